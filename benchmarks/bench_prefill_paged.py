"""GPU benchmark of chunk attention over a paged KV cache
(``ops.flash_prefill_paged``) against the same kernel over a contiguous
cache (``ops.flash_prefill``) on the 8B shape (32 query / 8 KV heads of 128,
f16 KV, f16 out as the chunk path runs it, the op's tuned config): chunks of
T = 512 and T = 128 (a chunked engine step) at L = 0 and 4096, pool blocks
of 64, 128 and 256 tokens (one or more a 64-key tile) and, for the record,
16 and 32 (several TMA boxes a tile), dealt in a shuffled order from a pool
with spare blocks, each sequence's table row holding ``CAPACITY`` tokens.

Every timing is a CUDA-graph replay of ``REPS`` calls (bench_common.graph_us),
the median of ``REPEATS`` replays divided by ``REPS``; the contiguous and
the paged kernels are timed in alternating ``ROUNDS`` and each reported as
its best round.  The paged output must equal the contiguous one bit for bit
(the same rows enter the same tiles); the contiguous one is checked against
float64 attention on a few rows.

    python -m benchmarks.bench_prefill_paged [out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time


from .bench_common import graph_us

REPS = 20
REPEATS = 7
ROUNDS = 3
N_Q, N_KV, D = 32, 8, 128
CAPACITY = 32768
CASES = [(512, 0), (512, 4096), (128, 0), (128, 4096)]
BLOCK_SIZES = (64, 128, 256, 16, 32)


def _inputs(torch, T, L, bs, gen):
    """q, the contiguous caches, and the same keys in shuffled pool blocks
    of ``bs`` with 7 spare blocks, and the sequence's table row."""
    n = L + T
    need = -(-n // bs)
    nb = need + 7
    q = torch.randn(T, N_Q, D, device="cuda", generator=gen)
    kc = torch.randn(N_KV, n, D, device="cuda", generator=gen).half()
    vc = torch.randn(N_KV, n, D, device="cuda", generator=gen).half()
    perm = torch.randperm(nb, device="cuda", generator=gen)[:need]
    table = torch.zeros(CAPACITY // bs, device="cuda", dtype=torch.int32)
    table[:need] = perm.to(torch.int32)
    pad = need * bs - n
    kp = torch.zeros(nb, N_KV, bs, D, device="cuda", dtype=torch.float16)
    vp = torch.zeros_like(kp)
    for src, dst in ((kc, kp), (vc, vp)):
        rows = torch.nn.functional.pad(src, (0, 0, 0, pad))             # [n_kv, need*bs, D]
        dst[perm.long()] = rows.view(N_KV, need, bs, D).permute(1, 0, 2, 3)
    return q, kc, vc, kp, vp, table


def _check_rows(torch, out, q, kc, vc, L, rows=(0, 1, -1)):
    """Max relative error of a few rows of ``out`` against float64 attention."""
    T = q.shape[0]
    err = 0.0
    for i in rows:
        i = i % T
        qq = q[i].double()                                              # [N_Q, D]
        k = kc[:, :L + i + 1].double().repeat_interleave(N_Q // N_KV, 0)
        v = vc[:, :L + i + 1].double().repeat_interleave(N_Q // N_KV, 0)
        s = torch.einsum("hd,hkd->hk", qq, k) / math.sqrt(D)
        ref = torch.einsum("hk,hkd->hd", torch.softmax(s, -1), v)
        got = out[i].double()
        err = max(err, float((got - ref).abs().max() / ref.abs().max()))
    return err


def bench_case(torch, T, L, block_sizes):
    from ptxgen.driver import Stream, as_device_array, ops
    stream = Stream(non_blocking=True)
    gen = torch.Generator(device="cuda")
    rec = {"T": T, "L": L, "contiguous_us": {}, "paged_us": {}, "identical": {}}
    for bs in block_sizes:
        gen.manual_seed(1000 * T + L + bs)
        q, kc, vc, kp, vp, table = _inputs(torch, T, L, bs, gen)
        out_c = torch.full((T, N_Q, D), float("nan"), device="cuda", dtype=torch.float16)
        out_p = torch.full_like(out_c, float("nan"))
        st = torch.tensor([L], dtype=torch.int32, device="cuda")
        nt = torch.tensor([T], dtype=torch.int32, device="cuda")
        dq, dkc, dvc, dkp, dvp, dt, dst, dnt, doc, dop = (
            as_device_array(t) for t in (q, kc, vc, kp, vp, table, st, nt, out_c, out_p))

        def contiguous(s):
            ops.flash_prefill(dq, dkc, dvc, dst, dnt, out=doc, stream=s)

        def paged(s):
            ops.flash_prefill_paged(dq, dkp, dvp, dt, dst, dnt, out=dop, stream=s)

        tc, tp = [], []
        for _ in range(ROUNDS):
            tc.append(graph_us(contiguous, stream, REPS, REPEATS))
            tp.append(graph_us(paged, stream, REPS, REPEATS))
        torch.cuda.synchronize()
        rec["contiguous_us"][bs] = min(tc)
        rec["paged_us"][bs] = min(tp)
        rec["identical"][bs] = bool(torch.equal(out_c.view(torch.int16), out_p.view(torch.int16)))
        if bs == block_sizes[0]:
            rec["contiguous_rel_err"] = _check_rows(torch, out_c, q, kc, vc, L)
        del q, kc, vc, kp, vp, table, out_c, out_p
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json_out", nargs="?", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="block sizes 64, 128 and 256 only")
    a = ap.parse_args(argv)
    import torch

    from ptxgen.driver import get_device
    dev = get_device()
    sizes = BLOCK_SIZES[:3] if a.quick else BLOCK_SIZES
    res = {"device": dev.name, "date": time.strftime("%Y-%m-%d"), "reps": REPS,
           "repeats": REPEATS, "rounds": ROUNDS,
           "shape": {"n_q_heads": N_Q, "n_kv_heads": N_KV, "head_dim": D, "capacity": CAPACITY},
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True).stdout.strip(),
           "cases": []}
    print(f"{dev.name}; us per call (CUDA-graph replays, best of {ROUNDS} alternating rounds)")
    print(f"{'T':>4} {'L':>5} {'bs':>4} {'contiguous':>10} {'paged':>8} {'paged/cont':>10} "
          f"{'same bits':>9}")
    bad = []
    for T, L in CASES:
        r = bench_case(torch, T, L, sizes)
        res["cases"].append(r)
        for bs in sizes:
            c, p = r["contiguous_us"][bs], r["paged_us"][bs]
            print(f"{T:>4} {L:>5} {bs:>4} {c:10.2f} {p:8.2f} {p / c:10.3f} "
                  f"{str(r['identical'][bs]):>9}", flush=True)
            if not r["identical"][bs]:
                bad.append((T, L, bs))
        print(f"           contiguous vs float64 (3 rows): rel err {r['contiguous_rel_err']:.1e}")
        if r["contiguous_rel_err"] > 5e-3:
            bad.append((T, L, "float64"))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", a.json_out)
    if bad:
        raise SystemExit(f"numerics: paged output differs from the contiguous one, or the "
                         f"contiguous one from float64, at {bad}")


if __name__ == "__main__":
    main()
