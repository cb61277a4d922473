"""Driver layer on a real GPU (skipped cleanly without a driver or device)."""

import threading

import numpy as np
import pytest

from driver_ptx import BLOCK_SUM_PTX, EMPTY_PTX, VADD_PTX
from ptxgen.abi import LaunchArgumentError
from ptxgen.driver import (
    DeviceArray,
    Event,
    GraphCaptureError,
    LaunchConfigError,
    Module,
    PTXJitError,
    Stream,
    as_device_array,
    cache,
    capture,
    launch,
    pinned_empty,
)
from ptxgen.driver.jit import cubin_compiler, ptxas_arch

pytestmark = pytest.mark.gpu


@pytest.fixture
def vadd(gpu_device, cache_root):
    return Module.from_ptx(VADD_PTX)["vadd"]


def _poisoned(n):
    return DeviceArray.from_numpy(np.full(n, np.nan, np.float32))


def _blocks(n, b=256):
    return (n + b - 1) // b


# ----------------------------------------------------------------------------- device


def test_device_attributes(gpu_device):
    d = gpu_device
    major, minor = d.compute_capability
    assert d.target == f"sm_{major}{minor}" and major >= 5
    assert d.sm_count > 0 and d.l2_bytes > 0 and d.max_threads_per_block >= 1024
    assert d.shared_per_block >= 48 * 1024 and d.shared_per_block_optin >= d.shared_per_block
    assert d.shared_per_sm >= d.shared_per_block
    assert d.bus_width_bits > 0 and d.name
    if d.bandwidth_gbps is not None:
        assert 50 < d.bandwidth_gbps < 20000
    s = d.summary()
    assert s["driver_version"] > 0 and s["total_memory"] > 0
    free, total = d.mem_info()
    assert 0 < free <= total


# ----------------------------------------------------------------------------- modules


def test_vadd_matches_numpy(vadd, rng):
    n = 1000  # not a multiple of the block
    a, b = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
    da, db, dc = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), _poisoned(n)
    launch(vadd, _blocks(n), 256, da, db, dc, n)
    np.testing.assert_array_equal(dc.to_numpy(), a + b)
    assert vadd.num_regs > 0 and 0 < vadd.max_threads_per_block <= 1024
    assert vadd.local_size_bytes == 0 and vadd.shared_size_bytes == 0
    assert [p.name for p in vadd.params] == ["a", "b", "c", "n"]


def test_block_sum_matches_numpy(gpu_device, cache_root, rng):
    f = Module.from_ptx(BLOCK_SUM_PTX).function("block_sum")
    assert f.shared_size_bytes == 256 * 4
    n = 256 * 7 + 13
    x = rng.standard_normal(n, np.float32)
    out = _poisoned(_blocks(n))
    f(_blocks(n), 256, DeviceArray.from_numpy(x), out, n)
    ref = np.add.reduceat(x.astype(np.float64), np.arange(0, n, 256))
    np.testing.assert_allclose(out.to_numpy(), ref, rtol=1e-5, atol=1e-5)


def test_from_object_with_to_ptx(gpu_device, cache_root):
    class Built:
        def to_ptx(self):
            return EMPTY_PTX

    mod = Module.from_ptx(Built())
    assert mod.names == ["empty"] and "empty" in mod
    launch(mod["empty"], 1, 32)
    gpu_device.synchronize()
    with pytest.raises(KeyError, match="has: empty"):
        mod.function("nope")


@pytest.mark.parametrize("use_cache", [False, True])
def test_broken_ptx_quotes_bad_line(gpu_device, cache_root, use_cache):
    bad_text = VADD_PTX.replace("add.f32 %f3, %f1, %f2;", "add.f32 %f3, %f1, %rd2;")
    lines = bad_text.splitlines()
    bad_line = next(i for i, s in enumerate(lines, 1) if "%rd2;" in s and "add.f32" in s)
    with pytest.raises(PTXJitError) as ei:
        Module.from_ptx(bad_text, cache=use_cache)
    e = ei.value
    assert e.log and (bad_line, lines[bad_line - 1]) in e.bad_lines
    assert f"{bad_line} | " in str(e) and "add.f32 %f3, %f1, %rd2;" in str(e)
    # the context is still fine
    launch(Module.from_ptx(EMPTY_PTX)["empty"], 1, 1)
    gpu_device.synchronize()


