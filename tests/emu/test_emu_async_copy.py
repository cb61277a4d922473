"""cp.async in the builder, the instruction table and the emulator.

The emulator writes a copy's bytes to shared memory only when the issuing
thread's wait retires its group (the latest moment the hardware allows), so
a kernel that reads before waiting sees stale bytes instead of passing by luck."""

import numpy as np
import pytest

import ptxgen
from ptxgen import emu
from ptxgen.errors import PtxBuildError, PtxTypeError
from ptxgen.types import f32, u32

RNG = np.random.default_rng()


def _build(wait, groups=2, pending=0):
    """Thread t copies 16 bytes per group into its slot; after the wait and a
    barrier it stores its neighbour's slot of every group."""
    m = ptxgen.Module("sm_80")
    with m.kernel("cpa") as k:
        src = k.param_ptr("src", f32, align=16)
        dst = k.param_ptr("dst", f32, align=16)
        sh = k.shared_array("sh", f32, 64 * 4 * groups, align=16)
        t = k.tid.x
        for g in range(groups):
            k.cp_async(sh[(t + 64 * g) * 4], src[(t + 64 * g) * 4])
            k.cp_async_commit()
        if wait:
            k.cp_async_wait(pending)
        k.bar_sync(0)
        o = (t + 1) & 63
        for g in range(groups):
            k.st(dst[(t + 64 * g) * 4], k.ld(sh[(o + 64 * g) * 4], f32, vec=4))
    return m


def _run(mod, groups=2):
    x = RNG.standard_normal(256 * groups).astype(np.float32)
    dx = emu.DeviceArray.from_numpy(x)
    dy = emu.DeviceArray.from_numpy(np.full(256 * groups, np.nan, np.float32))
    emu.launch(emu.Module.from_ptx(mod)["cpa"], 1, 64, dx, dy)
    want = np.roll(x.reshape(groups, 64, 4), -1, axis=1).reshape(-1)
    return dy.to_numpy(), want


def test_copies_land_after_the_wait():
    got, want = _run(_build(wait=True))
    np.testing.assert_array_equal(got, want)


def test_read_before_the_wait_sees_stale_bytes():
    got, want = _run(_build(wait=False))
    assert np.isnan(got).all()        # shared memory starts as 0xFF bytes


def test_wait_group_leaves_the_newest_groups_pending():
    """wait_group 1 retires the first of two groups only."""
    got, want = _run(_build(wait=True, pending=1))
    np.testing.assert_array_equal(got[:256], want[:256])
    assert np.isnan(got[256:]).all()


def test_ptx_text_and_parse_round_trip():
    text = _build(wait=True).to_ptx()
    assert "cp.async.cg.shared.global" in text and "cp.async.commit_group;" in text
    assert "cp.async.wait_group \t0;" in text
    emu.Module.from_ptx(text)       # the emulator's parser takes every form


def test_builder_refuses_misuse():
    m = ptxgen.Module("sm_80")
    with m.kernel("bad") as k:
        src = k.param_ptr("src", f32, align=16)
        sh = k.shared_array("sh", f32, 16, align=16)
        with pytest.raises(PtxBuildError, match="writes shared memory"):
            k.cp_async(src[0], src[4])
        with pytest.raises(PtxBuildError, match="reads global memory"):
            k.cp_async(sh[0], sh[4])
        with pytest.raises(PtxBuildError, match="4, 8 or 16 bytes"):
            k.cp_async(sh[0], src[0], 12)
        with pytest.raises(PtxBuildError, match="constant 0..63"):
            k.cp_async_wait(k.mov(1, u32))


def test_read_of_a_neighbours_copy_without_a_barrier_is_a_race():
    """The copy's write is logged at the wait: another thread's read in the
    same barrier interval is a race."""
    m = ptxgen.Module("sm_80")
    with m.kernel("cpa") as k:
        src = k.param_ptr("src", f32, align=16)
        dst = k.param_ptr("dst", f32, align=16)
        sh = k.shared_array("sh", f32, 256, align=16)
        t = k.tid.x
        k.cp_async(sh[t * 4], src[t * 4])
        k.cp_async_commit()
        k.cp_async_wait(0)
        k.st(dst[t * 4], k.ld(sh[((t + 1) & 63) * 4], f32, vec=4))
    x = emu.DeviceArray.from_numpy(RNG.standard_normal(256).astype(np.float32))
    y = emu.DeviceArray.from_numpy(np.zeros(256, np.float32))
    with pytest.raises(emu.RaceError):
        emu.launch(emu.Module.from_ptx(m)["cpa"], 1, 64, x, y)
