"""Chunked prefill against the token-by-token decode path on a tiny synthetic
Llama (emulator): the last prompt position's logits and the greedy
continuation."""

import numpy as np
import pytest

pytest.importorskip("gguf")

from ptxgen.llm.gguf.synth import write_synthetic_llama
from ptxgen.llm import Model

TINY = dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
            context_length=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_synthetic_llama(str(p), seed=module_seed, **TINY)
    return str(p)


@pytest.fixture(scope="module")
def model(tiny):
    """One emulator model for the module (loading compiles every kernel);
    each run starts from :func:`_fresh`."""
    return Model.from_gguf(tiny, backend="emu", capacity=16, progress=False)


def _fresh(m):
    """NaN in every KV cache row and no prefill state, so a run can only
    read what it wrote itself."""
    for pair in m.kv_caches:
        for c in pair:
            m.executor.write(c, np.full(c.shape, np.nan, np.float16))
    return m


def _run(m, prompt, new, chunk):
    _fresh(m)
    return m.generate(prompt, new, mode="eager", return_logits=True, prefill_chunk=chunk)


def same_continuation(got, got_logits, ref, ref_logits, n_prompt):
    """Check that the chunked prefill's greedy continuation is the
    token-by-token one: at every step the logits agree within 1e-2 (relative
    norm), and the tokens are equal up to the first step where they differ
    by a near tie only: the reference's two candidates within twice the
    per-logit deviation that bound allows (2e-2 rms of the logits; a random
    synthetic model's logits are flat, so such ties occur).  Returns the
    number of steps that agree."""
    for j, (a, b) in enumerate(zip(got.tokens, ref.tokens)):
        lg, lr = got_logits[j], ref_logits[n_prompt - 1 + j]
        err = float(np.linalg.norm(lg - lr) / np.linalg.norm(lr))
        assert err <= 1e-2, (j, err)
        if a != b:
            gap = float(lr[b] - lr[a])
            tie = 2e-2 * float(np.sqrt(np.mean(lr * lr)))
            assert gap <= tie, f"step {j}: prefill chose {a}, token by token {b}, gap {gap} > {tie}"
            return j
    return len(ref.tokens)


#: weight types of the parametrized file: llama.cpp's Q4_K_M mix (Q6_K for
#: attn_v, ffn_down and the output, so q, k and v differ in type), Q8_0, and
#: Q4_0 / Q5_0 / Q5_K / F16 / BF16 (GEMMs on the sm_90a warpgroup kernel
#: only: the emulator's)
MIXED = {"q4_k_m": dict(mix="Q4_K_M"), "q8_0": dict(qtype="Q8_0", output_qtype="Q8_0"),
         "q4_0": dict(qtype="Q4_0", output_qtype="Q4_0"),
         "q5_0": dict(qtype="Q5_0", output_qtype="Q5_0"),
         "q5_k": dict(qtype="Q5_K", output_qtype="Q5_K"),
         "f16": dict(qtype="F16", output_qtype="F16"),
         "bf16": dict(qtype="BF16", output_qtype="BF16"),
         # q/k/v biases (added by the GEMM's bias epilogue; split by type under the mix)
         "qwen2": dict(arch="qwen2"), "qwen2_q4_k_m": dict(arch="qwen2", mix="Q4_K_M"),
         # per-head q/k norms (the grouped RMSNorm over every token's heads)
         "qwen3": dict(arch="qwen3", head_dim=64)}
#: one layer (its attn_v and ffn_down are Q6_K under Q4_K_M) keeps the emulator quick
TYPED = dict(TINY, n_layers=1)


@pytest.fixture(scope="module", params=sorted(MIXED))
def typed_model(request, tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("model") / f"tiny_{request.param}.gguf"
    write_synthetic_llama(str(p), seed=module_seed, **TYPED, **MIXED[request.param])
    return Model.from_gguf(str(p), backend="emu", capacity=16, progress=False)


def test_prefill_matches_token_by_token(model, rng):
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 7)]
    new = 4
    (ref, ref_logits) = _run(model, prompt, new, 0)
    (got, got_logits) = _run(model, prompt, new, 4)      # two chunks: 4 + 2 tokens
    same_continuation(got, got_logits, ref, ref_logits, len(prompt))
    assert got.prompt_tokens_per_second > 0


def test_prefill_matches_token_by_token_types(typed_model, rng):
    """The same for a Q4_K_M-mix file, Q8_0, Q4_0, Q5_0, Q5_K, F16 and BF16
    files, and Qwen2 (biases) and Qwen3 (q/k norms) files: every projection
    runs on the GEMM (no GEMV per token)."""
    from ptxgen.llm.prefill import gemm_ready
    m = typed_model
    assert gemm_ready(m.file, m.target)
    types = {m.file.tensor(f"blk.0.{n}.weight").qtype for n in ("attn_q", "attn_v", "ffn_down")}
    assert types in ({"Q4_K", "Q6_K"}, {"Q4_K"}, {"Q8_0"}, {"Q4_0"}, {"Q5_0"}, {"Q5_K"},
                     {"F16"}, {"BF16"}), types
    launches = [L for b in m.prefill(4).buckets for op in m.prefill(4).graph(b).ops
                for L in op.launches]
    assert not any(L.family == "gemv" for L in launches)
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 6)]
    (ref, ref_logits) = _run(m, prompt, 2, 0)
    (got, got_logits) = _run(m, prompt, 2, 4)      # two chunks: 4 + 1 tokens
    same_continuation(got, got_logits, ref, ref_logits, len(prompt))


