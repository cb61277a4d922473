"""Warp-level and control instructions: ``shfl.sync``, ``vote.sync``,
``mma.sync``, ``bar``, ``membar``/``fence``, ``griddepcontrol``, ``bra``,
``ret``/``exit``.  (``griddepcontrol`` is a no-op here: the emulator runs
launches one after another, so a grid's predecessors are always complete.)

``shfl.sync`` and ``vote.sync`` need every non-exited lane named in the
member mask to execute the same instruction together with the thread
(min-PC scheduling converges them when control flow allows); a lane that is
named but elsewhere, a thread not in its own mask, or a shuffle that reads
a lane not taking part, is a :class:`WarpSyncError`.  ``mma.sync.aligned``
needs the whole warp.

``barrier.cluster.arrive`` counts the thread's arrival for the current
phase (a second arrival before the wait is a :class:`BarrierError`);
``barrier.cluster.wait`` parks the thread until every non-exited thread of
its cluster waits at the same instruction (see :mod:`ptxgen.emu.executor`).

``shfl`` follows the PTX ISA pseudocode (``c`` packs the clamp value in
bits 0-4 and the segment mask in bits 8-12).  ``mma.m16n8k16.row.col``
gathers A (16x16), B (16x8) and C (16x8) from the lanes with the ISA's
fragment layout (groupID = lane >> 2, threadID_in_group = lane % 4),
multiplies exactly in float64 and rounds D once to f32.
"""

from __future__ import annotations

import numpy as np

from ..isa import TABLE
from ..types import b32, f32, pred, u32
from .errors import BarrierError, Fault, UninitializedRegister, WarpSyncError
from .floatops import decode
from .operands import BAR, BRA, CBAR, EXIT, Op, finish_op, getter, semantics, setter

__all__ = ["A_LAYOUT", "B_LAYOUT", "C_LAYOUT"]


