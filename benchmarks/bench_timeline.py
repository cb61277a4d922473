"""Where a decode step's time goes between and inside its kernels.

``python -m benchmarks.bench_timeline [--contexts 128,4096] [--gguf MODEL]`` loads
the Llama-3-8B-shaped synthetic model of :mod:`bench_model` with every kernel
instrumented (:mod:`ptxgen.driver.timeline`), replays one decode step from its
CUDA graph and prints, per op kind averaged over the layers:

* ``ramp``: from the previous launch's last CTA end to this launch's first
  CTA passing ``griddepcontrol.wait`` (how long the dependency takes to
  resolve; PDL launches are already resident then, so this is the
  completion-to-release latency, not a launch);
* ``early``: how long before the previous launch's last end this launch's
  first CTA started (PDL's head start: weight loads issued before the wait);
* ``span``: first wait release to last CTA end (the launch's own time once
  its inputs are ready);
* ``tail``: last CTA end minus the median CTA end (the stragglers);
* ``floor``: the bytes the launch must read over the copy bandwidth, for the
  weight GEMVs;
* ``late``: the share of CTAs that started after the launch's first CTA had
  ended (a second wave), ``/SM`` the most CTAs one SM ran.

The step time with instrumentation is printed beside the plain graph's, so
the records' own cost is visible.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from collections import defaultdict

import numpy as np

from ptxgen.driver import timeline

def _step_ms(model, ctx, n=30):
    from .bench_model import _measure
    return _measure(model, ctx, "graph", n) * 1e3


def _launches(model):
    """The step's launches in order: (op kind, op name, module, kernel index, CTAs)."""
    ex = model.executor
    out = []
    for op in model.graph.ops:
        for L in op.launches:
            mod = ex._modules[(L.family, L.spec)]
            ctas = int(np.prod(L.geometry.grid))
            out.append((op.kind, op.name, mod, mod.names.index(L.kernel), ctas, L))
    return out


def collect(model, ctx):
    """One graph replay's per-launch summaries (ns, relative to the step's first start)."""
    from .bench_model import _set_context
    launches = _launches(model)
    mods = {id(m): m for _, _, m, _, _, _ in launches}
    _set_context(model, ctx)
    model.step("graph")
    model.device_stream.synchronize()
    _set_context(model, ctx)
    for m in mods.values():
        timeline.reset(m)
    model.step("graph")
    model.device_stream.synchronize()
    recs = {k: timeline.read(m) for k, m in mods.items()}
    cursor = defaultdict(int)
    rows = []
    for kind, name, mod, kidx, ctas, L in launches:
        r = recs[id(mod)]
        j = cursor[(id(mod), kidx)]
        cursor[(id(mod), kidx)] = j + 1
        part = r[(r["kernel"] == kidx) & (r["launch"] == j)]
        if len(part) != ctas:
            raise RuntimeError(f"{name}: {len(part)} records for {ctas} CTAs")
        rows.append(dict(kind=kind, name=name, kernel=L.kernel, ctas=ctas,
                         sms=len(np.unique(part["sm"])),
                         start0=int(part["start"].min()), start1=int(part["start"].max()),
                         wait0=int(part["wait"].min()), wait1=int(part["wait"].max()),
                         end_med=int(np.median(part["end"])), end1=int(part["end"].max()),
                         end0=int(part["end"].min()), launch=L,
                         late=float(np.mean(part["start"] > part["end"].min())),
                         per_sm=int(np.bincount(part["sm"]).max())))
    t0 = min(x["start0"] for x in rows)
    for x in rows:
        for f in ("start0", "start1", "wait0", "wait1", "end_med", "end1", "end0"):
            x[f] -= t0
    stamps = np.unique(np.concatenate([np.r_[r["start"], r["wait"], r["end"]] for r in recs.values()]))
    gran = int(np.diff(stamps).min()) if len(stamps) > 1 else 0
    return rows, gran


def _kind_of(x):
    """A label per distinct launch role (op kind, plus the kernel for multi-launch ops)."""
    name = re.sub(r"\d+", "#", x["name"])
    return f"{x['kind']}:{name}" + (":" + x["kernel"].rsplit("_", 1)[-1]
                                    if x["kind"] == "Attention" else "")


def summarize(rows, copy_bw=None, file=None):
    groups = defaultdict(list)
    prev = None
    for x in rows:
        if prev is not None:
            x["ramp"] = x["wait0"] - prev["end1"]
            x["early"] = prev["end1"] - x["start0"]
        else:
            x["ramp"] = x["early"] = 0
        x["span"] = x["end1"] - x["wait0"]
        x["tail"] = x["end1"] - x["end_med"]
        groups[_kind_of(x)].append(x)
        prev = x
    print(f"{'launch':<40}{'n':>4}{'CTAs':>6}{'SMs':>5}{'ramp':>8}{'early':>8}{'span':>8}"
          f"{'tail':>8}{'floor':>8}{'late':>6}{'/SM':>5}   (us, mean per launch)", file=file)
    total = defaultdict(float)
    for key, xs in groups.items():
        mean = {f: np.mean([x[f] for x in xs]) / 1e3 for f in ("ramp", "early", "span", "tail")}
        floor = ""
        nb = xs[0].get("bytes")
        if nb and copy_bw:
            floor = f"{nb / copy_bw * 1e6:8.2f}"
        print(f"{key[:40]:<40}{len(xs):>4}{xs[0]['ctas']:>6}{xs[0]['sms']:>5}"
              f"{mean['ramp']:8.2f}{mean['early']:8.2f}{mean['span']:8.2f}{mean['tail']:8.2f}"
              f"{floor:>8}{np.mean([x['late'] for x in xs]):6.2f}{xs[0]['per_sm']:5d}", file=file)
        for f in ("ramp", "span"):
            total[f] += sum(x[f] for x in xs) / 1e3
    step = (rows[-1]["end1"] - rows[0]["start0"]) / 1e3
    print(f"step (first start to last end) {step:.1f} us: spans {total['span']:.1f} us, "
          f"ramps {total['ramp']:.1f} us", file=file)
    return groups


