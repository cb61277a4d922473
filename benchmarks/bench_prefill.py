"""Prefill benchmarks: the chunk attention against torch SDPA (causal,
lower-right aligned for L > 0; both timed as CUDA-graph replays of 20
calls, so host time per call is left out) at T = 512, L = 0 / 4096 / 16384 on the 8B
shape (32 query heads, 8 KV heads, head_dim 128), and end-to-end prompt
tokens/s of the 8B-shaped synthetic Q4_K model at 512 and 4096 tokens
(chunk graphs, and eager launches).

    python benchmarks/bench_prefill.py [--model PATH.gguf] [--skip-model]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _graph_time_ptxgen(call, reps):
    """Microseconds per call of ``call``'s launches, ``reps`` of them replayed
    as one CUDA graph (no host time per launch, as in the prefill graph)."""
    from ptxgen import driver
    from ptxgen.driver.ops_backend import get_backend, recording
    with recording() as seq:
        call()
    be, s = get_backend("cuda"), driver.Stream()
    with driver.capture(s) as g:
        for _ in range(reps):
            for fn, grid, block, args, shared, pdl in seq:
                be.launch(fn, grid, block, *args, shared=shared, stream=s, pdl=pdl)
    ge = g.instantiate()
    ge.launch(s)
    s.synchronize()
    t0 = time.perf_counter()
    ge.launch(s)
    s.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def _graph_time_torch(call, reps):
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
    t0 = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def bench_attention(T=512, Ls=(0, 4096, 16384), nq=32, nkv=8, d=128, reps=20):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from ptxgen.driver import ops
    for L in Ls:
        cap = L + T
        q = torch.randn(T, nq, d, device="cuda", dtype=torch.float32)
        kc = torch.randn(nkv, cap, d, device="cuda", dtype=torch.float16)
        vc = torch.randn(nkv, cap, d, device="cuda", dtype=torch.float16)
        out = torch.empty_like(q)
        st = torch.tensor([L], dtype=torch.int32, device="cuda")
        nt = torch.tensor([T], dtype=torch.int32, device="cuda")

        def ours():
            ops.flash_prefill(q, kc, vc, st, nt, out=out)
        qh = q.half().permute(1, 0, 2).unsqueeze(0)               # [1, nq, T, d]
        kr = kc.repeat_interleave(nq // nkv, 0).unsqueeze(0)      # [1, nq, cap, d]
        vr = vc.repeat_interleave(nq // nkv, 0).unsqueeze(0)
        mask = causal_lower_right(T, cap)

        def sdpa():
            F.scaled_dot_product_attention(qh, kr, vr, attn_mask=mask)
        res = {"ptxgen": _graph_time_ptxgen(ours, reps), "sdpa": _graph_time_torch(sdpa, reps)}
        ref = F.scaled_dot_product_attention(qh.float(), kr.float(), vr.float(),
                                             attn_mask=mask)[0].permute(1, 0, 2)
        err = float((out - ref).abs().max() / ref.abs().max())
        print(f"attention T={T} L={L}: ptxgen {res['ptxgen']:.1f} us, "
              f"sdpa {res['sdpa']:.1f} us, rel err {err:.2e}")


def bench_model(path, lengths=(512, 4096), chunk=512):
    from ptxgen.driver.model.llama import LlamaModel
    m = LlamaModel.from_gguf(path, backend="cuda", capacity=max(lengths) + 8, progress=False)
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
    ap.add_argument("--model", default="/tmp/llama3-8b-q4k.gguf")
    ap.add_argument("--skip-model", action="store_true")
    a = ap.parse_args()
    bench_attention()
    if not a.skip_model:
        import os
        if not os.path.exists(a.model):
            from ptxgen.driver.model.gguf_synth import write_synthetic_llama  # noqa: F401
            import subprocess
            import sys
            subprocess.run([sys.executable, "-m", "ptxgen.driver.model.gguf_synth", a.model,
                            "--preset", "llama3-8b", "--qtype", "Q4_K"], check=True)
        bench_model(a.model)


if __name__ == "__main__":
    main()
