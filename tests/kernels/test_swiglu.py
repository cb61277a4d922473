"""SwiGLU ``silu(g) * u`` against float64 numpy.

The oracle is ``formulas.swiglu`` (a scalar sigmoid split by the sign of
g, where ``swiglu.reference`` writes ``g / (1 + exp(-g))`` over arrays);
the reference is checked against it too.  Inputs span |g| up to ~16, where silu's two
regimes (about g and about 0) both occur.
"""

import numpy as np
import pytest

from formulas import geglu as geglu_formula
from formulas import swiglu as formula
from ptxgen.kernels import swiglu as S


def rel_err(out, ref) -> float:
    """``max|out - ref| / max|ref|`` in float64 (inf if ``out`` is not finite)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _run(run, spec, g, u, offset=0):
    n = g.size
    f = run.function(S.build, spec)
    dg, du = run.array(np.concatenate([np.ones(offset, np.float32), g])), run.array(u)
    dout = run.poisoned(n, np.float16 if spec.out_type == "f16" else np.float32)
    gv = dg.view(offset=4 * offset, shape=(n,)) if offset else dg
    run.launch(f, S.launch_geometry(spec, n), dict(g=gv, u=du, out=dout, n=n))
    return run.get(dout)


@pytest.mark.parametrize("n,offset", [(1, 0), (7, 0), (1000, 0), (1027, 0), (1029, 1)])
def test_swiglu(run, n, offset, rng):
    g = (rng.standard_normal(n) * 4).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    out = _run(run, S.SwiGluSpec(block=64), g, u, offset)
    ref = formula(g, u)
    # elementwise relative error: each element stands alone
    assert np.all(np.isfinite(out))
    assert np.max(np.abs(out - ref) / np.maximum(np.abs(ref), 1e-30)) <= 1e-5


@pytest.mark.parametrize("n,offset", [(7, 0), (1027, 0), (1029, 1)])
def test_swiglu_f16_out(run, n, offset, rng):
    """An f16 ``out`` is the f32 kernel's result rounded to nearest, bit for
    bit, on the vector and scalar paths."""
    g = (rng.standard_normal(n) * 4).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    out32 = _run(run, S.SwiGluSpec(block=64), g, u, offset)
    out16 = _run(run, S.SwiGluSpec(block=64, out_type="f16"), g, u, offset)
    assert out16.dtype == np.float16
    assert np.array_equal(out16, out32.astype(np.float16))
    ref = formula(g, u)
    err = np.abs(out16.astype(np.float64) - ref)
    assert np.all(err <= (2.0 ** -11 + 1e-5) * np.abs(ref) + 2.0 ** -25), float(np.max(err))


@pytest.mark.parametrize("n,offset,out_type", [(7, 0, "f32"), (1027, 0, "f32"), (1029, 1, "f32"),
                                               (1027, 0, "f16")])
def test_geglu(run, n, offset, out_type, rng):
    """``act="gelu_tanh"``: GeGLU, GELU's tanh form, on both paths; |g| up
    to about 12, past GELU's two regimes (about g, about 0)."""
    g = (rng.standard_normal(n) * 4).astype(np.float32)
    g[:4] = (-11.0, -9.5, 9.5, 0.0)
    u = rng.standard_normal(n).astype(np.float32)
    out = _run(run, S.SwiGluSpec(block=64, act="gelu_tanh", out_type=out_type), g, u, offset)
    ref = geglu_formula(g, u)
    assert np.all(np.isfinite(out))
    # elementwise: 1e-5 of the element (plus f16's rounding), and an absolute
    # floor of 2^-100 |u| for GELU's far tail below -10 (its value vanishes)
    rnd = 1e-5 + (2.0 ** -11 if out_type == "f16" else 0)
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(err <= rnd * np.abs(ref) + 2.0 ** -100 * np.abs(u) + 2.0 ** -25), \
        float(np.max(err / np.maximum(np.abs(ref), 1e-30)))


@pytest.mark.gpu
def test_swiglu_gpu(gpu_run, rng):
    n = 14336 * 3 + 5
    g = (rng.standard_normal(n) * 4).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    out = _run(gpu_run, S.SwiGluSpec(), g, u)
    assert rel_err(out, formula(g, u)) <= 1e-5


def test_swiglu_reference_matches_the_formula(rng):
    g = rng.standard_normal(1000) * 6
    u = rng.standard_normal(1000)
    ref, f = S.reference(g, u), formula(g, u)
    assert np.max(np.abs(ref - f) / np.maximum(np.abs(f), 1e-300)) < 1e-13
    ref, f = S.reference(g, u, act="gelu_tanh"), geglu_formula(g, u)
    assert np.max(np.abs(ref - f) / np.maximum(np.abs(f), 1e-300)) < 1e-12


@pytest.mark.parametrize("bad", [dict(block=0), dict(block=48), dict(target="sm_75x"),
                                 dict(act="gelu")])
def test_swiglu_refuses(bad):
    with pytest.raises(ValueError):
        S.SwiGluSpec(**bad)
