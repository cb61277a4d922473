"""``python -m ptxgen run`` and ``python -m ptxgen demo``.

``run MODEL.gguf --tokens 1,2,3 -n 64 [--eager] [--backend auto|cuda|emu]``
    greedy decode; prints the tokens, tokens/s and launches per token.
``demo [--backend ...] [-n N] [--keep DIR]``
    writes a tiny synthetic Llama GGUF, decodes it on the GPU (or the CPU
    emulator when there is none) and checks every step's logits against a
    float64 numpy forward pass.

Both are registered under the ``ptxgen.commands`` entry point, so the DSL
package itself never imports the driver.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

__all__ = ["run_command", "demo_command"]


def _tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes comma-separated integers, got {text!r}")


def run_command(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m ptxgen run",
                                description="greedy decode of a Llama GGUF model")
    p.add_argument("model", help="a llama-architecture .gguf file")
    p.add_argument("--tokens", type=_tokens, default=[1], help="prompt token ids, e.g. 1,2,3")
    p.add_argument("-n", "--max-new-tokens", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="one launch per op, no CUDA graph")
    p.add_argument("--backend", choices=("auto", "cuda", "emu"), default="auto")
    p.add_argument("--capacity", type=int, default=None, help="KV cache length")
    p.add_argument("--summary", action="store_true", help="print the decode graph summary")
    a = p.parse_args(argv)
    from .model.gguf_loader import GGUFError
    from .model.llama import ContextOverflowError, LlamaModel
    try:
        model = LlamaModel.from_gguf(a.model, backend=a.backend, capacity=a.capacity)
        if a.summary:
            print(model.summary())
        res = model.generate(a.tokens, a.max_new_tokens, mode="eager" if a.eager else "graph")
    except (GGUFError, ContextOverflowError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("tokens:", ",".join(map(str, res.tokens)))
    print(f"prompt: {len(a.tokens)} tokens, {res.prompt_tokens_per_second:.1f} tokens/s "
          f"({res.prompt_seconds:.3f} s)")
    print(f"{res.tokens_per_second:.1f} tokens/s ({res.mode}, {res.launches_per_token} "
          f"launches per token, backend {model.backend.name})")
    return 0


def demo_command(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m ptxgen demo",
                                description="decode a tiny synthetic Llama and check it")
    p.add_argument("--backend", choices=("auto", "cuda", "emu"), default="auto")
    p.add_argument("-n", "--max-new-tokens", type=int, default=None)
    p.add_argument("--keep", metavar="DIR", help="keep the generated GGUF in DIR")
    a = p.parse_args(argv)
    from .backend import get_backend
    from .model.gguf_synth import write_synthetic_llama
    from .model.llama import LlamaModel
    from .model.llama_ref import LlamaReference

    be = get_backend(a.backend)
    n_new = a.max_new_tokens or (24 if be.name == "cuda" else 4)
    d = a.keep or tempfile.mkdtemp(prefix="ptxgen-demo-")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "tiny-llama.gguf")
    info = write_synthetic_llama(path, n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                                 vocab=512, context_length=256, seed=1234)
    print(f"wrote {path} ({info.n_bytes / 1e6:.2f} MB, 2 layers, hidden 256, 4/2 heads, vocab 512)")
    print(f"backend: {be.name}" + ("" if be.name == "cuda" else " (no GPU found: CPU emulator)"))
    model = LlamaModel.from_gguf(path, backend=be, capacity=64, progress=False)
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
    if not a.keep:
        os.remove(path)
    return 0 if worst <= 1e-4 else 1
