"""Time the batched engine's decode step per batch size and kernel.

    python scripts/profile_batch_step.py MODEL.gguf [--batches 1,8,32,64,128] [--ctx 200]

Builds a BatchRunner, feeds each bucket a step of B rows at position
``ctx`` (distinct block tables), and prints the step's wall time (graph
replay; eager launches beside it) greedy and sampled (temperature 0.8,
top-k 40, top-p 0.95, min-p 0.05), then where the time of a greedy B-row
step goes per kernel (torch's CUPTI profiler over eager launches and over
graph replays), when torch is importable.  ``--pdl on|off`` builds every
graph with or without programmatic dependent launch.
"""

import argparse
import time
from collections import defaultdict

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--profile", default="8,64")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--pdl", choices=("table", "on", "off"), default="table",
                    help="programmatic dependent launch: as the runner decides, or forced")
    a = ap.parse_args()
    from ptxgen.driver.backend import get_backend
    from ptxgen.llm.engine.runner import BatchRunner, DecodeRow
    from ptxgen.llm.generation import SamplingSettings
    from ptxgen.llm.gguf.file import LlamaFile
    be = get_backend(a.backend)
    f = LlamaFile(a.model)
    batches = [int(x) for x in a.batches.split(",")]
    t0 = time.perf_counter()
    pdl = None if a.pdl == "table" else a.pdl == "on"
    r = BatchRunner(f, be, max_batch=max(batches), chunk=512, ctx_size=1024, pdl=pdl)
    print(f"runner built in {time.perf_counter() - t0:.1f} s; pool {r.num_blocks} blocks of "
          f"{r.block_size}", flush=True)
    per = -(-(a.ctx + 1) // r.block_size)
    greedy = SamplingSettings(temperature=0.0)
    default = SamplingSettings(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)

    def rows(b, s):
        return [DecodeRow(token=5 + i, position=a.ctx,
                          block_table=tuple(range(i * per, (i + 1) * per)), sampling=s, seed=i)
                for i in range(b)]

    for b in batches:
        for name, s in (("greedy", greedy), ("sampled", default)):
            rr = rows(b, s)
            r.decode(rr)                 # capture
            ts = []
            for _ in range(10):
                t = time.perf_counter()
                r.decode(rr)
                ts.append(time.perf_counter() - t)
            ms = 1e3 * float(np.median(ts))
            te = []
            for _ in range(3):
                t = time.perf_counter()
                r.decode(rr, mode="eager")
                te.append(time.perf_counter() - t)
            print(f"B={b:4d} {name:8s} step {ms:8.3f} ms  {b / ms * 1e3:9.1f} tok/s  "
                  f"(eager {1e3 * float(np.median(te)):8.3f} ms)", flush=True)
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception as e:  # noqa: BLE001
        print("no torch profiler:", e)
        return
    for b in [int(x) for x in a.profile.split(",") if x]:
        for name, mode in (("greedy eager", "eager"), ("greedy graph", "graph")):
            rr = rows(b, greedy)
            r.decode(rr, mode=mode)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    r.decode(rr, mode=mode)
            agg = defaultdict(lambda: [0.0, 0])
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    agg[ev.name][0] += ev.device_time_total / 3
                    agg[ev.name][1] += 1
            tot = sum(v[0] for v in agg.values())
            print(f"-- B={b} {name}: kernels {tot / 1e3:.3f} ms per step")
            for k, (us, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:14]:
                print(f"   {us / 1e3:8.3f} ms  {n // 3:4d}x  {k[:90]}")


if __name__ == "__main__":
    main()
