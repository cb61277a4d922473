"""Spin-waits across CTAs: a CTA waits (``ld.acquire`` in a ``nanosleep``
loop) for a counter other CTAs raise (``red.release``) after writing data.

The emulator runs the CTAs of such a kernel as one batch and, at a
nanosleep, runs every other thread that can run before the spinning ones
again (docs/emulator.md, "Spin-waits"); a spin nobody will end is a
:class:`SpinDeadlock`.  The same kernels run on the GPU (``backend``)."""

import numpy as np
import pytest

import ptxgen
from ptxgen import emu
from ptxgen.types import u32

NT = 64


def _chain(order_reversed: bool, target="sm_90"):
    """CTA ``c`` waits until ``count >= rank(c)``, then writes ``data[c] =
    data[prev] + x[c]`` for every thread and raises the count; ``rank`` is
    ``c`` or ``nctaid - 1 - c`` (the last CTA first), so either the lowest
    or the highest CTA id runs ahead of the others."""
    m = ptxgen.Module(target)
    with m.kernel("chain", reqntid=NT) as k:
        x = k.param_ptr("x", u32)
        data = k.param_ptr("data", u32)
        count = k.param_ptr("count", u32)
        c = k.ctaid.x
        n = k.nctaid.x
        rank = (n - 1) - c if order_reversed else c
        prev = c + 1 if order_reversed else c - 1
        t = k.tid.x
        with k.if_(t.eq(0)):
            with k.while_(lambda: k.ld(count[0], sem="acquire", scope="gpu") < rank):
                k.nanosleep(32)
        k.bar_sync(0)
        before = k.var(u32, 0)
        with k.if_(rank > 0):
            before.set(k.ld(data[prev * NT + t]))
        k.st(data[c * NT + t], before + k.ld(x[c * NT + t]))
        k.bar_sync(0)
        with k.if_(t.eq(0)):
            k.red("add", count[0], 1, sem="release", scope="gpu")
    return m


@pytest.mark.parametrize("reverse", [False, True], ids=["lowest-first", "highest-first"])
def test_ctas_wait_for_each_other_in_order(backend, rng, reverse):
    """Each CTA adds its x to its predecessor's sums: the data are the
    prefix sums of x along the chain, whatever order the CTAs start in."""
    n = 5
    xs = rng.integers(0, 1000, (n, NT)).astype(np.uint32)
    mod = backend.load(_chain(reverse))
    data = backend.poisoned((n, NT), np.uint32)
    count = backend.array(np.zeros(1, np.uint32))
    backend.launch_positional(mod["chain"], n, NT, backend.array(xs), data, count)
    order = range(n - 1, -1, -1) if reverse else range(n)
    want = np.zeros((n, NT), np.uint64)
    acc = np.zeros(NT, np.uint64)
    for c in order:
        acc = acc + xs[c]
        want[c] = acc
    np.testing.assert_array_equal(data.to_numpy(), want.astype(np.uint32))
    assert int(count.to_numpy()[0]) == n


def _stuck(target="sm_90"):
    """Every CTA raises the count only after the count reaches the grid
    size: nobody ever does."""
    m = ptxgen.Module(target)
    with m.kernel("stuck", reqntid=NT) as k:
        count = k.param_ptr("count", u32)
        with k.if_(k.tid.x.eq(0)):
            with k.while_(lambda: k.ld(count[0], sem="acquire", scope="gpu") < k.nctaid.x):
                k.nanosleep(32)
        k.bar_sync(0)
        with k.if_(k.tid.x.eq(0)):
            k.red("add", count[0], 1, sem="release", scope="gpu")
    return m


def test_a_spin_no_one_ends_is_a_deadlock():
    """CTAs waiting for a count none of them raises: SpinDeadlock, naming
    the nanosleep's line."""
    mod = emu.Module.from_ptx(_stuck())
    count = emu.DeviceArray.zeros(1, np.uint32)
    with pytest.raises(emu.SpinDeadlock, match=r"nanosleep\.u32.*spin-wait deadlock"):
        emu.launch(mod["stuck"], (3,), (NT,), count)


def test_a_spinning_grid_must_fit_one_batch(monkeypatch):
    """The CTAs of a kernel that spin-waits run together; a grid past one
    batch is refused before anything runs."""
    from ptxgen.emu import executor
    monkeypatch.setattr(executor, "BATCH_THREADS", 2 * NT)
    mod = emu.Module.from_ptx(_chain(False))
    n = 3
    args = [emu.DeviceArray.zeros((n, NT), np.uint32), emu.DeviceArray.zeros((n, NT), np.uint32),
            emu.DeviceArray.zeros(1, np.uint32)]
    with pytest.raises(emu.LaunchConfigError, match="must run together.*at most 2 CTAs"):
        emu.launch(mod["chain"], (n,), (NT,), *args)


def test_ptxas_takes_the_spin_kernels(ptxas):
    """nanosleep, ld.acquire.gpu and red.release.gpu as the kernels here
    emit them assemble for sm_80 and sm_90."""
    from ptxgen.ptxas import assemble
    for target in ("sm_80", "sm_90"):
        for m in (_chain(False, target), _stuck(target)):
            assemble(m.to_ptx(), target)


@pytest.mark.parametrize("mutation", [
    ("ld.acquire.gpu.global", "ld.relaxed.gpu.global"),
    ("red.release.gpu.global", "red.relaxed.gpu.global"),
    ("ld.acquire.gpu.global", "ld.acquire.cta.global"),
], ids=["no-acquire", "no-release", "cta-scope"])
def test_the_race_check_sees_a_hand_off_without_release_acquire(mutation):
    """The chain's hand-off (data stored, count raised with a release; count
    read with an acquire, data loaded) passes the global race check; with
    the acquire or the release weakened, the load of the previous CTA's
    data is a race naming the store."""
    m = _chain(False)
    text = m.to_ptx()
    n = 3
    args = lambda: [emu.DeviceArray.zeros((n, NT), np.uint32),
                    emu.DeviceArray.zeros((n, NT), np.uint32), emu.DeviceArray.zeros(1, np.uint32)]
    emu.launch(emu.Module.from_ptx(text)["chain"], (n,), (NT,), *args())
    old, new = mutation
    assert old in text
    bad = emu.Module.from_ptx(text.replace(old, new))
    with pytest.raises(emu.RaceError, match=r"ld\.global\.u32.*global-memory race .* block "
                       r"\(1, 0, 0\) reads it here, and block \(0, 0, 0\) writes it at line \d+ "
                       r"\(`st\.global\.u32"):
        emu.launch(bad["chain"], (n,), (NT,), *args())


def test_the_race_check_sees_a_store_over_unfinished_reads():
    """A CTA overwriting a word another CTA read, with no order between
    them (write after read), is a race naming the read."""
    m = ptxgen.Module("sm_90")
    with m.kernel("war", reqntid=32) as k:
        buf = k.param_ptr("buf", u32)
        out = k.param_ptr("out", u32)
        c = k.ctaid.x
        with k.if_(c.eq(0)):
            k.st(out[k.tid.x], k.ld(buf[k.tid.x]))
        with k.if_(c.eq(1)):
            k.nanosleep(0)
            k.st(buf[k.tid.x], k.tid.x)
    with pytest.raises(emu.RaceError, match=r"block \(1, 0, 0\) writes it here, and block "
                       r"\(0, 0, 0\) reads it at"):
        emu.launch(emu.Module.from_ptx(m)["war"], (2,), (32,),
                   emu.DeviceArray.zeros(32, np.uint32), emu.DeviceArray.zeros(32, np.uint32))
