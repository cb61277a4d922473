"""GEMV benchmark: our kernels for every weight type against copy bandwidth and cuBLAS f16.

Run on a GPU with ``python -m benchmarks.bench_gemv [out.json] [--qtypes
Q4_0,F16] [--no-swiglu]`` or call :func:`run_all`.  Needs torch (for the
copy/cuBLAS peers and the CUDA graphs).  For every shape (M x K) and qtype
it reports our time (CUDA-graph replay of ``CALLS`` launches, median of
``REPEATS`` replays, rotating over enough weight copies to defeat the L2),
bytes read per second, the share of a device-to-device copy's bandwidth
measured in the same run (and the share asked of the type), cuBLAS's f16
GEMV time (``torch.mv``, timed once per shape in the run) and the ratio.
On sm_90 and newer our kernels are launched with programmatic dependent
launch (as the model launches them: each GEMV's first weight loads overlap
the previous call's tail), and the same kernel without it is timed beside;
then the fused gate/up SwiGLU kernel against two GEMVs plus a SwiGLU.  A
few rows of each output are checked against the float64 reference
(gguf-layout dequantisation in numpy).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time

import numpy as np

from ptxgen.kernels import gemv as G

from ptxgen.driver import ops_gemv
from ptxgen.driver.launch import launch

__all__ = ["run_all", "SHAPES", "QTYPES"]

SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (128256, 4096),
          (1024, 4096)]
QTYPES = list(G.GEMV_QTYPES)
#: share of copy bandwidth asked of each type on the large 8B shapes (issues 5 and 42)
GOALS = {"Q4_K": 0.90, "F16": 0.90, "BF16": 0.90}
GOAL_DEFAULT = 0.85
#: byte ranges of a block's f16 scales, which random bytes must not fill
_SCALES = {"Q4_K": (0, 4), "Q6_K": (208, 210), "Q5_K": (0, 4), "Q4_1": (0, 4), "Q5_1": (0, 4)}
CALLS = 20
REPEATS = 7
L2_DEFEAT_BYTES = 256 << 20


def _torch():
    import torch
    return torch


def _random_weights(torch, qtype, m, k, gen):
    """Random GGUF bytes with finite, sane f16 scales (on the device)."""
    if qtype in ("F16", "BF16"):
        dt = torch.float16 if qtype == "F16" else torch.bfloat16
        w = torch.randn((m, k), device="cuda", generator=gen, dtype=torch.float32) * 0.02
        return w.to(dt).view(torch.uint8).view(m, 2 * k)
    bw, bb = G.read_unit(qtype)
    nb = k // bw
    w = torch.randint(0, 256, (m, nb, bb), dtype=torch.uint8, device="cuda", generator=gen)
    scale = (torch.rand((m, nb, 2), device="cuda", generator=gen) * 0.02 + 0.001).half()
    sb = scale.view(torch.uint8).view(m, nb, 4)
    a, b = _SCALES.get(qtype, (0, 2))
    w[:, :, a:b] = sb[:, :, 0:b - a]
    return w.view(m, nb * bb)


def _time_graph(torch, fn, calls=CALLS, repeats=REPEATS):
    """Median seconds per call of ``fn(i)`` captured ``calls`` times in a graph."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / calls)
    return statistics.median(times)


def copy_bandwidth(torch=None, nbytes=1 << 30):
    """Device-to-device copy bandwidth, bytes read + written per second, and
    the seconds per copy (:func:`benchmarks.bench_common.copy_bandwidth`)."""
    from .bench_common import copy_bandwidth as cb
    return cb(nbytes)


def _launcher(torch, qtype, k, epilogue="none", m=None, **knobs):
    spec = ops_gemv.gemv_spec(qtype, k, epilogue, m=m, **knobs)
    fn = ops_gemv._function(spec)

    def go(ptrs, y, m):
        geo = G.launch_geometry(spec, m)
        launch(fn, geo.grid, geo.block, *ptrs, y, m, geo.args["rpc"], shared=geo.shared,
               stream=torch.cuda.current_stream(), pdl=spec.pdl)
    return spec, go


