"""Quantized GEMM benchmark: ``Y[T, M] = X[T, K] . W[M, K]^T`` (every weight
type of ``QTYPES``) beside cuBLAS f16 (``torch.mm`` on f16 weights of the same shape).

``python -m benchmarks.bench_gemm [out.json] [--sweep] [--sweep-wgmma]
[--qtypes Q6_K,Q8_0]`` on a GPU with torch.  For every weight type of
``--qtypes`` (default ``QTYPES``), 8B-shaped matrix (M x K) and T in ``TS``:
our time with f16 X (the table's choice and, for Q4_K, beside it the other
kernel: the ``mma.sync`` one and, on sm_90, the ``wgmma`` one) and with f32 X
(CUDA-graph replay of ``CALLS`` launches, median of ``REPEATS``,
rotating over enough weight copies to defeat the L2), TFLOP/s (``2 T M K``
per call), cuBLAS's time and TFLOP/s and the ratio ours / cuBLAS (below 1:
faster).  Sampled rows of each output are checked against the float64
reference (the gguf-layout dequantisation in numpy).  ``--sweep`` also
times the config variants of ``SWEEP`` at T = 512 and 2048 (Q4_K; for the
tuning table, ``kernels/tuning/gemm.json``); ``--sweep-wgmma`` only those of
``WGMMA_SWEEP`` (sm_90) and the mma.sync baseline.
"""

from __future__ import annotations

import json
import math
import sys
import time

import attrs
import numpy as np

from ptxgen.driver.backend import get_backend
from ptxgen.driver.launch import launch
from ptxgen.driver.ops_gemm import gemm_target
from ptxgen.kernels import gemm as G
from ptxgen.kernels.quants import qtype_of

from .bench_gemv import _random_weights, _time_graph, _torch

__all__ = ["run_all", "sweep", "SHAPES", "TS", "SWEEP", "WGMMA_SWEEP", "QTYPES"]

SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)]
TS = [16, 64, 256, 512, 2048]
QTYPES = list(G.GEMM_QTYPES)
L2_DEFEAT_BYTES = 256 << 20
#: config variants ``--sweep`` times (GemmConfig fields)
_MMA = dict(kernel="mma")
SWEEP = [
    dict(bm=128, bn=128, bk=64, warps_m=2, warps_n=2, stages=4, min_ctas=2, **_MMA),
    dict(bm=128, bn=128, bk=64, warps_m=2, warps_n=2, stages=3, min_ctas=2, **_MMA),
    dict(bm=128, bn=128, bk=128, warps_m=2, warps_n=2, stages=3, min_ctas=1, **_MMA),
    dict(bm=64, bn=128, bk=64, warps_m=1, warps_n=2, stages=4, min_ctas=2, **_MMA),
    dict(bm=128, bn=64, bk=64, warps_m=2, warps_n=1, stages=4, min_ctas=2, **_MMA),
    dict(bm=64, bn=128, bk=64, warps_m=1, warps_n=4, stages=4, min_ctas=2, **_MMA),
    dict(bm=128, bn=128, bk=64, warps_m=4, warps_n=2, stages=4, min_ctas=1, **_MMA),
    dict(bm=256, bn=128, bk=64, warps_m=4, warps_n=2, stages=3, min_ctas=1, **_MMA),
    dict(bm=128, bn=256, bk=64, warps_m=2, warps_n=4, stages=3, min_ctas=1, **_MMA),
]
_WG = dict(kernel="wgmma", bk=64, min_ctas=0)
#: wgmma configs (sm_90): warpgroups of 64 rows x bn tokens, 2 bm threads
WGMMA_SWEEP = [
    dict(bm=128, bn=128, stages=4, **_WG),
    dict(bm=128, bn=128, stages=5, **_WG),
    dict(bm=128, bn=256, stages=4, **_WG),
    dict(bm=128, bn=256, stages=5, **_WG),
    dict(bm=128, bn=64, stages=6, **_WG),
    dict(bm=64, bn=128, stages=6, **_WG),
    dict(bm=64, bn=256, stages=4, **_WG),
    dict(bm=256, bn=128, stages=4, **_WG),
    dict(bm=256, bn=64, stages=4, **_WG),
]
#: the token counts of the wgmma sweep
WGMMA_TS = (128, 256, 512, 2048)


class _Gemm:
    """One built GEMM plan and its launch on torch's current stream."""

    def __init__(self, k, m, t, x_type, qtype="Q4_K", target=None, **knobs):
        be = get_backend("cuda")
        self.plan = G.default_plan(qtype, k, x_type=x_type,
                                   target=target or gemm_target(be.target), m=m, t=t, **knobs)
        self.geo = G.launch_geometry(self.plan, m, t)
        self.fn = be.function(G.build, self.plan, dynamic_shared=self.geo.shared)
        self.m, self.t = m, t

    def __call__(self, torch, w, x, y):
        xm = G.x_map(self.plan, x.data_ptr(), x.shape[0])
        tail = () if xm is None else (get_backend("cuda").tensor_map(xm),)
        launch(self.fn, self.geo.grid, self.geo.block, w, x, y, self.m, self.t, *tail,
               shared=self.geo.shared, stream=torch.cuda.current_stream())


