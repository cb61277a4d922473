"""The DSL's two small kernels through the kernel-test runner, so they are
also compared emulator-against-GPU (the ``emu_vs_cuda`` case).

Oracles: vector_add against numpy's float32 sum (exact); block_reduce
against per-block sums written out here with ``math.fsum`` over the
elements each block's grid-stride loop visits (``reduce.reference`` is
checked against the same sums).
"""

import math

import numpy as np

from ptxgen.kernels import reduce, vector_add


def test_vector_add(run, rng):
    n = int(rng.integers(1000, 5000))
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    spec = vector_add.VectorAddSpec()
    fn = run.function(vector_add.build, spec)
    c = run.poisoned((n,))
    run.launch(fn, vector_add.launch_geometry(spec, n),
               dict(a=run.array(a), b=run.array(b), c=c, n=n))
    # one f32 add per element: exactly the float32 sum
    np.testing.assert_array_equal(run.get(c), a + b)


def test_block_reduce(run, rng):
    n = int(rng.integers(3000, 9000))
    x = rng.standard_normal(n).astype(np.float32)
    spec = reduce.BlockReduceSpec()
    grid = 3
    fn = run.function(reduce.build, spec)
    out = run.poisoned((grid,))
    run.launch(fn, reduce.launch_geometry(spec, n, grid), dict(x=run.array(x), out=out, n=n))
    want = np.array([math.fsum(float(x[i]) for i in range(n)
                               if (i // spec.block) % grid == b) for b in range(grid)])
    assert np.max(np.abs(reduce.reference(x, grid, spec.block) - want)) <= 1e-9 * np.sum(np.abs(x))
    got = run.get(out).astype(np.float64)
    # f32 sums of ~1000 terms each: relative error well under 1e-5 of sum |x|
    bound = 1e-5 * np.bincount((np.arange(n) % (grid * spec.block)) // spec.block,
                               weights=np.abs(x), minlength=grid)
    assert np.all(np.abs(got - want) <= bound)
