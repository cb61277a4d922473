"""End-to-end decode of a tiny synthetic Llama GGUF against a float64 numpy
forward pass (same weights through gguf's dequantizer, f16 KV cache)."""

import numpy as np
import pytest

pytest.importorskip("gguf")

from backends import cuda_available
from ptxgen.llm.gguf.synth import write_synthetic_llama
from ptxgen.llm.model import ContextOverflowError, Model
from decode_check import check_logits as _check_logits

TINY = dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
            context_length=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_synthetic_llama(str(p), seed=module_seed, **TINY)
    return str(p)


def _rope_kinds(m, fuse):
    kind, other = ("MulMatRopeKv", "RopeKvAppend") if fuse else ("RopeKvAppend", "MulMatRopeKv")
    kinds = [op.kind for op in m.graph.ops]
    assert kinds.count(kind) == TINY["n_layers"] and other not in kinds


def test_emulator_decode_matches_reference(tiny, rng):
    """The default graph, whose stacked QKV GEMV rotates q and k and appends
    k and v to the cache (one MulMatRopeKv op, no RopeKvAppend launch),
    matches the reference."""
    m = Model.from_gguf(tiny, backend="emu", capacity=8, progress=False)
    _rope_kinds(m, fuse=True)
    prompt = [int(t) for t in rng.integers(0, 512, 3)]
    res, logits = m.generate(prompt, 2, return_logits=True)
    assert len(logits) == 4 and len(res.tokens) == 2
    _check_logits(m, tiny, prompt, res, logits)


def test_rope_in_the_qkv_gemv_or_its_own_launch(tiny, rng):
    """fuse_rope=False keeps the separate RoPE + append launch and matches
    the reference (the default, fused, graph: the test above)."""
    prompt = [int(t) for t in rng.integers(0, 512, 3)]
    m = Model.from_gguf(tiny, backend="emu", capacity=8, progress=False, fuse_rope=False)
    _rope_kinds(m, fuse=False)
    res, logits = m.generate(prompt, 2, return_logits=True)
    _check_logits(m, tiny, prompt, res, logits)


