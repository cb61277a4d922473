"""Programmatic dependent launch: the griddepcontrol instructions, the
``pdl`` spec field, launch checks (emulator and driver), and on the GPU a
chain of dependent PDL launches (eager and captured) checked against numpy."""

import attrs
import numpy as np
import pytest

import ptxgen
from ptxgen import registry
from ptxgen.errors import TargetError
from ptxgen.kernels import flash_decode, gemv, rmsnorm, swiglu

from backends import cuda_available, line_of
from decode_check import check_logits


def test_griddepcontrol_needs_sm90_and_names_the_line():
    m = ptxgen.Module("sm_80")
    with m.kernel("k") as k:
        with pytest.raises(TargetError, match=r"griddepcontrol.*needs sm_90.*target sm_80") as ei:
            k.griddep_wait()  # MARK-gdc
    assert ei.value.loc.lineno == line_of(__file__, "MARK-gdc")
    m9 = ptxgen.Module("sm_90")
    with m9.kernel("k") as k:
        k.griddep_launch_dependents()
        k.griddep_wait()
    text = m9.to_ptx()
    assert "griddepcontrol.launch_dependents;" in text and "griddepcontrol.wait;" in text


def test_pdl_spec_field_needs_sm90():
    with pytest.raises(ValueError, match="pdl=True needs griddepcontrol.*sm_80"):
        rmsnorm.RmsNormSpec(pdl=True)
    with pytest.raises(ValueError, match="pdl must be a bool"):
        rmsnorm.RmsNormSpec(pdl=1, target="sm_90")
    s = rmsnorm.RmsNormSpec(pdl=True, target="sm_90")
    text = rmsnorm.build(s).to_ptx()
    # this grid waits before its first global read, and only then lets the
    # next grid launch (at most two grids resident: spec_fields.pdl_field)
    body = text[text.index("{"):]
    assert body.count("griddepcontrol.wait") == 1
    assert body.count("griddepcontrol.launch_dependents") == 1
    assert body.index("griddepcontrol.wait") < body.index("griddepcontrol.launch_dependents")
    assert body.index("griddepcontrol.wait") < body.index("ld.global")
    assert "griddepcontrol" not in rmsnorm.build(attrs.evolve(s, pdl=False)).to_ptx()


def test_gemv_q4k_ring_issues_weight_copies_before_the_wait_and_x_after():
    # the tuned ring: its first row groups' weight copies go out before the
    # wait (weights are read-only), x only after it
    s = gemv.default_plan("Q4_K", 4096, target="sm_90", m=4096, pdl=True)
    assert s.stages >= 2
    lines = gemv.build(s).to_ptx().splitlines()
    wait = next(i for i, l in enumerate(lines) if "griddepcontrol.wait" in l)
    assert any("cp.async" in l for l in lines[:wait])
    assert not any("ld.global" in l and ".f32" in l for l in lines[:wait])
    assert any("ld.global" in l and ".f32" in l for l in lines[wait:])
    assert not any("st.global" in l for l in lines[:wait])


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_gemv_ring_issues_ahead_groups_before_the_wait(ahead):
    """The ring's prologue: ``ahead`` of its S - 1 row groups (all with 0) are
    copied before griddepcontrol.wait, the rest after the x loads."""
    s = gemv.default_plan("Q4_K", 4096, "residual", target="sm_90", m=4096, pdl=True,
                          stages=4, rows=8, ahead=ahead)
    lines = [ln.strip() for ln in gemv.build(s).to_ptx().splitlines()]
    wait = lines.index("griddepcontrol.wait;")
    loop = next(i for i, ln in enumerate(lines) if ln.startswith("$L_loop"))
    commits = [i for i, ln in enumerate(lines[:loop]) if ln.startswith("cp.async.commit_group")]
    assert len(commits) == 3
    assert sum(i < wait for i in commits) == (ahead or 3)
    x_loads = [i for i, ln in enumerate(lines) if ln.startswith("ld.global.nc.v4.f32")]
    assert x_loads and all(i > wait for i in x_loads)
    if ahead:
        # the later groups go out after the thread's x values arrived
        assert all(c > min(x_loads) for c in commits[ahead:])


@pytest.mark.parametrize("family,spec", [
    (flash_decode, flash_decode.FlashDecodeSpec(target="sm_90", pdl=True)),
    (swiglu, swiglu.SwiGluSpec(target="sm_90", pdl=True)),
])
def test_every_kernel_of_a_pdl_spec_waits(family, spec):
    text = family.build(spec).to_ptx()
    entries = text.split(".entry")[1:]
    assert entries and all("griddepcontrol.wait" in e for e in entries)


def test_emulator_checks_pdl_launches(rng):
    from ptxgen import emu
    n = int(rng.integers(100, 3000))
    g, u = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    plain = swiglu.SwiGluSpec(target="sm_90")
    for spec, ok in ((plain, False), (attrs.evolve(plain, pdl=True), True)):
        fn = emu.Module.from_ptx(swiglu.build(spec))[spec.kernel_name]
        geo = swiglu.launch_geometry(spec, n)
        grid, block = geo.grid, geo.block
        dg, du = emu.DeviceArray.from_numpy(g), emu.DeviceArray.from_numpy(u)
        out = emu.DeviceArray.from_numpy(np.full(n, np.nan, np.float32))
        if not ok:
            with pytest.raises(Exception, match="never executes griddepcontrol.wait"):
                emu.launch(fn, grid, block, dg, du, out, n, pdl=True)
            continue
        emu.launch(fn, grid, block, dg, du, out, n, pdl=True)
        ref = swiglu.reference(g, u)
        got = out.to_numpy()
        assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) <= 1e-5


