"""Run the batched-decode kernels once on the 8B shape (32 query / 8 KV heads
of 128) for compute-sanitizer: RoPE with the KV append into a paged cache
(``RopeSpec(paged=...)``) for the batch's new tokens, then paged attention
over it, for block sizes 16, 64 and 256, batches of 1, 5 and 64 sequences
whose lengths include 0, 1, block boundaries and the table's capacity, with
one split per sequence (no combine), the op's split count, and 4-warp
blocks; pools sized exactly, so a read past a sequence's blocks or past the
pool is an error.  Each result is checked against float64 attention.

``compute-sanitizer --tool memcheck python3 tests/kernels/sanitize_paged.py``
(and ``--tool racecheck``); prints OK when every launch finished and every
check held.  The inputs are drawn from a fresh seed, printed first; ``--seed
N`` reuses one.
"""

import argparse
import secrets

import numpy as np

from ptxgen import driver, emu
from ptxgen.driver import ops
from ptxgen.driver.backend import device_target
from ptxgen.kernels import paged_attention as P
from ptxgen.kernels import rope as R

N_Q, N_KV, D = 32, 8, 128


def _case(api, rng, B, bs, max_blocks):
    """A batch whose newest token of each sequence is appended by the paged
    RoPE kernel, then attended to; returns the max relative error."""
    D_ = api.DeviceArray.from_numpy
    cap = max_blocks * bs
    cand = [0, 1, bs, bs + 1, cap, cap - 1] + list(rng.integers(1, cap + 1, B))
    lens = rng.permutation(np.array(cand, np.int32))[:B]
    if B == 1:
        lens[0] = rng.integers(cap // 2, cap + 1)
    need = [-(-int(L) // bs) for L in lens]
    nb = sum(need)
    perm = rng.permutation(max(nb, 1))
    table = np.zeros((B, max_blocks), np.int32)
    kp = rng.standard_normal((max(nb, 1), N_KV, bs, D)).astype(np.float16)
    vp = rng.standard_normal((max(nb, 1), N_KV, bs, D)).astype(np.float16)
    used = 0
    for b in range(B):
        table[b, :need[b]] = perm[used:used + need[b]]
        used += need[b]
    # the newest token of each non-empty sequence: q | k | v rows, RoPE at
    # position L - 1, its K/V into slot table[b, (L-1) // bs] * bs + (L-1) % bs
    spec = R.RopeSpec(head_dim=D, layout="interleaved", theta=500000.0, append="f16", rows=True,
                      paged=bs, target=_target(api))
    row = (N_Q + 2 * N_KV) * D
    qkv = rng.standard_normal((B, row)).astype(np.float32)
    pos = np.maximum(lens - 1, 0).astype(np.int32)
    slots = np.where(lens > 0, table[np.arange(B), pos // bs] * bs + pos % bs, -1).astype(np.int32)
    dqkv, dkp, dvp = D_(qkv), D_(kp), D_(vp)
    mod = api.Module.from_ptx(R.build(spec).to_ptx())
    geo = R.launch_geometry(spec, N_Q, N_KV, B)
    api.launch(mod.function(spec.kernel_name), geo.grid, geo.block, dqkv,
                  dqkv.view(offset=4 * N_Q * D), D_(R.freq_table(spec)), D_(pos), N_Q, N_KV,
                  dqkv.view(offset=4 * (N_Q + N_KV) * D), dkp, dvp, kp.shape[0] * bs, row,
                  D_(np.array([B], np.int32)), D_(slots))
    kp, vp, qkv2 = dkp.to_numpy(), dvp.to_numpy(), dqkv.to_numpy()
    err = 0.0
    for kw in (dict(n_splits=1), {}, dict(warps=4)):
        out = ops.paged_attention(dqkv, dkp, dvp, D_(table), D_(lens), n_q_heads=N_Q,
                                  **kw).to_numpy()
        ref = P.reference(qkv2[:, :N_Q * D].reshape(B, N_Q, D), kp, vp, table, lens)
        for b in range(B):
            if lens[b] == 0:
                assert np.all(out[b] == 0), (b, kw)
                continue
            e = float(np.max(np.abs(out[b] - ref[b])) / np.max(np.abs(ref[b])))
            assert e <= 1e-4, (B, bs, b, int(lens[b]), kw, e)
            err = max(err, e)
    return err


def _target(api):
    return "sm_80" if api.__name__ == "ptxgen.emu" else device_target()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: a fresh one)")
    ap.add_argument("--emu", action="store_true",
                    help="on the CPU emulator, the small cases only (a dry run of the script)")
    args = ap.parse_args(argv)
    seed = secrets.randbits(32) if args.seed is None else args.seed
    print(f"seed={seed}", flush=True)
    rng = np.random.default_rng(seed)
    api = emu if args.emu else driver
    cases = ((16, 5, 8), (64, 1, 40), (256, 5, 2), (16, 64, 20))
    for bs, B, max_blocks in cases[:3] if args.emu else cases:
        err = _case(api, rng, B, bs, max_blocks)
        print(f"block {bs}, batch {B}: max relative error {err:.2e}", flush=True)
    if not args.emu:
        driver.get_device().synchronize()
    print("OK")


if __name__ == "__main__":
    main()
