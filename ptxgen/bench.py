"""Emission speed of the DSL: instructions built and emitted per second.

``python -m ptxgen.bench`` builds a kernel of many unrolled instructions
(loads, arithmetic, shuffles, stores, branches) and times build + emit.
No GPU is involved.
"""

from __future__ import annotations

import time

import ptxgen
from ptxgen.types import f32, u32


def _build(n_blocks: int) -> ptxgen.Module:
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
    return m


def measure(n_blocks: int = 2000, repeats: int = 7) -> dict:
    """Build and emit ``repeats`` times; report the best and the median."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = _build(n_blocks)
        text = m.to_ptx()
        times.append(time.perf_counter() - t0)
    times.sort()
    n = m.instruction_count()
    med = times[len(times) // 2]
    return {"instructions": n, "seconds": times[0], "median_seconds": med,
            "per_second": n / times[0], "median_per_second": n / med,
            "slowest_per_second": n / times[-1], "bytes": len(text)}


def main() -> None:
    r = measure()
    print(f"built and emitted {r['instructions']} instructions ({r['bytes']} bytes of PTX): "
          f"best {r['per_second']:,.0f}/s, median {r['median_per_second']:,.0f}/s, "
          f"slowest {r['slowest_per_second']:,.0f}/s over 7 runs")


if __name__ == "__main__":
    main()