# ----------------------------------------------------------------------------- launches


def test_bad_launches_refused(vadd):
    n = 64
    da, db, dc = (DeviceArray.zeros(n) for _ in range(3))
    cases = [
        ((1, 64, da, db, dc), LaunchArgumentError, "takes 4 arguments"),
        ((1, 64, da, db, dc, 1.5), LaunchArgumentError, "float"),
        ((1, 64, da, db, dc, da), LaunchArgumentError, "scalar integer"),
        ((1, 64, da, db, 3.0, n), LaunchArgumentError, "device pointer"),
        ((1, 64, da, db, dc, -1), LaunchArgumentError, "out of range"),
        ((1, vadd.max_threads_per_block + 1, da, db, dc, n), LaunchConfigError, "per block"),
        ((0, 64, da, db, dc, n), LaunchConfigError, "positive"),
    ]
    for args, err, frag in cases:
        with pytest.raises(err, match=frag):
            launch(vadd, *args)
    freed = DeviceArray.zeros(n)
    freed.free()
    with pytest.raises(LaunchArgumentError, match="freed"):
        launch(vadd, 1, 64, da, freed, dc, n)
    big = vadd.max_dynamic_shared + 1024
    with pytest.raises(LaunchConfigError, match="set_max_dynamic_shared"):
        launch(vadd, 1, 64, da, db, dc, n, shared=big)
    optin = vadd.module.device.shared_per_block_optin
    if optin >= big:
        vadd.set_max_dynamic_shared(big)
        launch(vadd, 1, 64, da, db, dc, n, shared=big)
        vadd.module.device.synchronize()
    with pytest.raises(ValueError):
        vadd.set_max_dynamic_shared(optin + 1)


def test_launch_from_another_thread(vadd, rng):
    n = 300
    a = rng.standard_normal(n, np.float32)
    da, dc = DeviceArray.from_numpy(a), _poisoned(n)
    errors = []

    def work():
        try:
            launch(vadd, _blocks(n), 256, da, da, dc, n)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert errors == []
    np.testing.assert_array_equal(dc.to_numpy(), a + a)


def test_arrays_copy_from_a_thread_that_never_activated_the_context(gpu_device, rng):
    """A thread that only copies (the batched engine's loop once its graphs
    were captured in the loading thread) gets the context made current by
    the array: no CUDA_ERROR_INVALID_CONTEXT."""
    a = rng.standard_normal(257).astype(np.float32)
    da = DeviceArray.from_numpy(a)
    got, errors = [], []

    def work():
        try:
            got.append(da.to_numpy())
            da.copy_from(2 * a)
            da.fill(0.0)
            got.append(da.to_numpy())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert errors == []
    np.testing.assert_array_equal(got[0], a)
    np.testing.assert_array_equal(got[1], np.zeros_like(a))


# ----------------------------------------------------------------------------- arrays


def test_array_roundtrip_fill_and_copies(gpu_device, rng):
    x = rng.standard_normal((3, 5)).astype(np.float16)
    d = DeviceArray.from_numpy(x)
    assert d.shape == (3, 5) and d.dtype == np.float16 and d.nbytes == 30
    np.testing.assert_array_equal(d.to_numpy(), x)
    for dtype, v in [(np.float32, 2.5), (np.int8, -3), (np.float16, 1.5), (np.float64, -7.25), (np.uint32, 9)]:
        a = DeviceArray.empty(37, dtype).fill(v)
        np.testing.assert_array_equal(a.to_numpy(), np.full(37, v, dtype))
    z = DeviceArray.zeros((4, 4), np.int32)
    assert not z.to_numpy().any()
    c = d.copy()
    np.testing.assert_array_equal(c.to_numpy(), x)
    s = Stream()
    pin = pinned_empty((3, 5), np.float16)
    pin[:] = x * 2
    c.copy_from(pin, stream=s)
    out = pinned_empty((3, 5), np.float16)
    c.to_numpy(out, stream=s)
    np.testing.assert_array_equal(out, x * 2)
    with pytest.raises(ValueError, match="size mismatch"):
        c.copy_from(np.zeros(3, np.float16))


