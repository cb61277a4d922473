"""The DSL's vector add and block reduction through the driver, from numpy
arrays and from torch tensors (GPU only)."""

import numpy as np
import pytest

from backends import cuda_available
from ptxgen.kernels import reduce, vector_add

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="no NVIDIA GPU / driver available")]


def _fn(family, spec):
    from ptxgen.driver import Module, get_device
    import attrs
    spec = attrs.evolve(spec, target=get_device().target)
    return Module.from_ptx(family.build(spec)).function(spec.kernel_name), spec


def test_vector_add_numpy_and_torch(rng):
    from ptxgen.driver import DeviceArray, get_device, launch
    n = int(rng.integers(10_000, 50_000))
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    f, spec = _fn(vector_add, vector_add.VectorAddSpec())
    geo = vector_add.launch_geometry(spec, n)
    grid, block = geo.grid, geo.block
    da, db = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b)
    dc = DeviceArray.from_numpy(np.full(n, np.nan, np.float32))
    launch(f, grid, block, da, db, dc, n)
    np.testing.assert_array_equal(dc.to_numpy(), a + b)
    torch = pytest.importorskip("torch")
    ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
    tc = torch.full((n,), float("nan"), device="cuda")
    torch.cuda.synchronize()
    launch(f, grid, block, ta, tb, tc, n)
    get_device().synchronize()
    assert torch.equal(tc.cpu(), torch.from_numpy(a + b))


def test_block_reduce_numpy_and_torch(rng):
    from ptxgen.driver import DeviceArray, get_device, launch
    n = int(rng.integers(100_000, 300_000))
    x = rng.standard_normal(n).astype(np.float32)
    grid = 7
    f, spec = _fn(reduce, reduce.BlockReduceSpec())
    geo = reduce.launch_geometry(spec, n, grid)
    g, b = geo.grid, geo.block
    want = reduce.reference(x, grid, spec.block)
    # f32 partial sums: bound relative to the sum of |x| each block visits
    scale = reduce.reference(np.abs(x), grid, spec.block)
    out = DeviceArray.from_numpy(np.full(grid, np.nan, np.float32))
    launch(f, g, b, DeviceArray.from_numpy(x), out, n)
    assert np.all(np.abs(out.to_numpy() - want) <= 1e-5 * scale)
    torch = pytest.importorskip("torch")
    tx = torch.from_numpy(x).cuda()
    tout = torch.full((grid,), float("nan"), device="cuda")
    torch.cuda.synchronize()
    launch(f, g, b, tx, tout, n)
    get_device().synchronize()
    assert np.all(np.abs(tout.cpu().numpy() - want) <= 1e-5 * scale)
