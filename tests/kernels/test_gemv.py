"""Quantized GEMV (Q4_K, Q6_K, Q8_0; plain, residual, swiglu, geglu) against float64 (the other weight
types: test_gemv_qtypes.py).

The oracle is ``gemv.reference``: float64 weights from ``quants.dequantize``
times x.  ``_data`` checks, for the very weights of each test, that
``quants.dequantize`` equals gguf's decoder (``gguf.quants.dequantize``)
bit for bit, so the oracle's weights are gguf's (tests/test_quants.py
checks the two decoders on random bytes as well).  The fused-RoPE
epilogue's frequencies come from tests/kernels/formulas.py, not from the
table the kernel reads.
"""

import attrs
import numpy as np
import pytest

from ptxgen.kernels import gemv as G
from ptxgen.kernels import quants
from ptxgen.kernels.plan import LaunchGeometry
from ptxgen.ptxas import assemble

BOUND = 1e-5


def rel_err(out, ref) -> float:
    """``max|out - ref| / max|ref|`` (inf when ``out`` has a non-finite value)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _data(rng, qtype, m, k, n_mats):
    ws = [quants.quantize(rng.standard_normal((m, k)).astype(np.float32), qtype)
          for _ in range(n_mats)]
    gguf = pytest.importorskip("gguf")
    for w in ws:          # the oracle's decoder is gguf's, bit for bit
        ours = quants.dequantize(w, qtype, (m, k))
        theirs = gguf.quants.dequantize(w, gguf.GGMLQuantizationType[qtype])
        assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))
    x = rng.standard_normal(k).astype(np.float32)
    r = rng.standard_normal(m).astype(np.float32)
    return ws, x, r


def _norm_data(rng, k):
    """RMSNorm weights around 1 and an eps, as Llama checkpoints have."""
    return (1.0 + 0.2 * rng.standard_normal(k)).astype(np.float32), float(rng.uniform(1e-6, 1e-4))


def _ref(spec, ws, x, r, norm):
    return G.reference(spec, ws[0], x, residual=r, w_up=ws[1] if len(ws) > 1 else None,
                       norm_w=norm[0] if norm else None, eps=norm[1] if norm else None)


def _run_gemv(run, spec, ws, x, r, norm=None):
    m = ws[0].shape[0]
    fn = run.function(G.build, spec)
    args = dict(zip(("w", "wu"), map(run.array, ws)), x=run.array(x), y=run.poisoned(m), m=m)
    if spec.norm:
        args.update(nw=run.array(norm[0]), eps=norm[1])
    if spec.epilogue == "residual":
        args["r"] = run.array(r)
    run.launch(fn, G.launch_geometry(spec, m), args)
    return run.get(args["y"])


CASES = [
    ("Q4_K", 512, "none", {}),
    ("Q4_K", 512, "residual", {"rows": 2}),
    ("Q4_K", 256, "swiglu", {"rows": 1}),
    ("Q4_K", 512, "none", {"norm": True}),
    ("Q4_K", 512, "residual", {"norm": True, "rows": 2}),
    ("Q4_K", 256, "swiglu", {"norm": True, "rows": 1}),
    ("Q4_K", 512, "none", {"stages": 2, "rows": 2}),
    ("Q4_K", 512, "residual", {"stages": 3, "rows": 4}),
    ("Q4_K", 256, "swiglu", {"stages": 4, "rows": 1}),
    ("Q4_K", 768, "none", {"stages": 3, "rows": 2, "pieces": 2}),
    ("Q4_K", 1280, "residual", {"stages": 5, "rows": 1}),
    ("Q4_K", 512, "none", {"dot": "dp4a"}),
    ("Q4_K", 512, "residual", {"dot": "dp4a", "rows": 2}),
    ("Q4_K", 256, "swiglu", {"dot": "dp4a", "rows": 1}),
    ("Q4_K", 768, "none", {"dot": "dp4a", "pieces": 2, "rows": 2}),
    ("Q4_K", 512, "residual", {"dot": "dp4a", "stages": 3, "rows": 4}),
    ("Q4_K", 1280, "none", {"dot": "dp4a", "stages": 2, "rows": 1}),
    # fused RMSNorm through the ring and with the dp4a dot
    ("Q4_K", 512, "none", {"norm": True, "stages": 3, "rows": 2}),
    ("Q4_K", 512, "none", {"norm": True, "dot": "dp4a", "stages": 3, "rows": 4}),
    ("Q4_K", 256, "swiglu", {"norm": True, "dot": "dp4a", "stages": 2, "rows": 1}),
    ("Q4_K", 768, "residual", {"norm": True, "dot": "dp4a", "stages": 2, "rows": 2,
                               "pieces": 2}),
    ("Q4_K", 512, "residual", {"norm": True, "dot": "dp4a", "rows": 2}),
    # part of the ring's prologue after the x loads (ahead)
    ("Q4_K", 512, "residual", {"dot": "dp4a", "stages": 4, "rows": 1, "ahead": 1}),
    ("Q4_K", 512, "none", {"norm": True, "dot": "dp4a", "stages": 3, "rows": 2, "ahead": 1}),
    ("Q6_K", 2048, "none", {"stages": 3, "rows": 1, "tile": 2048, "ahead": 1}),
    ("Q6_K", 2048, "none", {"stages": 3, "rows": 2, "tile": 2048}),
    ("Q6_K", 2048, "swiglu", {"stages": 2, "rows": 1, "tile": 2048}),
    ("Q8_0", 512, "residual", {"stages": 4, "rows": 2, "tile": 512}),
    # several pieces a thread through the ring (the last round partly past K)
    ("Q8_0", 768, "residual", {"stages": 3, "rows": 2, "tile": 768, "pieces": 2}),
    ("Q8_0", 512, "swiglu", {"stages": 2, "rows": 1, "tile": 512, "pieces": 2}),
    ("Q6_K", 4096, "none", {"stages": 2, "rows": 2, "tile": 4096, "pieces": 3}),
    # Q6_K's dp4a dot through the ring: several pieces (the last round past K),
    # a residual, two matrices
    ("Q6_K", 2048, "none", {"dot": "dp4a", "stages": 2, "rows": 2, "tile": 2048,
                            "pieces": 3}),
    ("Q6_K", 2048, "residual", {"dot": "dp4a", "stages": 3, "rows": 1, "tile": 2048,
                                "interleave": True}),
    ("Q6_K", 2048, "swiglu", {"dot": "dp4a", "stages": 2, "rows": 2, "tile": 2048}),
    # the ring filled by the bulk copy engine (sm_90): the last group partial
    ("Q4_K", 512, "none", {"dot": "dp4a", "stages": 3, "rows": 2, "bulk": True,
                           "target": "sm_90"}),
    ("Q4_K", 512, "residual", {"dot": "dp4a", "stages": 4, "rows": 1, "ahead": 1,
                               "bulk": True, "target": "sm_90"}),
    ("Q4_K", 256, "swiglu", {"norm": True, "stages": 2, "rows": 4, "bulk": True,
                             "target": "sm_90"}),
    ("Q6_K", 2048, "none", {"stages": 3, "rows": 2, "tile": 2048, "pieces": 2, "bulk": True,
                            "target": "sm_90"}),
    ("Q8_0", 512, "swiglu", {"stages": 2, "rows": 4, "tile": 512, "bulk": True,
                             "target": "sm_90"}),
    # row groups dealt round robin over the CTAs (interleave): 19 groups on 4
    # CTAs, the partial last group on CTA 2
    ("Q4_K", 512, "residual", {"dot": "dp4a", "stages": 3, "rows": 2, "interleave": True}),
    ("Q4_K", 512, "none", {"dot": "dp4a", "stages": 3, "rows": 2, "ahead": 1, "bulk": True,
                           "interleave": True, "target": "sm_90"}),
    ("Q6_K", 2048, "swiglu", {"stages": 2, "rows": 2, "tile": 2048, "interleave": True}),
    ("Q6_K", 512, "none", {}),
    ("Q6_K", 512, "swiglu", {"rows": 2}),
    ("Q6_K", 768, "residual", {"tile": 512}),
    ("Q8_0", 512, "none", {}),
    ("Q8_0", 96, "residual", {}),
    ("Q8_0", 256, "swiglu", {"tile": 128}),
    # GeGLU (GELU's tanh form) in each kernel body: Q4_K direct and through the
    # ring with the fused norm and dp4a, the staged and ring bodies of the others
    ("Q4_K", 256, "geglu", {"rows": 1}),
    ("Q4_K", 512, "geglu", {"norm": True, "stages": 2, "dot": "dp4a", "rows": 2}),
    ("Q6_K", 512, "geglu", {"rows": 2}),
    ("Q8_0", 512, "geglu", {"stages": 2, "rows": 1, "tile": 512, "pieces": 2}),
]


@pytest.mark.parametrize("qtype,k,epi,knobs", CASES)
def test_gemv_numerics(run, qtype, k, epi, knobs, rng):
    """M = 37 (not a multiple of rows) and max_ctas=4 so CTAs walk several row groups."""
    m = 37
    spec = G.GemvPlan.make(qtype, k, epilogue=epi, max_ctas=4, **knobs)
    ws, x, r = _data(rng, qtype, m, k, spec.n_mats)
    norm = _norm_data(rng, k) if spec.norm else None
    y = _run_gemv(run, spec, ws, x, r, norm)
    assert rel_err(y, _ref(spec, ws, x, r, norm)) <= BOUND


@pytest.mark.parametrize("qtype,k,knobs", [
    ("Q4_K", 1024, {}), ("Q4_K", 1024, {"stages": 2, "rows": 2}),
    ("Q6_K", 2048, {"stages": 2, "rows": 2, "tile": 2048})])
def test_gemv_dp4a_outlier_activations(run, qtype, k, knobs, rng):
    """dot="dp4a" keeps x to 2^-22 of each piece's largest value: activations
    with a few entries 100x the rest (as LLM hidden states have) still meet
    the f32 bound, M = 37."""
    m = 37
    spec = G.GemvPlan.make(qtype, k, max_ctas=4, dot="dp4a", **knobs)
    ws, x, r = _data(rng, qtype, m, k, 1)
    x[rng.choice(k, 10, replace=False)] *= 100.0
    x[rng.choice(k, 64, replace=False)] *= 1e-3
    y = _run_gemv(run, spec, ws, x, r)
    assert rel_err(y, _ref(spec, ws, x, r, None)) <= BOUND


def test_q6k_dp4a_default_where_measured():
    """Q6_K takes the dp4a dot where it measured faster (the ring at K = 12288
    to 16384 without an epilogue or with the residual, and SwiGLU through the
    ring at K = 4096, the 128256-row output) and keeps the f32 dot at K =
    4096 otherwise."""
    def dot(m, k, epi):
        return G.default_plan("Q6_K", k, epi, target="sm_90", m=m).dot
    assert [dot(4096, 14336, "none"), dot(4096, 14336, "residual"), dot(2048, 16384, "none"),
            dot(14336, 4096, "swiglu"), dot(128256, 4096, "none")] == ["dp4a"] * 5
    assert [dot(m, 4096, e) for m, e in ((4096, "none"), (14336, "none"),
                                         (4096, "residual"))] == ["fma"] * 3


def test_dp4a_dot_refused_where_not_built():
    for bad in (dict(qtype="Q6_K", k=512), dict(qtype="Q8_0", k=512, stages=2, tile=512),
                ):
        with pytest.raises(ValueError, match="dp4a"):
            G.GemvPlan.make(dot="dp4a", **bad)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("epi", ["none", "residual", "swiglu"])
def test_gemv_gpu_large(gpu_run, qtype, epi, rng):
    m, k = 1031, 4096
    spec = (G.default_plan(qtype, k, epi)).evolve(max_ctas=200)
    ws, x, r = _data(rng, qtype, m, k, spec.n_mats)
    y = _run_gemv(gpu_run, spec, ws, x, r)
    assert rel_err(y, _ref(spec, ws, x, r, None)) <= BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,m,k,epi,knobs", [
    ("Q4_K", 1031, 14336, "none", (3, 4, 264, 0, True, "dp4a")),
    ("Q4_K", 1031, 14336, "residual", (3, 4, 264, 0, True, "dp4a")),
    ("Q4_K", 3072, 14336, "none", (3, 4, 192, 0, True, "dp4a")),
    ("Q6_K", 14339, 4096, "none", (4, 4, 528, 2, True, "fma")),
    ("Q4_K", 8195, 4096, "residual", (4, 8, 330, 0, False, "dp4a")),
    ("Q6_K", 1031, 14336, "none", (2, 4, 264, 2, False, "dp4a")),
    ("Q6_K", 1031, 14336, "residual", (2, 4, 264, 2, False, "dp4a")),
    ("Q6_K", 2053, 4096, "swiglu", (3, 4, 264, 2, False, "dp4a")),
    ("Q8_0", 1031, 14336, "none", (4, 1, 264, 8, False, "fma")),
    ("Q8_0", 1031, 14336, "residual", (4, 1, 264, 8, False, "fma")),
    ("Q8_0", 1031, 4096, "residual", (4, 4, 396, 2, False, "fma")),
    ("Q8_0", 1031, 8192, "residual", (0, 8, 2112, 0, False, "fma"))])
def test_gemv_gpu_default_wide_and_tall(gpu_run, qtype, m, k, epi, knobs, rng):
    """The defaults at K = 14336 (Q4_K alone: 3 stages filled by the bulk copy
    engine, at 3072 rows 192 CTAs of 4 row groups; Q6_K: two CTAs of 448
    threads per SM through the ring; Q8_0: two of 224, 8 pieces a thread), at
    8192 <= M < 16384 (330 CTAs at most), Q6_K and Q8_0 with two pieces a
    thread at K = 4096, and Q8_0 tiles of 1024 weights at K = 8192, with their
    own launch geometry (the dp4a dot: Q4_K through the ring, Q6_K at K =
    14336 and with SwiGLU)."""
    spec = G.default_plan(qtype, k, epi, target="sm_90", m=m)
    assert (spec.stages, spec.rows, spec.max_ctas, spec.pieces, spec.bulk, spec.dot) == knobs
    ws, x, r = _data(rng, qtype, m, k, spec.n_mats)
    y = _run_gemv(gpu_run, spec, ws, x, r)
    assert rel_err(y, _ref(spec, ws, x, r, None)) <= BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("k,epi,knobs", [(4096, "none", {"norm": True}),
                                         (4096, "swiglu", {"norm": True}),
                                         (14336, "none", {"norm": True}),
                                         (4096, "none", {"norm": True, "stages": 0}),
                                         (4096, "swiglu", {"norm": True, "stages": 0}),
                                         (4096, "none", {"stages": 4, "rows": 4}),
                                         (4096, "swiglu", {"stages": 3, "rows": 2}),
                                         (14336, "residual", {"stages": 4, "rows": 1}),
                                         (4096, "none", {"dot": "dp4a"}),
                                         (4096, "swiglu", {"dot": "dp4a"}),
                                         (14336, "residual", {"dot": "dp4a"}),
                                         (4096, "none", {"dot": "dp4a", "stages": 4,
                                                         "rows": 4}),
                                         (4096, "residual", {"dot": "dp4a", "stages": 4,
                                                             "rows": 8, "ahead": 1}),
                                         (14336, "residual", {"dot": "dp4a", "stages": 3,
                                                              "rows": 4, "ahead": 1}),
                                         (4096, "swiglu", {"stages": 2, "rows": 4,
                                                           "per_sm": 3})])
def test_gemv_q4k_knobs_gpu_large(gpu_run, k, epi, knobs, rng):
    """Fused RMSNorm and the cp.async ring at the model's
    shapes (M = 1031)."""
    m = 1031
    spec = (G.default_plan("Q4_K", k, epi, **knobs)).evolve(max_ctas=200)
    ws, x, r = _data(rng, "Q4_K", m, k, spec.n_mats)
    norm = _norm_data(rng, k) if spec.norm else None
    y = _run_gemv(gpu_run, spec, ws, x, r, norm)
    assert rel_err(y, _ref(spec, ws, x, r, norm)) <= BOUND


def test_default_plan_streams_q4k_with_dp4a():
    """Q4_K defaults to the cp.async ring with the dp4a dot wherever the other
    knobs allow it (measured faster at every shape, docs/notes/gemv.md,
    "Kernel structure"), with the row group shrunk to fit shared memory; Q6_K/Q8_0 stream
    at K <= 4096 with 16-byte rows."""
    def spec(m, epi="none", k=4096, **kw):
        return G.default_plan("Q4_K", k, epi, target="sm_90", m=m, **kw)

    def knobs(s):
        return (s.stages, s.rows, s.max_ctas, s.dot)
    assert knobs(spec(1024)) == (4, 2, 1056, "dp4a")
    assert knobs(spec(4096)) == knobs(spec(6144, "residual")) == (4, 8, 396, "dp4a")
    # 8192 <= M < 16384: fewer CTAs, so the next launch's CTAs find free slots
    assert knobs(spec(14336)) == knobs(spec(8192, "residual")) == (4, 8, 330, "dp4a")
    assert knobs(spec(16384)) == (4, 8, 396, "dp4a")
    assert knobs(spec(128256)) == (3, 16, 264, "dp4a")
    assert knobs(spec(14336, "swiglu")) == (2, 4, 528, "dp4a")
    # K = 14336: two CTAs of 448 threads per SM, held to 72 registers by the
    # hint, three stages filled by the bulk copy engine on sm_90; sm_80 has
    # none, and keeps two stages with the residual
    assert knobs(spec(4096, "residual", k=14336)) == knobs(spec(1031, k=14336)) \
        == (3, 4, 264, "dp4a")
    # alone, where the deal would fill 256 of the 264 slots with 3 row groups
    # each: one group more per CTA, so the next launch finds free slots
    assert [G.launch_geometry(spec(m, k=k), m).grid[0] for m, k in
            ((3072, 14336), (3072, 12288))] == [192, 192]
    # not where slots are free already, nor at 2 or 4+ groups, nor with three
    # CTAs an SM (K = 8192), nor with the residual
    assert [G.launch_geometry(spec(m, epi, k=k), m).grid[0] for m, epi, k in
            ((3584, "none", 14336), (4608, "none", 14336), (2048, "none", 14336),
             (4096, "none", 14336), (4096, "none", 11008), (5120, "none", 14336),
             (8192, "none", 14336), (4096, "none", 8192), (4096, "residual", 14336))
            ] == [224, 231, 256, 256, 256, 256, 256, 256, 256]
    # nor with one CTA an SM (K = 28672: 132 slots), where it was not measured
    assert [G.launch_geometry(spec(m, k=28672), m).grid[0] for m in (1536, 2048)] == [128, 128]
    assert spec(4096, k=14336).bulk and spec(4096, "residual", k=14336).bulk
    old = G.default_plan("Q4_K", 14336, "residual", m=4096, target="sm_80")
    assert not old.bulk and old.stages == 2
    assert not G.default_plan("Q4_K", 14336, m=4096, target="sm_80").bulk
    assert not any(spec(m).bulk for m in (1024, 4096, 14336, 128256))
    assert spec(4096, "residual", k=14336).min_ctas == 2 and spec(4096, k=28672).min_ctas == 0
    # 2 stages x 8 rows of 16128-byte rows exceed shared memory: fewer rows
    assert knobs(spec(4096, k=28672)) == (2, 4, 132, "dp4a")
    # a fused RMSNorm streams as well
    assert knobs(spec(6144, norm=True)) == (4, 8, 396, "dp4a") and spec(6144, norm=True).norm
    assert knobs(spec(14336, "swiglu", norm=True)) == (2, 4, 528, "dp4a")
    # the ring needs x in registers and one slice: the direct kernel
    for s in (spec(14336, "swiglu", k=14336), spec(14336, stages=0)):
        assert s.stages == 0 and s.dot == "fma"
    assert (G.default_plan("Q6_K", 4096, m=128256).stages, G.default_plan("Q6_K", 4096).tile) \
        == (4, 4096)
    assert G.default_plan("Q8_0", 4096, "residual").stages == 4
    # Q6_K at 12288 <= K <= 16384: two CTAs of K/32 threads per SM, 2 stages of 4 rows
    assert [(s.stages, s.rows, s.max_ctas, s.tile, s.pieces, G.threads(s)) for s in
            (G.default_plan("Q6_K", 14336), G.default_plan("Q6_K", 16384, "residual"))] \
        == [(2, 4, 264, 14336, 2, 448), (2, 4, 264, 16384, 2, 512)]
    # Q8_0 there: two CTAs of K/64 threads (8 pieces each); elsewhere past
    # K = 4096, 1024-weight tiles
    assert [(s.stages, s.rows, s.tile, s.pieces, G.threads(s)) for s in
            (G.default_plan("Q8_0", 14336), G.default_plan("Q8_0", 12288, "residual"))] \
        == [(4, 1, 14336, 8, 224), (4, 1, 12288, 8, 192)]
    assert (G.default_plan("Q8_0", 8192).tile, G.default_plan("Q8_0", 14336, "swiglu").tile) \
        == (1024, 2048)
    # two pieces a thread at K = 4096: Q8_0 always, Q6_K at 2048 <= M < 28672
    assert [G.default_plan(q, 4096, epi, m=m).pieces for q, epi, m in
            (("Q8_0", "none", None), ("Q8_0", "swiglu", 14336), ("Q8_0", "none", 128256),
             ("Q6_K", "none", 1024), ("Q6_K", "none", 2048), ("Q6_K", "swiglu", 14336),
             ("Q6_K", "residual", 28671), ("Q6_K", "none", 28672), ("Q6_K", "none", None))] \
        == [2, 2, 2, 0, 2, 2, 2, 0, 0]
    assert [G.default_plan("Q6_K", k, epi).stages for k, epi in
            ((8192, "none"), (18432, "none"), (14336, "swiglu"))] == [0, 0, 0]
    assert (G.default_plan("Q6_K", 4096, "swiglu").stages, G.default_plan("Q8_0", 4096, "swiglu").rows) \
        == (3, 4)
    # the ring's shared memory is what launch_geometry asks for
    s = spec(128256)
    assert G.launch_geometry(s, 128256).shared == 3 * 16 * s.row_bytes


def test_default_ring_sends_part_of_a_short_prologue_after_x():
    """ahead=1 where a CTA's rows fit in the prologue's S - 1 groups (the
    model's QKV and O), the whole prologue before the wait otherwise."""
    def ahead(m, k=4096, epi="none"):
        return G.default_plan("Q4_K", k, epi, m=m).ahead
    assert ahead(6144) == 1 and ahead(4096, epi="residual") == 1 and ahead(1024) == 1
    assert ahead(14336) == 0 and ahead(128256) == 0
    assert ahead(14336, epi="swiglu") == 0 and ahead(4096, 14336, "residual") == 0


def test_bulk_knob_refused_where_not_built():
    with pytest.raises(ValueError, match="needs stages"):
        G.GemvPlan.make("Q4_K", 512, bulk=True, target="sm_90")
    with pytest.raises(ValueError, match="sm_90 or newer"):
        G.GemvPlan.make("Q4_K", 512, stages=3, bulk=True, target="sm_80")
    assert G.GemvPlan.make("Q4_K", 512, stages=3, bulk=True, target="sm_90").kernel_name \
        == "gemv_q4_k_k512_r4_s3_bulk"


def test_kernel_names_tell_text_changing_knobs_apart():
    """Specs whose PTX differs get different entry names (profiles and
    timelines go by name); launch-only knobs leave the name alone."""
    base = dict(qtype="Q4_K", k=1024, rows=2)
    variants = [{}, {"pieces": 2}, {"min_ctas": 2}, {"dot": "dp4a"},
                {"stages": 3}, {"stages": 3, "pieces": 2}, {"stages": 3, "min_ctas": 2}]
    specs = [G.GemvPlan.make(**base, **v) for v in variants]
    names = [s.kernel_name for s in specs]
    assert len(set(names)) == len(names), names
    texts = {G.build(s).to_ptx().replace(s.kernel_name, "K") for s in specs}
    assert len(texts) == len(specs)          # each knob changes the text
    staged = [G.GemvPlan.make("Q6_K", 4096, **v).kernel_name for v in ({}, {"tile": 1024})]
    assert len(set(staged)) == 2
    # pdl is set by the executor after the graph names its launches
    assert G.GemvPlan.make(**base, pdl=True, target="sm_90").kernel_name == names[0]
    assert G.GemvPlan.make(**base, max_ctas=7, per_sm=0).kernel_name == names[0]
    assert G.GemvPlan.make(**base, stages=3, max_ctas=7, per_sm=2).kernel_name == names[4]


def test_interleave_knob_refused_without_the_ring():
    with pytest.raises(ValueError, match="it needs stages"):
        G.GemvPlan.make("Q4_K", 512, interleave=True)
    assert G.GemvPlan.make("Q4_K", 512, stages=3, interleave=True).kernel_name \
        == "gemv_q4_k_k512_r4_s3_il"


def test_interleave_defaults():
    """Ring GEMVs deal their row groups round robin except where it measured
    slower (Q4_K with few rows, the residual at K = 14336); the direct
    kernel has no ring to deal."""
    def spec(m, k=4096, epi="none", qtype="Q4_K", **kw):
        return G.default_plan(qtype, k, epi, target="sm_90", m=m, **kw)
    assert spec(4096, 14336).interleave and spec(14336).interleave
    assert spec(14336, epi="swiglu").interleave and spec(4096, epi="residual").interleave
    assert spec(6144, epi="rope", rope=(128, 32, 8)).interleave and spec(128256).interleave
    assert not spec(1024).interleave and not spec(4096, 14336, "residual").interleave
    for qt in ("Q6_K", "Q8_0"):
        assert spec(4096, 14336, qtype=qt).interleave and spec(128256, qtype=qt).interleave
    assert not spec(4096, stages=0).interleave
    assert not spec(4096, interleave=False).interleave


def test_ring_and_static_arrays_must_fit_together():
    """A ring 160 bytes under the limit, with 976 threads' reduction array
    (31 warps x 2 rows, padded to a line) in front of it, is refused; with
    488 threads (one line of static memory) it fits."""
    with pytest.raises(ValueError, match="232544 with the kernel's static arrays"):
        G.GemvPlan.make("Q8_0", 15616, stages=7, rows=2, tile=15616, pieces=2)
    ok = G.GemvPlan.make("Q8_0", 15616, stages=7, rows=2, tile=15616, pieces=4)
    assert ok.ring_bytes + ok.ring_static_bytes == 232288 + 128


def test_stages_knob_refused_where_not_built():
    with pytest.raises(ValueError, match="stages must be"):
        G.GemvPlan.make("Q4_K", 512, stages=1)
    with pytest.raises(ValueError, match="one tile per row"):
        G.GemvPlan.make("Q6_K", 4096, stages=3, tile=2048)
    with pytest.raises(ValueError, match="whole 16-byte chunks \\(4 rows of 210 bytes"):
        G.GemvPlan.make("Q6_K", 256, stages=3, tile=256)      # 210-byte rows
    with pytest.raises(ValueError, match="built for the ring"):
        G.GemvPlan.make("Q8_0", 512, pieces=2)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        G.GemvPlan.make("Q4_K", 14336, stages=8, rows=8)
    for stages, ahead in ((3, 3), (0, 1), (4, -1), (4, True)):
        with pytest.raises(ValueError, match="ahead"):
            G.GemvPlan.make("Q4_K", 512, stages=stages, ahead=ahead)


@pytest.mark.parametrize("target,shared_kb", [("sm_90", 228), ("sm_80", 164), ("sm_86", 100)])
def test_per_sm_caps_resident_rings_by_shared_memory(target, shared_kb):
    """per_sm=n asks for the dynamic shared memory at which n CTAs fit on an
    SM and n + 1 do not (1 KB reserved per CTA); the kernel text is unchanged."""
    base = G.GemvPlan.make("Q4_K", 4096, "swiglu", rows=2, stages=2, target=target)
    ring = base.ring_bytes
    assert base.dynamic_shared == ring
    per = shared_kb * 1024
    for n in range(1, per // (ring + 1024) + 1):
        s = base.evolve(per_sm=n)
        sh = G.launch_geometry(s, 14336).shared
        assert sh == s.dynamic_shared >= ring and sh % 16 == 0
        assert per // (sh + 1024) == n, (n, sh)
        assert G.build(s).to_ptx() == G.build(base).to_ptx()
    with pytest.raises(ValueError, match="do not fit"):
        base.evolve(per_sm=per // (ring + 1024) + 1)
    for bad in (-1, 33, True, 2.0):
        with pytest.raises(ValueError, match="per_sm"):
            base.evolve(per_sm=bad)
    with pytest.raises(ValueError, match="needs stages"):
        G.GemvPlan.make("Q4_K", 4096, per_sm=2, target=target)


@pytest.mark.parametrize("qtype,k", [("Q4_K", 300), ("Q4_K", 128), ("Q6_K", 1000),
                                     ("Q8_0", 40), ("Q8_0", 0), ("Q4_K", 512.0)])
def test_k_not_multiple_refused(qtype, k):
    with pytest.raises(ValueError, match="multiple"):
        G.GemvPlan.make(qtype, k)
    with pytest.raises(ValueError):
        G.default_plan(qtype, k)


@pytest.mark.parametrize("bad", [dict(qtype="Q3_K"), dict(qtype="F32"), dict(epilogue="gelu"),
                                 dict(rows=3),
                                 dict(rows=32), dict(tile=100), dict(slices=2),
                                 dict(target="sm_75"), dict(max_ctas=0)])
def test_bad_spec_refused(bad):
    kw = dict(qtype="Q8_0", k=256) | bad
    with pytest.raises(ValueError):
        G.GemvPlan.make(**kw)


def test_norm_is_q4k_register_only():
    with pytest.raises(ValueError, match="norm=True .* built for Q4_K, not Q6_K"):
        G.GemvPlan.make("Q6_K", 512, norm=True)
    assert "_norm" in G.GemvPlan.make("Q4_K", 512, norm=True).kernel_name


def test_launch_geometry_covers_rows():
    spec = G.GemvPlan.make("Q4_K", 4096, rows=4, max_ctas=100)
    for m in (1, 3, 4, 5, 399, 401, 128256):
        geo = G.launch_geometry(spec, m)
        grid, block, shared, rpc = geo.grid, geo.block, geo.shared, geo.args["rpc"]
        assert rpc % spec.rows == 0 and grid[0] <= 100 and grid[0] * rpc >= m
        assert (grid[0] - 1) * rpc < m and block == (128, 1, 1) and shared == 0
    with pytest.raises(ValueError):
        G.launch_geometry(spec, 0)


def test_deterministic_and_named():
    spec = G.GemvPlan.make("Q6_K", 512, epilogue="swiglu")
    assert G.build(spec).to_ptx() == G.build(spec).to_ptx()
    assert spec.kernel_name in G.build(spec).to_ptx()


@pytest.mark.parametrize("target", ["sm_80", "sm_86", "sm_89", "sm_90"])
@pytest.mark.parametrize("name", sorted(G.CANONICAL) + ["q4k_14336_swiglu", "q6k_4096"])
def test_ptxas_no_spills(ptxas, target, name):
    extra = {"q4k_14336_swiglu": G.default_plan("Q4_K", 14336, "swiglu"),
             "q6k_4096": G.default_plan("Q6_K", 4096)}
    try:
        spec = (G.CANONICAL.get(name) or extra[name]).evolve(target=target)
    except ValueError as e:         # the bulk copy engine needs sm_90
        pytest.skip(f"{name} is not built for {target}: {e}")
    _, reports = assemble(G.build(spec).to_ptx(), target)     # raises on a ptxas error
    # Q4_K swiglu at K=14336 (448 threads) spills 8 bytes on sm_80; allow that much
    assert len(reports) == 1 and reports[0].spill_stores <= 8, reports


# ---------------------------------------------------------------- rope epilogue

def _rope_case(rng, spec, capacity):
    """Weights, x, the RoPE table and reference inv_freq, poisoned caches."""
    from ptxgen.kernels import rope
    d, nq, nkv = spec.rope
    m = spec.rope_rows
    ws, x, _ = _data(rng, spec.qtype, m, spec.k, 1)
    rs = rope.RopeSpec(head_dim=d, layout="interleaved", theta=500000.0, scaling="llama3")
    caches = [rng.standard_normal((nkv, capacity, d)).astype(np.float16) for _ in range(2)]
    from formulas import llama3_inv_freq
    inv = llama3_inv_freq(rs.theta, d, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                          rs.original_context)
    return ws[0], x, rope.freq_table(rs), inv, caches


def _run_rope(run, spec, w, x, freqs, caches, pos, norm=None, bias=None):
    """The kernel on the natural-order ``w`` (put in pair order for NeoX)."""
    m = spec.rope_rows
    fn = run.function(G.build, spec)
    kc, vc = (run.array(c) for c in caches)
    if spec.rope_layout == "neox":
        w = w[G.neox_pair_rows(*spec.rope)]
    args = dict(w=run.array(w), x=run.array(x), freqs=run.array(freqs),
                pos_ptr=run.array(np.array([pos], np.int32)), k_cache=kc, v_cache=vc,
                capacity=caches[0].shape[1], y=run.poisoned(m), m=m)
    if spec.norm:
        args.update(nw=run.array(norm[0]), eps=norm[1])
    if spec.bias:
        args["bias"] = run.array(bias)
    run.launch(fn, G.launch_geometry(spec, m), args)
    return run.get(args["y"]), run.get(kc), run.get(vc)


ROPE_CASES = [
    ("Q4_K", 512, (32, 3, 1), {"rows": 2}),
    ("Q4_K", 512, (64, 2, 1), {"rows": 4, "stages": 3, "dot": "dp4a", "ahead": 1}),
    ("Q4_K", 256, (16, 5, 2), {"rows": 8, "norm": True, "stages": 2, "dot": "dp4a"}),
    # the decode step's QKV knobs: 8 rows, 3 stages, one group ahead, the norm folded
    ("Q4_K", 512, (32, 4, 2), {"rows": 8, "norm": True, "stages": 3, "dot": "dp4a",
                               "ahead": 1}),
    ("Q4_K", 512, (32, 4, 2), {"rows": 2}),
    ("Q6_K", 512, (32, 3, 1), {"rows": 2}),
    ("Q8_0", 256, (8, 6, 3), {"rows": 4, "stages": 3, "tile": 256}),
    # Qwen2's: biases, NeoX pairs (W in pair order), the decode step's knobs
    ("Q4_K", 512, (32, 4, 2), {"rows": 8, "norm": True, "stages": 3, "dot": "dp4a",
                               "ahead": 1, "bias": True, "rope_layout": "neox"}),
    ("Q4_K", 256, (16, 5, 2), {"rows": 2, "bias": True}),
    ("Q4_K", 512, (64, 2, 1), {"rows": 4, "rope_layout": "neox"}),
    ("Q6_K", 512, (32, 3, 1), {"rows": 2, "bias": True, "rope_layout": "neox"}),
    ("Q8_0", 256, (8, 6, 3), {"rows": 4, "stages": 3, "tile": 256, "bias": True,
                              "rope_layout": "neox"}),
]


@pytest.mark.parametrize("qtype,k,rope,knobs", ROPE_CASES)
def test_gemv_rope_epilogue(run, qtype, k, rope, knobs, rng):
    """The stacked QKV GEMV with RoPE and the f16 KV append: y against float64
    (rotated q/k, plain v; bound BOUND), the caches' row ``pos`` against
    f16(y) and every other cache row unchanged; at a position past the
    capacity y is still rotated and the caches are untouched.  M is not a
    multiple of a CTA's rows (small max_ctas).  With ``bias`` a random f32
    bias is added before the rotation; with NeoX pairs the kernel reads W
    in pair order and y and the caches are compared in the natural order."""
    spec = G.GemvPlan.make(qtype, k, epilogue="rope", rope=rope, max_ctas=3, **knobs)
    cap = 11
    w, x, freqs, inv, caches = _rope_case(rng, spec, cap)
    norm = _norm_data(rng, k) if spec.norm else None
    bias = rng.standard_normal(spec.rope_rows).astype(np.float32) if spec.bias else None
    plain = G.reference(spec, w, x, epilogue="none", norm_w=norm[0] if norm else None,
                        eps=norm[1] if norm else None)
    for pos in (int(rng.integers(1, cap)), cap):
        ref_caches = [c.astype(np.float64) for c in caches]
        ref = G.rope_reference(plain, pos, spec, inv, *ref_caches, bias=bias)
        y, kc, vc = _run_rope(run, spec, w, x, freqs, caches, pos, norm, bias)
        assert rel_err(y, ref) <= BOUND, pos
        for got, want, before in zip((kc, vc), ref_caches, caches):
            keep = np.ones(cap, bool)
            if pos < cap:
                keep[pos] = False
                # one f16 rounding of the row (relative 2^-11 of its largest value)
                assert rel_err(got[:, pos], want[:, pos]) <= 1e-3
            assert np.array_equal(got[:, keep].view(np.uint16), before[:, keep].view(np.uint16))


PAGED_ROPE_CASES = [
    ("Q4_K", 512, (32, 3, 1), 16, {"rows": 2}),
    # the decode step's QKV knobs with the norm folded, 8 KV heads' worth of pool
    ("Q4_K", 512, (32, 4, 2), 32, {"rows": 8, "norm": True, "stages": 3, "dot": "dp4a",
                                   "ahead": 1}),
    ("Q6_K", 512, (32, 3, 1), 16, {"rows": 2, "bias": True, "rope_layout": "neox"}),
    ("Q8_0", 256, (8, 6, 3), 64, {"rows": 4, "stages": 3, "tile": 256}),
]


@pytest.mark.parametrize("qtype,k,rope,bs,knobs", PAGED_ROPE_CASES)
def test_gemv_rope_epilogue_paged(run, qtype, k, rope, bs, knobs, rng):
    """The rope epilogue over paged pools (``paged=block_size``): y rotated at
    the device position against float64 (bound BOUND), the k and v rows at
    the device slot (block ``slot // bs``, offset ``slot % bs``, a slot
    apart from the position) against f16(y), every other pool entry
    unchanged; at a slot of -1 or past the pools y is still rotated and the
    pools are untouched."""
    spec = G.GemvPlan.make(qtype, k, epilogue="rope", rope=rope, paged=bs, max_ctas=3, **knobs)
    assert f"_paged{bs}" in spec.kernel_name
    d, nq, nkv = rope
    nb = 3
    w, x, freqs, inv, _ = _rope_case(rng, spec, 1)
    pools = [rng.standard_normal((nb, nkv, bs, d)).astype(np.float16) for _ in range(2)]
    norm = _norm_data(rng, k) if spec.norm else None
    bias = rng.standard_normal(spec.rope_rows).astype(np.float32) if spec.bias else None
    plain = G.reference(spec, w, x, epilogue="none", norm_w=norm[0] if norm else None,
                        eps=norm[1] if norm else None)
    m = spec.rope_rows
    fn = run.function(G.build, spec)
    if spec.rope_layout == "neox":
        w = w[G.neox_pair_rows(*spec.rope)]
    pos = int(rng.integers(0, 4096))
    for slot in (int(rng.integers(0, nb * bs)), -1, nb * bs):
        kp, vp = (run.array(p) for p in pools)
        args = dict(w=run.array(w), x=run.array(x), freqs=run.array(freqs),
                    pos_ptr=run.array(np.array([pos], np.int32)),
                    slots=run.array(np.array([slot], np.int32)), k_pool=kp, v_pool=vp,
                    n_slots=nb * bs, y=run.poisoned(m), m=m)
        if spec.norm:
            args.update(nw=run.array(norm[0]), eps=norm[1])
        if spec.bias:
            args["bias"] = run.array(bias)
        run.launch(fn, G.launch_geometry(spec, m), args)
        y, kg, vg = run.get(args["y"]), run.get(kp), run.get(vp)
        ref_pools = [p.astype(np.float64) for p in pools]
        ref = G.rope_reference(plain, pos, spec, inv, *ref_pools, bias=bias, slot=slot)
        assert rel_err(y, ref) <= BOUND, slot
        for got, want, before in zip((kg, vg), ref_pools, pools):
            keep = np.ones((nb, bs), bool)
            if 0 <= slot < nb * bs:
                b, o = divmod(slot, bs)
                keep[b, o] = False
                # one f16 rounding of the row (relative 2^-11 of its largest value)
                assert rel_err(got[b, :, o], want[b, :, o]) <= 1e-3
            mask = np.broadcast_to(keep[:, None, :, None], got.shape)
            assert np.array_equal(got[mask].view(np.uint16), before[mask].view(np.uint16))


def test_rope_epilogue_refused_where_not_built():
    with pytest.raises(ValueError, match="rows must be even"):
        G.GemvPlan.make("Q4_K", 512, epilogue="rope", rope=(64, 4, 2), rows=1)
    for bad in ((), (64, 4), (63, 4, 2), (64, 0, 2), (1024, 1, 1), (64.0, 4, 2)):
        with pytest.raises(ValueError, match="rope=\\(head_dim"):
            G.GemvPlan.make("Q4_K", 512, epilogue="rope", rope=bad, rows=2)
    with pytest.raises(ValueError, match="is for epilogue='rope'"):
        G.GemvPlan.make("Q4_K", 512, rope=(64, 4, 2))
    with pytest.raises(ValueError, match="bias=True is built for epilogue='rope'"):
        G.GemvPlan.make("Q4_K", 512, "residual", bias=True)
    with pytest.raises(ValueError, match="rope_layout='neox' is for epilogue='rope'"):
        G.GemvPlan.make("Q4_K", 512, rope_layout="neox")
    with pytest.raises(ValueError, match="rope_layout must be one of"):
        G.GemvPlan.make("Q4_K", 512, epilogue="rope", rope=(64, 4, 2), rope_layout="gptj")
    with pytest.raises(ValueError, match="paged=16 is for epilogue='rope'"):
        G.GemvPlan.make("Q4_K", 512, "residual", paged=16)
    for bad in (8, 24, True):
        with pytest.raises(ValueError, match="paged must be 0"):
            G.GemvPlan.make("Q4_K", 512, epilogue="rope", rope=(64, 4, 2), rows=2, paged=bad)
    # default_plan keeps rows even for the pairs
    s = G.default_plan("Q4_K", 4096, "rope", m=6144, rope=(128, 32, 8))
    assert s.rows % 2 == 0 and s.epilogue == "rope"
    assert (s.rows, s.stages, s.ahead, s.dot) == (8, 3, 1, "dp4a")
    assert "rope128h32x8" in s.kernel_name


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_gemv_rope_epilogue_gpu_model_shape(gpu_run, qtype, rng):
    """The model's QKV shape (32 query / 8 KV heads of 128, K = 4096) with
    the default knobs, on the GPU."""
    spec = G.default_plan(qtype, 4096, "rope", m=6144, rope=(128, 32, 8))
    cap = 300
    w, x, freqs, inv, caches = _rope_case(rng, spec, cap)
    plain = G.reference(spec, w, x, epilogue="none")
    pos = int(rng.integers(0, cap))
    ref_caches = [c.astype(np.float64) for c in caches]
    ref = G.rope_reference(plain, pos, spec, inv, *ref_caches)
    y, kc, vc = _run_rope(gpu_run, spec, w, x, freqs, caches, pos)
    assert rel_err(y, ref) <= BOUND
    for got, want in zip((kc, vc), ref_caches):
        assert rel_err(got[:, pos], want[:, pos]) <= 1e-3
        assert np.array_equal(np.delete(got, pos, axis=1), np.delete(want, pos, axis=1))


@pytest.mark.gpu
def test_gemv_rope_bias_neox_gpu_qwen2_shape(gpu_run, rng):
    """Qwen2-7B's QKV (28 query / 4 KV heads of 128, K = 3584) with its
    biases, NeoX pairs and the fused RMSNorm, default knobs, on the GPU."""
    spec = G.default_plan("Q4_K", 3584, "rope", m=4608, rope=(128, 28, 4), norm=True,
                          bias=True, rope_layout="neox")
    cap = 300
    w, x, freqs, inv, caches = _rope_case(rng, spec, cap)
    norm = _norm_data(rng, spec.k)
    bias = rng.standard_normal(spec.rope_rows).astype(np.float32)
    plain = G.reference(spec, w, x, epilogue="none", norm_w=norm[0], eps=norm[1])
    pos = int(rng.integers(0, cap))
    ref_caches = [c.astype(np.float64) for c in caches]
    ref = G.rope_reference(plain, pos, spec, inv, *ref_caches, bias=bias)
    y, kc, vc = _run_rope(gpu_run, spec, w, x, freqs, caches, pos, norm, bias)
    assert rel_err(y, ref) <= BOUND
    for got, want in zip((kc, vc), ref_caches):
        assert rel_err(got[:, pos], want[:, pos]) <= 1e-3
        assert np.array_equal(np.delete(got, pos, axis=1), np.delete(want, pos, axis=1))


def test_neox_pair_rows(rng):
    """A permutation that puts each q/k head's NeoX pairs (i, i + d/2) on
    adjacent rows (2i, 2i + 1) and leaves the v rows in place."""
    d, nq, nkv = 2 * int(rng.integers(1, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 3))
    order = G.neox_pair_rows(d, nq, nkv)
    assert sorted(order) == list(range((nq + 2 * nkv) * d))
    for h in range(nq + nkv):
        for i in range(d // 2):
            assert (order[h * d + 2 * i], order[h * d + 2 * i + 1]) == (h * d + i,
                                                                       h * d + i + d // 2)
    v0 = (nq + nkv) * d
    assert list(order[v0:]) == list(range(v0, v0 + nkv * d))


def test_ab_configs_name_valid_specs(ptxas):
    """Every variant of the knob A/B configs in benchmarks/ab/ is a spec the
    builder accepts and ptxas assembles for sm_90 without spilling
    (python -m benchmarks.bench_gemv_ab would otherwise find out on the
    GPU machine)."""
    import json
    import pathlib
    cfgs = sorted((pathlib.Path(__file__).parents[2] / "benchmarks" / "ab").glob("*.json"))
    assert cfgs
    for path in cfgs:
        for shape in json.loads(path.read_text())["shapes"]:
            for name, knobs in shape["variants"].items():
                spec = G.default_plan(shape.get("qtype", "Q4_K"), shape["k"],
                                      shape.get("epi", "none"), target="sm_90", pdl=True,
                                      m=shape["m"], **knobs)
                _, reports = assemble(G.build(spec).to_ptx(), "sm_90")
                assert reports[0].spill_stores == 0, (path.name, name, reports)


@attrs.frozen
class _PlanesProbe:
    """A kernel that splits 4 x values a thread with ``gemv.common.x_planes``
    and stores the three plane words."""
    target: str = "sm_80"
    kernel_name: str = "x_planes_probe"


def _build_planes_probe(spec):
    import ptxgen
    from ptxgen.types import f32, u32
    from ptxgen.kernels.gemv.common import x_planes
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name) as k:
        x = k.param_ptr("x", f32)
        inv = k.param("inv", f32)
        out = k.param_ptr("out", u32)
        i = k.ctaid.x * 32 + k.tid.x
        planes = x_planes(k, list(k.ld(x[i * 4], f32, vec=4)), inv)
        for p in range(3):
            k.st(out[i * 3 + p], planes[p][0])
    return m


def test_x_planes_hold_the_rounded_integer(run, rng):
    """The dp4a dot's three byte planes of x hold exactly ``T = round(x *
    inv)`` (ties to even, one rounding) as ``x0 2^16 + x1 2^8 + x2`` with
    ``x0`` a signed and ``x1, x2`` unsigned bytes, over the whole range
    ``|T| <= 4e6`` (``inv = 4e6 / max|x|``): ties, both ends, zero and
    values of every magnitude."""
    from ptxgen.kernels.gemv.common import XFULL
    n = 64 * 4
    amax = np.float32(rng.uniform(0.5, 3.0))
    inv = np.float32(XFULL / np.float64(amax))
    x = (rng.uniform(-1, 1, n) * amax * 10.0 ** rng.integers(-7, 1, n)).astype(np.float32)
    # exact ends, zero, and values that land on .5 ties (rounded to even)
    x[:4] = [amax, -amax, 0.0, np.float32(2.5 / np.float64(inv))]
    x[4:8] = np.float32(np.array([-0.5, 1.5, 65535.5, -65536.5]) / np.float64(inv))
    out = run.poisoned(n // 4 * 3, np.uint32)
    fn = run.function(_build_planes_probe, _PlanesProbe())
    run.launch(fn, LaunchGeometry(_PlanesProbe().kernel_name, n // 128, 32), dict(x=run.array(x), inv=inv, out=out))
    words = run.get(out).reshape(-1, 3)
    b = words.view(np.uint8).reshape(-1, 3, 4)       # [group, plane, value]
    t = (b[:, 0].astype(np.int8).astype(np.int64) * 65536 + b[:, 1].astype(np.int64) * 256
         + b[:, 2].astype(np.int64)).reshape(-1)
    want = np.rint(x.astype(np.float64) * np.float64(inv)).astype(np.int64)
    assert np.abs(want).max() <= XFULL + 1
    np.testing.assert_array_equal(t, want)


@pytest.mark.parametrize("k,config", [
    (512, {"rows": 2}),
    (512, {"rows": 4, "stages": 3, "dot": "dp4a", "ahead": 1, "interleave": True,
           "max_ctas": 3}),
    (768, {"rows": 8, "stages": 2, "pieces": 2}),
])
def test_norm_out(run, rng, seed, k, config):
    """``norm_out``: y as with the fused norm, and h (stored by CTA 0 only)
    the RMSNorm of x (``rmsnorm``'s float64 reference, 1e-5 relative, the
    rmsnorm kernel's bound); every CTA reads the same x, so h is whole."""
    from ptxgen.kernels import rmsnorm
    m = 40
    spec = G.GemvPlan.make("Q4_K", k, norm=True, norm_out=True, **config)
    ws, x, _ = _data(rng, "Q4_K", m, k, 1)
    nw, eps = _norm_data(rng, k)
    fn = run.function(G.build, spec)
    args = dict(w=run.array(ws[0]), x=run.array(x), nw=run.array(nw), eps=eps,
                h=run.poisoned(k), y=run.poisoned(m), m=m)
    geo = G.launch_geometry(spec, m)
    assert geo.grid[0] > 1
    run.launch(fn, geo, args)
    err = rel_err(run.get(args["y"]), _ref(spec, ws, x, None, (nw, eps)))
    assert err <= BOUND, f"seed={seed}: y off by {err:.3g}"
    err = rel_err(run.get(args["h"]), rmsnorm.reference(x, nw, eps))
    assert err <= 1e-5, f"seed={seed}: h off by {err:.3g}"


def test_norm_out_needs_norm():
    with pytest.raises(ValueError, match="norm_out=True .* needs norm=True"):
        G.GemvPlan.make("Q4_K", 512, norm_out=True)
    assert "_normh" in G.GemvPlan.make("Q4_K", 512, norm=True, norm_out=True).kernel_name