def test_leak_cycles_return_memory(gpu_device, cache_root):
    import gc

    Module.from_ptx(VADD_PTX).unload()  # warm: JIT once, then load from disk
    DeviceArray.empty(1 << 20).free()
    gc.collect()
    gpu_device.synchronize()
    free0, _ = gpu_device.mem_info()
    for _ in range(300):
        m = Module.from_ptx(VADD_PTX)
        assert m.source == "disk"
        m.unload()
        a = DeviceArray.empty(1 << 20)
        del a  # freed by its finalizer
        b = DeviceArray.empty(1 << 18)
        b.free()
    gc.collect()
    gpu_device.synchronize()
    free1, _ = gpu_device.mem_info()
    # 300 leaked MiB-sized buffers or modules would show; allow one allocator page of slack
    assert abs(free0 - free1) <= 2 << 20, (free0, free1)


# ----------------------------------------------------------------------------- interop


def test_torch_interop(vadd):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    n = 777
    a = torch.randn(n, device="cuda")
    b = torch.randn(n, device="cuda")
    c = torch.full((n,), float("nan"), device="cuda")
    torch.cuda.synchronize()
    launch(vadd, _blocks(n), 256, a, b, c, n)
    gpu_device = vadd.module.device
    gpu_device.synchronize()
    torch.testing.assert_close(c, a + b, rtol=0, atol=0)
    # our array viewed by torch without a copy
    ours = DeviceArray.from_numpy(np.arange(n, dtype=np.float32))
    t = torch.as_tensor(ours, device="cuda")
    assert t.data_ptr() == ours.ptr
    launch(vadd, _blocks(n), 256, ours, ours, ours, n)  # in place: ours *= 2
    gpu_device.synchronize()
    assert torch.equal(t.cpu(), torch.arange(n, dtype=torch.float32) * 2)
    # torch's tensor viewed by us without a copy
    v = as_device_array(a)
    assert v.ptr == a.data_ptr() and v.shape == (n,) and v.dtype == np.float32
    np.testing.assert_array_equal(v.to_numpy(), a.cpu().numpy())
    # a torch stream is accepted
    ts = torch.cuda.Stream()
    launch(vadd, _blocks(n), 256, a, a, c, n, stream=ts)
    ts.synchronize()
    torch.testing.assert_close(c, a + a, rtol=0, atol=0)


