"""The engine (``Engine.generate`` on the real runner) for the families
whose batched form differs most from a dense Llama: Qwen3-MoE (each row's
experts chosen on the device) and Gemma 3 (sliding-window layers over the
paged cache, their own RoPE base, the post-norms and GeGLU).  Each sequence
of a batch gets, greedily, the tokens the single-sequence ``Model``
gives it alone, up to a near tie (the batch's GEMMs and the single
sequence's GEMVs round differently, and a random model's logits are flat:
test_prefill's ``same_continuation`` bound)."""

import gc

import numpy as np
import pytest

pytest.importorskip("gguf")

from backends import cuda_available
from ptxgen.llm import Model
from ptxgen.llm.engine import Engine, RequestSettings
from ptxgen.llm.gguf.synth import PRESETS, write_synthetic_llama

#: tiny files of each family (vocab 512): the tiny-moe preset in the Q4_K_M
#: mix of MoE files; Gemma 3 with two local layers (window 3) and a global one
FILES = {
    "qwen3moe": {**PRESETS["tiny-moe"], "vocab": 512, "context_length": 256,
                 "mix": "Q4_K_M"},
    "gemma3": dict(arch="gemma3", n_layers=3, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                   head_dim=64, vocab=512, context_length=256, sliding_window=3,
                   swa_pattern=3, rope_theta=1e6, rope_theta_swa=1e4, tie_embeddings=True,
                   qtype="Q4_K"),
}


@pytest.fixture(scope="module", params=sorted(FILES))
def family_path(request, tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("engine_family") / f"{request.param}.gguf"
    write_synthetic_llama(str(p), seed=module_seed, **FILES[request.param])
    return str(p)


def _alone(path, backend, prompts, n):
    cap = max(64, max(len(p) for p in prompts) + n)
    model = Model.from_gguf(path, backend=backend, capacity=cap, progress=False,
                            tokenizer=False)
    out = [model.generate(p, n, return_logits=True) for p in prompts]
    del model
    gc.collect()
    return out


def _same_up_to_a_near_tie(got, res, logits, n_prompt):
    """``got`` (the engine's tokens) equal ``res.tokens`` up to the first step
    where they differ, and there by a near tie of the single sequence's
    logits only (within test_prefill's 2e-2 rms of them)."""
    for j, (a, b) in enumerate(zip(got, res.tokens)):
        if a != b:
            lr = np.asarray(logits[n_prompt - 1 + j], np.float64)
            gap = float(lr[b] - lr[a])
            tie = 2e-2 * float(np.sqrt(np.mean(lr * lr)))
            assert gap <= tie, f"step {j}: engine chose {a}, alone {b}, gap {gap} > {tie}"
            return
    assert len(got) == len(res.tokens)


def _check_batch(path, backend, prompts, n, **engine_kw):
    alone = _alone(path, backend, prompts, n)
    with Engine.from_gguf(path, backend=backend, progress=False, **engine_kw) as eng:
        outs = eng.generate(prompts, RequestSettings(max_tokens=n, ignore_eos=True))
        assert eng.stats().blocks_used == 0
    for p, (res, logits), o in zip(prompts, alone, outs):
        assert o.finish_reason == "length"
        _same_up_to_a_near_tie(list(o.token_ids), res, logits, len(p))


def test_each_sequence_gets_its_tokens_alone(family_path, rng):
    """Two prompts (2 and 19 tokens: past the window and a 16-token block)
    in one engine batch, 2 greedy tokens each."""
    prompts = [[int(t) for t in rng.integers(0, 512, n)] for n in (2, 19)]
    _check_batch(family_path, "emu", prompts, 2, max_seqs=2, ctx_size=64, chunk=16)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no NVIDIA GPU / driver available")
@pytest.mark.parametrize("arch", sorted(FILES))
def test_gpu_each_sequence_gets_its_tokens_alone(arch, tmp_path, seed, rng):
    """On the GPU (captured graphs): 6 requests of 5..50 tokens, 8 greedy
    tokens each, in buckets of up to 4 rows (so requests wait and join) and
    prompt chunks of 8 (few graphs to capture)."""
    path = str(tmp_path / f"{arch}.gguf")
    write_synthetic_llama(path, seed=seed, **FILES[arch])
    prompts = [[int(t) for t in rng.integers(0, 512, 5 + 9 * i)] for i in range(6)]
    _check_batch(path, "cuda", prompts, 8, max_seqs=4, ctx_size=96, chunk=8)
