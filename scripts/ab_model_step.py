#!/usr/bin/env python3
"""Time a model's decode step and prompt in whichever ptxgen tree is
importable, for A/B runs of two trees on one GPU (each installed apart and
put first on PYTHONPATH in turn):

    python3 scripts/ab_model_step.py MODEL.gguf --label new --json out.json
        [--contexts 128,4096] [--prompts 512,4096] [--steps 40] [--rounds 3]

Works with the tree before the runner moved to ``ptxgen.llm`` (LlamaModel,
``--api driver``) and after (Model, the default).  Decode: CUDA-event time of ``steps`` graph replays at
each context, the median of ``rounds``; the read floor is the bytes one step
must read (every weight but the embedding, of which one row, plus the K/V
rows up to the context) over a device-to-device copy's bandwidth (read +
written) measured in the same process.  Prompt: the seconds to the first
new token of a random prompt of each length (after one warm-up prompt),
and its tokens per second (``GenerateResult.prompt_tokens_per_second``).
Prints one JSON object; appends it to ``--json`` when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def _model_class(api):
    if api == "llm":
        from ptxgen.llm import Model
        return Model, "ptxgen.llm.Model"
    from ptxgen.driver.model.llama import LlamaModel
    return LlamaModel, "ptxgen.driver.model.llama.LlamaModel"


def _state(model):
    sg = getattr(model, "step_graph", None)
    return sg.state if sg is not None else model.state


def _stream(model):
    return getattr(model, "device_stream", None) or model._stream


def _set_context(model, ctx):
    from ptxgen.kernels import decode_state as ds
    st = np.zeros(ds.STATE_WORDS, np.int32)
    st[ds.TOKEN], st[ds.POS], st[ds.KV_LEN] = 1, ctx - 1, ctx
    model.executor.write(_state(model), st)
    model.backend.synchronize()


def _step_seconds(model, ctx, steps):
    from ptxgen import driver
    _set_context(model, ctx)
    s = _stream(model)
    for _ in range(3):
        model.step("graph")
    s.synchronize()
    _set_context(model, ctx)
    e0, e1 = driver.Event(), driver.Event()
    e0.record(s)
    for _ in range(steps):
        model.step("graph")
    e1.record(s)
    e1.synchronize()
    return e0.elapsed_ms(e1) / 1e3 / steps


def _step_bytes(model, ctx):
    hp, f = model.hp, model.file
    total = 0
    for name in f.names:
        t = f.tensor(name)
        total += t.data.nbytes // t.data.shape[0] if name == "token_embd.weight" else t.data.nbytes
    return total + 2 * hp.n_layers * hp.n_kv_heads * ctx * hp.head_dim * 2


def _copy_bandwidth():
    from cuda.bindings import driver as cu
    from ptxgen.driver import DeviceArray, Event, Stream
    from ptxgen.driver.errors import check
    n = 1 << 30
    a, b = DeviceArray.empty((n,), np.uint8), DeviceArray.empty((n,), np.uint8)
    s = Stream()
    best = 0.0
    for _ in range(3):
        ts = []
        for _ in range(12):
            e0, e1 = Event(), Event()
            e0.record(s)
            check(cu.cuMemcpyDtoDAsync(b.ptr, a.ptr, n, s.handle), "cuMemcpyDtoDAsync")
            e1.record(s)
            e1.synchronize()
            ts.append(e0.elapsed_ms(e1) / 1e3)
        best = max(best, 2 * n / statistics.median(ts[2:]))
    a.free()
    b.free()
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--contexts", default="128,4096")
    ap.add_argument("--prompts", default="512,4096")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--api", choices=("llm", "driver"), default="llm",
                    help="ptxgen.llm.Model, or the older tree's LlamaModel")
    a = ap.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",") if c]
    prompts = [int(c) for c in a.prompts.split(",") if c]
    cls, api = _model_class(a.api)
    cap = max(contexts + [p + 8 for p in prompts]) + 64
    t0 = time.perf_counter()
    m = cls.from_gguf(a.model, backend="cuda", capacity=cap, progress=False, tokenizer=False)
    out = {"label": a.label, "api": api, "model": a.model, "arch": m.hp.arch,
           "load_s": time.perf_counter() - t0, "launches_per_token": m.graph.launch_count,
           "copy_bytes_per_s": _copy_bandwidth(), "decode": [], "prompt": []}
    from ptxgen.driver import get_device
    out["device"] = get_device().name
    for ctx in contexts:
        ts = [_step_seconds(m, ctx, a.steps) for _ in range(a.rounds)]
        t = statistics.median(ts)
        floor = _step_bytes(m, ctx) / out["copy_bytes_per_s"]
        out["decode"].append({"context": ctx, "ms_per_token": t * 1e3, "all_ms": [x * 1e3 for x in ts],
                              "tokens_per_s": 1 / t, "floor_ms": floor * 1e3,
                              "share_of_floor": floor / t})
    rng = np.random.default_rng(0)
    for n in prompts:
        prompt = [int(x) for x in rng.integers(0, m.hp.vocab, n)]
        m.generate(prompt, 1)                    # warm-up: the chunk graphs are captured
        rs = [m.generate(prompt, 1) for _ in range(a.rounds)]
        secs = statistics.median(r.prompt_seconds for r in rs)
        out["prompt"].append({"tokens": n, "first_token_s": secs,
                              "tokens_per_s": statistics.median(r.prompt_tokens_per_second
                                                                for r in rs)})
    print(json.dumps(out))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(out) + "\n")
    for d in out["decode"]:
        print(f"# {a.label} {m.hp.arch} ctx {d['context']}: {d['ms_per_token']:.3f} ms/token "
              f"({d['tokens_per_s']:.1f} tok/s, {100 * d['share_of_floor']:.1f}% of floor)",
              file=sys.stderr)
    for p in out["prompt"]:
        print(f"# {a.label} {m.hp.arch} prompt {p['tokens']}: {p['tokens_per_s']:.0f} tok/s, "
              f"first token {p['first_token_s']:.3f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
