"""Log-probabilities for the server's ``logprobs`` / ``top_logprobs``
(``SamplingSpec.logprobs = N``): for a row whose parameters ask for them
(:func:`.pack_params` ``logprobs=True``), each draw's log-probability and
the ``N`` most likely tokens with theirs.

The distribution is the model's own: the log-softmax of the raw logits,
before penalties, filters and temperature (what OpenAI's API reports, and
llama-server's and vLLM's by default), whatever the row's sampling
settings; so a greedy row reports the same numbers as a sampled one.

Each block records the largest ``N`` keys of its raw slice (the same
64-bit keys as the sampler's: ties to the lower index), its raw max
``m_b`` and ``s_b = sum exp(x - m_b)`` after the blocks' records and the
running sums in ``scratch``.  Where the row's penalties are off, the raw
logits are the penalised ones and the block's sort serves; otherwise the
raw keys are sorted first (one more sort).  The last block forms
``lse = m + ln(sum_b s_b exp(m_b - m))`` (the sum in f64), writes
``logprob[r] = (logits[out[r]] - m) - ln(...)`` for each draw and merges
the blocks' lists into the row's top ``N``: ``top_ids[j]``,
``top_logprobs[j]`` in descending order (id -1 and ``-inf`` past a
vocabulary of fewer than ``N`` tokens).  Accuracy: within ``1e-5`` of
float64, absolute (``ex2.approx`` / ``lg2.approx``, f32 differences).
"""

from __future__ import annotations

from ptxgen.types import f32, f64, s32, u32, u64

from .blockops import key_value, ord_key
from .merge import merge_top, sort_slice
from .params import _LN2, _LOG2E, FREQ, LAST_N, LOGPROBS, PRESENT, REPEAT

__all__ = ["RawRecords"]


class RawRecords:
    """The blocks' raw records of one row and the last block's outputs.

    ``scratch``: the row's workspace (its records of ``spec.record`` words
    a block, then ``n`` running sums, then these records of ``N + 1``
    words a block); ``mrg``: the shared array of the block's sorted list."""

    def __init__(self, k, spec, blk, prm, scratch, n, mrg):
        self.k, self.spec, self.blk, self.mrg = k, spec, blk, mrg
        self.N = spec.logprobs
        self.on = k.ld(prm[LOGPROBS]).ne(0)
        # the penalties are off (the raw logits are the penalised ones), as
        # the chain decides it
        rep, freq, pres = (k.ld(prm[i], f32) for i in (REPEAT, FREQ, PRESENT))
        off = k.setp("eq", rep, 1.0, combine=("and", freq.eq(0.0)))
        off = k.setp("eq", pres, 0.0, combine=("and", off))
        self.pen_off = k.por(off, k.ld(prm[LAST_N], s32).eq(0))
        self.base = scratch + (k.nctaid.x * spec.record + n)
        self.rec = self.base + k.ctaid.x * (self.N + 1)

    def _write(self, m, s):
        """The block's record: the first ``N`` keys of ``mrg``, then ``(m, s)``."""
        k, blk = self.k, self.blk
        for j in k.strided(blk.tid, self.N, blk.n):
            k.st(self.rec[j], k.ld(self.mrg[j]))
        with k.if_(blk.tid.eq(0)):
            k.st(self.rec[self.N], k.pack(u64, m.bitcast(u32), s.bitcast(u32)))

    def before_penalties(self, raw, lo, nb):
        """With penalties on: sort the slice's raw logits (``raw``: the
        thread's two, ``-inf`` past the vocabulary) and write the record."""
        k, blk = self.k, self.blk
        ninf = float("-inf")
        with k.if_(k.pand(self.on, ~self.pen_off)):
            keys, mx = [], None
            for e, v in enumerate(raw):
                i = blk.tid + e * blk.n if e else blk.tid
                keys.append(k.select(i < nb, ord_key(k, v, lo + i), k.mov(0, u64)))
                mx = v if mx is None else k.max(mx, v)
            sort_slice(k, blk, keys, self.mrg, self.spec.merged)
            m = blk.reduce(mx, "max", ninf)
            s = k.var(f32, 0.0)
            with k.if_(m > ninf):
                for v in raw:
                    s += k.ex2((v - m) * _LOG2E)
            self._write(m, blk.reduce(s, "add", 0.0))
            k.bar_sync(0)                     # mrg is read before the chain's sort writes it

    def after_sort(self, mb, sb):
        """With penalties off: the chain's sorted slice, max and sum are the
        raw ones."""
        with self.k.if_(self.k.pand(self.on, self.pen_off)):
            self._write(mb, sb)

    def last_block(self, logits, out, n_draws, outputs):
        """The row's log-normaliser, each draw's log-probability, and the
        top ``N`` (``outputs = (logprob, top_ids, top_logprobs)``)."""
        k, blk, N = self.k, self.blk, self.N
        ninf = float("-inf")
        logprob, top_ids, top_lp = outputs
        g = k.nctaid.x
        with k.if_(self.on):
            mt = k.var(f32, ninf)
            st = k.var(f32, 0.0)
            with k.if_(blk.tid < g):
                a, c = k.unpack(k.ld(self.base[blk.tid * (N + 1) + N], cache="cg"), u32, 2)
                k.assign(mt, a.bitcast(f32))
                k.assign(st, c.bitcast(f32))
            m = blk.reduce(mt, "max", ninf)
            zt = k.var(f64, 0.0)
            with k.if_(k.setp("gt", mt, ninf, combine=("and", blk.tid < g))):
                k.assign(zt, st.to(f64) * k.ex2((mt - m) * _LOG2E).to(f64))
            lnz = k.lg2(blk.reduce(zt, "add", 0.0).to(f32)) * _LN2
            with k.for_range(blk.tid, n_draws, blk.n) as r:
                x = k.ld(logits[k.ld(out[r])])          # the thread's own draw, stored above
                k.st(logprob[r], (x - m) - lnz)
            k.bar_sync(0)                             # the draws read mrg
            merge_top(k, blk, self.base, N, N + 1, g, self.mrg, 32, k.mov(0, u64))
            for j in k.strided(blk.tid, N, blk.n):
                key = k.ld(self.mrg[j])
                y, idx = key_value(k, key)
                ok = key.ne(0)
                k.st(top_ids[j], k.select(ok, idx.bitcast(s32), k.mov(-1, s32)))
                k.st(top_lp[j], k.select(ok, (y - m) - lnz, k.mov(ninf, f32)))
