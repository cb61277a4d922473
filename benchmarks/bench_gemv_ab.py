"""Knob A/B for the quantized GEMV: variants of one shape timed in alternating rounds.

``python -m benchmarks.bench_gemv_ab CONFIG.json [--rounds N]`` on a GPU
with torch.  The config names shapes and, for each, the variants to compare
(``default_plan`` overrides; ``{}`` is the default)::

    {"shapes": [{"qtype": "Q4_K", "m": 4096, "k": 14336, "epi": "none",
                 "variants": {"default": {}, "rows8": {"rows": 8}}}]}

Every variant of a shape is built and checked (sampled rows against the
float64 reference; residual epilogues are checked without the residual, so
their error column is large by design) before any is timed; then each round
times every variant once, as ``make bench`` times a GEMV (a CUDA graph of
20 PDL launches, weights rotated past the L2), so drifts in clock or
temperature fall on all variants alike.  Prints one line per variant: grid,
error, the time of each round (µs) and the best round's share of a
device-to-device copy measured at the start.  Results for the docs come from
``make bench``; this is for choosing knobs.
"""

from __future__ import annotations

import argparse
import json
import math

from ptxgen.kernels import gemv as G

from . import bench_gemv as B

__all__ = ["run"]


def run(config: dict, rounds: int = 3, out=print) -> list[dict]:
    """Time every variant of every shape of ``config``; returns one dict per
    variant (``us``: the rounds' times in µs) and prints the table."""
    import torch
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    bw, _ = B.copy_bandwidth(torch)
    out(f"copy {bw / 1e12:.3f} TB/s")
    results = []
    for shape in config["shapes"]:
        qt, m, k = shape.get("qtype", "Q4_K"), shape["m"], shape["k"]
        epi = shape.get("epi", "none")
        nm = 2 if epi == "swiglu" else 1
        bw_, bb_ = G.read_unit(qt)
        nbytes = nm * m * (k // bw_ * bb_)
        copies = max(1, math.ceil(B.L2_DEFEAT_BYTES / nbytes))
        wl = [[B._random_weights(torch, qt, m, k, gen) for _ in range(nm)]
              for _ in range(copies)]
        x = torch.randn(k, device="cuda", generator=gen) * (0.1 if nm == 2 else 1.0)
        ys = [torch.full((m,), float("nan"), device="cuda") for _ in range(4)]
        rr = [torch.randn(m, device="cuda", generator=gen)] if epi == "residual" else []
        read = nbytes + 4 * (k + m)
        built = {}
        for name, knobs in shape["variants"].items():
            try:
                spec, go = B._launcher(torch, qt, k, epi, m=m, **knobs)
            except ValueError as e:
                out(f"{qt} {m}x{k} {epi} {name}: refused: {e}")
                continue
            go([*wl[0], x, *rr], ys[0], m)
            torch.cuda.synchronize()
            err = B._check_rows(torch, qt, wl[0][0], x, ys[0],
                                extra=wl[0][1] if nm == 2 else None)
            built[name] = (spec, go, err)
        times = {n: [] for n in built}
        for _ in range(rounds):
            for n, (spec, go, err) in built.items():
                times[n].append(B._time_graph(
                    torch, lambda i, go=go: go([*wl[i % copies], x, *rr], ys[i % 4], m)))
        for n, (spec, go, err) in built.items():
            grid = G.launch_geometry(spec, m).grid[0]
            us = [t * 1e6 for t in times[n]]
            share = read / min(times[n]) / bw
            out(f"{qt} {m}x{k} {epi} {n:14s} grid {grid:5d} err {err:.1e}: "
                + " ".join(f"{t:.2f}" for t in us) + f" us ({share:.1%})  {spec.kernel_name}")
            results.append(dict(qtype=qt, m=m, k=k, epi=epi, variant=n, spec=repr(spec),
                                grid=grid, rel_err=err, us=us, copy_share=share))
        del wl
        torch.cuda.empty_cache()
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_gemv_ab",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("config", help="JSON file: {'shapes': [{qtype, m, k, epi, variants}]}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    with open(a.config) as f:
        config = json.load(f)
    res = run(config, a.rounds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
