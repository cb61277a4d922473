"""Quantized GEMM (kernels/gemm) against float64.

The oracle is ``gemm.reference``: float64 weights from ``quants.dequantize``
(checked here bit for bit against gguf's decoder for the very weights of each
test) times float64 X.  The bound is the kernel's rounding, summed with the
absolute values: X rounded to f16 (``u = 2^-11``), the scale ``d sc`` and the
offset ``dmin m`` rounded to f16 (``u`` each) and the weight ``q (d sc) - dmin
m`` once more (``u``), so each product is off by at most ``3.01 u |x| A`` with
``A = |d sc q| + |dmin m|`` (plus ``2^-25 |x|`` where a value is subnormal in
f16); the mma chain adds ``(K/16 + 1) 2^-21`` of ``sum |x| A`` (docs/emulator.md)
and the residual add ``2^-24 |y|``.  ``A`` comes from this file's own decoder of
the Q4_K scales (:func:`_q4k_parts`), itself checked against ``quants``.
"""

import numpy as np
import pytest

from ptxgen.kernels import gemm as G
from ptxgen.kernels import quants

U = 2.0 ** -11


def _q4k_parts(raw, m, k):
    """Per weight: the level q (0..15), the scale d*sc and the offset dmin*m
    (float64), decoded from the GGUF bytes by the byte map of docs/quants.md."""
    b = raw.reshape(m, k // 256, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    s = b[..., 4:16].astype(np.int64)
    sc = np.empty(b.shape[:2] + (8,), np.int64)
    mn = np.empty_like(sc)
    for j in range(8):
        if j < 4:
            sc[..., j], mn[..., j] = s[..., j] & 63, s[..., j + 4] & 63
        else:
            sc[..., j] = (s[..., j + 4] & 15) | ((s[..., j - 4] >> 6) << 4)
            mn[..., j] = (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
    qs = b[..., 16:].astype(np.int64).reshape(m, k // 256, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(m, k // 256, 8, 32)
    scale = (d[..., None] * sc)[..., None]
    off = (dmin[..., None] * mn)[..., None]
    return (q.reshape(m, k), np.broadcast_to(scale, q.shape).reshape(m, k),
            np.broadcast_to(off, q.shape).reshape(m, k))


def _weights(rng, m, k):
    w = quants.quantize(rng.standard_normal((m, k)).astype(np.float32), "Q4_K")
    ours = quants.dequantize(w, "Q4_K", (m, k))
    gguf = pytest.importorskip("gguf")
    theirs = gguf.quants.dequantize(w, gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))
    q, s, o = _q4k_parts(w, m, k)
    # this file's decoder agrees with the oracle's weights
    assert np.allclose(q * s - o, ours, rtol=0, atol=1e-6 * np.abs(ours).max())
    return w, np.abs(q * s) + np.abs(o)


def bound(x, a_abs, ref, residual):
    """The elementwise error bound of the module docstring."""
    k = x.shape[1]
    xa = np.abs(np.asarray(x, np.float64))
    sa = xa @ a_abs.T
    b = 3.01 * U * sa + (k / 16 + 1) * 2.0 ** -21 * sa * (1 + 4 * U) \
        + 2.0 ** -25 * xa.sum(axis=1, keepdims=True) * 2
    if residual is not None:
        b = b + 2.0 ** -24 * np.abs(ref)
    return b


def _check(got, ref, bnd, what):
    assert got.shape == ref.shape
    assert np.all(np.isfinite(got)), f"{what}: non-finite outputs (poison left?)"
    err = np.abs(got.astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err - bnd), err.shape)
    assert np.all(err <= bnd), (f"{what}: error {err[worst]:.3g} above the bound "
                                f"{bnd[worst]:.3g} at (t, m) = {worst}")
    return float(err.max() / np.abs(ref).max())


def _launch(backend, plan, w, x, y, m, t_arg, t_max, r=None):
    fn = backend.load(G.build(plan))[plan.kernel_name]
    args = dict(w=backend.array(w), x=backend.array(x), y=y, m=m,
                **{"t_ptr" if plan.t_device else "t": t_arg})
    if r is not None:
        args["r"] = backend.array(r)
    backend.launch(fn, G.launch_geometry(plan, m, t_max), args)


# (T, M, K, config and spec fields): small tiles keep the emulator fast; M and
# T both cut tiles short; every bk, ring depth, x type and the residual
CASES = [
    (1, 48, 256, dict(bm=32, bn=8, warps_m=2, warps_n=1, stages=2)),
    (5, 80, 512, dict(bm=32, bn=16, warps_m=2, warps_n=1, stages=3)),
    (16, 64, 512, dict(bm=64, bn=16, warps_m=2, warps_n=2, stages=4, bk=128,
                       x_type="f16")),
    (33, 80, 256, dict(bm=16, bn=16, warps_m=1, warps_n=2, stages=3, bk=256)),
    (33, 96, 512, dict(bm=32, bn=32, warps_m=1, warps_n=2, stages=2, x_type="f16",
                       epilogue="residual")),
    (16, 37, 512, dict(bm=16, bn=8, warps_m=1, warps_n=1, stages=5, epilogue="residual")),
    # a bias (one value per weight row, every token): Qwen2's q/k/v
    (21, 40, 256, dict(bm=32, bn=16, warps_m=2, warps_n=1, stages=2, x_type="f16",
                       epilogue="bias")),
]


@pytest.mark.parametrize("t,m,k,fields", CASES)
def test_gemm_numerics(backend, rng, t, m, k, fields):
    plan = G.GemmPlan.make("Q4_K", k, **fields)
    w, a_abs = _weights(rng, m, k)
    x = rng.standard_normal((t, k)).astype(np.float32)
    xin = x.astype(np.float16) if plan.x_type == "f16" else x
    r = _addend(rng, plan.epilogue, t, m)
    y = backend.poisoned((t, m), np.float32)
    _launch(backend, plan, w, xin, y, m, t, t, r)
    ref = G.reference("Q4_K", w, xin, r)
    _check(y.to_numpy(), ref, bound(xin, a_abs, ref, r), plan.kernel_name)


def _addend(rng, epilogue, t, m):
    """The epilogue's ``r``: a residual ``[T, M]``, a bias ``[M]``, or None."""
    shape = {"residual": (t, m), "bias": (m,)}.get(epilogue)
    return None if shape is None else rng.standard_normal(shape).astype(np.float32)


def test_gemm_residual_in_place(backend, rng):
    """``y`` and ``r`` the same array: ``Y += X W^T``."""
    t, m, k = 9, 40, 256
    plan = G.GemmPlan.make("Q4_K", k, epilogue="residual", bm=32, bn=16, warps_m=2,
                           warps_n=1, stages=2)
    w, a_abs = _weights(rng, m, k)
    x = rng.standard_normal((t, k)).astype(np.float32)
    r = rng.standard_normal((t, m)).astype(np.float32)
    mod = backend.load(G.build(plan))
    yr = backend.array(r)
    backend.launch(mod[plan.kernel_name], G.launch_geometry(plan, m, t),
                   dict(w=backend.array(w), x=backend.array(x), r=yr, y=yr, m=m, t=t))
    ref = G.reference("Q4_K", w, x, r)
    _check(yr.to_numpy(), ref, bound(x, a_abs, ref, r), "in place")


def test_gemm_t_from_device(backend, rng):
    """A launch sized for 33 tokens with T = 20 in device memory: rows past
    T keep their poison, the others are right."""
    t_max, t, m, k = 33, 20, 48, 256
    plan = G.GemmPlan.make("Q4_K", k, t_device=True, bm=16, bn=16, warps_m=1, warps_n=1,
                           stages=2)
    w, a_abs = _weights(rng, m, k)
    x = rng.standard_normal((t_max, k)).astype(np.float32)
    y = backend.poisoned((t_max, m), np.float32)
    _launch(backend, plan, w, x, y, m, backend.array(np.array([t], np.uint32)), t_max)
    got = y.to_numpy()
    assert np.all(np.isnan(got[t:])), "rows past the device T were written"
    ref = G.reference("Q4_K", w, x[:t])
    _check(got[:t], ref, bound(x[:t], a_abs, ref, None), "t_device")


def test_ops_gemm_numpy(rng):
    """``ops.gemm`` with numpy arrays on the emulator, the tuned config, with
    ``out=`` and a residual."""
    from ptxgen.driver import ops
    t, m, k = 5, 72, 256
    w, a_abs = _weights(rng, m, k)
    x = rng.standard_normal((t, k)).astype(np.float32)
    r = rng.standard_normal((t, m)).astype(np.float32)
    out = np.full((t, m), np.nan, np.float32)
    got = ops.gemm(w, x, "q4_k", out=out, residual=r, backend="emu")
    assert got is out
    ref = G.reference("Q4_K", w, x, r)
    _check(out, ref, bound(x, a_abs, ref, r), "ops.gemm")
    y16 = ops.gemm(w, x.astype(np.float16), "Q4_K", backend="emu", bm=16, bn=8, warps_m=1,
                   warps_n=1, stages=2)
    ref16 = G.reference("Q4_K", w, x.astype(np.float16))
    _check(y16, ref16, bound(x.astype(np.float16), a_abs, ref16, None), "ops.gemm f16")


def test_ops_gemm_refuses_bad_input(rng):
    from ptxgen.driver import ops
    w = quants.quantize(rng.standard_normal((16, 256)).astype(np.float32), "Q4_K")
    x = rng.standard_normal((3, 256)).astype(np.float32)
    with pytest.raises(ValueError, match="no gemm kernel reads Q4_1 weights; the gemm kernels read Q4_K, "):
        ops.gemm(w, x, "Q4_1", backend="emu")
    with pytest.raises(ValueError, match=r"x must be \[T, K=256\]"):
        ops.gemm(w, x[:, :128], "Q4_K", backend="emu")
    with pytest.raises(TypeError, match="float32 or float16"):
        ops.gemm(w, x.astype(np.float64), "Q4_K", backend="emu")
    with pytest.raises(ValueError, match="not a whole number of 144-byte blocks"):
        ops.gemm(w[:, :100], x, "Q4_K", backend="emu")


@pytest.mark.parametrize("fields,msg", [
    (dict(k=300), "not a positive multiple"),
    (dict(bm=32, warps_m=4), "multiple of 16 x warps_m"),
    (dict(bn=16, warps_n=4), "multiple of 8 x warps_n"),
    (dict(bk=96), "bk must be one of"),
    (dict(bm=256, bn=256, bk=256, stages=4), "shared memory"),
    (dict(qtype="Q4_1"), "qtype must be one of"),
    (dict(x_type="bf16"), "x_type must be one of"),
])
def test_gemm_plan_refusals(fields, msg):
    qtype = fields.pop("qtype", "Q4_K")
    k = fields.pop("k", 512)
    with pytest.raises(ValueError, match=msg):
        G.GemmPlan.make(qtype, k, **fields)


SHAPES_8B = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336)]


@pytest.mark.parametrize("x_type", ["f16", "f32"])
@pytest.mark.parametrize("m,k", SHAPES_8B)
def test_gemm_8b_shapes_assemble(ptxas, m, k, x_type):
    """The tuned kernels of the 8B shapes at T = 512 assemble for sm_90 with
    no spills and no local memory, in the shared memory they ask for."""
    from ptxgen.ptxas import assemble
    plan = G.default_plan("Q4_K", k, x_type=x_type, target="sm_90", m=m, t=512)
    _, reports = assemble(G.build(plan).to_ptx(), "sm_90")
    (rep,) = reports
    assert rep.spill_stores == 0 and rep.spill_loads == 0 and rep.local_bytes == 0, rep
    assert plan.dynamic_shared <= G.MAX_SHARED