def _check_rows(torch, qtype, w, x, y, rows=8, extra=None):
    """Relative error of ``rows`` sampled rows against the float64 reference."""
    m = w.shape[0]
    idx = np.unique(np.r_[0, m - 1, np.linspace(0, m - 1, rows).astype(int)])
    wr = w[torch.as_tensor(idx, device="cuda")].cpu().numpy()
    xh = x.cpu().numpy()
    if extra is None:
        ref = G.reference(qtype, wr, xh)
    else:
        wu = extra[torch.as_tensor(idx, device="cuda")].cpu().numpy()
        ref = G.reference(qtype, wr, xh, w_up=wu, epilogue="swiglu")
    got = y.cpu().numpy()[idx].astype(np.float64)
    if not np.all(np.isfinite(got)) or not np.any(ref):
        return float("inf")        # a NaN left by the poison, or nothing to compare with
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def bench_shape(torch, qtype, m, k, copy_bw, gen, cublas=None, **knobs):
    """One row of the table (see the module docstring).  ``cublas``: a dict
    of cuBLAS times by shape, filled and reused across types in one run."""
    spec, go = _launcher(torch, qtype, k, m=m, **knobs)
    nbytes = m * spec.row_bytes
    copies = max(1, math.ceil(L2_DEFEAT_BYTES / nbytes))
    ws = [_random_weights(torch, qtype, m, k, gen) for _ in range(copies)]
    x = torch.randn(k, device="cuda", generator=gen)
    ys = [torch.full((m,), float("nan"), device="cuda") for _ in range(min(copies, 4))]
    t = _time_graph(torch, lambda i: go([ws[i % copies], x], ys[i % len(ys)], m))
    go([ws[0], x], ys[0], m)
    torch.cuda.synchronize()
    err = _check_rows(torch, qtype, ws[0], x, ys[0])
    t_plain = None
    if spec.pdl:    # the same kernel without programmatic dependent launch
        _, go0 = _launcher(torch, qtype, k, m=m, **dict(knobs, pdl=False))
        t_plain = _time_graph(torch, lambda i: go0([ws[i % copies], x], ys[i % len(ys)], m))
    del ws
    read = nbytes + 4 * (k + m)
    tc = (cublas or {}).get((m, k))
    if tc is None:
        f16_bytes = 2 * m * k
        fcopies = max(1, math.ceil(L2_DEFEAT_BYTES / f16_bytes))
        wf = [torch.randn(m, k, device="cuda", generator=gen, dtype=torch.float16)
              for _ in range(fcopies)]
        xf = torch.randn(k, device="cuda", generator=gen, dtype=torch.float16)
        yf = torch.empty(m, device="cuda", dtype=torch.float16)
        tc = _time_graph(torch, lambda i: torch.mv(wf[i % fcopies], xf, out=yf))
        del wf
        if cublas is not None:
            cublas[(m, k)] = tc
    torch.cuda.empty_cache()
    out = dict(qtype=qtype, m=m, k=k, spec=repr(spec), us=t * 1e6, bytes=read,
               gbps=read / t / 1e9, copy_share=read / t / copy_bw, cublas_f16_us=tc * 1e6,
               vs_cublas=t / tc, rel_err=err, pdl=spec.pdl,
               copy_goal=GOALS.get(qtype, GOAL_DEFAULT))
    if t_plain is not None:
        out.update(us_no_pdl=t_plain * 1e6, copy_share_no_pdl=read / t_plain / copy_bw)
    return out


def bench_swiglu(torch, qtype, m, k, gen, **knobs):
    """Fused gate/up + SwiGLU against two GEMVs and torch's silu(g) * u."""
    spec, fused = _launcher(torch, qtype, k, "swiglu", **knobs)
    _, plain = _launcher(torch, qtype, k)
    nbytes = 2 * m * spec.row_bytes
    copies = max(1, math.ceil(L2_DEFEAT_BYTES / nbytes))
    wg = [_random_weights(torch, qtype, m, k, gen) for _ in range(copies)]
    wu = [_random_weights(torch, qtype, m, k, gen) for _ in range(copies)]
    x = torch.randn(k, device="cuda", generator=gen) * 0.1
    y = torch.full((m,), float("nan"), device="cuda")
    g = torch.empty(m, device="cuda")
    u = torch.empty(m, device="cuda")
    tf = _time_graph(torch, lambda i: fused([wg[i % copies], wu[i % copies], x], y, m))
    fused([wg[0], wu[0], x], y, m)
    torch.cuda.synchronize()
    err = _check_rows(torch, qtype, wg[0], x, y, extra=wu[0])

    def split(i):
        plain([wg[i % copies], x], g, m)
        plain([wu[i % copies], x], u, m)
        torch.mul(torch.nn.functional.silu(g), u, out=y)
    ts = _time_graph(torch, split)
    return dict(qtype=qtype, m=m, k=k, fused_us=tf * 1e6, split_us=ts * 1e6,
                speedup=ts / tf, rel_err=err, bytes=nbytes)


