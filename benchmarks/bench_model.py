"""Decode-step benchmark of a Llama-3-8B-shaped Q4_K model (GPU).

``python -m benchmarks.bench_model [OUT.json] [--gguf PATH]`` writes the
synthetic model (32 layers, hidden 4096, FFN 14336, 32/8 heads, vocab
128256; Q4_K weights, Q6_K output) unless ``--gguf`` names one, then times
the decode step at contexts 128 and 4096 in eager mode (one Python launch
per op) and graph mode (one CUDA-graph replay per token), in three
configurations: "plain" (no programmatic dependent launch), "default" (PDL
on sm_90+) and "fused_norm" (PDL and the RMSNorms folded into the GEMVs).

The bandwidth floor of a step is the bytes it must read (every weight except
the embedding table, of which one row is read, plus the K and V cache rows
up to the context) over a device-to-device copy's bandwidth measured in the
same run (bytes read + written / time).

``python -m benchmarks.bench_model OUT.json --sampler [--gguf PATH]`` times
the sampler inside the decode step instead (:func:`run_sampler`): the graph
replay of the ``"greedy"`` step (argmax) against the ``"sample"`` step
(the sampler kernel in its place) with top-p/min-p settings, in alternating
rounds on one model, at contexts 128 and 4096.  The synthetic model's
logits are flatter than a trained model's, so top-p keeps more tokens than
it would on real text (the sampler's worse case).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time

import numpy as np

__all__ = ["run_all"]


def _copy_bandwidth(rounds: int = 3) -> float:
    """The device's copy ceiling (:func:`ptxgen.driver.timing.copy_ceiling`)."""
    from ptxgen.driver.timing import copy_ceiling
    return copy_ceiling(rounds)


def _step_bytes(model, ctx: int) -> int:
    """What one decode step at context ``ctx`` must read
    (:func:`ptxgen.llm.bench.step_read_bytes`)."""
    from ptxgen.llm.bench import step_read_bytes
    return step_read_bytes(model.file, [ctx])


def _set_context(model, ctx: int):
    from ptxgen.kernels import decode_state as ds
    st = np.zeros(ds.STATE_WORDS, np.int32)
    st[ds.TOKEN] = 1
    st[ds.POS] = ctx - 1
    st[ds.KV_LEN] = ctx
    st[ds.PROMPT_LEN] = 0
    model.executor.write(model.step_graph.state, st)
    model.backend.synchronize()


def _measure(model, ctx: int, mode: str, n: int = 30, variant: str | None = None) -> float:
    from ptxgen import driver
    _set_context(model, ctx)
    s = model.device_stream
    for _ in range(3):
        model.step(mode, variant)
    s.synchronize()
    _set_context(model, ctx)
    if mode == "graph":
        e0, e1 = driver.Event(), driver.Event()
        e0.record(s)
        for _ in range(n):
            model.step(mode, variant)
        e1.record(s)
        e1.synchronize()
        return e0.elapsed_ms(e1) / 1e3 / n
    t0 = time.perf_counter()
    for _ in range(n):
        model.step(mode, variant)
    s.synchronize()
    return (time.perf_counter() - t0) / n


def _stream_gate_up(m, k, epilogue):
    return (dict(stages=3, rows=2, max_ctas=792, min_ctas=0)
            if epilogue == "swiglu" else {})


@contextlib.contextmanager
def _without(kinds):
    """While open, ops of the given kinds (``"RmsNorm"``, ``"Attention"`` ...)
    join a graph with no launches: an ablation for timing only (the step's
    numbers are then garbage; what the other kernels read is not)."""
    from ptxgen.driver.executor import ComputeGraph
    add = ComputeGraph.add
    kinds = frozenset(kinds)

    def add_without(self, kind, name, inputs, outputs, launches, **kw):
        return add(self, kind, name, inputs, outputs, () if kind in kinds else launches, **kw)
    ComputeGraph.add = add_without
    try:
        yield
    finally:
        ComputeGraph.add = add


def _write_model(tmp) -> str:
    from ptxgen.llm.gguf.synth import write_synthetic_llama
    path = os.path.join(tmp, "llama3-8b-q4k.gguf")
    t0 = time.perf_counter()
    write_synthetic_llama(path, n_layers=32, hidden=4096, ffn=14336, n_heads=32,
                          n_kv_heads=8, vocab=128256, context_length=8192,
                          rope_theta=500000.0, qtype="Q4_K", output_qtype="Q6_K", seed=7)
    print(f"wrote synthetic model in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


#: the sampler settings timed against greedy (llama.cpp's flags in the names)
SAMPLER_CASES = {
    "top_p0.95_min_p0.05": dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.05),
    "llamacpp_default": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                             repeat_penalty=1.1, repeat_last_n=64),
    "top_p0.95": dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
    "min_p0.05": dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.05),
}


