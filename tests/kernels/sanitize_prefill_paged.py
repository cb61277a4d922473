"""Run chunk attention over a paged KV cache (``ops.flash_prefill_paged``)
for compute-sanitizer on the 8B shape (32 query / 8 KV heads of 128, the
op's tuned config, f16 and f32 out): block sizes 16, 64 and 256, chunks at
L = 0, in the middle of a block, and ending at the table's last key (T
asked past it, so clamped), grids wider than the chunk; pools and table
rows sized exactly (no spare block, no entry past the table), so a read
past a sequence's blocks or past the pool is an error.  Each output must
equal the contiguous kernel's bit for bit, and a few rows float64
attention.

``compute-sanitizer --tool memcheck python3 tests/kernels/sanitize_prefill_paged.py``
(and ``--tool racecheck``); prints OK when every launch finished and every
check held.  The inputs come from a fresh seed, printed first; ``--seed N``
reuses one; ``--emu`` runs small shapes on the CPU emulator (a dry run).
"""

import argparse
import math
import secrets

import numpy as np

from ptxgen.driver import ops


def _case(backend, rng, shape, bs, L, T, t_max, max_blocks, odt):
    """One launch of each kernel; returns the max relative error of the
    checked rows."""
    n_q, n_kv, d = shape
    n = min(L + T, max_blocks * bs)
    need = -(-n // bs)
    table = np.zeros(max_blocks, np.int32)
    table[:need] = rng.permutation(need)
    table[need:] = rng.integers(0, need, max_blocks - need)   # unused, inside the pool
    kc = rng.standard_normal((n_kv, need * bs, d)).astype(np.float16)
    vc = rng.standard_normal((n_kv, need * bs, d)).astype(np.float16)
    kp = np.empty((need, n_kv, bs, d), np.float16)
    vp = np.empty_like(kp)
    for j in range(need):
        kp[table[j]] = kc[:, j * bs:(j + 1) * bs]
        vp[table[j]] = vc[:, j * bs:(j + 1) * bs]
    q = rng.standard_normal((t_max, n_q, d)).astype(np.float32)
    st, nt = np.array([L], np.int32), np.array([T], np.int32)
    paged = np.full(q.shape, np.nan, odt)
    ops.flash_prefill_paged(q, kp, vp, table, st, nt, out=paged, backend=backend)
    # the contiguous cache of the same capacity (the clamps agree)
    cap = max_blocks * bs
    kcc = np.zeros((n_kv, cap, d), np.float16)
    vcc = np.zeros_like(kcc)
    kcc[:, :need * bs], vcc[:, :need * bs] = kc, vc
    cont = np.full(q.shape, np.nan, odt)
    ops.flash_prefill(q, kcc, vcc, st, nt, out=cont, backend=backend)
    assert np.array_equal(paged.view(np.uint8), cont.view(np.uint8)), (bs, L, T, odt)
    t_eff = n - L
    err = 0.0
    for i in sorted({0, t_eff // 2, t_eff - 1}):
        for qh in range(0, n_q, max(1, n_q // 4)):
            h = qh // (n_q // n_kv)
            keys = kc[h, :L + i + 1].astype(np.float64)
            s = keys @ q[i, qh].astype(np.float64) / math.sqrt(d)
            w = np.exp(s - s.max())
            ref = (w / w.sum()) @ vc[h, :L + i + 1].astype(np.float64)
            err = max(err, float(np.max(np.abs(paged[i, qh] - ref)) / np.max(np.abs(ref))))
    assert err <= 5e-3, (bs, L, T, err)
    assert np.all(np.isnan(paged[t_eff:])), (bs, L, T, "rows past T written")
    return err


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: a fresh one)")
    ap.add_argument("--emu", action="store_true",
                    help="on the CPU emulator, small shapes (a dry run of the script)")
    args = ap.parse_args(argv)
    seed = secrets.randbits(32) if args.seed is None else args.seed
    print(f"seed={seed}", flush=True)
    rng = np.random.default_rng(seed)
    if args.emu:
        backend, shape = "emu", (8, 2, 64)
        # (bs, L, T, t_max, max_blocks)
        cases = [(16, 0, 40, 48, 3), (64, 30, 20, 24, 1), (16, 21, 60, 64, 5)]
    else:
        backend, shape = "cuda", (32, 8, 128)
        cases = [(16, 0, 512, 512, 32), (64, 300, 133, 160, 8), (256, 4096, 128, 128, 17),
                 (64, 4000, 200, 200, 65), (16, 1000, 100, 128, 70)]
    for bs, L, T, t_max, max_blocks in cases:
        for odt in (np.float16, np.float32):
            err = _case(backend, rng, shape, bs, L, T, t_max, max_blocks, odt)
            print(f"block {bs}, L {L}, T {T} (table {max_blocks * bs} keys), "
                  f"{np.dtype(odt).name} out: max relative error {err:.2e}", flush=True)
    if backend == "cuda":
        from ptxgen import driver
        driver.get_device().synchronize()
    print("OK")


if __name__ == "__main__":
    main()
