"""The sampler kernel against a float64 numpy chain written here (penalties,
top-k, top-p, min-p, temperature), Philox-4x32-10 against Random123's
known answers, and the draws' distribution by a chi-square test."""

import math
import os

import attrs
import numpy as np
import pytest

import ptxgen
from ptxgen.kernels import sampling as S
from ptxgen.kernels.plan import LaunchGeometry
from ptxgen.types import u32

# Random123 (D. E. Shaw Research), tests/kat_vectors, the three "philox4x32 10"
# lines: counter (4 words), key (2 words) -> output (4 words).
PHILOX_KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff),
     (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]

SPEC = S.SamplingSpec(block=64, top=16)      # slices of 128 logits, 16 keys each


# ----------------------------------------------------------------- reference
def ref_penalised(logits, history, pos, last_n, rep, freq, pres):
    """llama.cpp's penalties in float64: divide positive logits by ``rep``,
    multiply the others, subtract ``count * freq + presence``."""
    y = logits.astype(np.float64)
    if last_n == 0 or (rep == 1.0 and freq == 0.0 and pres == 0.0):
        return y
    n = pos + 1 if last_n < 0 else min(last_n, pos + 1)
    window = history[pos + 1 - n: pos + 1]
    window = window[(window >= 0) & (window < y.size)]
    for t, c in zip(*np.unique(window, return_counts=True)):
        v = y[t] * rep if y[t] <= 0 else y[t] / rep
        y[t] = v - (c * float(np.float32(freq)) + float(np.float32(pres)))
    return y


def ref_penalised_f32(logits, history, pos, last_n, rep, freq, pres):
    """The same in float32, one rounding per operation (the kernel's bits)."""
    y = logits.astype(np.float32)
    if last_n == 0 or (rep == 1.0 and freq == 0.0 and pres == 0.0):
        return y
    n = pos + 1 if last_n < 0 else min(last_n, pos + 1)
    window = history[pos + 1 - n: pos + 1]
    window = window[(window >= 0) & (window < y.size)]
    rep, freq, pres = np.float32(rep), np.float32(freq), np.float32(pres)
    for t, c in zip(*np.unique(window, return_counts=True)):
        v = y[t] * rep if y[t] <= 0 else y[t] / rep
        y[t] = v - (np.float32(c) * freq + pres)
    return y


def ref_kept(y, top_k, top_p, min_p):
    """Indices kept by top-k, top-p (on the top-k set's softmax), min-p, in
    descending order of ``y`` (ties: lower index first)."""
    order = np.lexsort((np.arange(y.size), -y))
    keep = y.size
    if 0 < top_k < y.size:
        keep = top_k
    if top_p < 1.0:
        ys = y[order[:keep]]
        p = np.exp(ys - ys[0])
        c = np.cumsum(p / p.sum())
        keep = min(keep, int(np.argmax(c >= top_p)) + 1 if top_p > 0 else 1)
    if min_p > 0:
        keep = min(keep, max(1, int(np.sum(y >= y.max() + math.log(min_p)))))
    return order[:keep]


def ref_probs(y, kept, temp):
    w = np.exp((y[kept] - y[kept].max()) / temp)
    return w / w.sum()


def ref_known(y, slice_, top):
    """How many of the largest logits the kernel knows exactly: each slice
    of ``slice_`` logits hands over its ``top`` largest; ``kappa`` is the
    largest of the slices' ``top``-th (slices of ``top`` or fewer hand over
    everything).  Ties: lower index first, as in :func:`ref_kept`."""
    order = np.lexsort((np.arange(y.size), -y))
    rank = np.empty(y.size, np.int64)
    rank[order] = np.arange(y.size)
    best = y.size - 1
    for lo in range(0, y.size, slice_):
        part = np.arange(lo, min(lo + slice_, y.size))
        if part.size > top:
            best = min(best, int(np.sort(rank[part])[top - 1]))
    return best + 1


def merged_width(top):
    """The last block's merged list: ``top`` rounded up to a power of two,
    at least 32 (docs/sampling.md)."""
    return max(32, 1 << (top - 1).bit_length())


