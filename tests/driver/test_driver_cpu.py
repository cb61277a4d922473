"""Driver-layer behaviour that needs no GPU: errors, cache keys and files, launch refusals."""

import ctypes
import importlib
import struct
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

from driver_ptx import EMPTY_PTX, VADD_PTX
from ptxgen.abi import ArgPacker, LaunchArgumentError, parse_entries
from ptxgen.driver import cache, errors
from ptxgen.driver.errors import CUDAError, CUDAUnavailableError, LaunchConfigError, check
from ptxgen.driver.jit import jit_error, normalize_options, ptx_text
from ptxgen.driver.launch import launch, normalize_dims
from ptxgen.driver.memory import DeviceArray
from ptxgen.driver.module import Function

launch_mod = importlib.import_module("ptxgen.driver.launch")  # the package re-exports launch()


def test_import_does_not_load_bindings_or_libcuda():
    code = (
        "import sys, ptxgen.driver, ptxgen.abi\n"
        "assert 'cuda.bindings.driver' not in sys.modules, 'bindings imported eagerly'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


# ----------------------------------------------------------------------------- errors


@pytest.fixture
def fake_driver(monkeypatch):
    """Swap the bindings module for a fake; restores init state afterwards."""
    from cuda.bindings import driver as real

    fake = types.SimpleNamespace(CUresult=real.CUresult)
    monkeypatch.setattr(errors, "_driver_mod", fake)
    monkeypatch.setattr(errors, "_initialized", False)
    return fake


def test_missing_libcuda_gives_install_hint(fake_driver):
    class DynamicLibNotFoundError(RuntimeError):
        pass

    def cuInit(flags):
        raise DynamicLibNotFoundError('"cuda" is an NVIDIA driver library and can only be found via system search')

    fake_driver.cuInit = cuInit
    with pytest.raises(CUDAUnavailableError) as ei:
        errors.init()
    msg = str(ei.value)
    assert msg.startswith("no NVIDIA driver / no GPU found")
    assert "install the NVIDIA display driver" in msg and "ptxgen.emu" in msg
    assert errors.is_available() is False


def test_no_device_result_is_explained(fake_driver):
    fake_driver.cuInit = lambda flags: (fake_driver.CUresult.CUDA_ERROR_NO_DEVICE,)
    with pytest.raises(CUDAUnavailableError, match="CUDA_ERROR_NO_DEVICE.*reports no GPU"):
        errors.init()


def test_real_missing_driver_on_this_machine():
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        load_nvidia_dynamic_lib("cuda")
        pytest.skip("a CUDA driver library is installed here")
    except Exception:
        pass
    from ptxgen.driver import Module, get_device

    with pytest.raises(CUDAUnavailableError, match="no NVIDIA driver / no GPU found"):
        get_device()
    with pytest.raises(CUDAUnavailableError):
        Module.from_ptx(EMPTY_PTX)


def test_check_unpacks_and_raises():
    from cuda.bindings import driver as d

    ok = d.CUresult.CUDA_SUCCESS
    assert check((ok,)) is None
    assert check((ok, 5)) == 5
    assert check((ok, 1, 2)) == (1, 2)
    with pytest.raises(CUDAError) as ei:
        check((d.CUresult.CUDA_ERROR_INVALID_VALUE, None), "cuMemAlloc")
    e = ei.value
    assert e.code == 1 and e.name == "CUDA_ERROR_INVALID_VALUE"
    assert str(e).startswith("cuMemAlloc: CUDA_ERROR_INVALID_VALUE")


# ----------------------------------------------------------------------------- JIT helpers


def test_jit_error_quotes_offending_lines():
    from cuda.bindings import driver as d

    lines = VADD_PTX.splitlines()
    bad = next(i for i, s in enumerate(lines, 1) if "add.f32" in s)
    log = (f"ptxas application ptx input, line {bad}; error   : Arguments mismatch for instruction 'add'\n"
           f"ptxas application ptx input, line {bad}; error   : again\n"
           "ptxas fatal   : Ptx assembly aborted due to errors")
    e = jit_error(d.CUresult.CUDA_ERROR_INVALID_PTX, VADD_PTX, log, "", "cuModuleLoadDataEx")
    assert e.bad_lines == [(bad, lines[bad - 1])]
    msg = str(e)
    assert "CUDA_ERROR_INVALID_PTX" in msg and "of vadd" in msg
    assert "Arguments mismatch" in msg and f"{bad} | " in msg and "add.f32 %f3, %f1, %f2;" in msg
    assert isinstance(e, CUDAError) and e.log == log


def test_normalize_options_and_ptx_text():
    assert normalize_options(None) == {}
    assert normalize_options({"opt_level": 3, "line_info": 1, "max_registers": None}) == {
        "opt_level": 3, "line_info": True}
    with pytest.raises(ValueError, match="unknown JIT option"):
        normalize_options({"fast_math": True})
    with pytest.raises(ValueError, match="opt_level"):
        normalize_options({"opt_level": 7})

    class FromDSL:
        def to_ptx(self):
            return EMPTY_PTX

    assert ptx_text(FromDSL()) == EMPTY_PTX
    assert ptx_text(EMPTY_PTX.encode()) == EMPTY_PTX
    with pytest.raises(TypeError):
        ptx_text(42)


# ----------------------------------------------------------------------------- cache keys


def test_module_key_depends_on_text_and_options():
    k = cache.module_key(VADD_PTX, {})
    assert k == cache.module_key(VADD_PTX, None) and len(k) == 64
    assert k != cache.module_key(VADD_PTX + " ", {})
    assert k != cache.module_key(VADD_PTX, {"opt_level": 3})
    assert cache.module_key(VADD_PTX, {"a": 1, "b": 2}) == cache.module_key(VADD_PTX, {"b": 2, "a": 1})


def test_disk_key_hashes_every_field():
    base = dict(ptx=VADD_PTX, arch="sm_90", driver_version=12080, options={}, version="0.1.0")
    k = cache.disk_key(**base)
    variants = [
        dict(base, ptx=VADD_PTX.replace("add.f32", "sub.f32")),
        dict(base, arch="sm_89"),
        dict(base, driver_version=12090),
        dict(base, options={"opt_level": 2}),
        dict(base, version="0.2.0"),
        dict(base, compiler="Cuda compilation tools, release 13.1, V13.1.80"),
    ]
    keys = {cache.disk_key(**v) for v in variants}
    assert k not in keys and len(keys) == len(variants)
    import ptxgen

    assert cache.disk_key(VADD_PTX, "sm_90", 12080, {}) == cache.disk_key(**dict(base, version=ptxgen.__version__))


def test_ptxas_arch_keeps_the_arch_specific_variant():
    from ptxgen.driver.jit import ptxas_arch

    assert ptxas_arch(".version 8.0\n.target sm_90a\n", "sm_90") == "sm_90a"
    assert ptxas_arch(".version 8.0\n.target sm_80\n", "sm_90") == "sm_90"
    assert ptxas_arch(".version 8.0\n.target sm_90a\n", "sm_100") == "sm_100"
    assert ptxas_arch("// no target line\n", "sm_89") == "sm_89"


def test_compile_cubin_is_whole_program_and_takes_the_options(ptxas):
    """The disk cache's compile: ptxas without ``-c`` (RMSNorm 54 registers
    against 68 relocatable on sm_90), with the JIT options mapped onto its flags."""
    from ptxgen.driver.jit import compile_cubin
    from ptxgen.kernels import rmsnorm
    from ptxgen.ptxas import assemble

    text = rmsnorm.build(rmsnorm.RmsNormSpec()).to_ptx()
    _, whole = assemble(text, "sm_90")
    _, reloc = assemble(text, "sm_90", extra_args=("-c",))
    assert whole[0].registers < reloc[0].registers
    cubin, info = compile_cubin(text, {}, "sm_90", ptxas)
    assert cubin[:4] == b"\x7fELF"
    assert f"{whole[0].name}: {whole[0].registers} registers" in info
    # .maxntid outranks -maxrregcount in ptxas (and in the driver's JIT)
    free = text.replace(".maxntid 256, 1, 1", "")
    _, capped = compile_cubin(free, {"max_registers": 40}, "sm_90", ptxas)
    regs = int(capped.split(": ")[1].split(" registers")[0])
    assert regs <= 40 < whole[0].registers, capped


def test_cache_dir_and_no_cache_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PTXGEN_CACHE_DIR", str(tmp_path / "c"))
    assert cache.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PTXGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "ptxgen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_dir() == cache.Path.home() / ".cache" / "ptxgen"
    for v, enabled in [("1", False), ("true", False), ("0", True), ("", True)]:
        monkeypatch.setenv("PTXGEN_NO_CACHE", v)
        assert cache.cache_enabled() is enabled


# ----------------------------------------------------------------------------- cache files


def test_entry_format_roundtrip():
    payload = b"\x7fELF fake cubin" * 10
    data = cache.encode_entry(payload)
    assert data[:12] == b"PTXGENCUBIN\0" and len(data) == cache.HEADER_SIZE + len(payload)
    assert struct.unpack_from("<IQ", data, 12) == (cache.CACHE_FORMAT, len(payload))
    assert cache.decode_entry(data) == payload


@pytest.mark.parametrize("mutate, why", [
    (lambda d: d[:20], "short file"),
    (lambda d: b"NOTPTXGENCUB" + d[12:], "bad magic"),
    (lambda d: d[:12] + struct.pack("<I", 99) + d[16:], "format 99"),
    (lambda d: d[:-1], "header says"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "digest mismatch"),
])
def test_entry_corruption_detected(mutate, why):
    data = cache.encode_entry(b"cubin bytes " * 8)
    with pytest.raises(cache.CorruptCacheEntry, match=why):
        cache.decode_entry(mutate(data))


def test_disk_cache_put_get_and_corrupt_entry_removed(tmp_path):
    dc = cache.DiskCache(tmp_path)
    key = cache.disk_key(VADD_PTX, "sm_90", 12080, {}, "0.1.0")
    assert dc.get(key) is None
    path = dc.put(key, b"payload-1", {"arch": "sm_90"})
    assert path == tmp_path / "cubin" / key / "module.cubin"
    assert dc.get(key) == b"payload-1"
    assert (path.parent / "meta.json").read_text().count("sm_90") == 1
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
    path.write_bytes(path.read_bytes()[:-3])  # truncated write
    assert dc.get(key) is None and dc.corrupt_count == 1
    assert not path.exists()  # removed so the caller rebuilds it
    dc.put(key, b"payload-2")
    assert dc.get(key) == b"payload-2"


def test_disk_cache_write_is_atomic(tmp_path, monkeypatch):
    dc = cache.DiskCache(tmp_path)
    dc.put("k" * 64, b"old")

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(cache.os, "replace", failing_replace)
    assert dc.put("k" * 64, b"new") is None  # refused quietly
    monkeypatch.undo()
    assert dc.get("k" * 64) == b"old"  # the old entry is intact
    leftovers = [p for p in (tmp_path / "cubin" / ("k" * 64)).iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_disk_cache_concurrent_writers(tmp_path):
    dc = cache.DiskCache(tmp_path)
    payloads = [bytes([i]) * 4096 for i in range(8)]
    threads = [threading.Thread(target=dc.put, args=("same", p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert dc.get("same") in payloads  # always one whole payload, never a mix


def test_memory_cache():
    mc = cache.MemoryCache()
    a, b = object(), object()
    assert mc.put("k", a) is a and mc.put("k", b) is a
    mc.pop("k", b)
    assert mc.get("k") is a
    mc.pop("k", a)
    assert mc.get("k") is None and len(mc) == 0


# ----------------------------------------------------------------------------- launch checks


class _Dev:
    name = "fake GPU"
    max_block_dims = (1024, 1024, 64)
    max_grid_dims = (2**31 - 1, 65535, 65535)
    shared_per_block_optin = 227 * 1024

    def activate(self, force=False):
        return self


class _Mod:
    device = _Dev()


class _Recorder:
    """Stands in for cuda.bindings.driver: records launches and reads the param buffer."""

    def __init__(self, function):
        self.calls = []
        self.function = function
        from cuda.bindings import driver as d

        self.CUresult = d.CUresult

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, kp, extra):
        blobs = []
        if kp:
            ptrs = (ctypes.c_void_p * len(self.function.params)).from_address(kp)
            blobs = [ctypes.string_at(ptrs[i], p.size) for i, p in enumerate(self.function.params)]
        self.calls.append(((gx, gy, gz), (bx, by, bz), shared, stream, blobs))
        return (self.CUresult.CUDA_SUCCESS,)


def _fake_function(ptx, name, monkeypatch, max_threads=256):
    f = Function.__new__(Function)
    f.module = _Mod()
    f.name = name
    f.handle = 0xF00
    f.params = tuple(parse_entries(ptx)[name])
    f.packer = ArgPacker(name, f.params)
    f.num_regs, f.local_size_bytes, f.shared_size_bytes, f.const_size_bytes = 32, 0, 0, 0
    f.max_threads_per_block = max_threads
    f.max_dynamic_shared = 48 * 1024
    f.ptx_version = f.binary_version = 80
    f.cluster = None
    f._init_param_buffer()
    rec = _Recorder(f)
    monkeypatch.setattr(launch_mod, "_driver", rec)
    return f, rec


def test_cluster_grid_refused_before_driver(monkeypatch):
    """A kernel with ``.reqnctapercluster 2`` takes whole clusters only; the
    check runs on the fast path's int grid too."""
    f, rec = _fake_function(VADD_PTX, "vadd", monkeypatch)
    f.cluster = (2, 1, 1)
    with pytest.raises(LaunchConfigError, match=r"grid \(3, 1, 1\) is not a whole number of "
                                                r"clusters of \(2, 1, 1\)"):
        launch(f, 3, 32, 0, 0, 0, 1)
    assert rec.calls == []
    launch(f, 4, 32, 0, 0, 0, 1)
    assert rec.calls[0][0] == (4, 1, 1)


def test_entry_cluster_is_read_from_the_ptx():
    from ptxgen.driver.module import _entry_cluster
    ptx = (".visible .entry a(\n.param .u64 p\n)\n.reqntid 64, 1, 1\n.reqnctapercluster 2, 1, 1\n"
           "{\n\tret;\n}\n.visible .entry b()\n{\n\tret;\n}\n")
    assert _entry_cluster(ptx, "a") == (2, 1, 1)
    assert _entry_cluster(ptx, "b") is None


def test_launch_packs_declared_types(monkeypatch):
    f, rec = _fake_function(VADD_PTX, "vadd", monkeypatch)
    a = DeviceArray(0x10000, (100,), np.float32, None)
    launch(f, 4, 32, a, 0x20000, a.view(offset=16), np.uint32(100))
    ((grid, block, shared, stream, blobs),) = rec.calls
    assert grid == (4, 1, 1) and block == (32, 1, 1) and shared == 0 and stream == 0
    assert blobs == [struct.pack("<Q", 0x10000), struct.pack("<Q", 0x20000),
                     struct.pack("<Q", 0x10010), struct.pack("<I", 100)]
    launch(f, (2, 3), (16, 2, 1), 1, 2, 3, 4, shared=1024)
    assert rec.calls[1][:3] == ((2, 3, 1), (16, 2, 1), 1024)


@pytest.mark.parametrize("grid, block, args, kwargs, err, fragment", [
    (1, 32, (1, 2, 3), {}, LaunchArgumentError, "takes 4 arguments"),
    (1, 32, (1, 2, 3, 2.5), {}, LaunchArgumentError, "no implicit float truncation"),
    (1, 32, (1, 2, 3, -1), {}, LaunchArgumentError, "out of range"),
    (1, 32, (1, 2, np.zeros(2), 4), {}, LaunchArgumentError, "host memory"),
    (1, 512, (1, 2, 3, 4), {}, LaunchConfigError, "at most 256 per block"),
    (1, (16, 32), (1, 2, 3, 4), {}, LaunchConfigError, "512 threads"),
    (1, (1, 1, 128), (1, 2, 3, 4), {}, LaunchConfigError, "block.z = 128 exceeds"),
    (0, 32, (1, 2, 3, 4), {}, LaunchConfigError, "grid extents must be positive"),
    ((1, -1), 32, (1, 2, 3, 4), {}, LaunchConfigError, "positive"),
    (1, 0, (1, 2, 3, 4), {}, LaunchConfigError, "block extents must be positive"),
    (1, 2.0, (1, 2, 3, 4), {}, LaunchConfigError, "block must be an int"),
    ((1, 1, 1, 1), 32, (1, 2, 3, 4), {}, LaunchConfigError, "1 to 3 dimensions"),
    ((1, 70000), 32, (1, 2, 3, 4), {}, LaunchConfigError, "grid.y = 70000 exceeds"),
    (1, 32, (1, 2, 3, 4), {"shared": 64 * 1024}, LaunchConfigError, "set_max_dynamic_shared(65536)"),
    (1, 32, (1, 2, 3, 4), {"shared": 1 << 20}, LaunchConfigError, "at most"),
    (1, 32, (1, 2, 3, 4), {"shared": -4}, LaunchConfigError, "non-negative"),
])
def test_bad_launches_refused_before_driver(monkeypatch, grid, block, args, kwargs, err, fragment):
    f, rec = _fake_function(VADD_PTX, "vadd", monkeypatch)
    with pytest.raises(err) as ei:
        launch(f, grid, block, *args, **kwargs)
    assert fragment in str(ei.value)
    assert rec.calls == []


def test_freed_array_refused_before_driver(monkeypatch):
    f, rec = _fake_function(VADD_PTX, "vadd", monkeypatch)
    a = DeviceArray(0x10000, (8,), np.float32, None)
    a.free()
    assert a.freed
    with pytest.raises(LaunchArgumentError, match="parameter 'a'.*freed"):
        launch(f, 1, 32, a, 1, 2, 8)
    with pytest.raises(ValueError, match="freed"):
        a.ptr
    assert rec.calls == []


def test_launch_from_other_thread_uses_its_own_param_buffer(monkeypatch):
    f, rec = _fake_function(VADD_PTX, "vadd", monkeypatch)
    launch(f, 1, 32, 1, 2, 3, 4)
    t = threading.Thread(target=launch, args=(f, 1, 32, 5, 6, 7, 8))
    t.start()
    t.join()
    assert [c[4] for c in rec.calls] == [
        [struct.pack("<Q", v) for v in (1, 2, 3)] + [struct.pack("<I", 4)],
        [struct.pack("<Q", v) for v in (5, 6, 7)] + [struct.pack("<I", 8)],
    ]
    assert ctypes.string_at(ctypes.addressof(f._buf), 8) == struct.pack("<Q", 1)  # owner's buffer untouched


def test_launch_retries_once_without_context_then_raises(monkeypatch):
    f, rec = _fake_function(VADD_PTX, "vadd", monkeypatch)
    R = rec.CUresult
    results = [R.CUDA_ERROR_INVALID_CONTEXT, R.CUDA_SUCCESS]
    activated = []
    f.module.device.activate = lambda force=False: activated.append(force)
    real = rec.cuLaunchKernel
    monkeypatch.setattr(rec, "cuLaunchKernel", lambda *a: (real(*a), (results.pop(0),))[1])
    monkeypatch.setattr(launch_mod, "_d", lambda: rec)
    launch(f, 1, 32, 1, 2, 3, 4)
    assert activated == [True] and len(rec.calls) == 2 and rec.calls[0] == rec.calls[1]
    results[:] = [R.CUDA_ERROR_INVALID_VALUE]
    with pytest.raises(CUDAError, match=r"cuLaunchKernel\(vadd\).*CUDA_ERROR_INVALID_VALUE"):
        launch(f, 1, 32, 1, 2, 3, 4)


def test_empty_kernel_launch_and_refusal(monkeypatch):
    f, rec = _fake_function(EMPTY_PTX, "empty", monkeypatch, max_threads=1024)
    launch(f, 1, 1024)
    assert rec.calls == [((1, 1, 1), (1024, 1, 1), 0, 0, [])]
    with pytest.raises(LaunchArgumentError, match="takes 0 arguments"):
        launch(f, 1, 32, 5)
    assert len(rec.calls) == 1


def test_normalize_dims():
    assert normalize_dims(5, "grid") == (5, 1, 1)
    assert normalize_dims((2, 3), "grid") == (2, 3, 1)
    assert normalize_dims([np.int64(2), 3, 4], "block") == (2, 3, 4)
    with pytest.raises(LaunchConfigError):
        normalize_dims(True, "grid")


# ----------------------------------------------------------------------------- arrays (no GPU)


def test_device_array_interface_and_views():
    a = DeviceArray(0x1000, (4, 8), np.float16, None)
    cai = a.__cuda_array_interface__
    assert cai == {"shape": (4, 8), "typestr": "<f2", "data": (0x1000, False), "strides": None,
                   "version": 3, "stream": None}
    assert a.nbytes == 64 and a.size == 32 and a.ndim == 2 and len(a) == 4
    v = a.view(np.uint32, offset=16)
    assert v.ptr == 0x1010 and v.shape == (12,)
    assert a.reshape(-1).shape == (32,) and a.reshape(8, 4).shape == (8, 4)
    with pytest.raises(ValueError):
        a.view(np.float32, shape=(17,))
    with pytest.raises(ValueError):
        a.reshape(5, 5)
    assert "freed" not in repr(a)


def test_emu_backend_loads_an_identical_module_once():
    """The emulator backend parses and compiles a module's PTX once: the same
    text from the same builder lines gives the loaded module back; other text
    and plain text load anew."""
    from ptxgen import registry
    from ptxgen.driver.backend import EmuBackend
    specs = registry.canonical_specs()
    fam, spec = specs["vector_add"]
    a, b = EmuBackend(), EmuBackend()
    first = a.load(fam.build(spec))
    assert b.load(fam.build(spec)) is first
    other_fam, other = specs["rmsnorm"]
    assert a.load(other_fam.build(other)) is not first
    text = fam.build(spec).to_ptx()
    assert a.load(text) is not a.load(text)
