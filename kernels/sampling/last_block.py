"""The sampler's last block: merge the blocks' records, find the cut of
top-k, top-p and min-p, and draw.

The blocks' lists are merged by warps into ``S``, the sorted largest ``L``
keys of their union ``U`` (:mod:`.merge`).  Every key of ``S`` at or above
``kappa`` is in the vocabulary's exact order, so a cut inside ``S`` is an
index: top-k's is ``S[k - 1]``, top-p's the first prefix of ``S`` whose
mass reaches the target (prefix sums of the masses, a binary search), and
a kept set inside ``S`` is drawn from by a binary search of the prefix
sums of its tempered weights.  Only a cut below ``S`` (top-k past ``L``,
a top-p set of more than ``L`` tokens) runs the radix select over ``U``
(:mod:`.select`), and only a kept set larger than ``S`` is drawn from
``U``'s chunks.
"""

from __future__ import annotations

from ptxgen.types import f32, f64, pred, s32, u32, u64

from .blockops import key_value, ord_key
from .merge import count_at_least, count_below, merge_top, prefix_sums
from .params import (_LN2, _LOG2E, FIXED_BITS, FLAG_GREEDY, FLAG_TRUNCATED, FLAG_WHOLE, MIN_P,
                     SEED_HI, SEED_LO, TOP_K, TOP_P, ex2_weight, no_filter)
from .philox import philox4x32_10
from .select import radix_select

__all__ = ["merge_and_draw"]


def _true(k, blk):
    return k.setp("eq", blk.tid, blk.tid)


