"""Flash prefill (causal chunk attention on tensor cores) against float64
attention written here, on tiny shapes, on the emulator (and the GPU)."""

import math

import numpy as np
import pytest

from ptxgen.driver import ops
from ptxgen.kernels import flash_prefill as FP

BOUND = 5e-3       # q and P rounded to f16: ~2^-11 relative per term (f16 out: one more)


def attention64(q, kc, vc, L, T):
    """float64 causal attention, a loop over rows and heads."""
    nq, d = q.shape[1], q.shape[2]
    n_kv = kc.shape[0]
    out = np.zeros((T, nq, d))
    for i in range(T):
        for qh in range(nq):
            h = qh // (nq // n_kv)
            keys = kc[h, :L + i + 1].astype(np.float64)
            s = keys @ q[i, qh].astype(np.float64) / math.sqrt(d)
            w = np.exp(s - s.max())
            out[i, qh] = (w / w.sum()) @ vc[h, :L + i + 1].astype(np.float64)
    return out


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _data(rng, n_kv, G, d, L, T, t_max, cap):
    q = (rng.standard_normal((t_max, n_kv * G, d)) * 2).astype(np.float32)
    kc = np.full((n_kv, cap, d), np.nan, np.float16)     # unwritten rows: NaN
    vc = np.full((n_kv, cap, d), np.nan, np.float16)
    kc[:, :L + T] = rng.standard_normal((n_kv, L + T, d))
    vc[:, :L + T] = rng.standard_normal((n_kv, L + T, d))
    return q, kc, vc


# L = 15, 14: a key tile (block_keys 16) ends at a warp's first row's position or one past it
CASES = [(L, T) for L in (0, 3, 14, 15, 40) for T in (1, 5, 17)]


@pytest.mark.parametrize("L,T", CASES)
def test_matches_float64(backend, rng, L, T):
    """L and T read from device scalars; a grid for 24 rows (2 blocks of 16
    rows of 2 heads); rows past T stay untouched."""
    d, n_kv, G, t_max = 64, 1, 2, 24
    q, kc, vc = _data(rng, n_kv, G, d, L, T, t_max, cap=L + T + 9)
    out = np.full((t_max, n_kv * G, d), np.nan, np.float32)
    ops.flash_prefill(q, kc, vc, np.array([L], np.int32), np.array([T], np.int32), out=out,
                      backend=backend.name, warps=2, heads=2, block_keys=16, stages=2)
    ref = attention64(q, kc, vc, L, T)
    assert rel_err(out[:T], ref) <= BOUND, (L, T, rel_err(out[:T], ref))
    assert np.all(np.isnan(out[T:])), "rows past T were written"


# (head_dim, n_kv, group, warps, heads, block_keys, stages, L, T, out dtype): every
# group size, the head dims (256: Gemma 3), L = 0 and L > 0 with T not a multiple of the
# block's rows, both output types, the shipped d128 layout (8 warps, 4 heads);
# blocks of 2 and 4 row groups paired from both ends with an odd number of
# 16-row groups (a middle one: T = 9, 13, 33, 70) and an even one (T = 21, 90)
LAYOUTS = [
    (64, 1, 1, 4, 1, 16, 2, 6, 70, np.float32),
    (64, 1, 1, 4, 1, 32, 3, 0, 90, np.float16),
    (64, 2, 1, 2, 1, 16, 3, 0, 21, np.float32),
    (64, 1, 2, 2, 2, 32, 2, 19, 11, np.float16),
    (64, 1, 4, 4, 4, 32, 2, 37, 19, np.float16),
    (64, 1, 8, 8, 4, 16, 3, 5, 9, np.float32),
    (128, 1, 4, 8, 4, 64, 2, 70, 33, np.float16),
    (128, 2, 2, 4, 2, 32, 3, 0, 13, np.float32),
    (256, 2, 2, 8, 2, 16, 3, 21, 40, np.float16),
]


def _check_layout(backend, rng, d, n_kv, G, warps, heads, bn, stages, L, T, odt, kernel):
    """One launch of ``kernel`` at this layout against float64; rows past
    T stay untouched."""
    t_max = T + 3
    q, kc, vc = _data(rng, n_kv, G, d, L, T, t_max, cap=L + T + 5)
    out = np.full((t_max, n_kv * G, d), np.nan, odt)
    ops.flash_prefill(q, kc, vc, np.array([L], np.int32), np.array([T], np.int32), out=out,
                      backend=backend.name, warps=warps, heads=heads, block_keys=bn,
                      stages=stages, kernel=kernel)
    err = rel_err(out[:T], attention64(q, kc, vc, L, T))
    assert err <= BOUND, err
    assert np.all(np.isnan(out[T:])), "rows past T were written"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(backend, rng, layout):
    """The mma.sync kernel (named: on sm_90a the table would pick wgmma
    for some of these)."""
    _check_layout(backend, rng, *layout, kernel="mma")


