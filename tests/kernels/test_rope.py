"""RoPE (NeoX and interleaved, Llama-3 scaling) against float64 numpy.

The oracle is tests/kernels/formulas.py: the inverse frequencies written
out from Llama 3.1's published rope-scaling definition (every one of the
d/2 frequencies checked, the smoothed band included) and a pair-by-pair
rotation.  ``rope.reference`` builds its frequencies with ``rope.inv_freq``,
the function that also fills the kernel's table, so it is itself checked
against the formulas here and is never the oracle of a kernel test.
"""


import numpy as np
import pytest

from formulas import llama3_inv_freq, rope_rotate, smoothed_band
from ptxgen.kernels import rope as R


def formula_freqs(spec):
    """The spec's inverse frequencies from the plain formula."""
    if spec.scaling == "llama3":
        return llama3_inv_freq(spec.theta, spec.head_dim, spec.factor, spec.low_freq_factor,
                               spec.high_freq_factor, spec.original_context)
    return llama3_inv_freq(spec.theta, spec.head_dim)


def want(x, pos, spec):
    """The float64 oracle of RoPE at ``pos`` for ``spec``."""
    return rope_rotate(x, pos, formula_freqs(spec), spec.layout)


def rel_err(out, ref) -> float:
    """``max|out - ref| / max|ref|`` in float64 (inf if ``out`` is not finite)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _run(run, spec, q, k, pos):
    f = run.function(R.build, spec)
    n_q, n_kv = q.shape[0], k.shape[0]
    dq, dk = run.array(q), run.array(k)
    run.launch(f, R.launch_geometry(spec, n_q, n_kv),
               dict(q=dq, k=dk, freqs=run.array(R.freq_table(spec)),
                    pos_ptr=run.array(np.array([pos], np.int32)), n_q_heads=n_q,
                    n_kv_heads=n_kv))
    return run.get(dq), run.get(dk)


SPECS = [
    R.RopeSpec(head_dim=64, block=64),
    R.RopeSpec(head_dim=128, layout="interleaved", block=64),
    R.RopeSpec(head_dim=128, theta=500000.0, scaling="llama3", block=64),
    R.RopeSpec(head_dim=64, layout="interleaved", theta=500000.0, scaling="llama3",
               factor=32.0, original_context=8192, block=32),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout}-{s.head_dim}-{s.scaling}")
@pytest.mark.parametrize("pos", [0, 1, 17, 4099, 131071])
def test_rope(run, spec, pos, rng):
    q = rng.standard_normal((5, spec.head_dim)).astype(np.float32)
    k = rng.standard_normal((1, spec.head_dim)).astype(np.float32)
    gq, gk = _run(run, spec, q, k, pos)
    for got, x in ((gq, q), (gk, k)):
        ref = want(x, pos, spec)
        for h in range(x.shape[0]):
            assert rel_err(got[h], ref[h]) <= 1e-5, (h, rel_err(got[h], ref[h]))


# Llama 3.1 8B (theta 5e5, factor 8, low 1, high 4, original context 8192),
# Llama 3.2 1B/3B (factor 32), and a made-up set that moves every boundary.
LLAMA3_SETS = [
    dict(theta=500000.0, head_dim=128, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_context=8192),
    dict(theta=500000.0, head_dim=64, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_context=8192),
    dict(theta=10000.0, head_dim=128, factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0,
         original_context=4096),
]


@pytest.mark.parametrize("p", LLAMA3_SETS, ids=lambda p: f"f{p['factor']:g}-d{p['head_dim']}")
def test_llama3_frequencies(p):
    """Every frequency, the smoothed band between the two wavelengths too,
    equals the plain formula; the (hi, lo) table sums to it."""
    spec = R.RopeSpec(scaling="llama3", **p)
    f = R.inv_freq(spec)
    ref = llama3_inv_freq(p["theta"], p["head_dim"], p["factor"], p["low_freq_factor"],
                          p["high_freq_factor"], p["original_context"])
    assert f.shape == ref.shape == (p["head_dim"] // 2,)
    assert np.max(np.abs(f - ref) / ref) < 1e-14
    band = smoothed_band(p["theta"], p["head_dim"], p["low_freq_factor"], p["high_freq_factor"],
                         p["original_context"])
    assert len(band) >= 3, band            # the blend is exercised, not only the two ends
    t = R.freq_table(spec).astype(np.float64)
    assert np.max(np.abs(t[:, 0] + t[:, 1] - ref) / ref) < 1e-13


@pytest.mark.parametrize("name", ["theta", "factor", "low_freq_factor", "high_freq_factor",
                                  "original_context"])
def test_llama3_every_parameter_moves_frequencies(name):
    """A 10% change of any one parameter moves some frequency by more than
    1e-3 relative, in the kernel's table and in the formula alike."""
    p = dict(LLAMA3_SETS[0])
    spec = R.RopeSpec(scaling="llama3", **p)
    p2 = dict(p, **{name: p[name] * (1.1 if name != "original_context" else 1)
                    + (410 if name == "original_context" else 0)})
    spec2 = R.RopeSpec(scaling="llama3", **p2)
    moved = np.max(np.abs(R.inv_freq(spec2) - R.inv_freq(spec)) / R.inv_freq(spec))
    assert moved > 1e-3
    assert np.max(np.abs(formula_freqs(spec2) - R.inv_freq(spec2)) / formula_freqs(spec2)) < 1e-14


