"""Gemma 3 (``gemma3``) end to end on the emulator: a tiny synthetic file
with sliding-window (local) and global layers, decoded and prefilled,
against the float64 reference (testing/reference.py, llama.cpp's graph)."""

import attrs
import numpy as np
import pytest

pytest.importorskip("gguf")

from backends import cuda_available
from decode_check import check_logits
from ptxgen.llm.gguf.synth import write_synthetic_llama
from ptxgen.llm.model import Model
from ptxgen.testing.reference import LlamaReference

#: layers 0 and 1 local (a period of 3: il % 3 < 2), layer 2 global; a window
#: of 3 keys, so a 7-token sequence reaches past it
TINY = dict(arch="gemma3", n_layers=3, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
            head_dim=64, vocab=768, context_length=256, sliding_window=3, swa_pattern=3,
            rope_theta=1e6, rope_theta_swa=1e4, tie_embeddings=True, tokenizer="gemma3")
WINDOWS = (3, 3, 0)
#: the weight types: all Q4_K (q/k/v stacked with the attention norm folded
#: in, gate and up in one GeGLU GEMV), llama.cpp's Q4_K_M mix (attn_v and
#: ffn_down in Q6_K: three Q/K/V GEMVs), and gate and up of two types (two
#: GEMVs and a GeGLU launch)
TYPES = {"q4_k": dict(qtype="Q4_K"), "q4_k_m": dict(mix="Q4_K_M"),
         "split": dict(qtype="Q4_K", type_overrides={f"blk.{i}.ffn_up.weight": "Q8_0"
                                                     for i in range(3)})}


@pytest.fixture(scope="module", params=sorted(TYPES))
def tiny(request, tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("model") / f"gemma3_{request.param}.gguf"
    write_synthetic_llama(str(p), seed=module_seed, **TINY, **TYPES[request.param])
    return request.param, str(p)


@pytest.fixture(scope="module")
def tiny_q4_k(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("model") / "gemma3.gguf"
    write_synthetic_llama(str(p), seed=module_seed, **TINY, **TYPES["q4_k"])
    return str(p)


def _launches(graph, family):
    return [L for op in graph.ops for L in op.launches if L.family == family]


def test_decode_matches_reference(tiny, rng):
    """Greedy decode past the window: the logits within the decode path's
    bound of the float64 reference at every step, the tokens its argmax;
    the graph has the scaled embedding, a windowed attention kernel on the
    local layers only, the GeGLU and the post-norms added into the stream."""
    kind, path = tiny
    m = Model.from_gguf(path, backend="emu", capacity=8, progress=False)
    emb, = _launches(m.graph, "embedding")
    assert emb.spec.scaled and emb.args["scale"] == pytest.approx(16.0)   # sqrt(256)
    splits = [L for L in _launches(m.graph, "flash_decode") if "part_ml" in L.args
              and "q" in L.args]
    assert tuple(L.spec.window for L in splits) == WINDOWS
    assert all(L.args["sm_scale"] == pytest.approx(1 / 8) for L in splits)
    acc = [L for L in _launches(m.graph, "rmsnorm") if L.spec.accumulate]
    assert len(acc) == 2 * TINY["n_layers"]
    gated = [L.spec for L in _launches(m.graph, "gemv") if L.spec.epilogue in ("swiglu", "geglu")]
    acts = [L.spec.act for L in _launches(m.graph, "swiglu")]
    if kind == "split":
        assert not gated and acts == ["gelu_tanh"] * 3
    else:
        assert [s.epilogue for s in gated] == ["geglu"] * 3 and not acts
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 3)]
    res, logits = m.generate(prompt, 4, return_logits=True)
    assert len(logits) == 6
    check_logits(m, path, prompt, res, logits)


def test_the_window_and_local_rope_change_the_logits(tiny_q4_k, rng):
    """The reference without the windows (or with every layer at the global
    RoPE base) is far from the model past the window: the check above can fail."""
    path = tiny_q4_k
    m = Model.from_gguf(path, backend="emu", capacity=8, progress=False)
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 6)]
    res, logits = m.generate(prompt, 1, return_logits=True)
    seq = prompt + res.tokens
    for change in (dict(windows=(0, 0, 0)), dict(rope_theta_swa=1e6)):
        ref = LlamaReference(path, kv_dtype=np.float16)
        ref.hparams = attrs.evolve(ref.hparams, **change)
        want = [ref.step(t) for t in seq[:len(logits)]]
        err = np.linalg.norm(logits[-1] - want[-1]) / np.linalg.norm(want[-1])
        assert err > 1e-2, (change, err)


