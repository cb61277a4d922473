"""RMSNorm and fused residual-add + RMSNorm against float64 numpy.

The oracle is ``formulas.rmsnorm`` (tests/kernels/formulas.py: the mean
square by ``math.fsum`` row by row).  ``rmsnorm.reference`` (used by other
tests) is checked against it here, on rows whose mean square is near eps
as well as on ordinary ones, so that eps's sign and presence matter.
"""

import numpy as np
import pytest

from formulas import rmsnorm as formula
from ptxgen.kernels import rmsnorm as R


def want(x, w, eps, res=None):
    """The oracle: ``(out, sum)`` with a residual, else ``out``."""
    s = np.asarray(x, np.float64) + (0 if res is None else np.asarray(res, np.float64))
    out = formula(s, w, eps)
    return out if res is None else (out, s)


def rel_err(out, ref) -> float:
    """``max|out - ref| / max|ref|`` in float64 (inf if ``out`` is not finite)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _run(run, spec, x, w, eps, res=None):
    rows, n = x.shape
    f = run.function(R.build, spec)
    geo = R.launch_geometry(spec, rows)
    odt = np.float16 if spec.out_type == "f16" else np.float32
    args = dict(x=run.array(x), w=run.array(w), out=run.poisoned(x.shape, odt), n=n, eps=eps)
    if res is None:
        run.launch(f, geo, args)
        return run.get(args["out"]), None
    dsum = run.poisoned(x.shape)
    run.launch(f, geo, dict(args, res=run.array(res), sum_out=dsum))
    return run.get(args["out"]), run.get(dsum)


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
    ref = want(x, w, 1e-5, res)
    if residual:
        ref, ref_sum = ref
        assert rel_err(s, ref_sum) <= 1e-6       # one f32 add
    for r in range(rows):
        assert rel_err(out[r], ref[r]) <= 1e-5, (r, rel_err(out[r], ref[r]))


@pytest.mark.parametrize("rows,n", [(3, 260), (2, 1030), (2, 37)])
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_f16_out(run, rows, n, residual, rng):
    """An f16 ``out`` is the f32 kernel's result rounded to nearest, to one
    f16 step (the f16 kernel's f32 value may differ from the f32 kernel's by
    an ulp, which at a rounding midpoint moves the rounded result a step:
    seed 386471388), and within 2^-11 + 1e-5 of float64, plus half the f16
    subnormal step, on the one-pass rows (260), the two-pass rows (1030 > 4
    * 2 * 64) and the scalar ones (37)."""
    x = rng.standard_normal((rows, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32)
    res = rng.standard_normal((rows, n)).astype(np.float32) if residual else None
    kw = dict(residual=residual, block=64, cache_vec=2)
    out32, s32 = _run(run, R.RmsNormSpec(**kw), x, w, 1e-5, res)
    out16, s16 = _run(run, R.RmsNormSpec(out_type="f16", **kw), x, w, 1e-5, res)
    assert out16.dtype == np.float16
    near = out32.astype(np.float16)
    step = np.spacing(np.abs(near)).astype(np.float64)
    assert np.all(np.abs(out16.astype(np.float64) - near) <= step)
    if residual:
        assert np.array_equal(s16, s32)
    ref = want(x, w, 1e-5, res)
    ref = ref[0] if residual else ref
    err = np.abs(out16.astype(np.float64) - ref)
    assert np.all(err <= (2.0 ** -11 + 1e-5) * np.abs(ref) + 2.0 ** -25), float(np.max(err))


@pytest.mark.parametrize("heads,groups,n,stride", [(4, 3, 64, 384), (8, 2, 128, 1536),
                                                   (3, 5, 37, 200)])
def test_rmsnorm_grouped(run, heads, groups, n, stride, rng):
    """Rows in groups ``stride`` apart (the q heads of each token of a
    chunk): each row normed on its own, nothing written between the groups'
    rows."""
    spec = R.RmsNormSpec(grouped=True, block=64)
    buf = rng.standard_normal((groups, stride)).astype(np.float32) * 2
    w = rng.standard_normal(n).astype(np.float32)
    rows = buf[:, :heads * n].reshape(groups, heads, n)
    ref = want(rows.reshape(-1, n), w, 1e-6).reshape(groups, heads, n)
    f = run.function(R.build, spec)
    geo = R.launch_geometry(spec, heads, groups)
    assert geo.grid == (heads, groups, 1)
    dout = run.poisoned(buf.shape)
    run.launch(f, geo, dict(x=run.array(buf), w=run.array(w), out=dout, n=n, eps=1e-6,
                            stride=stride))
    got = run.get(dout)
    normed = got[:, :heads * n].reshape(groups, heads, n)
    assert rel_err(normed, ref) <= 1e-5, rel_err(normed, ref)
    assert np.all(np.isnan(got[:, heads * n:])), "a grouped row wrote past its group's rows"


@pytest.mark.parametrize("rows,n", [(3, 37), (2, 516), (2, 1030), (2, 2052)])
@pytest.mark.parametrize("cache_vec", [0, 2])
def test_rmsnorm_accumulate(run, rows, n, cache_vec, rng):
    """``accumulate``: the normed row added to what ``out`` holds (a residual
    stream of its own scale), on the one-pass, two-pass and scalar-tail paths."""
    x = rng.standard_normal((rows, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32)
    stream = (rng.standard_normal((rows, n)) * 10).astype(np.float32)
    spec = R.RmsNormSpec(block=128, cache_vec=cache_vec, accumulate=True)
    f = run.function(R.build, spec)
    out = run.array(stream)
    run.launch(f, R.launch_geometry(spec, rows), dict(x=run.array(x), w=run.array(w), out=out,
                                                      n=n, eps=1e-5))
    got = run.get(out)
    ref = stream.astype(np.float64) + want(x, w, 1e-5)
    for r in range(rows):
        # the normed row to 1e-5 of itself, then one f32 add
        tol = 1e-5 * np.max(np.abs(want(x, w, 1e-5)[r])) + 2 ** -23 * np.max(np.abs(ref[r]))
        assert np.max(np.abs(got[r] - ref[r])) <= tol, r


def test_rmsnorm_grouped_refuses_a_residual():
    with pytest.raises(ValueError, match="residual"):
        R.RmsNormSpec(grouped=True, residual=True)
    with pytest.raises(ValueError, match="grouped"):
        R.launch_geometry(R.RmsNormSpec(), 4, 2)


def test_rmsnorm_approx(run, rng):
    x = rng.standard_normal((2, 300)).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    out, _ = _run(run, R.RmsNormSpec(precise=False, block=64), x, w, 1e-6)
    assert rel_err(out, want(x, w, 1e-6)) <= 1e-4


def _near_eps_rows(rng, rows, n, eps):
    """Rows whose mean square is eps times a factor in [0.5, 2]."""
    x = rng.standard_normal((rows, n))
    x /= np.sqrt(np.mean(x * x, axis=1, keepdims=True))
    return (x * np.sqrt(eps * rng.uniform(0.5, 2.0, (rows, 1)))).astype(np.float32)


@pytest.mark.parametrize("precise", [True, False])
@pytest.mark.parametrize("cache_vec", [0, 4])
def test_rmsnorm_mean_square_near_eps(run, precise, cache_vec, rng):
    """eps is as large as the rows' mean square: dropping it, or subtracting
    it, is off by far more than the bound (checked on the oracle too)."""
    eps = float(rng.uniform(1e-6, 1e-4))
    rows, n = 3, 260
    x = _near_eps_rows(rng, rows, n, eps)
    w = rng.standard_normal(n).astype(np.float32)
    bound = 1e-5 if precise else 1e-4
    for residual in (False, True):
        res = _near_eps_rows(rng, rows, n, eps) if residual else None
        spec = R.RmsNormSpec(residual=residual, block=64, precise=precise, cache_vec=cache_vec)
        out, _ = _run(run, spec, x, w, eps, res)
        ref = want(x, w, eps, res)
        ref = ref[0] if residual else ref
        for r in range(rows):
            assert rel_err(out[r], ref[r]) <= bound, (r, rel_err(out[r], ref[r]))
    s = x.astype(np.float64)
    assert rel_err(formula(s, w, 0.0), formula(s, w, eps)) > 100 * bound
    ms = np.mean(s * s, axis=1, keepdims=True)
    assert rel_err(s / np.sqrt(np.abs(ms - eps) + 1e-30) * w, formula(s, w, eps)) > 100 * bound


def test_rmsnorm_reference_matches_the_formula(rng):
    """rmsnorm.reference against the plain formula, ordinary rows and rows
    whose mean square is near eps, with and without a residual."""
    for eps in (1e-5, float(rng.uniform(1e-6, 1e-3))):
        for x in (rng.standard_normal((3, 67)) * 3, _near_eps_rows(rng, 3, 67, eps)):
            w = rng.standard_normal(67)
            res = rng.standard_normal(x.shape) * np.sqrt(eps)
            assert rel_err(R.reference(x, w, eps), formula(x, w, eps)) < 1e-13
            out, s = R.reference(x, w, eps, res)
            assert rel_err(out, formula(x + res, w, eps)) < 1e-13
            assert rel_err(s, x + res) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n", [(1, 4096), (1, 8192), (64, 4096), (5, 14339)])
def test_rmsnorm_gpu(gpu_run, rows, n, rng):
    x = rng.standard_normal((rows, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    res = rng.standard_normal((rows, n)).astype(np.float32)
    for block, cv in ((256, 4), (1024, 2), (256, 0)):
        spec = R.RmsNormSpec(residual=True, block=block, cache_vec=cv)
        out, s = _run(gpu_run, spec, x, w, 1e-5, res)
        ref, ref_sum = want(x, w, 1e-5, res)
        assert rel_err(out, ref) <= 1e-5
        assert rel_err(s, ref_sum) <= 1e-6
        out, _ = _run(gpu_run, R.RmsNormSpec(block=block, cache_vec=cv), x, w, 1e-6)
        assert rel_err(out, want(x, w, 1e-6)) <= 1e-5


@pytest.mark.parametrize("bad", [dict(block=100), dict(block=2048), dict(residual=1),
                                 dict(cache_vec=3),
                                 dict(target="sm_10"), dict(accumulate=True, residual=True),
                                 dict(accumulate=True, out_type="f16")])
def test_rmsnorm_refuses(bad):
    with pytest.raises((ValueError, TypeError)):
        R.RmsNormSpec(**bad)
