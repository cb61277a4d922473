"""Prefill benchmarks: the chunk attention against torch SDPA (causal,
lower-right aligned for L > 0; both timed as CUDA-graph replays of 20
calls, median of 5 replays, so host time per call is left out) at T = 512,
L = 0 / 4096 / 16384 on the 8B shape (32 query heads, 8 KV heads, head_dim
128), with f32 and f16 output, and (``--sweep``) every config of ``SWEEP``;
then end-to-end prompt tokens/s of the 8B-shaped synthetic Q4_K model at
512 and 4096 tokens (chunk graphs, and eager launches).

    python -m benchmarks.bench_prefill [out.json] [--sweep] [--model PATH.gguf] [--skip-model]
        [--skip-attention]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

#: FlashPrefillConfig variants ``--sweep`` times (the first is the shipped
#: choice for head_dim 128, group 4 on sm_90a, the fourth elsewhere;
#: kernels/tuning/flash_prefill.json)
SWEEP = [
    dict(warps=8, heads=4, block_keys=64, stages=3, kernel="wgmma"),
    dict(warps=8, heads=4, block_keys=64, stages=4, kernel="wgmma"),
    dict(warps=4, heads=4, block_keys=64, stages=3, kernel="wgmma"),
    dict(warps=8, heads=4, block_keys=64, stages=2, kernel="mma"),
    dict(warps=8, heads=4, block_keys=64, stages=3, kernel="mma"),
    dict(warps=4, heads=4, block_keys=64, stages=2, kernel="mma"),
    dict(warps=8, heads=2, block_keys=64, stages=2, kernel="mma"),
    dict(warps=8, heads=1, block_keys=64, stages=2, kernel="mma"),
]


def _graph_time_ptxgen(call, reps, repeats=5):
    """Microseconds per call of ``call``'s launches, ``reps`` of them replayed
    as one CUDA graph (no host time per launch, as in the prefill graph);
    the median of ``repeats`` replays."""
    from ptxgen import driver
    from ptxgen.driver.backend import get_backend, recording
    with recording() as seq:
        call()
    be, s = get_backend("cuda"), driver.Stream()
    with driver.capture(s) as g:
        for _ in range(reps):
            for fn, grid, block, args, shared, pdl in seq:
                be.launch_positional(fn, grid, block, *args, shared=shared, stream=s, pdl=pdl)
    ge = g.instantiate()
    ge.launch(s)
    s.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ge.launch(s)
        s.synchronize()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def _graph_time_torch(call, reps, repeats=5):
    """The same for torch ops (``torch.cuda.CUDAGraph``)."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            call()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def _flops(T, L, nq, d):
    """Causal attention FLOPs (2 matmuls, 2 FLOP a multiply-add) over the
    keys each row sees."""
    return 4.0 * nq * d * sum(L + i + 1 for i in range(T))