def _check(torch, w, x, y, qtype="Q4_K", rows=8):
    """max |err| / max |ref| over sampled weight rows, all tokens."""
    m = w.shape[0]
    idx = np.unique(np.r_[0, m - 1, np.linspace(0, m - 1, rows).astype(int)])
    wr = w[torch.as_tensor(idx, device="cuda")].cpu().numpy()
    ref = G.reference(qtype, wr, x.float().cpu().numpy())
    got = y[:, torch.as_tensor(idx, device="cuda")].cpu().numpy().astype(np.float64)
    if not np.all(np.isfinite(got)) or not np.any(ref):
        return float("inf")
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def _weights(torch, m, k, gen, qtype="Q4_K"):
    rb = qtype_of(qtype).row_bytes(k)
    copies = max(1, math.ceil(L2_DEFEAT_BYTES / (m * rb)))
    return [_random_weights(torch, qtype, m, k, gen) for _ in range(copies)]


def _cublas(torch, m, k, t, gen):
    copies = max(1, math.ceil(L2_DEFEAT_BYTES / (2 * m * k)))
    wf = [torch.randn(k, m, device="cuda", generator=gen, dtype=torch.float16)
          for _ in range(copies)]
    xf = torch.randn(t, k, device="cuda", generator=gen, dtype=torch.float16)
    yf = torch.empty(t, m, device="cuda", dtype=torch.float16)
    tc = _time_graph(torch, lambda i: torch.mm(xf, wf[i % copies], out=yf))
    del wf
    torch.cuda.empty_cache()
    return tc


def _time_ours(torch, g, ws, x, t, m, qtype="Q4_K"):
    ys = [torch.full((t, m), float("nan"), device="cuda") for _ in range(2)]
    sec = _time_graph(torch, lambda i: g(torch, ws[i % len(ws)], x, ys[i % 2]))
    ys[0].fill_(float("nan"))
    g(torch, ws[0], x, ys[0])
    torch.cuda.synchronize()
    return sec, _check(torch, ws[0], x, ys[0], qtype)


def _variants(be_target, t, qtype):
    """The f16-X plans a Q4_K row times beside the table's choice:
    ``f16_mma`` (the mma.sync kernel, the table's config for sm_90) and, on
    sm_90, ``f16_wgmma`` (the wgmma config the table gives 4096 rows at
    512 tokens)."""
    if qtype != "Q4_K":
        return {}
    out = {"f16_mma": dict(target=be_target if be_target != "sm_90a" else "sm_90")}
    if gemm_target(be_target) == "sm_90a":
        out["f16_wgmma"] = dict(t_pick=512)
    return out


def bench_shape(torch, m, k, t, gen, ws=None, qtype="Q4_K", cublas=None):
    """One row: ours (f16 X: the table's kernel and, for Q4_K, the other
    one; f32 X) and cuBLAS f16 at ``T = t`` (``cublas``: its seconds, when
    already timed)."""
    ws = ws or _weights(torch, m, k, gen, qtype)
    flop = 2.0 * t * m * k
    row = dict(qtype=qtype, m=m, k=k, t=t)
    be = get_backend("cuda")
    x16 = torch.randn(t, k, device="cuda", generator=gen).half()
    runs = [("f16", torch.float16, {})]
    if qtype in G.MMA_QTYPES:                # f32 X runs on mma.sync, which decodes these only
        runs.append(("f32", torch.float32, {}))
    runs += [(name, torch.float16, v) for name, v in _variants(be.target, t, qtype).items()]
    for name, dt, v in runs:
        x = x16 if dt == torch.float16 else torch.randn(t, k, device="cuda", generator=gen)
        xt = "f16" if dt == torch.float16 else "f32"
        if "t_pick" in v:                # the wgmma config of 4096 rows at t_pick tokens
            cfg = G.default_plan(qtype, k, x_type=xt, target="sm_90a", m=4096,
                                 t=v["t_pick"]).config
            g = _Gemm(k, m, t, xt, qtype, **attrs.asdict(cfg))
        else:
            g = _Gemm(k, m, t, xt, qtype, target=v.get("target"))
        if name.startswith("f16_") and row["f16"]["plan"] == g.plan.kernel_name:
            row[name] = dict(row["f16"])     # the table's choice: timed already
            continue
        sec, err = _time_ours(torch, g, ws, x, t, m, qtype)
        row[name] = dict(us=sec * 1e6, tflops=flop / sec / 1e12, rel_err=err,
                         plan=g.plan.kernel_name, grid=list(g.grid), shared=g.shared,
                         regs=getattr(g.fn, "num_regs", None))
    tc = cublas if cublas is not None else _cublas(torch, m, k, t, gen)
    row["cublas_f16"] = dict(us=tc * 1e6, tflops=flop / tc / 1e12)
    for name in ("f16", "f32", "f16_mma", "f16_wgmma"):
        if name in row:
            row["ratio_" + name] = row[name]["us"] / row["cublas_f16"]["us"]
    return row


