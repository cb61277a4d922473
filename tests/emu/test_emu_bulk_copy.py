"""The bulk copy engine (``cp.async.bulk``) and mbarriers in the builder, the
instruction table and the emulator.

The emulator writes a bulk copy's bytes to shared memory only when a thread's
``mbarrier.try_wait`` first sees the copy's phase complete, so a kernel that
reads the stage without waiting sees stale bytes; a copy into bytes another
thread reads in the same barrier interval is a race."""

import numpy as np
import pytest

import ptxgen
from ptxgen import emu
from ptxgen.errors import PtxBuildError
from ptxgen.types import f32, u32, u64

N = 256                 # f32 values per copy (1 KB)


def _kernel(wait=True, parity=0, rounds=2, barrier=True, expect=4 * N):
    """Thread 0 copies ``rounds`` KB-sized pieces of ``src``, one after the
    other, into one shared stage on one mbarrier; after each, every thread
    stores its neighbour's four values of the stage to ``dst``."""
    m = ptxgen.Module("sm_90")
    with m.kernel("bulk", maxntid=64) as k:
        src = k.param_ptr("src", f32, align=16)
        dst = k.param_ptr("dst", f32, align=16)
        sh = k.shared_array("sh", f32, N, align=16)
        bar = k.shared_array("bar", u64, 1)
        t = k.tid.x
        first = t.eq(0)
        with k.if_(first):
            k.mbarrier_init(bar[0], 1)
            k.fence_mbarrier_init()
        k.bar_sync(0)
        for r in range(rounds):
            with k.if_(first):
                k.mbarrier_arrive_expect_tx(bar[0], expect)
                k.cp_async_bulk(sh[0], src[r * N], 4 * N, bar[0])
            if wait:
                k.mbarrier_wait(bar[0], (parity + r) & 1)
            o = (t + 1) & 63
            k.st(dst[r * N + t * 4], k.ld(sh[o * 4], f32, vec=4))
            if barrier:
                k.bar_sync(0)       # everyone has read the stage before the next copy
    return m


def _run(rng, backend, mod, rounds=2):
    x = rng.standard_normal(rounds * N).astype(np.float32)
    dx = backend.array(x)
    dy = backend.array(np.full(rounds * N, np.nan, np.float32))
    backend.launch_positional(backend.load(mod.to_ptx())["bulk"], 1, 64, dx, dy)
    want = np.roll(x.reshape(rounds, 64, 4), -1, axis=1).reshape(-1)
    return dy.to_numpy(), want


def test_copies_land_for_the_waiters(backend, rng):
    """Two phases of one mbarrier, on the emulator and an sm_90 GPU."""
    if backend.name == "cuda":
        from ptxgen.driver import get_device
        if get_device().compute_capability < (9, 0):
            pytest.skip("cp.async.bulk needs sm_90")
    got, want = _run(rng, backend, _kernel())
    np.testing.assert_array_equal(got, want)


def test_ptx_text_and_parse_round_trip():
    text = _kernel().to_ptx()
    assert ".version 8.0" in text
    for s in ("mbarrier.init.shared.b64", "fence.mbarrier_init.release.cluster",
              "mbarrier.arrive.expect_tx.shared.b64",
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
              "mbarrier.try_wait.parity.shared.b64"):
        assert s in text, s
    emu.Module.from_ptx(text)


def test_read_without_waiting_is_a_race_and_sees_stale_bytes(rng):
    """No wait: the race check names the copy and the read; without the
    check the bytes never land (shared memory starts as 0xFF, NaN)."""
    fn = emu.Module.from_ptx(_kernel(wait=False))["bulk"]
    x = emu.DeviceArray.from_numpy(rng.standard_normal(2 * N).astype(np.float32))
    dy = emu.DeviceArray.from_numpy(np.zeros(2 * N, np.float32))
    with pytest.raises(emu.RaceError, match="cp.async.bulk.*reads it"):
        emu.launch(fn, 1, 64, x, dy)
    emu.launch(fn, 1, 64, x, dy, races=False)
    assert np.isnan(dy.to_numpy()).all()


