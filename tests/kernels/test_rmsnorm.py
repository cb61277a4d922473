"""RMSNorm and fused residual-add + RMSNorm against float64 numpy."""

import numpy as np
import pytest

from ptxgen.kernels import rmsnorm as R


def rel_err(out, ref) -> float:
    """``max|out - ref| / max|ref|`` in float64 (inf if ``out`` is not finite)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _run(run, spec, x, w, eps, res=None):
    rows, n = x.shape
    f = run.function(R.build, spec)
    grid, block, _ = R.launch_geometry(spec, rows)
    dx, dw, dout = run.array(x), run.array(w), run.poisoned(x.shape)
    if res is None:
        run.launch(f, grid, block, dx, dw, dout, n, eps)
        return run.get(dout), None
    dsum = run.poisoned(x.shape)
    run.launch(f, grid, block, dx, run.array(res), dsum, dw, dout, n, eps)
    return run.get(dout), run.get(dsum)


CASES = [(3, 37), (2, 516), (3, 259), (1, 1), (2, 1030), (2, 4), (3, 1024), (2, 2052)]


@pytest.mark.parametrize("rows,n", CASES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cache_vec", [0, 2])
def test_rmsnorm(run, rows, n, residual, cache_vec, rng):
    x = rng.standard_normal((rows, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32)
    res = rng.standard_normal((rows, n)).astype(np.float32) if residual else None
    spec = R.RmsNormSpec(residual=residual, block=128, cache_vec=cache_vec)
    out, s = _run(run, spec, x, w, 1e-5, res)
    ref = R.reference(x, w, 1e-5, res)
    if residual:
        ref, ref_sum = ref
        assert rel_err(s, ref_sum) <= 1e-6       # one f32 add
    for r in range(rows):
        assert rel_err(out[r], ref[r]) <= 1e-5, (r, rel_err(out[r], ref[r]))


def test_rmsnorm_approx(run, rng):
    x = rng.standard_normal((2, 300)).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    out, _ = _run(run, R.RmsNormSpec(precise=False, block=64), x, w, 1e-6)
    assert rel_err(out, R.reference(x, w, 1e-6)) <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n", [(1, 4096), (1, 8192), (64, 4096), (5, 14339)])
def test_rmsnorm_gpu(gpu_run, rows, n, rng):
    x = rng.standard_normal((rows, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    res = rng.standard_normal((rows, n)).astype(np.float32)
    for block, cv in ((256, 4), (1024, 2), (256, 0)):
        spec = R.RmsNormSpec(residual=True, block=block, cache_vec=cv)
        out, s = _run(gpu_run, spec, x, w, 1e-5, res)
        ref, ref_sum = R.reference(x, w, 1e-5, res)
        assert rel_err(out, ref) <= 1e-5
        assert rel_err(s, ref_sum) <= 1e-6
        out, _ = _run(gpu_run, R.RmsNormSpec(block=block, cache_vec=cv), x, w, 1e-6)
        assert rel_err(out, R.reference(x, w, 1e-6)) <= 1e-5


@pytest.mark.parametrize("bad", [dict(block=100), dict(block=2048), dict(residual=1),
                                 dict(cache_vec=3),
                                 dict(target="sm_10")])
def test_rmsnorm_refuses(bad):
    with pytest.raises((ValueError, TypeError)):
        R.RmsNormSpec(**bad)
