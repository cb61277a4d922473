"""The sm_90a Q4_K GEMM (kernels/gemm/wgmma_q4k.py) against float64.

Same oracle and bound as tests/kernels/test_gemm.py (whose helpers this file
uses): float64 weights from ``quants.dequantize`` (checked bit for bit
against gguf's decoder) times float64 X.  The kernel rounds as the mma.sync
one does: X is f16 on input, ``d sc``, ``dmin m`` and each weight are
rounded to f16 once (``3.01 u |x| A`` a product, ``u = 2^-11``, ``A = |d sc
q| + |dmin m|``), and the f32 wgmma chain adds ``(K/16 + 1) 2^-21`` of
``sum |x| A`` (the emulator's model of a 16-wide step, docs/emulator.md);
the residual add ``2^-24 |y|``.  The emulator starts every block's shared
memory as 0xFF bytes (f16 NaN), so a chunk the kernel fails to copy, or a
K order that reads the wrong one, shows as a non-finite or wrong Y.
"""

import numpy as np
import pytest

from ptxgen.kernels import gemm as G
from test_gemm import _check, _weights, bound


def _plan(k, **fields):
    fields.setdefault("x_type", "f16")
    fields.setdefault("target", "sm_90a")
    return G.GemmPlan.make("Q4_K", k, kernel="wgmma", **fields)


def _run(backend, plan, w, x, y, m, t_arg, t_max, r=None):
    backend.require_sm(90)
    fn = backend.load(G.build(plan))[plan.kernel_name]
    xa = backend.array(x)
    args = dict(w=backend.array(w), x=xa, y=y, m=m,
                xmap=backend.tensor_map(G.x_map(plan, int(xa.ptr), x.shape[0])),
                **{"t_ptr" if plan.t_device else "t": t_arg})
    if r is not None:
        args["r"] = r
    ws, tiles = G.split_scratch(plan, m, t_max)
    if tiles:
        args["ws"] = backend.poisoned((ws,), np.float32)
        args["counters"] = counters = backend.array(np.zeros(tiles, np.uint32))
    backend.launch(fn, G.launch_geometry(plan, m, t_max), args)
    if tiles:
        # the last CTA of every tile leaves its counter zero for the next launch
        assert not counters.to_numpy().any(), counters.to_numpy()


# (T, M, K, config and spec fields): M and T both cut tiles short (M not a
# multiple of bm, T not of bn); K of 1, 2 and 4 super-blocks; rings of 3 to
# 5 stages (K = 256 with 5 stages: the prefetch runs past K from the start);
# one to four warpgroups; the residual, out of place and in place
CASES = [
    (20, 80, 512, dict(bm=64, bn=16, stages=3)),
    (37, 72, 1024, dict(bm=64, bn=32, stages=4, epilogue="residual")),
    (9, 136, 256, dict(bm=128, bn=8, stages=5)),
    (16, 200, 512, dict(bm=256, bn=16, stages=4, epilogue="residual")),
    (13, 96, 512, dict(bm=64, bn=16, stages=3, epilogue="bias")),
    # K split 4 and 2 ways (M and T cut short, in-place residual and bias)
    (11, 136, 2048, dict(bm=64, bn=8, stages=6, split_k=4, epilogue="residual")),
    (20, 72, 1024, dict(bm=64, bn=16, stages=4, split_k=2, epilogue="bias")),
    (9, 64, 512, dict(bm=128, bn=8, stages=3, split_k=2)),
]


@pytest.mark.parametrize("t,m,k,fields", CASES)
def test_wgmma_gemm_numerics(backend, rng, t, m, k, fields):
    plan = _plan(k, **fields)
    w, a_abs = _weights(rng, m, k)
    x = rng.standard_normal((t, k)).astype(np.float16)
    shape = {"residual": (t, m), "bias": (m,)}.get(plan.epilogue)
    r = None if shape is None else rng.standard_normal(shape).astype(np.float32)
    y = backend.poisoned((t, m), np.float32)
    _run(backend, plan, w, x, y, m, t, t, None if r is None else backend.array(r))
    ref = G.reference("Q4_K", w, x, r)
    err = _check(y.to_numpy(), ref, bound(x, a_abs, ref, r), plan.kernel_name)
    print(f"{plan.kernel_name}: max |err| / max |Y| = {err:.2e}")


