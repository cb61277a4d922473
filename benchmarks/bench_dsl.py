"""Emission speed of the DSL: instructions built and emitted per second.

``python -m benchmarks.bench_dsl`` times two workloads, seven runs each:

- ``kernels``: every registered canonical kernel (GEMV, flash decode,
  RMSNorm, ... about 7,000 instructions) built and emitted three times over;
  the kernels are ordinary user code outside the DSL package, so this is what
  a user's build costs;
- ``unrolled``: one synthetic kernel of 22,000 unrolled instructions (loads,
  fma, shuffles, branches), built by a function inside this module.

No GPU is involved.
"""

from __future__ import annotations

import time

import ptxgen
from ptxgen.types import f32, u32


def _unrolled(n_blocks: int = 2000) -> list:
    m = ptxgen.Module("sm_90")
    with m.kernel("emit_bench", maxntid=256) as k:
        x = k.param_ptr("x", f32, align=16)
        y = k.param_ptr("y", f32)
        n = k.param("n", u32)
        i = k.global_id()
        acc = k.var(f32, 0.0)
        for j in range(n_blocks):
            v = k.ld(x[i + j * 4], vec=4, nc=True)
            s = k.fma(v[0], v[1], v[2]) * v[3]
            s = s + k.shfl_xor(s, 1)
            with k.if_(i < n):
                acc += k.ex2(s)
        k.st(y[i], acc)
    return [m]


def _kernels(passes: int = 3) -> list:
    from ptxgen import registry
    specs = list(registry.canonical_specs().values())
    return [fam.build(spec) for _ in range(passes) for fam, spec in specs]


WORKLOADS = {"kernels": _kernels, "unrolled": _unrolled}


def measure(workload: str = "kernels", repeats: int = 7) -> dict:
    """Build and emit ``repeats`` times; report the best, median and slowest."""
    build = WORKLOADS[workload]
    build()     # first run imports the kernel modules; not timed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        modules = build()
        nbytes = sum(len(m.to_ptx()) for m in modules)
        times.append(time.perf_counter() - t0)
    times.sort()
    n = sum(m.instruction_count() for m in modules)
    med = times[len(times) // 2]
    return {"workload": workload, "instructions": n, "bytes": nbytes,
            "seconds": times[0], "median_seconds": med,
            "per_second": n / times[0], "median_per_second": n / med,
            "slowest_per_second": n / times[-1]}


def main() -> list:
    rows = []
    for name in WORKLOADS:
        r = measure(name)
        rows.append(r)
        print(f"{name:<9} {r['instructions']:>6} instructions ({r['bytes']:,} bytes of PTX): "
              f"best {r['per_second']:,.0f}/s, median {r['median_per_second']:,.0f}/s, "
              f"slowest {r['slowest_per_second']:,.0f}/s over 7 runs")
    return rows


if __name__ == "__main__":
    main()