def test_rope_reference_matches_the_formula(rng):
    for spec in SPECS:
        x = rng.standard_normal((3, spec.head_dim))
        pos = int(rng.integers(0, 1 << 20))
        assert rel_err(R.reference(x, pos, spec), want(x, pos, spec)) < 1e-9   # angles ~1e6 rad


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_rope_where_the_smoothed_band_dominates(run, layout, rng):
    """Llama 3.1 scaling at a long position, Q and K carrying their weight in
    the smoothed band's pairs (the other pairs 1000 times smaller): an error
    in a blended frequency moves the largest elements."""
    spec = R.RopeSpec(head_dim=128, layout=layout, theta=500000.0, scaling="llama3", block=64)
    band = smoothed_band(500000.0, 128, 1.0, 4.0, 8192)
    pair = np.zeros(128, bool)
    for i in band:
        pair[[i, i + 64] if layout == "neox" else [2 * i, 2 * i + 1]] = True
    scale = np.where(pair, 1.0, 1e-3)
    q = (rng.standard_normal((4, 128)) * scale).astype(np.float32)
    k = (rng.standard_normal((2, 128)) * scale).astype(np.float32)
    pos = int(rng.integers(60000, 130000))
    gq, gk = _run(run, spec, q, k, pos)
    for got, x in ((gq, q), (gk, k)):
        assert rel_err(got, want(x, pos, spec)) <= 1e-5
    # the bound is tight enough: the band's frequencies 1e-4 off fail it
    f = formula_freqs(spec)
    f[band] *= 1 + 1e-4
    assert rel_err(rope_rotate(q, pos, f, layout), want(q, pos, spec)) > 1e-4


def test_rope_theta_matters(run, rng):
    """theta 10000 against 500000 (no scaling): the results differ far beyond
    the bound at the position used, and the kernel follows the spec's."""
    q = rng.standard_normal((2, 64)).astype(np.float32)
    k = rng.standard_normal((1, 64)).astype(np.float32)
    pos = int(rng.integers(100, 5000))
    for theta in (10000.0, 500000.0):
        spec = R.RopeSpec(head_dim=64, theta=theta, block=64)
        gq, _ = _run(run, spec, q, k, pos)
        assert rel_err(gq, want(q, pos, spec)) <= 1e-5
    other = R.RopeSpec(head_dim=64, theta=10000.0)
    assert rel_err(want(q, pos, R.RopeSpec(head_dim=64, theta=500000.0)), want(q, pos, other)) > 1e-2