def test_wgmma_gemm_residual_in_place(backend, rng):
    """``y`` and ``r`` the same array: ``Y += X W^T``."""
    t, m, k = 11, 64, 512
    plan = _plan(k, epilogue="residual", bm=64, bn=16, stages=3)
    w, a_abs = _weights(rng, m, k)
    x = rng.standard_normal((t, k)).astype(np.float16)
    r = rng.standard_normal((t, m)).astype(np.float32)
    yr = backend.array(r)
    _run(backend, plan, w, x, yr, m, t, t, yr)
    ref = G.reference("Q4_K", w, x, r)
    _check(yr.to_numpy(), ref, bound(x, a_abs, ref, r), "in place")


def test_wgmma_gemm_t_from_device(backend, rng):
    """A launch sized for 40 tokens with T = 21 in device memory: the rows
    past T keep their poison (the CTA at tokens 32.. exits at once), the
    others are right."""
    t_max, t, m, k = 40, 21, 64, 256
    plan = _plan(k, t_device=True, bm=64, bn=16, stages=3)
    w, a_abs = _weights(rng, m, k)
    x = rng.standard_normal((t_max, k)).astype(np.float16)
    y = backend.poisoned((t_max, m), np.float32)
    _run(backend, plan, w, x, y, m, backend.array(np.array([t], np.uint32)), t_max)
    got = y.to_numpy()
    assert np.all(np.isnan(got[t:])), "rows past the device T were written"
    ref = G.reference("Q4_K", w, x[:t])
    _check(got[:t], ref, bound(x[:t], a_abs, ref, None), "t_device")


def test_wgmma_selected_on_sm_90a_for_f16_prompts():
    """The tuning table's choice, where the H100 measured it faster: wgmma
    for f16 X at T >= 128 on sm_90a, its tile by rows and tokens; mma.sync
    otherwise (f32 X, few tokens, unknown T, other targets)."""
    def pick(m=4096, **kw):
        return G.default_plan("Q4_K", 4096, m=m, **kw).config.kernel

    def tile(m, t):
        c = G.default_plan("Q4_K", 4096, m=m, x_type="f16", target="sm_90a", t=t).config
        return c.bm, c.bn, c.stages
    assert pick(x_type="f16", target="sm_90a", t=512) == "wgmma"
    assert pick(x_type="f16", target="sm_90a", t=128) == "wgmma"
    assert pick(m=14336, x_type="f16", target="sm_90a", t=512) == "wgmma"
    assert pick(x_type="f16", target="sm_90a", t=2048) == "wgmma"
    assert (tile(4096, 128), tile(4096, 256), tile(4096, 512), tile(4096, 2048)) == (
        (64, 128, 6), (64, 128, 6), (64, 256, 4), (128, 256, 5))
    assert (tile(6144, 128), tile(6144, 256), tile(6144, 512)) == (
        (64, 128, 6), (64, 256, 4), (128, 256, 5))
    assert (tile(14336, 128), tile(14336, 256), tile(14336, 512)) == (
        (128, 128, 5), (128, 256, 5), (128, 256, 5))
    # the batched engine's decode steps: 1 to 64 tokens on the warpgroup kernel, one token
    # tile covering T (the H100 sweep with cold weights)
    assert [tile(4096, t) for t in (2, 8, 9, 16, 17, 32, 33, 64)] == [
        (64, 8, 6), (64, 8, 6), (64, 16, 6), (64, 16, 6), (64, 32, 6), (64, 32, 6),
        (64, 64, 6), (64, 64, 6)]
    assert pick(x_type="f16", target="sm_90a", t=64) == "wgmma"
    assert pick(x_type="f16", target="sm_90a", t=8) == "wgmma"
    assert pick(x_type="f32", target="sm_90a", t=8) == "mma"
    assert pick(x_type="f16", target="sm_90", t=64) == "mma"
    # Q6_K and Q8_0 on the warpgroup kernel too, where K is whole super-blocks
    for q in ("Q6_K", "Q8_0"):
        assert G.default_plan(q, 4096, m=14336, x_type="f16", target="sm_90a",
                              t=512).config.kernel == "wgmma"
    assert G.default_plan("Q8_0", 4160, m=4096, x_type="f16", target="sm_90a",
                          t=512).config.kernel == "mma"
    assert pick(x_type="f32", target="sm_90a", t=512) == "mma"
    assert pick(x_type="f16", target="sm_90", t=512) == "mma"
    assert pick(x_type="f16", target="sm_90a", t=None) == "mma"


