"""The batched sampler (``SamplingSpec(rows=True)``, ``logprobs``): each row
of one launch against a one-row launch of the same inputs (the same tokens,
``info`` and penalised logits, bit for bit), its penalty window (a ring)
against the float chain written in test_sampling.py, greedy rows against
argmax with ties, the draws' distribution by chi-square, and the
log-probabilities against float64 log-softmax of the raw logits."""

import math

import numpy as np
import pytest

from ptxgen.kernels import sampling as S
from test_sampling import (Sampler, chi_square_p, ref_kept, ref_penalised, ref_penalised_f32,
                           ref_probs)

ONE = S.SamplingSpec(block=64, top=16)             # slices of 128 logits, 16 keys each
ROWS = S.SamplingSpec(block=64, top=16, rows=True)
LP_BOUND = 1e-5          # log-probabilities: absolute, against float64


def lse64(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return m + math.log(np.exp(x - m).sum())


class Rows:
    """A rows sampler over ``logits [B, V]`` with its workspace on a runner."""

    def __init__(self, run, logits, spec=ROWS):
        self.run, self.spec = run, spec
        self.B, self.v = logits.shape
        self.fn = run.function(S.build, spec)
        self.geo = S.launch_geometry(spec, self.v, self.B)
        self.logits = run.array(logits.astype(np.float32))
        self.scratch = run.poisoned((self.B, S.scratch_words(spec, self.v)), np.uint64)
        self.counter = run.array(np.zeros(self.B, np.uint32))

    def __call__(self, params, history, hist_len, pos, n_draws=1, info=True):
        """The outputs by name (``info=False``: a null ``info`` pointer)."""
        run, B, N = self.run, self.B, self.spec.logprobs
        got = {"out": run.poisoned((B, n_draws), np.int32),
               "work": run.poisoned((B, self.v), np.float32)}
        if info:
            got["info"] = run.poisoned((B, S.INFO_WORDS), np.int32)
        if N:
            got.update(logprob=run.poisoned((B, n_draws), np.float32),
                       top_ids=run.poisoned((B, N), np.int32),
                       top_logprobs=run.poisoned((B, N), np.float32))
        args = dict(logits=self.logits, n=self.v, history=run.array(history.astype(np.int32)),
                    window=history.shape[1], history_len=run.array(np.asarray(hist_len, np.int32)),
                    pos=run.array(np.asarray(pos, np.int32)), params=run.array(params),
                    out=got["out"], n_draws=n_draws, work=got["work"], info=got.get("info", 0),
                    scratch=self.scratch, counter=self.counter)
        args.update({k: got[k] for k in ("logprob", "top_ids", "top_logprobs") if k in got})
        run.launch(self.fn, self.geo, args)
        assert not run.get(self.counter).any(), "each row's last block must reset its counter"
        return {k: run.get(v) for k, v in got.items()}


def _ring(rng, seq, window, v):
    """The ring ``[window]`` of a sequence's tokens ``seq`` (token ``p`` at
    ``p % window``; slots no token of the last ``window`` reached hold
    other valid ids, which must not count)."""
    ring = rng.integers(0, v, window).astype(np.int32)
    for p in range(max(0, len(seq) - window), len(seq)):
        ring[p % window] = seq[p]
    return ring


def _window(seq, last_n, window):
    """The tokens a row's penalties count: its last ``min(last_n, len,
    window)`` (``last_n`` -1: ``min(len, window)``)."""
    n = len(seq) if last_n < 0 else min(last_n, len(seq))
    return seq[len(seq) - min(n, window):]


# per row: (sampling settings, history length, position - (history length - 1))
ROW_CASES = [
    (dict(temperature=0.0), 5, 0),
    (dict(temperature=0.0, penalty_last_n=8, penalty_repeat=1.3, penalty_present=0.4), 50, 0),
    (dict(top_k=12, top_p=0.9, min_p=0.02, temperature=0.8, penalty_last_n=16,
          penalty_repeat=1.1, penalty_freq=0.2), 40, 0),
    (dict(temperature=1.3), 7, 900),                             # whole vocabulary
    (dict(top_k=70, temperature=0.9), 3, 0),                     # a cut below the merged list
    (dict(min_p=0.05, temperature=0.7, penalty_last_n=-1, penalty_repeat=0.8,
          penalty_freq=-0.1), 60, 3),
]
WINDOW = 24


def _batch(rng, v, cases=ROW_CASES, spread=2.0):
    """Logits, packed params, rings, lengths, positions and the rows' token
    sequences for ``cases``."""
    B = len(cases)
    x = (rng.standard_normal((B, v)) * spread).astype(np.float32)
    x[:, rng.integers(0, v, 8)] += 5.0
    params = np.stack([S.pack_params(seed=int(rng.integers(0, 2**63)), **kw)
                       for kw, _, _ in cases])
    seqs = [rng.integers(0, v, n).astype(np.int32) for _, n, _ in cases]
    for s in seqs:                                   # repeated tokens: counts above 1
        s[len(s) // 2:] = rng.choice(s[:max(1, len(s) // 2)], len(s) - len(s) // 2)
    rings = np.stack([_ring(rng, s, WINDOW, v) for s in seqs])
    hist_len = np.array([len(s) for s in seqs], np.int32)
    pos = np.array([len(s) - 1 + d for (_, _, d), s in zip(cases, seqs)], np.int32)
    return x, params, rings, hist_len, pos, seqs


def test_rows_equal_one_row_launches(run, rng):
    """Every row's tokens (8 draws), ``info`` and penalised logits equal a
    one-row launch whose history holds the row's window at positions ``pos
    - n + 1 .. pos`` (ids -1, ignored, before), bit for bit."""
    v = 700
    x, params, rings, hist_len, pos, seqs = _batch(rng, v)
    got = Rows(run, x)(params, rings, hist_len, pos, n_draws=8)
    for b, (kw, _, _) in enumerate(ROW_CASES):
        win = _window(seqs[b], kw.get("penalty_last_n", 0), WINDOW)
        hist = np.full(int(pos[b]) + 1, -1, np.int32)
        hist[len(hist) - len(win):] = win
        out, info, work = Sampler(run, x[b], ONE)(params[b], hist, int(pos[b]), n_draws=8)
        assert np.array_equal(got["out"][b], out), (b, kw)
        assert np.array_equal(got["info"][b], info), (b, kw)
        assert np.array_equal(got["work"][b].view(np.uint32), work.view(np.uint32)), (b, kw)


def test_ring_window_penalties(run, rng):
    """The penalised logits of each row are llama.cpp's f32 chain over the
    row's last tokens as the ring holds them (wrapped, shorter than the
    ring, the whole history), bit for bit; greedy rows pick their argmax."""
    v = 600
    x, params, rings, hist_len, pos, seqs = _batch(rng, v)
    got = Rows(run, x)(params, rings, hist_len, pos)
    for b, (kw, _, _) in enumerate(ROW_CASES):
        win = _window(seqs[b], kw.get("penalty_last_n", 0), WINDOW)
        pen = (len(win), kw.get("penalty_repeat", 1.0), kw.get("penalty_freq", 0.0),
               kw.get("penalty_present", 0.0))
        want = ref_penalised_f32(x[b], win, len(win) - 1, *pen)
        assert np.array_equal(got["work"][b].view(np.uint32), want.view(np.uint32)), (b, kw)
        if kw["temperature"] == 0:
            assert int(got["out"][b, 0]) == int(np.argmax(want)), (b, kw)
            assert got["info"][b, 1] & S.FLAG_GREEDY


def test_greedy_rows_ties_go_to_the_lowest_index(run, rng):
    """Greedy rows whose largest logit appears several times (in different
    blocks, and made equal by a penalty): the lowest index wins, as
    ``argmax`` (llama.cpp's rule)."""
    v, B = 900, 4
    x = (rng.standard_normal((B, v)) * 2).astype(np.float32)
    ties = [np.sort(rng.choice(v, 3 + b, replace=False)) for b in range(B)]
    for b, t in enumerate(ties):
        x[b, t] = np.float32(9.5)
    # row 3: a lower index at 9.5 * 1.25, brought down to 9.5 by the penalty
    lower = int(ties[3][0]) // 2
    x[3, lower] = np.float32(9.5 * 1.25)
    params = np.stack([S.pack_params(temperature=0.0)] * 3
                      + [S.pack_params(temperature=0.0, penalty_last_n=4, penalty_repeat=1.25)])
    rings = np.full((B, 4), lower, np.int32)
    got = Rows(run, x)(params, rings, np.full(B, 1, np.int32), np.arange(B, dtype=np.int32))
    for b in range(3):
        assert int(got["out"][b, 0]) == int(ties[b][0]) == int(np.argmax(x[b]))
    assert int(got["out"][3, 0]) == min(lower, int(ties[3][0]))


def test_rows_draw_distribution(run, seed):
    """Draws r = 0..2999 of two rows of one launch (a filtered chain and the
    whole vocabulary) against the float64 tempered softmax of their kept
    sets: Pearson's chi-square at p > 1e-4."""
    rng = np.random.default_rng(seed)
    cases = [(dict(top_k=12, top_p=0.97, min_p=0.02, temperature=0.8, penalty_last_n=16,
                   penalty_repeat=1.1), 16, 0), (dict(temperature=1.3), 9, 0)]
    v = 700
    x, params, rings, hist_len, pos, seqs = _batch(rng, v, cases, spread=1.2)
    got = Rows(run, x)(params, rings, hist_len, pos, n_draws=3000)
    for b, (kw, _, _) in enumerate(cases):
        win = _window(seqs[b], kw.get("penalty_last_n", 0), WINDOW)
        y = ref_penalised(x[b], win, len(win) - 1, len(win), kw.get("penalty_repeat", 1.0),
                          0.0, 0.0)
        kept = ref_kept(y, kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
        draws = got["out"][b]
        assert set(draws.tolist()) <= set(kept.tolist()), (b, kw)
        counts = np.array([np.sum(draws == t) for t in kept])
        p = chi_square_p(counts, ref_probs(y, kept, kw["temperature"]))
        assert p > 1e-4, f"row {b} ({kw}): chi-square p = {p:.2e}"


LP = S.SamplingSpec(block=64, top=16, rows=True, logprobs=6)


@pytest.mark.parametrize("spec", [LP, S.SamplingSpec(block=64, top=16, rows=True,
                                                     logprobs=S.MAX_LOGPROBS)],
                         ids=["N6", "N20"])
def test_logprobs(run, rng, spec):
    """Rows asking for log-probabilities (penalties off, on, greedy, a
    whole-vocabulary draw) get each draw's ``log softmax(raw logits)`` and
    the top N in order within 1e-5 of float64, ties at the N-th place to the
    lower index; a row that does not ask keeps its outputs untouched."""
    N, v = spec.logprobs, 800
    cases = [(dict(top_k=20, temperature=0.9, logprobs=True), 10, 0),
             (dict(top_k=20, temperature=0.9, penalty_last_n=8, penalty_repeat=1.5,
                   penalty_present=1.0, logprobs=True), 10, 0),
             (dict(temperature=0.0, logprobs=True), 4, 0),
             (dict(temperature=1.0, logprobs=True), 4, 0),
             (dict(top_k=20, temperature=0.9), 10, 0)]
    x, params, rings, hist_len, pos, seqs = _batch(rng, v, cases)
    # ties straddling the N-th place, in different blocks
    order = np.lexsort((np.arange(v), -x[0].astype(np.float64)))
    x[0, rng.choice(order[N:], 3, replace=False)] = x[0, order[N - 1]]
    # the penalised window holds some of row 1's top tokens
    rings[1, :] = np.argsort(-x[1])[:WINDOW]
    got = Rows(run, x, spec)(params, rings, hist_len, pos, n_draws=4)
    for b, (kw, _, _) in enumerate(cases):
        lp, ids, tlp = got["logprob"][b], got["top_ids"][b], got["top_logprobs"][b]
        if not kw.get("logprobs"):
            assert np.all(np.isnan(lp)) and np.all(np.isnan(tlp)), b
            assert np.all(ids == -0x7F7F7F7F), b          # the runner's int poison
            continue
        lse = lse64(x[b])
        want_lp = x[b, got["out"][b]].astype(np.float64) - lse
        assert np.max(np.abs(lp - want_lp)) <= LP_BOUND, (b, lp, want_lp)
        order = np.lexsort((np.arange(v), -x[b].astype(np.float64)))[:N]
        assert np.array_equal(ids, order), (b, ids, order)
        assert np.max(np.abs(tlp - (x[b, order].astype(np.float64) - lse))) <= LP_BOUND, b


def test_logprobs_small_vocabulary(run, rng):
    """A vocabulary of fewer than N tokens: the top list ends with id -1
    and -inf; the log-probabilities of the rest sum to 1 (and no ``info``:
    a null pointer stays null in every row)."""
    spec = S.SamplingSpec(block=32, top=8, rows=True, logprobs=S.MAX_LOGPROBS)
    v = 13
    x = (rng.standard_normal((2, v)) * 3).astype(np.float32)
    params = np.stack([S.pack_params(temperature=0.8, seed=3, logprobs=True),
                       S.pack_params(temperature=0.0, logprobs=True)])
    got = Rows(run, x, spec)(params, np.zeros((2, 1), np.int32), np.zeros(2, np.int32),
                             np.zeros(2, np.int32), info=False)
    assert int(got["out"][1, 0]) == int(np.argmax(x[1]))
    for b in range(2):
        ids, tlp = got["top_ids"][b], got["top_logprobs"][b]
        order = np.lexsort((np.arange(v), -x[b].astype(np.float64)))
        assert np.array_equal(ids[:v], order) and np.all(ids[v:] == -1)
        assert np.all(np.isneginf(tlp[v:]))
        assert abs(np.exp(tlp[:v].astype(np.float64)).sum() - 1) <= 1e-5


def test_refuses_bad_input():
    with pytest.raises(ValueError, match="batch in 1"):
        S.launch_geometry(ROWS, 1000)
    with pytest.raises(ValueError, match="batch in 1"):
        S.launch_geometry(ROWS, 1000, 0)
    with pytest.raises(ValueError, match="rows=True"):
        S.launch_geometry(ONE, 1000, 4)
    assert S.launch_geometry(ROWS, 1000, 5).grid == (8, 5, 1)
    with pytest.raises(ValueError, match="logprobs must be an int in 0..20"):
        S.SamplingSpec(logprobs=21)
    with pytest.raises(ValueError, match="rows must be a bool"):
        S.SamplingSpec(rows=1)
    with pytest.raises(ValueError, match="logprobs must be a bool"):
        S.pack_params(logprobs=2)
    assert S.pack_params(logprobs=True)[10] == 1 and S.pack_params()[10] == 0
    assert LP.kernel_name == "sample_b64_t16_rows_lp6"
    # the logprob records follow the blocks' records and the running sums
    assert S.scratch_words(LP, 1000) == S.scratch_words(ROWS, 1000) + 8 * 7


def _op_case(rng, v, B, backend):
    """``ops.sample_rows`` with logprobs on ``B`` rows of ``v`` logits,
    against ``ops.sample`` row by row and float64 log-softmax."""
    from ptxgen.driver import ops
    x = (rng.standard_normal((B, v)) * 2.5).astype(np.float32)
    x[:, rng.integers(0, v, 30)] += 9.0
    W = 64
    seqs = [rng.integers(0, v, int(n)).astype(np.int32) for n in rng.integers(1, 200, B)]
    rings = np.stack([_ring(rng, s, W, v) for s in seqs])
    hist_len = np.array([len(s) for s in seqs], np.int32)
    pos = hist_len - 1
    settings = [dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, penalty_last_n=64,
                     penalty_repeat=1.1, penalty_freq=0.05, penalty_present=0.1),
                dict(temperature=0.0), dict(temperature=1.0), dict(top_p=0.9, temperature=0.7)]
    kws = [dict(settings[b % len(settings)], seed=int(rng.integers(0, 2**63)),
                logprobs=bool(b % 3)) for b in range(B)]
    params = np.stack([S.pack_params(**kw) for kw in kws])
    info = np.full((B, S.INFO_WORDS), -7, np.int32)
    out, lp, ids, tlp = ops.sample_rows(x, rings, hist_len, pos, params, n_draws=4, info=info,
                                        logprobs=8, backend=backend)
    for b, kw in enumerate(kws):
        hist = np.full(len(seqs[b]), -1, np.int32)
        win = _window(seqs[b], kw.get("penalty_last_n", 0), W)
        hist[len(hist) - len(win):] = win
        one_info = np.full(S.INFO_WORDS, -7, np.int32)
        one = ops.sample(x[b], hist, int(pos[b]), S.pack_params(**kw), n_draws=4, info=one_info,
                         backend=backend)
        assert np.array_equal(out[b], one) and np.array_equal(info[b], one_info), (b, kw)
        if kw["logprobs"]:
            lse = lse64(x[b])
            assert np.max(np.abs(lp[b] - (x[b, out[b]].astype(np.float64) - lse))) <= LP_BOUND
            order = np.lexsort((np.arange(v), -x[b].astype(np.float64)))[:8]
            assert np.array_equal(ids[b], order), b
            assert np.max(np.abs(tlp[b] - (x[b, order].astype(np.float64) - lse))) <= LP_BOUND


def test_op_sample_rows(rng):
    """The op on the emulator (blocks of 512 threads, two a row)."""
    _op_case(rng, 1500, 3, "emu")


@pytest.mark.gpu
def test_op_sample_rows_llama_vocab(rng):
    """The op at the 8B model's vocabulary (128,256), 16 rows of mixed
    settings, against the one-row op and float64."""
    from backends import cuda_available
    if not cuda_available():
        pytest.skip("no NVIDIA GPU / driver available")
    _op_case(rng, 128256, 16, "cuda")
