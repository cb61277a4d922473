#!/usr/bin/env python3
"""Chunked prefill against the token-by-token prompt on one model (GPU):
the logits of the last prompt position and of each of the next greedy
steps, and how many greedy tokens agree.

    python scripts/prefill_vs_decode.py MODEL.gguf [--prompt 512] [--new 32] [--seed S]

A random prompt of ``--prompt`` ids is run twice: through the chunked
prefill (chunks of 512, graphs) and token by token through the decode step;
then ``--new`` greedy tokens each.  Prints per step the relative error of
the logits (``|a - b| / |b|``) and, where the tokens first differ, the
token-by-token logits' gap between the two choices against the near-tie
margin ``2e-2 rms(logits)`` (tests/llm/test_prefill.py's criterion).
Exit status 0 when every compared step is within 1e-2 and the first
difference, if any, is a near tie.
"""

import argparse
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args(argv)
    from ptxgen.llm import Model
    seed = a.seed if a.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    m = Model.from_gguf(a.model, backend="cuda", capacity=a.prompt + a.new + 8, progress=False)
    prompt = [int(t) for t in rng.integers(0, m.hp.vocab, a.prompt)]
    ref, lr = m.generate(prompt, a.new, return_logits=True, prefill_chunk=0)
    got, lg = m.generate(prompt, a.new, return_logits=True, prefill_chunk=512)
    print(f"seed {seed}; prompt {a.prompt} tokens; prefill {got.prompt_seconds:.3f} s, "
          f"token by token {ref.prompt_seconds:.3f} s")
    ok, agree = True, a.new
    for j in range(a.new):
        x, y = lg[j], lr[a.prompt - 1 + j]
        err = float(np.linalg.norm(x - y) / np.linalg.norm(y))
        line = f"step {j:2d}: logits rel err {err:.2e}"
        ok &= err <= 1e-2
        if got.tokens[j] != ref.tokens[j]:
            gap = float(y[ref.tokens[j]] - y[got.tokens[j]])
            tie = 2e-2 * float(np.sqrt(np.mean(y * y)))
            print(f"{line}; tokens differ ({got.tokens[j]} vs {ref.tokens[j]}): gap {gap:.4f}, "
                  f"near-tie margin {tie:.4f}")
            ok &= gap <= tie
            agree = j
            break
        print(f"{line}; token {got.tokens[j]}")
    print(f"{agree}/{a.new} greedy tokens agree: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
