"""Decode a few tokens of a tiny synthetic Llama with the persistent decode
kernel (llm/persistent.py), for compute-sanitizer: the one launch a token
whose CTAs hand activations to each other through global memory, ordered by
the tape's counters.  The tokens must be the graph path's (on the emulator,
the eager launches'), the logits theirs within 1e-6 relative (the same
kernels' arithmetic), and every counter must end at its node's count times
the steps taken.

``compute-sanitizer --tool memcheck python3 tests/llm/sanitize_persistent.py``
(and ``--tool racecheck``); prints OK when every step finished and every
check held.  The model's weights and prompt come from a fresh seed, printed
first; ``--seed N`` reuses one.  ``--backend emu`` is a dry run on the CPU
emulator: one layer and one step (its global race check watches the
hand-offs), about a minute.
"""

import argparse
import os
import secrets
import tempfile

import numpy as np

from ptxgen.llm.gguf.synth import write_synthetic_llama
from ptxgen.llm.model import Model

#: the GPU's model: two layers, so the second layer's nodes wait on the first's
TINY = dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
            context_length=256)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None, help="weights and prompt seed "
                                                           "(default: a fresh one)")
    ap.add_argument("--backend", choices=("cuda", "emu"), default="cuda")
    ap.add_argument("--tokens", type=int, default=None,
                    help="new tokens after a 4-token prompt (default 8; the emulator: one step)")
    ap.add_argument("--grid", type=int, default=None,
                    help="persistent CTAs (default: the GPU's SMs; the emulator: 8)")
    args = ap.parse_args(argv)
    seed = secrets.randbits(32) if args.seed is None else args.seed
    print(f"seed={seed}", flush=True)
    rng = np.random.default_rng(seed)
    emu = args.backend == "emu"
    shape = dict(TINY, n_layers=1) if emu else TINY
    with tempfile.TemporaryDirectory(prefix="sanitize_persistent_") as d:
        path = os.path.join(d, "tiny.gguf")
        write_synthetic_llama(path, seed=seed, **shape)
        kw = dict(sm_count=8) if emu else {}
        m = Model.from_gguf(path, backend=args.backend, capacity=64, progress=False, **kw)
        prompt = [int(t) for t in rng.integers(0, shape["vocab"], 1 if emu else 4)]
        n = args.tokens if args.tokens is not None else (1 if emu else 8)
        grid = args.grid or (8 if emu else None)
        p = m.persistent_step(grid=grid)
        got, logits = m.generate(prompt, n, return_logits=True, mode="persistent")
        counts = m.backend.to_numpy(p._counters)
        m.decode_path = "graph"   # the comparison's graph steps, whatever the tuning table says
        want, want_logits = m.generate(prompt, n, return_logits=True,
                                       mode="eager" if emu else "graph")
    print(f"steps {len(logits)} on {p.grid} CTAs of {p.kernel.threads} threads, "
          f"{len(p.tape.instructions)} instructions a step; tokens {got.tokens}", flush=True)
    if got.tokens != want.tokens:
        raise SystemExit(f"persistent tokens {got.tokens} != the {want.mode} path's {want.tokens}")
    worst = max(float(np.linalg.norm(a - b) / np.linalg.norm(b))
                for a, b in zip(logits, want_logits))
    print(f"logits against the {want.mode} path: max relative error {worst:.2e}", flush=True)
    if not worst <= 1e-6:
        raise SystemExit(f"logits {worst:.2e} apart from the {want.mode} path's (bound 1e-6)")
    expect = [p.epoch * node.count for node in p.tape.nodes]
    if list(counts) != expect:
        raise SystemExit(f"counters {list(counts)} after {p.epoch} steps, expected {expect}")
    print("OK")


if __name__ == "__main__":
    main()
