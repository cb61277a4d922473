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
``block`` threads, ``8 * max(G * top, 2 * block)`` bytes of dynamic shared
memory (:func:`launch_geometry`: the union ``U`` of the blocks' lists in the
last block, the slice and its penalty counts before).  Block ``b`` owns the slice
``[2 * block * b, ...)`` of the vocabulary: it loads it into shared memory,
applies the penalties (the window's tokens counted per logit in shared
memory, then each thread updates its own logits), writes the penalised
logits to ``work`` (f32[V]), sorts its keys
``(order(logit) << 32) | ~index`` (each warp its 64 in registers, then a
tree of warp merges, :mod:`.merge`) and writes its ``top`` largest keys,
its max ``m_b``, ``sum exp(y - m_b)`` and ``sum exp((y - m_b) / T)`` and
its ``top``-th key ``kappa_b`` to ``scratch``.  The last block to finish (a
counter, as in ``argmax``; it resets the counter, so the launch replays)
merges (:mod:`.last_block`): the global max ``m``, the full normaliser
``Z``, ``kappa = max_b kappa_b`` and ``S``, the largest ``L`` keys of the
union ``U`` of the lists, sorted (``L``: ``top`` rounded up to a power of
two, at least 32).  Every key above ``kappa`` is in ``U``: the sorted
order of the whole vocabulary is known exactly down to ``kappa`` (at least
``top`` tokens, usually thousands), and ``S`` holds its first ``L``.
Then:

- top-k (``0 < k < V``): ``S[k - 1]``; past ``L``, the k-th largest key of
  ``U`` by a weighted radix select over shared histograms (:mod:`.select`);
- top-p (``p < 1``): the largest key ``c`` with
  ``sum_{key >= c} exp(y - m) >= p * Z_k`` (``Z_k``: the top-k set's sum,
  or ``Z``), in 40-bit fixed-point masses (integer sums: the same in every
  launch whatever the order): a binary search of ``S``'s running masses,
  or the radix select below ``S``;