def test_prefill_matches_reference(tiny, rng):
    """A 9-token prompt in chunks of 4 (the chunk attention's window on the
    local layers), then 2 tokens decoded: the logits within 1e-2 of the
    float64 reference (f16 GEMM inputs), the tokens its argmax but for
    near ties."""
    _, path = tiny
    m = Model.from_gguf(path, backend="emu", capacity=16, progress=False)
    pre = m.prefill(4)
    for b in pre.buckets:
        att = _launches(pre.graph(b), "flash_prefill")
        assert tuple(L.spec.window for L in att) == WINDOWS
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 9)]
    _prefill_matches_reference(m, path, prompt, 2, chunk=4, mode="eager")


def _prefill_matches_reference(m, path, prompt, new, *, chunk, mode):
    """``prompt`` prefilled in chunks of ``chunk``, then ``new`` tokens: each
    step's logits within 1e-2 of the float64 reference (f16 GEMM inputs),
    the tokens its argmax up to the first near tie."""
    res, logits = m.generate(prompt, new, mode=mode, return_logits=True, prefill_chunk=chunk)
    ref = LlamaReference(path, kv_dtype=np.float16)
    seq = prompt + res.tokens
    want = [ref.step(t) for t in seq[:-1]][len(prompt) - 1:]
    assert len(want) == len(logits) == new
    for j, (got, lr) in enumerate(zip(logits, want)):
        err = float(np.linalg.norm(got - lr) / np.linalg.norm(lr))
        assert err <= 1e-2, (j, err)
        best = int(np.argmax(lr))
        if res.tokens[j] != best:
            tie = 2e-2 * float(np.sqrt(np.mean(lr * lr)))
            assert lr[best] - lr[res.tokens[j]] <= tie, (j, res.tokens[j], best)
            break


gpu = pytest.mark.skipif(not cuda_available(), reason="no NVIDIA GPU / driver available")


@pytest.mark.gpu
@gpu
def test_gpu_decode_matches_reference(tiny, rng):
    """32 steps on the GPU (graph replay; 28 of them past the window)."""
    _, path = tiny
    m = Model.from_gguf(path, backend="cuda", capacity=64, progress=False)
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 3)]
    res, logits = m.generate(prompt, 30, mode="graph", return_logits=True)
    assert len(logits) == 32
    check_logits(m, path, prompt, res, logits)


@pytest.mark.gpu
@gpu
def test_gpu_prefill_matches_reference(tiny, rng):
    """A 40-token prompt in chunks of 16 on the GPU (captured chunk graphs,
    the windowed chunk attention), then 4 tokens: as on the emulator."""
    _, path = tiny
    m = Model.from_gguf(path, backend="cuda", capacity=64, progress=False)
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 40)]
    _prefill_matches_reference(m, path, prompt, 4, chunk=16, mode="graph")


def test_chat_template_and_its_tokens():
    """The file's Gemma 3 chat template (tests/data/vocab's gemma3
    vocabulary): the system message before the first user turn, the
    assistant's turns as "model", one BOS; the turn markers are the control
    tokens 105/106 (the same text inside a message stays text), and
    <end_of_turn> ends generation."""
    import os
    from ptxgen.llm.text.chat_template import encode_chat
    from ptxgen.llm.text.tokenizer import Tokenizer
    t = Tokenizer.from_gguf(os.path.join(os.path.dirname(__file__), "..", "data", "vocab",
                                         "ggml-vocab-gemma3.gguf"))
    msgs = [dict(role="system", content="You are terse."), dict(role="user", content="Hi "),
            dict(role="assistant", content="Hello."),
            dict(role="user", content="say <end_of_turn>")]
    assert t.apply_chat_template(msgs) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
        "Hello.<end_of_turn>\n<start_of_turn>user\nsay <end_of_turn><end_of_turn>\n"
        "<start_of_turn>model\n")
    ids = encode_chat(t, msgs)
    assert ids[0] == 2 and ids.count(2) == 1
    assert ids.count(105) == 4 and ids.count(106) == 3      # the one in the message is text
    opening = [105] + t.encode("model\n", add_special=False)
    assert ids[-len(opening):] == opening
    assert t.is_eog(106) and t.is_eog(1)