def test_cupy_interop(vadd):
    cp = pytest.importorskip("cupy")
    n = 513
    a = cp.arange(n, dtype=cp.float32)
    c = cp.full(n, cp.nan, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    launch(vadd, _blocks(n), 256, a, a, c, n)
    vadd.module.device.synchronize()
    assert bool((c == 2 * a).all())
    ours = DeviceArray.from_numpy(np.ones(n, np.float32))
    assert int(cp.asarray(ours).sum()) == n


# ----------------------------------------------------------------------------- streams, events


def test_streams_and_events(vadd):
    n = 1 << 16
    s = Stream()
    da = DeviceArray.from_numpy(np.ones(n, np.float32))
    dc = DeviceArray.empty(n)
    start = s.record()
    for _ in range(10):
        launch(vadd, _blocks(n), 256, da, da, dc, n, stream=s)
    end = s.record()
    ms = start.elapsed_ms(end)
    assert ms > 0 and end.query() and s.query()
    s.synchronize()
    e = Event(timing=False).record(s)
    e.synchronize()
    with pytest.raises(ValueError):
        start.elapsed_ms(e)
    assert s.ptr != 0


# ----------------------------------------------------------------------------- graphs


def test_graph_capture_replay_update(vadd, rng):
    n = 1000
    s = Stream()
    a = rng.standard_normal(n, np.float32)
    b = rng.standard_normal(n, np.float32)
    da, db, dc, dd = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), _poisoned(n), _poisoned(n)
    with capture(s) as g:
        launch(vadd, _blocks(n, 256), 256, da, db, dc, n, stream=s)      # c = a + b
        launch(vadd, _blocks(n, 128), 128, dc, db, dd, n, stream=s)      # d = c + b
    assert g.num_nodes == 2 and len(g.kernel_nodes) == 2
    assert all(node.function is vadd for node in g.kernel_nodes)
    first = next(nd for nd in g.kernel_nodes if nd.block == (256, 1, 1))  # the a + b launch
    exe = g.instantiate()
    np.testing.assert_array_equal(dc.to_numpy(), np.full(n, np.nan, np.float32))  # nothing ran yet
    exe.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(dd.to_numpy(), (a + b) + b)
    # point the first kernel at a new input, replay
    a2 = rng.standard_normal(n, np.float32)
    da2 = DeviceArray.from_numpy(a2)
    exe.set_kernel_args(first, da2, db, dc, n)
    exe.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(dd.to_numpy(), (a2 + b) + b)
    with pytest.raises(LaunchArgumentError):
        exe.set_kernel_args(first, da2, db, dc)


def test_graph_nodes_in_capture_order(vadd):
    s = Stream()
    n = 256
    da = DeviceArray.zeros(n)
    with capture(s) as g:
        for blocks in (1, 2, 3):
            launch(vadd, blocks, 64, da, da, da, n, stream=s)
    assert [nd.grid[0] for nd in g.kernel_nodes] == [1, 2, 3]


