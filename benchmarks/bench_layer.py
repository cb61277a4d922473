"""One Llama-3-8B layer's four Q4_K GEMVs as a chain, and grid-sizing variants.

``python -m benchmarks.bench_layer [--extra]``: QKV (6144×4096), O + residual
(4096×4096), gate/up + SwiGLU (2 × 14336×4096) and down + residual (4096×14336),
launched with programmatic dependent launch and replayed from a CUDA graph,
over 8 layers of distinct random weights (so L2 does not serve them); time
per layer and share of the floor (the layer's weight bytes over a device
copy's bandwidth measured in the same run).  Variants size each GEMV's grid
to whole waves from the driver's occupancy (``max_ctas = resident CTAs per SM
x SMs``, with ``min_ctas`` raising the CTAs per SM); ``--extra`` adds row and
ring variants; ``main(variants=...)`` times the given ones instead (name ->
{gemv: knobs}, or a function of the SM count giving that).  Its first
results are in the git history of docs/results.md ("Inside the decode
step", 2026-11-22).
"""

from __future__ import annotations

import json
import sys

import numpy as np

N_LAYERS = 8
H, FFN, QKV = 4096, 14336, 6144
SHAPES = dict(qkv=(QKV, H, "none"), o=(H, H, "residual"), gu=(FFN, H, "swiglu"),
              d=(H, FFN, "residual"))


def main(argv=None, variants=None):
    import torch

    from ptxgen.kernels import gemv as G

    from . import bench_gemv as BG
    from ptxgen.driver import ops_gemv
    from .bench_common import copy_bandwidth
    from ptxgen.driver.ops_decode import _resident
    argv = sys.argv[1:] if argv is None else argv
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    W = [dict(qkv=BG._random_weights(torch, "Q4_K", QKV, H, gen),
              o=BG._random_weights(torch, "Q4_K", H, H, gen),
              g=BG._random_weights(torch, "Q4_K", FFN, H, gen),
              u=BG._random_weights(torch, "Q4_K", FFN, H, gen),
              d=BG._random_weights(torch, "Q4_K", H, FFN, gen)) for _ in range(N_LAYERS)]
    x = torch.randn(H, device="cuda", generator=gen)
    r = torch.randn(H, device="cuda", generator=gen)
    yq, act = torch.empty(QKV, device="cuda"), torch.empty(FFN, device="cuda")
    y1, y2 = torch.empty(H, device="cuda"), torch.empty(H, device="cuda")
    nbytes = sum(w.numel() for w in W[0].values())
    bw = copy_bandwidth()[0]
    floor = nbytes / bw * 1e6

    def occ(m, k, ep, knobs):
        spec = ops_gemv.gemv_spec("Q4_K", k, ep, m=m, **knobs)
        fn = ops_gemv._function(spec)
        geo = G.launch_geometry(spec, m)
        return _resident(fn, geo.block[0], geo.shared) or 1, geo.grid[0], fn.num_regs

    def layer_us(knobs):
        L = {n: BG._launcher(torch, "Q4_K", k, ep, m=m, **knobs.get(n, {}))[1]
             for n, (m, k, ep) in SHAPES.items()}

        def fn(i):
            w = W[i % N_LAYERS]
            L["qkv"]([w["qkv"], x], yq, QKV)
            L["o"]([w["o"], x, r], y1, H)
            L["gu"]([w["g"], w["u"], x], act, FFN)
            L["d"]([w["d"], act, r], y2, H)
        return BG._time_graph(torch, fn, calls=2 * N_LAYERS) * 1e6

    print(f"{sms} SMs, copy {bw / 1e9:.0f} GB/s, layer {nbytes / 1e6:.1f} MB, floor {floor:.2f} us")
    for n, (m, k, ep) in SHAPES.items():
        print(f"{n}: default resident CTAs/SM, grid, registers = {occ(m, k, ep, {})}")
    res = {}

    def run(name, knobs):
        t = min(layer_us(knobs) for _ in range(2))
        res[name] = t
        print(f"{name:<40} {t:8.2f} us  {floor / t * 100:5.1f}% of floor", flush=True)

    run("default", {})
    run("default (again)", {})
    if variants:
        # name -> {gemv: knobs} (a callable gets the SM count)
        for name, knobs in variants.items():
            run(name, knobs(sms) if callable(knobs) else knobs)
        print(json.dumps(res))
        return res
    for n, (m, k, ep) in SHAPES.items():
        o, _, _ = occ(m, k, ep, {})
        run(f"{n}:wave{o}", {n: dict(max_ctas=o * sms)})
        for mc in (o + 1, o + 2):
            o2, _, regs = occ(m, k, ep, dict(min_ctas=mc))
            run(f"{n}:min{mc}->occ{o2},regs{regs}", {n: dict(min_ctas=mc, max_ctas=o2 * sms)})
    if "--extra" in argv:
        run("gu:ring R2S3C792", {"gu": dict(stages=3, rows=2, max_ctas=792, min_ctas=0)})
        run("d:rows8", {"d": dict(rows=8)})
        run("qkv:rows4", {"qkv": dict(rows=4)})
        run("qkv:rows4 wave", {"qkv": dict(rows=4, max_ctas=2 * sms)})
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
