"""Argmax: ties to the lowest index, NaN wins, -0 == +0.

The oracle is ``numpy.argmax`` and, for ties, NaN and signed zeros, indices
written out in the test.
"""

import numpy as np
import pytest

from ptxgen.kernels import argmax as A
from ptxgen.kernels.plan import LaunchGeometry


def _run(run, spec, x, grid):
    f = run.function(A.build, spec)
    dout = run.poisoned(1, np.int32)
    scratch = run.poisoned(grid, np.uint64)
    counter = run.array(np.zeros(1, np.uint32))
    for _ in range(2):                       # a replay must find the counter reset
        run.launch(f, LaunchGeometry(spec.kernel_name, grid, spec.block),
                   dict(x=run.array(x), n=x.size, out=dout, scratch=scratch, counter=counter))
        got = int(run.get(dout)[0])
        assert int(run.get(counter)[0]) == 0
    return got


@pytest.mark.parametrize("n,grid", [(1, 1), (5, 1), (777, 3), (2053, 2)])
def test_argmax_random(run, n, grid, rng):
    x = rng.standard_normal(n).astype(np.float32)
    assert _run(run, A.ArgmaxSpec(block=64), x, grid) == int(np.argmax(x))


def test_argmax_ties_nan_zero(run):
    spec = A.ArgmaxSpec(block=32)
    x = np.full(300, -5.0, np.float32)
    x[[250, 40, 199]] = 3.0
    assert _run(run, spec, x, 3) == 40
    x[[17, 260]] = np.nan
    assert _run(run, spec, x, 2) == 17
    z = np.full(100, -1.0, np.float32)
    z[60], z[30] = 0.0, -0.0
    assert _run(run, spec, z, 2) == 30
    assert _run(run, spec, np.full(65, -np.inf, np.float32), 2) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("n", [128256, 152064 + 3])
def test_argmax_gpu(gpu_run, n, rng):
    x = rng.standard_normal(n).astype(np.float32)
    x[n // 3] = x[n - 7] = 9.0
    from ptxgen.driver import get_device
    grid = A.launch_geometry(A.ArgmaxSpec(), n, get_device().sm_count).grid[0]
    assert _run(gpu_run, A.ArgmaxSpec(), x, grid) == n // 3


@pytest.mark.parametrize("bad", [dict(block=16), dict(block=1056)])
def test_argmax_refuses(bad):
    with pytest.raises(ValueError):
        A.ArgmaxSpec(**bad)
