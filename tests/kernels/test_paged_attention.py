"""Paged decode attention (a batch of sequences over a paged f16 KV cache)
against float64 attention over the same K/V.

The oracle is ``paged_attention.reference`` (each sequence's rows gathered
through its block table, float64 softmax attention), itself checked in
``test_reference_matches_a_contiguous_cache`` against flash decode's
reference over caches assembled here row by row.  Every pool slot no
sequence owns (unassigned blocks, the tail of a sequence's last block) holds
NaN, so a kernel that read one row too far, or a wrong block, gives NaN.
"""

import math

import numpy as np
import pytest

from ptxgen.kernels import flash_decode as FD
from ptxgen.kernels import paged_attention as P

BOUND = 1e-4          # relative to the sequence's largest output


def rel_err(out, ref) -> float:
    """``max|out - ref| / max|ref|`` in float64 (inf if ``out`` is not finite)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


class Paged:
    """A batch's paged cache: ``B`` sequences of up to ``lens_max[b]`` keys
    in blocks of ``bs`` tokens dealt from a shuffled pool with ``spare``
    blocks nobody owns; every slot no sequence owns is NaN; table entries
    past a sequence's blocks are random garbage (never read)."""

    def __init__(self, rng, lens_max, n_kv, G, d, bs, max_blocks, spare=3, q_pad=0):
        B = len(lens_max)
        need = [-(-int(L) // bs) for L in lens_max]
        if max(need) > max_blocks:
            raise ValueError("a sequence needs more blocks than its table row holds")
        nb = sum(need) + spare
        perm = rng.permutation(nb)
        self.table = rng.integers(-2**31, 2**31 - 1, (B, max_blocks)).astype(np.int32)
        self.kp = np.full((nb, n_kv, bs, d), np.nan, np.float16)
        self.vp = np.full((nb, n_kv, bs, d), np.nan, np.float16)
        used = 0
        for b, L in enumerate(lens_max):
            self.table[b, :need[b]] = perm[used:used + need[b]]
            used += need[b]
            pos = np.arange(int(L))
            blk = self.table[b, pos // bs]
            self.kp[blk, :, pos % bs] = rng.standard_normal((len(pos), n_kv, d))
            self.vp[blk, :, pos % bs] = rng.standard_normal((len(pos), n_kv, d))
        n_q = n_kv * G
        self.q_stride = n_q * d + q_pad
        qbuf = np.full((B, self.q_stride), np.nan, np.float32)
        qbuf[:, :n_q * d] = (rng.standard_normal((B, n_q * d)) * 2).astype(np.float32)
        self.qbuf = qbuf
        self.q = qbuf[:, :n_q * d].reshape(B, n_q, d)
        self.B, self.n_kv, self.n_q, self.d = B, n_kv, n_q, d

    def reference(self, lens, window=0):
        return P.reference(self.q, self.kp, self.vp, self.table, lens, window=window)


def _run(run, plan, pc: Paged, lens_list, n_splits, table=None):
    """The outputs ``[B, n_q, d]`` (the plan's ``out_type``) for each
    lengths array of ``lens_list``, launched with the same pools, table, q
    and workspace."""
    split = run.function(P.build, plan, plan.split_name)
    geos = P.launch_geometry(plan, pc.B, pc.n_kv, n_splits)
    comb = len(geos) > 1
    combine = run.function(P.build, plan, plan.combine_name) if comb else None
    part_o = run.poisoned((pc.B, pc.n_q, n_splits, pc.d))
    part_ml = run.poisoned((pc.B, pc.n_q, n_splits, 2))
    out = run.poisoned((pc.B, pc.n_q, pc.d),
                       np.float16 if plan.out_type == "f16" else np.float32)
    tab = pc.table if table is None else table
    dq, dk, dv, dt = (run.array(a) for a in (pc.qbuf, pc.kp, pc.vp, tab))
    results = []
    for lens in lens_list:
        dl = run.array(np.asarray(lens, np.int32))
        run.launch(split, geos[0], dict(q=dq, k_pool=dk, v_pool=dv, block_table=dt, seq_lens=dl,
                                        part_o=part_o, part_ml=part_ml, out=out,
                                        q_stride=pc.q_stride, max_blocks=tab.shape[1],
                                        num_blocks=pc.kp.shape[0], sm_scale=1 / math.sqrt(pc.d)))
        if comb:
            run.launch(combine, geos[1], dict(part_o=part_o, part_ml=part_ml, out=out))
        results.append(run.get(out))
    return results


def _check(outs, refs, lens_list, bound=BOUND):
    for lens, out, ref in zip(lens_list, outs, refs):
        for b, L in enumerate(lens):
            if L <= 0:
                assert np.all(out[b] == 0), (b, L)
                continue
            err = rel_err(out[b], ref[b])
            assert err <= bound, (b, int(L), err)


def _lengths(rng, B, bs, cap):
    """``B`` lengths in ``1..cap``: block boundaries (``k bs``, ``k bs + 1``,
    ``k bs - 1``), 1, ``cap`` and random ones, shuffled."""
    edge = [1, cap, bs, bs + 1, 2 * bs, 2 * bs - 1, 3 * bs + 1, 16, 17, 15]
    pick = [x for x in edge if 1 <= x <= cap]
    lens = [pick[i] if i < len(pick) and rng.random() < 0.7 else int(rng.integers(1, cap + 1))
            for i in range(B)]
    return np.array(rng.permutation(lens), np.int32)


EMU_PLANS = [
    # the 8B shape's head (d 128, group 4) in 16-token blocks, one warp
    P.PagedAttentionPlan.make(head_dim=128, group=4, block_size=16, warps=1, unroll=1),
    P.PagedAttentionPlan.make(head_dim=128, group=4, block_size=32, warps=2, unroll=2,
                              l2_prefetch=False, l1_bypass=False),
    P.PagedAttentionPlan.make(head_dim=64, group=3, block_size=16, warps=2, unroll=1),
    P.PagedAttentionPlan.make(head_dim=64, group=1, block_size=64, warps=1, unroll=3,
                              combine_warps=1),
    P.PagedAttentionPlan.make(head_dim=128, group=8, block_size=128, warps=2, unroll=1,
                              min_keys=32),
    P.PagedAttentionPlan.make(head_dim=64, group=5, block_size=256, warps=4, unroll=1,
                              combine_warps=4),
    # Gemma 3's head of 256 (1B: group 4; 4B and 12B: group 2)
    P.PagedAttentionPlan.make(head_dim=256, group=4, block_size=16, warps=2, unroll=1),
    P.PagedAttentionPlan.make(head_dim=256, group=2, block_size=32, warps=1, unroll=2),
    # early_kv (the one-row decode step's): the first trip loaded before the
    # wait, the newest row again after it
    P.PagedAttentionPlan.make(head_dim=128, group=4, block_size=16, warps=2, unroll=1,
                              early_kv=True, pdl=True, target="sm_90"),
    P.PagedAttentionPlan.make(head_dim=64, group=1, block_size=64, warps=1, unroll=3,
                              early_kv=True, l2_prefetch=False, l1_bypass=False),
    P.PagedAttentionPlan.make(head_dim=256, group=2, block_size=32, warps=2, unroll=2,
                              early_kv=True),
]


@pytest.mark.parametrize("n_splits", [1, 3])
@pytest.mark.parametrize("plan", EMU_PLANS, ids=lambda p: p.kernel_name)
def test_paged_attention(run, plan, n_splits, rng):
    """B of 1..8 sequences of lengths 1..capacity (block boundaries among
    them) in shuffled blocks; a second launch with other lengths (a graph
    replay: same arguments, the lengths array rewritten)."""
    bs = plan.block_size
    max_blocks = max(2, 80 // bs + 1)
    cap = max_blocks * bs
    B = int(rng.integers(1, 9))
    lens = [_lengths(rng, B, bs, cap), _lengths(rng, B, bs, cap)]
    pc = Paged(rng, np.maximum(*lens), 2, plan.group, plan.head_dim, bs, max_blocks)
    outs = _run(run, plan, pc, lens, n_splits)
    _check(outs, [pc.reference(x) for x in lens], lens)


@pytest.mark.parametrize("n_splits", [1, 2, 5])
def test_every_length_up_to_capacity(run, n_splits, rng):
    """One launch of 64 sequences of lengths 1..64 (4 blocks of 16, so every
    offset in a block, every block boundary and the full table)."""
    plan = P.PagedAttentionPlan.make(head_dim=64, group=2, block_size=16, warps=2, unroll=1)
    lens = np.array(rng.permutation(np.arange(1, 65)), np.int32)
    pc = Paged(rng, lens, 1, 2, 64, 16, max_blocks=4, spare=5)
    (out,) = _run(run, plan, pc, [lens], n_splits)
    _check([out], [pc.reference(lens)], [lens])


WINDOW_PLANS = [
    # a window not a multiple of 16 (its first chunk partly masked), Gemma 3's
    # head (d 256 is not built; 128 and 64 are) in 16- and 32-token blocks
    P.PagedAttentionPlan.make(head_dim=128, group=2, block_size=16, warps=2, unroll=1,
                              window=21),
    P.PagedAttentionPlan.make(head_dim=64, group=4, block_size=32, warps=1, unroll=2,
                              window=32, out_type="f16"),
    P.PagedAttentionPlan.make(head_dim=64, group=1, block_size=16, warps=1, unroll=1,
                              window=3, min_keys=32),
    P.PagedAttentionPlan.make(head_dim=256, group=2, block_size=16, warps=2, unroll=1,
                              window=20),
    P.PagedAttentionPlan.make(head_dim=128, group=2, block_size=16, warps=2, unroll=1,
                              window=21, early_kv=True),
]


@pytest.mark.parametrize("n_splits", [1, 3])
@pytest.mark.parametrize("plan", WINDOW_PLANS, ids=lambda p: p.kernel_name)
def test_sliding_window(run, plan, n_splits, rng):
    """A sliding window: each sequence attends over its last ``window`` keys
    only (lengths below, at, just past and far past it, and every block
    boundary), against the float64 reference with the same window; the
    keys before the window matter (the reference over all the keys is far
    from it), so the kernel cannot pass by reading them."""
    bs, W = plan.block_size, plan.window
    max_blocks = max(3, (3 * W) // bs + 2)
    cap = max_blocks * bs
    B = 8
    edge = np.array([1, W, W + 1, W + 15, 2 * W + 7, cap, bs + 1, 3 * bs - 1], np.int32)
    lens = [np.array(rng.permutation(np.minimum(edge, cap)), np.int32),
            _lengths(rng, B, bs, cap)]
    pc = Paged(rng, np.maximum(*lens), 2, plan.group, plan.head_dim, bs, max_blocks)
    outs = _run(run, plan, pc, lens, n_splits)
    refs = [pc.reference(x, window=W) for x in lens]
    bound = BOUND + (2.0 ** -11 if plan.out_type == "f16" else 0.0)
    _check(outs, refs, lens, bound=bound)
    full = pc.reference(lens[0])
    for b, L in enumerate(lens[0]):
        if L > W + 1:
            assert rel_err(full[b], refs[0][b]) > 100 * bound, (b, int(L))


def test_reference_matches_a_contiguous_cache(rng):
    """The paged reference equals flash decode's reference over caches
    assembled row by row through the table."""
    pc = Paged(rng, [37, 5, 64], 2, 3, 32, 16, max_blocks=4)
    lens = np.array([37, 5, 64], np.int32)
    ref = pc.reference(lens)
    for b, L in enumerate(lens):
        kc = np.zeros((2, L, 32), np.float16)
        vc = np.zeros((2, L, 32), np.float16)
        for p in range(L):
            blk = pc.table[b, p // 16]
            kc[:, p], vc[:, p] = pc.kp[blk, :, p % 16], pc.vp[blk, :, p % 16]
        want = FD.reference(pc.q[b], kc, vc, int(L))
        assert np.max(np.abs(ref[b] - want)) <= 1e-12 * np.max(np.abs(want))
    assert np.all(pc.reference(np.zeros(3, np.int32)) == 0)
    for b, L in enumerate(lens):            # the window: the last keys alone
        win = P.reference(pc.q[b:b + 1], pc.kp, pc.vp, pc.table[b:b + 1], [L], window=9)
        kc = np.stack([pc.kp[pc.table[b, p // 16], :, p % 16] for p in range(L)], 1)
        vc = np.stack([pc.vp[pc.table[b, p // 16], :, p % 16] for p in range(L)], 1)
        want = FD.reference(pc.q[b], kc, vc, int(L), window=9)
        assert np.max(np.abs(win[0] - want)) <= 1e-12 * np.max(np.abs(want))


@pytest.mark.parametrize("n_splits", [1, 3])
@pytest.mark.parametrize("plan", [
    P.PagedAttentionPlan.make(head_dim=128, group=4, block_size=16, warps=2, unroll=1,
                              out_type="f16"),
    P.PagedAttentionPlan.make(head_dim=64, group=3, block_size=32, warps=1, unroll=2,
                              combine_warps=1, out_type="f16"),
    P.PagedAttentionPlan.make(head_dim=256, group=2, block_size=16, warps=2, unroll=1,
                              out_type="f16"),
], ids=lambda p: p.kernel_name)
def test_f16_output(run, plan, n_splits, rng):
    """``out_type="f16"`` (the batched engine's, for the f16-X GEMM after
    it): the f32 result rounded to nearest, so within the f32 bound plus
    half an f16 ulp (2^-11 relative) of each element; the split kernel's
    own store (one split), the combine's (several) and an empty sequence's
    zeros."""
    bs = plan.block_size
    max_blocks = 80 // bs + 1
    cap = max_blocks * bs
    B = int(rng.integers(2, 7))
    lens = [_lengths(rng, B, bs, cap), np.array([0] + [cap] * (B - 1), np.int32)]
    pc = Paged(rng, np.maximum(*lens), 2, plan.group, plan.head_dim, bs, max_blocks)
    outs = _run(run, plan, pc, lens, n_splits)
    assert all(o.dtype == np.float16 for o in outs)
    _check(outs, [pc.reference(x) for x in lens], lens, bound=BOUND + 2.0 ** -11)


@pytest.mark.parametrize("early_kv", [False, True])
@pytest.mark.parametrize("n_splits", [1, 4])
def test_empty_and_clamped_lengths(run, n_splits, early_kv, rng):
    """Length 0 (and negative) gives zeros, a length past the table's
    capacity reads the whole table; q rows sit ``q_stride`` apart with NaN
    between them (q inside a wider row, as in a QKV buffer)."""
    plan = P.PagedAttentionPlan.make(head_dim=64, group=2, block_size=16, warps=2, unroll=1,
                                     early_kv=early_kv)
    pc = Paged(rng, [48, 0, 20, 48], 2, 2, 64, 16, max_blocks=3, q_pad=20)
    lens = [np.array([1000, 0, 20, -5], np.int32), np.array([0, 0, 0, 0], np.int32)]
    outs = _run(run, plan, pc, lens, n_splits)
    assert rel_err(outs[0][0], pc.reference([48, 0, 20, 0])[0]) <= BOUND
    _check(outs, [pc.reference(x) for x in lens], lens)


def test_bad_table_entries_read_the_last_block(run, rng):
    """An entry outside ``[0, num_blocks)`` inside a sequence's length reads
    block ``num_blocks - 1`` (the pool's last block, filled here)."""
    plan = P.PagedAttentionPlan.make(head_dim=64, group=2, block_size=16, warps=2, unroll=1)
    pc = Paged(rng, [40, 30], 2, 2, 64, 16, max_blocks=3, spare=1)
    last = pc.kp.shape[0] - 1
    pc.kp[last] = rng.standard_normal(pc.kp[last].shape)
    pc.vp[last] = rng.standard_normal(pc.vp[last].shape)
    bad = pc.table.copy()
    bad[0, 1], bad[1, 0] = -7, 2**31 - 1
    clamped = pc.table.copy()
    clamped[0, 1], clamped[1, 0] = last, last
    lens = np.array([40, 30], np.int32)
    (out,) = _run(run, plan, pc, [lens], 3, table=bad)
    ref = P.reference(pc.q, pc.kp, pc.vp, clamped, lens)
    _check([out], [ref], [lens])


def test_short_sequences_use_fewer_splits(run, rng):
    """A sequence of ``L`` keys works on ``ceil(L / min_keys)`` splits at
    most, its 16-key chunks dealt evenly; the splits past them leave the
    neutral partial ``(-1e30, 0)``: with min_keys 32 and 4 splits, L = 20
    keeps one split, L = 70 three (chunks 1, 2, 2: 16, 32 and 22 keys), L =
    128 four (32 each).  With q = 0 every score is 0, so ``l`` counts the
    split's keys."""
    plan = P.PagedAttentionPlan.make(head_dim=64, group=1, block_size=16, warps=1, unroll=1,
                                     min_keys=32)
    lens = np.array([20, 70, 128], np.int32)
    pc = Paged(rng, lens, 1, 1, 64, 16, max_blocks=8)
    pc.qbuf[:] = 0.0
    split = run.function(P.build, plan, plan.split_name)
    geo = P.launch_geometry(plan, 3, 1, 4)[0]
    part_ml = run.poisoned((3, 1, 4, 2))
    run.launch(split, geo, dict(q=run.array(pc.qbuf), k_pool=run.array(pc.kp),
                                v_pool=run.array(pc.vp), block_table=run.array(pc.table),
                                seq_lens=run.array(lens), part_o=run.poisoned((3, 1, 4, 64)),
                                part_ml=part_ml, out=run.poisoned((3, 1, 64)),
                                q_stride=pc.q_stride, max_blocks=8, num_blocks=pc.kp.shape[0],
                                sm_scale=0.125))
    got = run.get(part_ml)[:, 0]
    want_l = [[20, 0, 0, 0], [16, 32, 22, 0], [32, 32, 32, 32]]
    assert np.array_equal(got[..., 1], np.array(want_l, np.float32)), got[..., 1]
    assert np.all(got[..., 0][np.array(want_l) == 0] == np.float32(FD.NEG))
    assert np.all(got[..., 0][np.array(want_l) > 0] == 0.0)


def test_launch_geometry_and_splits():
    plan = P.PagedAttentionPlan.make()
    (one,) = P.launch_geometry(plan, 64, 8, 1)             # no combine
    assert (one.kernel, one.grid, one.block) == (plan.split_name, (1, 8, 64), (256, 1, 1))
    split, comb = P.launch_geometry(plan, 2, 8, 16)
    assert (split.grid, split.block) == ((16, 8, 2), (256, 1, 1))
    assert (comb.kernel, comb.grid, comb.block) == (plan.combine_name, (64, 1, 1), (64, 1, 1))
    assert dict(comb.args) == {"n_splits": 16}
    for bad in (0, P.MAX_SPLITS + 1):
        with pytest.raises(ValueError, match="n_splits"):
            P.launch_geometry(plan, 1, 8, bad)
    # one 8-warp block an SM: B = 1 fills 132 SMs with 16 splits per KV head
    # (flash decode's count), B = 8 with 2, B = 32 and more need no combine
    assert P.resident_blocks(plan) == 1
    assert P.choose_splits(plan, 132, 1, 8, 4096) == 16
    assert P.choose_splits(plan, 132, 8, 8, 4096) == 2
    assert P.choose_splits(plan, 132, 32, 8, 4096) == 1
    assert P.choose_splits(plan, 132, 1, 8, 64) == 4          # ceil(64 / min_keys 16)
    assert P.choose_splits(plan, 132, 1, 8, 4096, blocks_per_sm=4) == 66


@pytest.mark.parametrize("bad", [dict(head_dim=512), dict(head_dim=96),
                                 dict(head_dim=256, group=8, warps=8), dict(group=0),
                                 dict(group=9), dict(block_size=8), dict(block_size=48),
                                 dict(block_size=512), dict(block_size=True), dict(warps=0),
                                 dict(warps=9), dict(unroll=5), dict(min_keys=8),
                                 dict(min_keys=48), dict(l2_prefetch=1),
                                 dict(combine_warps=3), dict(kv_dtype="f32"),
                                 dict(pdl=True), dict(window=-1), dict(window=True)])
def test_refuses(bad):
    with pytest.raises(ValueError):
        P.PagedAttentionPlan.make(**bad)


def test_tuned_config_builds():
    spec = P.PagedAttentionSpec(target="sm_90")
    plan = P.plan(spec)
    assert plan.config == P.select_config(spec)
    assert plan.split_name in P.build(plan).to_ptx()


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64, 256])
@pytest.mark.parametrize("B,cap", [(1, 4096), (8, 1024), (64, 512)])
def test_paged_attention_gpu(gpu_run, B, cap, bs, rng):
    """The 8B shape (32 query / 8 KV heads of 128) with the tuned config and
    the device's split count, lengths up to ``cap``."""
    from ptxgen.driver import get_device
    dev = get_device()
    plan = P.plan(P.PagedAttentionSpec(block_size=bs, target=gpu_run.target()), batch=B)
    max_blocks = cap // bs
    lens = [_lengths(rng, B, bs, cap), np.array(rng.integers(1, cap + 1, B), np.int32)]
    pc = Paged(rng, np.maximum(*lens), 8, 4, 128, bs, max_blocks)
    S = P.choose_splits(plan, dev.sm_count, B, 8, cap)
    outs = _run(gpu_run, plan, pc, lens, S)
    _check(outs, [pc.reference(x) for x in lens], lens)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64])
def test_sliding_window_gpu(gpu_run, bs, rng):
    """A window of 1024 keys (Gemma 3's) on 8 KV heads of 128, group 2, with
    the tuned config and the device's split count: 16 sequences of lengths
    up to 3000 (below, at and past the window)."""
    from ptxgen.driver import get_device
    dev = get_device()
    W, cap, B = 1024, 3008, 16
    plan = P.plan(P.PagedAttentionSpec(group=2, block_size=bs, window=W,
                                       target=gpu_run.target()), batch=B)
    max_blocks = -(-cap // bs)
    lens = [np.array(rng.permutation([1, W - 1, W, W + 1, W + 17, cap] +
                                     list(rng.integers(1, cap + 1, B - 6))), np.int32)]
    pc = Paged(rng, lens[0], 8, 2, 128, bs, max_blocks)
    S = P.choose_splits(plan, dev.sm_count, B, 8, cap)
    outs = _run(gpu_run, plan, pc, lens, S)
    _check(outs, [pc.reference(x, window=W) for x in lens], lens)


@pytest.mark.parametrize("q_row", [False, True])
def test_op_on_the_emulator(q_row, rng):
    """``ops.paged_attention`` with numpy arrays on the emulator: q packed or
    inside longer rows (``n_q_heads``), the split count its own (an H100's)
    or one split (no combine)."""
    from ptxgen.driver import ops
    lens = np.array([33, 1, 64], np.int32)
    pc = Paged(rng, lens, 2, 2, 64, 16, max_blocks=4, q_pad=12 if q_row else 0)
    ref = pc.reference(lens)
    q = pc.qbuf if q_row else pc.q.copy()
    extra = dict(n_q_heads=4) if q_row else {}
    for kw in (dict(warps=2), dict(warps=1, n_splits=1)):
        out = ops.paged_attention(q, pc.kp, pc.vp, pc.table, lens, backend="emu", **extra, **kw)
        _check([out], [ref], [lens])


def test_op_refuses_bad_shapes(rng):
    from ptxgen.driver import ops
    pc = Paged(rng, [5, 7], 2, 2, 64, 16, max_blocks=2)
    lens = np.array([5, 7], np.int32)
    with pytest.raises(ValueError, match="k_pool"):
        ops.paged_attention(pc.q, pc.kp[0], pc.vp[0], pc.table, lens, backend="emu")
    with pytest.raises(TypeError, match="k_pool"):
        ops.paged_attention(pc.q, pc.kp.astype(np.float32), pc.vp, pc.table, lens,
                            backend="emu")
    with pytest.raises(ValueError, match="seq_lens"):
        ops.paged_attention(pc.q, pc.kp, pc.vp, pc.table, lens[:1], backend="emu")
    with pytest.raises(ValueError, match="multiple of 2 KV heads"):
        ops.paged_attention(pc.q[:, :3], pc.kp, pc.vp, pc.table, lens, backend="emu")
