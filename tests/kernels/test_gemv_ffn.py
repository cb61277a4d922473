"""The persistent FFN kernel (gate/up + SwiGLU, then down + residual, one launch)
against float64."""

import attrs
import numpy as np
import pytest

from ptxgen.kernels import gemv_ffn as F
from ptxgen.kernels import quants
from ptxgen.ptxas import assemble
from test_gemv import BOUND, rel_err   # the GEMV tests' bound (1e-5) and error measure

def _data(rng, hidden, ffn):
    q = quants.quantize
    wg = q(rng.standard_normal((ffn, hidden)).astype(np.float32), "Q4_K")
    wu = q(rng.standard_normal((ffn, hidden)).astype(np.float32), "Q4_K")
    wd = q(rng.standard_normal((hidden, ffn)).astype(np.float32), "Q4_K")
    x = rng.standard_normal(hidden).astype(np.float32)
    r = rng.standard_normal(hidden).astype(np.float32)
    return wg, wu, wd, x, r


def _launch(run, spec, ws, x, r, counters, ctas):
    """One launch on fresh poisoned h and y; returns (y, h)."""
    fn = run.function(F.build, spec)
    grid, block, shared = F.launch_geometry(spec, ctas)
    h = run.poisoned(spec.ffn)
    y = run.poisoned(spec.hidden)
    run.launch(fn, grid, block, *ws, run.array(x), run.array(r), h, y, counters, shared=shared)
    return run.get(y), run.get(h)


SPECS = [
    # 4 slices of 32 threads (hidden 256: 8 pieces), 2 stages
    F.FfnSpec(hidden=256, ffn=512, rows_up=1, rows_down=2, stages=2, threads=128),
    F.CANONICAL["gemv_ffn_q4_k"],
    # ffn pieces (40) not a multiple of 32: a partly idle warp in phase 2
    F.FfnSpec(hidden=512, ffn=1280, rows_up=2, rows_down=4, stages=4, threads=64, lookahead=3),
    # two pieces of a down row per thread (48 pieces, 32 threads), 2 CTAs/SM hint
    F.FfnSpec(hidden=256, ffn=1536, rows_up=2, rows_down=2, stages=3, threads=32,
              ctas_per_sm=2),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kernel_name)
def test_ffn_numerics_and_counters(run, spec, rng):
    """Two launches with fresh inputs on 3 CTAs (so CTAs grab items and meet
    at the grid barrier): both within the bound, counters back to zero."""
    counters = run.array(np.zeros(3, np.uint32))
    for _ in range(2):
        wg, wu, wd, x, r = _data(rng, spec.hidden, spec.ffn)
        ws = [run.array(w) for w in (wg, wu, wd)]
        y, h = _launch(run, spec, ws, x, r, counters, 3)
        ref_y, ref_h = F.reference(wg, wu, wd, x, r)
        assert rel_err(h, ref_h) <= BOUND
        assert rel_err(y, ref_y) <= BOUND
        assert np.array_equal(run.get(counters), np.zeros(3, np.uint32))


def test_ffn_more_ctas_than_items(run, rng):
    """CTAs whose static first items are already past the end only arrive
    and leave."""
    spec = F.FfnSpec(hidden=256, ffn=256, rows_up=2, rows_down=8, stages=3, threads=64)
    wg, wu, wd, x, r = _data(rng, spec.hidden, spec.ffn)
    counters = run.array(np.zeros(3, np.uint32))
    y, h = _launch(run, spec, [run.array(w) for w in (wg, wu, wd)], x, r, counters,
                   spec.n1 + spec.n2 + 2)
    ref_y, ref_h = F.reference(wg, wu, wd, x, r)
    assert rel_err(y, ref_y) <= BOUND and rel_err(h, ref_h) <= BOUND
    assert not run.get(counters).any()


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,ffn,knobs", [
    (4096, 14336, {}), (4096, 11008, {}),
    (4096, 14336, dict(threads=256, ctas_per_sm=2, rows_down=2))])
def test_ffn_gpu_model_shapes(gpu_run, hidden, ffn, knobs, rng):
    """Llama-3-8B and Llama-2-7B FFN shapes on one CTA per SM (and two of 256
    threads, two pieces of a down row each), launched twice
    back to back (with programmatic dependent launch where the device has
    it, so the second grid starts while the first drains): both give the
    same bits (rows are grabbed dynamically, but each is computed whole by
    one CTA) within the bound."""
    from ptxgen.driver import get_device
    from ptxgen.kernels.spec_fields import has_griddepcontrol
    tgt = gpu_run.target()
    spec = F.FfnSpec(hidden=hidden, ffn=ffn, target=tgt, pdl=has_griddepcontrol(tgt), **knobs)
    wg, wu, wd, x, r = _data(rng, hidden, ffn)
    ws = [gpu_run.array(w) for w in (wg, wu, wd)]
    xd, rd = gpu_run.array(x), gpu_run.array(r)
    counters = gpu_run.array(np.zeros(3, np.uint32))
    fn = gpu_run.function(F.build, spec)
    grid, block, shared = F.launch_geometry(spec, get_device().sm_count)
    fn.require_dynamic_shared(shared)
    outs = []
    for _ in range(2):
        h, y = gpu_run.poisoned(ffn), gpu_run.poisoned(hidden)
        gpu_run.api.launch(fn, grid, block, *ws, xd, rd, h, y, counters, shared=shared,
                           pdl=spec.pdl)
        outs.append((y, h))
    (y1, h1), (y2, h2) = [(gpu_run.get(y), gpu_run.get(h)) for y, h in outs]
    ref_y, ref_h = F.reference(wg, wu, wd, x, r)
    assert rel_err(h1, ref_h) <= BOUND and rel_err(y1, ref_y) <= BOUND
    assert y1.tobytes() == y2.tobytes() and h1.tobytes() == h2.tobytes()
    assert not gpu_run.get(counters).any()


@pytest.mark.parametrize("bad,match", [
    (dict(hidden=300), "multiple of 256"),
    (dict(ffn=0), "multiple of 256"),
    (dict(threads=96), "multiple of the 128 threads"),       # hidden 4096: 128-thread slices
    (dict(ffn=14336, threads=128), "at most two per thread"),
    (dict(ctas_per_sm=5), "ctas_per_sm"),
    (dict(stages=1), "stages must be"),
    (dict(rows_up=3), "power of two"),
    (dict(rows_up=16, stages=8), "shared memory"),
])
def test_bad_spec_refused(bad, match):
    kw = dict(hidden=4096, ffn=4096) | bad
    with pytest.raises(ValueError, match=match):
        F.FfnSpec(**kw)


def test_launch_geometry_refuses_bad_counts():
    spec = F.CANONICAL["gemv_ffn_q4_k"]
    assert F.launch_geometry(spec, 132) == ((132, 1, 1), (256, 1, 1), spec.shared_bytes)
    assert F.launch_geometry(spec, 132, 2)[0] == (264, 1, 1)
    for bad in ((0, 1), (132, 0), (1.5, 1)):
        with pytest.raises(ValueError):
            F.launch_geometry(spec, *bad)


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("spec", [F.CANONICAL["gemv_ffn_q4_k"],
                                  F.FfnSpec(hidden=4096, ffn=14336)],
                         ids=lambda s: s.kernel_name)
def test_ptxas_no_spills(ptxas, target, spec):
    spec = attrs.evolve(spec, target=target, pdl=target == "sm_90")
    _, reports = assemble(F.build(spec).to_ptx(), target)
    assert len(reports) == 1 and reports[0].spill_stores == 0, reports
