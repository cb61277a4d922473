#!/usr/bin/env python3
"""Time GEMM configs at the batched engine's decode row counts and keep the
fastest per call in the user tuning cache (what ``python -m ptxgen tune``
does for the GEMV), so the engine's graphs, built after, use them.

    python3 scripts/tune_gemm_batch.py [--t 8,32,64,128] [--json OUT.json]

The calls are an 8B Llama's weight shapes with the engine's X types and
epilogues; the candidates vary the tile (``bm``, ``bn``) and the warps
around the table's config.  Each is timed as a CUDA graph of 20 calls
through copies of the weights that together exceed the L2 (median of 5
replays); the weight bytes over the time is printed beside.
Buckets that are not measured take the nearest measured row count's choice.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import attrs
import numpy as np

#: (qtype, m, k, x_type, epilogue) of an 8B Llama's batch step
CALLS = [("Q4_K", 6144, 4096, "f16", "none"), ("Q4_K", 4096, 4096, "f32", "residual"),
         ("Q4_K", 4096, 4096, "f16", "residual"), ("Q4_K", 14336, 4096, "f16", "none"),
         ("Q4_K", 4096, 14336, "f16", "residual"), ("Q6_K", 128256, 4096, "f16", "none")]
BUCKETS = (2, 4, 8, 16, 32, 64, 128)
#: weight bytes a timed call cycles through (copies of its matrix), over the L2
COLD_BYTES = 256 << 20


def candidates(base, t, x_type, stages=(4, 6), mma=True, splits=(1,)):
    """The table's config, small mma.sync tiles (more CTAs at few rows;
    ``mma``) and, for f16 X, the warpgroup kernel's tiles of 64 and 128
    weight rows by one token tile covering T (sm_90a), with rings of each
    of ``stages`` and K split each of ``splits`` ways (those the shape and
    the shared memory allow)."""
    out = [base]
    bn = min(max(16, t), 64)
    for bm in ((16, 32, 64) if mma else ()):
        for wm, wn in ((1, 1), (2, 1)):
            c = attrs.evolve(base, bm=bm, bn=bn, warps_m=wm, warps_n=wn, stages=4,
                             kernel="mma", min_ctas=0)
            if c not in out:
                out.append(c)
    if x_type == "f16":
        wbn = min(max(8, -(-t // 8) * 8), 128)
        for bm in (64, 128):
            for depth in stages:
                for split in splits:
                    c = attrs.evolve(base, kernel="wgmma", bm=bm, bn=wbn, bk=64, stages=depth,
                                     warps_m=2, warps_n=2, min_ctas=0, split_k=split)
                    if c not in out:
                        out.append(c)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", default="8,64")
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-candidates", type=int, default=40)
    ap.add_argument("--stages", default="4,6",
                    help="ring depths of the warpgroup candidates (comma-separated)")
    ap.add_argument("--splits", default="1",
                    help="K splits of the warpgroup candidates (comma-separated)")
    ap.add_argument("--no-mma", action="store_true", help="warpgroup candidates only")
    ap.add_argument("--calls", default=None,
                    help="only these calls, as M x K (comma-separated, e.g. 4096x14336)")
    ap.add_argument("--no-store", action="store_true",
                    help="print and write JSON only; leave the user tuning cache alone")
    a = ap.parse_args(argv)
    from ptxgen import driver
    from ptxgen.driver import DeviceArray, Stream, get_device, ops
    from ptxgen.driver.ops_gemm import gemm_plan
    from ptxgen.driver.timing import graph_us
    from ptxgen.kernels import gemm as G, tuning
    from ptxgen.kernels.gemm.tuning import call_of
    from ptxgen.kernels.quants.qtypes import qtype_of
    dev = get_device()
    s = Stream()
    rng = np.random.default_rng(0)
    ts = [int(x) for x in a.t.split(",")]
    rows, best = [], {}
    stages = tuple(int(v) for v in a.stages.split(","))
    splits = tuple(int(v) for v in a.splits.split(","))
    calls = [c for c in CALLS if a.calls is None or f"{c[1]}x{c[2]}" in a.calls.split(",")]
    for q, m, k, xt, epi in calls:
        qt = qtype_of(q)
        row_bytes = qt.row_bytes(k)
        # copies enough to leave the L2 cold: consecutive calls read different weights,
        # as a decode step's layers do
        copies = max(1, -(-COLD_BYTES // (m * row_bytes)))
        wbytes = rng.integers(0, 256, (m, row_bytes), dtype=np.uint8)
        ws = [DeviceArray.from_numpy(wbytes) for _ in range(copies)]
        for t in ts:
            x = DeviceArray.from_numpy(rng.standard_normal((t, k)).astype(
                np.float16 if xt == "f16" else np.float32))
            y = DeviceArray.from_numpy(rng.standard_normal((t, m)).astype(np.float32))
            base = gemm_plan(q, k, m, t, x_type=xt, epilogue=epi, backend="cuda").config
            found = []
            for c in candidates(base, t, xt, stages, not a.no_mma, splits)[:a.max_candidates]:
                kw = attrs.asdict(c)
                try:
                    G.GemmPlan(gemm_plan(q, k, m, t, x_type=xt, epilogue=epi,
                                         backend="cuda").spec, c)
                    turn = itertools.cycle(ws)
                    us = graph_us(lambda i, kw=kw, turn=turn: ops.gemm(
                        next(turn), x, q, out=y, residual=y if epi == "residual" else None,
                        stream=s, **kw), s)
                except (ValueError, driver.CUDAError):
                    continue
                found.append((us, c))
            found.sort(key=lambda f: f[0])
            us0 = next(u for u, c in found if c == base) if any(c == base for _, c in found) \
                else float("nan")
            us1, c1 = found[0]
            gbs = m * row_bytes / us1 / 1e3
            print(f"{q} {m}x{k} {xt} {epi:8s} T={t:4d}: table {us0:8.1f} us, best {us1:8.1f} us "
                  f"({gbs:6.0f} GB/s weights) {attrs.asdict(c1)}", flush=True)
            rows.append(dict(qtype=q, m=m, k=k, x_type=xt, epilogue=epi, t=t, table_us=us0,
                             best_us=us1, best=attrs.asdict(c1), candidates=len(found),
                             timed=[dict(us=round(u, 2), **attrs.asdict(c)) for u, c in found]))
            best[(q, m, k, xt, epi, t)] = (c1, us1, us0)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"device": dev.name, "rows": rows}, f, indent=1)
    for q, m, k, xt, epi in ([] if a.no_store else calls):
        for bucket in BUCKETS:
            t = min(ts, key=lambda v: (abs(v - bucket), v))
            c1, us1, us0 = best[(q, m, k, xt, epi, t)]
            spec = gemm_plan(q, k, m, bucket, x_type=xt, epilogue=epi, backend="cuda").spec
            tuning.store_user_config("gemm", dev.name, call_of(spec, m, bucket), attrs.asdict(c1),
                                     {"us": round(us1, 2), "table_us": round(us0, 2),
                                      "measured_t": t, "date": time.strftime("%Y-%m-%d")})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": dev.name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
