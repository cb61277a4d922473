"""What the persistent kernel's scheduling costs a decode step, beside the
launches it replaces (GPU).

``python -m benchmarks.bench_megakernel MODEL.gguf [...] [--json OUT.json]``

For each file, the decode step's tape (:mod:`ptxgen.llm.tape`) cut for the
device's SMs is run by the persistent kernel (:mod:`ptxgen.kernels.
megakernel`, a CTA an SM) with every instruction a no-op: the step's time
is then its waits and counters alone (each node's instructions hand off to
the next node's through a release and an acquire).  Beside it, a CUDA graph
of the step's launches with an empty kernel each (the same grids and
blocks, programmatic dependent launch off): what the graph path pays for
its launches before any work.  Both are replayed ``--steps`` times back to
back; the counters are checked at the end.

With ``--decode``, each file is also decoded by the graph path and by the
persistent kernel running the step's own kernels (:mod:`ptxgen.llm.
persistent`) in the same call: whether they choose the same greedy tokens,
how far apart their logits are, and each path's tokens/s with its share of
the read floor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import ptxgen
from ptxgen.kernels import megakernel as mk


def _empty_kernel(target):
    m = ptxgen.Module(target)
    with m.kernel("empty"):
        pass
    return m


def _time(fn, steps, be, stream):
    fn()
    be.synchronize(stream)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    be.synchronize(stream)
    return (time.perf_counter() - t0) / steps


def measure(path, be, steps=200, threads=128):
    """``{file, nodes, instructions, persistent_us, graph_us, ...}`` for ``path``."""
    from ptxgen.llm.tape import decode_tape
    tape = decode_tape(path, sm_count=be.sm_count, target=be.target)
    spec = mk.MegakernelSpec(ops=("noop",), threads=threads, target=be.target)
    fn = be.load(mk.build(spec))[spec.kernel_name]
    records = be.from_numpy(tape.records(lambda n: "noop"))
    table = be.from_numpy(np.zeros((len(tape.nodes), mk.NODE_ARGS), np.uint64))
    counters = be.from_numpy(np.zeros(tape.n_counters, np.uint32))
    stream = be.stream()
    epoch = [0]

    def persistent():
        epoch[0] += 1
        be.launch_positional(fn, be.sm_count, threads, records, len(tape.instructions), table,
                             counters, epoch[0], stream=stream)
    t_p = _time(persistent, steps, be, stream)
    got = be.to_numpy(counters)
    want = np.array([epoch[0] * n.count for n in tape.nodes], np.uint32)
    if not np.array_equal(got, want):
        raise AssertionError(f"{path}: counters {got[:8]} ... after {epoch[0]} steps, "
                             f"want {want[:8]} ...")
    empty = be.load(_empty_kernel(be.target))["empty"]

    def issue():
        for n in tape.nodes:
            be.launch_positional(empty, n.grid, n.threads, stream=stream)
    graph = be.capture(stream, issue)
    t_g = _time(lambda: be.replay(graph, stream), steps, be, stream)
    return dict(file=path, nodes=len(tape.nodes), instructions=len(tape.instructions),
                sm_count=be.sm_count, persistent_us=t_p * 1e6,
                persistent_us_per_node=t_p * 1e6 / len(tape.nodes), graph_us=t_g * 1e6,
                graph_us_per_launch=t_g * 1e6 / len(tape.nodes))


def decode_ab(path, steps=128, check_steps=16, seed=0):
    """The graph path and the persistent kernel on ``path`` in one call:
    the same greedy tokens and logits over ``check_steps`` steps, then each
    path's decode tokens/s over ``steps`` (median step) and its share of
    the read floor (the step's bytes over the copy bandwidth)."""
    from ptxgen.llm.model import Model

    from .bench_model import _copy_bandwidth, _step_bytes
    m = Model.from_gguf(path, backend="cuda", progress=False, capacity=512)
    prompt = [int(t) for t in np.random.default_rng(seed).integers(0, m.hp.vocab, 4)]
    t0 = time.perf_counter()
    m.persistent_step()
    build_s = time.perf_counter() - t0
    rg, lg = m.generate(prompt, check_steps, return_logits=True, mode="graph")
    rp, lp = m.generate(prompt, check_steps, return_logits=True, mode="persistent")
    worst = max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(lp, lg))
    bw = _copy_bandwidth()
    floor = bw / _step_bytes(m, len(prompt) + steps // 2)
    out = dict(file=path, same_tokens=rg.tokens == rp.tokens, logits_rel_l2=worst,
               persistent_build_s=build_s, floor_tokens_per_s=floor)
    for mode in ("graph", "persistent"):
        r = m.generate(prompt, steps, mode=mode)
        out[f"{mode}_tokens_per_s"] = r.tokens_per_second
        out[f"{mode}_share_of_floor"] = r.tokens_per_second / floor
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_megakernel",
                                description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="GGUF files")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--decode", action="store_true",
                   help="also decode with the graph and the persistent kernel: same tokens, "
                        "tokens/s of each")
    a = p.parse_args(argv)
    from ptxgen.driver.backend import get_backend
    be = get_backend("cuda")
    rows = []
    for path in a.models:
        r = measure(path, be, a.steps)
        rows.append(r)
        print(f"{path}: tape of {r['nodes']} nodes, {r['instructions']} instructions on "
              f"{r['sm_count']} SMs; persistent no-op step {r['persistent_us']:.1f} us "
              f"({r['persistent_us_per_node']:.2f} us a node); graph of {r['nodes']} empty "
              f"launches {r['graph_us']:.1f} us ({r['graph_us_per_launch']:.2f} us a launch)")
    if a.decode:
        for path in a.models:
            r = decode_ab(path)
            rows.append(r)
            print(f"{path}: same tokens {r['same_tokens']}, logits within "
                  f"{r['logits_rel_l2']:.1e} (relative L2); decode tokens/s graph "
                  f"{r['graph_tokens_per_s']:.0f} ({100 * r['graph_share_of_floor']:.0f}% of the "
                  f"read floor {r['floor_tokens_per_s']:.0f}), persistent "
                  f"{r['persistent_tokens_per_s']:.0f} "
                  f"({100 * r['persistent_share_of_floor']:.0f}%); persistent kernel built and "
                  f"loaded in {r['persistent_build_s']:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
