"""The sorted top of the blocks' lists, merged by warps.

Each block hands the merge its ``top`` largest keys in descending order.
The last block needs the largest ``L`` keys of their union, sorted: top-k
is then an index, top-p a prefix sum and the draw a search.  A warp holds
one list of ``L = 32 * E`` keys in registers (lane ``l`` holds items
``l, l + 32, ...``) and merges another into it: the larger half of two
descending lists is ``max(a[i], b[L - 1 - i])`` (a bitonic sequence),
which a bitonic merge sorts (strides of 32 and more inside a lane, the
smaller ones by ``shfl.bfly``).  Warp ``w`` folds lists ``w, w + W, ...``,
then the warps' lists meet in a tree through shared memory, one barrier a
level.  Keys are unique (they hold the index) except the empty key 0,
below every other key, which pads short lists.
"""

from __future__ import annotations

from ptxgen.types import u32, u64

from .blockops import shfl64

__all__ = ["list_width", "merge_top", "sort_slice", "tree_merge", "load_list", "merge_desc",
           "sort_desc", "prefix_sums", "count_below", "count_at_least"]


def list_width(top: int) -> int:
    """``L``: the merged list's length, ``top`` rounded up to a power of
    two, at least 32 (one key per lane)."""
    n = 32
    while n < top:
        n *= 2
    return n


def load_list(k, lane, arr, base, count, per_lane: int, cache=None):
    """``per_lane`` u64 registers: items ``lane + 32 j`` of ``arr[base ..
    base + count)``, 0 past ``count``."""
    out = []
    kw = {} if cache is None else {"cache": cache}
    for j in range(per_lane):
        r = lane + 32 * j if j else lane
        v = k.var(u64, 0)
        if isinstance(count, int) and count >= 32 * per_lane:
            k.assign(v, k.ld(arr[base + r], **kw))
        else:
            with k.if_(r < count):
                k.assign(v, k.ld(arr[base + r], **kw))
        out.append(v)
    return out


def _keep(k, a, b, want_max):
    """``max(a, b)`` where ``want_max`` holds, else ``min(a, b)`` (u64):
    one compare and one select."""
    return k.select(k.setp("gt", a, b, combine=("xor", ~want_max)), a, b)


def _network(k, lane, c, stride: int, desc):
    """One compare-exchange step of a bitonic network over the items of
    ``c`` (item ``lane + 32 j`` in ``c[j]``): items ``i`` and
    ``i ^ stride`` exchange so that the lower index gets the larger key
    where the run is descending.  ``desc(j)`` says so for the items of
    ``c[j]``: True, False, or a predicate register (per lane)."""
    c = list(c)
    if stride >= 32:
        d = stride // 32
        for j in range(len(c)):
            if j & d:
                continue
            up = desc(j)
            a, b = c[j], c[j | d]
            if isinstance(up, bool):
                hi, lo = k.max(a, b), k.min(a, b)
                c[j], c[j | d] = (hi, lo) if up else (lo, hi)
            else:
                swap = k.setp("lt", a, b, combine=("xor", ~up))
                c[j], c[j | d] = k.select(swap, b, a), k.select(swap, a, b)
        return c
    lower = (lane & stride).eq(0)
    for j in range(len(c)):
        up = desc(j)
        want_max = (lower if up else ~lower) if isinstance(up, bool) else ~(lower ^ up)
        c[j] = _keep(k, c[j], shfl64(k, c[j], "bfly", stride), want_max)
    return c


def bitonic_merge_desc(k, lane, c):
    """Sort the bitonic list ``c`` (registers, see :func:`load_list`) in
    descending order."""
    c = list(c)
    s = 16 * len(c)
    while s >= 1:
        c = _network(k, lane, c, s, lambda j: True)
        s //= 2
    return c


def sort_desc(k, lane, c):
    """Sort the items of ``c`` (registers) in descending order: a bitonic
    sorting network, runs of ``size`` alternating in direction until the
    last stage."""
    c = list(c)
    e = len(c)
    width = 32 * e
    size = 2
    while size <= width:
        if size == width:
            def desc(j):
                return True
        elif size >= 32:                 # the run's direction follows j
            def desc(j, size=size):
                return not (32 * j) & size
        else:                            # ... or the lane
            run = (lane & size).eq(0)

            def desc(j, run=run):
                return run
        s = size // 2
        while s >= 1:
            c = _network(k, lane, c, s, desc)
            s //= 2
        size *= 2
    return c


def merge_desc(k, lane, a, b):
    """The largest ``L`` keys of two descending lists (registers), sorted."""
    e = len(a)
    rb = [shfl64(k, b[e - 1 - j], "bfly", 31) for j in range(e)]     # b reversed
    return bitonic_merge_desc(k, lane, [k.max(a[j], rb[j]) for j in range(e)])