# the warpgroup (wgmma) kernel, sm_90a: heads 4 and 8, both head dims, 3 and
# 4 stages, tiles of 16/32/64 keys, L = 0 with many tiles (the walk's last
# P V after the loop), one and two warpgroups a block; two-warpgroup blocks
# whose back group walks 2 to 6 tiles past the front one's, at L = 0 and at
# L = 5 and 13 (the back rows straddle a tile boundary, so two of their
# tiles are masked), and a lone middle group (T = 100: 7 row groups)
WG_LAYOUTS = [
    (64, 1, 4, 4, 4, 32, 3, 37, 19, np.float16),
    (64, 1, 8, 8, 4, 16, 3, 5, 9, np.float32),
    (64, 1, 8, 8, 8, 64, 3, 3, 30, np.float32),
    (128, 1, 4, 8, 4, 64, 4, 0, 40, np.float32),
    (128, 2, 4, 4, 4, 64, 3, 0, 130, np.float16),
    (128, 1, 4, 8, 4, 16, 4, 70, 33, np.float32),
    (128, 1, 4, 8, 4, 64, 3, 0, 150, np.float32),
    (64, 1, 4, 8, 4, 16, 3, 5, 100, np.float16),
    (64, 2, 4, 8, 4, 32, 4, 13, 150, np.float32),
    (64, 1, 4, 8, 4, 16, 3, 0, 100, np.float32),
]


@pytest.mark.parametrize("layout", WG_LAYOUTS)
def test_warpgroup_kernel(backend, rng, layout):
    backend.require_sm(90)
    _check_layout(backend, rng, *layout, kernel="wgmma")


def test_warpgroup_kernel_config_is_checked():
    with pytest.raises(ValueError, match="needs target sm_90a"):
        FP.FlashPrefillPlan.make(kernel="wgmma", target="sm_90", stages=3)
    with pytest.raises(ValueError, match="heads a multiple of 4"):
        FP.FlashPrefillPlan.make(kernel="wgmma", target="sm_90a", stages=3, group=2, heads=2)
    with pytest.raises(ValueError, match="stages >= 3"):
        FP.FlashPrefillPlan.make(kernel="wgmma", target="sm_90a", stages=2)
    # the table's sm_90a choice, and the mma.sync kernel where the caller's
    # fields rule the warpgroup one out
    from ptxgen.driver.ops_prefill import flash_prefill_plan
    assert flash_prefill_plan(128, 4, target="sm_90").config.kernel == "wgmma"
    assert flash_prefill_plan(128, 4, target="sm_90", heads=2).config.kernel == "mma"
    assert flash_prefill_plan(128, 4, target="sm_80").config.kernel == "mma"
    with pytest.raises(ValueError, match="stages >= 3"):
        flash_prefill_plan(128, 4, target="sm_90", stages=2, kernel="wgmma")