def test_bf16_weight_past_f16_keeps_its_matrix_on_the_gemv(tmp_path, rng):
    """The GEMM rounds BF16 weights to f16: a matrix holding one weight past
    f16's range (here 2^16) is read by the GEMV instead; the others keep
    the GEMM."""
    import gguf as _gguf
    from ptxgen.llm.gguf.file import LlamaFile
    from ptxgen.llm.lowering.matmul import has_gemm
    p = tmp_path / "bf16.gguf"
    write_synthetic_llama(str(p), seed=int(rng.integers(1 << 30)), **TYPED, **MIXED["bf16"])
    name = "blk.0.ffn_up.weight"
    t = next(t for t in _gguf.GGUFReader(str(p)).tensors if t.name == name)
    with open(p, "r+b") as f:               # the 17th weight of row 0 := 2^16 (bf16 0x4780)
        f.seek(int(t.data_offset) + 2 * 16)
        f.write(np.array([0x4780], np.uint16).tobytes())
    lf = LlamaFile(str(p))
    assert not lf.in_f16_range(name) and lf.in_f16_range("blk.0.ffn_gate.weight")
    assert not has_gemm(lf, name, "sm_90") and has_gemm(lf, "blk.0.ffn_gate.weight", "sm_90")
    assert not has_gemm(lf, "blk.0.ffn_gate.weight", "sm_80")
    with open(p, "r+b") as f:               # 65280, bf16's largest under 65504: fits
        f.seek(int(t.data_offset) + 2 * 16)
        f.write(np.array([0x477F], np.uint16).tobytes())
    assert LlamaFile(str(p)).in_f16_range(name)


def test_chunks_agree(model, rng):
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 6)]
    (a, la) = _run(model, prompt, 2, 2)
    (b, lb) = _run(model, prompt, 2, 8)
    err = float(np.linalg.norm(la[0] - lb[0]) / np.linalg.norm(lb[0]))
    assert err <= 1e-3, err
    assert a.tokens == b.tokens


def test_buckets_agree(model, rng):
    """Five prompt tokens as one chunk in a bucket of 8 (launches sized past
    the chunk, tiles past T exiting) against chunks of 4 and 1 in buckets of
    4 and 2: the same logits and continuation."""
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 6)]
    m = _fresh(model)
    pre = m.prefill(8, buckets=())
    a, la = m.generate(prompt, 2, mode="eager", return_logits=True, prefill_chunk=pre)
    assert set(pre._executors) == {8}
    _fresh(m)
    pre = m.prefill(4, buckets=(2, 4, 16))
    assert pre.buckets == (2, 4)
    b, lb = m.generate(prompt, 2, mode="eager", return_logits=True, prefill_chunk=pre)
    assert set(pre._executors) == {2, 4}
    err = float(np.linalg.norm(la[0] - lb[0]) / np.linalg.norm(lb[0]))
    assert err <= 1e-3, err
    assert a.tokens == b.tokens
    # the emulator decodes the prompt token by token unless told otherwise
    assert m.default_prefill_chunk() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("types", ["q4_k", "q4_k_m", "q8_0", "q4_0", "q5_0", "q5_k", "f16",
                                   "bf16", "qwen2", "qwen2_q4_k_m", "qwen3"])
def test_prefill_graph_gpu(tmp_path, rng, types):
    """On the GPU: graph replays (buckets 64 and 128 of a 128 chunk) agree with
    eager launches and with the token-by-token prompt (Q4_K, Q4_K_M mix,
    Q8_0, Q4_0, Q5_0, Q5_K, F16, BF16: the last five need sm_90a's warpgroup kernel,
    else they prefill with a GEMV a row; Qwen2's biases and Qwen3's q/k norms)."""
    from ptxgen import driver
    if not driver.is_available():
        pytest.skip("no NVIDIA GPU / driver available")
    p = tmp_path / "small.gguf"
    write_synthetic_llama(str(p), seed=int(rng.integers(1 << 30)), n_layers=2, hidden=512,
                          ffn=1024, n_heads=8, n_kv_heads=2, vocab=1024, context_length=512,
                          **MIXED.get(types, {}))
    prompt = [int(t) for t in rng.integers(0, 1024, 180)]       # chunks of 128 and 51
    m = Model.from_gguf(str(p), backend="cuda", capacity=256, progress=False)
    assert m.default_prefill_chunk() == 512
    ref, lr = m.generate(prompt, 8, return_logits=True, prefill_chunk=0)
    for mode in ("eager", "graph"):
        got, lg = m.generate(prompt, 8, mode=mode, return_logits=True, prefill_chunk=128)
        same_continuation(got, lg, ref, lr, len(prompt))
    assert set(m.prefill(128)._executors) == {64, 128}
