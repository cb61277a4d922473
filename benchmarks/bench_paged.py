"""GPU benchmark of paged decode attention (``ops.paged_attention``) on the 8B
shape (32 query / 8 KV heads of 128, f16 KV) for batches of sequences of one
length, in pool blocks of 16, 32, 64 and 128 tokens dealt in a shuffled
order; beside today's contiguous flash decode at B = 1 (``ops.flash_decode``,
a cache of 32768 rows as ``bench_decode`` times it: the op's config, and
with ``early_kv`` as the decode step runs it) and torch SDPA over
contiguous ``[B, 8, L, 128]`` f16 caches (GQA).

Every timing is a CUDA-graph replay of ``REPS`` calls (ours captured with
:class:`ptxgen.driver.capture`, torch's with ``torch.cuda.CUDAGraph``), the
median of ``REPEATS`` replays divided by ``REPS``.  Each sequence's table
holds ``CAPACITY`` tokens, so B = 1 gets flash decode's split count; the
split count is the op's own (the driver's occupancy) unless a variant names
one.  Sequences 0 and B - 1 of every configuration are checked against
float64 attention.

    python -m benchmarks.bench_paged [out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess

import numpy as np

from .bench_common import graph_us, torch_graph_us

REPS = 10
REPEATS = 7
N_Q, N_KV, D = 32, 8, 128
CAPACITY = 32768
CASES = [(1, 128), (1, 4096), (8, 256), (32, 256), (64, 256), (128, 256), (64, 1024)]
BLOCK_SIZES = (16, 32, 64, 128)
#: config variants (``ops.paged_attention`` keywords) timed at block size 16
VARIANTS = {
    "w4": dict(warps=4),
    "w4u2": dict(warps=4, unroll=2),
    "w8u2": dict(unroll=2),
    "no_l1_bypass": dict(l1_bypass=False),
    "no_hints": dict(l2_prefetch=False, l1_bypass=False),
    "splits1": dict(n_splits=1),
    "splits2": dict(n_splits=2),
    "splits4": dict(n_splits=4),
}


def _paged_inputs(torch, B, L, bs, gen):
    """q, pools, table and lengths of ``B`` sequences of ``L`` tokens in
    shuffled blocks of ``bs``."""
    need = -(-L // bs)
    nb = B * need + 1
    kp = torch.randn(nb, N_KV, bs, D, device="cuda", dtype=torch.float16, generator=gen)
    vp = torch.randn(nb, N_KV, bs, D, device="cuda", dtype=torch.float16, generator=gen)
    perm = torch.randperm(nb, device="cuda", generator=gen)[:B * need].to(torch.int32)
    table = torch.zeros(B, CAPACITY // bs, device="cuda", dtype=torch.int32)
    table[:, :need] = perm.view(B, need)
    lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
    q = torch.randn(B, N_Q, D, device="cuda", generator=gen)
    return q, kp, vp, table, lens


def _check(torch, out, q, kp, vp, table, lens):
    """Max relative error of sequences 0 and B - 1 against float64 attention."""
    from ptxgen.kernels import paged_attention as P
    B = q.shape[0]
    err = 0.0
    for b in sorted({0, B - 1}):
        L = int(lens[b])
        nblk = -(-L // kp.shape[2])
        blocks = table[b, :nblk].long()
        sub = (kp[blocks].cpu().numpy(), vp[blocks].cpu().numpy())
        tab = np.arange(nblk, dtype=np.int32)[None]
        ref = P.reference(q[b:b + 1].cpu().numpy(), *sub, tab, [L])[0]
        got = out[b].cpu().numpy().astype(np.float64)
        err = max(err, float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
    return err


def _splits(plan_kw, B, bs):
    """The op's split count for ``B`` sequences (the driver's occupancy)."""
    from ptxgen.driver.ops_backend import get_backend
    from ptxgen.driver.ops_paged import paged_attention_plan
    from ptxgen.kernels import paged_attention as P
    be = get_backend("cuda")
    plan = paged_attention_plan(D, N_Q // N_KV, bs, target=be.target, device=be.device_name,
                                batch=B, **plan_kw)
    fn = be.function(P.build, plan, plan.split_name)
    return P.choose_splits(plan, be.sm_count, B, N_KV, CAPACITY,
                           be.resident(fn, 32 * plan.warps))


def bench_case(torch, B, L, variants=True):
    import torch.nn.functional as F

    from ptxgen.driver import Stream, as_device_array
    from ptxgen.driver import ops
    stream = Stream(non_blocking=True)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1000 * B + L)
    kv_bytes = 2 * B * L * N_KV * D * 2
    rec = {"B": B, "L": L, "kv_bytes": kv_bytes, "paged_us": {}, "n_splits": {},
           "max_rel_err": {}, "variants_us": {}}
    for bs in BLOCK_SIZES:
        q, kp, vp, table, lens = _paged_inputs(torch, B, L, bs, gen)
        out = torch.empty(B, N_Q, D, device="cuda")
        dq, dk, dv, dt, dl, do = (as_device_array(t) for t in (q, kp, vp, table, lens, out))

        def call(s, **kw):
            ops.paged_attention(dq, dk, dv, dt, dl, out=do, stream=s, **kw)

        rec["paged_us"][bs] = graph_us(call, stream, REPS, REPEATS)
        rec["n_splits"][bs] = _splits({}, B, bs)
        rec["max_rel_err"][bs] = _check(torch, out, q, kp, vp, table, lens)
        if bs == 16 and variants:
            for name, kw in VARIANTS.items():
                out.fill_(float("nan"))
                rec["variants_us"][name] = graph_us(lambda s: call(s, **kw), stream, REPS,
                                                    REPEATS)
                rec["max_rel_err"][f"16_{name}"] = _check(torch, out, q, kp, vp, table, lens)
        del q, kp, vp, table, lens, out
    if B == 1:
        kc = torch.randn(N_KV, CAPACITY, D, device="cuda", dtype=torch.float16, generator=gen)
        vc = torch.randn(N_KV, CAPACITY, D, device="cuda", dtype=torch.float16, generator=gen)
        q1 = torch.randn(N_Q, D, device="cuda", generator=gen)
        o1 = torch.empty(N_Q, D, device="cuda")
        d = [as_device_array(t) for t in (q1, kc, vc, o1)]
        kv_len = as_device_array(torch.tensor([L], dtype=torch.int32, device="cuda"))
        for key, kw in (("flash_decode_us", {}), ("flash_decode_step_us", dict(early_kv=True))):
            rec[key] = graph_us(lambda s: ops.flash_decode(d[0], d[1], d[2], kv_len, out=d[3],
                                                           stream=s, **kw), stream, REPS, REPEATS)
        del kc, vc
    qs = torch.randn(B, N_Q, 1, D, device="cuda", dtype=torch.float16, generator=gen)
    ks = torch.randn(B, N_KV, L, D, device="cuda", dtype=torch.float16, generator=gen)
    vs = torch.randn(B, N_KV, L, D, device="cuda", dtype=torch.float16, generator=gen)
    try:
        F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
        rec["sdpa_us"], rec["sdpa_mode"] = torch_graph_us(
            lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True), REPS, REPEATS,
            eager_fallback=True)
    except TypeError:                    # a torch without enable_gqa: K/V expanded first
        ke, ve = (t.repeat_interleave(N_Q // N_KV, dim=1) for t in (ks, vs))
        rec["sdpa_us"], rec["sdpa_mode"] = torch_graph_us(
            lambda: F.scaled_dot_product_attention(qs, ke, ve), REPS, REPEATS,
            eager_fallback=True)
        rec["sdpa_mode"] += ", K/V expanded"
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json_out", nargs="?", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="no config variants")
    a = ap.parse_args(argv)
    import torch

    from ptxgen.driver import get_device
    dev = get_device()
    res = {"device": dev.name, "sm_count": dev.sm_count, "reps": REPS, "repeats": REPEATS,
           "shape": {"n_q_heads": N_Q, "n_kv_heads": N_KV, "head_dim": D,
                     "capacity": CAPACITY},
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True).stdout.strip(),
           "cases": []}
    print(f"{dev.name}, {dev.sm_count} SMs; us per call (CUDA-graph replays)")
    head = " ".join(f"{'bs' + str(b):>8}" for b in BLOCK_SIZES)
    print(f"{'B':>4} {'L':>5} {head} {'flash':>8} {'sdpa':>8} {'TB/s':>6} {'32 layers':>10}"
          f" {'splits':>7} {'rel err':>8}")
    for B, L in CASES:
        r = bench_case(torch, B, L, variants=not a.quick)
        res["cases"].append(r)
        best = min(r["paged_us"].values())
        fd = r.get("flash_decode_us")
        print(f"{B:>4} {L:>5} " + " ".join(f"{r['paged_us'][b]:8.2f}" for b in BLOCK_SIZES)
              + f" {fd if fd else math.nan:8.2f} {r['sdpa_us']:8.2f}"
              + f" {r['kv_bytes'] / best / 1e6:6.2f} {32 * best / 1000:8.3f}ms"
              + f" {r['n_splits'][16]:>7} {max(r['max_rel_err'].values()):8.1e}", flush=True)
        if fd:
            print(f"       flash decode with early_kv (the decode step's): "
                  f"{r['flash_decode_step_us']:.2f}")
        if r["variants_us"]:
            print("       bs16 variants: " + ", ".join(f"{k} {v:.2f}"
                                                     for k, v in r["variants_us"].items()))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", a.json_out)
    worst = max(max(c["max_rel_err"].values()) for c in res["cases"])
    if worst > 1e-4:
        raise SystemExit(f"numerics: max relative error {worst:.3g} is past 1e-4")


if __name__ == "__main__":
    main()
