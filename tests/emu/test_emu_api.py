"""The emulator's public API: module loading, launch checks, device arrays,
and that every instruction in the table has semantics."""

import numpy as np
import pytest

import ptxgen
from ptxgen import emu, isa, registry
from ptxgen.types import f32


def test_every_table_opcode_has_semantics():
    missing = sorted(set(isa.TABLE) - set(emu.SEMANTICS))
    assert not missing, f"opcodes without emulator semantics: {missing}"


def test_semantics_keys_are_table_opcodes():
    assert set(emu.SEMANTICS) <= set(isa.TABLE)


def _vadd():
    f, s = registry.canonical_specs()["vector_add"]
    return emu.Module.from_ptx(f.build(s)), s.kernel_name


def test_module_api_mirrors_driver():
    mod, name = _vadd()
    fn = mod.function(name)
    assert mod[name] is fn
    assert [p.name for p in fn.params] == ["a", "b", "c", "n"]
    assert mod.entries[name][0].is_pointer
    with pytest.raises(KeyError, match="no kernel"):
        mod.function("nope")
    assert emu.Module.from_ptx(mod.ptx.encode()).kernel_names == [name]


def test_launch_argument_errors():
    mod, name = _vadd()
    fn = mod[name]
    a = emu.DeviceArray.zeros(8, np.float32)
    with pytest.raises(emu.LaunchArgumentError, match="takes 4 arguments"):
        emu.launch(fn, 1, 32, a, a, a)
    with pytest.raises(emu.LaunchArgumentError, match="host memory"):
        emu.launch(fn, 1, 32, a, a, np.zeros(8, np.float32), 8)
    with pytest.raises(emu.LaunchArgumentError, match="out of range"):
        emu.launch(fn, 1, 32, a, a, a, -1)
    with pytest.raises(emu.LaunchConfigError, match="at most 256"):
        emu.launch(fn, 1, 512, a, a, a, 8)
    with pytest.raises(emu.LaunchConfigError):
        emu.launch(fn, 0, 32, a, a, a, 8)


def test_freed_array_is_refused():
    mod, name = _vadd()
    a = emu.DeviceArray.zeros(8, np.float32)
    b = emu.DeviceArray.zeros(8, np.float32)
    b.free()
    with pytest.raises(emu.LaunchArgumentError, match="freed"):
        emu.launch(mod[name], 1, 32, a, b, a, 8)


def test_device_array_roundtrip(rng):
    x = rng.standard_normal((3, 5)).astype(np.float32)
    d = emu.DeviceArray.from_numpy(x)
    assert d.shape == (3, 5) and d.dtype == np.float32 and d.nbytes == 60
    np.testing.assert_array_equal(d.to_numpy(), x)
    v = d.view(np.float32, (5,), offset=20)
    np.testing.assert_array_equal(v.to_numpy(), x[1])
    d.fill(2.5)
    assert (d.to_numpy() == 2.5).all()
    assert d.copy().to_numpy().sum() == 2.5 * 15


def test_dynamic_shared_and_int_pointer(rng):
    """``.extern .shared`` sized at launch; a raw int address as a pointer."""
    m = ptxgen.Module("sm_80")
    with m.kernel("rev") as k:
        x = k.param_ptr("x", f32)
        sh = k.dynamic_shared("buf", f32)
        t = k.tid.x
        n = k.ntid.x
        k.st(sh[t], k.ld(x[t]))
        k.bar_sync(0)
        k.st(x[t], k.ld(sh[n - 1 - t]))
    host = rng.standard_normal(96).astype(np.float32)
    d = emu.DeviceArray.from_numpy(host)
    mod = emu.Module.from_ptx(m)
    emu.launch(mod["rev"], 1, 96, d.ptr, shared=96 * 4)
    np.testing.assert_array_equal(d.to_numpy(), host[::-1])
    with pytest.raises(emu.MemoryFault, match="shared"):
        emu.launch(mod["rev"], 1, 96, d, shared=95 * 4)


def test_thread_instruction_counter_grows():
    mod, name = _vadd()
    fn = mod[name]
    a = emu.DeviceArray.zeros(100, np.float32)
    before = fn.thread_instructions
    emu.launch(fn, 1, 128, a, a, a, 100)
    assert fn.thread_instructions - before >= 100 * 10


def test_wide_shared_access_with_odd_total_shared_size():
    """A u64 store into shared memory whose total size (20 bytes) is not a
    multiple of 8 must work (regression: the whole buffer was viewed as u64)."""
    import ptxgen
    from ptxgen import emu
    from ptxgen.types import u32, u64
    m = ptxgen.Module("sm_80")
    with m.kernel("k") as k:
        a = k.shared_array("a", u64, 2, align=8)
        b = k.shared_array("b", u32, 1)
        out = k.param_ptr("out", u64)
        t = k.tid.x
        k.st(a[t], t.to(u64) + 7)
        k.st(b[0], k.mov(2, u32), guard=t.eq(0))
        k.bar_sync(0)
        k.st(out[t], k.ld(a[t]))
    o = emu.DeviceArray.from_numpy(np.full(2, 99, np.uint64))
    emu.launch(emu.Module.from_ptx(m.to_ptx()).function("k"), 1, 2, o)
    assert o.to_numpy().tolist() == [7, 8]


def test_free_from_a_finalizer_inside_a_locked_section_does_not_deadlock():
    """A DeviceArray's finalizer frees its allocation; the garbage collector
    can run it during an allocation inside Memory's own locked sections, on
    the thread holding the lock (this hung the test suite). The free is then
    queued and takes effect at the next locked section."""
    import threading
    from ptxgen.emu.memory import Memory
    mem = Memory()
    a, b = mem.alloc(64), mem.alloc(64)
    mem.table()

    def free_while_locked():
        with mem._lock:               # as when the GC runs inside table() / alloc()
            mem.free(a)
    t = threading.Thread(target=free_while_locked, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "free() waited for a lock its own thread holds"
    bases = [int(x) for x in mem.table()[0]]
    assert a not in bases and b in bases
    mem.free(b)
    assert len(mem.table()[0]) == 0
