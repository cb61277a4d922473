"""A weighted radix select over keys in shared memory, for cuts that lie
below the merged top list (top-k past ``L``, top-p sets of more than ``L``
tokens).

The search runs over a key range ``[lo, hi]``: the bits above the highest
bit where ``lo`` and ``hi`` differ are known, so the first digit starts
there (keys of similar logits share their sign and exponent, and a digit
over those bits would put nearly every key in one bin).  Each digit of up
to 8 bits takes a 256-bin histogram: counts by a native 32-bit shared
``red.add``, and 64-bit weights as two 32-bit halves, the low half by
``atom.add`` whose old value gives the carry into the high half (exact:
every wrap of the low word adds its carry; a 64-bit shared add would be a
compare-and-swap loop on the GPU).
"""

from __future__ import annotations

from ptxgen.types import pred, u32, u64

__all__ = ["radix_select"]


def radix_select(k, blk, keys, nkeys, weight, need, lo, hi, hist_lo, hist_hi, hist_n):
    """The largest key ``c`` of ``keys[0 .. nkeys)`` (u64, shared) with
    ``sum(weight(key) for c <= key <= hi) >= need``, among keys in
    ``[lo, hi]`` (the caller makes sure those weigh at least ``need >= 1``).
    ``weight(key)`` gives a u64 register, or ``weight`` is None: every key
    weighs 1 (the ``need``-th largest key).  ``hist_*``: shared u32[256].
    Every thread gets the result; ends with a barrier."""
    t = blk.tid
    nthr = blk.n
    nbits = 64 - k.clz(lo ^ hi)                      # the low bits that vary
    mask = k.var(u64, 0)
    k.assign(mask, k.shl(k.mov(0xFFFFFFFFFFFFFFFF, u64), nbits))
    prefix = k.var(u64, 0)
    k.assign(prefix, hi & mask)
    rest = k.var(u64, 0)
    k.assign(rest, need)
    going = k.var(pred)
    k.setp("gt", nbits, 0, out=going)
    counts_only = weight is None
    for d in range(8):
        with k.if_(going):
            left = nbits - 8 * d
            width = k.min(left, 8)
            shift = left - width
            wmask = (k.shl(k.mov(1, u32), width) - 1)
            for b in k.strided(t, 256, nthr):
                k.st(hist_n[b], k.mov(0, u32))
                if not counts_only:
                    k.st(hist_lo[b], k.mov(0, u32))
                    k.st(hist_hi[b], k.mov(0, u32))
            k.bar_sync(0)
            with k.for_range(t, nkeys, nthr) as i:
                key = k.ld(keys[i])
                hit = k.setp("eq", key & mask, prefix, combine=("and", key >= lo))
                hit = k.setp("le", key, hi, combine=("and", hit))
                with k.if_(hit):
                    b = k.shr(key, shift).to(u32) & wmask
                    k.red("add", hist_n[b], k.mov(1, u32))
                    if not counts_only:
                        wl, wh = k.unpack(weight(key), u32, 2)
                        old = k.atom("add", hist_lo[b], wl)
                        carry = k.select(k.setp("lt", old + wl, old), k.mov(1, u32),
                                         k.mov(0, u32))
                        k.red("add", hist_hi[b], wh + carry)
            k.bar_sync(0)
            _pick_bin(k, blk, hist_lo, hist_hi, hist_n, rest, counts_only)
            k.bar_sync(0)
            digit = k.ld(blk.bcast[0])
            k.assign(rest, k.ld(blk.bcast[1]))
            prefix.set(prefix | k.shl(digit, shift))
            mask.set(mask | k.shl(wmask.to(u64), shift))
            one = k.setp("eq", k.ld(blk.bcast[2]), 1)
            k.setp("gt", shift, 0, combine=("and", ~one), out=going)
            k.bar_sync(0)
    # the one key under the prefix (or the prefix itself once every bit is set)
    best = k.var(u64, 0)
    with k.for_range(t, nkeys, nthr) as i:
        key = k.ld(keys[i])
        hit = k.setp("eq", key & mask, prefix, combine=("and", key >= lo))
        hit = k.setp("le", key, hi, combine=("and", hit))
        with k.if_(hit):
            k.max(best, key, out=best)
    return blk.reduce(best, "max", 0)


def _pick_bin(k, blk, hist_lo, hist_hi, hist_n, rest, counts_only):
    """Warp 0 scans the bins from the highest down and broadcasts the bin
    where the running weight reaches ``rest``: its digit, the weight still
    needed inside it, and its count (``blk.bcast[0..3)``)."""
    with k.if_(blk.warp.eq(0)):
        # lane l holds bins 255-8l .. 248-8l, highest first
        top = 255 - (blk.lane << 3)
        ws = []
        s = k.mov(0, u64)
        for j in range(8):
            b = top - j
            w = (k.ld(hist_n[b]).to(u64) if counts_only
                 else k.pack(u64, k.ld(hist_lo[b]), k.ld(hist_hi[b])))
            ws.append(w)
            s = s + w
        inc = blk.warp_inclusive_scan(s)
        exc = inc - s
        mine = k.setp("lt", exc, rest, combine=("and", rest <= inc))
        with k.if_(mine):
            acc = k.var(u64, 0)
            k.assign(acc, exc)
            found = k.var(pred)
            k.setp("ne", blk.lane, blk.lane, out=found)          # false
            for j in range(8):
                nxt = acc + ws[j]
                take = k.setp("le", rest, nxt, combine=("and", ~found))
                with k.if_(take):
                    k.st(blk.bcast[0], (top - j).to(u64))
                    k.st(blk.bcast[1], rest - acc)
                    k.st(blk.bcast[2], k.ld(hist_n[top - j]).to(u64))
                k.assign(found, k.por(found, take))
                k.assign(acc, nxt)
