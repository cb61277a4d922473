"""RoPE with the per-head q/k RMSNorm in front (``RopeSpec.qk_norm``, Qwen3)
against float64.

The oracle: tests/kernels/formulas.py's RMSNorm (``math.fsum`` of the
squares) of each head with its weight, then its pair-by-pair rotation with
the inverse frequencies of the plain formula.  Heads are drawn at scales
a thousand-fold apart, so a sum of squares that strays across heads (or
misses a pair) fails by far more than the bound.

Bound: q and k within 2e-5 of each head's largest magnitude (the RMSNorm
kernel's 1e-5 relative, then RoPE's 1e-5 of the largest element); the
cached K is the stored k converted to the cache type bit for bit, the
cached V is v converted, and nothing else of q, k or the caches moves.
"""

import numpy as np
import pytest

from formulas import llama3_inv_freq, rmsnorm, rope_rotate
from ptxgen.kernels import rope as R

BOUND = 2e-5


def oracle(x, w, eps, pos, spec):
    """float64 normalised and rotated heads ``x[heads, d]``."""
    f = (llama3_inv_freq(spec.theta, spec.head_dim, spec.factor, spec.low_freq_factor,
                         spec.high_freq_factor, spec.original_context)
         if spec.scaling == "llama3" else llama3_inv_freq(spec.theta, spec.head_dim))
    return rope_rotate(rmsnorm(x, w, eps), pos, f, spec.layout)


