"""GEMV of the weight types beside Q4_K/Q6_K/Q8_0: Q4_0, Q4_1, Q5_0, Q5_1,
Q5_K, F16 and BF16, in every epilogue, against float64.

The oracle is gguf's own decoder: each test's weights are decoded by
``gguf.quants.dequantize`` (float32, widened to float64) and multiplied by
x in float64 here, epilogues written out in numpy; the kernels' decoders
share nothing with it.  Weights are fresh random draws from the test's
seeded generator, both GGML-quantized Gaussian rows and raw random bytes
with random finite f16 scales (every bit pattern of the quants, the Q5
high bits and the K-quant scales).  Outputs are poisoned (NaN) before each
launch.  Bound: ``max|y - ref| / max|ref| <= 1e-5``, as for the other
types (docs/notes/gemv.md, "Accuracy").  M = 37 (odd, not a multiple of a
CTA's rows) with a grid of at most 4 CTAs, so CTAs walk several row groups.
"""

import attrs
import numpy as np
import pytest

from ptxgen.kernels import gemv as G
from ptxgen.kernels import quants

BOUND = 1e-5
NEW = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K", "F16", "BF16"]
DP4A = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K"]
M = 37

#: byte ranges of the f16 scale fields of a block (random bytes get finite scales there)
_SCALE_FIELDS = {"Q4_0": (0, 2), "Q4_1": (0, 4), "Q5_0": (0, 2), "Q5_1": (0, 4), "Q5_K": (0, 4)}