- min-p (``p > 0``): ``y >= m + ln(p)``; the top token always stays;
- the draw (``T > 0``): weights ``round(2^40 * exp((y - m) / T))`` over the
  kept keys, integer running sums (over ``S``, or over ``U`` by chunks when
  the kept set is larger), and ``floor(r * total / 2^64)`` for a 64-bit
  ``r`` from Philox-4x32-10 keyed by the 64-bit seed with the counter
  ``(position, draw, 0, 0)``; ``T <= 0`` picks the top key (argmax of the
  penalised logits, ties to the lowest index).

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
words), logprobs (0/1: the row's log-probabilities are wanted), one
reserved word.  The window is ``history[pos - n + 1 .. pos]``
(prompt and generated tokens, as llama-cli accepts both), ``pos`` read from
the int32 at ``pos``; ids outside ``[0, V)`` are ignored.

Batched (``rows=True``, :mod:`.rows`): ``grid.y`` rows of logits in one
launch, each with its own parameters, penalty window (a ring ``[B,
window]`` with a per-row count), position, outputs and workspace; row
``y``'s result equals a one-row launch's on the same inputs.  Log-
probabilities (``logprobs = N``, :mod:`.logprobs`): each draw's and the
top ``N`` tokens' under the log-softmax of the raw logits, for rows that
ask.
"""

from __future__ import annotations

from types import SimpleNamespace

import attrs

import ptxgen
from ptxgen import registry
from ptxgen.types import f32, f64, s32, u32, u64

from ..plan import LaunchGeometry
from ..spec_fields import block_field, pdl_field, pdl_prologue, target_field
from .blockops import Block, SharedView, ord_key
from .last_block import merge_and_draw
from .logprobs import RawRecords
from .merge import list_width, sort_slice
from .params import (_LOG2E, FIXED_BITS, FLAG_GREEDY, FLAG_TRUNCATED, FLAG_WHOLE, FREQ,
                     INFO_WORDS, LAST_N, MAX_LOGPROBS, MAX_ROWS, PARAM_WORDS, PRESENT, REPEAT,
                     TEMP, ex2_weight, no_filter, pack_params)
from .philox import philox4x32_10
from .rows import row_arrays

__all__ = ["SamplingSpec", "build", "launch_geometry", "scratch_words", "pack_params",
           "PARAM_WORDS", "INFO_WORDS", "FIXED_BITS", "FLAG_TRUNCATED", "FLAG_WHOLE",
           "FLAG_GREEDY", "MAX_LOGPROBS", "MAX_ROWS", "philox4x32_10"]


def _check_top(inst, attr, v):
    if not (isinstance(v, int) and 1 <= v <= 2 * inst.block):
        raise ValueError(f"{attr.name} must be an int in 1..2*block ({2 * inst.block}), got {v!r}")


def _check_rows(inst, attr, v):
    if not isinstance(v, bool):
        raise ValueError(f"{attr.name} must be a bool, got {v!r}")


def _check_logprobs(inst, attr, v):
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS:
        raise ValueError(f"{attr.name} must be an int in 0..{MAX_LOGPROBS} (the top "
                         f"log-probabilities a row reports), got {v!r}")


@attrs.frozen
class SamplingSpec:
    """A sampler kernel.

    Parameters
    ----------
    block : int
        Threads per block; each block owns ``2 * block`` logits.
    top : int
        Keys each block hands to the merge (the exact top-k limit).
    rows : bool
        Batched: ``grid.y`` rows of logits, each with its own parameters,
        penalty window, position, outputs and workspace (:mod:`.rows`).
    logprobs : int
        0, or ``N`` in 1..20: the launch also writes each draw's
        log-probability and the ``N`` most likely tokens with theirs
        (:mod:`.logprobs`), for rows whose parameters ask for them.
    target : str
    pdl : bool
    """

    block: int = block_field(512)
    top: int = attrs.field(default=64, validator=_check_top)
    rows: bool = attrs.field(default=False, validator=_check_rows)
    logprobs: int = attrs.field(default=0, validator=_check_logprobs)
    target: str = target_field()
    pdl: bool = pdl_field()

    @property
    def kernel_name(self) -> str:
        return (f"sample_b{self.block}_t{self.top}" + ("_rows" if self.rows else "")
                + (f"_lp{self.logprobs}" if self.logprobs else ""))

    @property
    def slice(self) -> int:
        return 2 * self.block

    @property
    def merged(self) -> int:
        """``L``: keys of the last block's sorted merge (``top`` rounded up
        to a power of two, at least 32)."""
        return list_width(self.top)

    @property
    def record(self) -> int:
        """u64 words of a block's record in ``scratch``."""
        return self.top + 3

    def check_power_of_two(self):
        if self.slice & (self.slice - 1):
            raise ValueError(f"block must be a power of two for the bitonic sort, got {self.block}")


