"""Warp-wide tensor-core instructions: ``mma.sync``, ``ldmatrix``, ``stmatrix``.

Each needs its whole warp (``.sync.aligned``): every lane of a warp that
executes it must execute it together, or it is a :class:`WarpSyncError`.

``mma.sync.aligned.<shape>.row.col`` gathers A, B and C of every warp from
the lanes' registers with the PTX ISA's fragment layouts (groupID = lane >> 2,
threadID_in_group = lane % 4; see :data:`MMA_LAYOUTS`), multiplies a batch of
warps with one numpy matmul and scatters D back.  Rounding: f16/bf16 products
are exact in float64 and the sum (K products plus C) is formed in float64,
then rounded once to f32 (round to nearest even).  The hardware instead
truncates the aligned partial sums; both stay within
``2**-21 * (|A|.|B| + |C|)`` of the exact result per instruction (docs/emulator.md).
s8/u8 products and sums are exact (int64); D wraps modulo 2**32, or with
``.satfinite`` clamps to the s32 range.

``ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16``: lane ``8i + r``
holds the address of row ``r`` of matrix ``i`` (16 bytes, 16-byte aligned);
lane ``l`` receives, in register ``i``, elements ``(l // 4, 2 (l % 4) + j)``,
j = 0, 1 (low half first) of matrix ``i``, or of its transpose with
``.trans``.  ``stmatrix`` is the inverse.  Both log their shared accesses
for the race check.
"""

from __future__ import annotations

import numpy as np

from ..isa import TABLE
from ..types import b32, f32, s32
from .errors import Fault, MemoryFault, WarpSyncError
from .memops import READ, WRITE, Access, shared_address
from .operands import Op, finish_op, getter, semantics, setter

__all__ = ["MMA_LAYOUTS", "whole_warps"]


def _layouts():
    lane = np.arange(32)[:, None]
    g, t = lane >> 2, lane % 4
    e8, e4, e2, e16 = (np.arange(n)[None, :] for n in (8, 4, 2, 16))
    c = (g + 8 * (e4 >= 2), 2 * t + (e4 & 1))
    k16 = ((g + 8 * ((e8 >> 1) & 1), 2 * t + (e8 & 1) + 8 * (e8 >= 4)),
           (2 * t + (e4 & 1) + 8 * (e4 >= 2), g + 0 * e4), c)
    k8 = ((g + 8 * (e4 >= 2), 2 * t + (e4 & 1)), (2 * t + e2, g + 0 * e2), c)
    r16, r8 = e16 >> 2, e8 >> 2
    k32 = ((g + 8 * (r16 & 1), 4 * t + (e16 & 3) + 16 * (r16 >> 1)),
           (4 * t + (e8 & 3) + 16 * r8, g + 0 * e8), c)
    return {"m16n8k16": k16, "m16n8k8": k8, "m16n8k32": k32}


#: shape -> (A, B, C) layouts: each (rows, cols) arrays of shape (32 lanes,
#: elements), element e of lane l at (rows[l, e], cols[l, e])
MMA_LAYOUTS = _layouts()
_K = {"m16n8k16": 16, "m16n8k8": 8, "m16n8k32": 32}


def whole_warps(st, m, what, width=32):
    """Raise unless every group of ``width`` threads (a warp, or a
    warpgroup) that has a thread in ``m`` executes with all its threads."""
    if st.block_threads % width:
        raise Fault(WarpSyncError, f"{what} needs whole {'warps' if width == 32 else 'warpgroups'}"
                    f" (block size a multiple of {width})", 0)
    if m is None:
        return
    full = m.reshape(-1, width)
    part = full.any(axis=1) & ~full.all(axis=1)
    if part.any():
        w = int(np.flatnonzero(part)[0])
        lane = int(np.flatnonzero(~full[w])[0])
        raise Fault(WarpSyncError, f"{what}: thread {lane} of {'warp' if width == 32 else 'warpgroup'}"
                    f" {w % (st.block_threads // width)} does not execute it with the rest",
                    w * width + lane)


