"""``python -m ptxgen demo``: a tiny synthetic Llama, decoded and checked, then
the text path (tokenizer, sampler, chat template) on a tiny model with a
real vocabulary.

Part one writes a random 2-layer model, decodes it on the backend (CUDA
graphs on a GPU) and compares every step's logits with a float64 numpy
forward pass.  Part two copies a real vocabulary into another random model
(:func:`~ptxgen.llm.gguf.synth.write_synthetic_llama` ``vocab_from``), streams
the text it generates from a prompt, greedily and with a seeded sampler, and
answers one chat turn with the vocabulary's chat template; the weights are
random, so the text is gibberish.  On the emulator the vocabulary is cut to
its first 700 tokens and the special ones, and the model is smaller, so each
step takes about a second.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

from ptxgen.cli import ArgumentParser, HelpFormatter
from ptxgen.llm.cli import get_backend_for_cli, positive as _positive, run_guarded

__all__ = ["demo", "default_vocab", "demo_command"]

_VOCAB_NAME = "ggml-vocab-phi-3.gguf"


def default_vocab() -> str | None:
    """The source tree's ``tests/data/vocab/ggml-vocab-phi-3.gguf``, or None
    (an installed package has no tests)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "tests", "data", "vocab", _VOCAB_NAME)
    return path if os.path.isfile(path) else None


def demo(a, be) -> int:
    """Run both parts on backend ``be``; ``a`` holds the parsed arguments
    (``max_new_tokens``, ``keep``, ``vocab``).  Returns the exit code."""
    d = a.keep or tempfile.mkdtemp(prefix="ptxgen-demo-")
    os.makedirs(d, exist_ok=True)
    try:
        ok = _numerics(a, be, d)
        print()
        _text(a, be, d)
    finally:
        if not a.keep:
            for name in os.listdir(d):
                os.remove(os.path.join(d, name))
            os.rmdir(d)
    return 0 if ok else 1


def _numerics(a, be, d) -> bool:
    from ptxgen.llm.gguf.synth import write_synthetic_llama
    from ptxgen.llm import Model
    from ptxgen.testing.reference import LlamaReference

    n_new = a.max_new_tokens or (24 if be.name == "cuda" else 4)
    path = os.path.join(d, "tiny-llama.gguf")
    info = write_synthetic_llama(path, n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                                 vocab=512, context_length=256, seed=1234)
    print(f"wrote {path} ({info.n_bytes / 1e6:.2f} MB, 2 layers, hidden 256, 4/2 heads, vocab 512)")
    print(f"backend: {be.name}" + ("" if be.name == "cuda" else " (no GPU: CPU emulator)"))
    model = Model.from_gguf(path, backend=be, capacity=64, progress=False)
    print(model.summary())
    prompt = [1, 7, 42]
    res, logits = model.generate(prompt, n_new, mode="graph", return_logits=True)
    ref = LlamaReference(path, kv_dtype=np.float16)
    worst = 0.0
    seq = prompt + res.tokens
    for i, got in enumerate(logits):
        want = ref.step(seq[i])
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        worst = max(worst, err)
    print("prompt:", prompt)
    print("generated:", res.tokens)
    print(f"logits vs float64 numpy reference: worst relative error {worst:.2e} over "
          f"{len(logits)} steps (bound 1e-4)")
    print(f"{res.tokens_per_second:.1f} tokens/s, {res.launches_per_token} launches per token "
          f"({res.mode})")
    return worst <= 1e-4


def _text(a, be, d) -> None:
    from ptxgen.llm.gguf.synth import write_synthetic_llama
    from ptxgen.llm import Model

    vocab = a.vocab or default_vocab()
    if vocab is None:
        print(f"text path: skipped (no vocabulary: pass --vocab FILE.gguf, e.g. llama.cpp's "
              f"models/{_VOCAB_NAME})")
        return
    gpu = be.name == "cuda"
    n_new = a.max_new_tokens or (24 if gpu else 4)
    shape = (dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, qtype="Q4_K",
                  output_qtype="Q6_K") if gpu else
             dict(n_layers=1, hidden=128, ffn=256, n_heads=2, n_kv_heads=1, qtype="Q8_0",
                  output_qtype="Q8_0"))
    path = os.path.join(d, "tiny-llama-vocab.gguf")
    info = write_synthetic_llama(path, context_length=256, seed=4321, vocab_from=vocab,
                                 vocab_limit=None if gpu else 700, **shape)
    model = Model.from_gguf(path, backend=be, capacity=128, progress=False)
    tok = model.tokenizer
    print(f"text path: {os.path.basename(vocab)}'s vocabulary ({tok.n_vocab} tokens, "
          f"{tok.model} tokenizer{'' if gpu else ', cut down for the emulator'}) in a random "
          f"{shape['n_layers']}-layer model ({info.n_bytes / 1e6:.2f} MB): the text is gibberish")
    prompt = "Once upon a time"
    for label, kw in (("greedy", {}),
                      ("sampled (temp 0.8, top-k 40, top-p 0.95, min-p 0.05, seed 7)",
                       dict(temperature=0.8, seed=7))):
        print(f"{label}: {prompt}", end="", flush=True)
        stream = model.stream(prompt, max_new_tokens=n_new, **kw)
        for piece in stream:
            print(piece, end="", flush=True)
        r = stream.result
        print(f"\n    {r.stats()}")
    if tok.chat_template:
        chat = model.chat_session(max_new_tokens=n_new)
        question = "What is a GPU?"
        r = chat.send(question)
        print(f"chat: user: {question!r} -> assistant: {r.text!r}")
        print(f"    {r.prompt_tokens} prompt tokens through the chat template; {r.stats()}")
    sys.stdout.flush()


def demo_command(argv) -> int:
    """Build the kernels, check a tiny model against a float64 reference, generate text."""
    p = ArgumentParser(prog="python -m ptxgen demo", formatter_class=HelpFormatter,
                                description="decode a tiny synthetic Llama, check it against a "
                                            "float64 reference, then generate text with a real "
                                            "vocabulary")
    p.add_argument("--backend", choices=("auto", "cuda", "emu"), default="auto",
                   help="the GPU, the CPU emulator, or the GPU when there is one")
    p.add_argument("-n", "--max-new-tokens", type=_positive, default=None,
                   help="tokens to generate (default: 24 on a GPU, 4 on the emulator)")
    p.add_argument("--keep", metavar="DIR", default=None, help="keep the generated GGUFs in DIR")
    p.add_argument("--vocab", metavar="FILE.gguf", default=None,
                   help="the vocabulary of the text part (default: the source tree's "
                        "tests/data/vocab/ggml-vocab-phi-3.gguf, when present)")
    a = p.parse_args(argv)
    return run_guarded(lambda: demo(a, get_backend_for_cli(a.backend)))
