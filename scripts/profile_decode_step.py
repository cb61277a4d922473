#!/usr/bin/env python3
"""Where a single-sequence decode step's time goes, per kernel.

    python3 scripts/profile_decode_step.py MODEL.gguf [--ctx 128] [--top 16]

Times the greedy step as graph replays (CUDA events, the median of 3 runs
of 20 steps at context ``ctx``), then runs eager steps under torch's CUPTI
profiler and prints the kernels' summed time per step, by kernel name
(launches a step, µs a step, share of the kernels' sum).  The gap between
the graph step and the kernels' sum is what the launches between them
cost.  Needs torch for the profile (the GPU machine has it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_model_step import _set_context, _step_seconds  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--top", type=int, default=16)
    a = ap.parse_args(argv)
    from ptxgen.llm import Model
    model = Model.from_gguf(a.model, backend="cuda", progress=False)
    step = statistics.median(_step_seconds(model, a.ctx, 20) for _ in range(3))
    print(f"{Path(a.model).name}: graph step {step * 1e6:.1f} us ({1 / step:.1f} tokens/s) "
          f"at context {a.ctx}")
    import torch
    from torch.profiler import ProfilerActivity, profile
    reps = 3
    _set_context(model, a.ctx)
    model.step("eager")
    model.backend.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            _set_context(model, a.ctx)
            model.step("eager")
        model.backend.synchronize()
    agg = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in ev.name:
            agg[ev.name][0] += ev.device_time_total / reps
            agg[ev.name][1] += 1
    tot = sum(v[0] for v in agg.values())
    n = sum(v[1] for v in agg.values()) // reps
    print(f"kernels: {n} launches, {tot:.1f} us a step (graph step - kernels = "
          f"{step * 1e6 - tot:.1f} us)")
    for name, (us, cnt) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"  {us:8.1f} us {cnt // reps:4d}x {us / (cnt // reps or 1):7.2f} us each "
              f"{100 * us / tot:5.1f}%  {name[:80]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
