"""Emulator speed: thread-instructions per second on this machine.

``python -m benchmarks.bench_emu [--repeat N]`` runs the block reduction
(256 threads per block) and vector add canonical kernels on fresh random
inputs, checks their results, and prints a table.  A thread-instruction is
one PTX instruction issued for one thread of the running group.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from ptxgen import registry
from ptxgen.emu import DeviceArray, Module, launch

__all__ = ["measure", "main"]


def _reduce_case(n, grid):
    from ptxgen.kernels import reduce as rk
    spec = registry.canonical_specs()["block_reduce"][1]
    fn = Module.from_ptx(rk.build(spec))[spec.kernel_name]
    x = np.random.default_rng().uniform(-1, 1, n).astype(np.float32)
    dx, out = DeviceArray.from_numpy(x), DeviceArray.from_numpy(np.full(grid, np.nan, np.float32))
    geo = rk.launch_geometry(spec, n, grid)

    def run():
        launch(fn, geo.grid, geo.block, dx, out, n, shared=geo.shared)

    def check():
        want = rk.reference(x, grid, spec.block)
        # f32 partial sums of up to 2^20 values: the error scales with sum |x|
        tol = 1e-4 + 2e-7 * float(np.abs(x).sum())
        assert np.allclose(out.to_numpy(), want, rtol=1e-5, atol=tol)
    return f"block_reduce (256 thr, grid {grid}, n={n})", fn, run, check


def _vadd_case(n):
    from ptxgen.kernels import vector_add as vk
    spec = registry.canonical_specs()["vector_add"][1]
    fn = Module.from_ptx(vk.build(spec))[spec.kernel_name]
    rng = np.random.default_rng()
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    da, db = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b)
    dc = DeviceArray.from_numpy(np.full(n, np.nan, np.float32))
    geo = vk.launch_geometry(spec, n)

    def run():
        launch(fn, geo.grid, geo.block, da, db, dc, n, shared=geo.shared)

    def check():
        assert np.array_equal(dc.to_numpy(), a + b)
    return f"vector_add (256 thr, n={n})", fn, run, check


def measure(case, repeat=3):
    """(name, thread-instructions per run, best seconds, rate per second)."""
    name, fn, run, check = case
    run()
    check()
    best = float("inf")
    per_run = 0
    for _ in range(repeat):
        before = fn.thread_instructions
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
        per_run = fn.thread_instructions - before
        best = min(best, dt)
    return name, per_run, best, per_run / best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    cases = [_reduce_case(1 << 20, 1), _reduce_case(1 << 18, 16), _vadd_case(1 << 18)]
    rows = [measure(c, args.repeat) for c in cases]
    print(f"ptxgen.emu benchmark on {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}, numpy {np.__version__}")
    print(f"{'kernel':<44} {'thread-instr':>13} {'seconds':>9} {'M thread-instr/s':>17}")
    for name, n, s, rate in rows:
        print(f"{name:<44} {n:>13,} {s:>9.3f} {rate / 1e6:>17.2f}")
    return rows


if __name__ == "__main__":
    main()
