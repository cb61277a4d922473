"""Token sampling on the GPU: penalties, top-k, top-p, min-p, temperature
and a seeded draw over f32 logits, in one launch that writes int32 tokens.

The chain is llama.cpp's default order (``common_params_sampling::samplers``
with DRY, top-n-sigma, typical-p and XTC off): repetition / frequency /
presence penalties over the last ``n`` tokens, top-k, top-p, min-p,
temperature, then the draw.  Every filter keeps a prefix of the logits
sorted in descending order (ties: lower index first), so the kept set is
``{key >= cut}`` for one 64-bit key ``cut``; the kernel finds ``cut`` and
draws from the tempered softmax over that set.  What changes per token
(the sampling parameters, the seed, the position, the token history) is
read from device memory, so a captured graph replays it and the host may
rewrite the parameters between replays.

Launch: ``G = ceil(V / (2 * block))`` blocks (at most ``block``) of
``block`` threads, ``8 * max(2 * block, G * top)`` bytes of dynamic shared
memory (:func:`launch_geometry`).  Block ``b`` owns the slice
``[2 * block * b, ...)`` of the vocabulary: it loads it into shared memory,
applies the penalties to the tokens of the window that fall in it, writes
the penalised logits to ``work`` (f32[V]), sorts its keys
``(order(logit) << 32) | ~index`` (bitonic, descending) and writes its
``top`` largest keys, its max ``m_b``, ``sum exp(y - m_b)`` and
``sum exp((y - m_b) / T)`` and its ``top``-th key ``kappa_b`` to
``scratch``.  The last block to finish (a counter, as in ``argmax``; it
resets the counter, so the launch replays) merges: the global max ``m``,
the full normaliser ``Z``, the union ``U`` of the lists (``G * top`` keys in
shared memory) and ``kappa = max_b kappa_b``.  Every key above ``kappa``
is in ``U``: the sorted order of the whole vocabulary is known exactly down
to ``kappa`` (at least ``top`` tokens, usually thousands).  Then:

- top-k (``0 < k < V``): the k-th largest key of ``U`` (a byte-wise radix
  select with 256-bin shared histograms);
- top-p (``p < 1``): the largest key ``c`` with
  ``sum_{key >= c} exp(y - m) >= p * Z_k`` (``Z_k``: the top-k set's sum,
  or ``Z``), the same radix select weighted by 40-bit fixed-point masses
  (integer sums: the same in every launch whatever the order);
- min-p (``p > 0``): ``y >= m + ln(p)``; the top token always stays;
- the draw (``T > 0``): weights ``round(2^40 * exp((y - m) / T))`` over the
  kept keys, a block-wide integer prefix sum, and ``floor(r * total / 2^64)``
  for a 64-bit ``r`` from Philox-4x32-10 keyed by the 64-bit seed with the
  counter ``(position, draw, 0, 0)``; ``T <= 0`` picks the top key (argmax
  of the penalised logits, ties to the lowest index).

Exactness.  Penalties are IEEE f32 operations in llama.cpp's order
(bit-exact).  The kept set is exact (the same tokens as a float64 chain,
except where a cumulative sum lies within float rounding of a threshold)
whenever the cut lies at or above ``kappa``; it always does for
``top_k <= top``.  With no filter at all (``top_k`` 0 or ``>= V``,
``top_p >= 1``, ``min_p <= 0``) the draw is over the whole vocabulary:
a block is picked by its tempered mass (f64), then a token inside it by
fixed-point weights, with a second pair of Philox words.  When top-p or
min-p (without a top-k at or below ``top``) would keep tokens below
``kappa`` (a very flat distribution), the kept set is cut at ``kappa``
and ``info[1]`` bit 0 says so; that set is the exact top ``info[3]``
tokens.  Weights below ``2^-40`` of the largest are 0 (never drawn); the
64-bit draw's bias is below ``2^-10 / weight`` per weight unit.

Outputs: ``out[r]`` (int32) for draws ``r < n_draws`` (draw ``r`` uses the
Philox counter ``(pos, r, 0, 0)``; the decode step uses ``n_draws = 1``, the
statistics tests many); ``work`` the penalised logits; ``info`` (int32[4],
may be a null pointer): kept count (``V`` for a whole-vocabulary draw),
flags (bit 0 truncated at ``kappa``, bit 1 whole-vocabulary draw, bit 2
greedy), index of the smallest kept key (-1 for a whole-vocabulary draw),
the number of keys known exactly (``>= kappa``).

Parameters (``params``, u32[12], :func:`pack_params`): top_k (s32), top_p,
min_p, temperature, penalty_last_n (s32; -1: the whole history),
penalty_repeat, penalty_freq, penalty_present (f32), seed (u64 as two
words), two reserved words.  The window is ``history[pos - n + 1 .. pos]``
(prompt and generated tokens, as llama-cli accepts both), ``pos`` read from
the int32 at ``pos``; ids outside ``[0, V)`` are ignored.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import f32, f64, pred, s32, u32, u64

from ..spec_fields import block_field, pdl_field, pdl_prologue, target_field
from .blockops import Block, key_value, ord_key
from .philox import philox4x32_10

__all__ = ["SamplingSpec", "build", "launch_geometry", "scratch_words", "pack_params",
           "PARAM_WORDS", "INFO_WORDS", "FIXED_BITS", "philox4x32_10"]

(TOP_K, TOP_P, MIN_P, TEMP, LAST_N, REPEAT, FREQ, PRESENT, SEED_LO, SEED_HI) = range(10)
PARAM_WORDS = 12
INFO_WORDS = 4
FIXED_BITS = 40
FLAG_TRUNCATED, FLAG_WHOLE, FLAG_GREEDY = 1, 2, 4
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _check_top(inst, attr, v):
    if not (isinstance(v, int) and 1 <= v <= 2 * inst.block):
        raise ValueError(f"{attr.name} must be an int in 1..2*block ({2 * inst.block}), got {v!r}")


@attrs.frozen
class SamplingSpec:
    """A sampler kernel.

    Parameters
    ----------
    block : int
        Threads per block; each block owns ``2 * block`` logits.
    top : int
        Keys each block hands to the merge (the exact top-k limit).
    target : str
    pdl : bool
    """

    block: int = block_field(512)
    top: int = attrs.field(default=64, validator=_check_top)
    target: str = target_field()
    pdl: bool = pdl_field()

    @property
    def kernel_name(self) -> str:
        return f"sample_b{self.block}_t{self.top}"

    @property
    def slice(self) -> int:
        return 2 * self.block

    @property
    def record(self) -> int:
        """u64 words of a block's record in ``scratch``."""
        return self.top + 3

    def check_power_of_two(self):
        if self.slice & (self.slice - 1):
            raise ValueError(f"block must be a power of two for the bitonic sort, got {self.block}")