def tree_merge(k, blk, acc, mrg, width: int):
    """Each warp holds a descending list ``acc`` (registers); write the
    largest ``width`` keys of all of them, sorted, to ``mrg[0 .. width)``
    (shared u64[warps * width]): a tree of warp merges, one barrier a
    level.  Ends with a barrier."""
    e = width // 32
    lane, warp = blk.lane, blk.warp
    base = warp * width
    for j, v in enumerate(acc):
        k.st(mrg[base + lane + 32 * j if j else base + lane], v)
    k.bar_sync(0)
    half = blk.warps // 2
    while half >= 1:
        with k.if_(warp < half):
            a = load_list(k, lane, mrg, base, width, e)
            b = load_list(k, lane, mrg, (warp + half) * width, width, e)
            for j, v in enumerate(merge_desc(k, lane, a, b)):
                k.st(mrg[base + lane + 32 * j if j else base + lane], v)
        k.bar_sync(0)
        half //= 2


def sort_slice(k, blk, key_pair, mrg, width: int):
    """The block's largest ``width`` keys, sorted, to ``mrg[0 .. width)``
    from the two keys each thread holds (``key_pair``): each warp sorts
    its 64 keys in registers, then :func:`tree_merge`."""
    e = width // 32
    lane = blk.lane
    if e == 1:
        acc = merge_desc(k, lane, sort_desc(k, lane, key_pair[:1]),
                         sort_desc(k, lane, key_pair[1:]))
    else:
        acc = sort_desc(k, lane, list(key_pair) + [k.mov(0, u64)] * (e - 2))
    tree_merge(k, blk, acc, mrg, width)


def merge_top(k, blk, lists, top: int, stride: int, nlists, mrg, width: int, kappa):
    """Write the largest ``width`` keys of ``nlists`` descending lists
    ``lists[b * stride .. b * stride + top)`` (global, read with ``.cg``)
    to ``mrg[0 .. width)``, sorted, and return how many of their keys are
    ``>= kappa`` and non-zero (every thread gets it).  Ends with a barrier."""
    e = width // 32
    lane, warp, nw = blk.lane, blk.warp, blk.warps
    known = k.var(u32, 0)

    def count(lst):
        for v in lst:
            hit = k.setp("ge", v, kappa, combine=("and", v.ne(0)))
            k.add(known, k.popc(k.vote_sync("ballot", hit)), out=known)

    def fetch(dst, b):
        for v, x in zip(dst, load_list(k, lane, lists, b * stride, top, e, cache="cg")):
            k.assign(v, x)

    acc = [k.var(u64, 0) for _ in range(e)]
    nxt = [k.var(u64, 0) for _ in range(e)]
    with k.if_(warp < nlists):                  # the warp's first list, as it is
        fetch(acc, warp)
        count(acc)
    with k.if_(warp + nw < nlists):
        fetch(nxt, warp + nw)
    with k.for_range(warp + nw, nlists, nw) as b:
        cur = [k.mov(v) for v in nxt]
        with k.if_(b + nw < nlists):            # the next list loads during this merge
            fetch(nxt, b + nw)
        count(cur)
        for v, x in zip(acc, merge_desc(k, lane, acc, cur)):
            k.assign(v, x)
    with k.if_(lane.eq(0)):
        k.st(blk.count[warp], known)
    tree_merge(k, blk, acc, mrg, width)
    total = k.var(u32, 0)
    with k.for_range(0, nw, 1) as w:
        k.add(total, k.ld(blk.count[w]), out=total)
    return total


def prefix_sums(k, blk, mrg, width: int, weights, outs):
    """Warp 0: the inclusive prefix sums over ``mrg[0 .. width)`` of each
    ``weights[i](key)`` (u64 registers), written to ``outs[i][0 .. width)``
    (shared u64).  The caller adds the barrier."""
    e = width // 32
    lane = blk.lane
    with k.if_(blk.warp.eq(0)):
        ks = load_list(k, lane, mrg, 0, width, e)
        for wf, arr in zip(weights, outs):
            carry = k.var(u64, 0)
            for j in range(e):
                inc = blk.warp_inclusive_scan(wf(ks[j])) + carry
                k.st(arr[lane + 32 * j if j else lane], inc)
                if j + 1 < e:
                    k.assign(carry, shfl64(k, inc, "idx", 31))


def count_below(k, arr, width: int, x, bound, *, strict: bool):
    """The number of leading entries of the non-decreasing shared
    ``arr[0 .. bound)`` (``bound <= width``, a power of two) that are
    ``< x`` (``strict``) or ``<= x``: a branch-free binary search."""
    t = k.var(u32, 0)
    step = width
    while step >= 1:
        c = t + step
        with k.if_(c <= bound):
            v = k.ld(arr[c - 1])
            ok = k.setp("lt" if strict else "le", v, x)
            with k.if_(ok):
                k.assign(t, c)
        step //= 2
    return t


def count_at_least(k, arr, width: int, x, bound):
    """The number of leading entries of the non-increasing shared
    ``arr[0 .. bound)`` that are ``>= x``."""
    t = k.var(u32, 0)
    step = width
    while step >= 1:
        c = t + step
        with k.if_(c <= bound):
            with k.if_(k.ld(arr[c - 1]) >= x):
                k.assign(t, c)
        step //= 2
    return t
