"""TMA: ``cp.async.bulk.tensor.{1..5}d.shared::cluster.global.tile.
mbarrier::complete_tx::bytes [dst], [map, {c0, ...}], [mbar]``.

The tensor map is a :class:`ptxgen.tensor_map.TensorMap` passed to the
launch (its emulator encoding, in a ``.param .align 64 .b8 name[128]``
parameter whose generic address the kernel takes with ``cvta.param``) or
128 bytes of global memory holding that encoding.  The copy reads the box
that starts at element coordinates ``c`` (s32, innermost first; they may
be negative) when it is issued: element ``(i0, i1, ...)`` of the box is
global element ``c + i``, or the map's fill (zero, or a NaN: all mantissa
bits set) when that lies outside the tensor.  In shared memory the box is
dense, innermost dimension fastest, starting at ``dst``; a swizzled map
(its box row exactly the swizzle's span) has each byte address swizzled
(:func:`ptxgen.smem_layout.swizzle`), so ``dst`` must start a swizzle
pattern (``8 * span`` bytes); otherwise it is 128-byte aligned.  The whole
box's bytes complete on the mbarrier, and the bytes land when a wait first
sees the mbarrier's phase complete, as for ``cp.async.bulk``
(:mod:`ptxgen.emu.memops`).
"""

from __future__ import annotations

import numpy as np

from ..isa import TABLE
from ..smem_layout import SWIZZLES, swizzle
from ..tensor_map import decode_emu_bytes
from ..types import type_by_name
from .errors import Fault, MemoryFault
from .memops import ATOMIC, addr_for, shared_address, mbar_offsets, active_threads, land_bulk_copy
from .memory import MEMORY, PARAM_WINDOW
from .operands import Op, finish_op, getter, semantics

__all__ = ["box_image"]

_NAN = {"f16": 0x7FFF, "bf16": 0x7FFF, "f32": 0x7FFFFFFF, "f64": 0x7FFFFFFFFFFFFFFF}


def _map_of(st, addr, t):
    a = int(addr)
    if PARAM_WINDOW <= a < PARAM_WINDOW + len(st.params):
        off = a - PARAM_WINDOW
        data = bytes(st.params[off:off + 128])
    else:
        try:
            (buf, offs, _), = MEMORY.locate(np.array([a], np.uint64), 128, "tensor map read")[0]
        except Fault as f:
            f.thread = t
            raise
        data = buf[int(offs[0]):int(offs[0]) + 128].tobytes()
    tm = decode_emu_bytes(data)
    if tm is None:
        raise Fault(MemoryFault, f"cp.async.bulk.tensor: the 128 bytes at 0x{a:x} are not a "
                    "tensor map (the emulator runs ptxgen.tensor_map.TensorMap; a driver "
                    "CUtensorMap is opaque to it)", t)
    return tm


def box_image(tm, coords, t=0):
    """The box of ``tm`` at ``coords`` as the bytes TMA writes (before the
    swizzle): a uint8 array of ``tm.box_bytes``."""
    size = tm.elem_bytes
    r = tm.rank
    idx = np.indices(tuple(reversed(tm.box))).reshape(r, -1)[::-1]   # innermost first
    g = idx.astype(np.int64) + np.array(coords, np.int64)[:, None]
    valid = np.all((g >= 0) & (g < np.array(tm.shape, np.int64)[:, None]), axis=0)
    steps = np.array((size,) + tm.strides, np.int64)[:, None]
    addr = tm.address + (np.where(valid, g, 0) * steps).sum(axis=0)
    out = np.zeros((idx.shape[1], size), np.uint8)
    if tm.oob_fill == "nan":
        out[:] = np.frombuffer(_NAN[tm.dtype].to_bytes(size, "little"), np.uint8)
    if valid.any():
        a = addr[valid].astype(np.uint64)
        try:
            parts, _ = MEMORY.locate(a, size, "cp.async.bulk.tensor read")
        except Fault as f:
            f.thread = t
            raise
        vals = np.zeros((a.size, size), np.uint8)
        for buf, offs, sel in parts:
            got = buf[offs[:, None] + np.arange(size)]
            if sel is None:
                vals[:] = got
            else:
                vals[sel] = got
        out[valid] = vals
    return out.reshape(-1)


@semantics("cp.async.bulk.tensor")
def _tma(stmt, ctx):
    rank = int(stmt.mods[0][:-1])
    if not {"shared::cluster", "global"} <= set(stmt.mods):
        raise ctx.error("cp.async.bulk.tensor: the emulator runs the global -> "
                        "shared::cluster form")
    get_dst, _ = shared_address(ctx, stmt.operands[0], "shared")
    tensor = stmt.operands[1]
    if tensor[0] != "tensor" or len(tensor[2]) != rank:
        raise ctx.error(f"cp.async.bulk.tensor.{rank}d takes [map, {{{rank} coordinates}}]")
    get_map = getter(ctx, tensor[1], type_by_name("u64"))
    get_c = [getter(ctx, o, type_by_name("s32")) for o in tensor[2]]
    get_bar, bar_acc = mbar_offsets(ctx, stmt.operands[2], "cp.async.bulk.tensor")
    op = Op()
    bar_acc.op = op

    def fn(st, m):
        tids = active_threads(st, m)
        if tids.size == 0:
            return
        dst = addr_for(get_dst, st, tids, m)
        maps = addr_for(get_map, st, tids, m)
        cs = [np.broadcast_to(np.asarray(g(st)), (st.n,)) for g in get_c]
        (_, boffs, _), = bar_acc.parts(st, addr_for(get_bar, st, tids, m), tids, ATOMIC)
        for j in range(tids.size):
            t = int(tids[j])
            tm = _map_of(st, maps[j], t)
            if tm.rank != rank:
                raise Fault(MemoryFault, f"cp.async.bulk.tensor.{rank}d with a "
                            f"{tm.rank}-dimensional tensor map", t)
            d = int(dst[j])
            nb = tm.box_bytes
            align = 128 if tm.swizzle == "none" else 8 * SWIZZLES[tm.swizzle]
            if d % align:
                raise Fault(MemoryFault, f"cp.async.bulk.tensor to shared offset {d}: a "
                            f"{tm.swizzle}-swizzled box starts on a {align}-byte boundary", t)
            if d + nb > st.shared_size:
                raise Fault(MemoryFault, f"cp.async.bulk.tensor box of {nb} bytes at shared "
                            f"offset {d} runs past the block's {st.shared_size} bytes", t)
            data = box_image(tm, [int(c[t]) for c in cs], t)
            if tm.swizzle != "none":
                img = np.empty_like(data)
                img[swizzle(d + np.arange(nb), tm.swizzle) - d] = data
                data = img
            land_bulk_copy(st, op, tids[j:j + 1], t, d, data, nb, boffs[j],
                           "cp.async.bulk.tensor")
    op.fn = fn
    return finish_op(op, stmt, ctx, TABLE["cp.async.bulk.tensor"])
