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


def _run(rng, mod, groups=2):
    x = rng.standard_normal(256 * groups).astype(np.float32)
    dx = emu.DeviceArray.from_numpy(x)
    dy = emu.DeviceArray.from_numpy(np.full(256 * groups, np.nan, np.float32))
    emu.launch(emu.Module.from_ptx(mod)["cpa"], 1, 64, dx, dy)
    want = np.roll(x.reshape(groups, 64, 4), -1, axis=1).reshape(-1)
    return dy.to_numpy(), want


def test_copies_land_after_the_wait(rng):
    got, want = _run(rng, _build(wait=True))
    np.testing.assert_array_equal(got, want)


def test_read_before_the_wait_sees_stale_bytes(rng):
    got, want = _run(rng, _build(wait=False))
    assert np.isnan(got).all()        # shared memory starts as 0xFF bytes


def test_wait_group_leaves_the_newest_groups_pending(rng):
    """wait_group 1 retires the first of two groups only."""
    got, want = _run(rng, _build(wait=True, pending=1))
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


def test_read_of_a_neighbours_copy_without_a_barrier_is_a_race(rng):
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
    x = emu.DeviceArray.from_numpy(rng.standard_normal(256).astype(np.float32))
    y = emu.DeviceArray.from_numpy(np.zeros(256, np.float32))
    with pytest.raises(emu.RaceError):
        emu.launch(emu.Module.from_ptx(m)["cpa"], 1, 64, x, y)


# ------------------------------------------------ cp.async.bulk.prefetch.L2

def _prefetch_kernel():
    """Thread 0 prefetches ``n`` bytes at ``&w[off]`` (f32 elements) into L2; every thread
    then doubles one value (the prefetch must not change anything)."""
    m = ptxgen.Module("sm_90")
    with m.kernel("pf", maxntid=64) as k:
        w = k.param_ptr("w", f32, align=16)
        off = k.param("off", u32)
        n = k.param("n", u32)
        y = k.param_ptr("y", f32)
        k.prefetch_l2_bulk(k.ptr_add(w, k.cvt("u64", off))[0], n, guard=k.tid.x.eq(0))
        t = k.tid.x
        k.st(y[t], k.ld(w[t], f32) * 2.0)
    return m


def test_bulk_prefetch_emits_ptx_8_and_changes_nothing(backend, rng):
    """On the emulator and on an sm_90 GPU (where the driver's JIT takes the
    instruction): the whole 256-byte array prefetched, nothing changed."""
    if backend.name == "cuda":
        from ptxgen.driver import get_device
        if get_device().compute_capability < (9, 0):
            pytest.skip("cp.async.bulk.prefetch needs sm_90")
    m = _prefetch_kernel()
    text = m.to_ptx()
    assert ".version 8.0" in text and "cp.async.bulk.prefetch.L2.global" in text
    x = rng.standard_normal(64).astype(np.float32)
    dw = backend.array(x)
    dy = backend.array(np.full(64, np.nan, np.float32))
    backend.launch_positional(backend.load(text)["pf"], 1, 64, dw, 0, 256, dy)
    np.testing.assert_array_equal(dy.to_numpy(), x * 2)
    np.testing.assert_array_equal(dw.to_numpy(), x)


@pytest.mark.parametrize("off,n,what", [(0, 24, "multiple of 16"), (2, 16, "16-byte aligned"),
                                        (0, 0, "positive"), (32, 256, "past the end")])
def test_bulk_prefetch_bad_range_is_a_fault(off, n, what, rng):
    """A misaligned start, a size not a positive multiple of 16, or a range
    past the allocation (256 bytes) is refused, naming the thread."""
    text = _prefetch_kernel().to_ptx()
    dw = emu.DeviceArray.from_numpy(rng.standard_normal(64).astype(np.float32))
    dy = emu.DeviceArray.empty(64, np.float32)
    with pytest.raises(emu.MemoryFault, match=what):
        emu.launch(emu.Module.from_ptx(text)["pf"], 1, 64, dw, off, n, dy)


def test_bulk_prefetch_builder_checks():
    m = ptxgen.Module("sm_90")
    with pytest.raises(PtxBuildError, match="multiple of 16"):
        with m.kernel("a") as k:
            w = k.param_ptr("w", f32, align=16)
            k.prefetch_l2_bulk(w[0], 40)
    m = ptxgen.Module("sm_90")
    with pytest.raises(PtxBuildError, match="global"):
        with m.kernel("b") as k:
            sh = k.shared_array("sh", f32, 16, align=16)
            k.prefetch_l2_bulk(sh[0], 64)
    m = ptxgen.Module("sm_80")
    with pytest.raises(ptxgen.errors.TargetError, match="needs sm_90"):
        with m.kernel("c") as k:
            w = k.param_ptr("w", f32, align=16)
            k.prefetch_l2_bulk(w[0], 64)


def test_module_version_rises_only_where_needed():
    """Every module holding the prefetch says .version 8.0 (the builder caches
    checked forms, so the second build must still raise it); an sm_90 module
    without it keeps the target's 7.8."""
    for _ in range(2):
        assert ".version 8.0" in _prefetch_kernel().to_ptx()
    m = ptxgen.Module("sm_90")
    with m.kernel("plain") as k:
        y = k.param_ptr("y", f32)
        k.st(y[k.tid.x], k.mov(1.0, f32))
    assert ".version 7.8" in m.to_ptx()
