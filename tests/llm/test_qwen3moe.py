"""qwen3moe (a mixture of experts in every layer) on the emulator against
the float64 reference: the decode step (router, the selected experts'
GEMVs, their weighted sum: the experts chosen on the device inside one
graph) and the chunked prefill against the token-by-token path (the
batched engine's: tests/llm/test_batch_runner.py and
tests/llm/engine/test_engine_families.py).

The file is the tiny-moe preset (2 layers, 8 experts, 2 used) in the
Q4_K_M mix llama.cpp writes for MoE files (F32 router, Q4_K gate/up
experts, ffn_down_exps Q6_K in llama.cpp's use_more_bits layers).  Bounds:
:func:`decode_check.check_logits`'s (logits 1e-4 relative per step, cached
K/V within an f16 ulp, greedy tokens the argmax) and test_prefill's
``same_continuation``.
"""

import copy

import numpy as np
import pytest

pytest.importorskip("gguf")

from decode_check import check_logits, tie_free_prompt
from ptxgen.llm import Model
from ptxgen.llm.gguf.synth import PRESETS, write_synthetic_llama
from ptxgen.testing.reference import LlamaReference

TINY = {**PRESETS["tiny-moe"], "vocab": 512, "context_length": 256}
#: the prefill tests ask at least the first greedy token to agree: their
#: prompts' first token leads by twice same_continuation's near-tie bound
LEAD = 4e-2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    p = str(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf")
    info = write_synthetic_llama(p, seed=module_seed, mix="Q4_K_M", **TINY)
    types = {n: t for n, t, _ in info.tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.ffn_up_exps.weight"] == "Q4_K"
    assert {types[f"blk.{i}.ffn_down_exps.weight"] for i in (0, 1)} == {"Q4_K", "Q6_K"}
    return p


@pytest.fixture(scope="module")
def model(tiny):
    return Model.from_gguf(tiny, backend="emu", capacity=16, progress=False)


def test_decode_matches_reference(model, tiny, rng):
    """Greedy decode: every step's logits within the reference's bound, and
    the router chose more than one set of experts over the steps (so the
    ids the kernels read did change inside the one graph)."""
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 3)]
    res, logits = model.generate(prompt, 3, mode="eager", return_logits=True,
                                 prefill_chunk=0)
    check_logits(model, tiny, prompt, res, logits)
    ref = LlamaReference(tiny)
    chosen = set()
    for t in prompt + res.tokens[:-1]:
        ref.step(t)
        chosen.add(tuple(tuple(sorted(ids)) for ids in ref.last_experts))
    assert len(chosen) > 1
    kinds = [op.kind for op in model.graph.ops if op.name.startswith("blk.0.")]
    # the FFN's RMSNorm is in the router's launch and the weighted sum in
    # the down GEMV's (ExpertGemvSpec.combine)
    assert kinds[-3:] == ["MoeRouter", "MoeMulMatSwiGLU", "MoeMulMatSum"]
    assert not [op for op in model.graph.ops if op.name == "blk.0.ffn_norm"]


def test_prefill_matches_token_by_token(model, tiny, rng):
    """A 7-token prompt in chunks of 4 (so a partial chunk: rows past T
    exit) against the token-by-token path; the prompt routes clear of a
    near tie (``decode_check.route_margin``: a chunk's router reads f16
    rows, the token-by-token one f32)."""
    from test_prefill import _run, same_continuation
    prompt = tie_free_prompt(rng, tiny, 7, TINY["vocab"], 3, lead=LEAD)
    ref, ref_logits = _run(model, prompt, 3, 0)
    got, got_logits = _run(model, prompt, 3, 4)          # two chunks: 4 + 3 tokens
    assert same_continuation(got, got_logits, ref, ref_logits, len(prompt)) >= 1


@pytest.mark.parametrize("x_ahead,router_tokens", [(False, 1), (True, 4)])
def test_prefill_grouped_gemm_matches_token_by_token(tiny, rng, monkeypatch, x_ahead,
                                                     router_tokens):
    """The chunk path of the experts' grouped GEMM (the pairs grouped by
    expert on the device, then gate, up with SwiGLU and down as GEMMs) on
    chunks of 4 (the table gives it from 64 rows: here the config the table
    gives 64 rows, on the mma.sync kernel, with the GEMMs' ``x_ahead`` and
    ``packed`` grid and the router's tokens a CTA set as the case says),
    against the token-by-token path."""
    from test_prefill import _run, same_continuation
    from ptxgen.llm.lowering import moe
    real, real_specs, paths, specs = moe.chunk_path, moe._gemm_specs, [], []
    real_geo, routers = moe.router.launch_geometry, []

    def at_64_rows(lw, e, rows):
        cfg = real(lw, e, 64)
        paths.append(cfg["path"])
        return {**cfg, "router_tokens": router_tokens, "kernel": "mma",
                **{key: {**cfg[key], "x_ahead": x_ahead, "packed": x_ahead}
                   for key in ("gate_up", "down")}}

    def recorded(*a, **kw):
        specs.extend(real_specs(*a, **kw))
        return specs[-3:]

    def router_geometry(spec, *a):
        routers.append(spec.tokens)
        return real_geo(spec, *a)
    monkeypatch.setattr(moe, "chunk_path", at_64_rows)
    monkeypatch.setattr(moe, "_gemm_specs", recorded)
    monkeypatch.setattr(moe.router, "launch_geometry", router_geometry)
    m = Model.from_gguf(tiny, backend="emu", capacity=16, progress=False)
    prompt = tie_free_prompt(rng, tiny, 7, TINY["vocab"], 3, lead=LEAD)
    ref, ref_logits = _run(m, prompt, 3, 0)
    got, got_logits = _run(m, prompt, 3, 4)              # two chunks: 4 + 3 tokens
    assert paths and set(paths) == {"gemm"}, paths
    assert specs and {s.x_ahead for s in specs} == {x_ahead}, specs
    assert {s.n_expert for s in specs} == {TINY["n_expert"] if x_ahead else 0}, specs
    assert router_tokens in routers, routers
    assert same_continuation(got, got_logits, ref, ref_logits, len(prompt)) >= 1


