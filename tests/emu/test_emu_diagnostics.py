"""Planted bugs are reported with the PTX line, the block and the thread,
and for a module built in-process with the test's own file:line."""

import os
import re

import numpy as np
import pytest

import ptxgen
from ptxgen import emu
from ptxgen.types import f32, u32

from backends import line_of


def _line_of(text, needle):
    """1-based numbers of the lines of ``text`` containing ``needle``."""
    return [i + 1 for i, ln in enumerate(text.split("\n")) if needle in ln]


def test_out_of_bounds_write_names_line_block_thread(rng):
    m = ptxgen.Module("sm_80")
    with m.kernel("copy_unguarded") as k:
        x = k.param_ptr("x", f32)
        y = k.param_ptr("y", f32)
        k.param("n", u32)
        i = k.global_id()
        k.st(y[i], k.ld(x[i]))            # planted: no i < n guard
    text = m.to_ptx()
    n = int(rng.integers(100, 200))
    # a big enough source, an output exactly n long: the write runs off the end
    x = emu.DeviceArray.from_numpy(rng.standard_normal(256).astype(np.float32))
    y = emu.DeviceArray.empty(n, np.float32)
    mod = emu.Module.from_ptx(text)
    with pytest.raises(emu.MemoryFault) as ei:
        emu.launch(mod["copy_unguarded"], 2, 128, x, y, n)
    e = ei.value
    assert e.line in _line_of(text, "st.global.f32")
    assert "st.global.f32" in e.text
    first_bad = n
    assert e.block == (first_bad // 128, 0, 0)
    assert e.thread == (first_bad % 128, 0, 0)
    assert "past the end" in str(e) and f"line {e.line}" in str(e)


def test_missing_barrier_is_a_shared_race(rng):
    m = ptxgen.Module("sm_80")
    with m.kernel("neighbour") as k:
        x = k.param_ptr("x", f32)
        buf = k.shared_array("buf", f32, 64)
        t = k.tid.x
        k.st(buf[t], k.ld(x[t]))
        # planted: no k.bar_sync(0) here
        k.st(x[t], k.ld(buf[t ^ 1]))
    text = m.to_ptx()
    x = emu.DeviceArray.from_numpy(rng.standard_normal(64).astype(np.float32))
    with pytest.raises(emu.RaceError) as ei:
        emu.launch(emu.Module.from_ptx(text)["neighbour"], 1, 64, x)
    e = ei.value
    assert e.line in _line_of(text, "ld.shared.f32") + _line_of(text, "st.shared.f32")
    assert "st.shared.f32" in str(e) and "ld.shared.f32" in str(e)
    assert e.block == (0, 0, 0)
    assert "no bar.sync between" in str(e)


def test_with_the_barrier_there_is_no_race(rng):
    m = ptxgen.Module("sm_80")
    with m.kernel("neighbour") as k:
        x = k.param_ptr("x", f32)
        buf = k.shared_array("buf", f32, 64)
        t = k.tid.x
        k.st(buf[t], k.ld(x[t]))
        k.bar_sync(0)
        k.st(x[t], k.ld(buf[t ^ 1]))
    host = rng.standard_normal(64).astype(np.float32)
    x = emu.DeviceArray.from_numpy(host)
    emu.launch(emu.Module.from_ptx(m)["neighbour"], 1, 64, x)
    np.testing.assert_array_equal(x.to_numpy(), host[np.arange(64) ^ 1])


def test_divergent_bar_sync():
    m = ptxgen.Module("sm_80")
    with m.kernel("divergent") as k:
        x = k.param_ptr("x", u32)
        t = k.tid.x
        with k.if_(t < 16):
            k.bar_sync(0)                 # planted: only half the block arrives
        k.st(x[t], t)
    text = m.to_ptx()
    x = emu.DeviceArray.zeros(32, np.uint32)
    with pytest.raises(emu.BarrierError) as ei:
        emu.launch(emu.Module.from_ptx(text)["divergent"], 1, 32, x)
    e = ei.value
    assert f"line {_line_of(text, 'bar.sync')[0]}" in str(e)
    assert e.thread[0] >= 16               # a thread that never reached it
    assert e.block == (0, 0, 0)


def test_two_different_barriers_are_divergent():
    m = ptxgen.Module("sm_80")
    with m.kernel("two_bars") as k:
        x = k.param_ptr("x", u32)
        t = k.tid.x
        with k.if_else(t < 8) as (then, other):
            with then:
                k.bar_sync(0)
            with other:
                k.bar_sync(0)
        k.st(x[t], t)
    text = m.to_ptx()
    with pytest.raises(emu.BarrierError, match="divergent barrier") as ei:
        emu.launch(emu.Module.from_ptx(text)["two_bars"], 1, 32, emu.DeviceArray.zeros(32, np.uint32))
    assert ei.value.line in _line_of(text, "bar.sync")


def test_uninitialised_register_read():
    m = ptxgen.Module("sm_80")
    with m.kernel("maybe") as k:
        x = k.param_ptr("x", u32)
        t = k.tid.x
        v = k.var(u32)
        with k.if_(t < 5):
            v.set(7)
        k.st(x[t], v)                     # planted: threads >= 5 never wrote v
    text = m.to_ptx()
    with pytest.raises(emu.UninitializedRegister) as ei:
        emu.launch(emu.Module.from_ptx(text)["maybe"], 1, 32, emu.DeviceArray.zeros(32, np.uint32))
    e = ei.value
    assert e.line in _line_of(text, "st.global.u32")
    assert e.thread == (5, 0, 0)
    assert "%r" in str(e)


def test_handwritten_uninitialised_register():
    text = """.version 7.8
.target sm_80
.address_size 64
.visible .entry k(
\t.param .u64 .ptr .global .align 4 x
)
{
\t.reg .u32 %r<4>;
\t.reg .u64 %rd<3>;
\tld.param.u64 %rd1, [x];
\tadd.u32 %r1, %r2, 1;
\tst.global.u32 [%rd1], %r1;
\tret;
}
"""
    with pytest.raises(emu.UninitializedRegister, match="%r2") as ei:
        emu.launch(emu.Module.from_ptx(text)["k"], 1, 1, emu.DeviceArray.zeros(1, np.uint32))
    assert ei.value.line == 11


def test_shfl_with_a_lane_missing():
    m = ptxgen.Module("sm_80")
    with m.kernel("half_shfl") as k:
        x = k.param_ptr("x", u32)
        t = k.tid.x
        with k.if_(t < 16):
            k.st(x[t], k.shfl_xor(t, 1))   # full mask, half the warp
    text = m.to_ptx()
    with pytest.raises(emu.WarpSyncError, match="not converged") as ei:
        emu.launch(emu.Module.from_ptx(text)["half_shfl"], 1, 32, emu.DeviceArray.zeros(32, np.uint32))
    assert ei.value.line in _line_of(text, "shfl.sync")


def _uniform_branch(cond_of):
    m = ptxgen.Module("sm_80")
    with m.kernel("uni") as k:
        x = k.param_ptr("x", u32)
        t = k.tid.x
        with k.if_(cond_of(t), uniform=True):
            k.st(x[t], t + 1)
    return m.to_ptx()


def test_uniform_branch_that_diverges_is_caught():
    """``if_(..., uniform=True)`` emits ``bra.uni``: a guard that differs
    inside a warp is reported at the branch; one that differs only between
    warps runs."""
    text = _uniform_branch(lambda t: t < 48)          # warp 1 splits at lane 16
    assert "bra.uni" in text
    with pytest.raises(emu.WarpSyncError, match="bra.uni") as ei:
        emu.launch(emu.Module.from_ptx(text)["uni"], 1, 64, emu.DeviceArray.zeros(64, np.uint32))
    assert ei.value.line in _line_of(text, "bra.uni")
    assert ei.value.thread[0] // 32 == 1
    out = emu.DeviceArray.zeros(64, np.uint32)
    emu.launch(emu.Module.from_ptx(_uniform_branch(lambda t: t < 32))["uni"], 1, 64, out)
    want = np.arange(1, 65, dtype=np.uint32)
    want[32:] = 0
    np.testing.assert_array_equal(out.to_numpy(), want)


def test_misaligned_access():
    text = """.version 7.8
.target sm_80
.address_size 64
.visible .entry k(
\t.param .u64 .ptr .global .align 4 x
)
{
\t.reg .f32 %f<2>;
\t.reg .u64 %rd<3>;
\tld.param.u64 %rd1, [x];
\tld.global.f32 %f1, [%rd1+2];
\tret;
}
"""
    with pytest.raises(emu.MemoryFault, match="misaligned") as ei:
        emu.launch(emu.Module.from_ptx(text)["k"], 1, 1, emu.DeviceArray.zeros(4, np.float32))
    assert ei.value.line == 11


def test_out_of_bounds_shared_read():
    m = ptxgen.Module("sm_80")
    with m.kernel("sh") as k:
        x = k.param_ptr("x", f32)
        buf = k.shared_array("buf", f32, 32)
        t = k.tid.x
        k.st(buf[t], 1.0)
        k.bar_sync(0)
        k.st(x[t], k.ld(buf[t + 1]))       # planted: thread 31 reads buf[32]
    text = m.to_ptx()
    with pytest.raises(emu.MemoryFault, match="shared") as ei:
        emu.launch(emu.Module.from_ptx(text)["sh"], 1, 32, emu.DeviceArray.zeros(32, np.float32))
    assert ei.value.thread == (31, 0, 0)
    assert ei.value.line in _line_of(text, "ld.shared.f32")


def test_early_exit_before_a_barrier_is_fine(rng):
    m = ptxgen.Module("sm_80")
    with m.kernel("early") as k:
        x = k.param_ptr("x", u32)
        n = k.param("n", u32)
        buf = k.shared_array("buf", u32, 64)
        t = k.tid.x
        k.ret(guard=t >= n)               # these threads leave before the barrier
        k.st(buf[t], t * 2)
        k.bar_sync(0)
        k.st(x[t], k.ld(buf[n - 1 - t]))
    n = int(rng.integers(1, 64))
    x = emu.DeviceArray.from_numpy(np.full(64, 7, np.uint32))
    emu.launch(emu.Module.from_ptx(m)["early"], 1, 64, x, n)
    got = x.to_numpy()
    np.testing.assert_array_equal(got[:n], 2 * (n - 1 - np.arange(n)))
    assert (got[n:] == 7).all()


def _halves_kernel(read_other, bar_id=None):
    """Two 64-thread halves of a block, each behind its own named barrier
    (``bar.sync 1 + half, 64``, the id a register): a thread writes its
    slot, its half syncs, it reads a neighbour's slot (``read_other``: in
    the other half, which no barrier orders)."""
    m = ptxgen.Module("sm_80")
    with m.kernel("halves") as k:
        x = k.param_ptr("x", f32)
        buf = k.shared_array("buf", f32, 128)
        t = k.tid.x
        half = t >> 6
        k.st(buf[t], k.ld(x[t]))
        k.bar_sync(bar_id(k, t) if bar_id else half + 1, 64)
        k.st(x[t], k.ld(buf[(t ^ 64) if read_other else (t ^ 1)]))
    return m.to_ptx()


def test_named_barriers_of_two_halves(rng):
    """Warps may name different barriers at one bar.sync (a CTA of
    independent slices): each half syncs alone, and its threads' accesses on
    either side of its own barrier do not race."""
    host = rng.standard_normal(128).astype(np.float32)
    x = emu.DeviceArray.from_numpy(host)
    emu.launch(emu.Module.from_ptx(_halves_kernel(False))["halves"], 2, 128, x)
    np.testing.assert_array_equal(x.to_numpy(), host[np.arange(128) ^ 1])


def test_a_named_barrier_does_not_order_the_other_half(rng):
    text = _halves_kernel(True)
    x = emu.DeviceArray.from_numpy(rng.standard_normal(128).astype(np.float32))
    with pytest.raises(emu.RaceError, match="no bar.sync between") as ei:
        emu.launch(emu.Module.from_ptx(text)["halves"], 1, 128, x)
    e = ei.value
    assert e.line in _line_of(text, "ld.shared.f32") + _line_of(text, "st.shared.f32")
    assert e.block == (0, 0, 0)


def test_a_barrier_id_must_be_warp_uniform(rng):
    # planted: lanes 16..31 of each warp name another barrier
    text = _halves_kernel(False, bar_id=lambda k, t: ((t >> 4) & 1) + 1)
    x = emu.DeviceArray.from_numpy(rng.standard_normal(128).astype(np.float32))
    with pytest.raises(emu.BarrierError, match="differs between the threads of a warp") as ei:
        emu.launch(emu.Module.from_ptx(text)["halves"], 1, 128, x)
    assert ei.value.line in _line_of(text, "bar.sync")


# --- the builder's file:line beside the PTX line ------------------------------

def _here(marker):
    """``path:line`` of the line of this file carrying ``marker``."""
    return f"{__file__}:{line_of(__file__, marker)}"


def _race_module():
    m = ptxgen.Module("sm_80")
    with m.kernel("swap_pairs") as k:
        x = k.param_ptr("x", f32)
        buf = k.shared_array("buf", f32, 64)
        t = k.tid.x
        k.st(buf[t], k.ld(x[t]))            # MARK-race-store
        k.st(x[t], k.ld(buf[t ^ 1]))        # MARK-race-load (planted: no bar.sync before)
    return m


def test_race_names_both_python_lines(rng):
    m = _race_module()
    x = emu.DeviceArray.from_numpy(rng.standard_normal(64).astype(np.float32))
    with pytest.raises(emu.RaceError) as ei:
        emu.launch(emu.Module.from_ptx(m)["swap_pairs"], 1, 64, x)
    e = ei.value
    msg = str(e)
    store, load = _here("MARK-race-store"), _here("MARK-race-load")
    # both conflicting accesses, each beside its own PTX instruction
    assert re.search(r"\(`st\.shared\.f32[^`]*` at " + re.escape(store) + r"\)", msg), msg
    assert re.search(r"\(`ld\.shared\.f32[^`]*` at " + re.escape(load) + r"\)", msg), msg
    # the error's own line (where the second access ran) and its source agree
    assert str(e.source) in (store, load)
    assert f"line {e.line} `{e.text}` at {e.source}" in msg
    assert e.source.filename == __file__


def test_out_of_bounds_global_load_names_the_python_line(rng):
    m = ptxgen.Module("sm_80")
    with m.kernel("gather") as k:
        x = k.param_ptr("x", f32)
        y = k.param_ptr("y", f32)
        i = k.global_id()
        v = k.ld(x[i + 3])                  # MARK-oob-load (planted: runs 3 past the end)
        k.st(y[i], v)
    n = 96
    x = emu.DeviceArray.from_numpy(rng.standard_normal(n).astype(np.float32))
    y = emu.DeviceArray.empty(n, np.float32)
    mod = emu.Module.from_ptx(m)
    with pytest.raises(emu.MemoryFault, match="past the end") as ei:
        emu.launch(mod["gather"], 1, n, x, y)
    e = ei.value
    assert "ld.global.f32" in e.text
    assert str(e.source) == _here("MARK-oob-load")
    assert f"line {e.line} `{e.text}` at {_here('MARK-oob-load')}, block (0, 0, 0)" in str(e)
    assert e.thread == (n - 3, 0, 0)
    # the PTX line is the one the module's text has there
    assert "ld.global.f32" in mod.ptx.split("\n")[e.line - 1]


def test_divergent_barrier_names_both_python_lines():
    m = ptxgen.Module("sm_80")
    with m.kernel("two_bars") as k:
        x = k.param_ptr("x", u32)
        t = k.tid.x
        with k.if_else(t < 8) as (then, other):
            with then:
                k.bar_sync(0)               # MARK-bar-then
            with other:
                k.bar_sync(0)               # MARK-bar-else
        k.st(x[t], t)
    with pytest.raises(emu.BarrierError, match="divergent barrier") as ei:
        emu.launch(emu.Module.from_ptx(m)["two_bars"], 1, 32, emu.DeviceArray.zeros(32, np.uint32))
    msg = str(ei.value)
    assert _here("MARK-bar-then") in msg and _here("MARK-bar-else") in msg, msg


def test_text_without_a_builder_names_the_ptx_line_only(rng):
    text = _race_module().to_ptx()
    x = emu.DeviceArray.from_numpy(rng.standard_normal(64).astype(np.float32))
    mod = emu.Module.from_ptx(text)
    assert mod.sources == {}
    with pytest.raises(emu.RaceError) as ei:
        emu.launch(mod["swap_pairs"], 1, 64, x)
    e = ei.value
    assert e.source is None
    assert os.path.basename(__file__) not in str(e)
    assert re.search(r"at line \d+ \(`st\.shared\.f32[^`]*`\)", str(e)), str(e)
    assert f"line {e.line} `{e.text}`, block" in str(e)


def test_a_source_map_given_with_text(rng):
    text = _race_module().to_ptx()
    line = next(i for i, ln in enumerate(text.split("\n"), 1) if "ld.shared.f32" in ln)
    mod = emu.Module.from_ptx(text, sources={line: "kernel_src.py:7"})
    x = emu.DeviceArray.from_numpy(rng.standard_normal(64).astype(np.float32))
    with pytest.raises(emu.RaceError, match=r"ld\.shared\.f32[^`]*` at kernel_src\.py:7\)"):
        emu.launch(mod["swap_pairs"], 1, 64, x)


def test_the_source_map_agrees_with_the_annotated_text():
    """``to_ptx_and_sources`` gives the text of ``to_ptx`` and, per line, the
    file:line that ``to_ptx(annotate=True)`` writes in a comment there."""
    m = _race_module()
    with m.kernel("second") as k:            # a second kernel: line numbers carry on
        y = k.param_ptr("y", u32)
        k.st(y[k.tid.x], k.tid.x)            # MARK-second-store
    text, sources = m.to_ptx_and_sources()
    assert text == m.to_ptx()
    annotated = m.to_ptx(annotate=True).split("\n")
    assert len(annotated) == len(text.split("\n"))
    seen = {}
    for no, ln in enumerate(annotated, 1):
        hit = re.search(r"\t// (\S+:\d+)$", ln)
        if hit and not ln.lstrip().startswith("//"):
            seen[no] = hit.group(1)
    assert seen and seen == {no: loc.short for no, loc in sources.items()}
    st = [no for no, ln in enumerate(annotated, 1) if "st.global.u32" in ln]
    assert str(sources[st[-1]]) == _here("MARK-second-store")
