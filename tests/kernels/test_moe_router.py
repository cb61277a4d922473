"""The mixture-of-experts router against float64: logits, softmax, top-k
(ties to the lower expert id), renormalised weights.

The oracle is ``router.reference`` (float64 logits, softmax and a stable
sort written in numpy).  The kernel's logits are f32 sums, so where two
experts' float64 probabilities lie within ``TIE`` (relative) of each other
around the k-th place the test accepts either order; everywhere else the
ids must be the reference's exactly.  Weights: relative error at most
``BOUND`` (f32 dot products of 256..2048 terms, ``ex2.approx``, ``div.rn``).
"""

import numpy as np
import pytest

from ptxgen.kernels.moe import router as R

BOUND = 2e-5
TIE = 1e-4


def _run(run, spec, w, x, t=None, t_rows=1):
    f = run.function(R.build, spec)
    E, NU = spec.n_expert, spec.n_used
    ids = run.poisoned((t_rows, NU), np.int32)
    wts = run.poisoned((t_rows, NU), np.float32)
    counter = run.array(np.zeros(t_rows, np.uint32))
    args = dict(w=run.array(w), x=run.array(x), logits=run.poisoned((t_rows, E)),
                counter=counter, ids=ids, weights=wts)
    if spec.rows:
        args["t_ptr"] = run.array(np.array([t], np.uint32))
    for _ in range(2):                    # a replay must find the counters reset
        run.launch(f, R.launch_geometry(spec, t_rows), args)
        assert not run.get(counter).any()
    return run.get(ids), run.get(wts)


def _check(ids, wts, w, x, n_used, seed):
    _, rid, rw = R.reference(w, x, n_used)
    p = np.exp(x.astype(np.float64) @ w.astype(np.float64).T)
    p /= p.sum()
    if not np.array_equal(ids, rid):
        # only a near tie may come out in another order
        kth = p[rid[-1]]
        for a, b in zip(ids, rid):
            assert a == b or (abs(p[a] - p[b]) <= TIE * kth), f"seed={seed}: {ids} vs {rid}"
        _, rw = R.route(np.log(p), n_used)
        rw = p[ids] / max(p[ids].sum(), R.CLAMP)
    err = np.max(np.abs(wts - rw) / np.abs(rw))
    assert err <= BOUND, f"seed={seed}: weights off by {err:.3g}"
    assert np.all(np.diff(p[ids]) <= TIE * p[ids][0]), f"seed={seed}: not descending"


def _data(rng, E, K):
    w = (rng.standard_normal((E, K)) / np.sqrt(K) * rng.uniform(0.5, 4)).astype(np.float32)
    x = rng.standard_normal(K).astype(np.float32)
    return w, x


@pytest.mark.parametrize("E,NU,K,block", [(8, 2, 256, 256), (128, 8, 2048, 256),
                                          (60, 4, 512, 128), (1, 1, 64, 32),
                                          (200, 6, 128, 64)])
def test_router_random(run, rng, seed, E, NU, K, block):
    spec = R.MoeRouterSpec(E, NU, K, block=block)
    w, x = _data(rng, E, K)
    ids, wts = _run(run, spec, w, x)
    _check(ids[0], wts[0], w, x, NU, seed)
    assert abs(float(wts.sum()) - 1.0) < 1e-5


def test_router_unnormalised(run, rng, seed):
    """norm_w=False: the chosen experts' probabilities as they are."""
    E, NU, K = 32, 4, 256
    spec = R.MoeRouterSpec(E, NU, K, norm_w=False, block=128)
    w, x = _data(rng, E, K)
    ids, wts = _run(run, spec, w, x)
    p = np.exp(x.astype(np.float64) @ w.astype(np.float64).T)
    p /= p.sum()
    err = np.max(np.abs(wts[0] - p[ids[0]]) / p[ids[0]])
    assert err <= BOUND, f"seed={seed}: probabilities off by {err:.3g}"
    _check(ids[0], wts[0] / wts[0].sum(), w, x, NU, seed)


@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_router_rows(run, rng, seed, tokens):
    """Up to T tokens of a chunk, ``tokens`` a CTA (a group cut short by T,
    a group wholly past it): the rows past the count in t_ptr are left
    alone (still poisoned)."""
    E, NU, K, T, t_rows = 16, 3, 256, 3, 5
    spec = R.MoeRouterSpec(E, NU, K, rows=True, block=128, tokens=tokens)
    w, _ = _data(rng, E, K)
    x = rng.standard_normal((t_rows, K)).astype(np.float32)
    ids, wts = _run(run, spec, w, x, t=T, t_rows=t_rows)
    for r in range(T):
        _check(ids[r], wts[r], w, x[r], NU, seed)
    assert np.all(ids[T:] == -0x7F7F7F7F) and np.all(np.isnan(wts[T:]))