def _weight_bytes(model, rows):
    """Attach each MulMat launch's weight bytes (its weight buffers' sizes)."""
    for x in rows:
        L = x["launch"]
        nb = 0
        for a in L.args:
            b = getattr(a, "buffer", a)
            if getattr(b, "kind", None) == "weight" and getattr(b, "dtype", None) is not None \
                    and np.dtype(b.dtype) == np.uint8:
                nb += int(np.prod(b.shape))
        if nb and x["kind"] != "Embedding":
            x["bytes"] = nb


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128", help="comma-separated context lengths")
    ap.add_argument("--gguf", default=None, help="model file (default: the synthetic 8B shape)")
    ap.add_argument("--layer", type=int, default=1, help="print this layer's launches in full")
    ap.add_argument("--drop", default="", help="comma-separated op kinds built without launches "
                    "(an ablation, as bench_model's configs' \"drop\")")
    ap.add_argument("--fuse-norm", default=None,
                    help="RMSNorms folded into the GEMVs after them (Model's fuse_norm): "
                         "all, none, or a comma list of attn,ffn,output (default: the model's)")
    ap.add_argument("--gemv-knobs", default="{}",
                    help='Q4_K GEMV spec overrides per epilogue as JSON, e.g. '
                    '\'{"swiglu": {"per_sm": 4}}\' (Model\'s gemv_knobs)')
    ap.add_argument("--flash-knobs", default="{}",
                    help='FlashDecodeSpec overrides as JSON, e.g. \'{"per_sm": 2}\' '
                    "(Model's flash_knobs)")
    ap.add_argument("--no-fuse-rope", action="store_true",
                    help="RoPE and the KV append as a launch of their own (fuse_rope=False)")
    args = ap.parse_args(argv)
    per_epi = json.loads(args.gemv_knobs)
    if not isinstance(per_epi, dict) or not all(isinstance(v, dict) for v in per_epi.values()):
        ap.error(f"--gemv-knobs: a JSON object of epilogue -> overrides, got {args.gemv_knobs!r}")
    from .bench_common import copy_bandwidth
    from .bench_model import _without
    from ptxgen.llm.gguf.synth import write_synthetic_llama
    from ptxgen.llm import Model
    path = args.gguf
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="ptxgen-timeline-"), "llama3-8b-q4k.gguf")
        write_synthetic_llama(path, n_layers=32, hidden=4096, ffn=14336, n_heads=32,
                              n_kv_heads=8, vocab=128256, context_length=8192,
                              rope_theta=500000.0, qtype="Q4_K", output_qtype="Q6_K", seed=7)
    copy_bw = copy_bandwidth()[0]
    contexts = [int(c) for c in args.contexts.split(",")]
    cap = max(contexts) + 64
    drop = [k for k in args.drop.split(",") if k]
    fuse = ({} if args.fuse_norm is None else
            {"fuse_norm": {"all": True, "none": False}.get(args.fuse_norm,
                                                           args.fuse_norm.split(","))})
    load = dict(backend="cuda", capacity=cap, progress=False, **fuse,
                gemv_knobs=lambda m, k, epilogue: per_epi.get(epilogue, {}),
                flash_knobs=json.loads(args.flash_knobs), fuse_rope=not args.no_fuse_rope)
    with _without(drop):
        plain = Model.from_gguf(path, **load)
    t_plain = {c: _step_ms(plain, c) for c in contexts}
    del plain
    with timeline.instrumenting(), _without(drop):
        model = Model.from_gguf(path, **load)
    out = {}
    for ctx in contexts:
        t_inst = _step_ms(model, ctx)
        rows, gran = collect(model, ctx)
        _weight_bytes(model, rows)
        out[ctx] = rows
        print(f"\ncopy {copy_bw / 1e9:.0f} GB/s; context {ctx}; step {t_plain[ctx] * 1e3:.1f} us "
              f"(plain graph), {t_inst * 1e3:.1f} us instrumented; %globaltimer step {gran} ns; "
              f"{len(rows)} launches")
        summarize(rows, copy_bw)
        per_layer = [x for x in rows if f"blk.{args.layer}." in x["name"]]
        if per_layer:
            print(f"\nlayer {args.layer} (us from the step's first start):")
            print(f"{'launch':<34}{'start0':>8}{'start1':>8}{'wait0':>8}{'wait1':>8}{'end0':>8}"
                  f"{'end_med':>8}{'end1':>8}")
            for x in per_layer:
                print(f"{(x['name'] + ':' + x['kernel'].rsplit('_', 1)[-1])[:34]:<34}"
                      + "".join(f"{x[f] / 1e3:8.2f}" for f in
                                ("start0", "start1", "wait0", "wait1", "end0", "end_med", "end1")))
    return out


if __name__ == "__main__":
    main()
