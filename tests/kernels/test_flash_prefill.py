"""Flash prefill (causal chunk attention on tensor cores) against float64
attention written here, on tiny shapes, on the emulator (and the GPU)."""

import math

import numpy as np
import pytest

from ptxgen.driver import ops
from ptxgen.kernels import flash_prefill as FP

BOUND = 5e-3       # q and P rounded to f16: ~2^-11 relative per term


def attention64(q, kc, vc, L, T):
    """float64 causal attention, a loop over rows and heads."""
    nq, d = q.shape[1], q.shape[2]
    n_kv = kc.shape[0]
    out = np.zeros((T, nq, d))
    for i in range(T):
        for qh in range(nq):
            h = qh // (nq // n_kv)
            keys = kc[h, :L + i + 1].astype(np.float64)
            s = keys @ q[i, qh].astype(np.float64) / math.sqrt(d)
            w = np.exp(s - s.max())
            out[i, qh] = (w / w.sum()) @ vc[h, :L + i + 1].astype(np.float64)
    return out


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _data(rng, n_kv, G, d, L, T, t_max, cap):
    q = (rng.standard_normal((t_max, n_kv * G, d)) * 2).astype(np.float32)
    kc = np.full((n_kv, cap, d), np.nan, np.float16)     # unwritten rows: NaN
    vc = np.full((n_kv, cap, d), np.nan, np.float16)
    kc[:, :L + T] = rng.standard_normal((n_kv, L + T, d))
    vc[:, :L + T] = rng.standard_normal((n_kv, L + T, d))
    return q, kc, vc


CASES = [(L, T) for L in (0, 3, 40) for T in (1, 5, 17)]


@pytest.mark.parametrize("L,T", CASES)
def test_matches_float64(backend, rng, L, T):
    d, n_kv, G, t_max = 64, 1, 2, 24
    q, kc, vc = _data(rng, n_kv, G, d, L, T, t_max, cap=L + T + 9)
    out = np.full((t_max, n_kv * G, d), np.nan, np.float32)
    ops.flash_prefill(q, kc, vc, np.array([L], np.int32), np.array([T], np.int32), out=out,
                      backend=backend.name, warps=1, block_keys=16)
    ref = attention64(q, kc, vc, L, T)
    assert rel_err(out[:T], ref) <= BOUND, (L, T, rel_err(out[:T], ref))
    assert np.all(np.isnan(out[T:])), "rows past T were written"


@pytest.mark.parametrize("L,T,warps,bn", [(40, 17, 2, 32), (3, 5, 1, 64)])
def test_head_dim_128_gqa(backend, rng, L, T, warps, bn):
    d, n_kv, G = 128, 2, 2
    q, kc, vc = _data(rng, n_kv, G, d, L, T, T, cap=L + T + 3)
    out = np.full(q.shape, np.nan, np.float32)
    ops.flash_prefill(q, kc, vc, L, T, out=out, backend=backend.name, warps=warps,
                      block_keys=bn)
    assert rel_err(out, attention64(q, kc, vc, L, T)) <= BOUND


def test_causal_future_keys_do_not_leak(backend, rng):
    """Changing the chunk's last key and value changes only the last row."""
    d, L, T = 64, 3, 17
    q, kc, vc = _data(rng, 1, 1, d, L, T, T, cap=L + T)
    a = ops.flash_prefill(q, kc, vc, L, T, backend=backend.name, warps=1, block_keys=16)
    kc2, vc2 = kc.copy(), vc.copy()
    kc2[:, L + T - 1] = rng.standard_normal(d) * 4
    vc2[:, L + T - 1] = rng.standard_normal(d) * 4
    b = ops.flash_prefill(q, kc2, vc2, L, T, backend=backend.name, warps=1, block_keys=16)
    np.testing.assert_array_equal(a[:T - 1], b[:T - 1])
    assert not np.array_equal(a[T - 1], b[T - 1])


def test_reference_module_agrees(rng):
    q, kc, vc = _data(rng, 2, 3, 64, 5, 7, 7, cap=12)
    np.testing.assert_allclose(FP.reference(q, kc, vc, 5, 7), attention64(q, kc, vc, 5, 7),
                               rtol=1e-12, atol=1e-12)


def test_bad_input_is_refused():
    q = np.zeros((4, 2, 64), np.float32)
    kc = np.zeros((1, 8, 64), np.float32)
    with pytest.raises(TypeError, match="float16"):
        ops.flash_prefill(q, kc, kc, 0, 4, backend="emu")
    kc = np.zeros((1, 8, 96), np.float16)
    with pytest.raises(ValueError, match="q must be"):
        ops.flash_prefill(q, kc, kc, 0, 4, backend="emu")
