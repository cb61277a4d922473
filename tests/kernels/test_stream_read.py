"""The stream-read yardstick kernel (kernels/stream_read.py): every word it
is asked to read is folded into exactly one block's XOR, in both modes, at
sizes that end inside a step, with and without programmatic dependent launch.

Oracle: the fold written out here unit by unit (unit u belongs to step
``u // step_units``, step s to block ``s % grid``), which
``stream_read.reference`` is checked against, and the XOR of every word.
"""

import numpy as np
import pytest

from ptxgen.kernels import stream_read as S
from ptxgen.kernels.spec_fields import has_griddepcontrol


@pytest.mark.parametrize("persistent,block,loads,grid", [
    (False, 64, 2, None),      # one step per block, grid from launch_geometry
    (False, 128, 4, None),
    (True, 64, 3, 5),          # persistent: 5 blocks walk all steps
    (True, 128, 1, 2),
])
def test_stream_read_xor(run, persistent, block, loads, grid, rng):
    spec = S.StreamReadSpec(block=block, loads=loads, persistent=persistent)
    steps = int(rng.integers(3, 7))
    # a size that ends part-way through the last step (and part-way through a load)
    n16 = (steps - 1) * spec.step_units + int(rng.integers(1, spec.step_units))
    words = rng.integers(0, 1 << 32, size=4 * n16, dtype=np.uint64).astype(np.uint32)
    # a tail past n16 that must not be read: it would change the XOR
    src = np.concatenate([words, rng.integers(1, 1 << 32, size=64, dtype=np.uint64)
                          .astype(np.uint32)])
    tgt = run.target()
    pdl = has_griddepcontrol(tgt)
    spec = S.StreamReadSpec(block=block, loads=loads, persistent=persistent, pdl=pdl,
                            target=tgt)
    geo = S.launch_geometry(spec, 16 * n16)
    if grid is not None:
        geo = geo.evolve(grid=grid)
    fn = run.function(S.build, spec)
    out = run.poisoned((geo.grid[0],), np.uint32)
    run.launch(fn, geo, dict(src=run.array(src), out=out, n16=n16))
    got = run.get(out)
    want = np.zeros(geo.grid[0], np.uint32)
    for u in range(n16):
        s = u // spec.step_units
        if persistent or s < geo.grid[0]:
            for w in words[4 * u:4 * u + 4]:
                want[s % geo.grid[0]] ^= w
    np.testing.assert_array_equal(S.reference(words, spec, geo.grid[0]), want)
    np.testing.assert_array_equal(got, want)
    # and the fold covers every word once
    assert np.bitwise_xor.reduce(got) == np.bitwise_xor.reduce(words)


def test_stream_read_refusals():
    with pytest.raises(ValueError, match="loads"):
        S.StreamReadSpec(loads=0)
    with pytest.raises(ValueError, match="16-byte"):
        S.launch_geometry(S.StreamReadSpec(), 100)
    with pytest.raises(ValueError, match="griddepcontrol"):
        S.StreamReadSpec(pdl=True, target="sm_80")
