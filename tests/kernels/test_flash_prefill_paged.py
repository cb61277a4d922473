"""Flash prefill over a paged KV cache (``FlashPrefillSpec.paged``): a chunk
of one sequence whose keys sit in pool blocks found through its block-table
row, against float64 attention over the keys gathered here row by row, and
bit for bit against the contiguous kernel on the same keys.

Every pool slot the sequence does not own (spare blocks, the tail of its
last block) is NaN, and the table's entries past the sequence's blocks are
random integers (negative ones and ones past the pool included), so a wrong
block, a row read past the sequence or an entry read and used past it gives
NaN or a wrong value.
"""

import math

import numpy as np
import pytest

from ptxgen.driver import ops
from ptxgen.kernels import flash_prefill as FP

BOUND = 5e-3       # as the contiguous kernel's (q and P rounded to f16)


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


class Chunk:
    """One sequence of ``L + T`` keys in shuffled blocks of ``bs`` of a pool
    with ``spare`` blocks nobody owns, its table row ``max_blocks`` long
    (garbage past its blocks), and a chunk's queries for ``t_max`` rows."""

    def __init__(self, rng, n_kv, G, d, bs, L, T, t_max, max_blocks=None, spare=3):
        n = L + T
        need = -(-n // bs)
        self.max_blocks = max_blocks or need + 2
        nb = need + spare
        self.table = rng.integers(-2**31, 2**31 - 1, self.max_blocks).astype(np.int32)
        self.table[:need] = rng.permutation(nb)[:need]
        self.kp = np.full((nb, n_kv, bs, d), np.nan, np.float16)
        self.vp = np.full((nb, n_kv, bs, d), np.nan, np.float16)
        # the sequence's keys and values, contiguous, then dealt into the pool
        self.kc = rng.standard_normal((n_kv, n, d)).astype(np.float16)
        self.vc = rng.standard_normal((n_kv, n, d)).astype(np.float16)
        for p in range(n):
            blk, off = self.table[p // bs], p % bs
            self.kp[blk, :, off] = self.kc[:, p]
            self.vp[blk, :, off] = self.vc[:, p]
        self.q = (rng.standard_normal((t_max, n_kv * G, d)) * 2).astype(np.float32)
        self.L, self.T = L, T

    def reference(self, window=0):
        return FP.reference(self.q, self.kc, self.vc, self.L, self.T, window=window)

    def run(self, backend, odt=np.float32, **kw):
        out = np.full(self.q.shape, np.nan, odt)
        ops.flash_prefill_paged(self.q, self.kp, self.vp, self.table,
                                np.array([self.L], np.int32), np.array([self.T], np.int32),
                                out=out, backend=backend.name, **kw)
        return out


# (kernel, head_dim, n_kv, group, warps, heads, block_keys, stages, block size, L, T):
# blocks smaller than a tile (16 / 32 keys under 32- and 64-key tiles: several
# TMA boxes a half), as large and larger; L and L + T on block boundaries and
# one key off them; L = 0 with many tiles; two row groups a block; several
# KV heads, with one to seven query heads each and blocks of part of a group
CASES = [
    ("mma", 64, 1, 2, 2, 2, 32, 2, 16, 37, 19),
    ("mma", 64, 2, 1, 4, 1, 16, 3, 16, 16, 16),
    ("mma", 64, 1, 4, 4, 4, 32, 3, 64, 63, 30),
    ("mma", 128, 1, 4, 8, 4, 64, 2, 32, 0, 70),
    ("mma", 64, 1, 2, 4, 2, 32, 2, 128, 129, 12),
    ("mma", 64, 2, 7, 2, 1, 32, 2, 32, 40, 20),          # Qwen2's group of 7
    ("mma", 64, 2, 4, 4, 2, 32, 3, 64, 10, 40),          # two blocks a KV head
    ("wgmma", 64, 1, 4, 4, 4, 32, 3, 16, 31, 33),
    ("wgmma", 64, 1, 4, 8, 4, 64, 3, 16, 5, 100),
    ("wgmma", 64, 1, 8, 8, 8, 64, 4, 32, 64, 64),
    ("wgmma", 128, 1, 4, 8, 4, 64, 3, 64, 0, 130),
    ("wgmma", 128, 2, 4, 4, 4, 64, 3, 128, 191, 17),
    ("wgmma", 64, 1, 4, 4, 4, 16, 3, 256, 250, 40),
    ("mma", 256, 2, 2, 8, 2, 16, 3, 16, 21, 35),          # head_dim 256 (Gemma 3)
    ("wgmma", 256, 1, 4, 4, 4, 16, 3, 32, 40, 20),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-bs{c[8]}-bn{c[6]}-L{c[9]}-T{c[10]}"
                                             for c in CASES])
def test_matches_float64(backend, rng, case):
    """Against float64 attention; rows past T stay untouched."""
    kernel, d, n_kv, G, warps, heads, bn, stages, bs, L, T = case
    if kernel == "wgmma":
        backend.require_sm(90)
    c = Chunk(rng, n_kv, G, d, bs, L, T, T + 5)
    out = c.run(backend, warps=warps, heads=heads, block_keys=bn, stages=stages, kernel=kernel)
    err = rel_err(out[:T], c.reference())
    assert err <= BOUND, err
    assert np.all(np.isnan(out[T:])), "rows past T were written"


# (kernel, head_dim, group, warps, heads, block_keys, stages, block size, L, T,
# window): windows shorter than a tile, than a block, and longer than both, so
# the walk starts at a tile past the first (its table entries read there)
WINDOW_CASES = [
    ("mma", 64, 2, 2, 2, 32, 2, 16, 37, 19, 5),
    ("mma", 64, 4, 4, 2, 32, 3, 64, 70, 40, 33),
    ("wgmma", 64, 4, 4, 4, 32, 3, 16, 31, 33, 20),
    ("wgmma", 128, 4, 8, 4, 64, 3, 64, 130, 70, 100),
]


@pytest.mark.parametrize("case", WINDOW_CASES,
                         ids=[f"{c[0]}-bs{c[7]}-bn{c[5]}-L{c[8]}-T{c[9]}-W{c[10]}"
                              for c in WINDOW_CASES])
def test_sliding_window(backend, rng, case):
    """A sliding window over the paged cache (Gemma 3's local layers): row
    ``i`` sees keys ``L + i - W + 1 .. L + i`` only, against the float64
    reference with that window, which the reference over every key is far
    from (so the keys before the window matter); rows past T untouched."""
    kernel, d, G, warps, heads, bn, stages, bs, L, T, W = case
    if kernel == "wgmma":
        backend.require_sm(90)
    c = Chunk(rng, 2, G, d, bs, L, T, T + 5)
    out = c.run(backend, warps=warps, heads=heads, block_keys=bn, stages=stages, kernel=kernel,
                window=W)
    ref = c.reference(window=W)
    assert rel_err(out[:T], ref) <= BOUND
    assert rel_err(c.reference(), ref) > 100 * BOUND
    assert np.all(np.isnan(out[T:])), "rows past T were written"


@pytest.mark.parametrize("kernel,bs,bn", [("mma", 16, 32), ("wgmma", 64, 32),
                                          ("wgmma", 16, 64)])
def test_same_bits_as_the_contiguous_cache(backend, rng, kernel, bs, bn):
    """The paged kernel reads the same key rows into the same tiles as the
    contiguous one: the outputs agree bit for bit (f16 out)."""
    backend.require_sm(90 if kernel == "wgmma" else 80)
    d, n_kv, G, L, T = 64, 1, 4, 45, 50
    c = Chunk(rng, n_kv, G, d, bs, L, T, T)
    kw = dict(warps=8, heads=4, block_keys=bn, stages=3, kernel=kernel)
    paged = c.run(backend, np.float16, **kw)
    cont = np.full(c.q.shape, np.nan, np.float16)
    ops.flash_prefill(c.q, c.kc, c.vc, np.array([L], np.int32), np.array([T], np.int32),
                      out=cont, backend=backend.name, **kw)
    assert np.array_equal(paged.view(np.uint16), cont.view(np.uint16))


@pytest.mark.parametrize("bs", [16, 64])
def test_full_table(backend, rng, bs):
    """The chunk ends at the table's last key (L + T = max_blocks * bs, the
    table exactly that long): reads ahead of the walk stay inside the row;
    a T past the table is clamped to it."""
    backend.require_sm(90)
    d, n_kv, G, T = 64, 1, 4, 40
    max_blocks = 4 * -(-(T + 8) // (4 * bs))         # whole 16-byte words of entries
    L = max_blocks * bs - T
    c = Chunk(rng, n_kv, G, d, bs, L, T, T + 6, max_blocks=max_blocks)
    assert c.table.size == max_blocks and L + T == max_blocks * bs
    ref = c.reference()
    kw = dict(warps=4, heads=4, block_keys=32, stages=3, kernel="wgmma")
    out = c.run(backend, **kw)
    assert rel_err(out[:T], ref) <= BOUND
    c.T = T + 5                                        # clamped to the table's capacity
    out = c.run(backend, **kw)
    assert rel_err(out[:T], ref) <= BOUND
    assert np.all(np.isnan(out[T:]))


@pytest.mark.parametrize("bs,bn,stages,L,T", [(16, 64, 2, 70, 33), (64, 32, 3, 0, 45),
                                              (128, 64, 2, 100, 20)])
def test_sm80_ring_of_cp_async(backend, rng, bs, bn, stages, L, T):
    """The sm_80 build (every tile by cp.async through the table, no maps)."""
    from ptxgen.driver.ops_prefill import flash_prefill_plan
    backend.require_sm(80)
    d, n_kv, G = 128 if bn == 64 else 64, 1, 4
    plan = flash_prefill_plan(d, G, target="sm_80", warps=8, heads=4, block_keys=bn,
                              stages=stages, paged=bs)
    c = Chunk(rng, n_kv, G, d, bs, L, T, T)
    assert FP.pool_maps(plan, 0, 0, n_kv, c.kp.shape[0]) is None
    out = backend.poisoned(c.q.shape, np.float32)
    fn = backend.load(FP.build(plan))[plan.kernel_name]
    backend.launch(fn, FP.launch_geometry(plan, n_kv * G, T),
                   dict(q=backend.array(c.q), k_pool=backend.array(c.kp),
                        v_pool=backend.array(c.vp), block_table=backend.array(c.table),
                        start_ptr=backend.array(np.array([L], np.int32)),
                        n_tokens_ptr=backend.array(np.array([T], np.int32)), out=out,
                        max_blocks=c.max_blocks, sm_scale=1.0 / math.sqrt(d),
                        q_stride=n_kv * G * d, num_blocks=c.kp.shape[0]))
    assert rel_err(out.to_numpy(), c.reference()) <= BOUND


@pytest.mark.parametrize("bs", [16, 64, 256])
@pytest.mark.parametrize("odt", [np.float32, np.float16])
def test_gpu_shipped_config_larger(backend, rng, bs, odt):
    """The tuned config (the warpgroup kernel on an H100) on a shape too
    large for the emulator: 8 query heads of 2 KV heads, head_dim 128, a
    grid for 160 rows with T = 133, L = 300."""
    if backend.name == "emu":
        pytest.skip("GPU-sized case")
    c = Chunk(rng, 2, 4, 128, bs, 300, 133, 160)
    out = c.run(backend, odt)
    assert rel_err(out[:133], c.reference()) <= BOUND
    assert np.all(np.isnan(out[133:]))


def test_pool_maps():
    p = FP.FlashPrefillPlan.make(target="sm_90a", kernel="wgmma", stages=3, block_keys=64,
                                 paged=16)
    km, vm = FP.pool_maps(p, 1 << 20, 2 << 20, 8, 100)
    assert km.shape == (128, 100 * 8 * 16) and km.box == (64, 16) and km.swizzle == "128B"
    assert vm.address == 2 << 20
    assert FP.pool_maps(p.evolve(paged=256), 0, 0, 8, 10)[0].box == (64, 64)
    with pytest.raises(ValueError, match="pool_maps"):
        FP.cache_maps(p, 0, 0, 8, 128)
    with pytest.raises(ValueError, match="cache_maps"):
        FP.pool_maps(p.evolve(paged=0), 0, 0, 8, 10)


def test_spec_and_bad_input():
    assert FP.FlashPrefillPlan.make(paged=64).kernel_name.endswith("_p64")
    with pytest.raises(ValueError, match="paged must be one of"):
        FP.FlashPrefillSpec(paged=48)
    q = np.zeros((4, 2, 64), np.float32)
    kp = np.zeros((3, 1, 16, 64), np.float16)
    tab = np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="block size 24"):
        ops.flash_prefill_paged(q, np.zeros((3, 1, 24, 64), np.float16),
                                np.zeros((3, 1, 24, 64), np.float16), tab, 0, 4, backend="emu")
    with pytest.raises(ValueError, match="the sequence's row"):
        ops.flash_prefill_paged(q, kp, kp, tab[None], 0, 4, backend="emu")
    with pytest.raises(ValueError, match="max_blocks >= 1"):
        ops.flash_prefill_paged(q, kp, kp, tab[:0], 0, 4, backend="emu")
    with pytest.raises(TypeError, match="block_table must be int32"):
        ops.flash_prefill_paged(q, kp, kp, tab.astype(np.int64), 0, 4, backend="emu")
    with pytest.raises(ValueError, match="must both be"):
        ops.flash_prefill_paged(q, kp, kp[:2], tab, 0, 4, backend="emu")
    with pytest.raises(TypeError, match="float16"):
        ops.flash_prefill_paged(q, kp.astype(np.float32), kp.astype(np.float32), tab, 0, 4,
                                backend="emu")