def test_failed_capture_ends_and_context_survives(vadd, rng):
    s = Stream()
    n = 512
    a = rng.standard_normal(n, np.float32)
    da, dc = DeviceArray.from_numpy(a), _poisoned(n)
    with pytest.raises(GraphCaptureError, match="capture"):
        with capture(s):
            launch(vadd, _blocks(n), 256, da, da, dc, n, stream=s)
            dc.to_numpy()  # a synchronous copy is illegal while capturing
    with pytest.raises(GraphCaptureError, match="KeyError"):
        with capture(s):
            launch(vadd, _blocks(n), 256, da, da, dc, n, stream=s)
            raise KeyError("user code failed")
    from ptxgen.driver.errors import check, cuda

    status = check(cuda().cuStreamIsCapturing(s.handle))
    assert status == cuda().CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    launch(vadd, _blocks(n), 256, da, da, dc, n, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(dc.to_numpy(), a + a)
    with capture(s) as g:  # capturing again works
        launch(vadd, _blocks(n), 256, da, da, dc, n, stream=s)
    g.instantiate().launch(s)
    s.synchronize()


# ----------------------------------------------------------------------------- cache


def test_disk_cache_hit_corruption_and_bypass(gpu_device, cache_root, monkeypatch):
    from ptxgen.driver import driver_version

    m1 = Module.from_ptx(VADD_PTX)
    assert m1.source == "jit"
    assert Module.from_ptx(VADD_PTX) is m1  # in-process hit
    key = cache.disk_key(VADD_PTX, gpu_device.target, driver_version(), {},
                         compiler=cubin_compiler()[1])
    path = cache.DiskCache().entry_path(key)
    assert path.exists() and path.read_bytes()[:12] == b"PTXGENCUBIN\0"
    cache.memory_cache.clear()
    m2 = Module.from_ptx(VADD_PTX)
    assert m2.source == "disk" and m2 is not m1
    # corrupt: truncated file -> rebuilt
    path.write_bytes(path.read_bytes()[:100])
    cache.memory_cache.clear()
    m3 = Module.from_ptx(VADD_PTX)
    assert m3.source == "jit" and cache.decode_entry(path.read_bytes())
    # well-formed entry whose payload the driver refuses -> rebuilt
    path.write_bytes(cache.encode_entry(b"definitely not a cubin\0"))
    cache.memory_cache.clear()
    m4 = Module.from_ptx(VADD_PTX)
    assert m4.source == "jit"
    n = 100
    a = DeviceArray.from_numpy(np.arange(n, dtype=np.float32))
    out = _poisoned(n)
    launch(m4["vadd"], 1, 128, a, a, out, n)
    np.testing.assert_array_equal(out.to_numpy(), 2 * np.arange(n, dtype=np.float32))
    # bypass
    monkeypatch.setenv("PTXGEN_NO_CACHE", "1")
    other = VADD_PTX.replace("// c[i]", "// uncached c[i]")
    m5 = Module.from_ptx(other)
    assert m5.source == "jit" and Module.from_ptx(other) is not m5
    okey = cache.disk_key(other, gpu_device.target, driver_version(), {},
                          compiler=cubin_compiler()[1])
    assert not cache.DiskCache().entry_path(okey).exists()


def test_cached_cubin_is_compiled_whole(gpu_device, cache_root):
    """A disk-cached kernel has the registers of a whole-program compile
    (ptxas without -c), not the linker's relocatable ones; RMSNorm at d 4096
    is 54 against 68 on sm_90 with ptxas 13.0; the test asserts they differ,
    so it can tell the two apart."""
    from ptxgen.kernels import rmsnorm
    from ptxgen.ptxas import assemble

    text = rmsnorm.build(rmsnorm.RmsNormSpec()).to_ptx()
    arch = ptxas_arch(text, gpu_device.target)
    _, whole = assemble(text, arch)
    _, reloc = assemble(text, arch, extra_args=("-c",))
    m = Module.from_ptx(text)
    cache.memory_cache.clear()
    again = Module.from_ptx(text)
    assert (m.source, again.source) == ("jit", "disk")
    assert [r.registers for r in whole] != [r.registers for r in reloc]
    for r, rr in zip(whole, reloc):
        assert again[r.name].num_regs == r.registers, (r, again[r.name].num_regs)
        print(f"{r.name}: whole {r.registers} regs, relocatable {rr.registers}")


def test_without_ptxas_the_driver_jit_and_no_disk_entry(gpu_device, cache_root, monkeypatch):
    from ptxgen.driver import module as M

    monkeypatch.setattr(M, "cubin_compiler", lambda: None)
    text = VADD_PTX.replace("// c[i]", "// no ptxas c[i]")
    m = Module.from_ptx(text)
    assert m.source == "jit" and Module.from_ptx(text) is m
    assert not any(cache.cache_dir().rglob("module.cubin"))
    n = 300
    a = DeviceArray.from_numpy(np.arange(n, dtype=np.float32))
    out = _poisoned(n)
    launch(m["vadd"], 3, 128, a, a, out, n)
    np.testing.assert_array_equal(out.to_numpy(), 2 * np.arange(n, dtype=np.float32))


def test_copy_bandwidth_frees_its_buffers(gpu_device):
    """The copy ceiling: a rate no device reaches past 20 TB/s nor stays
    under 50 GB/s, the time per copy agreeing with it, and its two buffers
    given back."""
    from ptxgen.driver.timing import copy_bandwidth
    free0 = gpu_device.mem_info()[0]
    n = 64 << 20
    bw, t = copy_bandwidth(n, reps=4)
    assert 5e10 < bw < 2e13, bw
    assert bw == pytest.approx(2 * n / t, rel=1e-9)
    assert gpu_device.mem_info()[0] >= free0 - (8 << 20)      # 128 MiB allocated, returned
