"""Block-wide building blocks of the sampler: reductions and scans in a
fixed order (so every launch adds the same numbers in the same order), a
bitonic sort of a shared array, and a radix select over shared keys."""

from __future__ import annotations

from ptxgen.types import f32, pred, u32, u64

__all__ = ["Block", "ord_key", "key_value"]


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


def _shfl(k, v, how, arg):
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

    # ---------------------------------------------------------- reductions
    def _op(self, op, a, b):
        k = self.k
        if op == "add":
            return a + b
        return k.max(a, b) if op == "max" else k.min(a, b)

    def warp_reduce(self, v, op):
        for off in (16, 8, 4, 2, 1):
            v = self._op(op, v, _shfl(self.k, v, "bfly", off))
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
            o = _shfl(k, v, "up", off)
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

    # ----------------------------------------------------------------- sort
    def bitonic_sort_desc(self, keys, count: int):
        """Sort ``keys[0..count)`` (u64, shared; ``count == 2 * nthreads``, a
        power of two) in descending order, one compare-exchange per thread
        per step, a barrier after each step."""
        k = self.k
        t = self.tid
        size = 2
        while size <= count:
            stride = size // 2
            while stride >= 1:
                i = ((t & ((~(stride - 1)) & 0xFFFFFFFF)) << 1) | (t & (stride - 1)) \
                    if stride > 1 else t << 1
                a = k.ld(keys[i])
                b = k.ld(keys[i + stride])
                if size < count:
                    up = (i & size).ne(0)          # an ascending run of this stage
                    swap = k.setp("lt", a, b, combine=("xor", up))
                else:
                    swap = a < b
                k.st(keys[i], k.select(swap, b, a))
                k.st(keys[i + stride], k.select(swap, a, b))
                k.bar_sync(0)
                stride //= 2
            size *= 2

    # --------------------------------------------------------------- select
    def radix_select(self, keys, nkeys, weight, need, floor, hist_w, hist_n):
        """The largest key ``c`` of ``keys[0..nkeys)`` (u64, shared) with
        ``sum(weight(key) for key >= c, key >= floor) >= need`` (u64; the
        caller makes sure the keys at or above ``floor`` weigh at least
        ``need``, and ``need >= 1``).  ``weight(key)`` gives a u64 register
        (1 for a plain k-th largest).  Byte by byte from the top with a
        256-bin histogram of weights and counts (``hist_w``, ``hist_n``:
        shared u64[256]); stops early once the chosen bin holds one key.
        Every thread gets the result."""
        k = self.k
        t = self.tid
        prefix = k.var(u64, 0)
        mask = k.var(u64, 0)
        rest = k.var(u64, 0)
        k.assign(rest, need)
        going = k.var(pred)
        k.setp("eq", self.lane, self.lane, out=going)          # true
        for d in range(8):
            shift = 56 - 8 * d
            with k.if_(going):
                for b in k.strided(t, 256, self.n):
                    k.st(hist_w[b], k.mov(0, u64))
                    k.st(hist_n[b], k.mov(0, u64))
                k.bar_sync(0)
                with k.for_range(t, nkeys, self.n) as i:
                    key = k.ld(keys[i])
                    hit = k.setp("eq", key & mask, prefix, combine=("and", key >= floor))
                    with k.if_(hit):
                        b = (key >> shift).to(u32) & 255
                        k.red("add", hist_w[b], weight(key))
                        k.red("add", hist_n[b], k.mov(1, u64))
                k.bar_sync(0)
                with k.if_(self.warp.eq(0)):
                    # lane l holds bins 255-8l .. 248-8l, highest first
                    top = 255 - (self.lane << 3)
                    ws = []
                    s = k.mov(0, u64)
                    for j in range(8):
                        w = k.ld(hist_w[top - j])
                        ws.append(w)
                        s = s + w
                    inc = self.warp_inclusive_scan(s)
                    exc = inc - s
                    mine = k.setp("lt", exc, rest, combine=("and", rest <= inc))
                    with k.if_(mine):
                        acc = k.var(u64, 0)
                        k.assign(acc, exc)
                        found = k.var(pred)
                        k.setp("ne", self.lane, self.lane, out=found)   # false
                        for j in range(8):
                            nxt = acc + ws[j]
                            take = k.setp("le", rest, nxt, combine=("and", ~found))
                            with k.if_(take):
                                k.st(self.bcast[0], (top - j).to(u64))
                                k.st(self.bcast[1], rest - acc)
                                k.st(self.bcast[2], k.ld(hist_n[top - j]))
                            k.assign(found, k.por(found, take))
                            k.assign(acc, nxt)
                k.bar_sync(0)
                digit = k.ld(self.bcast[0])
                k.assign(rest, k.ld(self.bcast[1]))
                prefix.set(prefix | (digit << shift))
                mask.set(mask | (0xFF << shift))
                k.setp("ne", k.ld(self.bcast[2]), 1, out=going)
                k.bar_sync(0)
        # the one key under the prefix (or the prefix itself after 8 bytes)
        best = k.var(u64, 0)
        with k.for_range(t, nkeys, self.n) as i:
            key = k.ld(keys[i])
            hit = k.setp("eq", key & mask, prefix, combine=("and", key >= floor))
            with k.if_(hit):
                k.max(best, key, out=best)
        return self.reduce(best, "max", 0)
