"""Warp-level and control instructions: ``shfl.sync``, ``vote.sync``,
``bar``, ``membar``/``fence``, ``griddepcontrol``, ``nanosleep``, ``bra``,
``ret``/``exit``.  (``griddepcontrol`` is a no-op here: the emulator runs
launches one after another, so a grid's predecessors are always complete.)

``shfl.sync`` and ``vote.sync`` need every non-exited lane named in the
member mask to execute the same instruction together with the thread
(min-PC scheduling converges them when control flow allows); a lane that is
named but elsewhere, a thread not in its own mask, or a shuffle that reads
a lane not taking part, is a :class:`WarpSyncError`.  (The tensor-core
instructions are in :mod:`ptxgen.emu.mma` and :mod:`ptxgen.emu.wgmma`.)

``barrier.cluster.arrive`` counts the thread's arrival for the current
phase (a second arrival before the wait is a :class:`BarrierError`);
``barrier.cluster.wait`` parks the thread until every non-exited thread of
its cluster waits at the same instruction (see :mod:`ptxgen.emu.executor`).

``shfl`` follows the PTX ISA pseudocode (``c`` packs the clamp value in
bits 0-4 and the segment mask in bits 8-12).
"""

from __future__ import annotations

import numpy as np

from ..isa import TABLE
from ..types import b32, pred, u32
from .errors import BarrierError, Fault, UninitializedRegister, WarpSyncError
from .operands import BAR, BRA, CBAR, EXIT, YIELD, Op, finish_op, getter, semantics, setter

__all__ = ["check_members"]


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
    # memory is sequentially consistent here; a fence between CTAs counts for
    # the global race check (global_races) only
    orders = ((stmt.op == "membar" and "cta" not in stmt.mods)
              or (stmt.op == "fence" and "cta" not in stmt.mods))

    def fn(st, m):
        if orders and st.gsync is not None:
            st.gsync.fence(st.blk if m is None else st.blk[m])
    return finish_op(Op(fn=fn), stmt, ctx, TABLE[stmt.op])


@semantics("nanosleep")
def _nanosleep(stmt, ctx):
    # kind YIELD: the executor parks the threads and runs the others first
    # (ptxgen.emu.executor, "Spin-waits"); the duration is not read
    return finish_op(Op(kind=YIELD), stmt, ctx, TABLE["nanosleep"])


@semantics("bra")
def _bra(stmt, ctx):
    op = Op(kind=BRA)
    op.target = ctx.kt.labels[stmt.operands[0][1]]
    op.extra = "uni" if "uni" in stmt.mods else None
    return finish_op(op, stmt, ctx, TABLE["bra"])


@semantics("ret", "exit")
def _exit(stmt, ctx):
    return finish_op(Op(kind=EXIT), stmt, ctx, TABLE[stmt.op])
