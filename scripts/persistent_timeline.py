#!/usr/bin/env python3
"""Where the persistent decode kernel's step goes, node by node, from its
``%globaltimer`` stamps (issue 57), beside the graph path's step.

    python3 scripts/persistent_timeline.py MODEL.gguf [--steps 16] [--json OUT.json]

Decodes ``--steps`` greedy tokens with the graph path, with the persistent
kernel, then with the persistent kernel built with the timeline, and prints
the last step's nodes: instructions, summed wait and work (µs over all
CTAs), span (first record taken to last instruction done) and the share of
the step the node's span covers; then the step's length, the CTAs' busy
share (work over grid x step) and the tokens/s of each run (the stamps cost
the timeline's run some).
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--backend", default="cuda", help="cuda, or emu (a tiny file, a smoke test)")
    a = ap.parse_args(argv)
    import numpy as np

    from ptxgen.llm.model import Model
    from ptxgen.llm.persistent import timeline_summary
    kw = dict(sm_count=8) if a.backend == "emu" else {}
    m = Model.from_gguf(a.model, backend=a.backend, capacity=512, progress=False, **kw)
    prompt = [1, 2, 3, 4]
    m.decode_path = "graph"   # the graph path's run, whatever the tuning table says
    ref = m.generate(prompt, a.steps, mode="graph")
    plain = m.generate(prompt, a.steps, mode="persistent")
    p = m.persistent_step(timeline=True)
    got = m.generate(prompt, a.steps, mode="persistent")
    st = p.timeline().astype(np.int64)
    step_us = float(st[:, 2].max() - st[:, 0].min()) / 1e3
    rows = timeline_summary(p.tape, st)
    print(f"{'node':>4} {'kind':14} {'kernel':52} {'instr':>5} {'wait us':>9} {'work us':>9} "
          f"{'span us':>8} {'share':>6}")
    out = []
    for node, n, wait, work, span in rows:
        print(f"{node.index:4d} {node.kind:14} {node.kernel[:52]:52} {n:5d} {wait:9.1f} "
              f"{work:9.1f} {span:8.1f} {span / max(step_us, 1e-9):6.1%}")
        out.append(dict(node=node.index, op=node.op, kind=node.kind, kernel=node.kernel,
                        instructions=n, wait_us=wait, work_us=work, span_us=span))
    work = sum(r[3] for r in rows)
    busy = work / (p.grid * max(step_us, 1e-9))
    same = plain.tokens == ref.tokens == got.tokens
    print(f"step {step_us:.1f} us on {p.grid} CTAs of {p.kernel.threads} threads; busy share "
          f"{busy:.1%}; graph {ref.tokens_per_second:.1f} tokens/s, persistent "
          f"{plain.tokens_per_second:.1f} tokens/s ({got.tokens_per_second:.1f} with the "
          f"timeline); same tokens: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model=a.model, step_us=step_us, grid=p.grid, threads=p.kernel.threads,
                           busy=busy, persistent_tps=plain.tokens_per_second,
                           persistent_timeline_tps=got.tokens_per_second,
                           graph_tps=ref.tokens_per_second, same_tokens=same, nodes=out),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
