"""Flash decode (split-KV, GQA) against float64 attention over the same K/V.

The oracle is ``flash_decode.reference`` (float64 softmax attention over the
cached values as stored, written apart from the kernel's input
preparation), itself checked in ``test_reference_matches_the_formula``
against a per-key loop written here with ``math.fsum`` sums.
"""

import math

import attrs
import numpy as np
import pytest

from ptxgen.kernels import flash_decode as F


def rel_err(out, ref) -> float:
    """``max|out - ref| / max|ref|`` in float64 (inf if ``out`` is not finite)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _run(run, spec, q, kc, vc, L, n_splits, kv_len_dev=None):
    """Outputs for each length in ``L``, launched with the same arguments
    (as a replayed graph would)."""
    n_kv, cap, d = kc.shape
    n_q = q.shape[0]
    split = run.function(F.build, spec, spec.split_name)
    split_geo, comb_geo = F.launch_geometry(spec, n_kv, n_splits)
    comb = run.function(F.build, spec, spec.combine_name)
    part_o = run.poisoned((n_q, n_splits, d))
    part_ml = run.poisoned((n_q, n_splits, 2))
    out = run.poisoned((n_q, d))
    dq, dk, dv = run.array(q), run.array(kc), run.array(vc)
    results = []
    for length in ([L] if np.isscalar(L) else L):      # one "graph": same args, new length
        lens = run.array(np.array([length], np.int32))
        run.launch(split, split_geo,
                   dict(q=dq, k_cache=dk, v_cache=dv, kv_len_ptr=lens, part_o=part_o,
                        part_ml=part_ml, capacity=cap, sm_scale=1 / math.sqrt(d)))
        run.launch(comb, comb_geo, dict(part_o=part_o, part_ml=part_ml, out=out))
        results.append(run.get(out))
    return results


def _data(rng, n_kv, G, cap, d, dtype):
    q = (rng.standard_normal((n_kv * G, d)) * 2).astype(np.float32)
    kc = rng.standard_normal((n_kv, cap, d)).astype(dtype)
    vc = rng.standard_normal((n_kv, cap, d)).astype(dtype)
    return q, kc, vc


EMU_SPECS = [
    F.FlashDecodePlan.make(head_dim=64, group=3, warps=2, unroll=2),
    F.FlashDecodePlan.make(head_dim=128, group=2, warps=1, unroll=2),
    F.FlashDecodePlan.make(head_dim=64, group=1, kv_dtype="f32", warps=1, unroll=3),
    F.FlashDecodePlan.make(head_dim=128, group=2, kv_dtype="f32", warps=1, unroll=3),
    F.FlashDecodePlan.make(head_dim=128, group=4, warps=1, unroll=3, min_keys=16),
    # early_kv: length and first tile before the wait, q and the newest row after
    F.FlashDecodePlan.make(head_dim=64, group=3, warps=2, unroll=2, early_kv=True),
    F.FlashDecodePlan.make(head_dim=128, group=2, kv_dtype="f32", warps=1, unroll=3,
                           early_kv=True),
    # tensor cores: 16-key chunks (a split's last one masked), group 1..8,
    F.FlashDecodePlan.make(head_dim=64, group=3, warps=2, unroll=1, mma=True),
    F.FlashDecodePlan.make(head_dim=128, group=4, warps=1, unroll=2, mma=True),
    F.FlashDecodePlan.make(head_dim=128, group=8, warps=2, unroll=1, mma=True),
    F.FlashDecodePlan.make(head_dim=64, group=1, warps=1, unroll=3, mma=True, min_keys=16),
    F.FlashDecodePlan.make(head_dim=128, group=5, warps=2, unroll=2, mma=True, early_kv=True),
    # warp trips dealt round robin over the splits from one round on
    # (interleave=1): at L = 100, 7 and 4 trips of 16 and 32 keys on 3 splits
    # (rounds of 96), the last trip partial; at L = 33, contiguous ranges
    F.FlashDecodePlan.make(head_dim=64, group=3, warps=2, unroll=1, mma=True, interleave=1),
    F.FlashDecodePlan.make(head_dim=128, group=5, warps=1, unroll=2, mma=True, early_kv=True,
                           interleave=1),
    # the K/V loads with the .L2::256B prefetch-size hint, d = 64 and 128
    F.FlashDecodePlan.make(head_dim=64, group=3, warps=2, unroll=1, mma=True, interleave=1,
                           l2_prefetch=True),
    F.FlashDecodePlan.make(head_dim=128, group=5, warps=1, unroll=2, mma=True, early_kv=True,
                           l2_prefetch=True, l1_bypass=True),
    # L1 bypassed from one round on (96 keys on 3 splits): L = 100 runs the
    # bypassing copy of the loop, 1, 7 and 33 the other
    F.FlashDecodePlan.make(head_dim=64, group=3, warps=2, unroll=1, mma=True, interleave=1,
                           l2_prefetch=True, l1_bypass=True, bypass_from=1),
    # a combine of one warp (registers only) and of two (shared memory)
    F.FlashDecodePlan.make(head_dim=64, group=3, warps=2, unroll=2, combine_warps=1),
    F.FlashDecodePlan.make(head_dim=128, group=4, warps=1, unroll=1, mma=True, combine_warps=2),
]


@pytest.mark.parametrize("spec", EMU_SPECS, ids=lambda s: s.kernel_name)
def test_flash_decode(run, spec, rng):
    n_kv, cap = 2, 100
    dt = np.float16 if spec.kv_dtype == "f16" else np.float32
    q, kc, vc = _data(rng, n_kv, spec.group, cap, spec.head_dim, dt)
    lengths = [1, 7, 100, 33]
    outs = _run(run, spec, q, kc, vc, lengths, n_splits=3)
    for L, out in zip(lengths, outs):
        err = rel_err(out, F.reference(q, kc, vc, L))
        assert err <= 1e-4, (L, err)


WINDOW_SPECS = [
    F.FlashDecodePlan.make(head_dim=64, group=3, warps=2, unroll=2, window=20),
    F.FlashDecodePlan.make(head_dim=256, group=2, warps=2, unroll=1, window=37, early_kv=True),
    F.FlashDecodePlan.make(head_dim=64, group=3, warps=2, unroll=1, mma=True, window=20),
    F.FlashDecodePlan.make(head_dim=128, group=5, warps=1, unroll=2, mma=True, early_kv=True,
                           window=37),
    # the round-robin deal over a window's keys: 96-key rounds from L - 20
    F.FlashDecodePlan.make(head_dim=64, group=3, warps=2, unroll=1, mma=True, interleave=1,
                           window=97),
]


@pytest.mark.parametrize("spec", WINDOW_SPECS, ids=lambda s: s.kernel_name)
def test_flash_decode_window(run, spec, rng):
    """A sliding window: only the last ``window`` keys; lengths shorter and
    longer than it, the keys dealt over 3 splits (and a window longer than
    the round of an interleaved deal)."""
    n_kv, cap = 2, 130
    q, kc, vc = _data(rng, n_kv, spec.group, cap, spec.head_dim, np.float16)
    lengths = [1, 7, spec.window, spec.window + 1, 100, 130]
    outs = _run(run, spec, q, kc, vc, lengths, n_splits=3)
    for L, out in zip(lengths, outs):
        ref = F.reference(q, kc, vc, L, window=spec.window)
        err = rel_err(out, ref)
        assert err <= 1e-4, (L, err)
        # the keys before the window matter (checked where 30 or more fall
        # outside it: one key in a hundred moves the mean by about 1e-3)
        if L - spec.window >= 30:
            assert rel_err(F.reference(q, kc, vc, L), ref) > 1e-2


def test_reference_matches_the_formula(rng):
    n_kv, G, cap, d, L = 2, 3, 40, 16, 29
    q, kc, vc = _data(rng, n_kv, G, cap, d, np.float16)
    ref = F.reference(q, kc, vc, L)
    for h in range(n_kv * G):
        kk = kc[h // G, :L].astype(np.float64)
        vv = vc[h // G, :L].astype(np.float64)
        s = [math.fsum(q[h].astype(np.float64) * kk[j]) / math.sqrt(d) for j in range(L)]
        top = max(s)
        p = [math.exp(v - top) for v in s]
        total = math.fsum(p)
        want = [math.fsum(p[j] * vv[j, c] for j in range(L)) / total for c in range(d)]
        assert np.max(np.abs(ref[h] - want)) <= 1e-12 * max(1.0, np.max(np.abs(want)))
    assert np.all(F.reference(q, kc, vc, 0) == 0)
    # a window of W keys: the last W of the L, as the whole of a cache of W
    W = 11
    shifted = F.reference(q, kc[:, L - W:], vc[:, L - W:], W)
    assert np.array_equal(F.reference(q, kc, vc, L, window=W), shifted)
    assert np.array_equal(F.reference(q, kc, vc, 5, window=W), F.reference(q, kc, vc, 5))


@pytest.mark.parametrize("interleave", [0, 1, 2])
def test_splits_take_the_keys_they_are_dealt(run, interleave, rng):
    """Each split's partial ``(m, l)`` is that of the keys it was dealt, in
    float64: contiguous ranges, or with ``interleave=1`` (L = 100 is more
    than one round of 3 splits x 2 warps x 16 keys) warp trips ``s, s + n,
    ...`` (split 0 takes keys 0-15, 48-63 and 96-99); ``interleave=2`` needs
    two rounds (192 keys), so L = 100 keeps contiguous ranges."""
    spec = F.FlashDecodePlan.make(head_dim=64, group=3, warps=2, unroll=1, mma=True,
                             interleave=interleave)
    n_kv, cap, L, n = 2, 100, 100, 3
    q, kc, vc = _data(rng, n_kv, 3, cap, 64, np.float16)
    split = run.function(F.build, spec, spec.split_name)
    split_geo, _ = F.launch_geometry(spec, n_kv, n)
    part_ml = run.poisoned((n_kv * 3, n, 2))
    run.launch(split, split_geo,
               dict(q=run.array(q), k_cache=run.array(kc), v_cache=run.array(vc),
                    kv_len_ptr=run.array(np.array([L], np.int32)),
                    part_o=run.poisoned((n_kv * 3, n, 64)), part_ml=part_ml, capacity=cap,
                    sm_scale=1 / math.sqrt(64)))
    got = run.get(part_ml).astype(np.float64)
    trips = [range(t * 16, min(L, t * 16 + 16)) for t in range(-(-L // 16))]
    if interleave == 1:
        keys = [[i for t in trips[s::n] for i in t] for s in range(n)]
    else:
        keys = [list(range(s * 32, L if s == n - 1 else (s + 1) * 32)) for s in range(n)]
    kf = kc.astype(np.float64)
    for qh in range(n_kv * 3):
        sc = kf[qh // 3] @ q[qh].astype(np.float64) / math.sqrt(64) / math.log(2)
        for s in range(n):
            m = sc[keys[s]].max()
            want = (m, np.exp2(sc[keys[s]] - m).sum())
            assert np.allclose(got[qh, s], want, rtol=1e-4, atol=1e-4), (qh, s, got[qh, s], want)


def test_flash_decode_empty_and_clamped(run, rng):
    spec = EMU_SPECS[0]
    q, kc, vc = _data(rng, 1, 3, 20, 64, np.float16)
    zero, big = _run(run, spec, q, kc, vc, [0, 1000], n_splits=4)
    assert np.all(zero == 0)
    assert rel_err(big, F.reference(q, kc, vc, 20)) <= 1e-4


GPU_KNOBS = {"cuda_cores": {}, "mma": dict(mma=True, unroll=2),
             "mma_w8e": dict(mma=True, warps=8, unroll=1, early_kv=True),
             "mma_w8e_cw1": dict(mma=True, warps=8, unroll=1, early_kv=True, combine_warps=1),
             "mma_w8ei": dict(mma=True, warps=8, unroll=1, early_kv=True, interleave=1),
             "mma_w8il": dict(mma=True, warps=8, unroll=1, interleave=2, l2_prefetch=True),
             "mma_w8eil": dict(mma=True, warps=8, unroll=1, early_kv=True, interleave=2,
                               l2_prefetch=True),
             "mma_w8eiln": dict(mma=True, warps=8, unroll=1, early_kv=True, interleave=2,
                                l2_prefetch=True, l1_bypass=True),
             "mma_w8iln6": dict(mma=True, warps=8, unroll=1, interleave=2, l2_prefetch=True,
                                l1_bypass=True, bypass_from=6)}


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", list(GPU_KNOBS))
@pytest.mark.parametrize("L", [1, 7, 1000, 4096, 32768])
def test_flash_decode_gpu(gpu_run, L, knobs, rng):
    from ptxgen.driver import get_device
    spec = F.FlashDecodePlan.make(**GPU_KNOBS[knobs])
    n_kv, cap = 8, 32768
    q, kc, vc = _data(rng, n_kv, 4, cap, 128, np.float16)
    S = F.choose_splits(spec, get_device().sm_count, n_kv, cap)
    (out,) = _run(gpu_run, spec, q, kc, vc, L, S)
    assert rel_err(out, F.reference(q, kc, vc, L)) <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("d,G,dt,mma", [(64, 5, "f16", False), (128, 6, "f32", False),
                                        (256, 2, "f16", False), (64, 5, "f16", True),
                                        (128, 8, "f16", True)])
def test_flash_decode_gpu_shapes(gpu_run, d, G, dt, mma, rng):
    spec = F.FlashDecodePlan.make(head_dim=d, group=G, kv_dtype=dt, warps=2 if d == 256 else 4,
                             mma=mma)
    n_kv, cap = 3, 5000
    q, kc, vc = _data(rng, n_kv, G, cap, d, np.float16 if dt == "f16" else np.float32)
    for L, out in zip([4999, 3], _run(gpu_run, spec, q, kc, vc, [4999, 3], 40)):
        assert rel_err(out, F.reference(q, kc, vc, L)) <= 1e-4


@pytest.mark.parametrize("bad", [dict(head_dim=96), dict(group=0), dict(group=17),
                                 dict(kv_dtype="bf16"), dict(warps=9), dict(unroll=0),
                                 dict(head_dim=256, kv_dtype="f32"),
                                 dict(head_dim=256, group=16, warps=8), dict(chunks=2),
                                 dict(min_keys=4), dict(min_keys=48), dict(stages=3),
                                 dict(fused_combine=True), dict(prefetch=False),
                                 dict(early_kv=1), dict(mma=True, kv_dtype="f32"),
                                 dict(mma=True, head_dim=256), dict(mma=True, group=9),
                                 dict(mma=True, unroll=5), dict(mma=1),
                                 dict(interleave=1), dict(mma=True, interleave=True),
                                 dict(mma=True, interleave=65), dict(l2_prefetch=True),
                                 dict(mma=True, l2_prefetch=1), dict(l1_bypass=True),
                                 dict(mma=True, bypass_from=2),
                                 dict(mma=True, l1_bypass=True, bypass_from=True),
                                 dict(mma=True, l1_bypass=True, bypass_from=65)])
def test_flash_decode_refuses(bad):
    with pytest.raises(ValueError):
        F.FlashDecodePlan.make(**bad)


MMA_OP = dict(mma=True, warps=8, unroll=1, interleave=2, l2_prefetch=True, l1_bypass=True,
              bypass_from=6)


@pytest.mark.parametrize("given,want", [
    ({}, MMA_OP),
    ({"l1_bypass": False}, {**MMA_OP, "l1_bypass": False, "bypass_from": 0}),
    ({"bypass_from": 3}, {**MMA_OP, "bypass_from": 3}),
    ({"warps": 4, "interleave": 0}, {**MMA_OP, "warps": 4, "interleave": 0}),
    ({"mma": False}, dict(mma=False, warps=8, unroll=1)),
    ({"mma": False, "warps": 4, "unroll": 5}, dict(mma=False, warps=4, unroll=5))])
def test_config_overrides(given, want):
    """The tuned config at the op's shape (d 128, group 4, f16, no early_kv)
    with a caller's fields over it: the tensor-core split's own fields go
    with it, the bypass threshold with the bypass."""
    spec = F.FlashDecodeSpec(head_dim=128, group=4, target="sm_90")
    got = F.with_overrides(spec, given).config
    defaults = attrs.asdict(F.FlashDecodeConfig())
    want = {**{k: defaults[k] for k in ("interleave", "l2_prefetch", "l1_bypass",
                                        "bypass_from", "per_sm")}, **want}
    assert {k: getattr(got, k) for k in want} == want


def test_tuned_configs():
    """The table: the tensor-core split where the shape takes it (the op's
    L1 bypass from six rounds; with early_kv, as the decode step runs it, at
    every length and two blocks an SM); the CUDA-core split elsewhere."""
    S = F.FlashDecodeSpec
    op = F.select_config(S(head_dim=128, group=4, target="sm_90"))
    assert attrs.asdict(op) == {**attrs.asdict(F.FlashDecodeConfig()), **MMA_OP}
    step = F.select_config(S(head_dim=128, group=4, early_kv=True, target="sm_90"))
    assert (step.mma, step.per_sm, step.bypass_from, step.l1_bypass) == (True, 2, 0, True)
    for shape in (dict(head_dim=256), dict(kv_dtype="f32"), dict(group=16)):
        c = F.select_config(S(target="sm_90", **shape))
        assert c == F.FlashDecodeConfig(), shape
        F.FlashDecodePlan(S(target="sm_90", **shape), c)      # builds


def test_choose_splits():
    spec = F.FlashDecodePlan.make()
    assert F.resident_blocks(spec) == 3
    assert F.choose_splits(spec, 132, 8, 32768) == 49     # one wave: 392 of 396 slots
    assert F.choose_splits(spec, 132, 8, 32768, 4) == 66
    assert F.choose_splits(spec, 132, 8, 100) == 13       # capped by the capacity (8-key minimum)
    assert F.choose_splits(F.FlashDecodePlan.make(min_keys=64), 132, 8, 100) == 2
    assert F.choose_splits(spec, 1, 64, 4096) == 1
    # the tensor-core split: 8 warps of ~190 registers fit once, 4 warps twice
    mma = F.FlashDecodePlan.make(mma=True, warps=8, unroll=1, early_kv=True)
    assert F.resident_blocks(mma) == 1 and F.choose_splits(mma, 132, 8, 32768) == 16
    assert F.resident_blocks(attrs.evolve(mma, warps=4)) == 2
    assert F.mma_fits(128, 4, "f16") and F.mma_fits(64, 8, "f16")
    assert not F.mma_fits(256, 4, "f16") and not F.mma_fits(128, 4, "f32")
    assert not F.mma_fits(128, 16, "f16")


def test_flash_decode_many_splits(run, rng):
    """More splits than keys: most blocks write neutral partials."""
    spec = EMU_SPECS[0]
    q, kc, vc = _data(rng, 1, 3, 100, 64, np.float16)
    for L, out in zip([100, 3], _run(run, spec, q, kc, vc, [100, 3], n_splits=37)):
        assert rel_err(out, F.reference(q, kc, vc, L)) <= 1e-4, L


@pytest.mark.parametrize("d,n_splits,cw", [(256, 5, 16), (64, 300, 16), (256, 21, 1),
                                            (64, 300, 1), (128, 40, 4)])
def test_flash_decode_combine_rounds(run, d, n_splits, cw, rng):
    """The combine's lanes hold 8 columns at head_dim 256, and its warps take
    several rounds of splits (6 a round with 16 or 4 warps, 16 with one)
    past 96 splits (here most are empty)."""
    spec = F.FlashDecodePlan.make(head_dim=d, group=2, warps=1, unroll=2, combine_warps=cw)
    q, kc, vc = _data(rng, 1, 2, 1200, d, np.float16)
    # the short length first: its empty splits' o must be written (the
    # workspace starts poisoned)
    for L, out in zip([9, 1200], _run(run, spec, q, kc, vc, [9, 1200], n_splits=n_splits)):
        assert rel_err(out, F.reference(q, kc, vc, L)) <= 1e-4, L


def test_splits_share_keys_evenly(run, rng):
    """Every working split gets the same number of row groups, give or take
    one: with 8-key groups, 7 splits and 100 keys (13 groups) each split's
    (m, l) partial must cover 1 or 2 groups (8..16 keys; rounding chunks up
    to whole groups would leave the last split 4); l counts keys when q = 0."""
    spec = F.FlashDecodePlan.make(head_dim=64, group=1, warps=2, unroll=2)
    assert spec.row_groups == 8
    n_kv, cap, d, S = 1, 128, 64, 7
    q = np.zeros((1, d), np.float32)             # every score 0: l = keys seen
    kc = rng.standard_normal((n_kv, cap, d)).astype(np.float16)
    vc = rng.standard_normal((n_kv, cap, d)).astype(np.float16)
    split = run.function(F.build, spec, spec.split_name)
    split_geo, _ = F.launch_geometry(spec, n_kv, S)
    part_o, part_ml = run.poisoned((1, S, d)), run.poisoned((1, S, 2))
    run.launch(split, split_geo,
               dict(q=run.array(q), k_cache=run.array(kc), v_cache=run.array(vc),
                    kv_len_ptr=run.array(np.array([100], np.int32)), part_o=part_o,
                    part_ml=part_ml, capacity=cap, sm_scale=0.125))
    keys = run.get(part_ml)[0, :, 1]
    assert keys.sum() == 100 and np.all((keys >= 8) & (keys <= 16)), keys


@pytest.mark.gpu
@pytest.mark.parametrize("warps,unroll", [(4, 2), (4, 4), (8, 2), (2, 4), (4, 3)])
def test_flash_decode_gpu_variants(gpu_run, warps, unroll, rng):
    from ptxgen.driver import get_device
    spec = F.FlashDecodePlan.make(warps=warps, unroll=unroll)
    n_kv, cap = 8, 8192
    q, kc, vc = _data(rng, n_kv, 4, cap, 128, np.float16)
    for bps in (2, 8):
        S = F.choose_splits(spec, get_device().sm_count, n_kv, cap, bps)
        for L, out in zip([8192, 3001, 5], _run(gpu_run, spec, q, kc, vc, [8192, 3001, 5], S)):
            assert rel_err(out, F.reference(q, kc, vc, L)) <= 1e-4, (L, bps)


@pytest.mark.parametrize("mma", [False, True])
def test_early_kv_reads_only_the_length_and_cache_before_the_wait(mma):
    """With early_kv under PDL, the split kernel reads nothing before its one
    griddepcontrol.wait but the length and the first tile's K/V rows, through
    L2 (``.cg``), stores nothing before it, and after it loads q and, for the
    lanes whose row is ``kv_len - 1``, that row again."""
    spec = F.FlashDecodePlan.make(early_kv=True, target="sm_90", pdl=True, mma=mma, unroll=3)
    # the words of a tile a lane loads: CUDA cores, 3 rows of K and of V of
    # one 16-byte word; tensor cores, per 16-key chunk 2 K rows of 4 words
    # and 4 V rows of 2
    n_words = 3 * (2 * 4 + 4 * 2) if mma else 2 * 3
    word = "ld.global.cg.v4.b32" if mma else "ld.global.cg.v4.u32"
    text = F.build(spec).to_ptx()
    body = text[text.index(".entry " + spec.split_name):]
    body = body[:body.index("\n}")]
    lines = [ln.strip() for ln in body.splitlines()]
    waits = [i for i, ln in enumerate(lines) if ln == "griddepcontrol.wait;"]
    assert len(waits) == 1 and lines[waits[0] + 1] == "griddepcontrol.launch_dependents;"
    before, after = lines[:waits[0]], lines[waits[0]:]
    loads = [ln for ln in before if ln.startswith("ld.global")]
    # the length, then the first tile's 16-byte words
    assert loads[0].startswith("ld.global.cg.s32") and len(loads) == 1 + n_words
    assert all(ln.startswith(word) for ln in loads[1:])
    assert not any(ln.startswith(("st.", "atom.", "red.")) for ln in before)
    # q after the wait (f32), and the newest row again (.cg) under a row == kv_len - 1 test
    assert any(ln.startswith("ld.global.nc.v4.f32") for ln in after)
    first_q = next(i for i, ln in enumerate(after) if ln.startswith("ld.global.nc.v4.f32"))
    # (before the math; q's fragments take the tensor-core split longer)
    math = (next(i for i, ln in enumerate(after) if ln.startswith("mma.")) if mma
            else first_q + 200)
    assert sum(ln.startswith("setp.eq.u32") for ln in after[first_q:math]) >= 3
    assert sum(ln.startswith(word) for ln in after) == n_words
    # without early_kv the wait comes first and nothing goes through .cg
    plain = F.build(attrs.evolve(spec, early_kv=False)).to_ptx()
    assert ".cg" not in plain
    pb = [ln.strip() for ln in plain[plain.index(".entry"):].splitlines()]
    assert pb.index("griddepcontrol.wait;") < min(
        i for i, ln in enumerate(pb) if ln.startswith("ld.global"))


@pytest.mark.gpu
@pytest.mark.parametrize("mma", [False, True])
def test_early_kv_sees_the_row_the_grid_before_appends(mma, rng):
    """The decode step's contract on the GPU: a PDL chain of KV append (this
    token's row at ``kv_len - 1``) then the early_kv split (and combine),
    captured once and replayed while the host advances the length.  Rows past
    the starting length hold NaN until appended, so a split that kept the
    row it loaded before its wait would give NaN.  Every step is checked
    against float64 attention over the rows appended so far."""
    from ptxgen.driver import (DeviceArray, Module, Stream, capture, get_device,
                               is_available, launch)
    from ptxgen.kernels import kv_append as KA
    if not is_available():
        pytest.skip("no NVIDIA driver / GPU available")
    dev = get_device()
    if dev.compute_capability < (9, 0):
        pytest.skip("PDL needs sm_90")
    tgt = dev.target
    spec = F.FlashDecodePlan.make(early_kv=True, target=tgt, pdl=True, mma=mma,
                                  unroll=2 if mma else 3)
    aspec = KA.KvAppendSpec(head_dim=128, target=tgt, pdl=True)
    fmod = Module.from_ptx(F.build(spec).to_ptx())
    split = fmod.function(spec.split_name)
    comb = fmod.function(spec.combine_name)
    app = Module.from_ptx(KA.build(aspec).to_ptx()).function(aspec.kernel_name)
    n_kv, G, d, cap = 8, 4, 128, 2048
    L0, steps = int(rng.integers(1, 300)), 24
    q, kc, vc = _data(rng, n_kv, G, cap, d, np.float16)
    kc[:, L0:] = np.nan
    vc[:, L0:] = np.nan
    S = F.choose_splits(spec, dev.sm_count, n_kv, cap)
    sgeo, cgeo = F.launch_geometry(spec, n_kv, S)
    g1, b1 = sgeo.grid, sgeo.block
    dq, dk, dv = (DeviceArray.from_numpy(a) for a in (q, kc, vc))
    knew = DeviceArray.from_numpy(np.zeros((n_kv, d), np.float32))
    vnew = DeviceArray.from_numpy(np.zeros((n_kv, d), np.float32))
    pos = DeviceArray.from_numpy(np.zeros(1, np.int32))
    lens = DeviceArray.from_numpy(np.zeros(1, np.int32))
    part_o = DeviceArray.from_numpy(np.full((n_kv * G, S, d), np.nan, np.float32))
    part_ml = DeviceArray.from_numpy(np.full((n_kv * G, S, 2), np.nan, np.float32))
    out = DeviceArray.from_numpy(np.full((n_kv * G, d), np.nan, np.float32))
    geo = KA.launch_geometry(aspec, n_kv)
    ag, ab = geo.grid, geo.block
    s = Stream()
    with capture(s) as cg:
        launch(app, ag, ab, knew, vnew, dk, dv, pos, n_kv, cap, stream=s, pdl=True)
        launch(split, g1, b1, dq, dk, dv, lens, part_o, part_ml, cap,
               1 / math.sqrt(d), stream=s, pdl=True)
        launch(comb, cgeo.grid, cgeo.block, part_o, part_ml, out, S, stream=s, pdl=True)
    ge = cg.instantiate()
    for step in range(steps):
        L = L0 + step + 1
        kn = rng.standard_normal((n_kv, d)).astype(np.float32)
        vn = rng.standard_normal((n_kv, d)).astype(np.float32)
        kc[:, L - 1], vc[:, L - 1] = kn, vn          # f16, as the append rounds
        knew.copy_from(kn)
        vnew.copy_from(vn)
        pos.copy_from(np.array([L - 1], np.int32))
        lens.copy_from(np.array([L], np.int32))
        out.copy_from(np.full((n_kv * G, d), np.nan, np.float32))
        ge.launch(s)
        s.synchronize()
        err = rel_err(out.to_numpy(), F.reference(q, kc, vc, L))
        assert err <= 1e-4, (step, L, err)


@pytest.mark.parametrize("target", ["sm_80", "sm_86", "sm_90"])
def test_per_sm_caps_split_blocks_by_shared_memory(target):
    """per_sm=n: the split launch asks for dynamic shared memory at which n
    blocks (with their static partials and 1 KB reserved) fit on an SM and
    n + 1 do not; resident_blocks and so choose_splits count with it."""
    from ptxgen.target import CTA_RESERVED_SHARED, TARGETS
    per = TARGETS[target].shared_per_sm
    base = F.FlashDecodePlan.make(target=target)
    assert base.dynamic_shared == 0
    for n in (1, 2, 3):
        s = attrs.evolve(base, per_sm=n)
        blk = s.dynamic_shared + s.shared_bytes + CTA_RESERVED_SHARED
        assert per // blk == n and s.dynamic_shared % 16 == 0
        assert F.resident_blocks(s) <= n
        assert F.build(s).to_ptx() == F.build(base).to_ptx()
    with pytest.raises(ValueError, match="per_sm"):
        attrs.evolve(base, per_sm=33)
    with pytest.raises(ValueError, match="do not fit"):
        F.FlashDecodePlan.make(target=target, head_dim=256, group=8, warps=2, per_sm=32)
