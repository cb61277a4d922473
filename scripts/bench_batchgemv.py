#!/usr/bin/env python3
"""The batched GEMV against the tensor-core GEMM at a decode step's row
counts, per weight shape of an 8B Llama (Q4_K_M-like), to choose the
crossover of ``kernels/tuning/gemv_batch.json``.

    python3 scripts/bench_batchgemv.py [--b 1,2,4,8,16,32] [--json OUT.json] [--store]

Each call is timed as a CUDA graph of 20 launches (median of 5 replays).
B = 1 times the single-row GEMV (the engine's one-row step); B >= 2 the
batched GEMV at :func:`ptxgen.kernels.gemv.batch_plan`'s config ("n/a"
where x and the ring do not fit shared memory).  The GEMM is the engine's:
f16 X (f32 for attn_output, which reads the paged attention's f32 output),
the table's config for B rows.  Prints one line per shape and B, then per
B the layer's total (qkv, attn_output, gate + up, ffn_down) both ways, and
the crossover: the largest B up to which the batched GEMV's layer total is
below the GEMM's at every B; with ``--store`` it is kept in the user tuning
cache for this device, where the engine's decode steps read it
(:func:`ptxgen.kernels.gemv.batch_crossover`).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

#: (name, qtype, m, k, epilogue, GEMM x type, times a layer) of an 8B Llama's step
SHAPES = [("attn_qkv", "Q4_K", 6144, 4096, "none", "f16", 1),
          ("attn_output", "Q4_K", 4096, 4096, "residual", "f32", 1),
          ("ffn_gate_up", "Q4_K", 14336, 4096, "none", "f16", 2),
          ("ffn_down", "Q4_K", 4096, 14336, "residual", "f16", 1),
          ("ffn_down_q6k", "Q6_K", 4096, 14336, "residual", "f16", 0),
          ("output", "Q6_K", 128256, 4096, "none", "f16", 0)]


def graph_us(issue, stream):
    """Median microseconds of one ``issue()`` over graph replays."""
    from ptxgen.driver.timing import graph_us as _graph_us
    return _graph_us(lambda i: issue(), stream, 20, 5)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", default="1,2,4,8,16,32")
    ap.add_argument("--json", default=None)
    ap.add_argument("--store", action="store_true",
                    help="keep the crossover in the user tuning cache for this device")
    a = ap.parse_args(argv)
    from ptxgen.driver import DeviceArray, ops
    from ptxgen.driver.backend import get_backend
    from ptxgen.driver.ops_gemv import gemv_spec
    from ptxgen.kernels import gemv as G
    from ptxgen.kernels import tuning
    from ptxgen.kernels.quants.qtypes import qtype_of
    be = get_backend("cuda")
    s = be.stream()
    rng = np.random.default_rng(0)
    bs = [int(v) for v in a.b.split(",")]
    rows, times = [], {}
    for name, q, m, k, epi, xt, _ in SHAPES:
        rb = qtype_of(q).row_bytes(k)
        w = DeviceArray.from_numpy(rng.integers(0, 256, (m, rb), dtype=np.uint8))
        for B in bs:
            xf = rng.standard_normal((B, k)).astype(np.float32)
            x32 = DeviceArray.from_numpy(xf)
            x16 = DeviceArray.from_numpy(xf.astype(np.float16))
            y = DeviceArray.from_numpy(rng.standard_normal((B, m)).astype(np.float32))
            n_ptr = DeviceArray.from_numpy(np.array([B], np.int32))
            if B == 1:
                plan = gemv_spec(q, k, epi, m, pdl=False)
                args = dict(w=w, x=x32, y=y, m=m)
            else:
                try:
                    plan = G.batch_plan(q, k, epi, batch=B, target=be.target, m=m,
                                        sm_count=be.sm_count)
                except ValueError:
                    plan = None
                args = dict(w=w, x=x32, y=y, m=m, n_ptr=n_ptr, ys=m)
            if epi == "residual":
                args["r"] = y
            gv = float("nan")
            if plan is not None:
                fn = be.load(G.build(plan)).function(plan.kernel_name)
                geo = G.launch_geometry(plan, m)
                gv = graph_us(lambda: be.launch(fn, geo, args, stream=s), s)
            xg = x16 if xt == "f16" else x32
            gm = graph_us(lambda: ops.gemm(w, xg, q, out=y, residual=y if epi == "residual"
                                               else None, stream=s), s)
            times[name, B] = (gv, gm)
            print(f"{name:12s} {q} {m:6d}x{k:5d} B={B:3d}: gemv {gv:8.1f} us  gemm {gm:8.1f} us"
                  f"  gemm/gemv {gm / gv:5.2f}  ({m * rb / min(gv, gm) / 1e3:5.0f} GB/s best)",
                  flush=True)
            rows.append(dict(name=name, qtype=q, m=m, k=k, b=B, gemv_us=gv, gemm_us=gm))
    crossover, ok = 0, True
    for B in bs:
        tv = sum(n * times[nm, B][0] for nm, *_, n in SHAPES if n)
        tm = sum(n * times[nm, B][1] for nm, *_, n in SHAPES if n)
        print(f"layer B={B:3d}: gemv {tv:8.1f} us  gemm {tm:8.1f} us")
        if B > 1 and ok and tv < tm:
            crossover = B
        elif B > 1:
            ok = False
    print(f"CROSSOVER {be.device_name} ({be.target}): batched GEMV up to B={crossover} "
          f"(kernels/tuning/gemv_batch.json 'crossover')")
    if a.store:
        path = tuning.store_user_config(
            "gemv_batch", be.device_name, G.crossover_call(be.target), {"crossover": crossover},
            {"date": time.strftime("%Y-%m-%d"), "measured_b": bs})
        print(f"stored in {path}: the engine's decode steps on this device take it")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": be.device_name, "rows": rows, "crossover": crossover}, f,
                      indent=1)


if __name__ == "__main__":
    main()
