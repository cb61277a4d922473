"""RoPE (NeoX and interleaved, Llama-3 scaling) against float64 numpy."""

import numpy as np
import pytest

from ptxgen.kernels import rope as R


def rel_err(out, ref) -> float:
    """``max|out - ref| / max|ref|`` in float64 (inf if ``out`` is not finite)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _run(run, spec, q, k, pos):
    f = run.function(R.build, spec)
    n_q, n_kv = q.shape[0], k.shape[0]
    grid, block, _ = R.launch_geometry(spec, n_q, n_kv)
    dq, dk = run.array(q), run.array(k)
    run.launch(f, grid, block, dq, dk, run.array(R.freq_table(spec)),
               run.array(np.array([pos], np.int32)), n_q, n_kv)
    return run.get(dq), run.get(dk)


SPECS = [
    R.RopeSpec(head_dim=64, block=64),
    R.RopeSpec(head_dim=128, layout="interleaved", block=64),
    R.RopeSpec(head_dim=128, theta=500000.0, scaling="llama3", block=64),
    R.RopeSpec(head_dim=64, layout="interleaved", theta=500000.0, scaling="llama3",
               factor=32.0, original_context=8192, block=32),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout}-{s.head_dim}-{s.scaling}")
@pytest.mark.parametrize("pos", [0, 1, 17, 4099, 131071])
def test_rope(run, spec, pos):
    rng = np.random.default_rng(pos + spec.head_dim)
    q = rng.standard_normal((5, spec.head_dim)).astype(np.float32)
    k = rng.standard_normal((1, spec.head_dim)).astype(np.float32)
    gq, gk = _run(run, spec, q, k, pos)
    for got, x in ((gq, q), (gk, k)):
        ref = R.reference(x, pos, spec)
        for h in range(x.shape[0]):
            assert rel_err(got[h], ref[h]) <= 1e-5, (h, rel_err(got[h], ref[h]))


def test_llama3_frequencies():
    # Llama-3.1 8B: theta 5e5, factor 8, low 1, high 4, original context 8192
    spec = R.RopeSpec(theta=500000.0, scaling="llama3")
    f = R.inv_freq(spec)
    base = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    wl = 2 * np.pi / base
    assert np.allclose(f[wl < 8192 / 4], base[wl < 8192 / 4])       # high frequencies kept
    assert np.allclose(f[wl > 8192], base[wl > 8192] / 8)           # low frequencies / factor
    t = R.freq_table(spec).astype(np.float64)
    assert np.max(np.abs(t[:, 0] + t[:, 1] - f) / f) < 1e-13


@pytest.mark.gpu
def test_rope_gpu(gpu_run):
    spec = R.RopeSpec(theta=500000.0, scaling="llama3")
    rng = np.random.default_rng(5)
    q = rng.standard_normal((32, 128)).astype(np.float32)
    k = rng.standard_normal((8, 128)).astype(np.float32)
    for pos in (0, 8191, 100000):
        gq, gk = _run(gpu_run, spec, q, k, pos)
        assert rel_err(gq, R.reference(q, pos, spec)) <= 1e-5
        assert rel_err(gk, R.reference(k, pos, spec)) <= 1e-5


@pytest.mark.parametrize("bad", [dict(head_dim=7), dict(head_dim=1024), dict(layout="gptj"),
                                 dict(theta=0.0), dict(scaling="yarn"),
                                 dict(scaling="llama3", low_freq_factor=4.0, high_freq_factor=1.0)])
def test_rope_refuses(bad):
    with pytest.raises(ValueError):
        R.RopeSpec(**bad)
