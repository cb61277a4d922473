"""The DSL's two small kernels against numpy, on every available backend."""

import numpy as np
import pytest

from ptxgen import registry
from ptxgen.kernels import reduce as reduce_k
from ptxgen.kernels import vector_add as vadd_k


def _spec(name):
    return registry.canonical_specs()[name][1]


@pytest.mark.parametrize("cname", ["vector_add", "vector_add_u32"])
def test_vector_add(backend, cname, rng):
    spec = _spec(cname)
    mod = backend.load(vadd_k.build(spec))
    fn = mod[spec.kernel_name]
    n = int(rng.integers(3, 40) * spec.block + rng.integers(1, spec.block))   # not a multiple
    if spec.dtype == "f32":
        a = (rng.uniform(0.5, 2.0, n) * rng.choice([-1, 1], n)).astype(np.float32)
        b = rng.uniform(0.5, 2.0, n).astype(np.float32)
        out_host = np.full(n, np.nan, np.float32)
    else:
        a = rng.integers(1, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
        b = rng.integers(1, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
        out_host = np.full(n, 0xDEADBEEF, np.uint32)
    da, db, dc = backend.array(a), backend.array(b), backend.array(out_host)
    geo = vadd_k.launch_geometry(spec, n)
    grid, block, shared = geo.grid, geo.block, geo.shared
    backend.launch_positional(fn, grid, block, da, db, dc, n, shared=shared)
    got = dc.to_numpy()
    # f32 addition of two f32 values is exactly the float32 rounding of the
    # float64 sum, so the comparison is exact for both dtypes
    want = vadd_k.reference(a.astype(np.float64), b.astype(np.float64)).astype(a.dtype) \
        if spec.dtype == "f32" else vadd_k.reference(a, b)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("cname,grid", [("block_reduce", 1), ("block_reduce", 3),
                                        ("block_reduce_1024", 2)])
def test_block_reduce(backend, cname, grid, rng):
    spec = _spec(cname)
    mod = backend.load(reduce_k.build(spec))
    fn = mod[spec.kernel_name]
    n = int(rng.integers(2, 30) * spec.block * grid + rng.integers(1, spec.block))
    x = (rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    dx = backend.array(x)
    out = backend.poisoned(grid, np.float32)
    geo = reduce_k.launch_geometry(spec, n, grid)
    g, block, shared = geo.grid, geo.block, geo.shared
    backend.launch_positional(fn, g, block, dx, out, n, shared=shared)
    got = out.to_numpy().astype(np.float64)
    want = reduce_k.reference(x, grid, spec.block)
    # f32 accumulation of |x| <= 1.5 terms: error below n * 2^-24 * sum|x|
    bound = 1e-6 * np.abs(x).sum() + 1e-6
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - want) <= bound), (got, want, bound)
    # relative to the magnitude of what was summed
    assert np.all(np.abs(got - want) / np.abs(x).sum() < 1e-6)