def test_copy_into_a_stage_still_being_read_is_a_race(rng):
    """Without the barrier after the reads, the second copy overwrites the
    stage other threads read in the same interval."""
    mod = _kernel(barrier=False)
    x = emu.DeviceArray.from_numpy(rng.standard_normal(2 * N).astype(np.float32))
    y = emu.DeviceArray.from_numpy(np.zeros(2 * N, np.float32))
    with pytest.raises(emu.RaceError, match="cp.async.bulk"):
        emu.launch(emu.Module.from_ptx(mod)["bulk"], 1, 64, x, y)


@pytest.mark.parametrize("kw,match", [(dict(parity=1), "never completes"),
                                      (dict(expect=4 * N + 16), "never completes")])
def test_a_phase_that_cannot_complete_is_reported(kw, match, rng):
    """Waiting on the wrong parity, or for more bytes than are copied, would
    hang a GPU; the emulator names the deadlock."""
    mod = _kernel(rounds=1, **kw)
    x = emu.DeviceArray.from_numpy(rng.standard_normal(N).astype(np.float32))
    y = emu.DeviceArray.from_numpy(np.zeros(N, np.float32))
    with pytest.raises(emu.MemoryFault, match=match):
        emu.launch(emu.Module.from_ptx(mod)["bulk"], 1, 64, x, y)


def _one_copy(rng, init=True, first=0, nbytes=4 * N):
    """Thread 0 copies ``nbytes`` from ``src[first]`` into shared memory."""
    m = ptxgen.Module("sm_90")
    with m.kernel("bulk", maxntid=32) as k:
        src = k.param_ptr("src", f32, align=16)
        sh = k.shared_array("sh", f32, N, align=16)
        bar = k.shared_array("bar", u64, 1)
        with k.if_(k.tid.x.eq(0)):
            if init:
                k.mbarrier_init(bar[0], 1)
            k.mbarrier_arrive_expect_tx(bar[0], nbytes)
            k.cp_async_bulk(sh[0], src[first], nbytes, bar[0])
    x = emu.DeviceArray.from_numpy(rng.standard_normal(N).astype(np.float32))
    emu.launch(emu.Module.from_ptx(m)["bulk"], 1, 32, x)


def test_use_before_init_is_refused(rng):
    with pytest.raises(emu.MemoryFault, match="no mbarrier.init"):
        _one_copy(rng, init=False)


def test_misaligned_bulk_copy_faults(rng):
    """A source 4 bytes off a 16-byte boundary faults, as on the GPU."""
    with pytest.raises(emu.MemoryFault, match="16-byte aligned"):
        _one_copy(rng, first=1, nbytes=64)


def test_copy_past_the_allocation_faults(rng):
    with pytest.raises(emu.MemoryFault, match="cp.async.bulk"):
        _one_copy(rng, first=N - 4, nbytes=64)


def test_builder_refuses_misuse():
    m = ptxgen.Module("sm_90")
    with m.kernel("bad") as k:
        src = k.param_ptr("src", f32, align=16)
        sh = k.shared_array("sh", f32, 64, align=16)
        bar = k.shared_array("bar", u64, 1)
        with pytest.raises(PtxBuildError, match="destination must be in .shared"):
            k.cp_async_bulk(src[0], src[4], 16, bar[0])
        with pytest.raises(PtxBuildError, match="source must be in .global"):
            k.cp_async_bulk(sh[0], sh[4], 16, bar[0])
        with pytest.raises(PtxBuildError, match="mbarrier must be in .shared"):
            k.cp_async_bulk(sh[0], src[0], 16, src[0])
        with pytest.raises(PtxBuildError, match="multiple of 16"):
            k.cp_async_bulk(sh[0], src[0], 24, bar[0])
        with pytest.raises(PtxBuildError, match="count of 1"):
            k.mbarrier_init(bar[0], 0)
        with pytest.raises(PtxBuildError, match="lives in .shared"):
            k.mbarrier_wait(src[0], 0)
        k.mbarrier_wait(bar[0], k.mov(0, u32))


def test_sm80_target_refuses_the_bulk_copy():
    m = ptxgen.Module("sm_80")
    with m.kernel("old") as k:
        src = k.param_ptr("src", f32, align=16)
        sh = k.shared_array("sh", f32, 64, align=16)
        bar = k.shared_array("bar", u64, 1)
        with pytest.raises(PtxBuildError, match="sm_90"):
            k.cp_async_bulk(sh[0], src[0], 16, bar[0])