def test_enable_pdl_rewrites_launches_and_the_emulator_runs_them(tmp_path, rng, seed):
    pytest.importorskip("gguf")
    from ptxgen.llm.gguf.synth import write_synthetic_llama
    from ptxgen.llm import Model
    path = str(tmp_path / "tiny.gguf")
    write_synthetic_llama(path, n_layers=1, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                          vocab=512, context_length=64, seed=seed)
    m = Model.from_gguf(path, backend="emu", capacity=4, progress=False,
                             target="sm_90", pdl=True)
    launches = [L for op in m.graph.ops for L in op.launches]
    assert launches and all(L.spec.pdl for L in launches)
    prompt = [int(t) for t in rng.integers(0, 512, 2)]
    res, logits = m.generate(prompt, 1, return_logits=True)
    # the cached K/V rows within an f16 ulp of the reference's, the logits
    # against the reference fed those rows (an f16 rounding that goes the
    # other way at a midpoint is not an error: decode_check.check_logits)
    check_logits(m, path, prompt, res, logits)


gpu = pytest.mark.skipif(not cuda_available(), reason="no NVIDIA GPU / driver available")


@pytest.mark.gpu
@gpu
def test_gpu_pdl_chain_eager_and_captured(rng):
    """64 dependent SwiGLU launches, each reading the previous one's output,
    with PDL: eager and graph replay give the same bits as the same chain
    launched without PDL (any launch reading early would change them), and
    the result is within 64 x 1e-5 relative of the float64 chain."""
    from ptxgen.driver import DeviceArray, Module, Stream, capture, get_device, launch
    from ptxgen.driver.errors import LaunchConfigError
    dev = get_device()
    if dev.compute_capability < (9, 0):
        pytest.skip("PDL needs sm_90")
    spec = swiglu.SwiGluSpec(target=dev.target, pdl=True)
    fn = Module.from_ptx(swiglu.build(spec)).function(spec.kernel_name)
    plain = attrs.evolve(spec, pdl=False)
    fplain = Module.from_ptx(swiglu.build(plain)).function(plain.kernel_name)
    n = int(rng.integers(200_000, 400_000))
    # silu(g) ~ g for g >= 20, so the chain stays in [20, 40] over 64 steps
    u = (1.0 + 0.01 * rng.random(n)).astype(np.float32)
    g0 = (20.0 + rng.random(n)).astype(np.float32)
    geo = swiglu.launch_geometry(spec, n)
    grid, block = geo.grid, geo.block
    steps = 64
    bufs = [DeviceArray.from_numpy(g0)] + [
        DeviceArray.from_numpy(np.full(n, np.nan, np.float32)) for _ in range(steps)]
    du = DeviceArray.from_numpy(u)

    def chain(f, s, pdl):
        for i in range(steps):
            launch(f, grid, block, bufs[i], du, bufs[i + 1], n, stream=s, pdl=pdl)

    def poison():
        for b in bufs[1:]:
            b.copy_from(np.full(n, np.nan, np.float32))

    with pytest.raises(LaunchConfigError, match="never executes griddepcontrol.wait"):
        launch(fplain, grid, block, bufs[0], du, bufs[1], n, pdl=True)
    s = Stream()
    chain(fplain, s, False)
    s.synchronize()
    serial = bufs[-1].to_numpy()
    ref = g0.astype(np.float64)
    for _ in range(steps):
        ref = swiglu.reference(ref, u)
    assert np.max(np.abs(serial - ref) / np.abs(ref)) <= 1e-5 * steps
    poison()
    chain(fn, s, True)
    s.synchronize()
    assert bufs[-1].to_numpy().tobytes() == serial.tobytes()
    poison()
    with capture(s) as cg:
        chain(fn, s, True)
    ge = cg.instantiate()
    for _ in range(3):
        ge.launch(s)
    s.synchronize()
    assert bufs[-1].to_numpy().tobytes() == serial.tobytes()


PDL_SPECS = {n: fs for n, fs in registry.canonical_specs().items() if hasattr(fs[1], "pdl")}


@pytest.mark.parametrize("name", sorted(PDL_SPECS))
def test_every_pdl_kernel_releases_the_next_grid_only_after_its_wait(name):
    """At most two grids may be resident at once (spec_fields.pdl_field): a
    kernel built with pdl executes griddepcontrol.wait exactly once and
    launch_dependents right after it, never before; without pdl neither."""
    fam, spec = PDL_SPECS[name]
    # sm_90, or sm_90a for a spec that needs it (the wgmma GEMM)
    spec = attrs.evolve(spec, target="sm_90a" if spec.target == "sm_90a" else "sm_90", pdl=True)
    text = fam.build(spec).to_ptx()
    for body in text.split(".entry")[1:]:
        ops = [ln.strip().rstrip(";") for ln in body.splitlines() if "griddepcontrol" in ln]
        assert ops == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"], (name, ops)
        lines = [ln.strip() for ln in body.splitlines()]
        w = lines.index("griddepcontrol.wait;")
        assert lines[w + 1] == "griddepcontrol.launch_dependents;", (name, lines[w:w + 2])
    assert "griddepcontrol" not in fam.build(attrs.evolve(spec, pdl=False)).to_ptx()