def test_running_max_moves_past_the_slack(backend, rng):
    """Scores that rise from key tile to key tile (16-key tiles): by about
    5 (log2 units) where the kernel keeps its running max (probabilities
    up to 2^5 enter P), by about 16 and 24 where it must move it and
    rescale O and l (RESCALE_SLACK is 8)."""
    from ptxgen.kernels.flash_prefill.kernel import RESCALE_SLACK
    d, n_kv, G, L, T = 64, 1, 2, 40, 17
    q, kc, vc = _data(rng, n_kv, G, d, L, T, T, cap=L + T)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    q[:] = 3 * u + 0.3 * rng.standard_normal(q.shape)
    rise = np.array([0.0, 5.0, 21.0, 45.0])[np.arange(L + T) // 16]   # log2 units a tile
    b = rise / (3 / math.sqrt(d) / math.log(2))                   # q . k / sqrt(d) ~ 3 b / 8
    kc[0] = (b[:, None] * u + 0.3 * rng.standard_normal((L + T, d))).astype(np.float16)
    steps = np.diff(np.unique(rise))
    assert steps.min() < RESCALE_SLACK < steps.max()
    out = np.full(q.shape, np.nan, np.float32)
    ops.flash_prefill(q, kc, vc, np.array([L], np.int32), np.array([T], np.int32), out=out,
                      backend=backend.name, warps=2, heads=2, block_keys=16, stages=2)
    err = rel_err(out, attention64(q, kc, vc, L, T))
    assert err <= BOUND, err


def test_tuned_config(backend, rng):
    """No config fields: the shipped table's choice for head_dim 128, group 4."""
    d, L, T = 128, 9, 6
    q, kc, vc = _data(rng, 1, 4, d, L, T, T, cap=L + T)
    out = np.full(q.shape, np.nan, np.float32)
    ops.flash_prefill(q, kc, vc, L, T, out=out, backend=backend.name)
    assert rel_err(out, attention64(q, kc, vc, L, T)) <= BOUND


@pytest.mark.parametrize("odt", [np.float32, np.float16])
def test_gpu_shipped_config_larger(backend, rng, odt):
    """The tuned config on a shape too large for the emulator: 8 query heads
    of 2 KV heads, head_dim 128, a grid for 160 rows with T = 133 from the
    device, L = 300 (many key tiles, several blocks per head pair)."""
    if backend.name == "emu":
        pytest.skip("GPU-sized case")
    d, n_kv, G, L, T, t_max = 128, 2, 4, 300, 133, 160
    q, kc, vc = _data(rng, n_kv, G, d, L, T, t_max, cap=L + t_max + 7)
    out = np.full(q.shape, np.nan, odt)
    ops.flash_prefill(q, kc, vc, np.array([L], np.int32), np.array([T], np.int32), out=out,
                      backend=backend.name)
    assert rel_err(out[:T], attention64(q, kc, vc, L, T)) <= BOUND
    assert np.all(np.isnan(out[T:]))


@pytest.mark.parametrize("d,bn,stages,L,T", [(128, 64, 2, 70, 33), (64, 32, 3, 0, 45)])
def test_sm80_ring_of_cp_async(backend, rng, d, bn, stages, L, T):
    """The sm_80 build (every tile by cp.async, no tensor maps) on the same
    swizzled layout; a whole-tile and a partial last tile."""
    from ptxgen.driver.ops_prefill import flash_prefill_plan
    backend.require_sm(80)
    n_kv, G = 1, 4
    plan = flash_prefill_plan(d, G, target="sm_80", warps=8, heads=4, block_keys=bn,
                              stages=stages)
    assert FP.cache_maps(plan, 0, 0, n_kv, 1) is None
    q, kc, vc = _data(rng, n_kv, G, d, L, T, T, cap=L + T + 5)
    out = backend.poisoned(q.shape, np.float32)
    fn = backend.load(FP.build(plan))[plan.kernel_name]
    backend.launch(fn, FP.launch_geometry(plan, n_kv * G, T),
                   dict(q=backend.array(q), k_cache=backend.array(kc), v_cache=backend.array(vc),
                        start_ptr=backend.array(np.array([L], np.int32)),
                        n_tokens_ptr=backend.array(np.array([T], np.int32)), out=out,
                        capacity=L + T + 5, sm_scale=1.0 / math.sqrt(d), q_stride=n_kv * G * d))
    assert rel_err(out.to_numpy(), attention64(q, kc, vc, L, T)) <= BOUND


def test_q_in_a_wider_row(backend, rng):
    """q read from the start of each row of a wider [T, row] array."""
    d, n_kv, G, L, T = 64, 1, 2, 4, 7
    q, kc, vc = _data(rng, n_kv, G, d, L, T, T, cap=L + T)
    wide = rng.standard_normal((T, G * d + 3 * d)).astype(np.float32)
    wide[:, :G * d] = q.reshape(T, -1)
    out = ops.flash_prefill(wide, kc, vc, L, T, n_q_heads=G, backend=backend.name, warps=2,
                            heads=2, block_keys=16)
    assert rel_err(out, attention64(q, kc, vc, L, T)) <= BOUND


def test_causal_future_keys_do_not_leak(backend, rng):
    """Changing the chunk's last key and value changes only the last row."""
    d, L, T = 64, 3, 17
    q, kc, vc = _data(rng, 1, 1, d, L, T, T, cap=L + T)
    kw = dict(backend=backend.name, warps=1, heads=1, block_keys=16)
    a = ops.flash_prefill(q, kc, vc, L, T, **kw)
    kc2, vc2 = kc.copy(), vc.copy()
    kc2[:, L + T - 1] = rng.standard_normal(d) * 4
    vc2[:, L + T - 1] = rng.standard_normal(d) * 4
    b = ops.flash_prefill(q, kc2, vc2, L, T, **kw)
    np.testing.assert_array_equal(a[:T - 1], b[:T - 1])
    assert not np.array_equal(a[T - 1], b[T - 1])


def test_reference_module_agrees(rng):
    q, kc, vc = _data(rng, 2, 3, 64, 5, 7, 7, cap=12)
    np.testing.assert_allclose(FP.reference(q, kc, vc, 5, 7), attention64(q, kc, vc, 5, 7),
                               rtol=1e-12, atol=1e-12)


def test_launch_geometry():
    p = FP.FlashPrefillPlan.make(head_dim=128, group=4, warps=8, heads=4, block_keys=64,
                                 stages=2)
    geo = FP.launch_geometry(p, 32, 512)
    grid, block, shared = geo.grid, geo.block, geo.shared
    assert (grid, block) == ((16, 8, 1), (256, 1, 1))
    # 2 stages of a K and a V tile of 64 unpadded rows of 128 halves (sm_80)
    assert shared == 2 * 2 * 64 * 128 * 2
    # sm_90 adds one 8-byte mbarrier a stage (whole tiles come by TMA)
    p90 = FP.FlashPrefillPlan.make(head_dim=128, group=4, warps=8, heads=4, block_keys=64,
                                   stages=3, target="sm_90")
    assert FP.launch_geometry(p90, 32, 512).shared == 3 * 2 * 64 * 128 * 2 + 3 * 8


def test_bad_input_is_refused():
    q = np.zeros((4, 2, 64), np.float32)
    kc = np.zeros((1, 8, 64), np.float32)
    with pytest.raises(TypeError, match="float16"):
        ops.flash_prefill(q, kc, kc, 0, 4, backend="emu")
    kc16 = np.zeros((1, 8, 64), np.float16)
    with pytest.raises(TypeError, match="out must be float32 or float16"):
        ops.flash_prefill(q, kc16, kc16, 0, 4, out=np.zeros((4, 2, 64)), backend="emu")
    with pytest.raises(ValueError, match="heads=4 must divide the GQA group 2"):
        ops.flash_prefill(q, kc16, kc16, 0, 4, backend="emu", heads=4)
    with pytest.raises(ValueError, match="must divide warps"):
        FP.FlashPrefillPlan.make(group=4, heads=4, warps=2)
    kc = np.zeros((1, 8, 96), np.float16)
    with pytest.raises(ValueError, match="q must be"):
        ops.flash_prefill(q, kc, kc, 0, 4, backend="emu")


# (head_dim, n_kv, group, warps, heads, block_keys, stages, L, T, window): a
# window shorter than a tile and longer than several, L = 0 and a chunk far
# into the sequence (the walk starts past tile 0), blocks of one row group
# and of pairs (the back group's first tile past the front group's last),
# head_dim 256 (Gemma 3)
WINDOW_LAYOUTS = [
    (64, 1, 2, 2, 2, 16, 2, 0, 40, 5),
    (64, 1, 2, 2, 2, 16, 3, 37, 20, 7),
    (64, 1, 1, 4, 1, 16, 2, 6, 70, 20),
    (64, 2, 2, 4, 2, 32, 2, 50, 33, 48),
    (128, 1, 4, 8, 4, 64, 2, 70, 33, 17),
    (64, 1, 4, 4, 4, 32, 3, 37, 19, 9),
    (64, 1, 4, 8, 4, 16, 3, 5, 100, 30),
    (256, 2, 2, 8, 2, 16, 3, 40, 45, 24),
    (256, 1, 4, 4, 4, 16, 3, 9, 30, 12),
]


@pytest.mark.parametrize("layout", WINDOW_LAYOUTS)
@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
def test_sliding_window(backend, rng, layout, kernel):
    """Row i sees the keys L + i - window + 1 .. L + i (the keys before
    are NaN-free but far from the rows' windows: a leak changes the sums)."""
    d, n_kv, G, warps, heads, bn, stages, L, T, W = layout
    if kernel == "wgmma":
        backend.require_sm(90)
        stages = max(stages, 3)
        if heads % 4:
            pytest.skip("wgmma takes heads in fours")
    t_max = T + 3
    q, kc, vc = _data(rng, n_kv, G, d, L, T, t_max, cap=L + T + 5)
    out = np.full((t_max, n_kv * G, d), np.nan, np.float32)
    ops.flash_prefill(q, kc, vc, np.array([L], np.int32), np.array([T], np.int32), out=out,
                      backend=backend.name, warps=warps, heads=heads, block_keys=bn,
                      stages=stages, kernel=kernel, window=W)
    ref = FP.reference(q, kc, vc, L, T, window=W)
    err = rel_err(out[:T], ref)
    assert err <= BOUND, err
    assert rel_err(out[:T], FP.reference(q, kc, vc, L, T)) > 10 * BOUND, "the window is not applied"
    assert np.all(np.isnan(out[T:])), "rows past T were written"


def test_window_reference_matches_the_loop(rng):
    """The module's windowed reference against a loop over rows here."""
    q, kc, vc = _data(rng, 1, 2, 64, 9, 6, 6, cap=15)
    W = 4
    want = np.zeros((6, 2, 64))
    for i in range(6):
        p = 9 + i
        for qh in range(2):
            keys = kc[0, p - W + 1:p + 1].astype(np.float64)
            s = keys @ q[i, qh].astype(np.float64) / 8.0
            w = np.exp(s - s.max())
            want[i, qh] = (w / w.sum()) @ vc[0, p - W + 1:p + 1].astype(np.float64)
    assert np.max(np.abs(FP.reference(q, kc, vc, 9, 6, window=W) - want)) < 1e-12