def head_err(got, want) -> float:
    """The largest ``max|got - want| / max|want|`` over the heads (rows)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.max(np.abs(got - want), axis=-1) / np.max(np.abs(want), axis=-1)))


def _heads(rng, n, d):
    """Random heads at scales 1e-2 ... 10 (a different one each)."""
    scale = 10.0 ** rng.uniform(-2, 1, (n, 1))
    return (rng.standard_normal((n, d)) * scale).astype(np.float32)


def _bits(x):
    x = np.ascontiguousarray(x)
    return x.view(np.uint16 if x.dtype == np.float16 else np.uint32)


def _caches(rng, spec, n_kv, cap):
    """Caches poisoned with NaN (f32) or a random fill (f16)."""
    if spec.append == "f32":
        return [np.full((n_kv, cap, spec.head_dim), np.nan, np.float32) for _ in range(2)]
    return [rng.standard_normal((n_kv, cap, spec.head_dim)).astype(np.float16)
            for _ in range(2)]


def _run(run, spec, q, k, wq, wk, eps, pos, v=None, caches=None):
    f = run.function(R.build, spec)
    n_q, n_kv = q.shape[0], k.shape[0]
    dq, dk = run.array(q), run.array(k)
    args = dict(q=dq, k=dk, freqs=run.array(R.freq_table(spec)),
                pos_ptr=run.array(np.array([pos], np.int32)), n_q_heads=n_q, n_kv_heads=n_kv,
                q_norm=run.array(wq), k_norm=run.array(wk), eps=eps)
    if spec.append != "none":
        dkc, dvc = (run.array(c) for c in caches)
        args.update(v=run.array(v), k_cache=dkc, v_cache=dvc, capacity=caches[0].shape[1])
    run.launch(f, R.launch_geometry(spec, n_q, n_kv), args)
    out = [run.get(dq), run.get(dk)]
    if spec.append != "none":
        out += [run.get(dkc), run.get(dvc)]
    return out


#: head sizes and the thread mapping they take: 128 (a warp a head, two
#: pairs a thread), 64 (a warp, one pair), 96 (16 threads, three pairs),
#: 16 (8 threads: four heads share a warp)
SPECS = [R.RopeSpec(head_dim=d, layout=lay, theta=th, scaling=sc, append=app, qk_norm=True,
                    block=64)
         for d, lay, th, sc, app in [(128, "neox", 1e6, "none", "f16"),
                                     (128, "interleaved", 5e5, "llama3", "f16"),
                                     (64, "neox", 1e4, "none", "none"),
                                     (96, "interleaved", 1e4, "none", "f32"),
                                     (16, "neox", 1e4, "none", "f16")]]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout}-{s.head_dim}-{s.append}")
@pytest.mark.parametrize("heads", [(32, 8), (7, 3)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_qk_norm_rope(run, spec, heads, rng):
    """Each q and k head normalised with its weight and rotated; with append,
    this position's cache rows hold the stored k and the given v and every
    other row is as it was.  7 + 3 heads leave the last block part empty."""
    n_q, n_kv = heads
    d, cap = spec.head_dim, 9
    q, k, v = _heads(rng, n_q, d), _heads(rng, n_kv, d), _heads(rng, n_kv, d)
    wq, wk = (rng.uniform(0.5, 1.5, d).astype(np.float32) for _ in range(2))
    eps = float(rng.choice([1e-6, 1e-5]))
    pos = int(rng.integers(0, cap))
    caches = _caches(rng, spec, n_kv, cap) if spec.append != "none" else None
    out = _run(run, spec, q, k, wq, wk, eps, pos, v, caches)
    gq, gk = out[:2]
    assert head_err(gq, oracle(q, wq, eps, pos, spec)) <= BOUND
    assert head_err(gk, oracle(k, wk, eps, pos, spec)) <= BOUND
    if spec.append == "none":
        return
    gkc, gvc = out[2:]
    cty = caches[0].dtype
    np.testing.assert_array_equal(_bits(gkc[:, pos]), _bits(gk.astype(cty)))
    np.testing.assert_array_equal(_bits(gvc[:, pos]), _bits(v.astype(cty)))
    others = np.arange(cap) != pos
    np.testing.assert_array_equal(_bits(gkc[:, others]), _bits(caches[0][:, others]))
    np.testing.assert_array_equal(_bits(gvc[:, others]), _bits(caches[1][:, others]))


def test_qk_norm_uses_each_weight_and_eps(run, rng):
    """The q heads take q_norm and the k heads k_norm (swapping them moves
    both past the bound), and eps counts: heads of magnitude 1e-3 with eps
    1e-5 are far from those with eps 1e-6."""
    spec = SPECS[2]
    d = spec.head_dim
    q = _heads(rng, 4, d)
    k = (rng.standard_normal((2, d)) * 1e-3).astype(np.float32)
    wq, wk = rng.uniform(0.5, 1.5, d).astype(np.float32), rng.uniform(2, 3, d).astype(np.float32)
    pos, eps = int(rng.integers(0, 1000)), 1e-5
    gq, gk = _run(run, spec, q, k, wq, wk, eps, pos)
    assert head_err(gq, oracle(q, wq, eps, pos, spec)) <= BOUND
    assert head_err(gk, oracle(k, wk, eps, pos, spec)) <= BOUND
    assert head_err(gq, oracle(q, wk, eps, pos, spec)) > 100 * BOUND
    assert head_err(gk, oracle(k, wk, 1e-6, pos, spec)) > 100 * BOUND


def test_qk_norm_out_of_range_leaves_cache(run, rng):
    """A position past the capacity, or negative: q and k are still normalised
    and rotated, the caches untouched."""
    spec = SPECS[1]
    d = spec.head_dim
    q, k, v = _heads(rng, 4, d), _heads(rng, 2, d), _heads(rng, 2, d)
    wq, wk = (rng.uniform(0.5, 1.5, d).astype(np.float32) for _ in range(2))
    for pos in (5, -1):
        caches = _caches(rng, spec, 2, 5)
        gq, gk, gkc, gvc = _run(run, spec, q, k, wq, wk, 1e-6, pos, v, caches)
        assert head_err(gq, oracle(q, wq, 1e-6, pos, spec)) <= BOUND
        assert head_err(gk, oracle(k, wk, 1e-6, pos, spec)) <= BOUND
        np.testing.assert_array_equal(_bits(gkc), _bits(caches[0]))
        np.testing.assert_array_equal(_bits(gvc), _bits(caches[1]))


def _offset(arr, elems):
    return arr.view(offset=4 * elems)


@pytest.mark.parametrize("paged", [0, 16], ids=["rows", "paged16"])
@pytest.mark.parametrize("layout", ["interleaved", "neox"])
def test_qk_norm_rows(run, layout, paged, rng):
    """The rows form (a chunk's, and with ``paged`` a batch's): row y of a
    padded [T_max, q | k | v | pad] buffer at position start + y (paged: its
    own position and slot, one slot -1), rows at or past T and the padding
    untouched, each row's K/V in its cache row or slot."""
    spec = R.RopeSpec(head_dim=64, layout=layout, theta=1e6, append="f16", rows=True,
                      paged=paged, qk_norm=True, block=64)
    n_q, n_kv, d, t_max, T, start = 4, 2, 64, 5, 4, 3
    stride = (n_q + 2 * n_kv) * d + 8
    qkv = (rng.standard_normal((t_max, stride)) * 10.0 ** rng.uniform(-2, 1, (t_max, 1))
           ).astype(np.float32)
    wq, wk = (rng.uniform(0.5, 1.5, d).astype(np.float32) for _ in range(2))
    eps = 1e-6
    if paged:
        nb = 3
        shape = (nb, n_kv, paged, d)
        positions = rng.integers(0, 30000, t_max).astype(np.int32)
        slots = rng.choice(nb * paged, t_max, replace=False).astype(np.int32)
        slots[int(rng.integers(0, T))] = -1
    else:
        cap = 12
        shape = (n_kv, cap, d)
        positions = start + np.arange(t_max, dtype=np.int32)
    kc, vc = (rng.standard_normal(shape).astype(np.float16) for _ in range(2))
    f = run.function(R.build, spec)
    dqkv, dkc, dvc = run.array(qkv), run.array(kc), run.array(vc)
    args = dict(q=dqkv, k=_offset(dqkv, n_q * d), freqs=run.array(R.freq_table(spec)),
                n_q_heads=n_q, n_kv_heads=n_kv, v=_offset(dqkv, (n_q + n_kv) * d),
                row_stride=stride, n_rows_ptr=run.array(np.array([T], np.int32)),
                q_norm=run.array(wq), k_norm=run.array(wk), eps=eps)
    if paged:
        args.update(positions=run.array(positions), k_pool=dkc, v_pool=dvc,
                    n_slots=nb * paged, slots=run.array(slots))
    else:
        args.update(pos_ptr=run.array(np.array([start], np.int32)), k_cache=dkc, v_cache=dvc,
                    capacity=cap)
    run.launch(f, R.launch_geometry(spec, n_q, n_kv, t_max), args)
    out, gkc, gvc = run.get(dqkv), run.get(dkc), run.get(dvc)
    want_kc, want_vc = kc.copy(), vc.copy()
    qe, ke = n_q * d, (n_q + n_kv) * d
    for y in range(t_max):
        if y >= T:
            np.testing.assert_array_equal(out[y], qkv[y])
            continue
        pos = int(positions[y])
        q, k = qkv[y, :qe].reshape(n_q, d), qkv[y, qe:ke].reshape(n_kv, d)
        gk = out[y, qe:ke].reshape(n_kv, d)
        assert head_err(out[y, :qe].reshape(n_q, d), oracle(q, wq, eps, pos, spec)) <= BOUND
        assert head_err(gk, oracle(k, wk, eps, pos, spec)) <= BOUND
        np.testing.assert_array_equal(out[y, ke:], qkv[y, ke:])      # v and the padding
        v = qkv[y, ke:ke + n_kv * d].reshape(n_kv, d)
        if paged:
            if slots[y] >= 0:
                blk, off = divmod(int(slots[y]), paged)
                want_kc[blk, :, off], want_vc[blk, :, off] = gk, v
        else:
            want_kc[:, pos], want_vc[:, pos] = gk, v
    np.testing.assert_array_equal(_bits(gkc), _bits(want_kc))
    np.testing.assert_array_equal(_bits(gvc), _bits(want_vc))


