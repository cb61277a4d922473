"""Block-wide building blocks of the sampler: the 64-bit keys, and
reductions and scans in a fixed order (so every launch adds the same
numbers in the same order)."""

from __future__ import annotations

from ptxgen.types import f32, u32, u64
from ptxgen.values import Address

__all__ = ["Block", "ord_key", "key_value", "shfl64", "SharedView"]


class SharedView:
    """Elements of type ``elem`` from ``offset`` bytes into the shared
    array ``sym``: ``view[i]`` is an address, like a shared array's (a
    kernel has one dynamic array; views give it several uses)."""

    def __init__(self, k, sym, elem, offset: int = 0):
        self.k, self.elem, self.offset = k, elem, offset
        self.base = k.mov(sym)

    def __getitem__(self, i):
        size = self.elem.bytes
        if isinstance(i, int):
            return Address(self.base, self.offset + i * size, "shared", self.elem)
        base = self.base if self.base.type is i.type else self.base.bitcast(i.type)
        return Address(self.k.mad(i, size, base), self.offset, "shared", self.elem)


def ord_key(k, x, idx):
    """The u64 key ``(order(x) << 32) | ~idx`` of value ``x`` (f32) at index
    ``idx`` (u32): keys compare like the values, ties to the lower index;
    ``-0`` equals ``+0``; NaN gets order 0 (below ``-inf``)."""
    zero = x.eq(0.0)
    b = k.select(zero, k.mov(0, u32), x.bitcast(u32))
    neg = b >= 0x80000000
    o = k.select(neg, ~b, b | 0x80000000)
    o = k.select(k.setp("nan", x, x), k.mov(0, u32), o)
    return k.pack(u64, ~idx, o)


def key_value(k, key):
    """``(value f32, index u32)`` of a key made by :func:`ord_key`."""
    lo, o = k.unpack(key, u32, 2)
    pos = o >= 0x80000000
    bits = k.select(pos, o & 0x7FFFFFFF, ~o)
    return bits.bitcast(f32), ~lo


def shfl64(k, v, how, arg):
    """``shfl.sync`` of a 32- or 64-bit register (two shuffles for 64 bits)."""
    if v.type.bits == 64:
        lo, hi = k.unpack(v, u32, 2)
        return k.pack(v.type, k.shfl_sync(how, lo, arg), k.shfl_sync(how, hi, arg))
    return k.shfl_sync(how, v, arg)


class Block:
    """Helpers bound to one kernel: ``nthreads`` threads, ``tid``, and the
    small shared arrays they share (declared once per kernel)."""

    def __init__(self, k, nthreads: int):
        self.k = k
        self.n = nthreads
        self.warps = nthreads // 32
        self.tid = k.tid.x
        self.lane = self.tid & 31
        self.warp = self.tid >> 5
        self._red = k.shared_array("red_b64", u64, 32, align=8)
        self.bcast = k.shared_array("bcast", u64, 4, align=8)
        self.count = k.shared_array("warp_count", u32, 32, align=16)

    # ---------------------------------------------------------- reductions
    def _op(self, op, a, b):
        k = self.k
        if op == "add":
            return a + b
        return k.max(a, b) if op == "max" else k.min(a, b)

    def warp_reduce(self, v, op):
        for off in (16, 8, 4, 2, 1):
            v = self._op(op, v, shfl64(self.k, v, "bfly", off))
        return v

    def reduce(self, v, op, identity):
        """``op`` (add, max, min) of ``v`` over the block, the same in every
        thread: a butterfly within each warp, then the warp results in warp
        order.  Ends with a barrier, so it can be called again at once."""
        k = self.k
        ty = v.type
        v = self.warp_reduce(v, op)
        with k.if_(self.lane.eq(0)):
            k.st(self._red[self.warp], v if ty is u64 else v.bitcast(u64) if ty.bits == 64
                 else v.to(u64) if ty.is_int else k.pack(u64, v.bitcast(u32), k.mov(0, u32)))
        k.bar_sync(0)
        r = k.var(ty, identity)
        with k.if_(self.lane < self.warps):
            w = k.ld(self._red[self.lane])
            if ty.bits == 64:
                k.assign(r, w.bitcast(ty) if ty is not u64 else w)
            elif ty.is_int:
                k.assign(r, w.to(ty))
            else:
                k.assign(r, k.unpack(w, u32, 2)[0].bitcast(ty))
        r = self.warp_reduce(r, op)
        k.bar_sync(0)
        return r

    def warp_inclusive_scan(self, v):
        """Inclusive prefix sum over the lanes of a warp (``shfl.up``)."""
        k = self.k
        for off in (1, 2, 4, 8, 16):
            o = shfl64(k, v, "up", off)
            v = k.select(self.lane >= off, v + o, v)
        return v

    def exclusive_scan_into(self, v, arr):
        """Write the exclusive prefix sums of ``v`` (thread order) to
        ``arr[0..n)`` and the total to ``arr[n]`` (``arr`` shared, ``n + 1``
        entries of ``v``'s type); returns the total.  Ends with a barrier."""
        k = self.k
        ty = v.type
        inc = self.warp_inclusive_scan(v)
        with k.if_(self.lane.eq(31)):
            k.st(self._red[self.warp], inc if ty is u64 else inc.bitcast(u64))
        k.bar_sync(0)
        with k.if_(self.warp.eq(0)):
            wt = k.var(ty, 0 if ty.is_int else 0.0)
            with k.if_(self.lane < self.warps):
                w = k.ld(self._red[self.lane])
                k.assign(wt, w if ty is u64 else w.bitcast(ty))
            winc = self.warp_inclusive_scan(wt)
            with k.if_(self.lane < self.warps):
                k.st(self._red[self.lane], (winc - wt) if ty is u64 else (winc - wt).bitcast(u64))
            with k.if_(self.lane.eq(self.warps - 1)):
                k.st(arr[self.n], winc)
        k.bar_sync(0)
        base = k.ld(self._red[self.warp])
        base = base if ty is u64 else base.bitcast(ty)
        k.st(arr[self.tid], base + inc - v)
        k.bar_sync(0)
        return k.ld(arr[self.n])