def run_sampler(gguf_path: str | None = None, contexts=(128, 4096), rounds: int = 3,
                cases=None) -> dict:
    """The decode step (graph replay) with greedy decoding and with each of
    ``cases`` (name -> SamplingSettings keywords), in ``rounds`` alternating
    rounds per context on one model; each row gives the median ms/token and
    the ratio to greedy's median in the same context."""
    from ptxgen.driver import get_device
    from ptxgen.llm.generation import SamplingSettings
    from ptxgen.llm import Model
    cases = dict(SAMPLER_CASES if cases is None else cases)
    tmp = None
    if gguf_path is None:
        tmp = tempfile.mkdtemp(prefix="ptxgen-bench-")
        gguf_path = _write_model(tmp)
    model = Model.from_gguf(gguf_path, backend="cuda", capacity=max(contexts) + 64,
                                 progress=False, tokenizer=False)
    out = {"device": get_device().name, "rounds": rounds, "rows": [],
           "launches_per_token": {v: model.graph.launch_count_of(v)
                                  for v in model.graph.variants}}
    print(f"{'context':>8}{'settings':>22}{'ms/token':>10}{'vs greedy':>11}")
    for ctx in contexts:
        times = {"greedy": []}
        for name in cases:
            times[name] = []
        for _ in range(rounds):
            times["greedy"].append(_measure(model, ctx, "graph", variant="greedy"))
            for name, kw in cases.items():
                model.executor.write(model.step_graph.sampling_params, SamplingSettings(**kw).params(1234))
                model.backend.synchronize()
                times[name].append(_measure(model, ctx, "graph", variant="sample"))
        base = float(np.median(times["greedy"]))
        for name, ts in times.items():
            t = float(np.median(ts))
            row = {"context": ctx, "settings": name, "sampling": cases.get(name, {}),
                   "seconds_per_token": t, "all_seconds": ts, "ratio_to_greedy": t / base}
            out["rows"].append(row)
            print(f"{ctx:>8}{name:>22}{t * 1e3:>10.3f}{t / base:>11.4f}", flush=True)
    if tmp:
        os.remove(gguf_path)
    return out


def run_all(gguf_path: str | None = None, contexts=(128, 4096), configs=None,
            modes=("eager", "graph")) -> dict:
    """Decode-step timings per configuration (``configs``: name ->
    :class:`Model` keyword arguments; default: the ones below).  A
    configuration's ``"drop"`` entry (op kinds) builds the model without
    those ops' launches, to time what they cost (:func:`_without`)."""
    from ptxgen.llm import Model
    tmp = None
    if gguf_path is None:
        tmp = tempfile.mkdtemp(prefix="ptxgen-bench-")
        gguf_path = _write_model(tmp)
    from ptxgen.driver import get_device
    # "plain": no programmatic dependent launch; "default": PDL where the
    # device has it, the attention RMSNorm folded into the Q/K/V GEMV;
    # "fused_norm" / "no_fused_norm": every RMSNorm folded / none
    if configs is None:
        configs = {"plain": dict(pdl=False)}
        configs["default"] = {}
        configs["fused_norm"] = dict(fuse_norm=True)
        configs["no_fused_norm"] = dict(fuse_norm=False)
        # the fused gate/up GEMV through the cp.async ring (faster on its own,
        # not when followed by the down projection: the git history of
        # docs/notes/gemv.md)
        configs["stream_gate_up"] = dict(gemv_knobs=_stream_gate_up)
    copy_bw = _copy_bandwidth()
    out = {"device": get_device().name, "copy_bandwidth_GBps": copy_bw / 1e9, "rows": []}
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write)")
    for config, kw in configs.items():
        t0 = time.perf_counter()
        kw = dict(kw)
        with _without(kw.pop("drop", ())):
            model = Model.from_gguf(gguf_path, backend="cuda", capacity=max(contexts) + 64,
                                         progress=False, **kw)
        load_s = time.perf_counter() - t0
        out.update(launches_per_token=model.graph.launch_count,
                   weight_bytes=model.file.weight_bytes)
        out["load_seconds"] = load_s
        print(f"model ({config}: pdl={model.pdl}, fuse_norm={model.fuse_norm}) loaded in "
              f"{load_s:.1f} s; {model.graph.launch_count} launches per token")
        print(f"{'context':>8}{'mode':>7}{'config':>14}{'ms/token':>10}{'tokens/s':>10}{'GB read':>9}"
              f"{'floor ms':>10}{'share':>8}")
        for ctx in contexts:
            nbytes = _step_bytes(model, ctx)
            floor = nbytes / copy_bw
            for mode in modes:
                t = _measure(model, ctx, mode)
                row = {"context": ctx, "mode": mode, "config": config, "pdl": model.pdl,
                       "fuse_norm": model.fuse_norm, "launches_per_token": model.graph.launch_count,
                       "seconds_per_token": t,
                       "tokens_per_second": 1 / t, "bytes_per_token": nbytes,
                       "floor_seconds": floor, "share_of_floor": floor / t}
                out["rows"].append(row)
                print(f"{ctx:>8}{mode:>7}{config:>14}{t * 1e3:>10.3f}{1 / t:>10.1f}"
                      f"{nbytes / 1e9:>9.2f}{floor * 1e3:>10.3f}{floor / t:>8.1%}", flush=True)
        del model
        import gc
        gc.collect()
    if tmp:
        os.remove(gguf_path)
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    path = None
    if "--gguf" in argv:
        i = argv.index("--gguf")
        path = argv[i + 1]
        del argv[i:i + 2]
    sampler = "--sampler" in argv
    if sampler:
        argv.remove("--sampler")
    res = run_sampler(path) if sampler else run_all(path)
    if argv:
        with open(argv[0], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
