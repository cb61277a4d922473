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
    """The device's copy ceiling: the best of ``rounds`` medians.  One
    median once read 2.83 TB/s where every other measurement of the same
    call read 2.98-2.99, which made the shares of the floor look 4 points
    better than they were; the best of three keeps a dip from doing that."""
    from .bench_common import copy_bandwidth
    return max(copy_bandwidth()[0] for _ in range(rounds))


def _step_bytes(model, ctx: int) -> int:
    hp = model.hp
    f = model.file
    total = 0
    for name in f.names:
        t = f.tensor(name)
        if name == "token_embd.weight":
            total += t.data.nbytes // t.data.shape[0]
        else:
            total += t.data.nbytes
    total += 2 * hp.n_layers * hp.n_kv_heads * ctx * hp.head_dim * 2
    return total


def _set_context(model, ctx: int):
    from ptxgen.kernels import decode_state as ds
    st = np.zeros(ds.STATE_WORDS, np.int32)
    st[ds.TOKEN] = 1
    st[ds.POS] = ctx - 1
    st[ds.KV_LEN] = ctx
    st[ds.PROMPT_LEN] = 0
    model.executor.write(model.state, st)
    model.backend.synchronize()


def _measure(model, ctx: int, mode: str, n: int = 30) -> float:
    from ptxgen import driver
    _set_context(model, ctx)
    s = model._stream
    for _ in range(3):
        model.step(mode)
    s.synchronize()
    _set_context(model, ctx)
    if mode == "graph":
        e0, e1 = driver.Event(), driver.Event()
        e0.record(s)
        for _ in range(n):
            model.step(mode)
        e1.record(s)
        e1.synchronize()
        return e0.elapsed_ms(e1) / 1e3 / n
    t0 = time.perf_counter()
    for _ in range(n):
        model.step(mode)
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


def run_all(gguf_path: str | None = None, contexts=(128, 4096), configs=None,
            modes=("eager", "graph")) -> dict:
    """Decode-step timings per configuration (``configs``: name ->
    :class:`LlamaModel` keyword arguments; default: the ones below).  A
    configuration's ``"drop"`` entry (op kinds) builds the model without
    those ops' launches, to time what they cost (:func:`_without`)."""
    from ptxgen.driver.model.gguf_synth import write_synthetic_llama
    from ptxgen.driver.model.llama import LlamaModel
    tmp = None
    if gguf_path is None:
        tmp = tempfile.mkdtemp(prefix="ptxgen-bench-")
        gguf_path = os.path.join(tmp, "llama3-8b-q4k.gguf")
        t0 = time.perf_counter()
        write_synthetic_llama(gguf_path, n_layers=32, hidden=4096, ffn=14336, n_heads=32,
                              n_kv_heads=8, vocab=128256, context_length=8192,
                              rope_theta=500000.0, qtype="Q4_K", output_qtype="Q6_K", seed=7)
        print(f"wrote synthetic model in {time.perf_counter() - t0:.1f} s", flush=True)
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
        # not followed by the down projection: docs/notes/gemv.md, fifth pass)
        configs["stream_gate_up"] = dict(gemv_knobs=_stream_gate_up)
    copy_bw = _copy_bandwidth()
    out = {"device": get_device().name, "copy_bandwidth_GBps": copy_bw / 1e9, "rows": []}
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write)")
    for config, kw in configs.items():
        t0 = time.perf_counter()
        kw = dict(kw)
        with _without(kw.pop("drop", ())):
            model = LlamaModel.from_gguf(gguf_path, backend="cuda", capacity=max(contexts) + 64,
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
    res = run_all(path)
    if argv:
        with open(argv[0], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