def bench_attention(T=512, Ls=(0, 4096, 16384), nq=32, nkv=8, d=128, reps=20, sweep=False):
    """Times and errors per L (a list of dicts, also printed)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from ptxgen.driver import ops
    results = []
    for L in Ls:
        cap = L + T
        torch.manual_seed(L)
        q = torch.randn(T, nq, d, device="cuda", dtype=torch.float32)
        kc = torch.randn(nkv, cap, d, device="cuda", dtype=torch.float16)
        vc = torch.randn(nkv, cap, d, device="cuda", dtype=torch.float16)
        out = torch.full_like(q, float("nan"))
        out16 = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.float16)
        st = torch.tensor([L], dtype=torch.int32, device="cuda")
        nt = torch.tensor([T], dtype=torch.int32, device="cuda")
        qh = q.half().permute(1, 0, 2).unsqueeze(0)               # [1, nq, T, d]
        kr = kc.repeat_interleave(nq // nkv, 0).unsqueeze(0)      # [1, nq, cap, d]
        vr = vc.repeat_interleave(nq // nkv, 0).unsqueeze(0)
        mask = causal_lower_right(T, cap)

        def sdpa():
            F.scaled_dot_product_attention(qh, kr, vr, attn_mask=mask)
        ref = F.scaled_dot_product_attention(qh.float(), kr.float(), vr.float(),
                                             attn_mask=mask)[0].permute(1, 0, 2)

        def err(o):
            o = o.float()
            if not bool(torch.isfinite(o).all()):
                return float("inf")
            return float((o - ref).abs().max() / ref.abs().max())

        fl = _flops(T, L, nq, d)
        row = {"T": T, "L": L, "n_q_heads": nq, "n_kv_heads": nkv, "head_dim": d,
               "gflop": fl / 1e9, "sdpa_us": _graph_time_torch(sdpa, reps)}
        row["ptxgen_us"] = _graph_time_ptxgen(
            lambda: ops.flash_prefill(q, kc, vc, st, nt, out=out), reps)
        row["ptxgen_err"] = err(out)
        row["ptxgen_f16_us"] = _graph_time_ptxgen(
            lambda: ops.flash_prefill(q, kc, vc, st, nt, out=out16), reps)
        row["ptxgen_f16_err"] = err(out16)
        print(f"attention T={T} L={L}: ptxgen {row['ptxgen_us']:.1f} us "
              f"({fl / row['ptxgen_us'] / 1e6:.0f} TFLOP/s, rel err {row['ptxgen_err']:.1e}), "
              f"f16 out {row['ptxgen_f16_us']:.1f} us (rel err {row['ptxgen_f16_err']:.1e}), "
              f"sdpa {row['sdpa_us']:.1f} us ({fl / row['sdpa_us'] / 1e6:.0f} TFLOP/s); "
              f"ptxgen/sdpa {row['ptxgen_us'] / row['sdpa_us']:.3f}", flush=True)
        if sweep:
            row["sweep"] = []
            for cfg in SWEEP:
                out.fill_(float("nan"))
                us = _graph_time_ptxgen(
                    lambda: ops.flash_prefill(q, kc, vc, st, nt, out=out, **cfg), reps)
                e = err(out)
                row["sweep"].append({"config": cfg, "us": us, "err": e})
                print(f"  {cfg}: {us:.1f} us ({us / row['sdpa_us']:.3f} of sdpa), "
                      f"rel err {e:.1e}", flush=True)
        results.append(row)
    return results


def bench_model(path, lengths=(512, 4096), chunk=512):
    from ptxgen.llm import Model
    m = Model.from_gguf(path, backend="cuda", capacity=max(lengths) + 8, progress=False)
    rng = np.random.default_rng(0)
    for n in lengths:
        prompt = [int(t) for t in rng.integers(0, m.hp.vocab, n)]
        m.generate(prompt, 1, prefill_chunk=chunk)                  # warm-up
        r = m.generate(prompt, 1, prefill_chunk=chunk)
        re = m.generate(prompt, 1, mode="eager", prefill_chunk=chunk)
        r0 = m.generate(prompt[:64], 1, prefill_chunk=0)
        print(f"prompt {n}: {r.prompt_tokens_per_second:.0f} tokens/s "
              f"({r.prompt_seconds:.3f} s; chunk {chunk}, graphs); eager launches "
              f"{re.prompt_tokens_per_second:.0f} tokens/s; token-by-token at 64: "
              f"{r0.prompt_tokens_per_second:.0f} tokens/s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json_out", nargs="?", help="write the attention results here")
    ap.add_argument("--sweep", action="store_true", help="also time every config of SWEEP")
    ap.add_argument("--model", default="/tmp/llama3-8b-q4k.gguf")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-attention", action="store_true", help="only the end-to-end prompts")
    a = ap.parse_args()
    res = [] if a.skip_attention else bench_attention(sweep=a.sweep)
    if a.json_out and res:
        import subprocess
        dev = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        with open(a.json_out, "w") as f:
            json.dump({"device": dev, "commit": commit, "date": time.strftime("%Y-%m-%d"),
                       "attention": res}, f, indent=1)
    if not a.skip_model:
        import os
        if not os.path.exists(a.model):
            import subprocess
            import sys
            subprocess.run([sys.executable, "-m", "ptxgen.llm.gguf.synth", a.model,
                            "--preset", "llama3-8b", "--qtype", "Q4_K"], check=True)
        bench_model(a.model)


if __name__ == "__main__":
    main()