def run_all(shapes=SHAPES, qtypes=QTYPES, swiglu=True, verbose=True) -> dict:
    """Run the whole benchmark; returns a dict (device, copy bandwidth, rows)."""
    torch = _torch()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(time.time()))
    bw, tcopy = copy_bandwidth(torch)
    out = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
               copy_bw_gbps=bw / 1e9, copy_1gib_us=tcopy * 1e6, gemv=[], swiglu=[])
    cublas = {}         # cuBLAS f16 is the same GEMV for every type: timed once a shape
    for qtype in qtypes:
        for m, k in shapes:
            out["gemv"].append(bench_shape(torch, qtype, m, k, bw, gen, cublas))
            if verbose:
                _print_row(out["gemv"][-1])
    if swiglu:
        for qtype in qtypes:
            out["swiglu"].append(bench_swiglu(torch, qtype, 14336, 4096, gen))
            if verbose:
                r = out["swiglu"][-1]
                print(f"swiglu {qtype} 14336x4096: fused {r['fused_us']:.1f} us, "
                      f"2 gemv + swiglu {r['split_us']:.1f} us ({r['speedup']:.2f}x), "
                      f"err {r['rel_err']:.1e}")
    return out


def sweep(variants, qtype="Q4_K", verbose=True) -> dict:
    """Time knob variants per shape in one process: ``variants`` maps
    ``(m, k)`` to a list of knob dicts (``{}``: the defaults).  Weights are
    made once per shape and shared by its variants; every variant's output is
    checked on sampled rows against the float64 reference."""
    torch = _torch()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(time.time()))
    bw, _ = copy_bandwidth(torch)
    out = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
               copy_bw_gbps=bw / 1e9, rows=[])
    if verbose:
        print(f"{out['device']}: copy {bw / 1e9:.0f} GB/s (r+w)", flush=True)
    for (m, k), knob_list in variants.items():
        rb = G.read_unit(qtype)[1] * k // G.read_unit(qtype)[0]
        copies = max(1, math.ceil(L2_DEFEAT_BYTES / (m * rb)))
        ws = [_random_weights(torch, qtype, m, k, gen) for _ in range(copies)]
        x = torch.randn(k, device="cuda", generator=gen)
        ys = [torch.full((m,), float("nan"), device="cuda") for _ in range(min(copies, 4))]
        for knobs in knob_list:
            try:
                spec, go = _launcher(torch, qtype, k, m=m, **knobs)
                t = _time_graph(torch, lambda i: go([ws[i % copies], x], ys[i % len(ys)], m))
                ys[0].fill_(float("nan"))
                go([ws[0], x], ys[0], m)
                torch.cuda.synchronize()
                err = _check_rows(torch, qtype, ws[0], x, ys[0], rows=16)
                nregs = getattr(ops_gemv._function(spec), "num_regs", None)
                read = m * rb + 4 * (k + m)
                r = dict(m=m, k=k, knobs=knobs, us=t * 1e6, copy_share=read / t / bw,
                         rel_err=err, regs=nregs)
            except Exception as e:      # a variant that fails to build/launch
                r = dict(m=m, k=k, knobs=knobs, error=f"{type(e).__name__}: {e}"[:200])
            out["rows"].append(r)
            if verbose:
                if "error" in r:
                    print(f"{m}x{k} {knobs}: {r['error']}", flush=True)
                else:
                    print(f"{m:6d}x{k:<6d} {r['us']:8.2f} us {100 * r['copy_share']:5.1f}% "
                          f"regs {r['regs']} err {r['rel_err']:.1e}  {knobs}", flush=True)
        del ws
        torch.cuda.empty_cache()
    return out


def _print_row(r):
    print(f"{r['qtype']:5s} {r['m']:6d}x{r['k']:<6d} {r['us']:8.2f} us {r['gbps']:7.0f} GB/s "
          f"{100 * r['copy_share']:5.1f}% copy (goal {100 * r['copy_goal']:.0f}%)  "
          f"cuBLAS f16 {r['cublas_f16_us']:7.2f} us "
          f"ratio {r['vs_cublas']:.3f}  err {r['rel_err']:.1e}"
          + (f"  (no PDL: {r['us_no_pdl']:.2f} us, {100 * r['copy_share_no_pdl']:.1f}%)"
             if "us_no_pdl" in r else ""), flush=True)


def main(argv=None):
    """``[out.json] [--qtypes Q4_0,F16,...] [--no-swiglu]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    qtypes, swiglu = QTYPES, True
    if "--qtypes" in argv:
        i = argv.index("--qtypes")
        qtypes = [q.strip().upper() for q in argv[i + 1].split(",")]
        bad = [q for q in qtypes if q not in G.GEMV_QTYPES]
        if bad:
            raise SystemExit(f"unknown qtype(s) {', '.join(bad)}; known: "
                             f"{', '.join(G.GEMV_QTYPES)}")
        del argv[i:i + 2]
    if "--no-swiglu" in argv:
        argv.remove("--no-swiglu")
        swiglu = False
    res = run_all(qtypes=qtypes, swiglu=swiglu)
    if argv:
        with open(argv[0], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
