"""Chunked prefill against the token-by-token decode path on a tiny synthetic
Llama (emulator): the last prompt position's logits and the greedy
continuation."""

import numpy as np
import pytest

pytest.importorskip("gguf")

from ptxgen.driver.model.gguf_synth import write_synthetic_llama
from ptxgen.driver.model.llama import LlamaModel

TINY = dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
            context_length=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_synthetic_llama(str(p), seed=module_seed, **TINY)
    return str(p)


def _run(path, prompt, new, chunk):
    m = LlamaModel.from_gguf(path, backend="emu", capacity=len(prompt) + new, progress=False)
    return m.generate(prompt, new, mode="eager", return_logits=True, prefill_chunk=chunk)


def test_prefill_matches_token_by_token(tiny, rng):
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 7)]
    new = 4
    (ref, ref_logits) = _run(tiny, prompt, new, 0)
    (got, got_logits) = _run(tiny, prompt, new, 4)      # two chunks: 4 + 2 tokens
    want = ref_logits[len(prompt) - 1]
    err = float(np.linalg.norm(got_logits[0] - want) / np.linalg.norm(want))
    assert err <= 1e-2, err
    assert got.tokens == ref.tokens
    assert got.prompt_tokens_per_second > 0


def test_chunks_agree(tiny, rng):
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 6)]
    (a, la) = _run(tiny, prompt, 2, 2)
    (b, lb) = _run(tiny, prompt, 2, 8)
    err = float(np.linalg.norm(la[0] - lb[0]) / np.linalg.norm(lb[0]))
    assert err <= 1e-3, err
    assert a.tokens == b.tokens