def test_qk_norm_reference_matches_the_oracle(rng):
    spec = SPECS[1]
    x, w = rng.standard_normal((3, spec.head_dim)), rng.uniform(0.5, 1.5, spec.head_dim)
    pos = int(rng.integers(0, 1 << 16))
    assert head_err(R.qk_norm_reference(x, w, 1e-6, pos, spec), oracle(x, w, 1e-6, pos, spec)) \
        < 1e-9


def test_qk_norm_threads_names_parameters_and_refusals():
    mapping = {d: (R.RopeSpec(head_dim=d, qk_norm=True).head_threads,
                   R.RopeSpec(head_dim=d, qk_norm=True).pairs_per_thread)
               for d in (16, 64, 96, 128, 256, 512)}
    assert mapping == {16: (8, 1), 64: (32, 1), 96: (16, 3), 128: (32, 2), 256: (32, 4),
                       512: (32, 8)}
    spec = R.RopeSpec(layout="interleaved", append="f16", qk_norm=True)
    assert spec.kernel_name == "rope_interleaved_d128_app16_qknorm"
    assert R.launch_geometry(spec, 32, 8).grid == ((32 + 8) * 32 // 128, 1, 1)
    params = [line.strip().rstrip(",").split()[-1] for line in R.build(spec).to_ptx().splitlines()
              if line.strip().startswith(".param")]
    assert params == ["q", "k", "freqs", "pos_ptr", "n_q_heads", "n_kv_heads", "v", "k_cache",
                      "v_cache", "capacity", "q_norm", "k_norm", "eps"]
    for d in (72, 200):            # 9 and 25 pairs a thread
        with pytest.raises(ValueError, match="qk_norm: head_dim"):
            R.RopeSpec(head_dim=d, qk_norm=True)
    with pytest.raises(TypeError, match="qk_norm"):
        R.RopeSpec(qk_norm=1)


@pytest.mark.gpu
def test_qk_norm_rope_gpu(gpu_run, rng):
    spec = R.RopeSpec(theta=1e6, append="f16", qk_norm=True)
    d, cap = 128, 64
    q, k, v = _heads(rng, 32, d), _heads(rng, 8, d), _heads(rng, 8, d)
    wq, wk = (rng.uniform(0.5, 1.5, d).astype(np.float32) for _ in range(2))
    pos = int(rng.integers(0, cap))
    caches = _caches(rng, spec, 8, cap)
    gq, gk, gkc, gvc = _run(gpu_run, spec, q, k, wq, wk, 1e-6, pos, v, caches)
    assert head_err(gq, oracle(q, wq, 1e-6, pos, spec)) <= BOUND
    assert head_err(gk, oracle(k, wk, 1e-6, pos, spec)) <= BOUND
    np.testing.assert_array_equal(_bits(gkc[:, pos]), _bits(gk.astype(np.float16)))
    np.testing.assert_array_equal(_bits(gvc[:, pos]), _bits(v.astype(np.float16)))
