"""KV append at a device-resident position (f32 -> f16 with cvt.rn).

The oracle is built in each test: a copy of the caches with row ``pos`` of
every head set to numpy's round-to-nearest-even cast of k and v (which
``kv_append.reference`` is checked against).  K is scaled by 100 so that a
K/V swap, a wrong head or a wrong row shows.
"""

import numpy as np
import pytest

from ptxgen.kernels import kv_append as K


def _run(run, spec, k, v, kc, vc, pos):
    n_kv = kc.shape[0]
    f = run.function(K.build, spec)
    dkc, dvc = run.array(kc), run.array(vc)
    run.launch(f, K.launch_geometry(spec, n_kv),
               dict(k=run.array(k), v=run.array(v), k_cache=dkc, v_cache=dvc,
                    pos_ptr=run.array(np.array([pos], np.int32)), n_kv_heads=n_kv,
                    capacity=kc.shape[1]))
    return run.get(dkc), run.get(dvc)


@pytest.mark.parametrize("d,dtype", [(64, np.float16), (128, np.float16), (12, np.float32)])
@pytest.mark.parametrize("pos", [0, 5, 6])
def test_kv_append(run, d, dtype, pos, rng):
    n_kv, cap = 3, 7
    kc = rng.standard_normal((n_kv, cap, d)).astype(dtype)
    vc = rng.standard_normal((n_kv, cap, d)).astype(dtype)
    k = rng.standard_normal((n_kv, d)).astype(np.float32) * 100
    v = rng.standard_normal((n_kv, d)).astype(np.float32)
    spec = K.KvAppendSpec(head_dim=d, cache_dtype="f16" if dtype == np.float16 else "f32",
                          block=32)
    gk, gv = _run(run, spec, k, v, kc, vc, pos)
    rk, rv = kc.copy(), vc.copy()
    if pos < cap:
        for h in range(n_kv):
            rk[h, pos] = k[h].astype(dtype)
            rv[h, pos] = v[h].astype(dtype)
    for got, ref in zip(K.reference(k, v, kc, vc, pos), (rk, rv)):
        np.testing.assert_array_equal(got, ref)
    # numpy's float32 -> float16 cast rounds to nearest even, like cvt.rn
    np.testing.assert_array_equal(gk, rk)
    np.testing.assert_array_equal(gv, rv)


@pytest.mark.parametrize("pos", [-1, 7, 1 << 30])
def test_kv_append_out_of_range_writes_nothing(run, pos, rng):
    kc = rng.standard_normal((2, 7, 64)).astype(np.float16)
    vc = rng.standard_normal((2, 7, 64)).astype(np.float16)
    k = rng.standard_normal((2, 64)).astype(np.float32)
    gk, gv = _run(run, K.KvAppendSpec(head_dim=64, block=32), k, k, kc, vc, pos)
    np.testing.assert_array_equal(gk, kc)
    np.testing.assert_array_equal(gv, vc)


@pytest.mark.parametrize("bad", [dict(head_dim=6), dict(head_dim=1024), dict(cache_dtype="bf16"),
                                 dict(block=33)])
def test_kv_append_refuses(bad):
    with pytest.raises(ValueError):
        K.KvAppendSpec(**bad)