def blocks_for(spec: SamplingSpec, n: int) -> int:
    return max(1, -(-n // spec.slice))


def launch_geometry(spec: SamplingSpec, n: int, batch: int | None = None):
    """The launch for a vocabulary of ``n`` logits (and with ``rows``,
    ``batch`` rows of them: ``grid.y``)."""
    if n < 1:
        raise ValueError(f"the vocabulary must hold at least one logit, got {n}")
    g = blocks_for(spec, n)
    if g > spec.block:
        raise ValueError(f"{n} logits need {g} blocks of {spec.slice}; at most block = "
                         f"{spec.block} blocks: use a larger block")
    if spec.rows:
        if batch is None or isinstance(batch, bool) or not 1 <= batch <= MAX_ROWS:
            raise ValueError(f"a rows sampler needs batch in 1..{MAX_ROWS}, got {batch!r}")
    elif batch not in (None, 1):
        raise ValueError(f"{spec.kernel_name} samples one row; batch={batch!r} needs "
                         "SamplingSpec(rows=True)")
    return LaunchGeometry(spec.kernel_name, (g, batch or 1, 1), spec.block,
                          8 * max(g * spec.top, spec.slice))


def scratch_words(spec: SamplingSpec, n: int) -> int:
    """u64 words of ``scratch`` for ``n`` logits (a row's, with ``rows``): a
    record per block, the running sums of the whole-vocabulary draw (one per
    logit), and with ``logprobs`` a record per block of its top raw logits."""
    g = blocks_for(spec, n)
    return g * spec.record + n + (g * (spec.logprobs + 1) if spec.logprobs else 0)


def _penalties(k, blk, vals, counts, history, pos_p, prm, lo, nb, nthreads, ring=None):
    """Apply the window's penalties to ``vals`` (the block's slice): the
    threads count the window's tokens that fall in the slice into
    ``counts`` (shared u32[slice], native shared atomics), then each
    thread updates its own logits.  Starts and ends with a barrier.

    The window: ``history[pos - n + 1 .. pos]``; with ``ring = (have,
    window)`` (the rows mode) the last ``n`` of ``have`` tokens of a ring
    of ``window`` entries, token ``p`` at ``history[p % window]`` (``n``
    at most ``window``)."""
    last_n = k.ld(prm[LAST_N], s32)
    rep, freq, pres = (k.ld(prm[i], f32) for i in (REPEAT, FREQ, PRESENT))
    off = k.setp("eq", rep, 1.0, combine=("and", freq.eq(0.0)))
    off = k.setp("eq", pres, 0.0, combine=("and", off))
    off = k.por(off, last_n.eq(0))
    if ring is None:
        pos = k.ld(pos_p[0])
        have = pos + 1
    else:
        have, window = ring
    nwin = k.select(last_n < 0, have, k.min(last_n, have))
    nwin = k.select(have < 0, k.mov(0, s32), nwin)
    if ring is not None:
        nwin = k.min(nwin, window.bitcast(s32))
    start = (have - nwin).bitcast(u32)
    nw = nwin.bitcast(u32)
    with k.if_(~off):
        for e in (0, 1):
            k.st(counts[blk.tid + e * nthreads if e else blk.tid], k.mov(0, u32))
        k.bar_sync(0)
        with k.for_range(blk.tid, nw, nthreads) as j:
            at = start + j if ring is None else (start + j) % window
            rel = k.ld(history[at]).bitcast(u32) - lo
            with k.if_(rel < nb):
                k.red("add", counts[rel], k.mov(1, u32))
        k.bar_sync(0)
        for e in (0, 1):
            i = blk.tid + e * nthreads if e else blk.tid
            cnt = k.ld(counts[i])
            with k.if_(cnt > 0):
                v = k.ld(vals[i])
                v2 = k.select(v <= 0.0, v * rep, v / rep)
                pen = cnt.to(f32) * freq + pres
                k.st(vals[i], v2 - pen)
    k.bar_sync(0)


def build(spec: SamplingSpec) -> ptxgen.Module:
    """PTX for ``spec``; parameters ``logits: f32*, n: u32, history: s32*,
    pos: s32*, params: u32*, out: s32*, n_draws: u32, work: f32*, info: s32*
    (or 0), scratch: u64*, counter: u32*``; with ``rows`` (:mod:`.rows`)
    ``logits, n, history, window: u32, history_len: s32*, pos, params, out,
    n_draws, work, info, scratch, counter``, each array one row per
    ``grid.y``; with ``logprobs`` also ``logprob: f32*, top_ids: s32*,
    top_logprobs: f32*`` (:mod:`.logprobs`)."""
    spec.check_power_of_two()
    nthr, S, T, R = spec.block, spec.slice, spec.top, spec.record
    NL = spec.logprobs
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, maxntid=nthr) as k:
        pdl_prologue(k, spec)
        logits = k.param_ptr("logits", f32)
        n = k.param("n", u32)
        history = k.param_ptr("history", s32)
        if spec.rows:
            window = k.param("window", u32)
            hist_len = k.param_ptr("history_len", s32)
        pos_p = k.param_ptr("pos", s32)
        prm = k.param_ptr("params", u32, align=16)
        out = k.param_ptr("out", s32)
        n_draws = k.param("n_draws", u32)
        work = k.param_ptr("work", f32)
        info = k.param_ptr("info", s32)
        scratch = k.param_ptr("scratch", u64, align=8)
        counter = k.param_ptr("counter", u32)
        if NL:
            lp_out = (k.param_ptr("logprob", f32), k.param_ptr("top_ids", s32),
                      k.param_ptr("top_logprobs", f32))
        if spec.rows:
            # this row's part of every array
            (logits, history, hist_len, pos_p, prm, out, work, info, scratch, counter,
             lp_out) = row_arrays(k, spec, n, n_draws, window, logits, history, hist_len, pos_p,
                                  prm, out, work, info, scratch, counter,
                                  lp_out if NL else None)

        blk = Block(k, nthr)
        keys = k.dynamic_shared("keys", u64, align=16)
        # the slice and its penalty counts share the dynamic array with U
        vals = SharedView(k, keys, f32)
        pref = k.shared_array("pref", u64, nthr + 1, align=8)
        L = spec.merged
        sh = SimpleNamespace(
            pref=pref, wpre=k.shared_array("wpre", f64, nthr + 1, align=8),
            mrg=k.shared_array("merged", u64, (nthr // 32) * L, align=16),
            cmass=k.shared_array("cmass", u64, L, align=16),
            ctemp=k.shared_array("ctemp", u64, L, align=16),
            hist_lo=k.shared_array("hist_lo", u32, 256, align=16),
            hist_hi=k.shared_array("hist_hi", u32, 256, align=16),
            hist_n=k.shared_array("hist_n", u32, 256, align=16))
        last = k.shared_array("is_last", u32, 4, align=16)
        counts = SharedView(k, keys, u32, 4 * S)
        tid = blk.tid
        ninf = float("-inf")

        temp = k.ld(prm[TEMP], f32)
        greedy = temp <= 0.0
        scale_t = k.select(greedy, k.mov(0.0, f32), _LOG2E / k.max(temp, 1e-30))

        # ---- this block's slice: load, penalise, keys, statistics, sort
        lo = k.ctaid.x * S
        nb = k.min(n - lo, S)
        raw = []                                    # the slice's logits as loaded
        for e in (0, 1):
            i = tid + e * nthr if e else tid
            v = k.var(f32, ninf)
            with k.if_(i < nb):
                v.set(k.ld(logits[lo + i], nc=True))
            k.st(vals[i], v)
            raw.append(v)
        k.bar_sync(0)
        if NL:
            lp = RawRecords(k, spec, blk, prm, scratch, n, sh.mrg)
            lp.before_penalties(raw, lo, nb)
        _penalties(k, blk, vals, counts, history, pos_p, prm, lo, nb, nthr,
                   ring=(k.ld(hist_len[0]), window) if spec.rows else None)
        mloc = k.var(f32, ninf)
        pair = []
        for e in (0, 1):
            i = tid + e * nthr if e else tid
            v = k.ld(vals[i])
            ok = i < nb
            pair.append(k.select(ok, ord_key(k, v, lo + i), k.mov(0, u64)))
            with k.if_(ok):
                k.st(work[lo + i], v)
                k.max(mloc, v, out=mloc)
        sort_slice(k, blk, pair, sh.mrg, L)         # the slice's top L keys, sorted
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
        with k.if_(no_filter(k, prm, n, temp)):
            w_pair = []
            for e in (0, 1):
                i = (tid << 1) + e
                v = k.ld(vals[i])
                w_pair.append(k.select(k.pand(i < nb, finite), ex2_weight(k, v, mb, scale_t),
                                       k.mov(0, u64)))
            k.assign(tot_b, blk.exclusive_scan_into(w_pair[0] + w_pair[1], pref))
            base = k.ld(pref[tid])
            i0 = tid << 1
            with k.if_(i0 < nb):
                k.st(cum[lo + i0], base + w_pair[0])
            with k.if_(i0 + 1 < nb):
                k.st(cum[lo + i0 + 1], base + w_pair[0] + w_pair[1])

        if NL:
            lp.after_sort(mb, sb)
        rec = scratch + k.ctaid.x * R
        for j in k.strided(tid, T, nthr):
            k.st(rec[j], k.ld(sh.mrg[j]))
        with k.if_(tid.eq(0)):
            k.st(rec[T], k.pack(u64, mb.bitcast(u32), sb.bitcast(u32)))
            k.st(rec[T + 1], tot_b)
            k.st(rec[T + 2], k.select(nb > T, k.ld(sh.mrg[T - 1]), k.mov(0, u64)))
        k.fence("acq_rel", "gpu")
        k.bar_sync(0)
        with k.if_(tid.eq(0)):
            old = k.atom("add", counter[0], 1)
            k.st(last[0], k.select((old + 1).eq(k.nctaid.x), k.mov(1, u32), k.mov(0, u32)))
        k.bar_sync(0)
        with k.if_(k.ld(last[0]).eq(1)):
            k.fence("acq_rel", "gpu")
            merge_and_draw(k, spec, blk, SimpleNamespace(**locals()))
            if NL:
                lp.last_block(logits, out, n_draws, lp_out)
    return m


CANONICAL = {"sampling": SamplingSpec(),
             # the batched engine's: rows, with the top 20 log-probabilities
             "sampling_rows": SamplingSpec(rows=True, logprobs=MAX_LOGPROBS)}

registry.register("sampling", SamplingSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
