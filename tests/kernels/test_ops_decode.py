"""``ptxgen.driver.ops`` decode entry points on a GPU, eager and replayed from a graph."""

import numpy as np
import pytest

from ptxgen.kernels import flash_decode as F
from ptxgen.kernels import rmsnorm as R

pytestmark = pytest.mark.gpu


@pytest.fixture
def drv():
    from ptxgen import driver
    if not driver.is_available():
        pytest.skip("no NVIDIA driver / GPU available")
    from ptxgen.driver import ops_decode
    return driver, ops_decode


def test_ops_eager(drv, rng):
    driver, ops = drv
    D = driver.DeviceArray.from_numpy
    x = rng.standard_normal((3, 4099)).astype(np.float32)
    w = rng.standard_normal(4099).astype(np.float32)
    out = ops.rmsnorm(D(x), D(w), 1e-5).to_numpy()
    ref = R.reference(x, w, 1e-5)
    assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= 1e-5
    v = rng.standard_normal(128256).astype(np.float32)
    assert int(ops.argmax(D(v)).to_numpy()[0]) == int(np.argmax(v))


@pytest.mark.parametrize("pdl", [True, False])
def test_rmsnorm_chain_in_a_graph(drv, pdl, rng):
    """Each RMSNorm reads the previous one's output: with programmatic
    dependent launch (the sm_90 default) the wait must still order them."""
    driver, ops = drv
    if pdl and driver.get_device().compute_capability[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    D = driver.DeviceArray.from_numpy
    n, links = 4096, 6
    x = rng.standard_normal((1, n)).astype(np.float32) * 3 + 1
    ws = [rng.uniform(0.5, 1.5, n).astype(np.float32) for _ in range(links)]
    bufs = [D(x)] + [D(np.full((1, n), np.nan, np.float32)) for _ in range(links)]
    dws = [D(w) for w in ws]
    s = driver.Stream()
    ops.rmsnorm(bufs[0], dws[0], 1e-5, out=bufs[1], pdl=pdl, stream=s)   # build outside capture
    s.synchronize()
    bufs[1].copy_from(np.full((1, n), np.nan, np.float32))
    with driver.capture(s) as g:
        for i in range(links):
            ops.rmsnorm(bufs[i], dws[i], 1e-5, out=bufs[i + 1], pdl=pdl, stream=s)
    g.instantiate().launch(s)
    s.synchronize()
    ref = x.astype(np.float64)
    for w in ws:
        ref = R.reference(ref, w, 1e-5)
    out = bufs[-1].to_numpy()
    assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= links * 1e-5


def test_graph_replay_follows_device_length(drv, rng):
    """One captured step (append + attention) replayed at growing positions."""
    driver, ops = drv
    D = driver.DeviceArray.from_numpy
    n_kv, G, d, cap = 8, 4, 128, 4096
    kc = rng.standard_normal((n_kv, cap, d)).astype(np.float16)
    vc = rng.standard_normal((n_kv, cap, d)).astype(np.float16)
    q = rng.standard_normal((n_kv * G, d)).astype(np.float32)
    dk, dv, dq = D(kc), D(vc), D(q)
    knew = rng.standard_normal((n_kv, d)).astype(np.float32)
    dknew = D(knew)
    pos = D(np.array([0], np.int32))
    klen = D(np.array([1], np.int32))
    out = driver.DeviceArray.empty((n_kv * G, d), np.float32)
    stream = driver.Stream()

    def step(s):
        ops.kv_append(dknew, dknew, dk, dv, pos, stream=s)
        ops.flash_decode(dq, dk, dv, klen, out=out, stream=s)

    step(stream)                 # eager: appends knew at row 0 and compiles
    stream.synchronize()
    kc[:, 0] = knew.astype(np.float16)
    vc[:, 0] = knew.astype(np.float16)
    with driver.capture(stream) as g:
        step(stream)
    exe = g.instantiate()
    for p in (5, 6, 1000, 4095):
        pos.copy_from(np.array([p], np.int32))
        klen.copy_from(np.array([p + 1], np.int32))
        exe.launch(stream)
        stream.synchronize()
        kc[:, p] = knew.astype(np.float16)
        vc[:, p] = knew.astype(np.float16)
        ref = F.reference(q, kc, vc, p + 1)
        got = out.to_numpy()
        assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) <= 1e-4, p