def test_ring_gemvs_spread_evenly_over_the_sms(tiny):
    """Each ring GEMV of the graph asks for the shared memory that holds at
    most ceil(grid / SMs) of its CTAs on an SM (where its ring alone would
    allow more), and the attention split takes the tuned config of an
    early_kv split (two blocks an SM, the L1 bypass at every length)."""
    from ptxgen.kernels import gemv as G
    m = Model.from_gguf(tiny, backend="emu", capacity=8, progress=False, sm_count=60)
    rings = [L for op in m.graph.ops for L in op.launches
             if L.family == "gemv" and L.spec.stages]
    assert rings
    capped = 0
    for L in rings:
        want = -(-L.geometry.grid[0] // 60)
        if L.spec.per_sm:
            capped += 1
            assert L.spec.per_sm == want and L.geometry.shared == L.spec.dynamic_shared > L.spec.ring_bytes
        else:
            assert L.geometry.shared == L.spec.ring_bytes
    assert capped
    split = next(L for op in m.graph.ops for L in op.launches if L.kernel.endswith("_split"))
    want = dict(mma=True, warps=8, unroll=1, per_sm=2, interleave=2, l2_prefetch=True,
                l1_bypass=True, bypass_from=0, early_kv=True)
    assert {k: getattr(split.spec, k) for k in want} == want
    assert split.geometry.shared == split.spec.dynamic_shared > 0


def test_fused_norm_and_gemv_knobs_shape_the_graph(tiny):
    """fuse_norm=True folds the layers' RMSNorms into their Q4_K GEMVs (the
    Q6_K output's stays a launch; the fused kernels' numerics are checked in
    tests/kernels/test_gemv.py); the default folds the attention norm only;
    gemv_knobs replace config fields of the Q4_K GEMVs; one a shape cannot
    take is refused with the shape named."""
    m = Model.from_gguf(tiny, backend="emu", capacity=4, progress=False, fuse_norm=True,
                             gemv_knobs={"max_ctas": 7})
    kinds = [op.kind for op in m.graph.ops]
    assert kinds.count("RmsNorm") == 1 and m.graph.ops[kinds.index("RmsNorm")].name == "output_norm"
    gemvs = [L.spec for op in m.graph.ops for L in op.launches if L.family == "gemv"]
    q4k = [s for s in gemvs if s.qtype == "Q4_K"]
    assert q4k and all(s.max_ctas == 7 for s in q4k)
    with pytest.raises(ValueError, match="gemv_knobs .* blk.0"):
        Model.from_gguf(tiny, backend="emu", capacity=4, progress=False,
                             gemv_knobs={"rows": 3})
    assert sum(s.norm for s in q4k) == 2 * TINY["n_layers"]
    # the default folds the attention norm only: the FFN and output norms launch
    default = Model.from_gguf(tiny, backend="emu", capacity=4, progress=False)
    assert default.fuse_norm == ("attn",)
    norms = [op.name for op in default.graph.ops if op.kind == "RmsNorm"]
    assert norms == [f"blk.{i}.ffn_norm" for i in range(TINY["n_layers"])] + ["output_norm"]
    normed = [op.kind for op in default.graph.ops for L in op.launches
              if L.family == "gemv" and L.spec.norm]
    assert normed == ["MulMatRopeKv"] * TINY["n_layers"]
    plain = Model.from_gguf(tiny, backend="emu", capacity=4, progress=False,
                                 fuse_norm=False)
    assert [op.kind for op in plain.graph.ops].count("RmsNorm") == 2 * TINY["n_layers"] + 1
    out_only = Model.from_gguf(tiny, backend="emu", capacity=4, progress=False,
                                    fuse_norm="output")
    # the output is Q6_K here: its norm cannot fold, so every norm launches
    assert out_only.fuse_norm == ("output",)
    assert [op.kind for op in out_only.graph.ops].count("RmsNorm") == 2 * TINY["n_layers"] + 1
    with pytest.raises(ValueError, match="fuse_norm: unknown RMSNorm 'attention'"):
        Model.from_gguf(tiny, backend="emu", capacity=4, progress=False,
                             fuse_norm=["attention"])


def test_benchmark_ablation_drops_only_the_named_ops(tiny):
    """bench_model's ablation (timing what an op kind costs) builds the graph
    without those ops' launches, keeps everything else, and restores
    ComputeGraph.add afterwards even when the build fails."""
    from benchmarks import bench_model
    from ptxgen.driver.executor import ComputeGraph
    add = ComputeGraph.add
    full = Model.from_gguf(tiny, backend="emu", capacity=4, progress=False)
    with bench_model._without({"RmsNorm", "Attention"}):
        cut = Model.from_gguf(tiny, backend="emu", capacity=4, progress=False)
    assert ComputeGraph.add is add
    per_kind = {}
    for op in full.graph.ops:
        per_kind[op.kind] = per_kind.get(op.kind, 0) + len(op.launches)
    assert cut.graph.launch_count == (full.graph.launch_count - per_kind["RmsNorm"]
                                      - per_kind["Attention"])
    assert [op.kind for op in cut.graph.ops] == [op.kind for op in full.graph.ops]
    from ptxgen.llm.gguf.file import GGUFError
    with pytest.raises(GGUFError):
        with bench_model._without({"RmsNorm"}):
            Model.from_gguf(__file__, backend="emu", progress=False)
    assert ComputeGraph.add is add


def test_mixed_types_use_unfused_paths(tmp_path, seed):
    """attn_v in Q6_K (as Q4_K_M files have it) and ffn_up in Q8_0: Q and K
    are then one GEMV with the attention norm folded in, which also stores
    the normed row for V's GEMV, and gate/up two GEMVs plus a SwiGLU
    launch; results still match."""
    path = str(tmp_path / "mixed.gguf")
    write_synthetic_llama(path, seed=seed, **dict(TINY, n_layers=1),
                          type_overrides={"blk.0.attn_v.weight": "Q6_K",
                                          "blk.0.ffn_up.weight": "Q8_0"})
    m = Model.from_gguf(path, backend="emu", capacity=4, progress=False)
    kinds = [op.kind for op in m.graph.ops]
    assert kinds.count("MulMat") == 2 + 2 + 1 + 1 + 1 and "SwiGLU" in kinds
    assert "RopeKvAppend" in kinds and "MulMatRopeKv" not in kinds
    qk = next(op for op in m.graph.ops if op.name == "blk.0.attn_qk")
    assert qk.launches[0].spec.norm_out
    # Q8_0 GEMVs take no fused norm: the FFN's and the output's run as RmsNorm ops
    assert kinds.count("RmsNorm") == 2
    res, logits = m.generate([5, 6], 1, return_logits=True)
    _check_logits(m, path, [5, 6], res, logits)


def test_context_overflow_refused(tiny):
    m = Model.from_gguf(tiny, backend="emu", capacity=4, progress=False)
    with pytest.raises(ContextOverflowError, match="need 6 positions; the KV cache holds 4"):
        m.generate([1, 2], 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.generate([512], 1)


gpu = pytest.mark.skipif(not cuda_available(), reason="no NVIDIA GPU / driver available")


@pytest.mark.gpu
@gpu
def test_gpu_decode_32_steps_matches_reference(tiny, rng):
    m = Model.from_gguf(tiny, backend="cuda", capacity=64, progress=False)
    prompt = [int(t) for t in rng.integers(0, 512, 3)]
    res, logits = m.generate(prompt, 30, mode="graph", return_logits=True)
    assert len(logits) == 32
    _check_logits(m, tiny, prompt, res, logits)


@pytest.mark.gpu
@gpu
def test_gpu_graph_replay_equals_eager_bit_for_bit(tiny):
    m = Model.from_gguf(tiny, backend="cuda", capacity=80, progress=False)
    prompt = [3, 14, 15]
    # 64 steps: the 3 prompt tokens and 61 of the 62 generated ones each give logits
    r1, l1 = m.generate(prompt, 62, mode="eager", return_logits=True)
    r2, l2 = m.generate(prompt, 62, mode="graph", return_logits=True)
    assert r1.tokens == r2.tokens and len(l1) == len(l2) == 64
    for a, b in zip(l1, l2):
        assert a.tobytes() == b.tobytes()
    assert r2.mode == "graph" and r1.mode == "eager"


@pytest.mark.gpu
@gpu
def test_gpu_errors_leave_context_usable(tiny, tmp_path):
    from ptxgen.llm.gguf.file import GGUFError
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(open(tiny, "rb").read()[:100_000])
    with pytest.raises(GGUFError, match="truncated"):
        Model.from_gguf(str(bad), backend="cuda", progress=False)
    m = Model.from_gguf(tiny, backend="cuda", capacity=8, progress=False)
    with pytest.raises(ContextOverflowError):
        m.generate([1, 2, 3], 10)
    res = m.generate([1, 2, 3], 4)   # the same model still decodes afterwards
    assert len(res.tokens) == 4


@pytest.mark.gpu
@gpu
def test_gpu_pdl_graph_equals_plain_eager_bit_for_bit(tiny):
    """Programmatic dependent launch changes when kernels start, not what they
    compute: a PDL graph replay gives the logits of plain serial launches."""
    from ptxgen.driver import get_device
    if get_device().compute_capability < (9, 0):
        pytest.skip("PDL needs sm_90")
    prompt = [7, 1, 8]
    plain = Model.from_gguf(tiny, backend="cuda", capacity=40, progress=False, pdl=False)
    fast = Model.from_gguf(tiny, backend="cuda", capacity=40, progress=False, pdl=True)
    assert not plain.pdl and fast.pdl
    r1, l1 = plain.generate(prompt, 30, mode="eager", return_logits=True)
    r2, l2 = fast.generate(prompt, 30, mode="graph", return_logits=True)
    assert r1.tokens == r2.tokens
    for a, b in zip(l1, l2):
        assert a.tobytes() == b.tobytes()


def test_model_flash_config_where_the_tensor_cores_do_not_take_the_shape(tmp_path, seed):
    """16 query heads of 128 per KV head: the tensor-core split does not
    take the group, so the CUDA-core split's config is used (4 warps; 8
    warps' partials would overflow the split's 48 KB of static shared
    memory), and fields a caller gives are kept."""
    path = str(tmp_path / "g16.gguf")
    write_synthetic_llama(path, seed=seed, **dict(TINY, n_layers=1, hidden=2048, n_heads=16, n_kv_heads=1))
    for knobs in (None, {"unroll": 2}):
        m = Model.from_gguf(path, backend="emu", capacity=4, progress=False,
                                 flash_knobs=knobs)
        split = next(L.spec for op in m.graph.ops for L in op.launches
                     if L.kernel.endswith("_split"))
        assert split.group == 16 and not split.mma and split.warps == 4
        assert split.per_sm == 0 and split.unroll == (knobs or {}).get("unroll", 3)