def _print_row(r):
    a, c = r["f16"], r["cublas_f16"]
    b = r.get("f32")
    extra = "".join(f"  {n[4:]} {r[n]['us']:8.1f} us ({r['ratio_' + n]:.2f}x)"
                    for n in ("f16_mma", "f16_wgmma") if n in r)
    f32 = f"  f32 X {b['us']:9.1f} us" if b else "  f32 X        -   "
    ratios = f"{r['ratio_f16']:.2f}" + (f" / {r['ratio_f32']:.2f}" if b else "")
    errs = f"{a['rel_err']:.1e}" + (f" {b['rel_err']:.1e}" if b else "")
    print(f"{r['qtype']:5s} {r['m']:6d}x{r['k']:<6d} T={r['t']:5d}"
          f"  f16 X {a['us']:9.1f} us {a['tflops']:6.1f} TF{f32}"
          f"  cuBLAS {c['us']:9.1f} us {c['tflops']:6.1f} TF  ratio {ratios}{extra}"
          f"  err {errs}  {a['plan']} regs {a['regs']}", flush=True)


def run_all(shapes=SHAPES, ts=TS, verbose=True, qtypes=QTYPES) -> dict:
    torch = _torch()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(time.time()))
    out = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), rows=[])
    for m, k in shapes:
        cublas = {t: _cublas(torch, m, k, t, gen) for t in ts}
        for qtype in qtypes:
            ws = _weights(torch, m, k, gen, qtype)
            for t in ts:
                try:
                    out["rows"].append(bench_shape(torch, m, k, t, gen, ws, qtype, cublas[t]))
                except Exception as e:      # keep the other types' rows
                    out["rows"].append(dict(qtype=qtype, m=m, k=k, t=t,
                                            error=f"{type(e).__name__}: {e}"[:300]))
                    print(qtype, m, k, t, out["rows"][-1]["error"], flush=True)
                    continue
                if verbose:
                    _print_row(out["rows"][-1])
            del ws
            torch.cuda.empty_cache()
    return out


def sweep(variants=SWEEP, shapes=SHAPES, ts=(512, 2048), verbose=True, qtype="Q4_K") -> dict:
    """Time each config of ``variants`` (f16 X, ``qtype`` weights) per shape and T."""
    torch = _torch()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(time.time()))
    out = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), rows=[])
    for m, k in shapes:
        ws = _weights(torch, m, k, gen, qtype)
        for t in ts:
            x = torch.randn(t, k, device="cuda", generator=gen).half()
            for knobs in variants:
                try:
                    g = _Gemm(k, m, t, "f16", qtype, **knobs)
                    sec, err = _time_ours(torch, g, ws, x, t, m, qtype)
                    r = dict(qtype=qtype, m=m, k=k, t=t, knobs=knobs, us=sec * 1e6,
                             tflops=2.0 * t * m * k / sec / 1e12, rel_err=err,
                             regs=getattr(g.fn, "num_regs", None))
                except Exception as e:      # a variant that does not build or launch
                    r = dict(m=m, k=k, t=t, knobs=knobs, error=f"{type(e).__name__}: {e}"[:200])
                out["rows"].append(r)
                if verbose:
                    print(f"{qtype} {m}x{k} T={t} " + (r["error"] if "error" in r else
                          f"{r['us']:9.1f} us {r['tflops']:6.1f} TF err {r['rel_err']:.1e} "
                          f"regs {r['regs']}") + f"  {knobs}", flush=True)
        del ws
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    qts = QTYPES
    argv = sys.argv[1:]
    if "--qtypes" in argv:
        i = argv.index("--qtypes")
        qts = argv[i + 1].split(",")
        del argv[i:i + 2]
    args = [a for a in argv if not a.startswith("--")]
    res = run_all(qtypes=qts)
    if "--sweep" in sys.argv:
        res["sweep"] = sweep()
    if "--sweep-wgmma" in sys.argv:
        res["sweep_wgmma"] = {q: sweep(SWEEP[:1] + WGMMA_SWEEP, ts=WGMMA_TS, qtype=q)
                              for q in qts if q in G.WGMMA_QTYPES}
    if args:
        with open(args[0], "w") as f:
            json.dump(res, f, indent=1)