def test_prefill_experts_wgmma_matches_token_by_token(tiny, rng, monkeypatch):
    """A table rule asking for the warpgroup kernel from 64 rows (none does
    until a GPU measures it: here one is added), on the emulator's sm_90
    (GEMMs built for sm_90a): the chunk's rows permuted into the experts'
    order and the experts' warpgroup GEMMs (gate, up with SwiGLU into f16,
    down into each pair's row), on chunks of 4, against the token-by-token
    path; and a target without sm_90a GEMMs keeps the mma.sync kernel."""
    from test_prefill import _run, same_continuation
    from ptxgen.llm.lowering import moe
    real, real_specs, cfgs, specs = moe.chunk_path, moe._wgmma_specs, [], []
    cascade = moe._tuning.cascade
    tile = {"bm": 128, "bn": 16, "stages": 4}

    def with_wgmma_rule(family, call):
        cfg = cascade(family, call)
        if family == "moe_ffn" and call["rows"] >= 64 and call["target"] == "sm_90":
            cfg = {**cfg, "kernel": "wgmma", "wgmma_gate_up": tile, "wgmma_down": tile}
        return cfg
    monkeypatch.setattr(moe._tuning, "cascade", with_wgmma_rule)

    def at_64_rows(lw, e, rows):
        cfgs.append(real(lw, e, 64))
        other = copy.copy(lw)
        other.target = "sm_80"
        assert real(other, e, 64)["kernel"] == "mma"
        return cfgs[-1]

    def recorded(*a, **kw):
        specs.extend(real_specs(*a, **kw))
        return specs[-4:]
    monkeypatch.setattr(moe, "chunk_path", at_64_rows)
    monkeypatch.setattr(moe, "_wgmma_specs", recorded)
    m = Model.from_gguf(tiny, backend="emu", capacity=16, progress=False)
    prompt = tie_free_prompt(rng, tiny, 7, TINY["vocab"], 3, lead=LEAD)
    ref, ref_logits = _run(m, prompt, 3, 0)
    got, got_logits = _run(m, prompt, 3, 4)              # two chunks: 4 + 3 tokens
    assert cfgs and {(c["path"], c["kernel"]) for c in cfgs} == {("gemm", "wgmma")}, cfgs
    outs = [s.out for s in specs if hasattr(s, "out")]
    assert outs and set(outs) == {"sorted", "swiglu", "pairs"}, specs
    # both layers' down types (Q4_K and Q6_K) on the warpgroup kernel
    assert {s.plan.qtype for s in specs if getattr(s, "out", "") == "pairs"} == {"Q4_K", "Q6_K"}
    assert same_continuation(got, got_logits, ref, ref_logits, len(prompt)) >= 1


@pytest.mark.gpu
def test_gpu_decode_and_prefill(tmp_path, rng, seed):
    """On the GPU: the decode step replayed from its CUDA graph against the
    float64 reference (the experts chosen on the device each step), and
    prefill chunks (graph replays, buckets 64 and 128) against the
    token-by-token prompt, on a 4-layer file of 16 experts, 4 used."""
    from ptxgen import driver
    if not driver.is_available():
        pytest.skip("no NVIDIA GPU / driver available")
    p = str(tmp_path / "moe.gguf")
    write_synthetic_llama(p, seed=seed, mix="Q4_K_M", **{**TINY, "n_layers": 4,
                                                         "n_expert": 16, "n_expert_used": 4})
    m = Model.from_gguf(p, backend="cuda", capacity=256, progress=False)
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 4)]
    res, logits = m.generate(prompt, 4, mode="graph", return_logits=True, prefill_chunk=0)
    check_logits(m, p, prompt, res, logits)
    from test_prefill import same_continuation
    long = [int(t) for t in rng.integers(0, TINY["vocab"], 180)]   # chunks of 128 and 52
    ref, lr = m.generate(long, 6, return_logits=True, prefill_chunk=0)
    for mode in ("eager", "graph"):
        got, lg = m.generate(long, 6, mode=mode, return_logits=True, prefill_chunk=128)
        same_continuation(got, lg, ref, lr, len(long))


def test_tune_times_the_experts_plans(model, tiny):
    """`ptxgen tune` times the GEMVs the decode step runs: for the experts,
    one expert's gate/up (swiglu) and down matrices, as their plans are."""
    from ptxgen.llm.tune import gemv_calls
    calls = gemv_calls(tiny)
    specs = {op.kind: L.spec for op in model.graph.ops if op.name.startswith("blk.0.")
             for L in op.launches}
    hp = model.hp
    gate, down = specs["MoeMulMatSwiGLU"].plan, specs["MoeMulMatSum"].plan
    assert (gate.qtype, hp.expert_ffn, hp.hidden, "swiglu") in calls
    assert (down.qtype, hp.hidden, hp.expert_ffn, "none") in calls
    assert (gate.k, down.k) == (hp.hidden, hp.expert_ffn)