def fragment_regs(gets, st, dtype=np.uint32):
    """The registers ``gets`` of every thread as an (n, len(gets)) array."""
    return np.stack([np.broadcast_to(np.asarray(g(st)), (st.n,)).astype(dtype, copy=False)
                     for g in gets], axis=1)


def elements(bits, kind):
    """The elements packed in (n, r) uint32 registers, low bits first:
    (n, 2r) float64 for f16/bf16, (n, 4r) int64 for s8/u8."""
    bits = np.ascontiguousarray(bits, dtype=np.uint32)
    if kind == "f16":
        return bits.view(np.float16).astype(np.float64)
    if kind == "bf16":
        h = bits.view(np.uint16).astype(np.uint32) << np.uint32(16)
        return h.view(np.float32).astype(np.float64)
    return bits.view(np.int8 if kind == "s8" else np.uint8).astype(np.int64)


def finish_int(d, satfinite):
    """int64 sums to s32: clamp with ``.satfinite``, else wrap."""
    if satfinite:
        return np.clip(d, -(1 << 31), (1 << 31) - 1).astype(np.int32)
    return d.astype(np.int64).astype(np.uint64).astype(np.uint32).view(np.int32)


@semantics("mma")
def _mma(stmt, ctx):
    dty, ta, tb, _ = stmt.types
    shape = next(m for m in stmt.mods if m in _K)
    fd, fa, fb, fc = stmt.operands
    (ar, ac), (br, bc), (cr, cc) = MMA_LAYOUTS[shape]
    counts = [4, ar.shape[1] * ta.bits // 32, br.shape[1] * tb.bits // 32, 4]
    if any(o[0] != "vec" for o in (fd, fa, fb, fc)) or [len(o[1]) for o in (fd, fa, fb, fc)] != counts:
        raise ctx.error(f"mma.{shape} takes vectors of {counts} registers (D, A, B, C)")
    integer = dty is s32
    acc_ty = s32 if integer else f32
    ga = [getter(ctx, o, b32) for o in fa[1]]
    gb = [getter(ctx, o, b32) for o in fb[1]]
    gc = [getter(ctx, o, acc_ty) for o in fc[1]]
    puts = [setter(ctx, o, acc_ty) for o in fd[1]]
    kk = _K[shape]
    sat = "satfinite" in stmt.mods

    def fn(st, m):
        whole_warps(st, m, "mma.sync.aligned")
        nw = st.n // 32
        av = elements(fragment_regs(ga, st), ta.name).reshape(nw, 32, -1)
        bv = elements(fragment_regs(gb, st), tb.name).reshape(nw, 32, -1)
        ct = np.int64 if integer else np.float64
        cv = fragment_regs(gc, st, ct).reshape(nw, 32, 4)
        A = np.zeros((nw, 16, kk), ct)
        B = np.zeros((nw, kk, 8), ct)
        C = np.zeros((nw, 16, 8), ct)
        A[:, ar, ac] = av
        B[:, br, bc] = bv
        C[:, cr, cc] = cv
        D = np.matmul(A, B) + C
        dv = D[:, cr, cc].reshape(st.n, 4)
        dv = finish_int(dv, sat) if integer else dv.astype(np.float32)
        for i, put in enumerate(puts):
            put(st, dv[:, i], m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE["mma"])


def _matrix_op(stmt, ctx, load):
    """ldmatrix (``load``) or stmatrix: the address lanes and the layout."""
    num = {"x1": 1, "x2": 2, "x4": 4}[next(x for x in stmt.mods if x in ("x1", "x2", "x4"))]
    trans = "trans" in stmt.mods
    vec_op, addr_op = (stmt.operands[0], stmt.operands[1]) if load else \
        (stmt.operands[1], stmt.operands[0])
    regs = vec_op[1] if vec_op[0] == "vec" else [vec_op]
    if len(regs) != num:
        raise ctx.error(f"{stmt.op}.x{num} takes {num} registers")
    get_addr, _ = shared_address(ctx, addr_op, "shared")
    op = Op()
    acc = Access("shared", 16, 1, stmt.op, op)
    lane = np.arange(32)
    # register i of lane l holds (row, col) = (l // 4, 2 (l % 4) + j) of matrix i
    row = np.repeat(lane // 4, 2)
    col = (2 * (lane % 4))[:, None] + np.arange(2)[None, :]
    if trans:
        row, col = col.reshape(-1), row
    else:
        col = col.reshape(-1)
    # element (lane, j) lives in row `row` at byte 2 * col of matrix i's row
    return num, regs, get_addr, op, acc, row, col * 2


def _row_offsets(st, m, get_addr, acc, num, kind):
    """(warps, num * 8) shared byte offsets of the matrices' rows, from the
    address lanes (lane 8i + r: row r of matrix i), bounds/alignment checked
    and logged for races."""
    tids = st.all_tids if m is None else np.flatnonzero(m)
    addr = np.broadcast_to(np.asarray(get_addr(st), dtype=np.uint64), (st.n,))
    nw = st.n // 32
    lanes = (np.arange(nw)[:, None] * 32 + np.arange(num * 8)[None, :]).reshape(-1)
    if m is not None:
        lanes = lanes[np.isin(lanes // 32, tids // 32)]
    a = addr[lanes]
    if (a % np.uint64(16)).any():
        j = int(np.flatnonzero(a % np.uint64(16))[0])
        raise Fault(MemoryFault, f"{acc.what}: row address 0x{int(a[j]):x} of lane "
                    f"{int(lanes[j]) % 32} is not 16-byte aligned", int(lanes[j]))
    (_, offs, _), = acc.parts(st, a, lanes, kind)
    return lanes, offs.reshape(-1, num * 8)


@semantics("ldmatrix")
def _ldmatrix(stmt, ctx):
    num, regs, get_addr, op, acc, row, cbyte = _matrix_op(stmt, ctx, True)
    puts = [setter(ctx, o, b32) for o in regs]

    def fn(st, m):
        whole_warps(st, m, "ldmatrix.sync.aligned")
        lanes, offs = _row_offsets(st, m, get_addr, acc, num, READ)
        warps = np.unique(lanes // 32)
        for i, put in enumerate(puts):
            base = offs[:, 8 * i:8 * i + 8]                       # (warps, 8 rows)
            byte = base[:, row] + cbyte.reshape(1, -1)            # (warps, 64)
            h = st.shared[byte] | (st.shared[byte + 1].astype(np.uint16) << 8)
            h = h.astype(np.uint32).reshape(-1, 32, 2)
            v = np.zeros((st.n // 32, 32), np.uint32)
            v[warps] = h[:, :, 0] | (h[:, :, 1] << np.uint32(16))
            put(st, v.reshape(-1), m)
    op.fn = fn
    return finish_op(op, stmt, ctx, TABLE["ldmatrix"])


@semantics("stmatrix")
def _stmatrix(stmt, ctx):
    num, regs, get_addr, op, acc, row, cbyte = _matrix_op(stmt, ctx, False)
    gets = [getter(ctx, o, b32) for o in regs]

    def fn(st, m):
        whole_warps(st, m, "stmatrix.sync.aligned")
        lanes, offs = _row_offsets(st, m, get_addr, acc, num, WRITE)
        warps = np.unique(lanes // 32)
        for i, g in enumerate(gets):
            v = np.broadcast_to(np.asarray(g(st), dtype=np.uint32), (st.n,))
            v = v.reshape(-1, 32)[warps]
            h = np.stack([v & np.uint32(0xFFFF), v >> np.uint32(16)], axis=2).reshape(len(warps), 64)
            byte = offs[:, 8 * i:8 * i + 8][:, row] + cbyte.reshape(1, -1)
            st.shared[byte] = (h & 0xFF).astype(np.uint8)
            st.shared[byte + 1] = (h >> 8).astype(np.uint8)
    op.fn = fn
    return finish_op(op, stmt, ctx, TABLE["stmatrix"])