def merge_and_draw(k, spec, blk, env):
    """The last block: merge the blocks' records, find the cut, draw."""
    nthr, T, R, L = spec.block, spec.top, spec.record, spec.merged
    keys, scratch, prm, cum = env.keys, env.scratch, env.prm, env.cum
    sh = env.sh
    n, out, n_draws, info, counter = env.n, env.out, env.n_draws, env.info, env.counter
    pos_p, greedy, scale_t, temp = env.pos_p, env.greedy, env.scale_t, env.temp
    tid = blk.tid
    ninf = float("-inf")
    g = k.nctaid.x
    nu = g * T

    mt = k.var(f32, ninf)
    s_t = k.var(f32, 0.0)
    tb = k.var(u64, 0)
    kap = k.var(u64, 0)
    with k.if_(tid < g):
        w = k.ld(scratch[tid * R + T], cache="cg")
        a, c = k.unpack(w, u32, 2)
        k.assign(mt, a.bitcast(f32))
        k.assign(s_t, c.bitcast(f32))
        k.assign(tb, k.ld(scratch[tid * R + T + 1], cache="cg"))
        k.assign(kap, k.ld(scratch[tid * R + T + 2], cache="cg"))
    m = blk.reduce(mt, "max", ninf)
    kappa = blk.reduce(kap, "max", 0)
    live = k.setp("gt", mt, ninf, combine=("and", tid < g))
    z_t = k.var(f64, 0.0)
    w_t = k.var(f64, 0.0)
    with k.if_(live):
        k.assign(z_t, s_t.to(f64) * k.ex2((mt - m) * _LOG2E).to(f64))
        k.assign(w_t, tb.to(f64) * k.ex2((mt - m) * scale_t).to(f64))
    z = blk.reduce(z_t, "add", 0.0)
    w_total = blk.exclusive_scan_into(w_t, sh.wpre)

    # S, the sorted top L of U, and the keys known exactly (>= kappa)
    n_known = merge_top(k, blk, scratch, T, R, g, sh.mrg, L, kappa)
    u_ready = k.var(pred)
    k.setp("ne", tid, tid, out=u_ready)

    def need_u():
        """U in shared memory (``keys``), for a cut or kept set below S."""
        with k.if_(~u_ready):
            with k.for_range(tid, nu, nthr) as i:
                b = i // T
                k.st(keys[i], k.ld(scratch[b * R + (i - b * T)], cache="cg"))
            k.bar_sync(0)
            k.assign(u_ready, _true(k, blk))

    def mass(key):
        y, _ = key_value(k, key)
        return ex2_weight(k, y, m, _LOG2E)

    def tempered(key):
        y, _ = key_value(k, key)
        return ex2_weight(k, y, m, scale_t)

    prefix_sums(k, blk, sh.mrg, L, (mass, tempered), (sh.cmass, sh.ctemp))
    k.bar_sync(0)
    top_key = k.ld(sh.mrg[0])
    s_last = k.ld(sh.mrg[L - 1])
    n_s = k.min(n_known, L)
    _top_val, top_idx = key_value(k, top_key)
    known_lo = k.max(kappa, k.mov(1, u64))            # the smallest key known exactly

    def mass_above(floor):
        need_u()
        acc = k.var(u64, 0)
        with k.for_range(tid, nu, nthr) as i:
            key = k.ld(keys[i])
            with k.if_(key >= floor):
                k.add(acc, mass(key), out=acc)
        return blk.reduce(acc, "add", 0)

    def select(weight, need, lo):
        """The cut below S: the keys in [lo, S[L-1]) weighing ``need``."""
        need_u()
        return radix_select(k, blk, keys, nu, weight, need, lo, s_last - 1, sh.hist_lo,
                            sh.hist_hi, sh.hist_n)

    cut = k.var(u64, 0)
    trunc = k.var(pred)
    k.setp("ne", tid, tid, out=trunc)
    zk = k.var(f64, 0.0)
    k.assign(zk, z * float(1 << FIXED_BITS))
    kk = k.ld(prm[TOP_K], s32)
    ku = kk.bitcast(u32)
    with k.if_(k.setp("gt", kk, 0, combine=("and", ku < n))):
        with k.if_else(ku > n_known) as (beyond, inside):
            with beyond:
                k.assign(trunc, _true(k, blk))
                k.assign(cut, kappa)
                k.assign(zk, mass_above(known_lo).to(f64))
            with inside:
                with k.if_else(ku <= L) as (in_s, below_s):
                    with in_s:
                        k.assign(cut, k.ld(sh.mrg[ku - 1]))
                        k.assign(zk, k.ld(sh.cmass[ku - 1]).to(f64))
                    with below_s:
                        k.assign(cut, select(None, (ku - L).to(u64), known_lo))
                        k.assign(zk, mass_above(cut).to(f64))
    tp = k.ld(prm[TOP_P], f32)
    with k.if_(tp < 1.0):
        want = k.max((tp.to(f64) * zk).to(u64, rnd="rpi"), k.mov(1, u64))
        floor = k.max(cut, k.mov(1, u64))
        n_floor = count_at_least(k, sh.mrg, L, floor, L)
        lim = k.min(n_floor, n_s)
        at = count_below(k, sh.cmass, L, want, lim, strict=True)
        with k.if_else(at < lim) as (found, not_found):
            with found:
                k.assign(cut, k.ld(sh.mrg[at]))
            with not_found:
                # S holds every key >= max(floor, kappa) unless it is full of them
                covered = k.setp("lt", n_s, L, combine=("or", n_floor < L))
                with k.if_else(covered) as (short, longer):
                    with short:
                        k.assign(trunc, _true(k, blk))
                        k.max(cut, kappa, out=cut)
                    with longer:
                        lo2 = k.max(floor, known_lo)
                        have = mass_above(lo2)
                        with k.if_else(want > have) as (beyond, inside):
                            with beyond:
                                k.assign(trunc, _true(k, blk))
                                k.max(cut, kappa, out=cut)
                            with inside:
                                need = want - k.ld(sh.cmass[L - 1])
                                k.max(cut, select(mass, need, lo2), out=cut)
    mp = k.ld(prm[MIN_P], f32)
    with k.if_(mp > 0.0):
        thr = m + k.lg2(mp) * _LN2
        k.max(cut, k.min(ord_key(k, thr, k.mov(0xFFFFFFFF, u32)), top_key), out=cut)
    whole = k.setp("ne", kappa, 0, combine=("and", no_filter(k, prm, n, temp)))
    k.max(cut, k.mov(1, u64), out=cut)
    with k.if_(k.setp("lt", cut, kappa, combine=("and", ~whole))):
        k.assign(trunc, _true(k, blk))
        k.assign(cut, kappa)

    # the kept keys: inside S (an index), or U's chunks
    in_s = k.setp("ge", cut, s_last, combine=("and", ~whole))
    n_kept = k.var(u32, 0)
    low_key = k.var(u64, 0)
    total = k.var(u64, 0)
    chunk = (nu + (nthr - 1)) // nthr

    def weight(key):
        return k.select(key >= cut, tempered(key), k.mov(0, u64))

    with k.if_(~whole):                     # a whole-vocabulary draw needs none of this
        with k.if_else(in_s) as (short, longer):
            with short:
                k.assign(n_kept, count_at_least(k, sh.mrg, L, cut, L))
                k.assign(low_key, k.ld(sh.mrg[n_kept - 1]))
                k.assign(total, k.ld(sh.ctemp[n_kept - 1]))
            with longer:
                need_u()
                c0 = tid * chunk
                c1 = k.min(c0 + chunk, nu)
                kept = k.var(u32, 0)
                low = k.var(u64, 0xFFFFFFFFFFFFFFFF)
                wsum = k.var(u64, 0)
                with k.for_range(c0, c1, 1) as i:
                    key = k.ld(keys[i])
                    ink = key >= cut
                    k.add(kept, k.select(ink, k.mov(1, u32), k.mov(0, u32)), out=kept)
                    with k.if_(ink):
                        k.min(low, key, out=low)
                    k.add(wsum, weight(key), out=wsum)
                k.assign(n_kept, blk.reduce(kept, "add", 0))
                k.assign(low_key, blk.reduce(low, "min", 0xFFFFFFFFFFFFFFFF))
                k.assign(total, blk.exclusive_scan_into(wsum, sh.pref))

    pos = k.ld(pos_p[0]).bitcast(u32)
    seed = (k.ld(prm[SEED_LO]), k.ld(prm[SEED_HI]))
    empty = k.setp("eq", total, 0, combine=("and", ~whole))
    with k.if_else(k.por(greedy, empty)) as (pick_top, sample):
        with pick_top:
            with k.for_range(tid, n_draws, nthr) as r:
                k.st(out[r], top_idx.bitcast(s32))
        with sample:
            with k.if_else(whole) as (everything, kept_set):
                with everything:
                    _draw_whole(k, spec, blk, scratch, cum, sh.wpre, w_total, n, out, n_draws,
                                pos, seed)
                with kept_set:
                    with k.if_else(in_s) as (from_s, from_u):
                        with from_s:
                            _draw_sorted(k, blk, nthr, L, sh.mrg, sh.ctemp, n_kept, total, out,
                                         n_draws, pos, seed)
                        with from_u:
                            _draw_chunks(k, blk, nthr, keys, sh.pref, total, weight, chunk, nu,
                                         out, n_draws, pos, seed)

    with k.if_(k.setp("eq", tid, 0, combine=("and", k.setp("ne", info, 0)))):
        flags = k.select(trunc, k.mov(FLAG_TRUNCATED, u32), k.mov(0, u32))
        flags = flags | k.select(whole, k.mov(FLAG_WHOLE, u32), k.mov(0, u32))
        flags = flags | k.select(greedy, k.mov(FLAG_GREEDY, u32), k.mov(0, u32))
        _, low_idx = key_value(k, low_key)
        k.st(info[0], k.select(whole, n, n_kept).bitcast(s32))
        k.st(info[1], flags.bitcast(s32))
        k.st(info[2], k.select(whole, k.mov(0xFFFFFFFF, u32), low_idx).bitcast(s32))
        k.st(info[3], n_known.bitcast(s32))
    with k.if_(tid.eq(0)):
        k.st(counter[0], 0)


