"""Per-CTA timeline instrumentation (ptxgen.driver.timeline): the rewritten
PTX assembles, records land once per CTA on the GPU."""


import numpy as np
import pytest

import ptxgen
from ptxgen.driver import timeline
from ptxgen.kernels import flash_decode as fd
from ptxgen.kernels import gemv
from ptxgen.ptxas import assemble
from ptxgen.types import f32, u32


def _guarded_exit_module(target="sm_90"):
    """Every thread writes the low word of ``%globaltimer`` and ``%smid``;
    blocks with an odd index then leave through a guarded ``exit``, the others
    also write 1.0."""
    m = ptxgen.Module(target)
    with m.kernel("k") as k:
        out = k.param_ptr("out", u32)
        n = k.param("n", u32)
        t0 = k.globaltimer()
        sm = k.smid
        b = k.ctaid.x
        i = k.global_id()
        with k.if_(i < n):
            k.st(out[i * 4], t0.to(u32))
            k.st(out[i * 4 + 1], sm)
        k.exit(guard=(b & 1).eq(1))
        x = k.mov(1.0, f32)
        with k.if_(i < n):
            k.st(out[i * 4 + 2], x.bitcast(u32))
    return m


def test_instrumented_ptx_assembles(ptxas):
    mods = [gemv.build(gemv.default_plan("Q4_K", 4096, epilogue="swiglu", target="sm_90",
                                         m=14336, pdl=True)),
            gemv.build(gemv.default_plan("Q4_K", 4096, target="sm_90", m=128256, pdl=True)),
            fd.build(fd.FlashDecodeSpec(target="sm_90", pdl=True)),
            _guarded_exit_module()]
    for mod in mods:
        text = timeline.instrument(mod.to_ptx(), launches=4, max_ctas=1024)
        n_kernels = text.count(".entry")
        assert f".global .align 16 .b8 ptxgen_timeline[{n_kernels * 4 * 1024 * 32}];" in text
        # a launch number per kernel entry, a record before every ret/exit
        exits = sum(1 for line in text.splitlines() if line.strip().endswith(("ret;", "exit;")))
        assert text.count("atom.global.add.u32") == n_kernels
        assert text.count("st.global.v2.u32 \t[%tla0+24]") == exits
        cubin, reports = assemble(text, "sm_90")
        assert cubin[:4] == b"\x7fELF"
        assert all(r.local_bytes == 0 for r in reports)


def test_guarded_exit_keeps_its_guard():
    text = timeline.instrument(_guarded_exit_module().to_ptx())
    lines = [ln.strip() for ln in text.splitlines()]
    i = next(j for j, ln in enumerate(lines) if ln.startswith("@") and ln.endswith("exit;"))
    guard = lines[i].split()[0][1:]
    assert f"and.pred \t%tlp2, %tlp1, {guard};" in lines[i - 8:i]
    assert all(ln.startswith("@%tlp2 st.") for ln in lines[i - 3:i])


def test_builder_special_registers():
    text = _guarded_exit_module().to_ptx()
    assert "%globaltimer;" in text and "%smid;" in text


def test_refusals():
    text = timeline.instrument(_guarded_exit_module().to_ptx())
    with pytest.raises(ValueError, match="already instrumented"):
        timeline.instrument(text)
    with pytest.raises(ValueError, match="no .entry"):
        timeline.instrument(".version 7.8\n.target sm_90\n.address_size 64\n")
    with pytest.raises(ValueError, match="launches"):
        timeline.instrument(_guarded_exit_module().to_ptx(), launches=0)
    with pytest.raises(ValueError, match="exceed 1 GiB"):
        timeline.instrument(_guarded_exit_module().to_ptx(), launches=65536, max_ctas=65536)


@pytest.mark.gpu
def test_records_on_gpu(gpu_device, cache_root):
    from ptxgen.driver import DeviceArray, Module, launch
    from ptxgen.driver.ops_decode import device_target
    with timeline.instrumenting(launches=2, max_ctas=32) as loaded:
        mod = Module.from_ptx(_guarded_exit_module(device_target()))
    assert loaded == [mod] and "ptxgen_timeline" in mod.ptx
    n_blocks, block = 40, 64
    n = n_blocks * block
    out = DeviceArray.from_numpy(np.full(n * 4, 0xFFFFFFFF, np.uint32))
    sms = []
    for _ in range(3):
        launch(mod["k"], n_blocks, block, out, n)
        sms.append(out.to_numpy().reshape(n_blocks, block, 4)[:, 0, 1].astype(np.int64))
    rec = timeline.read(mod)
    # 2 launches of CTAs 0..31 recorded (launches=2, max_ctas=32)
    assert len(rec) == 64
    assert rec["launch"].tolist() == [0] * 32 + [1] * 32
    assert rec["cta"].tolist() == list(range(32)) * 2
    assert np.all(rec["kernel"] == 0)
    assert np.all(rec["start"] > 0)
    assert np.all(rec["start"] <= rec["wait"]) and np.all(rec["wait"] <= rec["end"])
    # the kernel's own %smid reads agree with the records (a CTA stays on its SM)
    for j in range(2):
        assert np.array_equal(rec["sm"][rec["launch"] == j], sms[j][:32])
    # launches are ordered in time, and a launch takes well under a second
    assert rec["start"][32:].min() >= rec["end"][:32].max()
    assert np.all(rec["end"] - rec["start"] < 10**9)
    got = out.to_numpy().reshape(n_blocks, block, 4)
    assert np.all(got[0::2, :, 2] == np.float32(1.0).view(np.uint32))
    assert np.all(got[1::2, :, 2] == 0xFFFFFFFF)          # odd blocks left early
    timeline.reset(mod)
    launch(mod["k"], n_blocks, block, out, n)
    rec = timeline.read(mod)
    assert rec["launch"].tolist() == [0] * 32 and rec["cta"].tolist() == list(range(32))
