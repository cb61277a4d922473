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


def measure(n_blocks: int = 2000, repeats: int = 3) -> dict:
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = _build(n_blocks)
        text = m.to_ptx()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    n = m.instruction_count()
    return {"instructions": n, "seconds": best, "per_second": n / best, "bytes": len(text)}


def main() -> None:
    r = measure()
    print(f"built and emitted {r['instructions']} instructions ({r['bytes']} bytes of PTX) "
          f"in {r['seconds'] * 1e3:.1f} ms: {r['per_second']:,.0f} instructions/s")


if __name__ == "__main__":
    main()