@pytest.mark.gpu
def test_rope_gpu(gpu_run, rng):
    spec = R.RopeSpec(theta=500000.0, scaling="llama3")
    q = rng.standard_normal((32, 128)).astype(np.float32)
    k = rng.standard_normal((8, 128)).astype(np.float32)
    for pos in (0, 8191, 100000):
        gq, gk = _run(gpu_run, spec, q, k, pos)
        assert rel_err(gq, want(q, pos, spec)) <= 1e-5
        assert rel_err(gk, want(k, pos, spec)) <= 1e-5


@pytest.mark.parametrize("bad", [dict(head_dim=7), dict(head_dim=1024), dict(layout="gptj"),
                                 dict(theta=0.0), dict(scaling="yarn"), dict(append="bf16"),
                                 dict(append=True),
                                 dict(scaling="llama3", low_freq_factor=4.0, high_freq_factor=1.0)])
def test_rope_refuses(bad):
    with pytest.raises(ValueError):
        R.RopeSpec(**bad)


# --------------------------------------------------------------------------
# Fused RoPE + KV-cache append (append="f16" / "f32")

def _run_append(run, spec, q, k, v, kc, vc, pos):
    f = run.function(R.build, spec)
    n_q, n_kv = q.shape[0], k.shape[0]
    dq, dk, dkc, dvc = run.array(q), run.array(k), run.array(kc), run.array(vc)
    run.launch(f, R.launch_geometry(spec, n_q, n_kv),
               dict(q=dq, k=dk, freqs=run.array(R.freq_table(spec)),
                    pos_ptr=run.array(np.array([pos], np.int32)), n_q_heads=n_q,
                    n_kv_heads=n_kv, v=run.array(v), k_cache=dkc, v_cache=dvc,
                    capacity=kc.shape[1]))
    return run.get(dq), run.get(dk), run.get(dkc), run.get(dvc)


def _inputs(rng, spec, n_q, n_kv, cap):
    """Random q, k, v (scaled, so never zeros) and caches poisoned with NaN
    (f32) or a random fill (f16)."""
    d = spec.head_dim
    q = (rng.standard_normal((n_q, d)) * 3).astype(np.float32)
    k = (rng.standard_normal((n_kv, d)) * 3).astype(np.float32)
    v = (rng.standard_normal((n_kv, d)) * 3).astype(np.float32)
    if spec.append == "f16":
        kc = rng.standard_normal((n_kv, cap, d)).astype(np.float16)
        vc = rng.standard_normal((n_kv, cap, d)).astype(np.float16)
    else:
        kc = np.full((n_kv, cap, d), np.nan, np.float32)
        vc = np.full((n_kv, cap, d), np.nan, np.float32)
    return q, k, v, kc, vc


def _bits(x):
    x = np.ascontiguousarray(x)
    return x.view(np.uint16 if x.dtype == np.float16 else np.uint32)


def _check_qk(gq, gk, q, k, pos, spec):
    for got, x in ((gq, q), (gk, k)):
        ref = want(x, pos, spec)
        for h in range(x.shape[0]):
            assert rel_err(got[h], ref[h]) <= 1e-5, (h, rel_err(got[h], ref[h]))


APPEND_SPECS = [R.RopeSpec(head_dim=d, layout=lay, append=app, block=64,
                           **(dict(theta=500000.0, scaling="llama3") if lay == "interleaved"
                              else {}))
                for lay in ("neox", "interleaved") for d in (64, 128) for app in ("f16", "f32")]


@pytest.mark.parametrize("spec", APPEND_SPECS,
                         ids=lambda s: f"{s.layout}-{s.head_dim}-{s.append}")