def test_ops_gemm_plan_targets_sm_90a_on_an_h100_class_device():
    """``ops.gemm_plan`` builds the GEMM family for sm_90a where the backend
    is an sm_90 device (the emulator stands for an H100), so prompts of 128
    tokens or more (and the engine's steps of up to 64) reach the wgmma kernel."""
    from ptxgen.driver import ops
    p = ops.gemm_plan("Q4_K", 4096, 4096, 512, x_type="f16", backend="emu")
    assert p.target == "sm_90a" and p.kernel == "wgmma"
    assert ops.gemm_plan("Q4_K", 4096, 4096, 8, x_type="f16", backend="emu").kernel == "wgmma"
    assert ops.gemm_plan("Q4_K", 4096, 4096, 8, x_type="f32", backend="emu").kernel == "mma"


def test_ops_gemm_wgmma_numpy(rng):
    """``ops.gemm`` on the emulator with numpy arrays and the wgmma kernel
    asked for by knobs."""
    from ptxgen.driver import ops
    t, m, k = 12, 64, 256
    w, a_abs = _weights(rng, m, k)
    x = rng.standard_normal((t, k)).astype(np.float16)
    got = ops.gemm(w, x, "Q4_K", backend="emu", kernel="wgmma", bm=64, bn=16, bk=64, stages=3)
    ref = G.reference("Q4_K", w, x)
    _check(got, ref, bound(x, a_abs, ref, None), "ops.gemm wgmma")


@pytest.mark.parametrize("fields,msg", [
    (dict(target="sm_90"), "needs target sm_90a"),
    (dict(x_type="f32"), "takes f16 X"),
    (dict(bm=32), "must be 64, 128 or 256"),
    (dict(bk=128), "must be 64"),
    (dict(stages=2), "at least 3"),
    (dict(bm=256, bn=256, stages=6), "shared memory"),
    (dict(split_k=3), "does not divide"),
])
def test_wgmma_plan_refusals(fields, msg):
    with pytest.raises(ValueError, match=msg):
        _plan(512, **fields)


def test_split_k_refusals():
    with pytest.raises(ValueError, match="only kernel='wgmma' splits K"):
        G.GemmPlan.make("Q4_K", 512, x_type="f16", split_k=2)
    with pytest.raises(ValueError, match="16-byte aligned"):
        G.GemmPlan.make("Q6_K", 512, x_type="f16", target="sm_90a", kernel="wgmma", split_k=2)


SHAPES_8B = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)]


@pytest.mark.parametrize("t", [128, 512])
@pytest.mark.parametrize("m,k", [s for s in SHAPES_8B if s[0] <= 4096])
def test_wgmma_8b_shapes_assemble(ptxas, m, k, t):
    """The tuned wgmma kernels of the 8B shapes the table gives them (at
    most 4096 rows, 128 to 512 tokens) assemble for sm_90a with no spills
    and no local memory, in the shared memory they ask for."""
    from ptxgen.ptxas import assemble
    plan = G.default_plan("Q4_K", k, x_type="f16", target="sm_90a", m=m, t=t)
    assert plan.kernel == "wgmma"
    _, reports = assemble(G.build(plan).to_ptx(), "sm_90a")
    (rep,) = reports
    assert rep.spill_stores == 0 and rep.spill_loads == 0 and rep.local_bytes == 0, rep
    assert plan.dynamic_shared <= G.MAX_SHARED