def _search(k, arr, count: int, x, bound):
    """The largest ``t < bound`` (``bound <= count``) with ``arr[t] <= x``
    (``arr`` non-decreasing, ``arr[0] <= x``): a branch-free binary search."""
    t = k.var(u32, 0)
    step = 1 << (count - 1).bit_length()
    while step >= 1:
        c = t + step
        ok = k.setp("lt", c, bound)
        with k.if_(ok):
            with k.if_(k.ld(arr[c]) <= x):
                k.assign(t, c)
        step //= 2
    return t


def _draw_sorted(k, blk, nthr, width, mrg, ctemp, n_kept, total, out, n_draws, pos, seed):
    """Draws over the kept prefix ``S[0 .. n_kept)``, one thread per draw:
    the first key whose running tempered weight passes the target."""
    with k.for_range(blk.tid, n_draws, nthr) as r:
        x0, x1, _x2, _x3 = philox4x32_10(k, (pos, r, 0, 0), seed)
        x = k.mul_hi(k.pack(u64, x0, x1), total)
        at = count_below(k, ctemp, width, x, n_kept, strict=False)
        k.st(out[r], key_value(k, k.ld(mrg[at]))[1].bitcast(s32))


def _draw_chunks(k, blk, nthr, keys, pref, total, weight, chunk, nu, out, n_draws, pos, seed):
    """Draws over the kept keys of ``U``: one thread per draw, a chunk by
    the block's prefix sums, then a walk through it."""
    with k.for_range(blk.tid, n_draws, nthr) as r:
        x0, x1, _x2, _x3 = philox4x32_10(k, (pos, r, 0, 0), seed)
        x = k.mul_hi(k.pack(u64, x0, x1), total)
        t = _search(k, pref, nthr, x, nthr)
        acc = k.var(u64, 0)
        k.assign(acc, k.ld(pref[t]))
        tok = k.var(u32, 0)
        found = k.var(pred)
        k.setp("ne", t, t, out=found)
        c0 = t * chunk
        with k.for_range(c0, k.min(c0 + chunk, nu), 1) as i:
            key = k.ld(keys[i])
            k.add(acc, weight(key), out=acc)
            take = k.setp("lt", x, acc, combine=("and", ~found))
            with k.if_(take):
                k.assign(tok, key_value(k, key)[1])
                k.assign(found, k.setp("eq", t, t))
        k.st(out[r], tok.bitcast(s32))


