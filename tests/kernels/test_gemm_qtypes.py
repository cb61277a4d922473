"""The GEMM's Q6_K and Q8_0 formats (kernels/gemm/q6k.py, q8_0.py), and the
warpgroup kernel's Q6_K, Q8_0, Q4_0, Q5_0, Q5_K, F16 and BF16 (wgmma_q6k.py,
wgmma_blocks32.py, wgmma_q4k.py, wgmma_f16.py), against float64.

The oracle: float64 weights from ``gguf.quants.dequantize`` (gguf's own
decoder; exact here, as its f32 products ``d sc (q - 32)`` and ``d q`` need at
most 24 bits) times float64 X.  Weights are random valid blocks drawn from the
seeded ``rng`` (and, for Q8_0, gguf's quantizer of random floats), with ``|d|
>= 2^-10`` so that no decoded weight is subnormal in f16.

The bound, per output, summed with absolute values over K (``u = 2^-11``):

- Q6_K: X rounded to f16 (``u``), ``d sc`` to f16 (``u``), the weight ``(q -
  32) (d sc)`` once more (``u``): ``3.01 u sum |x w|``; Q5_K the same with
  ``|w|`` replaced by ``|d sc q| + |dmin m|`` (rounded apart); F16 only X
  (``1.01 u sum |x w|``);
- Q8_0, Q4_0, Q5_0: X (``u``) and the weight ``(q - z) d`` (``u``; ``q - z``
  exact): ``2.01 u sum |x w|``;

plus ``(K/16 + 1) 2^-21 sum |x w|`` for the f32 mma chain (docs/emulator.md),
``2^-24 sum (|x| + |w|)`` for f16 subnormals of X, and ``2^-24 |y|`` for the
residual add.
"""

import numpy as np
import pytest

from ptxgen.kernels import gemm as G
from test_gemm import _check as check, _launch as launch

gguf = pytest.importorskip("gguf")

U = 2.0 ** -11
FACTOR = {"Q6_K": 3.01, "Q8_0": 2.01, "Q4_0": 2.01, "Q5_0": 2.01, "Q5_K": 3.01, "F16": 1.01,
          "BF16": 1.01}


def _d(rng, n):
    """f16 scales with 2^-10 <= |d| < 2^-4, either sign, as bytes."""
    mag = 2.0 ** rng.uniform(-10, -4, n)
    return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float16).view(np.uint8).reshape(n, 2)


def random_blocks(rng, qtype, m, k):
    """``uint8 [m, row_bytes]`` of random valid ``qtype`` blocks."""
    if qtype == "F16":
        return (rng.standard_normal((m, k)) * 0.1).astype(np.float16).view(np.uint8)
    if qtype == "BF16":
        # magnitudes 2^-20 .. 2^15 (f16 subnormals to near f16's largest),
        # truncated to bf16's 8 significant bits
        w = rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-20, 15, (m, k))
        w = np.clip(w, -65280, 65280).astype(np.float32)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if qtype == "Q5_K":
        n = m * k // 256
        b = np.concatenate([_d(rng, n), _d(rng, n),
                            rng.integers(0, 256, (n, 12 + 32 + 128), dtype=np.uint8)], axis=1)
        return b.reshape(m, k // 256 * 176)
    if qtype in ("Q8_0", "Q4_0", "Q5_0"):
        nq = {"Q8_0": 32, "Q4_0": 16, "Q5_0": 20}[qtype]       # bytes after d
        n = m * k // 32
        b = np.concatenate([_d(rng, n), rng.integers(0, 256, (n, nq), dtype=np.uint8)], axis=1)
        return b.reshape(m, k // 32 * (2 + nq))
    n = m * k // 256
    q = rng.integers(0, 256, (n, 192), dtype=np.uint8)            # ql, qh
    sc = rng.integers(-128, 128, (n, 16)).astype(np.int8).view(np.uint8)
    b = np.concatenate([q, sc, _d(rng, n)], axis=1)
    return b.reshape(m, k // 256 * 210)


def gguf_quantized(rng, m, k):
    """Q8_0 from gguf's own quantizer (random floats of a few magnitudes)."""
    w = (rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-3, 3, (m, 1))).astype(np.float32)
    return np.asarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))


