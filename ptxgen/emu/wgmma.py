"""Warpgroup tensor-core instructions (sm_90a): ``wgmma.mma_async``,
``wgmma.fence``, ``wgmma.commit_group``, ``wgmma.wait_group``.

A warpgroup is 4 consecutive warps (threads 128w .. 128w + 127 of a block);
every instruction here needs all 128 threads together (``.sync.aligned``).

``wgmma.mma_async.m64nNkK``: D (64 x N) = A (64 x K) . B (K x N) + D, or
without the old D when the ``scale-d`` predicate is false; A and B are
negated by ``imm-scale-a/b = -1``.  A comes from registers (warp w holds rows
16w .. 16w + 15 in the ``mma.m16n8k16``/``m16n8k32`` A layout) or, like B,
from shared memory through a matrix descriptor (:mod:`ptxgen.smem_layout`):
element (i, j) of a K-major operand (i the M or N index, j the K index,
``T = 16 / element bytes``) is at byte::

    no swizzle:  (i % 8) * 16 + (i // 8) * SBO + (j // T) * LBO + (j % T) * size
    S-byte swz:  (i % 8) * S  + (i // 8) * SBO + (j // T) * 16  + (j % T) * size

and of an MN-major one (``imm-trans-a/b = 1``; ``C = S / 16``)::

    no swizzle:  (i % T) * size + (i // T) * SBO + (j % 8) * 16 + (j // 8) * LBO
    S-byte swz:  (i % T) * size + (i // T % C) * 16 + (i // (T C)) * LBO
                 + (j % 8) * S + (j // 8) * SBO

from the descriptor's start address, then swizzled as a shared byte address
(:func:`ptxgen.smem_layout.swizzle`): the PTX ISA's canonical layouts
("Shared Memory Matrix Layout"), with its swizzles acting on address bits.
A descriptor with a non-zero matrix base offset is refused.  Accumulator
register ``i`` of thread ``l`` of warp ``w`` holds D's row ``16w + g +
8 ((i >> 1) & 1)``, column ``8 (i >> 2) + 2t + (i & 1)`` (g = l >> 2,
t = l % 4).  Rounding as for ``mma.sync`` (:mod:`ptxgen.emu.mma`).

Asynchrony: the operation reads shared memory and writes the accumulators
when it is issued, but its accumulator registers stay *pending* until a
``wgmma.wait_group`` retires its group: any other instruction that reads or
writes one of them before then is a :class:`WarpSyncError` (the hardware's
result would be undefined).  Groups count per thread as for ``cp.async``.
``wgmma.fence`` is accepted and not checked; the shared-memory reads are not
race-checked.
"""

from __future__ import annotations

import numpy as np

from ..isa import TABLE
from ..smem_layout import SWIZZLES, decode_descriptor, swizzle
from ..types import b32, b64, pred, s32
from .errors import Fault, MemoryFault, UninitializedRegister, UnsupportedError, WarpSyncError
from .mma import MMA_LAYOUTS, fragment_regs, elements, finish_int, whole_warps
from .operands import Op, finish_op, getter, semantics

__all__ = ["descriptor_offsets", "ASYNC"]

#: ``Op.extra`` of the wgmma instructions: the executor lets them touch
#: pending accumulators
ASYNC = "wgmma"