def _draw_whole(k, spec, blk, scratch, cum, wpre, w_total, n, out, n_draws, pos, seed):
    """Draws over the whole vocabulary, one thread per draw: a block by its
    tempered mass (f64), then a token inside it by a binary search of the
    block's running sums ``cum`` with a second 64-bit number."""
    S, T, R = spec.slice, spec.top, spec.record
    with k.for_range(blk.tid, n_draws, spec.block) as r:
        x0, x1, x2, x3 = philox4x32_10(k, (pos, r, 0, 0), seed)
        u = (x0 >> 5).to(f64) * float(1 << 26) + (x1 >> 6).to(f64)
        b = _search(k, wpre, spec.block, u * (2.0 ** -53) * w_total, k.nctaid.x)
        base = b * S
        nbb = k.min(n - base, S)
        x = k.mul_hi(k.pack(u64, x2, x3), k.ld(scratch[b * R + T + 1], cache="cg"))
        # the first i with cum[base + i] > x
        j = k.var(u32, 0)
        step = S // 2
        while step >= 1:
            c = j + step
            with k.if_(c <= nbb):
                with k.if_(k.ld(cum[base + c - 1], cache="cg") <= x):
                    k.assign(j, c)
            step //= 2
        k.st(out[r], (base + k.min(j, nbb - 1)).bitcast(s32))