def rel_err(out, ref) -> float:
    """``max|out - ref| / max|ref|`` (inf when ``out`` has a non-finite value)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _gguf_decode(raw, qtype, m, k):
    gguf = pytest.importorskip("gguf")
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    return np.asarray(out, dtype=np.float32).reshape(m, k).astype(np.float64)


def _weights(rng, qtype, m, k, source):
    """``uint8 [m, row_bytes]``: Gaussian rows quantized by GGML's method, or
    random bytes whose f16 scale fields hold random finite scales of either
    sign (F16/BF16: random values of every exponent in a wide range)."""
    if source == "quantized" or qtype in ("F16", "BF16"):
        w = rng.standard_normal((m, k)).astype(np.float32)
        if source == "bytes":           # F16/BF16: magnitudes over ten binades
            w *= np.float32(2.0) ** rng.integers(-5, 5, (m, k)).astype(np.float32)
        return quants.quantize(w, qtype)
    q = quants.qtype_of(qtype)
    nb = k // q.block_size
    raw = rng.integers(0, 256, (m, nb, q.type_size), dtype=np.uint8)
    a, b = _SCALE_FIELDS[qtype]
    sc = (rng.uniform(1e-3, 2e-2, (m, nb, (b - a) // 2))
          * rng.choice([-1.0, 1.0], (m, nb, (b - a) // 2))).astype(np.float16)
    raw[:, :, a:b] = sc.view(np.uint8).reshape(m, nb, b - a)
    return raw.reshape(m, nb * q.type_size)


def _data(rng, qtype, m, k, n_mats, source="quantized"):
    ws = [_weights(rng, qtype, m, k, source) for _ in range(n_mats)]
    deq = [_gguf_decode(w, qtype, m, k) for w in ws]
    x = rng.standard_normal(k).astype(np.float32)
    r = rng.standard_normal(m).astype(np.float32)
    return ws, deq, x, r


def _ref(epi, deq, x, r):
    """float64: gguf's weights times x, with the epilogue."""
    y = deq[0] @ x.astype(np.float64)
    if epi == "residual":
        return y + r
    if epi == "swiglu":
        u = deq[1] @ x.astype(np.float64)
        # silu(y) = y * sigmoid(y), sigmoid through exp(-|y|): no overflow
        # where random blocks' scales make y huge, no cancellation below 0
        e = np.exp(-np.abs(y))
        return y * np.where(y >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * u
    return y


def _run_gemv(run, plan, ws, x, r):
    m = ws[0].shape[0]
    fn = run.function(G.build, plan)
    args = dict(zip(("w", "wu"), map(run.array, ws)), x=run.array(x), y=run.poisoned(m), m=m)
    if plan.epilogue == "residual":
        args["r"] = run.array(r)
    run.launch(fn, G.launch_geometry(plan, m), args)
    return run.get(args["y"])


def _cases():
    """Per type: the ring (several pieces a thread, the last round past K;
    interleaved groups; one row a group; the bulk copy engine) with each dot,
    and tile by tile (tiles shorter than the row; rows that are not 16-byte
    aligned), in each epilogue."""
    out = []
    for q in NEW:
        blk = G.read_unit(q)[0]
        kq = 768
        dots = ["fma", "dp4a"] if q in DP4A else ["fma"]
        for dot in dots:
            out += [
                (q, 512, "none", dict(stages=3, rows=2, tile=512, pieces=3, dot=dot)),
                (q, kq, "residual", dict(stages=2, rows=4, tile=kq, interleave=True, dot=dot)),
                (q, 256, "swiglu", dict(stages=2, rows=1, tile=256, pieces=2, dot=dot)),
                (q, 512, "residual", dict(stages=3, rows=2, tile=512, ahead=1, bulk=True,
                                          target="sm_90", dot=dot)),
            ]
        out += [(q, 768, "none", dict(tile=256)),
                (q, 512, "swiglu", dict(rows=2)),
                (q, 256, "residual", dict(rows=8, tile=256))]
        if blk == 32:
            # a row of 3 blocks: 54, 60, 66, 72 bytes, 2-, 4-, 2-, 8-byte aligned
            out.append((q, 96, "residual", dict(rows=2)))
        elif blk == 8:
            out.append((q, 40, "none", dict(rows=2)))        # 80-byte rows
    return out


CASES = _cases()


def _id(case):
    q, k, epi, knobs = case
    return f"{q}-k{k}-{epi}-" + "-".join(f"{a}{b}" for a, b in knobs.items())


@pytest.mark.parametrize("qtype,k,epi,knobs", CASES, ids=[_id(c) for c in CASES])
def test_gemv_qtype_numerics(run, qtype, k, epi, knobs, rng):
    plan = G.GemvPlan.make(qtype, k, epilogue=epi, max_ctas=4, **knobs)
    ws, deq, x, r = _data(rng, qtype, M, k, plan.n_mats)
    y = _run_gemv(run, plan, ws, x, r)
    assert rel_err(y, _ref(epi, deq, x, r)) <= BOUND


@pytest.mark.parametrize("qtype,k,rows,dot,epi,m", [
    ("Q6_K", 3584, 8, "dp4a", "none", 36),      # Qwen2's output rows: 2,940 bytes
    ("Q6_K", 3584, 4, "fma", "residual", 36),
    ("Q6_K", 3584, 4, "dp4a", "swiglu", 36),
    ("Q8_0", 96, 8, "fma", "residual", 40),     # 102-byte rows, groups of 816 bytes
])
def test_ring_over_rows_not_16_byte_aligned(run, qtype, k, rows, dot, epi, m, rng):
    """The ring where a row is not 16-byte aligned but a row group is: the
    rows sit back to back in the stage, M a whole number of chunks (36 Q6_K
    rows leave the last group of 8 short); dealt round robin."""
    plan = G.GemvPlan.make(qtype, k, epilogue=epi, stages=3, rows=rows, tile=k, dot=dot,
                           interleave=True, max_ctas=3, target="sm_90")
    assert plan.row_bytes % 16 and (rows * plan.row_bytes) % 16 == 0
    ws, deq, x, r = _data(rng, qtype, m, k, plan.n_mats)
    y = _run_gemv(run, plan, ws, x, r)
    assert rel_err(y, _ref(epi, deq, x, r)) <= BOUND


def test_the_table_rings_qwen2_output_rows_where_m_fits():
    """Q6_K rows of K = 3584 take the ring of K = 4096's output where M is
    a whole number of 16-byte chunks (152,064 rows), the direct kernel where
    it is not or M is unknown."""
    ring = G.default_plan("Q6_K", 3584, m=152064, target="sm_90")
    assert (ring.stages, ring.rows, ring.dot) == (4, 8, "dp4a")
    out4096 = G.default_plan("Q6_K", 4096, m=128256, target="sm_90")
    assert attrs.evolve(ring.config, tile=4096) == out4096.config
    for m in (152062, None):
        assert G.default_plan("Q6_K", 3584, m=m, target="sm_90").stages == 0


@pytest.mark.parametrize("qtype,dot", [(q, d) for q in NEW
                                       for d in (("fma", "dp4a") if q in DP4A else ("fma",))])
def test_gemv_qtype_random_bytes(run, qtype, dot, rng):
    """Raw random blocks (every quant, high-bit and scale pattern) through
    the ring and, with the f32 dot, tile by tile; F16/BF16 values spread over
    ten binades."""
    k = 512
    plans = [G.GemvPlan.make(qtype, k, "residual", max_ctas=4, stages=2, rows=2, tile=k,
                             pieces=2, dot=dot)]
    if dot == "fma":
        plans.append(G.GemvPlan.make(qtype, k, "swiglu", max_ctas=4, rows=2, tile=256))
    for plan in plans:
        ws, deq, x, r = _data(rng, qtype, M, k, plan.n_mats, source="bytes")
        y = _run_gemv(run, plan, ws, x, r)
        assert rel_err(y, _ref(plan.epilogue, deq, x, r)) <= BOUND, plan.kernel_name


@pytest.mark.parametrize("qtype", DP4A)
def test_gemv_qtype_dp4a_outlier_activations(run, qtype, rng):
    """The dp4a dot keeps x to 2^-22.9 of each piece's largest value:
    activations with a few entries 100x the rest and some 1000x smaller
    still meet the bound."""
    k = 1024
    plan = G.GemvPlan.make(qtype, k, max_ctas=4, stages=2, rows=2, tile=k, dot="dp4a")
    ws, deq, x, r = _data(rng, qtype, M, k, 1)
    x[rng.choice(k, 10, replace=False)] *= 100.0
    x[rng.choice(k, 64, replace=False)] *= 1e-3
    y = _run_gemv(run, plan, ws, x, r)
    assert rel_err(y, _ref("none", deq, x, r)) <= BOUND


# ---------------------------------------------------------------- rope epilogue

def _rope_ref(y, pos, spec, inv_freq, caches):
    """float64 RoPE (interleaved pairs) on q and k rows; k and v rows into the caches."""
    d, nq, nkv = spec.rope
    y = y.copy()
    ang = pos * inv_freq                          # [d / 2]
    c, s = np.cos(ang), np.sin(ang)
    qk = y[:(nq + nkv) * d].reshape(nq + nkv, d // 2, 2)
    a, b = qk[..., 0].copy(), qk[..., 1].copy()
    qk[..., 0], qk[..., 1] = a * c - b * s, a * s + b * c
    y[:(nq + nkv) * d] = qk.reshape(-1)
    cap = caches[0].shape[1]
    if 0 <= pos < cap:
        caches[0][:, pos, :] = y[nq * d:(nq + nkv) * d].reshape(nkv, d)
        caches[1][:, pos, :] = y[(nq + nkv) * d:].reshape(nkv, d)
    return y


ROPE_CASES = [(q, dict(stages=3, rows=4, tile=256, dot="dp4a" if q in DP4A else "fma",
                       ahead=1)) for q in NEW] + [(q, dict(rows=2)) for q in ("Q5_0", "BF16")]


@pytest.mark.parametrize("qtype,knobs", ROPE_CASES, ids=[f"{q}-{'-'.join(map(str, kn.values()))}"
                                                        for q, kn in ROPE_CASES])
def test_gemv_qtype_rope_epilogue(run, qtype, knobs, rng):
    """The stacked QKV GEMV with RoPE and the f16 KV append: y against
    float64, the cache row of ``pos`` against f16(y) (one f16 rounding), the
    other cache rows untouched."""
    from formulas import llama3_inv_freq

    from ptxgen.kernels import rope
    k, cap = 256, 11
    spec = G.GemvPlan.make(qtype, k, epilogue="rope", rope=(16, 3, 1), max_ctas=3, **knobs)
    d, nq, nkv = spec.rope
    m = spec.rope_rows
    ws, deq, x, _ = _data(rng, qtype, m, k, 1)
    rs = rope.RopeSpec(head_dim=d, layout="interleaved", theta=500000.0, scaling="llama3")
    inv = llama3_inv_freq(rs.theta, d, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                          rs.original_context)
    caches = [rng.standard_normal((nkv, cap, d)).astype(np.float16) for _ in range(2)]
    pos = int(rng.integers(1, cap))
    fn = run.function(G.build, spec)
    kc, vc = (run.array(c) for c in caches)
    y = run.poisoned(m)
    run.launch(fn, G.launch_geometry(spec, m),
               dict(w=run.array(ws[0]), x=run.array(x), freqs=run.array(rope.freq_table(rs)),
                    pos_ptr=run.array(np.array([pos], np.int32)), k_cache=kc, v_cache=vc,
                    capacity=cap, y=y, m=m))
    ref_caches = [c.astype(np.float64) for c in caches]
    ref = _rope_ref(deq[0] @ x.astype(np.float64), pos, spec, inv, ref_caches)
    assert rel_err(run.get(y), ref) <= BOUND
    for got, want, before in zip((run.get(kc), run.get(vc)), ref_caches, caches):
        assert rel_err(got[:, pos], want[:, pos]) <= 1e-3
        keep = np.arange(cap) != pos
        assert np.array_equal(got[:, keep].view(np.uint16), before[:, keep].view(np.uint16))


# ---------------------------------------------------------------- selection

#: the Llama-3-8B GEMVs: (M, K, epilogue)
SHAPES_8B = [(4096, 4096, "none"), (4096, 4096, "residual"), (6144, 4096, "rope"),
             (14336, 4096, "swiglu"), (4096, 14336, "residual"), (4096, 14336, "none"),
             (128256, 4096, "none"), (14336, 4096, "none")]


def _default(qtype, m, k, epi, target="sm_90", **kw):
    rope = (128, 32, 8) if epi == "rope" else ()
    return G.default_plan(qtype, k, epi, target=target, m=m, rope=rope, **kw)


@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
@pytest.mark.parametrize("qtype", NEW)
def test_selected_configs_at_8b_shapes(qtype, target):
    """Every 8B shape gets a ring config that builds (16-byte rows, the
    stages in shared memory), with the dp4a dot for the 4- and 5-bit types
    and f32 for F16/BF16, and at most 1024 threads; the bulk copy engine
    only on sm_90."""
    for m, k, epi in SHAPES_8B:
        p = _default(qtype, m, k, epi, target, sm_count=132)
        assert p.stages >= 2 and p.tile == k, (m, k, epi, p)
        assert p.dot == ("dp4a" if qtype in DP4A else "fma"), (m, k, epi, p)
        assert G.threads(p) <= 1024 and p.ring_bytes + p.ring_static_bytes <= G.MAX_RING_BYTES
        assert not (p.bulk and target != "sm_90")
        assert G.build(p).to_ptx().count(".entry") == 1


@pytest.mark.parametrize("qtype", NEW)
def test_selected_configs_at_small_and_odd_shapes(qtype):
    """Small and unaligned K get a config that builds: through the ring
    where rows are 16-byte aligned, tile by tile (f32 dot) where not."""
    blk, bb = G.read_unit(qtype)
    built = set()           # many shapes select the same plan: build each once
    for k in (blk, 2 * blk, 3 * blk, 256, 512, 768, 896, 4864, 18944, 28672):
        if k % blk:
            continue
        for epi in ("none", "residual", "swiglu"):
            for m in (None, 1, 37, 1024, 151936):
                p = G.default_plan(qtype, k, epi, m=m)
                aligned = (k // blk * bb) % 16 == 0
                assert (p.stages >= 2) <= aligned, (k, epi, m, p)
                assert p.dot == "fma" or p.stages
                if p not in built:
                    G.build(p)
                    built.add(p)


def test_ring_needs_whole_16_byte_row_groups_and_dp4a_its_formats():
    with pytest.raises(ValueError, match="whole 16-byte chunks \\(4 rows of 54 bytes"):
        G.GemvPlan.make("Q4_0", 96, stages=2, tile=96)          # 54-byte rows
    with pytest.raises(ValueError, match="whole 16-byte chunks \\(1 rows of 616 bytes"):
        G.GemvPlan.make("Q5_0", 896, stages=2, tile=896, rows=1)     # 616-byte rows
    # two 616-byte rows are 77 chunks: the ring takes them, for an M of whole chunks
    p = G.GemvPlan.make("Q5_0", 896, stages=2, tile=896, rows=2)
    assert G.launch_geometry(p, 6).grid[0] >= 1
    with pytest.raises(ValueError, match="7 rows of 616 bytes"):
        G.launch_geometry(p, 7)
    with pytest.raises(ValueError, match="bulk copies need 16-byte aligned rows"):
        G.GemvPlan.make("Q6_K", 3584, stages=2, tile=3584, rows=8, bulk=True, target="sm_90")
    assert G.GemvPlan.make("Q5_1", 64, stages=2, tile=64).row_bytes == 48
    for q in ("F16", "BF16", "Q8_0"):
        with pytest.raises(ValueError, match=f"dp4a.*not {q}"):
            G.GemvPlan.make(q, 512, stages=2, tile=512, dot="dp4a")
    for q in DP4A:
        with pytest.raises(ValueError, match="dp4a.*without it"):
            G.GemvPlan.make(q, 512, dot="dp4a")
    for q in NEW:
        with pytest.raises(ValueError, match="built for Q4_K"):
            G.GemvPlan.make(q, 512, norm=True)


@pytest.mark.parametrize("qtype,k,match", [("Q4_0", 48, "block size \\(32"),
                                           ("Q5_K", 128, "block size \\(256"),
                                           ("F16", 12, "multiple of 8"),
                                           ("BF16", 0, "multiple of 8"),
                                           ("Q5_1", 64.0, "block size")])
def test_k_not_multiple_refused(qtype, k, match):
    with pytest.raises(ValueError, match=match):
        G.GemvPlan.make(qtype, k)


def test_kernel_names_and_texts_differ_by_type():
    names = {G.GemvPlan.make(q, 512, stages=2, tile=512).kernel_name for q in NEW}
    assert len(names) == len(NEW)
    texts = {G.build(G.GemvPlan.make(q, 512, stages=2, tile=512)).to_ptx() for q in NEW}
    assert len(texts) == len(NEW)


@pytest.mark.parametrize("qtype", NEW)
def test_ptxas_no_spills_at_8b_shapes(ptxas, qtype):
    """The selected kernels of every 8B shape (with PDL, as the model and ops
    launch them on sm_90), and of K = 11008, 18944, 28672, assemble for
    sm_90 without spills."""
    from ptxgen.ptxas import assemble
    # and the row lengths of other Llama and Qwen models
    others = [(4096, k, epi) for k in (11008, 18944, 28672) for epi in ("none", "swiglu")]
    for m, k, epi in SHAPES_8B + others:
        p = _default(qtype, m, k, epi, pdl=True)
        _, reports = assemble(G.build(p).to_ptx(), "sm_90")
        assert len(reports) == 1 and reports[0].spill_stores == 0, (m, k, epi, reports)


# ---------------------------------------------------------------- ops

@pytest.mark.parametrize("qtype", NEW)
def test_ops_gemv_takes_the_new_types(qtype, rng):
    """``ops.gemv`` and ``ops.gemv_swiglu`` on the emulator (numpy in, numpy
    out), the weight shape read through read_unit."""
    from ptxgen.driver import ops
    m, k = 21, 512
    ws, deq, x, r = _data(rng, qtype, m, k, 2)
    y = ops.gemv(ws[0], x, qtype, residual=r, backend="emu")
    assert rel_err(y, _ref("residual", deq, x, r)) <= BOUND
    y = ops.gemv_swiglu(ws[0], ws[1], x, qtype.lower(), backend="emu")
    assert rel_err(y, _ref("swiglu", deq, x, r)) <= BOUND
    # a row two bytes short: a partial block, or an F16/BF16 K that is not a multiple of 8
    bad = "multiple of 8" if qtype in ("F16", "BF16") else "not a whole number"
    with pytest.raises(ValueError, match=bad):
        ops.gemv(np.ascontiguousarray(ws[0][:, :-2]), x, qtype, backend="emu")


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("qtype", NEW)
@pytest.mark.parametrize("m,k,epi", [(1031, 4096, "none"), (1031, 4096, "residual"),
                                     (2053, 4096, "swiglu"), (1031, 14336, "none"),
                                     (1031, 14336, "residual"), (4096, 14336, "none"),
                                     (14339, 4096, "none")])
def test_gemv_qtype_gpu_default(gpu_run, qtype, m, k, epi, rng):
    """The selected configs at the model's K on the GPU (sm_90 defaults:
    the bulk copy engine where chosen)."""
    plan = G.default_plan(qtype, k, epi, m=m, target=gpu_run.target())
    ws, deq, x, r = _data(rng, qtype, m, k, plan.n_mats)
    y = _run_gemv(gpu_run, plan, ws, x, r)
    assert rel_err(y, _ref(epi, deq, x, r)) <= BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", NEW)
def test_gemv_qtype_gpu_rope_model_shape(gpu_run, qtype, rng):
    """The 8B QKV shape (32 query / 8 KV heads of 128, K = 4096), default config."""
    from formulas import llama3_inv_freq

    from ptxgen.kernels import rope
    spec = G.default_plan(qtype, 4096, "rope", m=6144, rope=(128, 32, 8),
                          target=gpu_run.target())
    d, nq, nkv = spec.rope
    m, cap = spec.rope_rows, 300
    ws, deq, x, _ = _data(rng, qtype, m, 4096, 1)
    rs = rope.RopeSpec(head_dim=d, layout="interleaved", theta=500000.0, scaling="llama3")
    inv = llama3_inv_freq(rs.theta, d, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                          rs.original_context)
    caches = [rng.standard_normal((nkv, cap, d)).astype(np.float16) for _ in range(2)]
    pos = int(rng.integers(0, cap))
    fn = gpu_run.function(G.build, spec)
    kc, vc = (gpu_run.array(c) for c in caches)
    y = gpu_run.poisoned(m)
    gpu_run.launch(fn, G.launch_geometry(spec, m),
                   dict(w=gpu_run.array(ws[0]), x=gpu_run.array(x),
                        freqs=gpu_run.array(rope.freq_table(rs)),
                        pos_ptr=gpu_run.array(np.array([pos], np.int32)), k_cache=kc,
                        v_cache=vc, capacity=cap, y=y, m=m))
    ref_caches = [c.astype(np.float64) for c in caches]
    ref = _rope_ref(deq[0] @ x.astype(np.float64), pos, spec, inv, ref_caches)
    assert rel_err(gpu_run.get(y), ref) <= BOUND
    for got, want in zip((gpu_run.get(kc), gpu_run.get(vc)), ref_caches):
        assert rel_err(got[:, pos], want[:, pos]) <= 1e-3