def descriptor_offsets(desc: int, mn: int, kk: int, size: int, kmajor: bool):
    """Shared byte addresses (mn x kk) of a wgmma operand described by ``desc``."""
    f = decode_descriptor(desc)
    if f["base_offset"]:
        raise UnsupportedError(f"wgmma: a matrix descriptor with base offset "
                               f"{f['base_offset']} (the emulator takes swizzled matrices "
                               f"that start on their pattern's boundary)")
    mode, lbo, sbo = f["swizzle"], f["lbo"], f["sbo"]
    t = 16 // size
    i = np.arange(mn)[:, None]
    j = np.arange(kk)[None, :]
    s = SWIZZLES[mode]
    if kmajor:
        if mode == "none":
            off = (i % 8) * 16 + (i // 8) * sbo + (j // t) * lbo + (j % t) * size
        else:
            off = (i % 8) * s + (i // 8) * sbo + (j // t) * 16 + (j % t) * size
    elif mode == "none":
        off = (i % t) * size + (i // t) * sbo + (j % 8) * 16 + (j // 8) * lbo
    else:
        c = s // 16
        off = ((i % t) * size + (i // t % c) * 16 + (i // (t * c)) * lbo
               + (j % 8) * s + (j // 8) * sbo)
    return swizzle(f["start"] + off, mode)


def _d_layout(n):
    """(rows, cols) of accumulator register i of warpgroup thread l: (128, n/2)."""
    tid = np.arange(128)[:, None]
    w, lane = tid // 32, tid % 32
    g, t = lane >> 2, lane % 4
    i = np.arange(n // 2)[None, :]
    return 16 * w + g + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * t + (i & 1)


def _uniform(vals, what, st):
    """One value per warpgroup (n/128, ...) after checking they agree."""
    v = np.broadcast_to(np.asarray(vals), (st.n,)).reshape(-1, 128)
    bad = (v != v[:, :1]).any(axis=1)
    if bad.any():
        w = int(np.flatnonzero(bad)[0])
        raise Fault(WarpSyncError, f"wgmma.mma_async: the {what} differs between the threads "
                    f"of a warpgroup", w * 128 + int(np.flatnonzero(v[w] != v[w, 0])[0]))
    return v[:, 0]


def _read(st, wg, addrs, kind, size):
    """Elements of ``kind`` at shared byte addresses ``addrs`` of warpgroup
    ``wg``'s block."""
    if addrs.min() < 0 or addrs.max() + size > st.shared_size:
        raise Fault(MemoryFault, f"wgmma.mma_async reads shared bytes {int(addrs.min())}.."
                    f"{int(addrs.max()) + size - 1}, outside the block's {st.shared_size}",
                    wg * 128)
    base = 0 if st.shared_base is None else int(st.shared_base[wg * 128])
    a = addrs + base
    if size == 1:
        raw = st.shared[a]
        return raw.view(np.int8).astype(np.int64) if kind == "s8" else raw.astype(np.int64)
    bits = st.shared[a].astype(np.uint32) | (st.shared[a + 1].astype(np.uint32) << 8)
    if kind == "f16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float64)
    return (bits << np.uint32(16)).view(np.float32).astype(np.float64)


@semantics("wgmma.mma_async")
def _mma_async(stmt, ctx):
    dty, ta, tb = stmt.types
    shape = next(m for m in stmt.mods if m.startswith("m64n"))
    n, kk = (int(x) for x in shape[4:].split("k"))
    ops = stmt.operands
    integer = dty is s32
    if (ta.name in ("s8", "u8")) != integer or ta.bits != tb.bits:
        raise ctx.error(f"wgmma.mma_async.{dty.name}.{ta.name}.{tb.name} is not a form the "
                        "emulator runs")
    dv = ops[0]
    if dv[0] != "vec" or len(dv[1]) != n // 2:
        raise ctx.error(f"wgmma.mma_async.{shape} takes {n // 2} accumulator registers")
    acc_idx = [ctx.reg(o[1]) for o in dv[1]]
    a_regs = ops[1][0] == "vec"
    ga = [getter(ctx, o, b32) for o in ops[1][1]] if a_regs else getter(ctx, ops[1], b64)
    gb = getter(ctx, ops[2], b64)
    gscale = getter(ctx, ops[3], pred)
    imms = [o[2] for o in ops[4:]]
    if any(o[0] != "imm" for o in ops[4:]):
        raise ctx.error("wgmma.mma_async: the scale and transpose operands are constants")
    need = 0 if integer else (3 if a_regs else 4)
    if len(imms) != need:
        raise ctx.error(f"wgmma.mma_async.{dty.name}.{ta.name} takes {need} constants after "
                        f"scale-d, got {len(imms)}")
    sa, sb = (imms[0], imms[1]) if need else (1, 1)
    trans_a = bool(imms[2]) if need == 4 else False
    trans_b = bool(imms[-1]) if need else False
    sat = "satfinite" in stmt.mods
    rows, cols = _d_layout(n)
    size = ta.bits // 8
    a_layout = MMA_LAYOUTS["m16n8k32" if integer else "m16n8k16"][0]
    nat = np.int32 if integer else np.float32
    ct = np.int64 if integer else np.float64
    names = {v: k for k, v in ctx.reg_index.items()}

    def fn(st, m):
        whole_warps(st, m, "wgmma.mma_async", 128)
        nwg = st.n // 128
        on = np.ones(nwg, bool) if m is None else m.reshape(-1, 128).any(axis=1)
        scale = _uniform(gscale(st), "scale-d predicate", st)
        bdesc = _uniform(gb(st), "B descriptor", st)
        adesc = None if a_regs else _uniform(ga(st), "A descriptor", st)
        ex = st.full_mask if m is None else m
        use_d = np.repeat(scale, 128) & ex
        for r in acc_idx:
            w = st.written[r]
            if w is not None and (use_d & ~w).any():
                raise Fault(UninitializedRegister, f"wgmma.mma_async accumulates into "
                            f"{names[r]}, which no path has written (pass "
                            "scale_d=False for the first product)",
                            int(np.flatnonzero(use_d & ~w)[0]))
        old = np.stack([st.regs[r].view(nat) for r in acc_idx], axis=1).astype(ct)
        old = old.reshape(nwg, 128, -1)
        if a_regs:
            av = elements(fragment_regs(ga, st), ta.name).reshape(nwg, 4, 32, -1)
        new = old.copy()
        for wg in np.flatnonzero(on):
            if a_regs:
                A = np.zeros((64, kk), ct)
                for w in range(4):
                    A[16 * w + a_layout[0], a_layout[1]] = av[wg, w]
            else:
                A = _read(st, wg, descriptor_offsets(int(adesc[wg]), 64, kk, size, not trans_a),
                          ta.name, size)
            BT = _read(st, wg, descriptor_offsets(int(bdesc[wg]), n, kk, size, not trans_b),
                       tb.name, size)
            D = np.matmul(A, BT.T) * (sa * sb)
            if scale[wg]:
                C = np.zeros((64, n), ct)
                C[rows, cols] = old[wg]
                D = D + C
            new[wg] = D[rows, cols]
        new = new.reshape(st.n, -1)
        new = finish_int(new, sat) if integer else new.astype(np.float32)
        group = st.wg_committed
        for i, r in enumerate(acc_idx):
            v = new[:, i].view(np.uint32)
            st.regs[r] = v if m is None else np.where(m, v, st.regs[r])
            p = st.wg_pending.get(r)
            if p is None:
                st.wg_pending[r] = (ex.copy(), np.where(ex, group, -1))
            else:
                p[0][ex] = True
                p[1][ex] = group[ex]
    op = finish_op(Op(fn=fn), stmt, ctx, TABLE["wgmma.mma_async"])
    op.extra = ASYNC
    return op


@semantics("wgmma.fence")
def _fence(stmt, ctx):
    def fn(st, m):
        whole_warps(st, m, "wgmma.fence", 128)
    op = finish_op(Op(fn=fn), stmt, ctx, TABLE[stmt.op])
    op.extra = ASYNC
    return op


@semantics("wgmma.commit_group")
def _commit(stmt, ctx):
    def fn(st, m):
        whole_warps(st, m, "wgmma.commit_group", 128)
        st.wg_committed = st.wg_committed + (1 if m is None else m)
    op = finish_op(Op(fn=fn), stmt, ctx, TABLE[stmt.op])
    op.extra = ASYNC
    return op


@semantics("wgmma.wait_group")
def _wait(stmt, ctx):
    o = stmt.operands[0]
    if o[0] != "imm":
        raise ctx.error("wgmma.wait_group takes a constant")
    keep = int(o[2])

    def fn(st, m):
        whole_warps(st, m, "wgmma.wait_group", 128)
        ex = st.full_mask if m is None else m
        for r in list(st.wg_pending):
            mask, group = st.wg_pending[r]
            done = ex & mask & (group < st.wg_committed - keep)
            mask &= ~done
            if not mask.any():
                del st.wg_pending[r]
    op = finish_op(Op(fn=fn), stmt, ctx, TABLE[stmt.op])
    op.extra = ASYNC
    return op


def check_pending(op, st, m, reg_names):
    """Raise if ``op`` touches an accumulator of a wgmma still in flight."""
    for r in op.reads + op.writes:
        p = st.wg_pending.get(r)
        if p is None:
            continue
        bad = p[0] if m is None else p[0] & m
        if bad.any():
            raise Fault(WarpSyncError, f"{reg_names[r]} is an accumulator of a "
                        "wgmma.mma_async still in flight: wgmma.commit_group and "
                        "wgmma.wait_group before touching it", int(np.flatnonzero(bad)[0]))