@pytest.mark.parametrize("heads", [(32, 8), (6, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_rope_append(run, spec, heads, rng):
    n_q, n_kv = heads
    cap = 37
    pos = int(rng.integers(0, cap))
    q, k, v, kc, vc = _inputs(rng, spec, n_q, n_kv, cap)
    gq, gk, gkc, gvc = _run_append(run, spec, q, k, v, kc, vc, pos)
    _check_qk(gq, gk, q, k, pos, spec)

    cty = kc.dtype
    ref_k = want(k, pos, spec)
    for h in range(n_kv):
        row = gkc[h, pos]
        if cty == np.float16:
            assert np.all(np.isfinite(row)), h
            # the rotation is f32 (within 1e-5 of the row's largest value, as
            # _check_qk bounds it), then rounded to f16: at most half an f16
            # ulp of the exact value more; where x cos - y sin cancels, the
            # f32 part can exceed an ulp of the small result
            ref = ref_k[h]
            ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
            bound = 0.5 * ulp + 1e-5 * np.max(np.abs(ref))
            err = np.abs(row.astype(np.float64) - ref)
            assert np.all(err <= bound), (h, float(np.max(err / bound)))
        else:
            assert rel_err(row, ref_k[h]) <= 1e-5, (h, rel_err(row, ref_k[h]))
    # the cache holds exactly the rotated K written back to k, converted
    np.testing.assert_array_equal(_bits(gkc[:, pos]), _bits(gk.astype(cty)))
    # V is copied, converted with round-to-nearest-even (numpy's cast, cvt.rn)
    np.testing.assert_array_equal(_bits(gvc[:, pos]), _bits(v.astype(cty)))
    # every other row is untouched
    others = np.arange(cap) != pos
    np.testing.assert_array_equal(_bits(gkc[:, others]), _bits(kc[:, others]))
    np.testing.assert_array_equal(_bits(gvc[:, others]), _bits(vc[:, others]))


@pytest.mark.parametrize("spec", [APPEND_SPECS[0], APPEND_SPECS[-1]],
                         ids=lambda s: f"{s.layout}-{s.head_dim}-{s.append}")
@pytest.mark.parametrize("where", ["capacity", "negative"])
def test_rope_append_out_of_range_leaves_cache(run, spec, where, rng):
    cap = 5
    pos = cap if where == "capacity" else -1
    q, k, v, kc, vc = _inputs(rng, spec, 6, 2, cap)
    gq, gk, gkc, gvc = _run_append(run, spec, q, k, v, kc, vc, pos)
    _check_qk(gq, gk, q, k, pos, spec)          # Q and K are still rotated
    np.testing.assert_array_equal(_bits(gkc), _bits(kc))
    np.testing.assert_array_equal(_bits(gvc), _bits(vc))


def test_rope_append_kernel_names():
    names = {R.RopeSpec(append=a).kernel_name for a in ("none", "f16", "f32")}
    assert names == {"rope_neox_d128", "rope_neox_d128_app16", "rope_neox_d128_app32"}
    assert R.RopeSpec(layout="interleaved", head_dim=64, append="f16").kernel_name \
        == "rope_interleaved_d64_app16"


def test_rope_append_parameters():
    text = R.build(R.RopeSpec(append="f16")).to_ptx()
    order = ["q", "k", "freqs", "pos_ptr", "n_q_heads", "n_kv_heads",
             "v", "k_cache", "v_cache", "capacity"]
    params = [line.strip().rstrip(",").split()[-1] for line in text.splitlines()
              if line.strip().startswith(".param")]
    assert params == order
    none = R.build(R.RopeSpec()).to_ptx()
    assert [line.strip().rstrip(",").split()[-1] for line in none.splitlines()
            if line.strip().startswith(".param")] == order[:6]


@pytest.mark.parametrize("layout", ["interleaved", "neox"])
def test_rope_rows_append(run, layout, rng):
    """The rows form: row y of a [T_max, q | k | v] buffer at position start + y,
    rows at or past T untouched, each row's K/V in the cache at its position."""
    spec = R.RopeSpec(head_dim=64, layout=layout, append="f16", rows=True, block=64)
    n_q, n_kv, d, cap, t_max, T, start = 4, 2, 64, 16, 5, 3, 6
    stride = (n_q + 2 * n_kv) * d
    qkv = rng.standard_normal((t_max, stride)).astype(np.float32)
    kc = rng.standard_normal((n_kv, cap, d)).astype(np.float16)
    vc = rng.standard_normal((n_kv, cap, d)).astype(np.float16)
    f = run.function(R.build, spec)
    dqkv, dkc, dvc = run.array(qkv), run.array(kc), run.array(vc)
    # q, k, v at element offsets 0, n_q d, (n_q + n_kv) d of each row
    run.launch(f, R.launch_geometry(spec, n_q, n_kv, t_max),
               dict(q=dqkv, k=_offset(dqkv, n_q * d), freqs=run.array(R.freq_table(spec)),
                    pos_ptr=run.array(np.array([start], np.int32)), n_q_heads=n_q,
                    n_kv_heads=n_kv, v=_offset(dqkv, (n_q + n_kv) * d), k_cache=dkc,
                    v_cache=dvc, capacity=cap, row_stride=stride,
                    n_rows_ptr=run.array(np.array([T], np.int32))))
    out, gkc, gvc = run.get(dqkv), run.get(dkc), run.get(dvc)
    for y in range(t_max):
        q = qkv[y, :n_q * d].reshape(n_q, d)
        k = qkv[y, n_q * d:(n_q + n_kv) * d].reshape(n_kv, d)
        v = qkv[y, (n_q + n_kv) * d:].reshape(n_kv, d)
        if y >= T:
            np.testing.assert_array_equal(out[y], qkv[y])
            continue
        pos = start + y
        assert rel_err(out[y, :n_q * d].reshape(n_q, d), want(q, pos, spec)) <= 1e-5
        kr = want(k, pos, spec)
        assert rel_err(out[y, n_q * d:(n_q + n_kv) * d].reshape(n_kv, d), kr) <= 1e-5
        np.testing.assert_array_equal(out[y, (n_q + n_kv) * d:], qkv[y, (n_q + n_kv) * d:])
        assert rel_err(gkc[:, pos].astype(np.float64), kr) <= 2e-3
        np.testing.assert_array_equal(gvc[:, pos], v.astype(np.float16))
    untouched = [p for p in range(cap) if not start <= p < start + T]
    np.testing.assert_array_equal(gkc[:, untouched], kc[:, untouched])
    np.testing.assert_array_equal(gvc[:, untouched], vc[:, untouched])


def _offset(arr, elems):
    """A view of ``arr`` starting ``elems`` f32 elements in."""
    return arr.view(offset=4 * elems)


@pytest.mark.parametrize("layout,app,bs", [("interleaved", "f16", 16), ("neox", "f16", 32),
                                           ("interleaved", "f32", 64), ("neox", "f32", 16)])
def test_rope_paged_append(run, layout, app, bs, rng):
    """The paged form: row y of a [T_max, q | k | v] buffer (tokens of any
    sequences) rotated at its own position ``positions[y]`` (unordered, far
    apart), its K/V rows written to slot ``slots[y]`` of paged pools
    ``[num_blocks, n_kv, bs, d]``; a row with slot -1 or ``n_slots`` is
    rotated and writes nothing; rows at or past T are untouched, and so is
    every other slot of the pools."""
    spec = R.RopeSpec(head_dim=64, layout=layout, append=app, rows=True, paged=bs, block=64,
                      **(dict(theta=500000.0, scaling="llama3") if layout == "interleaved"
                         else {}))
    n_q, n_kv, d, nb, t_max, T = 4, 2, 64, 5, 7, 6
    n_slots = nb * bs
    stride = (n_q + 2 * n_kv) * d + 8                 # a padded row: 8 elements nobody reads
    qkv = (rng.standard_normal((t_max, stride)) * 3).astype(np.float32)
    cty = np.float16 if app == "f16" else np.float32
    kp = rng.standard_normal((nb, n_kv, bs, d)).astype(cty)
    vp = rng.standard_normal((nb, n_kv, bs, d)).astype(cty)
    positions = rng.permutation(rng.integers(0, 20000, t_max)).astype(np.int32)
    slots = rng.choice(n_slots, t_max, replace=False).astype(np.int32)
    skip = rng.choice(T, 2, replace=False)
    slots[skip[0]], slots[skip[1]] = -1, n_slots
    f = run.function(R.build, spec)
    dqkv, dkp, dvp = run.array(qkv), run.array(kp), run.array(vp)
    run.launch(f, R.launch_geometry(spec, n_q, n_kv, t_max),
               dict(q=dqkv, k=_offset(dqkv, n_q * d), freqs=run.array(R.freq_table(spec)),
                    positions=run.array(positions), n_q_heads=n_q, n_kv_heads=n_kv,
                    v=_offset(dqkv, (n_q + n_kv) * d), k_pool=dkp, v_pool=dvp, n_slots=n_slots,
                    row_stride=stride, n_rows_ptr=run.array(np.array([T], np.int32)),
                    slots=run.array(slots)))
    out, gkp, gvp = run.get(dqkv), run.get(dkp), run.get(dvp)
    want_kp, want_vp = kp.copy(), vp.copy()
    vend = (n_q + 2 * n_kv) * d
    for y in range(t_max):
        if y >= T:
            np.testing.assert_array_equal(out[y], qkv[y])
            continue
        pos = int(positions[y])
        q = qkv[y, :n_q * d].reshape(n_q, d)
        k = qkv[y, n_q * d:(n_q + n_kv) * d].reshape(n_kv, d)
        v = qkv[y, (n_q + n_kv) * d:vend].reshape(n_kv, d)
        assert rel_err(out[y, :n_q * d].reshape(n_q, d), want(q, pos, spec)) <= 1e-5, y
        gk = out[y, n_q * d:(n_q + n_kv) * d].reshape(n_kv, d)
        assert rel_err(gk, want(k, pos, spec)) <= 1e-5, y
        np.testing.assert_array_equal(out[y, (n_q + n_kv) * d:], qkv[y, (n_q + n_kv) * d:])
        if 0 <= slots[y] < n_slots:
            blk, off = divmod(int(slots[y]), bs)
            want_kp[blk, :, off] = gk.astype(cty)       # the rotated K, converted
            want_vp[blk, :, off] = v.astype(cty)        # V as given, converted
    np.testing.assert_array_equal(_bits(gkp), _bits(want_kp))
    np.testing.assert_array_equal(_bits(gvp), _bits(want_vp))


def test_rope_paged_parameters_and_refusals():
    spec = R.RopeSpec(append="f16", rows=True, paged=64)
    assert spec.kernel_name == "rope_neox_d128_app16_rows_paged64"
    params = [line.strip().rstrip(",").split()[-1] for line in R.build(spec).to_ptx().splitlines()
              if line.strip().startswith(".param")]
    assert params == ["q", "k", "freqs", "positions", "n_q_heads", "n_kv_heads", "v", "k_pool",
                      "v_pool", "n_slots", "row_stride", "n_rows_ptr", "slots"]
    for bad in (dict(paged=16), dict(paged=16, rows=True), dict(paged=16, append="f16"),
                dict(paged=8, rows=True, append="f16"), dict(paged=True, rows=True,
                                                            append="f16"),
                dict(paged=512, rows=True, append="f16")):
        with pytest.raises(ValueError, match="paged"):
            R.RopeSpec(**bad)
