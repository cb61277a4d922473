"""Kernels' PTX inlined into the persistent kernel (kernels/megakernel/
inline.py, build_fused): two small DSL kernels of different block sizes,
with parameters, shared memory, barriers, CTA indices and early returns,
run as a tape on the emulator give what their own launches give."""

import numpy as np
import pytest

import ptxgen
from ptxgen import emu
from ptxgen.kernels import megakernel as mk
from ptxgen.kernels.megakernel.inline import inline_entry
from ptxgen.types import f32, u32

N = 200          # A's elements: its last CTA returns early past N


def _scale():
    """A (64 threads): ``y[i] = x[i] * s + (sum of its CTA's x)``, via shared memory."""
    m = ptxgen.Module("sm_90")
    with m.kernel("scale", reqntid=64) as k:
        x, y = k.param_ptr("x", f32), k.param_ptr("y", f32)
        s, n = k.param("s", f32), k.param("n", u32)
        sm = k.shared_array("vals", f32, 64, align=16)
        i = k.ctaid.x * 64 + k.tid.x
        v = k.var(f32, 0.0)
        with k.if_(i < n):
            v.set(k.ld(x[i]))
        k.st(sm[k.tid.x], v)
        k.bar_sync(0)
        tot = k.var(f32, 0.0)
        with k.for_range(0, 64) as j:
            tot.set(tot + k.ld(sm[j]))
        with k.if_(i >= n):
            k.ret()
        k.st(y[i], v * s + tot)
    return m


def _gather():
    """B (32 threads, 2D grid): ``z[cy * nx + cx] = y[32 * (cy * nx + cx) + 31 - tid]``
    reversed through shared memory, lane 0 writing the CTA's first."""
    m = ptxgen.Module("sm_90")
    with m.kernel("gather", reqntid=32) as k:
        y, z = k.param_ptr("y", f32), k.param_ptr("z", f32)
        sm = k.shared_array("buf", f32, 32, align=16)
        c = k.ctaid.y * k.nctaid.x + k.ctaid.x
        k.st(sm[k.tid.x], k.ld(y[c * 32 + k.tid.x]))
        k.bar_sync(0)
        with k.if_(k.tid.x.eq(0)):
            k.st(z[c], k.ld(sm[31]))
    return m


def test_two_kernels_inlined_run_as_their_launches(rng):
    x = rng.standard_normal(N).astype(np.float32)
    s = np.float32(rng.uniform(0.5, 2))
    fk = mk.build_fused([(_scale().to_ptx(), "scale"), (_gather().to_ptx(), "gather")], "sm_90")
    assert fk.threads == 64 and fk.table_words == 4
    xd = emu.DeviceArray.from_numpy(x)
    yd = emu.DeviceArray.from_numpy(np.full(256, np.nan, np.float32))
    zd = emu.DeviceArray.from_numpy(np.full(6, np.nan, np.float32))
    table = np.zeros((2, fk.table_words), np.uint64)
    table[0, :4] = [xd.ptr, yd.ptr, int(s.view(np.uint32)), N]
    table[1, :2] = [yd.ptr, zd.ptr]
    # A: 4 CTAs in two instructions; B: a 3 x 2 grid (CTAs reading y[0:192]) in three
    # A's instructions ask their x into L2 (the emulator checks the range is allocated)
    recs = mk.encode_fused([(0, 0, 0, 2, (), (4, 1, 1), ((xd.ptr, 512),)),
                            (0, 0, 2, 4, (), (4, 1, 1), ((xd.ptr + 512, 288),)),
                            (1, 1, 0, 1, ((0, 2),), (3, 2, 1)),
                            (1, 1, 1, 4, ((0, 2),), (3, 2, 1)),
                            (1, 1, 4, 6, ((0, 2),), (3, 2, 1))])
    fn = emu.Module.from_ptx(fk.ptx)[fk.name]
    counters = emu.DeviceArray.from_numpy(np.zeros(2, np.uint32))
    emu.launch(fn, (3,), (fk.threads,), emu.DeviceArray.from_numpy(recs), len(recs),
               emu.DeviceArray.from_numpy(table), counters, 1)
    xs = np.zeros(256, np.float64)
    xs[:N] = x
    want_y = xs * float(s) + np.repeat(xs.reshape(4, 64).sum(1), 64)
    got_y = yd.to_numpy()
    np.testing.assert_allclose(got_y[:N], want_y[:N], rtol=1e-5, atol=1e-5)
    assert np.isnan(got_y[N:]).all()                       # the early return wrote nothing
    np.testing.assert_array_equal(zd.to_numpy(), got_y[np.arange(6) * 32 + 31])
    np.testing.assert_array_equal(counters.to_numpy(), [2, 3])


def test_the_inliner_refuses_what_it_does_not_know():
    m = ptxgen.Module("sm_90")
    with m.kernel("plain") as k:
        k.st(k.param_ptr("y", u32)[0], 1)
    with pytest.raises(ValueError, match="no .reqntid or .maxntid"):
        inline_entry(m.to_ptx(), "plain", "a_")
    with pytest.raises(ValueError, match="no entry 'other'"):
        inline_entry(_scale().to_ptx(), "other", "a_")
    text = _scale().to_ptx().replace("bar.sync \t0;", "bar.sync \t3, 64;")
    with pytest.raises(ValueError, match=r"barrier 'bar.sync.*3, 64;' is not one"):
        inline_entry(text, "scale", "a_")


def test_a_prefetch_range_must_be_aligned_and_allocated(rng):
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        mk.encode_fused([(0, 0, 0, 1, (), (1, 1, 1), ((0x1008, 32),))])
    fk = mk.build_fused([(_gather().to_ptx(), "gather")], "sm_90")
    y = emu.DeviceArray.from_numpy(np.zeros(64, np.float32))
    table = np.zeros((1, fk.table_words), np.uint64)
    table[0, :2] = [y.ptr, y.ptr]
    recs = mk.encode_fused([(0, 0, 0, 1, (), (1, 1, 1), ((y.ptr, 4096),))])
    with pytest.raises(emu.MemoryFault, match="prefetch"):
        emu.launch(emu.Module.from_ptx(fk.ptx)[fk.name], (1,), (fk.threads,),
                   emu.DeviceArray.from_numpy(recs), 1, emu.DeviceArray.from_numpy(table),
                   emu.DeviceArray.from_numpy(np.zeros(1, np.uint32)), 1)