def test_router_tokens_change_nothing(run, rng, seed):
    """Several tokens a CTA sum each logit in the same order as one: the
    ids and weights are bit for bit those of ``tokens=1``, at the 30B-A3B
    router's shape."""
    E, NU, K, T, t_rows = 128, 8, 2048, 7, 8
    w, _ = _data(rng, E, K)
    x = rng.standard_normal((t_rows, K)).astype(np.float32)
    one = _run(run, R.MoeRouterSpec(E, NU, K, rows=True), w, x, t=T, t_rows=t_rows)
    four = _run(run, R.MoeRouterSpec(E, NU, K, rows=True, tokens=4), w, x, t=T, t_rows=t_rows)
    for a, b in zip(one, four):
        assert np.array_equal(a[:T], b[:T]), f"seed={seed}"
    for r in range(T):
        _check(four[0][r], four[1][r], w, x[r], NU, seed)


def test_router_ties_to_the_lower_id(run, rng):
    """Experts with identical rows get bit-identical logits: the lower id
    comes first, and equal weights."""
    E, NU, K = 40, 4, 256
    w, x = _data(rng, E, K)
    w *= 0.25                                              # the others' logits: |z| < ~4
    top = (x / np.dot(x, x) * 12.0).astype(np.float32)     # a logit of about 12
    for e in (33, 7, 20):
        w[e] = top
    w[12] = (x / np.dot(x, x) * 9.0).astype(np.float32)    # the fourth, clearly
    spec = R.MoeRouterSpec(E, NU, K, block=128)
    ids, wts = _run(run, spec, w, x)
    assert ids[0].tolist() == [7, 20, 33, 12]
    assert wts[0, 0] == wts[0, 1] == wts[0, 2] > wts[0, 3]


@pytest.mark.parametrize("E,NU,K,block,rows", [(128, 8, 2048, 256, False),
                                               (16, 3, 256, 64, True)])
def test_router_norm(run, rng, seed, E, NU, K, block, rows):
    """The FFN's RMSNorm folded in: ``h`` is x's RMSNorm (``rmsnorm``'s
    float64 reference, within 1e-5 relative: the rmsnorm kernel's bound)
    and the ids and weights are those of its logits."""
    from ptxgen.kernels import rmsnorm
    T, t_rows = (2, 3) if rows else (1, 1)
    spec = R.MoeRouterSpec(E, NU, K, rows=rows, block=block, norm=True)
    w, _ = _data(rng, E, K)
    x = (rng.standard_normal((t_rows, K)) * rng.uniform(0.1, 10)).astype(np.float32)
    nw = (1.0 + 0.3 * rng.standard_normal(K)).astype(np.float32)
    eps = 1e-6
    f = run.function(R.build, spec)
    ids, wts = run.poisoned((t_rows, NU), np.int32), run.poisoned((t_rows, NU), np.float32)
    h = run.poisoned((t_rows, K))
    counter = run.array(np.zeros(t_rows, np.uint32))
    args = dict(w=run.array(w), x=run.array(x), nw=run.array(nw), eps=eps, h=h,
                logits=run.poisoned((t_rows, E)), counter=counter, ids=ids, weights=wts)
    if rows:
        args["t_ptr"] = run.array(np.array([T], np.uint32))
    run.launch(f, R.launch_geometry(spec, t_rows), args)
    assert not run.get(counter).any()
    ids, wts, h = run.get(ids), run.get(wts), run.get(h)
    for t in range(T):
        ref_h = rmsnorm.reference(x[t], nw, eps)
        err = np.max(np.abs(h[t] - ref_h)) / np.max(np.abs(ref_h))
        assert err <= 1e-5, f"seed={seed}: h of token {t} off by {err:.3g}"
        # the ids and weights of the float64 normed row's logits
        _check(ids[t], wts[t], w, ref_h, NU, seed)
    assert np.all(np.isnan(h[T:]))


@pytest.mark.parametrize("bad, message", [
    (dict(n_expert=0, n_used=1, k=64), "n_expert must be an int in 1..1024"),
    (dict(n_expert=8, n_used=9, k=64), r"n_used must be an int in 1..8"),
    (dict(n_expert=8, n_used=2, k=66), "k must be a positive multiple of 4"),
    (dict(n_expert=8, n_used=2, k=64, tokens=2), "tokens=2 needs rows"),
    (dict(n_expert=8, n_used=2, k=64, rows=True, block=64, tokens=4),
     "tokens=4 is more than the block's 2 warps"),
])
def test_router_refuses(bad, message):
    with pytest.raises(ValueError, match=message):
        R.MoeRouterSpec(**bad)
