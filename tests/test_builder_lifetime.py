"""The lifetime of what the builder makes: a dropped module, its kernels,
instructions and registers are freed by reference counting alone, leaving
nothing for Python's cyclic garbage collector (issues 52 and 59: a
collection inside a CUDA graph capture broke captures), and a value used
after its kernel is gone gets an error at the user's line."""

import collections
import contextlib
import gc
import weakref

import pytest

import ptxgen
from ptxgen import registry
from ptxgen.builder import KernelBuilder
from ptxgen.emit import emit_kernel
from ptxgen.errors import PtxBuildError
from ptxgen.types import f32, u32

from backends import line_of

SPECS = registry.canonical_specs()

# Specs whose kernel code (outside ptxgen) holds its builder in a reference
# cycle; each entry says where.  Remove an entry once that code is fixed
# (the strict xfail then fails, as a reminder).
HELD_IN_CYCLES: dict = {}


@contextlib.contextmanager
def _cyclic_garbage():
    """Run the block with the collector off, then collect and report what
    of ptxgen's was found only in cycles: ``found["types"]``, a Counter of
    type names, and ``found["kernels"]``, the names of the kernels whose
    builders were among it.

    Objects older than the block are frozen (``gc.freeze``), so only the
    block's own objects are looked at, and quickly; garbage older than the
    block is frozen with them and not counted.  No collection runs first:
    on a worker that ran the model tests before (the emulator's cache of
    parsed modules), a full one takes seconds.
    """
    found = {"types": collections.Counter(), "kernels": []}
    was_enabled = gc.isenabled()
    gc.disable()
    gc.freeze()
    try:
        yield found
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        for o in gc.garbage:
            cls = type(o)
            if cls.__module__.startswith("ptxgen"):
                found["types"][f"{cls.__module__}.{cls.__qualname__}"] += 1
                if isinstance(o, KernelBuilder):
                    found["kernels"].append(o.name)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def _build_and_drop(name):
    fam, spec = SPECS[name]
    m = fam.build(spec)
    assert m.to_ptx().startswith("//")


@pytest.fixture(scope="module", autouse=True)
def _kernel_modules_imported():
    """Build each spec once first: importing the kernel modules and filling
    the builder's caches is not what is checked."""
    for name in SPECS:
        _build_and_drop(name)


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(reason=HELD_IN_CYCLES[n], strict=True))
    if n in HELD_IN_CYCLES else n for n in sorted(SPECS)])
def test_canonical_kernel_leaves_no_cyclic_garbage(name):
    with _cyclic_garbage() as found:
        _build_and_drop(name)
    assert not found["types"], (f"building and dropping {name} left objects only the cyclic "
                                f"collector frees: kernels {found['kernels']}, "
                                f"{dict(found['types'].most_common())}")


def test_the_check_finds_a_kernel_held_in_a_cycle():
    """The check above can fail: a module kept in a cycle of the user's
    is found, with its kernel and instructions."""
    with _cyclic_garbage() as found:
        m = ptxgen.Module("sm_80")
        with m.kernel("held") as k:
            x = k.param_ptr("x", f32)
            k.st(x[k.tid.x], 1.0)
        m.to_ptx()
        loop = [m]
        loop.append(loop)
        del m, k, x, loop
    assert found["kernels"] == ["held"]
    assert found["types"]["ptxgen.instr.Instr"] > 0


def test_dropped_module_is_freed_without_the_collector():
    gc.disable()
    try:
        m = ptxgen.Module("sm_90")
        with m.kernel("scale", maxntid=128) as k:
            x = k.param_ptr("x", f32)
            n = k.param("n", u32)
            buf = k.shared_array("buf", f32, 128)
            i = k.global_id()
            with k.if_(i < n):
                k.st(buf[k.tid.x], k.ld(x[i]) * 2.0)
            k.bar_sync()
        assert k.module is m and x.kb is k and buf.kernel is k
        m.to_ptx()
        alive = [weakref.ref(o) for o in (m, k, x, n, i)]
        del m, k, x, n, buf, i
        assert [r() for r in alive] == [None] * len(alive)
    finally:
        gc.enable()


def _values_of_a_dropped_module():
    m = ptxgen.Module("sm_80")
    with m.kernel("gone") as k:
        n = k.param("n", u32)
        buf = k.shared_array("buf", u32, 32)
        k.st(buf[0], n)
    m.to_ptx()
    return n, buf


def test_register_of_a_gone_kernel():
    n, buf = _values_of_a_dropped_module()
    with pytest.raises(PtxBuildError, match=r"register %r1 belongs to kernel gone, which "
                                            r"is gone: its Module was dropped") as ei:
        n + 1  # MARK-gone-add
    assert ei.value.loc.lineno == line_of(__file__, "MARK-gone-add")
    with pytest.raises(PtxBuildError, match=r"shared array buf belongs to kernel gone, "
                                            r"which is gone") as ei:
        buf[3]  # MARK-gone-index
    assert ei.value.loc.lineno == line_of(__file__, "MARK-gone-index")

    m = ptxgen.Module("sm_80")
    with m.kernel("live") as k:
        with pytest.raises(PtxBuildError, match=r"register %r1 belongs to kernel gone, "
                                                r"which is gone \(its Module was dropped\), "
                                                r"not live") as ei:
            k.add(n, 1)  # MARK-gone-other
        assert ei.value.loc.lineno == line_of(__file__, "MARK-gone-other")


def test_register_of_a_finished_kernel():
    m = ptxgen.Module("sm_80")
    with m.kernel("done") as k:
        n = k.param("n", u32)
    with pytest.raises(PtxBuildError, match="kernel done is already finished") as ei:
        n + 1  # MARK-finished
    assert ei.value.loc.lineno == line_of(__file__, "MARK-finished")


def test_kernel_outlives_its_module():
    """The builder holds its module weakly: a kernel kept on its own still
    builds, and says its module is gone."""
    k = ptxgen.Module("sm_80").kernel("solo")
    assert k.module is None
    n = k.param("n", u32)
    k.add(n, 1)
    k.finish()
    assert "\tadd.u32 \t%r2, %r1, 1;" in emit_kernel(k)