def blocks_for(spec: SamplingSpec, n: int) -> int:
    return max(1, -(-n // spec.slice))


def launch_geometry(spec: SamplingSpec, n: int):
    """``(grid, block, shared_bytes)`` for a vocabulary of ``n`` logits."""
    if n < 1:
        raise ValueError(f"the vocabulary must hold at least one logit, got {n}")
    g = blocks_for(spec, n)
    if g > spec.block:
        raise ValueError(f"{n} logits need {g} blocks of {spec.slice}; at most block = "
                         f"{spec.block} blocks: use a larger block")
    return (g, 1, 1), (spec.block, 1, 1), 8 * max(spec.slice, g * spec.top)


def scratch_words(spec: SamplingSpec, n: int) -> int:
    """u64 words of ``scratch`` for ``n`` logits: a record per block, then
    the running sums of the whole-vocabulary draw (one per logit)."""
    return blocks_for(spec, n) * spec.record + n


def pack_params(*, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0, penalty_last_n=0,
                penalty_repeat=1.0, penalty_freq=0.0, penalty_present=0.0,
                seed=0) -> np.ndarray:
    """The ``params`` words (u32[12]) of the sampler; llama.cpp's names:
    ``--top-k``, ``--top-p``, ``--min-p``, ``--temp``, ``--repeat-last-n``,
    ``--repeat-penalty``, ``--frequency-penalty``, ``--presence-penalty``,
    ``--seed`` (0 .. 2^64 - 1)."""
    seed = int(seed)
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in 0 .. 2**64 - 1, got {seed}")
    for name, v in (("top_k", top_k), ("penalty_last_n", penalty_last_n)):
        if not isinstance(v, (int, np.integer)) or not -2**31 <= v < 2**31:
            raise ValueError(f"{name} must be an int32, got {v!r}")
    if penalty_last_n < -1:
        raise ValueError(f"penalty_last_n must be -1 (all), 0 (off) or positive, got {penalty_last_n}")
    w = np.zeros(PARAM_WORDS, np.uint32)
    w[TOP_K] = np.int32(top_k).view(np.uint32)
    w[LAST_N] = np.int32(penalty_last_n).view(np.uint32)
    for i, v in ((TOP_P, top_p), (MIN_P, min_p), (TEMP, temperature), (REPEAT, penalty_repeat),
                 (FREQ, penalty_freq), (PRESENT, penalty_present)):
        if not math.isfinite(float(v)):
            raise ValueError(f"sampling parameters must be finite, got {v!r}")
        w[i] = np.float32(v).view(np.uint32)
    w[SEED_LO], w[SEED_HI] = seed & 0xFFFFFFFF, seed >> 32
    return w


def _ex2_weight(k, y, m, scale):
    """``round(2^40 * 2^((y - m) * scale))`` as u64 (0 for -inf / NaN)."""
    e = k.ex2((y - m) * scale)
    return (e * float(1 << FIXED_BITS)).to(u64, rnd="rni")


def _penalties(k, blk, vals, history, pos_p, prm, lo, nb, nthreads):
    """Apply the window's penalties to ``vals`` (the block's slice)."""
    last_n = k.ld(prm[LAST_N], s32)
    rep, freq, pres = (k.ld(prm[i], f32) for i in (REPEAT, FREQ, PRESENT))
    off = k.setp("eq", rep, 1.0, combine=("and", freq.eq(0.0)))
    off = k.setp("eq", pres, 0.0, combine=("and", off))
    off = k.por(off, last_n.eq(0))
    pos = k.ld(pos_p[0])
    have = pos + 1
    nwin = k.select(last_n < 0, have, k.min(last_n, have))
    nwin = k.select(have < 0, k.mov(0, s32), nwin)
    start = (have - nwin).bitcast(u32)
    nw = nwin.bitcast(u32)
    with k.if_(~off):
        with k.for_range(blk.tid, nw, nthreads) as j:
            t = k.ld(history[start + j])
            rel = t.bitcast(u32) - lo
            with k.if_(rel < nb):
                cnt = k.var(u32, 0)
                first = k.var(pred)
                k.setp("eq", j, j, out=first)
                with k.for_range(0, nw, 1) as j2:
                    same = k.ld(history[start + j2]).eq(t)
                    k.add(cnt, k.select(same, k.mov(1, u32), k.mov(0, u32)), out=cnt)
                    earlier = k.setp("lt", j2, j, combine=("and", same))
                    k.assign(first, k.pand(first, k.setp("eq", j, j, combine=("xor", earlier))))
                with k.if_(first):
                    v = k.ld(vals[rel])
                    v2 = k.select(v <= 0.0, v * rep, v / rep)
                    pen = cnt.to(f32) * freq + pres
                    k.st(vals[rel], v2 - pen)


def build(spec: SamplingSpec) -> ptxgen.Module:
    """PTX for ``spec``; parameters ``logits: f32*, n: u32, history: s32*,
    pos: s32*, params: u32*, out: s32*, n_draws: u32, work: f32*, info: s32*
    (or 0), scratch: u64*, counter: u32*``."""
    spec.check_power_of_two()
    nthr, S, T, R = spec.block, spec.slice, spec.top, spec.record
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, maxntid=nthr) as k:
        pdl_prologue(k, spec)
        logits = k.param_ptr("logits", f32)
        n = k.param("n", u32)
        history = k.param_ptr("history", s32)
        pos_p = k.param_ptr("pos", s32)
        prm = k.param_ptr("params", u32, align=16)
        out = k.param_ptr("out", s32)
        n_draws = k.param("n_draws", u32)
        work = k.param_ptr("work", f32)
        info = k.param_ptr("info", s32)
        scratch = k.param_ptr("scratch", u64, align=8)
        counter = k.param_ptr("counter", u32)

        blk = Block(k, nthr)
        keys = k.dynamic_shared("keys", u64, align=16)
        vals = k.shared_array("vals", f32, S, align=16)
        hist_w = k.shared_array("hist_w", u64, 256, align=8)
        hist_n = k.shared_array("hist_n", u64, 256, align=8)
        pref = k.shared_array("pref", u64, nthr + 1, align=8)
        wpre = k.shared_array("wpre", f64, nthr + 1, align=8)
        last = k.shared_array("is_last", u32, 4, align=16)
        tid = blk.tid
        ninf = float("-inf")

        temp = k.ld(prm[TEMP], f32)
        greedy = temp <= 0.0
        scale_t = k.select(greedy, k.mov(0.0, f32), _LOG2E / k.max(temp, 1e-30))

        # ---- this block's slice: load, penalise, keys, statistics, sort
        lo = k.ctaid.x * S
        nb = k.min(n - lo, S)
        for e in (0, 1):
            i = tid + e * nthr if e else tid
            v = k.var(f32, ninf)
            with k.if_(i < nb):
                v.set(k.ld(logits[lo + i], nc=True))
            k.st(vals[i], v)
        k.bar_sync(0)
        _penalties(k, blk, vals, history, pos_p, prm, lo, nb, nthr)
        k.bar_sync(0)
        mloc = k.var(f32, ninf)
        for e in (0, 1):
            i = tid + e * nthr if e else tid
            v = k.ld(vals[i])
            ok = i < nb
            k.st(keys[i], k.select(ok, ord_key(k, v, lo + i), k.mov(0, u64)))
            with k.if_(ok):
                k.st(work[lo + i], v)
                k.max(mloc, v, out=mloc)
        mb = blk.reduce(mloc, "max", ninf)
        finite = mb > ninf
        s1 = k.var(f32, 0.0)
        with k.if_(finite):
            for e in (0, 1):
                i = tid + e * nthr if e else tid
                s1 += k.ex2((k.ld(vals[i]) - mb) * _LOG2E)
        sb = blk.reduce(s1, "add", 0.0)
        # with no filter the draw covers the whole vocabulary: this block's
        # running sums of 2^40 * exp((y - m_b) / T), in slice order
        cum = scratch + k.nctaid.x * R
        tot_b = k.var(u64, 0)
        with k.if_(_no_filter(k, prm, n, temp)):
            w_pair = []
            for e in (0, 1):
                i = (tid << 1) + e
                v = k.ld(vals[i])
                w_pair.append(k.select(k.pand(i < nb, finite), _ex2_weight(k, v, mb, scale_t),
                                       k.mov(0, u64)))
            k.assign(tot_b, blk.exclusive_scan_into(w_pair[0] + w_pair[1], pref))
            base = k.ld(pref[tid])
            i0 = tid << 1
            with k.if_(i0 < nb):
                k.st(cum[lo + i0], base + w_pair[0])
            with k.if_(i0 + 1 < nb):
                k.st(cum[lo + i0 + 1], base + w_pair[0] + w_pair[1])
        blk.bitonic_sort_desc(keys, S)

        rec = scratch + k.ctaid.x * R
        for j in k.strided(tid, T, nthr):
            k.st(rec[j], k.ld(keys[j]))
        with k.if_(tid.eq(0)):
            k.st(rec[T], k.pack(u64, mb.bitcast(u32), sb.bitcast(u32)))
            k.st(rec[T + 1], tot_b)
            k.st(rec[T + 2], k.select(nb > T, k.ld(keys[T - 1]), k.mov(0, u64)))
        k.fence("acq_rel", "gpu")
        k.bar_sync(0)
        with k.if_(tid.eq(0)):
            old = k.atom("add", counter[0], 1)
            k.st(last[0], k.select((old + 1).eq(k.nctaid.x), k.mov(1, u32), k.mov(0, u32)))
        k.bar_sync(0)
        with k.if_(k.ld(last[0]).eq(1)):
            k.fence("acq_rel", "gpu")
            _merge_and_draw(k, spec, blk, SimpleNamespace(**locals()))
    return m


def _no_filter(k, prm, n, temp):
    """True when no filter is on (top-k 0 or >= V, top-p >= 1, min-p <= 0)
    and the temperature is positive."""
    kk = k.ld(prm[TOP_K], s32)
    no_k = k.setp("le", kk, 0)
    no_k = k.setp("ge", kk.bitcast(u32), n, combine=("or", no_k))
    p = k.setp("ge", k.ld(prm[TOP_P], f32), 1.0, combine=("and", no_k))
    p = k.setp("le", k.ld(prm[MIN_P], f32), 0.0, combine=("and", p))
    return k.setp("gt", temp, 0.0, combine=("and", p))


def _merge_and_draw(k, spec, blk, env):
    """The last block: merge the blocks' records, find the cut, draw."""
    nthr, T, R = spec.block, spec.top, spec.record
    keys, scratch, prm, cum = env.keys, env.scratch, env.prm, env.cum
    hist_w, hist_n, pref, wpre = env.hist_w, env.hist_n, env.pref, env.wpre
    n, out, n_draws, info, counter = env.n, env.out, env.n_draws, env.info, env.counter
    pos_p, greedy, scale_t, temp = env.pos_p, env.greedy, env.scale_t, env.temp
    tid = blk.tid
    ninf = float("-inf")
    g = k.nctaid.x
    nu = g * T

    with k.for_range(tid, nu, nthr) as i:
        b = i // T
        k.st(keys[i], k.ld(scratch[b * R + (i - b * T)], cache="cg"))
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
    w_total = blk.exclusive_scan_into(w_t, wpre)

    # the top key and the keys known exactly
    topk_ = k.var(u64, 0)
    known = k.var(u32, 0)
    with k.for_range(tid, nu, nthr) as i:
        key = k.ld(keys[i])
        k.max(topk_, key, out=topk_)
        kn = k.setp("ge", key, kappa, combine=("and", key.ne(0)))
        k.add(known, k.select(kn, k.mov(1, u32), k.mov(0, u32)), out=known)
    top_key = blk.reduce(topk_, "max", 0)
    n_known = blk.reduce(known, "add", 0)
    _top_val, top_idx = key_value(k, top_key)

    def one(_key):
        return k.mov(1, u64)

    def mass(key):
        y, _ = key_value(k, key)
        return _ex2_weight(k, y, m, _LOG2E)

    def mass_above(floor):
        acc = k.var(u64, 0)
        with k.for_range(tid, nu, nthr) as i:
            key = k.ld(keys[i])
            with k.if_(key >= floor):
                k.add(acc, mass(key), out=acc)
        return blk.reduce(acc, "add", 0)

    cut = k.var(u64, 0)
    trunc = k.var(pred)
    k.setp("ne", tid, tid, out=trunc)
    zk = k.var(f64, 0.0)
    k.assign(zk, z * float(1 << FIXED_BITS))
    kk = k.ld(prm[TOP_K], s32)
    with k.if_(k.setp("gt", kk, 0, combine=("and", kk.bitcast(u32) < n))):
        with k.if_else(kk.bitcast(u32) > n_known) as (beyond, inside):
            with beyond:
                k.assign(trunc, k.setp("eq", tid, tid))
                k.assign(cut, kappa)
            with inside:
                k.assign(cut, blk.radix_select(keys, nu, one, kk.bitcast(u32).to(u64), 1,
                                               hist_w, hist_n))
        k.assign(zk, mass_above(cut).to(f64))
    tp = k.ld(prm[TOP_P], f32)
    with k.if_(tp < 1.0):
        want = k.max((tp.to(f64) * zk).to(u64, rnd="rpi"), k.mov(1, u64))
        floor = k.max(cut, k.mov(1, u64))
        have = mass_above(k.max(floor, kappa))
        with k.if_else(want > have) as (beyond, inside):
            with beyond:
                k.assign(trunc, k.setp("eq", tid, tid))
                k.max(cut, kappa, out=cut)
            with inside:
                k.max(cut, blk.radix_select(keys, nu, mass, want, floor, hist_w, hist_n),
                      out=cut)
    mp = k.ld(prm[MIN_P], f32)
    with k.if_(mp > 0.0):
        thr = m + k.lg2(mp) * _LN2
        k.max(cut, k.min(ord_key(k, thr, k.mov(0xFFFFFFFF, u32)), top_key), out=cut)
    whole = k.setp("ne", kappa, 0, combine=("and", _no_filter(k, prm, n, temp)))
    k.max(cut, k.mov(1, u64), out=cut)
    with k.if_(k.setp("lt", cut, kappa, combine=("and", ~whole))):
        k.assign(trunc, k.setp("eq", tid, tid))
        k.assign(cut, kappa)

    # the kept keys: count, smallest, and the draw's weights per thread chunk
    chunk = (nu + (nthr - 1)) // nthr
    c0 = tid * chunk
    c1 = k.min(c0 + chunk, nu)

    def weight(key):
        y, _ = key_value(k, key)
        return k.select(key >= cut, _ex2_weight(k, y, m, scale_t), k.mov(0, u64))

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
    n_kept = blk.reduce(kept, "add", 0)
    low_key = blk.reduce(low, "min", 0xFFFFFFFFFFFFFFFF)
    total = blk.exclusive_scan_into(wsum, pref)

    pos = k.ld(pos_p[0]).bitcast(u32)
    seed_lo, seed_hi = k.ld(prm[SEED_LO]), k.ld(prm[SEED_HI])
    empty = k.setp("eq", total, 0, combine=("and", ~whole))
    with k.if_else(k.por(greedy, empty)) as (pick_top, sample):
        with pick_top:
            with k.for_range(tid, n_draws, nthr) as r:
                k.st(out[r], top_idx.bitcast(s32))
        with sample:
            with k.if_else(whole) as (everything, kept_set):
                with everything:
                    _draw_whole(k, spec, blk, scratch, cum, wpre, w_total, n, out, n_draws,
                                pos, seed_lo, seed_hi)
                with kept_set:
                    _draw_kept(k, blk, nthr, keys, pref, total, weight, chunk, nu, out, n_draws,
                               pos, seed_lo, seed_hi)

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


def _draw_kept(k, blk, nthr, keys, pref, total, weight, chunk, nu, out, n_draws, pos,
               seed_lo, seed_hi):
    """Draws over the kept keys of ``U``: one thread per draw."""
    with k.for_range(blk.tid, n_draws, nthr) as r:
        x0, x1, _x2, _x3 = philox4x32_10(k, (pos, r, 0, 0), (seed_lo, seed_hi))
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


def _draw_whole(k, spec, blk, scratch, cum, wpre, w_total, n, out, n_draws, pos,
                seed_lo, seed_hi):
    """Draws over the whole vocabulary, one thread per draw: a block by its
    tempered mass (f64), then a token inside it by a binary search of the
    block's running sums ``cum`` with a second 64-bit number."""
    S, T, R = spec.slice, spec.top, spec.record
    with k.for_range(blk.tid, n_draws, spec.block) as r:
        x0, x1, x2, x3 = philox4x32_10(k, (pos, r, 0, 0), (seed_lo, seed_hi))
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


CANONICAL = {"sampling": SamplingSpec()}

registry.register("sampling", SamplingSpec, build, CANONICAL, doc=__doc__.splitlines()[0])