def philox_ref(ctr, key):
    """Philox-4x32-10 in Python integers (Salmon et al., SC 2011)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) % 2**32, (k1 + 0xBB67AE85) % 2**32
        a, b = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (b >> 32) ^ c1 ^ k0, b % 2**32, (a >> 32) ^ c3 ^ k1, a % 2**32
    return c0, c1, c2, c3


def chi_square_p(counts, probs):
    """The p-value of Pearson's chi-square for ``counts`` against ``probs``;
    cells expected below 5 are pooled; the chi-square tail by the
    Wilson-Hilferty cube-root normal approximation."""
    n = counts.sum()
    e = probs * n
    small = e < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(e[~small], e[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    x2 = float(np.sum((obs - exp) ** 2 / exp))
    dof = obs.size - 1
    if dof < 1:
        return 1.0
    z = ((x2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


# ------------------------------------------------------------------ running
class Sampler:
    """One sampler kernel with its buffers on a backend runner."""

    def __init__(self, run, logits, spec=SPEC):
        self.run, self.spec = run, spec
        self.fn = run.function(S.build, spec)
        self.v = logits.size
        self.geometry = S.launch_geometry(spec, self.v)
        self.logits = run.array(logits.astype(np.float32))
        self.scratch = run.poisoned(S.scratch_words(spec, self.v), np.uint64)
        self.counter = run.array(np.zeros(1, np.uint32))

    def __call__(self, params, history, pos, n_draws=1):
        run = self.run
        out = run.poisoned(n_draws, np.int32)
        info = run.poisoned(S.INFO_WORDS, np.int32)
        work = run.poisoned(self.v, np.float32)
        run.launch(self.fn, self.geometry,
                   dict(logits=self.logits, n=self.v, history=run.array(history.astype(np.int32)),
                        pos=run.array(np.array([pos], np.int32)), params=run.array(params),
                        out=out, n_draws=n_draws, work=work, info=info, scratch=self.scratch,
                        counter=self.counter))
        assert int(run.get(self.counter)[0]) == 0, "the last block must reset the counter"
        return run.get(out), run.get(info), run.get(work)


def _logits(rng, v, spread=3.0):
    return (rng.standard_normal(v) * spread).astype(np.float32)


# --------------------------------------------------------------------- tests
@attrs.frozen
class _KatSpec:
    target: str = "sm_80"
    kernel_name = "philox_kat"


def _build_kat(spec):
    """A kernel: thread i runs Philox on the 6 words src[6i..6i+6)."""
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, maxntid=32) as k:
        src = k.param_ptr("src", u32)
        out = k.param_ptr("out", u32)
        i = k.tid.x
        with k.if_(i < len(PHILOX_KAT)):
            words = [k.ld(src[i * 6 + j]) for j in range(6)]
            for j, w in enumerate(S.philox4x32_10(k, words[:4], words[4:])):
                k.st(out[i * 4 + j], w)
    return m


def test_philox_known_answers(run):
    fn = run.function(_build_kat, _KatSpec())
    src = np.array([w for c, key, _ in PHILOX_KAT for w in (*c, *key)], np.uint32)
    out = run.poisoned(4 * len(PHILOX_KAT), np.uint32)
    run.launch(fn, LaunchGeometry(_KatSpec().kernel_name, 1, 32), dict(src=run.array(src), out=out))
    got = run.get(out).reshape(-1, 4)
    for (ctr, key, want), g in zip(PHILOX_KAT, got):
        assert tuple(int(x) for x in g) == want
        assert philox_ref(ctr, key) == want          # the test's own Philox too


@pytest.mark.parametrize("last_n,rep,freq,pres", [(24, 1.3, 0.0, 0.0), (24, 1.1, 0.25, 0.5),
                                                 (-1, 0.8, -0.1, 0.3)])
def test_penalties_exact(run, last_n, rep, freq, pres):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    v = 600
    x = _logits(rng, v)
    hist = rng.integers(0, v, 40).astype(np.int32)
    hist[5:9] = hist[20]                                # repeats: counts above 1
    hist[11] = -3                                        # out of range: ignored
    pos = 30
    params = S.pack_params(temperature=0.0, penalty_last_n=last_n, penalty_repeat=rep,
                           penalty_freq=freq, penalty_present=pres, seed=1)
    out, info, work = Sampler(run, x)(params, hist, pos)
    want32 = ref_penalised_f32(x, hist, pos, last_n, rep, freq, pres)
    assert np.array_equal(work.view(np.uint32), want32.view(np.uint32)), f"seed {seed}"
    want = ref_penalised(x, hist, pos, last_n, rep, freq, pres)
    scale = np.abs(x).astype(np.float64) * max(rep, 1 / rep) + 40 * abs(freq) + abs(pres)
    assert np.all(np.abs(work - want) <= 4 * 2.0 ** -24 * scale), f"seed {seed}"
    assert int(out[0]) == int(np.argmax(want32)), f"greedy after penalties, seed {seed}"
    assert info[1] & S.FLAG_GREEDY


@pytest.mark.parametrize("window", [-1, 700])
def test_penalties_long_window(run, window):
    """A window longer than the block (several tokens per thread) with many
    repeats: the counts come from shared atomics; bit-exact to f32."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    v = 600
    x = _logits(rng, v)
    hist = rng.integers(0, v, 900).astype(np.int32)
    hist[rng.integers(0, 900, 30)] = int(hist[7])            # one token seen 30+ times
    hist[rng.integers(0, 900, 20)] = rng.integers(v, 2 * v, 20)   # out of range: ignored
    pos = 850
    params = S.pack_params(temperature=0.0, penalty_last_n=window, penalty_repeat=1.25,
                           penalty_freq=0.07, penalty_present=0.3, seed=1)
    _out, info, work = Sampler(run, x)(params, hist, pos)
    want32 = ref_penalised_f32(x, hist, pos, window, 1.25, 0.07, 0.3)
    assert np.array_equal(work.view(np.uint32), want32.view(np.uint32)), f"seed {seed}"
    want = ref_penalised(x, hist, pos, window, 1.25, 0.07, 0.3)
    scale = np.abs(x).astype(np.float64) * 1.25 + 900 * 0.07 + 0.3
    assert np.all(np.abs(work - want) <= 4 * 2.0 ** -24 * scale), f"seed {seed}"


