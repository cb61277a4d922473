"""The Llama-3-8B FFN as one persistent kernel against two GEMVs (GPU).

``python -m benchmarks.bench_ffn [OUT.json]``: gate/up + SwiGLU (2 ×
14336×4096) then down + residual (4096×14336), all Q4_K, over 8 layers of
distinct random weights (so L2 does not serve them), launched with
programmatic dependent launch and replayed from a CUDA graph:

* ``two GEMVs``: the default fused gate/up GEMV, then the default down GEMV;
* ``persistent``: :mod:`ptxgen.kernels.gemv_ffn` (one launch, one resident
  CTA per SM), with its default knobs and the variants given;
* the same inside the layer's GEMV chain (QKV 6144×4096 and O + residual
  4096×4096 before each FFN).

Each row gives µs per FFN (or per layer) and the share of the floor (the
weight bytes over a device copy's bandwidth measured in the same run).  Every
persistent variant's output is compared with the two-GEMV path's (relative
difference of the whole output vector; the float64 checks are in
tests/kernels/test_gemv_ffn.py).
"""

from __future__ import annotations

import json
import sys

import numpy as np

N_LAYERS = 8
H, FFN, QKV = 4096, 14336, 6144

#: persistent-kernel knobs timed besides the defaults
VARIANTS = {
    "2 CTAs/SM of 256, rows_down 2": dict(threads=256, ctas_per_sm=2, rows_down=2),
    "2 CTAs/SM of 256, stages 3": dict(threads=256, ctas_per_sm=2, stages=3),
    "2 CTAs/SM of 256, rows_down 2, stages 3": dict(threads=256, ctas_per_sm=2, rows_down=2,
                                                    stages=3),
    "2 CTAs/SM of 512, stages 2": dict(threads=512, ctas_per_sm=2, stages=2),
    "stages 3": dict(stages=3),
}


def main(argv=None, variants=None):
    import torch

    from . import bench_gemv as BG
    from ptxgen.driver import ops_gemv
    from .bench_common import copy_bandwidth
    from ptxgen.driver.launch import launch
    from ptxgen.driver.memory import DeviceArray
    argv = sys.argv[1:] if argv is None else argv
    variants = VARIANTS if variants is None else variants
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    q4 = "Q4_K"
    W = [dict(qkv=BG._random_weights(torch, q4, QKV, H, gen),
              o=BG._random_weights(torch, q4, H, H, gen),
              g=BG._random_weights(torch, q4, FFN, H, gen),
              u=BG._random_weights(torch, q4, FFN, H, gen),
              d=BG._random_weights(torch, q4, H, FFN, gen)) for _ in range(N_LAYERS)]
    x = torch.randn(H, device="cuda", generator=gen)
    r = torch.randn(H, device="cuda", generator=gen)
    yq, act = torch.empty(QKV, device="cuda"), torch.empty(FFN, device="cuda")
    y1, y2 = torch.empty(H, device="cuda"), torch.empty(H, device="cuda")
    ffn_bytes = sum(W[0][n].numel() for n in "gud")
    layer_bytes = sum(w.numel() for w in W[0].values())
    bw = copy_bandwidth()[0]
    floors = dict(ffn=ffn_bytes / bw * 1e6, layer=layer_bytes / bw * 1e6)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _, qkv = BG._launcher(torch, q4, H, "none", m=QKV)
    _, o = BG._launcher(torch, q4, H, "residual", m=H)
    _, gu = BG._launcher(torch, q4, H, "swiglu", m=FFN)
    _, d = BG._launcher(torch, q4, FFN, "residual", m=H)
    counters = DeviceArray.from_numpy(np.zeros(3, np.uint32))

    def two_gemvs(w, out):
        gu([w["g"], w["u"], x], act, FFN)
        d([w["d"], act, r], out, H)

    def persistent(knobs):
        spec = ops_gemv.ffn_spec(H, FFN, **knobs)
        fn = ops_gemv._ffn_function(spec)
        grid, block, shared = ops_gemv.ffn_geometry(spec)

        def go(w, out):
            launch(fn, grid, block, w["g"], w["u"], w["d"], x, r, act, out, counters,
                   shared=shared, stream=torch.cuda.current_stream(), pdl=spec.pdl)
        return spec, fn, go

    def timed(ffn):
        t_ffn = BG._time_graph(torch, lambda i: ffn(W[i % N_LAYERS], y2), calls=2 * N_LAYERS)

        def layer(i):
            w = W[i % N_LAYERS]
            qkv([w["qkv"], x], yq, QKV)
            o([w["o"], x, r], y1, H)
            ffn(w, y2)
        t_layer = BG._time_graph(torch, layer, calls=2 * N_LAYERS)
        return t_ffn * 1e6, t_layer * 1e6

    def result(ffn):
        y2.fill_(float("nan"))
        ffn(W[0], y2)
        torch.cuda.synchronize()
        return y2.double().cpu().numpy()

    print(f"{torch.cuda.get_device_name()}, {sms} SMs, copy {bw / 1e9:.0f} GB/s; FFN "
          f"{ffn_bytes / 1e6:.1f} MB (floor {floors['ffn']:.2f} us), layer "
          f"{layer_bytes / 1e6:.1f} MB (floor {floors['layer']:.2f} us)", flush=True)
    ref = result(two_gemvs)
    rows = []

    def report(name, ffn, extra=None):
        ts = [timed(ffn) for _ in range(2)]
        t_ffn, t_layer = min(t[0] for t in ts), min(t[1] for t in ts)
        got = result(ffn)
        diff = (float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
                if np.all(np.isfinite(got)) else float("inf"))
        row = dict(name=name, ffn_us=t_ffn, ffn_share=floors["ffn"] / t_ffn, layer_us=t_layer,
                   layer_share=floors["layer"] / t_layer, rel_diff=diff, **(extra or {}))
        rows.append(row)
        print(f"{name:<28} FFN {t_ffn:7.2f} us {row['ffn_share']:6.1%}   layer {t_layer:7.2f} us "
              f"{row['layer_share']:6.1%}   diff {diff:.1e}  {extra or ''}", flush=True)

    report("two GEMVs (default)", two_gemvs)
    for name, knobs in {"persistent (default)": {}, **variants}.items():
        try:
            spec, fn, go = persistent(knobs)
        except ValueError as e:
            print(f"{name:<28} not built: {e}")
            continue
        report(name, go, dict(regs=fn.num_regs, shared=spec.shared_bytes))
    out = dict(device=torch.cuda.get_device_name(), copy_bw_gbps=bw / 1e9, floors_us=floors,
               rows=rows)
    if argv:
        with open(argv[0], "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