def oracle(qtype, w, x, r=None):
    """``(Y in float64, |W| in float64)`` from gguf's dequantizer."""
    wd = gguf.quants.dequantize(w, getattr(gguf.GGMLQuantizationType, qtype))
    wd = np.asarray(wd, np.float64).reshape(w.shape[0], -1)
    y = np.asarray(x, np.float64) @ wd.T
    if r is not None:
        y = y + np.asarray(r, np.float64)
    return y, np.abs(wd)


def q5k_abs_parts(w, m, k):
    """``|d sc q| + |dmin m|`` per weight of Q5_K bytes (the product bound's
    term: the kernel rounds ``d sc`` and ``dmin m`` separately), decoded here
    from the block layout, and checked against gguf's weights."""
    b = w.reshape(m * k // 256, 176)
    d = b[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float64)
    dmin = b[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float64)
    sc8, qh, qs = b[:, 4:16].astype(np.int64), b[:, 16:48].astype(np.int64), b[:, 48:]
    out = np.empty((b.shape[0], 256))
    wd = np.empty((b.shape[0], 256))
    for j in range(8):
        if j < 4:
            sc, mn = sc8[:, j] & 63, sc8[:, j + 4] & 63
        else:
            sc = (sc8[:, j + 4] & 15) | ((sc8[:, j - 4] >> 6) << 4)
            mn = (sc8[:, j + 4] >> 4) | ((sc8[:, j] >> 6) << 4)
        g, hi = j // 2, j % 2
        nib = (qs[:, 32 * g:32 * g + 32].astype(np.int64) >> (4 * hi)) & 15
        q = nib + 16 * ((qh >> j) & 1)
        s_, o_ = (d * sc)[:, None], (dmin * mn)[:, None]
        out[:, 32 * j:32 * j + 32] = np.abs(s_ * q) + np.abs(o_)
        wd[:, 32 * j:32 * j + 32] = s_ * q - o_
    theirs = np.asarray(gguf.quants.dequantize(w, gguf.GGMLQuantizationType.Q5_K), np.float64)
    assert np.allclose(wd.reshape(m, k), theirs.reshape(m, k), rtol=0,
                       atol=1e-6 * np.abs(theirs).max())
    return out.reshape(m, k)


def bound(qtype, x, wa, ref, residual):
    k = x.shape[1]
    xa = np.abs(np.asarray(x, np.float64))
    sa = xa @ wa.T
    b = (FACTOR[qtype] * U + (k / 16 + 1) * 2.0 ** -21 * (1 + 4 * U)) * sa
    b = b + 2.0 ** -24 * (xa.sum(axis=1, keepdims=True) + wa.sum(axis=1)[None, :])
    if residual is not None:
        b = b + 2.0 ** -24 * np.abs(ref)
    return b


# (qtype, T, M, K, fields): M and T cut tiles short; rows whose bytes are not
# 16-byte aligned (210 and 34 bytes a block: every shift 0..14 occurs) and a
# W whose size is not a multiple of 16 (the last chunk read in 8, 4 and 2-byte
# pieces); every stage depth, both x types, the residual
CASES = [
    ("Q6_K", 5, 37, 256, dict(bk=128, bm=32, bn=8, warps_m=2, warps_n=1, stages=2)),
    ("Q6_K", 9, 48, 512, dict(bk=256, bm=16, bn=16, warps_m=1, warps_n=2, stages=2,
                              x_type="f16", epilogue="residual")),
    ("Q6_K", 17, 40, 768, dict(bk=128, bm=32, bn=16, warps_m=1, warps_n=2, stages=3,
                               epilogue="residual")),
    ("Q8_0", 5, 37, 192, dict(bk=64, bm=32, bn=8, warps_m=2, warps_n=1, stages=3)),
    ("Q8_0", 17, 40, 256, dict(bk=128, bm=16, bn=16, warps_m=1, warps_n=2, stages=2,
                               x_type="f16", epilogue="residual")),
    ("Q8_0", 8, 24, 512, dict(bk=256, bm=16, bn=8, warps_m=1, warps_n=1, stages=2)),
]


@pytest.mark.parametrize("qtype,t,m,k,fields", CASES)
def test_gemm_qtype_numerics(backend, rng, qtype, t, m, k, fields):
    plan = G.GemmPlan.make(qtype, k, **fields)
    w = random_blocks(rng, qtype, m, k)
    x = rng.standard_normal((t, k)).astype(np.float32)
    xin = x.astype(np.float16) if plan.x_type == "f16" else x
    r = rng.standard_normal((t, m)).astype(np.float32) if plan.epilogue == "residual" else None
    y = backend.poisoned((t, m), np.float32)
    launch(backend, plan, w, xin, y, m, t, t, r)
    ref, wa = oracle(qtype, w, xin, r)
    check(y.to_numpy(), ref, bound(qtype, xin, wa, ref, r), plan.kernel_name)


def test_gemm_q8_0_gguf_quantizer_t_device(backend, rng):
    """Q8_0 weights from gguf's quantizer; a launch sized for 20 tokens with
    T = 13 in device memory: rows past T keep their poison."""
    t_max, t, m, k = 20, 13, 33, 128
    plan = G.GemmPlan.make("Q8_0", k, t_device=True, bk=64, bm=16, bn=8, warps_m=1,
                           warps_n=1, stages=2)
    w = gguf_quantized(rng, m, k)
    x = rng.standard_normal((t_max, k)).astype(np.float32)
    y = backend.poisoned((t_max, m), np.float32)
    launch(backend, plan, w, x, y, m, backend.array(np.array([t], np.uint32)), t_max)
    got = y.to_numpy()
    assert np.all(np.isnan(got[t:])), "rows past the device T were written"
    ref, wa = oracle("Q8_0", w, x[:t])
    check(got[:t], ref, bound("Q8_0", x[:t], wa, ref, None), "t_device")


def test_gemm_q6_k_t_device_in_place(backend, rng):
    """Q6_K with ``y`` = ``r`` and T from device memory."""
    t_max, t, m, k = 16, 11, 24, 256
    plan = G.GemmPlan.make("Q6_K", k, t_device=True, epilogue="residual", bk=128, bm=16,
                           bn=8, warps_m=1, warps_n=1, stages=2)
    w = random_blocks(rng, "Q6_K", m, k)
    x = rng.standard_normal((t_max, k)).astype(np.float32)
    r = rng.standard_normal((t_max, m)).astype(np.float32)
    mod = backend.load(G.build(plan))
    yr = backend.array(r)
    backend.launch(mod[plan.kernel_name], G.launch_geometry(plan, m, t_max),
                   dict(w=backend.array(w), x=backend.array(x), r=yr, y=yr, m=m,
                        t_ptr=backend.array(np.array([t], np.uint32))))
    got = yr.to_numpy()
    assert np.array_equal(got[t:], r[t:]), "rows past the device T were changed"
    ref, wa = oracle("Q6_K", w, x[:t], r[:t])
    check(got[:t], ref, bound("Q6_K", x[:t], wa, ref, r[:t]), "in place, t_device")


@pytest.mark.parametrize("qtype", ["Q6_K", "Q8_0"])
def test_ops_gemm_qtypes(rng, qtype):
    """``ops.gemm`` with numpy arrays on the emulator and the tuned config."""
    from ptxgen.driver import ops
    t, m, k = 3, 40, 256
    w = random_blocks(rng, qtype, m, k)
    x = rng.standard_normal((t, k)).astype(np.float32)
    got = ops.gemm(w, x, qtype.lower(), backend="emu")
    ref, wa = oracle(qtype, w, x)
    check(got, ref, bound(qtype, x, wa, ref, None), f"ops.gemm {qtype}")


@pytest.mark.parametrize("qtype,k,fields,msg", [
    ("Q6_K", 512, dict(bk=64), "not a stage depth of Q6_K"),
    ("Q6_K", 200, {}, "not a positive multiple"),
    ("Q8_0", 96, dict(bk=64), "not a multiple of bk=64"),
    ("Q8_0", 40, {}, "not a positive multiple"),
])
def test_gemm_qtype_refusals(qtype, k, fields, msg):
    with pytest.raises(ValueError, match=msg):
        G.GemmPlan.make(qtype, k, **fields)


SHAPES_8B = [(4096, 4096), (14336, 4096), (4096, 14336)]


@pytest.mark.parametrize("qtype", ["Q6_K", "Q8_0"])
@pytest.mark.parametrize("t", [16, 512])
@pytest.mark.parametrize("m,k", SHAPES_8B)
def test_gemm_qtype_8b_shapes_assemble(ptxas, qtype, m, k, t):
    """The tuned kernels of the 8B shapes assemble for sm_90 with no spills
    and no local memory, in the shared memory they ask for."""
    from ptxgen.ptxas import assemble
    plan = G.default_plan(qtype, k, x_type="f16", target="sm_90", m=m, t=t)
    _, reports = assemble(G.build(plan).to_ptx(), "sm_90")
    (rep,) = reports
    assert rep.spill_stores == 0 and rep.spill_loads == 0 and rep.local_bytes == 0, rep
    assert plan.dynamic_shared <= G.MAX_SHARED


def test_ops_gemm_y_stride(rng):
    """``y_stride``: Y (and R) as a column block of a wider array; the other
    columns are not touched."""
    from ptxgen.driver import ops
    t, m, k, ld, col = 6, 24, 256, 40, 8
    w = random_blocks(rng, "Q6_K", m, k)
    x = rng.standard_normal((t, k)).astype(np.float32)
    big = rng.standard_normal((t, ld)).astype(np.float32)
    before = big.copy()
    flat = big.reshape(-1)[col:]                   # row t of Y at t * ld
    ops.gemm(w, x, "Q6_K", out=flat, residual=flat, y_stride=ld, backend="emu", bm=16, bn=8,
             warps_m=1, warps_n=1, bk=128, stages=2)
    got = flat[np.arange(t)[:, None] * ld + np.arange(m)]
    ref, wa = oracle("Q6_K", w, x, before[:, col:col + m])
    check(got, ref, bound("Q6_K", x, wa, ref, before[:, col:col + m]), "y_stride")
    keep = np.ones(ld, bool)
    keep[col:col + m] = False
    assert np.array_equal(big[:, keep], before[:, keep]), "columns outside Y were written"
    with pytest.raises(ValueError, match="y_stride needs out="):
        ops.gemm(w, x, "Q6_K", y_stride=ld, backend="emu")
    with pytest.raises(ValueError, match="elements"):
        ops.gemm(w, x, "Q6_K", out=flat[:100], y_stride=ld, backend="emu")


# the sm_90a warpgroup kernel with Q6_K, Q8_0, Q4_0, Q5_0, Q5_K and F16 weights
# (kernels/gemm/wgmma_q6k.py, wgmma_blocks32.py, wgmma_q4k.py, wgmma_f16.py): M
# of 37 rows (a W whose size is not a multiple of 16, every row shift), T not
# a multiple of the tile, 1 and 2 warpgroups, K of 1 to 3 super-blocks (the
# ring runs past K), the residual in place, T from the device; Q8_0 also from
# gguf's quantizer
WG_CASES = [
    ("Q6_K", 5, 37, 256, dict(bm=64, bn=8, stages=3)),
    ("Q6_K", 21, 70, 512, dict(bm=128, bn=16, stages=4, epilogue="residual")),
    ("Q6_K", 9, 37, 768, dict(bm=64, bn=16, stages=5, t_device=True)),
    ("Q8_0", 5, 37, 256, dict(bm=64, bn=8, stages=3)),
    ("Q8_0", 21, 70, 512, dict(bm=128, bn=16, stages=4, epilogue="residual")),
    ("Q8_0", 9, 37, 768, dict(bm=64, bn=16, stages=5, t_device=True)),
    ("Q4_0", 5, 37, 256, dict(bm=64, bn=8, stages=3)),
    ("Q4_0", 21, 70, 512, dict(bm=128, bn=16, stages=4, epilogue="residual")),
    ("Q5_0", 5, 37, 256, dict(bm=64, bn=8, stages=3)),
    ("Q5_0", 9, 70, 768, dict(bm=128, bn=16, stages=5, t_device=True)),
    ("Q5_K", 5, 37, 256, dict(bm=64, bn=8, stages=3)),
    ("Q5_K", 21, 70, 768, dict(bm=128, bn=16, stages=4, epilogue="residual")),
    ("F16", 5, 37, 256, dict(bm=64, bn=8, stages=3)),
    ("F16", 9, 70, 512, dict(bm=128, bn=16, stages=4, t_device=True)),
    ("BF16", 5, 37, 256, dict(bm=64, bn=8, stages=3)),
    ("BF16", 21, 70, 512, dict(bm=128, bn=16, stages=4, epilogue="residual")),
]


@pytest.mark.parametrize("qtype,t,m,k,fields", WG_CASES)
def test_wgmma_qtypes(backend, rng, qtype, t, m, k, fields):
    """Same oracle and bound as the mma.sync kernel's (the same roundings;
    wgmma's f32 chain is modelled like mma's)."""
    backend.require_sm(90)
    plan = G.GemmPlan.make(qtype, k, kernel="wgmma", x_type="f16", target="sm_90a", bk=64,
                           **fields)
    w = gguf_quantized(rng, m, k) if qtype == "Q8_0" and fields.get("t_device") else \
        random_blocks(rng, qtype, m, k)
    x = rng.standard_normal((t, k)).astype(np.float16)
    r = rng.standard_normal((t, m)).astype(np.float32) if plan.epilogue == "residual" else None
    mod = backend.load(G.build(plan))
    xa = backend.array(x)
    y = backend.array(r) if r is not None else backend.poisoned((t, m), np.float32)
    args = dict(w=backend.array(w), x=xa, y=y, m=m,
                xmap=backend.tensor_map(G.x_map(plan, int(xa.ptr), t)))
    if r is not None:
        args["r"] = y
    if plan.t_device:
        args["t_ptr"] = backend.array(np.array([t], np.uint32))
    else:
        args["t"] = t
    backend.launch(mod[plan.kernel_name], G.launch_geometry(plan, m, t), args)
    ref, wa = oracle(qtype, w, x, r)
    if qtype == "Q5_K":                       # d sc q and dmin m rounded apart: no cancellation
        wa = q5k_abs_parts(w, m, k)
    check(y.to_numpy(), ref, bound(qtype, x, wa, ref, r), plan.kernel_name)


def test_q4_0_q5_0_need_the_warpgroup_kernel():
    """No mma.sync decoder for Q4_0/Q5_0/Q5_K: a plan for it is refused, and
    ``supported`` says where a GEMM exists (the prefill reads the others with
    a GEMV a row)."""
    with pytest.raises(ValueError, match="Q4_0 GEMMs run on kernel='wgmma'"):
        G.GemmPlan.make("Q4_0", 256, kernel="mma", x_type="f16", target="sm_90")
    assert G.supported("Q4_0", 4096, "sm_90a") and G.supported("Q5_0", 4096, "sm_90a")
    assert G.supported("Q5_K", 4096, "sm_90a") and not G.supported("Q5_K", 4096, "sm_80")
    assert G.supported("F16", 4096, "sm_90a") and G.supported("BF16", 4096, "sm_90a")
    assert not G.supported("BF16", 4096, "sm_90")
    assert not G.supported("Q4_0", 4096, "sm_90") and not G.supported("Q5_0", 4160, "sm_90a")
    assert G.supported("Q8_0", 4160, "sm_80") and not G.supported("Q4_1", 4096, "sm_90a")