def _between(c, j):
    """A threshold halfway between the sorted cumulative values c[j-1], c[j]."""
    return float(0.5 * (c[j - 1] + c[j]))


@pytest.mark.parametrize("case", ["top_k", "top_p", "min_p", "all", "top_k_top_p"])
def test_filtered_sets(run, case):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    v = 1500
    x = _logits(rng, v, 2.0)
    x[rng.integers(0, v, 6)] += 6.0                     # a few strong tokens
    hist = rng.integers(0, v, 64).astype(np.int32)
    pos = 63
    pen = dict(penalty_last_n=32, penalty_repeat=1.2, penalty_freq=0.1, penalty_present=0.2)
    y = ref_penalised(x, hist, pos, 32, 1.2, 0.1, 0.2)
    order = np.lexsort((np.arange(v), -y))
    kw = {}
    if case in ("top_k", "all", "top_k_top_p"):
        kw["top_k"] = int(rng.integers(3, SPEC.top + 1))
    if case in ("top_p", "all", "top_k_top_p"):
        kk = kw.get("top_k", v)
        pk = np.exp(y[order[:kk]] - y[order[0]])
        ck = np.cumsum(pk / pk.sum())
        j = int(rng.integers(1, min(kk, 12)))
        kw["top_p"] = _between(ck, j)                    # keeps j + 1
    if case in ("min_p", "all"):
        j = int(rng.integers(2, 14))
        kw["min_p"] = float(np.exp(0.5 * (y[order[j - 1]] + y[order[j]]) - y[order[0]]))
    params = S.pack_params(temperature=0.7, seed=seed, **pen, **kw)
    want = ref_kept(y, kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    out, info, _ = Sampler(run, x)(params, hist, pos, n_draws=64)
    msg = f"seed {seed}, {kw}"
    assert int(info[0]) == want.size, msg
    assert int(info[2]) == int(want[-1]), msg
    assert not info[1] & S.FLAG_TRUNCATED, msg
    assert set(out.tolist()) <= set(want.tolist()), msg


@pytest.mark.parametrize("case", ["top_k", "top_p", "top_k_top_p", "ties", "mixed_sign"])
def test_cut_below_merged(run, case):
    """Cuts below the merged list (32 keys for SPEC): top-k past it, and
    top-p sets of more tokens, found by the radix select over every block's
    list; equal logits (``ties``) go to the lower index; with 60 positive
    logits among negative ones (``mixed_sign``) the keys searched differ in
    their top bit (the select's range spans all 64 bits)."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    v = 1500
    x = _logits(rng, v, 2.0)
    if case == "ties":
        x[rng.choice(v, 300, replace=False)] = np.float32(3.0)
    if case == "mixed_sign":
        x = np.minimum(x * 0.5 - 3.0, -0.01).astype(np.float32)
        x[rng.choice(v, 60, replace=False)] = rng.uniform(0.5, 5.0, 60).astype(np.float32)
    y = x.astype(np.float64)
    width = merged_width(SPEC.top)
    known = ref_known(y, SPEC.slice, SPEC.top)
    msg = f"seed {seed}, {known} known"
    assert known > width + 12, msg                      # the case needs keys below the list
    order = np.lexsort((np.arange(v), -y))
    if case == "mixed_sign":
        assert y[order[width - 1]] > 0 > y[order[known - 1]], msg
    kw = {}
    if case in ("top_k", "ties", "top_k_top_p", "mixed_sign"):
        kw["top_k"] = int(rng.integers(width + 10 if case == "top_k_top_p" else width + 1,
                                       known + 1))
    if case in ("top_p", "top_k_top_p"):
        kk = kw.get("top_k", v)
        pk = np.exp(y[order[:kk]] - y[order[0]])
        ck = np.cumsum(pk / pk.sum())
        j = int(rng.integers(width + 1, min(kk, known) - 1))
        kw["top_p"] = _between(ck, j)                    # keeps j + 1 > width
    params = S.pack_params(temperature=0.9, seed=seed, **kw)
    want = ref_kept(y, kw.get("top_k", 0), kw.get("top_p", 1.0), 0.0)
    out, info, _ = Sampler(run, x)(params, np.zeros(1, np.int32), 0, n_draws=64)
    msg += f", {kw}"
    assert want.size > width, msg
    assert int(info[3]) == known, msg
    assert int(info[0]) == want.size, msg
    assert int(info[2]) == int(want[-1]), msg
    assert not info[1] & S.FLAG_TRUNCATED, msg
    assert set(out.tolist()) <= set(want.tolist()), msg


@pytest.mark.parametrize("block,top", [(64, 64), (64, 24), (32, 40), (1024, 64)])
def test_merge_widths(run, block, top):
    """Other block sizes and list lengths: two keys a lane, a list padded
    to its power of two, one warp (no tree), 32 warps (the op's block past
    524,288 logits); top-k inside the merged list and below it, top-p
    inside it."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    spec = S.SamplingSpec(block=block, top=top)
    v = 1300
    x = _logits(rng, v, 2.0)
    y = x.astype(np.float64)
    width = merged_width(top)
    known = ref_known(y, 2 * block, top)
    order = np.lexsort((np.arange(v), -y))
    smp = Sampler(run, x, spec)
    pk = np.exp(y[order] - y[order[0]])
    ck = np.cumsum(pk / pk.sum())
    cases = [dict(top_k=int(rng.integers(2, min(top, known) + 1))),
             dict(top_p=_between(ck, int(rng.integers(2, min(width, known) - 1))))]
    if known > width + 1:
        cases.append(dict(top_k=int(rng.integers(width + 1, known + 1))))
    for kw in cases:
        want = ref_kept(y, kw.get("top_k", 0), kw.get("top_p", 1.0), 0.0)
        out, info, _ = smp(S.pack_params(temperature=1.1, seed=seed, **kw), np.zeros(1, np.int32),
                           0, n_draws=32)
        msg = f"seed {seed}, {kw}, {known} known"
        assert int(info[3]) == known, msg
        assert int(info[0]) == want.size and int(info[2]) == int(want[-1]), msg
        assert not info[1] & S.FLAG_TRUNCATED, msg
        assert set(out.tolist()) <= set(want.tolist()), msg


def _chi_square_case(run, params_kw, v, n_draws, spread, seed):
    rng = np.random.default_rng(seed)
    x = _logits(rng, v, spread)
    hist = rng.integers(0, v, 16).astype(np.int32)
    params = S.pack_params(seed=seed, **params_kw)
    out, info, _ = Sampler(run, x)(params, hist, 15, n_draws=n_draws)
    y = ref_penalised(x, hist, 15, params_kw.get("penalty_last_n", 0),
                      params_kw.get("penalty_repeat", 1.0), params_kw.get("penalty_freq", 0.0),
                      params_kw.get("penalty_present", 0.0))
    kept = ref_kept(y, params_kw.get("top_k", 0), params_kw.get("top_p", 1.0),
                    params_kw.get("min_p", 0.0))
    probs = ref_probs(y, kept, params_kw["temperature"])
    assert set(out.tolist()) <= set(kept.tolist())
    counts = np.array([np.sum(out == t) for t in kept])
    return chi_square_p(counts, probs), info


@pytest.mark.parametrize("params_kw,v,spread", [
    (dict(top_k=12, top_p=0.97, min_p=0.02, temperature=0.8, penalty_last_n=16,
          penalty_repeat=1.1), 1000, 1.5),
    (dict(temperature=1.3), 700, 1.0),                  # whole vocabulary
], ids=["chain", "whole_vocab"])
def test_draw_distribution(run, params_kw, v, spread):
    """Draws r = 0..n-1 of one launch (Philox counters (pos, r)) against the
    float64 filtered, tempered softmax: Pearson's chi-square at p > 1e-4,
    with a fixed seed and with a fresh one (printed on failure)."""
    n_draws = 3000
    p_fixed, info = _chi_square_case(run, params_kw, v, n_draws, spread, 12345)
    assert p_fixed > 1e-4, f"fixed seed 12345: chi-square p = {p_fixed:.2e}"
    if "top_k" not in params_kw:
        assert info[1] & S.FLAG_WHOLE
    fresh = int.from_bytes(os.urandom(4), "little")
    p_fresh, _ = _chi_square_case(run, params_kw, v, n_draws, spread, fresh)
    assert p_fresh > 1e-4, f"fresh seed {fresh}: chi-square p = {p_fresh:.2e}"


def _wide_case(run, seed, n_draws):
    rng = np.random.default_rng(seed)
    v = 1000
    x = _logits(rng, v, 1.0)
    y = x.astype(np.float64)
    order = np.lexsort((np.arange(v), -y))
    j = 50                                               # keeps 50 > 32 merged keys
    min_p = float(np.exp(0.5 * (y[order[j - 1]] + y[order[j]]) - y[order[0]]))
    params = S.pack_params(min_p=min_p, temperature=0.9, seed=seed)
    out, info, _ = Sampler(run, x)(params, np.zeros(1, np.int32), 0, n_draws=n_draws)
    kept = ref_kept(y, 0, 1.0, min_p)
    assert kept.size == j and int(info[0]) == j and not info[1] & S.FLAG_TRUNCATED
    assert set(out.tolist()) <= set(kept.tolist())
    counts = np.array([np.sum(out == t) for t in kept])
    return chi_square_p(counts, ref_probs(y, kept, 0.9))


def test_draw_distribution_wide_set(run):
    """A kept set larger than the merged list is drawn from the blocks'
    lists by chunks: chi-square at p > 1e-4, fixed and fresh seeds."""
    p_fixed = _wide_case(run, 4321, 3000)
    assert p_fixed > 1e-4, f"fixed seed 4321: chi-square p = {p_fixed:.2e}"
    fresh = int.from_bytes(os.urandom(4), "little")
    p_fresh = _wide_case(run, fresh, 3000)
    assert p_fresh > 1e-4, f"fresh seed {fresh}: chi-square p = {p_fresh:.2e}"


def test_same_seed_same_token_and_replay(run):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    x = _logits(rng, 900, 1.0)
    hist = rng.integers(0, 900, 8).astype(np.int32)
    smp = Sampler(run, x)
    p = S.pack_params(top_k=16, top_p=0.99, temperature=1.5, seed=seed)
    a = [int(smp(p, hist, pos)[0][0]) for pos in range(6)]
    b = [int(smp(p, hist, pos)[0][0]) for pos in range(6)]   # replays: same buffers
    assert a == b, f"seed {seed}"
    assert len(set(a)) > 1, f"six positions gave one token {a}, seed {seed}"
    many, _, _ = smp(p, hist, 3, n_draws=5)
    assert int(many[0]) == a[3], "draw 0 of a batch is the single draw"
    other = S.pack_params(top_k=16, top_p=0.99, temperature=1.5, seed=seed ^ 0x5A5A5A5A)
    c = [int(smp(other, hist, pos)[0][0]) for pos in range(6)]
    assert c != a, f"another seed gave the same six tokens, seed {seed}"


def test_truncation_reported(run):
    """A flat distribution with top-p and no top-k keeps more tokens than the
    blocks' lists hold: the set is cut at the known keys and flagged."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(2000) * 0.01).astype(np.float32)
    out, info, _ = Sampler(run, x)(S.pack_params(top_p=0.9, temperature=1.0, seed=seed),
                                   np.zeros(1, np.int32), 0, n_draws=32)
    assert info[1] & S.FLAG_TRUNCATED, f"seed {seed}"
    order = np.lexsort((np.arange(x.size), -x.astype(np.float64)))
    kept = order[:int(info[0])]
    assert int(info[0]) == int(info[3]) and int(info[2]) == int(kept[-1]), f"seed {seed}"
    assert set(out.tolist()) <= set(kept.tolist())


# -------------------------------------------------- boundaries reached exactly
def _tied_logits(rng, v, n_tied):
    """``n_tied`` equal logits at random indices; every other logit is
    -inf or lies more than 760 below them, where its weight is 0 in the
    kernel's 40-bit masses and in float64 (``exp(-760) == 0``): the top-k
    and top-p sums are exact, ``n_tied * 2^40`` and ``n_tied``."""
    x = np.where(rng.random(v) < 0.5, -np.inf, rng.uniform(-1000.0, -760.0, v))
    a = float(np.float32(rng.uniform(-2.0, 5.0)))
    tied = np.sort(rng.choice(v, n_tied, replace=False))
    x[tied] = a
    return x.astype(np.float32), tied


@pytest.mark.parametrize("n_tied", [2, 8, 32, 64])
def test_boundary_top_p_reached_by_ties(run, n_tied, rng):
    """``n_tied`` equal logits and ``top_p = j / n_tied`` (exact in f32):
    the first ``j`` of them reach ``top_p`` exactly, so top-p keeps ``j``
    tokens, the ``j`` lowest indices of the tie (not ``j + 1``).  With and
    without a top-k that keeps the whole tie (and some zero-weight tokens);
    64 tied tokens cut below the 32-key merged list (the radix select)."""
    v = 1500
    x, tied = _tied_logits(rng, v, n_tied)
    y = x.astype(np.float64)
    smp = Sampler(run, x)
    for top_k in (0, n_tied, n_tied + int(rng.integers(1, 9))):
        j = int(rng.integers(1, n_tied))
        top_p = j / n_tied
        assert float(np.float32(top_p)) == top_p
        want = ref_kept(y, top_k, top_p, 0.0)
        assert want.tolist() == tied[:j].tolist()          # the reference's own reading
        params = S.pack_params(top_k=top_k, top_p=top_p, temperature=0.8,
                               seed=int(rng.integers(1 << 62)))
        out, info, _ = smp(params, np.zeros(1, np.int32), 0, n_draws=48)
        msg = f"top_k {top_k}, top_p {j}/{n_tied}"
        assert int(info[0]) == j and int(info[2]) == int(tied[j - 1]), msg
        assert not info[1] & S.FLAG_TRUNCATED, msg
        assert set(out.tolist()) <= set(want.tolist()), msg


def test_boundary_min_p_one_keeps_tied_maxima(run, rng):
    """``min_p = 1`` puts the threshold exactly at the maximum
    (``y >= max + ln 1``): every logit equal to the maximum is kept (the
    threshold's key is the smallest of its value), nothing else.  Greedy
    (temperature 0) over tied maxima picks the lowest index."""
    v = 1500
    x = _logits(rng, v, 2.0)
    top = float(np.float32(x.max() + 1.0))
    tied = np.sort(rng.choice(v, int(rng.integers(2, 12)), replace=False))
    x[tied] = top
    y = x.astype(np.float64)
    want = ref_kept(y, 0, 1.0, 1.0)
    assert want.tolist() == tied.tolist()
    smp = Sampler(run, x)
    out, info, _ = smp(S.pack_params(min_p=1.0, temperature=1.0, seed=int(rng.integers(1 << 62))),
                       np.zeros(1, np.int32), 0, n_draws=64)
    assert int(info[0]) == tied.size and int(info[2]) == int(tied[-1])
    assert set(out.tolist()) <= set(tied.tolist())
    assert len(set(out.tolist())) > 1, "64 draws over equal weights gave one token"
    out, info, _ = smp(S.pack_params(temperature=0.0), np.zeros(1, np.int32), 0, n_draws=4)
    assert out.tolist() == [int(tied[0])] * 4 and info[1] & S.FLAG_GREEDY


def test_boundary_top_k_edges(run, rng):
    """top-k equal to the merged list's width, to the count of keys known
    exactly, and to the vocabulary (then it is off: with no other filter
    the draw covers the whole vocabulary); one below the vocabulary is a
    filter."""
    v = 1500
    x = _logits(rng, v, 2.0)
    y = x.astype(np.float64)
    width = merged_width(SPEC.top)
    known = ref_known(y, SPEC.slice, SPEC.top)
    assert known > width + 1, known
    order = np.lexsort((np.arange(v), -y))
    smp = Sampler(run, x)
    hist = np.zeros(1, np.int32)
    for top_k in (width, known):
        out, info, _ = smp(S.pack_params(top_k=top_k, temperature=1.0, seed=top_k), hist, 0,
                           n_draws=32)
        assert int(info[0]) == top_k and int(info[2]) == int(order[top_k - 1]), top_k
        assert int(info[3]) == known and not info[1] & S.FLAG_TRUNCATED, top_k
        assert set(out.tolist()) <= set(order[:top_k].tolist())
    out, info, _ = smp(S.pack_params(top_k=v, temperature=1.0, seed=3), hist, 0, n_draws=32)
    assert info[1] & S.FLAG_WHOLE and int(info[0]) == v and int(info[2]) == -1
    assert not info[1] & S.FLAG_TRUNCATED
    out, info, _ = smp(S.pack_params(top_k=v - 1, temperature=1.0, seed=3), hist, 0, n_draws=32)
    assert not info[1] & S.FLAG_WHOLE and info[1] & S.FLAG_TRUNCATED   # past the known keys
    assert int(info[0]) == known


def test_refuses_bad_input():
    with pytest.raises(ValueError):
        S.SamplingSpec(block=64, top=200)
    with pytest.raises(ValueError):
        S.launch_geometry(S.SamplingSpec(block=32), 32 * 64 * 2 + 1)
    with pytest.raises(ValueError):
        S.pack_params(seed=-1)
    with pytest.raises(ValueError):
        S.pack_params(top_p=float("nan"))
    with pytest.raises(ValueError):
        S.pack_params(penalty_last_n=-2)


@pytest.mark.gpu
def test_op_sample_llama_vocab(gpu_run):
    """The op at the 8B model's vocabulary (128,256): the kept set of the
    default chain, draws inside it, and the same seed giving the same token."""
    from ptxgen.driver import DeviceArray
    from ptxgen.driver.ops_sampling import sample, sampling_params
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    v = 128256
    x = _logits(rng, v, 2.5)
    x[rng.integers(0, v, 30)] += 9.0
    hist = rng.integers(0, v, 200).astype(np.int32)
    pos = 150
    kw = dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, penalty_last_n=64,
              penalty_repeat=1.1, penalty_freq=0.05, penalty_present=0.1, seed=seed)
    params = sampling_params(**kw)
    dx, dh = DeviceArray.from_numpy(x), DeviceArray.from_numpy(hist)
    info = DeviceArray.from_numpy(np.full(4, -7, np.int32))
    out = sample(dx, dh, pos, params, n_draws=256, info=info)
    got, inf = out.to_numpy(), info.to_numpy()
    y = ref_penalised(x, hist, pos, 64, 1.1, 0.05, 0.1)
    want = ref_kept(y, 40, 0.95, 0.05)
    assert int(inf[0]) == want.size and not inf[1] & S.FLAG_TRUNCATED, f"seed {seed}"
    assert set(got.tolist()) <= set(want.tolist()), f"seed {seed}"
    again = sample(dx, dh, pos, params, n_draws=256).to_numpy()
    assert np.array_equal(got, again), f"seed {seed}"
