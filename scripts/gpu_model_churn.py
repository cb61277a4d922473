#!/usr/bin/env python3
"""Load, use and drop models one after another on the GPU (issue 59).

    python3 scripts/gpu_model_churn.py [MODEL.gguf] [--models 200] [--capacity 64] [--tolerance-mib 8]

Without a model file a tiny synthetic one is written (the "tiny" preset:
2 layers, hidden 256). The loop is the issue's::

    for i in range(models):
        m = Model.from_gguf(path, backend="cuda", capacity=capacity, progress=False)
        m.generate([1, 2, 3], 8)
        del m

with the cyclic collector enabled and no explicit collection. One warm-up
model runs first (kernels built, modules loaded), then free device memory
is read (after a collection and a synchronize); every 20 models the script
prints the free memory and how many full collections ran. At the end it
prints the free memory as the loop left it and again after one collection.
Exit status 0 when every model generated the warm-up's tokens and the free
memory after the final collection is within ``--tolerance-mib`` of the start.
"""

import argparse
import gc
import os
import sys
import tempfile
import time

MIB = 1 << 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", help="a GGUF file (default: a tiny synthetic one)")
    ap.add_argument("--models", type=int, default=200)
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--tolerance-mib", type=float, default=8.0)
    a = ap.parse_args(argv)
    from ptxgen.driver import get_device
    from ptxgen.llm import Model

    path = a.model
    if path is None:
        from ptxgen.llm.gguf.synth import PRESETS, write_synthetic_llama
        path = os.path.join(tempfile.mkdtemp(prefix="churn-"), "tiny.gguf")
        write_synthetic_llama(path, seed=1, **PRESETS["tiny"])
    gc.enable()
    dev = get_device()

    def free_mib(collect: bool) -> float:
        if collect:
            gc.collect()
        dev.synchronize()
        return dev.mem_info()[0] / MIB

    def load():
        return Model.from_gguf(path, backend="cuda", capacity=a.capacity, progress=False)

    m = load()
    want = m.generate([1, 2, 3], 8).tokens
    del m
    start = free_mib(collect=True)
    print(f"{dev.name}; {path}; {a.models} models; free at start {start:.1f} MiB", flush=True)
    t0 = time.perf_counter()
    bad = 0
    for i in range(a.models):
        try:
            m = load()
            got = m.generate([1, 2, 3], 8).tokens
        except Exception as exc:
            print(f"FAILED at model {i} (after the warm-up): {type(exc).__name__}: {exc}")
            return 1
        del m
        if got != want:
            bad += 1
            print(f"model {i}: tokens {got} != {want}")
        if (i + 1) % 20 == 0:
            print(f"{i + 1:4d} models, {time.perf_counter() - t0:6.1f} s: free {free_mib(False):.1f} MiB, "
                  f"full collections so far {gc.get_stats()[2]['collections']}", flush=True)
    left = free_mib(collect=False)
    end = free_mib(collect=True)
    print(f"free at end {left:.1f} MiB as the loop left it, {end:.1f} MiB after a collection "
          f"(start {start:.1f}, difference {end - start:+.1f} MiB)")
    ok = bad == 0 and abs(end - start) <= a.tolerance_mib
    print("OK" if ok else f"FAILED: {bad} models gave other tokens; memory difference "
          f"{end - start:+.1f} MiB (tolerance {a.tolerance_mib})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