def _layouts():
    lane = np.arange(32)
    g, t = lane >> 2, lane % 4
    a_r = np.stack([g + 8 * ((i // 2) % 2) for i in range(8)], axis=1)
    a_c = np.stack([2 * t + (i & 1) + 8 * (i >= 4) for i in range(8)], axis=1)
    b_r = np.stack([2 * t + (i & 1) + 8 * (i >= 2) for i in range(4)], axis=1)
    b_c = np.stack([g for _ in range(4)], axis=1)
    c_r = np.stack([g + 8 * (i >= 2) for i in range(4)], axis=1)
    c_c = np.stack([2 * t + (i & 1) for i in range(4)], axis=1)
    return (a_r, a_c), (b_r, b_c), (c_r, c_c)


#: (rows, cols) of element i held by lane l: arrays of shape (32, elements)
A_LAYOUT, B_LAYOUT, C_LAYOUT = _layouts()


def _warp_bits(st, mask):
    """Per-warp bitmask of the lanes where ``mask`` holds."""
    return np.bitwise_or.reduceat(np.where(mask, st.lanebit, np.uint32(0)), st.warp_starts)


def check_members(st, m, membermask, what):
    """Validate the member mask for the executing threads ``m``; returns the
    per-warp executing bitmask."""
    ex = st.full_mask if m is None else m
    ex_bits = _warp_bits(st, ex)
    if m is None and st.uniform_warps and np.all(np.asarray(membermask) == 0xFFFFFFFF):
        return ex_bits
    alive = _warp_bits(st, ~st.exited)
    mm = np.broadcast_to(np.asarray(membermask, dtype=np.uint32), (st.n,))
    w = st.warp
    need = mm & alive[w]
    bad_self = ex & ((mm & st.lanebit) == 0)
    missing = ex & ((ex_bits[w] & need) != need)
    bad = bad_self | missing
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        if bad_self[j]:
            msg = f"{what}: thread's own lane {int(st.lane[j])} is not in membermask 0x{int(mm[j]):08x}"
        else:
            lanes = [i for i in range(32) if (int(need[j]) >> i) & 1 and not (int(ex_bits[w[j]]) >> i) & 1]
            msg = (f"{what}: lanes {lanes} of membermask 0x{int(mm[j]):08x} are not converged "
                   f"at this instruction")
        raise Fault(WarpSyncError, msg, j)
    return ex_bits


@semantics("shfl")
def _shfl(stmt, ctx):
    mode = stmt.mods[1]
    ops = stmt.operands
    put = setter(ctx, ops[0], b32)
    a = getter(ctx, ops[1], b32)
    b, c, mk = (getter(ctx, o, u32) for o in ops[2:5])
    a_reg = ctx.reg(ops[1][1]) if ops[1][0] == "reg" else None

    def fn(st, m):
        ex_bits = check_members(st, m, mk(st), "shfl.sync")
        lane = st.lane.astype(np.int64)
        bval = np.asarray(b(st), dtype=np.int64) & 31
        cv = np.asarray(c(st), dtype=np.int64)
        cval, seg = cv & 31, (cv >> 8) & 31
        max_lane = (lane & seg) | (cval & ~seg)
        min_lane = lane & seg
        if mode == "up":
            j = lane - bval
            ok = j >= max_lane
        elif mode == "down":
            j = lane + bval
            ok = j <= max_lane
        elif mode == "bfly":
            j = lane ^ bval
            ok = j <= max_lane
        else:
            j = min_lane | (bval & ~seg)
            ok = j <= max_lane
        j = np.where(ok, j, lane)
        src = st.warp_base + j
        ex = st.full_mask if m is None else m
        valid = (src < st.warp_end) & ((ex_bits[st.warp] >> j.astype(np.uint32)) & 1).astype(bool)
        bad = ex & ~valid
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise Fault(WarpSyncError, f"shfl.sync reads lane {int(j[k])}, which does not "
                        "take part in this shfl (result undefined)", k)
        src = np.where(valid, src, st.all_tids)
        if a_reg is not None and st.written[a_reg] is not None:
            unw = ex & ~st.written[a_reg][src]
            if unw.any():
                k = int(np.flatnonzero(unw)[0])
                raise Fault(UninitializedRegister, f"shfl.sync reads {ops[1][1]} of lane "
                            f"{int(j[k])}, which no path has written", k)
        val = np.broadcast_to(np.asarray(a(st)), (st.n,))
        put(st, val[src], m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE["shfl"])


@semantics("vote")
def _vote(stmt, ctx):
    mode = stmt.mods[1]
    ops = stmt.operands
    ty = stmt.types[0]
    p = getter(ctx, ops[1], pred)
    mk = getter(ctx, ops[2], u32)
    put = setter(ctx, ops[0], u32 if mode == "ballot" else pred)
    if mode == "ballot" and ty is not b32 or mode != "ballot" and ty is not pred:
        raise ctx.error(f"vote.{mode} takes .{'b32' if mode == 'ballot' else 'pred'}")

    def fn(st, m):
        check_members(st, m, mk(st), "vote.sync")
        ex = st.full_mask if m is None else m
        mm = np.broadcast_to(np.asarray(mk(st), dtype=np.uint32), (st.n,))
        pv = np.broadcast_to(np.asarray(p(st), dtype=bool), (st.n,))
        true_bits = _warp_bits(st, ex & pv)[st.warp] & mm
        part = _warp_bits(st, ex)[st.warp] & mm
        if mode == "ballot":
            r = true_bits
        elif mode == "all":
            r = true_bits == part
        elif mode == "any":
            r = true_bits != 0
        else:
            r = (true_bits == part) | (true_bits == 0)
        put(st, r, m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE["vote"])


@semantics("mma")
def _mma(stmt, ctx):
    _, ta, tb, _ = stmt.types
    fd, fa, fb, fc = stmt.operands
    if any(o[0] != "vec" for o in (fd, fa, fb, fc)) or \
            [len(o[1]) for o in (fd, fa, fb, fc)] != [4, 4, 2, 4]:
        raise ctx.error("mma.m16n8k16 takes {4 x f32}, {4 x b32}, {2 x b32}, {4 x f32}")
    ga = [getter(ctx, o, b32) for o in fa[1]]
    gb = [getter(ctx, o, b32) for o in fb[1]]
    gc = [getter(ctx, o, f32) for o in fc[1]]
    puts = [setter(ctx, o, f32) for o in fd[1]]
    hty = {"f16": "f16x2", "bf16": "bf16x2"}
    from ..types import type_by_name
    pa, pb = type_by_name(hty[ta.name]), type_by_name(hty[tb.name])

    def elems(gets, ty, st):
        out = []
        for g in gets:
            lo, hi = decode(np.broadcast_to(np.asarray(g(st)), (st.n,)), ty)
            out += [lo, hi]
        return np.stack(out, axis=1)     # (n, elements)

    def fn(st, m):
        ex = st.full_mask if m is None else m
        if st.block_threads % 32:
            raise Fault(WarpSyncError, "mma.sync needs whole warps (block size a multiple of 32)", 0)
        full = ex.reshape(-1, 32)
        part = full.any(axis=1)
        if (part & ~full.all(axis=1)).any():
            w = int(np.flatnonzero(part & ~full.all(axis=1))[0])
            lane = int(np.flatnonzero(~full[w])[0])
            raise Fault(WarpSyncError, f"mma.sync.aligned: lane {lane} of warp "
                        f"{w % (st.block_threads // 32)} does not "
                        "execute it with the rest of the warp", w * 32 + lane)
        nw = st.n // 32
        av = elems(ga, pa, st).reshape(nw, 32, 8)
        bv = elems(gb, pb, st).reshape(nw, 32, 4)
        cv = np.stack([np.broadcast_to(np.asarray(g(st), dtype=np.float64), (st.n,))
                       for g in gc], axis=1).reshape(nw, 32, 4)
        A = np.zeros((nw, 16, 16))
        B = np.zeros((nw, 16, 8))
        C = np.zeros((nw, 16, 8))
        A[:, A_LAYOUT[0], A_LAYOUT[1]] = av
        B[:, B_LAYOUT[0], B_LAYOUT[1]] = bv
        C[:, C_LAYOUT[0], C_LAYOUT[1]] = cv
        D = (np.matmul(A, B) + C).astype(np.float32)
        dv = D[:, C_LAYOUT[0], C_LAYOUT[1]].reshape(st.n, 4)
        for i, put in enumerate(puts):
            put(st, dv[:, i], m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE["mma"])


@semantics("bar")
def _bar(stmt, ctx):
    if "sync" not in stmt.mods and "arrive" not in stmt.mods:
        raise ctx.error("bar.red is not supported by the emulator")
    ops = stmt.operands
    op = Op(kind=BAR)
    bid = getter(ctx, ops[0], u32) if ops else (lambda st: np.uint32(0))
    cnt = getter(ctx, ops[1], u32) if len(ops) > 1 else None
    op.extra = (bid, cnt, "arrive" in stmt.mods)
    return finish_op(op, stmt, ctx, TABLE["bar"])


@semantics("barrier.cluster.arrive")
def _cluster_arrive(stmt, ctx):
    # an arrival counts once per phase; barrier.cluster.wait (kind CBAR, run
    # by the executor) consumes it
    def fn(st, m):
        twice = st.cl_arrived > st.cl_waited
        if m is not None:
            twice &= m
        if twice.any():
            raise Fault(BarrierError, "barrier.cluster.arrive a second time before its "
                        "barrier.cluster.wait", int(np.flatnonzero(twice)[0]))
        st.cl_arrived = st.cl_arrived + (1 if m is None else m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE[stmt.op])


@semantics("barrier.cluster.wait")
def _cluster_wait(stmt, ctx):
    return finish_op(Op(kind=CBAR), stmt, ctx, TABLE[stmt.op])


@semantics("membar", "fence", "fence.mbarrier_init", "fence.proxy.async", "griddepcontrol")
def _fence(stmt, ctx):
    def fn(st, m):
        return None
    return finish_op(Op(fn=fn), stmt, ctx, TABLE[stmt.op])


@semantics("bra")
def _bra(stmt, ctx):
    op = Op(kind=BRA)
    op.target = ctx.kt.labels[stmt.operands[0][1]]
    return finish_op(op, stmt, ctx, TABLE["bra"])


@semantics("ret", "exit")
def _exit(stmt, ctx):
    return finish_op(Op(kind=EXIT), stmt, ctx, TABLE[stmt.op])
