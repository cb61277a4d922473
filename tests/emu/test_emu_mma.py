"""mma.sync (every shape ptxgen builds), ldmatrix and stmatrix against numpy.

The fragment layouts below are written from the PTX ISA's figures
("Matrix Fragments for mma.m16n8k16 / m16n8k8 / m16n8k32", "ldmatrix"),
element by element, independently of the emulator's tables.  Float results
must be within 2**-21 * (|A|.|B| + |C|) of the float64 product (the bound
docs/emulator.md states for one instruction, GPU or emulator); integer
results bit-exact.
"""

import os
import zlib

import numpy as np
import pytest

import ptxgen
from backends import line_of
from ptxgen import types as T
from ptxgen.errors import TargetError
from ptxgen.types import f32, s32, u32
from ptxgen.values import Address

HERE = os.path.abspath(__file__)


def _seed(request):
    return zlib.crc32(request.node.nodeid.encode())


# ----------------------------------------------------------- oracle layouts
def frag_a(shape, lane, i):
    g, t = lane // 4, lane % 4
    if shape == "m16n8k16":
        return (g if i in (0, 1, 4, 5) else g + 8), t * 2 + (i & 1) + (8 if i >= 4 else 0)
    if shape == "m16n8k8":
        return (g if i < 2 else g + 8), t * 2 + (i & 1)
    return (g if i < 4 or 8 <= i < 12 else g + 8), t * 4 + (i & 3) + (16 if i >= 8 else 0)


def frag_b(shape, lane, i):
    g, t = lane // 4, lane % 4
    if shape == "m16n8k16":
        return t * 2 + (i & 1) + (8 if i >= 2 else 0), g
    if shape == "m16n8k8":
        return t * 2 + i, g
    return t * 4 + (i & 3) + (16 if i >= 4 else 0), g


def frag_c(lane, i):
    g, t = lane // 4, lane % 4
    return g + (8 if i >= 2 else 0), t * 2 + (i & 1)


SHAPES = {"m16n8k16": (16, 8, 4), "m16n8k8": (8, 4, 2), "m16n8k32": (32, 16, 8)}


def _pack(values, per_reg):
    """Rows of element bit patterns (uint) -> b32 registers, low element first."""
    bits = 32 // per_reg
    v = values.astype(np.uint64)
    out = np.zeros(values.shape[:-1] + (values.shape[-1] // per_reg,), np.uint64)
    for j in range(per_reg):
        out |= v[..., j::per_reg] << np.uint64(bits * j)
    return out.astype(np.uint32)


def _operands(rng, ab, kk, tiles):
    """Random A (16 x K), B (K x 8) as float64/int64 values and their bit patterns."""
    if ab in ("s8", "u8"):
        lo, hi = (-128, 128) if ab == "s8" else (0, 256)
        A = rng.integers(lo, hi, (tiles, 16, kk))
        B = rng.integers(lo, hi, (tiles, kk, 8))
        return A, B, A.astype(np.uint64) & 0xFF, B.astype(np.uint64) & 0xFF
    A = rng.standard_normal((tiles, 16, kk))
    B = rng.standard_normal((tiles, kk, 8))
    if ab == "f16":
        A, B = A.astype(np.float16), B.astype(np.float16)
        return A.astype(np.float64), B.astype(np.float64), A.view(np.uint16), B.view(np.uint16)
    bits = [(x.astype(np.float32).view(np.uint32) >> 16) for x in (A, B)]
    vals = [(b << 16).astype(np.uint32).view(np.float32).astype(np.float64) for b in bits]
    return vals[0], vals[1], bits[0], bits[1]


def _mma_kernel(shape, ab, na, nb, satfinite=False):
    acc = s32 if ab in ("s8", "u8") or isinstance(ab, tuple) else f32
    m = ptxgen.Module("sm_80")
    with m.kernel("mma") as k:
        pa, pb = k.param_ptr("fa", u32), k.param_ptr("fb", u32)
        pc, po = k.param_ptr("fc", acc), k.param_ptr("out", acc)
        i = k.global_id()
        a = tuple(k.bitcast(T.b32, k.ld(pa[i * na + j])) for j in range(na))
        b = tuple(k.bitcast(T.b32, k.ld(pb[i * nb + j])) for j in range(nb))
        c = tuple(k.ld(pc[i * 4 + j]) for j in range(4))
        d = k.mma(a, b, c, shape=shape, ab_type=ab, satfinite=satfinite)
        for j in range(4):
            k.st(po[i * 4 + j], d[j])
    return m


def _run_mma(backend, shape, ab, A, B, C, abits, bbits, satfinite=False):
    tiles = A.shape[0]
    kk, ea, eb = SHAPES[shape]
    per = 4 if ab in ("s8", "u8") or isinstance(ab, tuple) else 2
    fa = np.zeros((tiles, 32, ea), np.uint64)
    fb = np.zeros((tiles, 32, eb), np.uint64)
    fc = np.zeros((tiles, 32, 4), C.dtype)
    for tt in range(tiles):
        for lane in range(32):
            for e in range(ea):
                fa[tt, lane, e] = abits[tt][frag_a(shape, lane, e)]
            for e in range(eb):
                fb[tt, lane, e] = bbits[tt][frag_b(shape, lane, e)]
            for e in range(4):
                fc[tt, lane, e] = C[tt][frag_c(lane, e)]
    ra, rb = _pack(fa, per), _pack(fb, per)
    mod = backend.load(_mma_kernel(shape, ab, ra.shape[-1], rb.shape[-1], satfinite))
    out = backend.poisoned(tiles * 32 * 4, C.dtype)
    backend.launch_positional(mod["mma"], tiles, 32, backend.array(ra), backend.array(rb),
                              backend.array(fc), out)
    got = out.to_numpy().reshape(tiles, 32, 4)
    D = np.zeros((tiles, 16, 8), np.float64 if C.dtype == np.float32 else np.int64)
    for tt in range(tiles):
        for lane in range(32):
            for e in range(4):
                D[tt][frag_c(lane, e)] = got[tt, lane, e]
    return D


@pytest.mark.parametrize("shape,ab", [("m16n8k16", "f16"), ("m16n8k16", "bf16"),
                                      ("m16n8k8", "f16"), ("m16n8k8", "bf16")])
def test_mma_float_shapes(backend, request, shape, ab):
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    kk = SHAPES[shape][0]
    A, B, abits, bbits = _operands(rng, ab, kk, 3)
    C = rng.standard_normal((3, 16, 8)).astype(np.float32)
    D = _run_mma(backend, shape, ab, A, B, C, abits, bbits)
    want = A @ B + C
    bound = 2.0 ** -21 * (np.abs(A) @ np.abs(B) + np.abs(C))
    err = np.abs(D - want)
    assert np.all(err <= bound), f"seed={seed}: max error {err.max():.3g}, bound {bound.min():.3g}"


@pytest.mark.parametrize("ab", ["s8", "u8"])
def test_mma_int8_is_exact(backend, request, ab):
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    A, B, abits, bbits = _operands(rng, ab, 32, 3)
    C = rng.integers(-(1 << 20), 1 << 20, (3, 16, 8)).astype(np.int32)
    D = _run_mma(backend, "m16n8k32", ab, A, B, C, abits, bbits)
    np.testing.assert_array_equal(D, A @ B + C, err_msg=f"seed={seed}")


@pytest.mark.parametrize("satfinite", [False, True])
def test_mma_int8_overflow_wraps_or_saturates(backend, request, satfinite):
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    A, B, abits, bbits = _operands(rng, "s8", 32, 2)
    A[0], B[0] = 127, 127                         # tile 0: 32 * 127 * 127 over the top
    A[1], B[1] = -128, 127                        # tile 1: under the bottom
    abits, bbits = A.astype(np.uint64) & 0xFF, B.astype(np.uint64) & 0xFF
    C = np.empty((2, 16, 8), np.int32)
    C[0] = (1 << 31) - 1 - rng.integers(0, 1000, (16, 8))
    C[1] = -(1 << 31) + rng.integers(0, 1000, (16, 8))
    D = _run_mma(backend, "m16n8k32", "s8", A, B, C, abits, bbits, satfinite)
    exact = A @ B + C
    want = (np.clip(exact, -(1 << 31), (1 << 31) - 1) if satfinite
            else (exact + (1 << 31)) % (1 << 32) - (1 << 31))
    np.testing.assert_array_equal(D, want, err_msg=f"seed={seed}")


@pytest.mark.parametrize("ta,tb", [("s8", "u8"), ("u8", "s8"), ("s8", "s8"), ("u8", "u8")])
def test_mma_int8_signs_with_satfinite(backend, request, ta, tb):
    """Every sign pair of m16n8k32 (mixed ones without and with
    .satfinite, each pair with it): exact, clamped where D leaves s32."""
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    A, _, abits, _ = _operands(rng, ta, 32, 2)
    _, B, _, bbits = _operands(rng, tb, 32, 2)
    big = (1 << 31) - 1
    C = np.empty((2, 16, 8), np.int32)
    C[0] = rng.integers(-(1 << 20), 1 << 20, (16, 8))
    C[1, :8] = big - rng.integers(0, 1000, (8, 8))      # rows that may cross the top
    C[1, 8:] = -big - 1 + rng.integers(0, 1000, (8, 8))   # and the bottom
    exact = A @ B + C
    for sat in ((False, True) if ta != tb else (True,)):
        D = _run_mma(backend, "m16n8k32", (ta, tb), A, B, C, abits, bbits, sat)
        want = (np.clip(exact, -big - 1, big) if sat
                else (exact + (1 << 31)) % (1 << 32) - (1 << 31))
        np.testing.assert_array_equal(D, want, err_msg=f"seed={seed} satfinite={sat}")


def test_mma_shape_and_type_errors_name_the_line():
    m = ptxgen.Module("sm_80")
    with m.kernel("k") as k:
        w = k.bitcast(T.b32, k.param("w", u32))
        x = k.param("x", f32)
        with pytest.raises(ptxgen.errors.PtxTypeError, match="multiplies s8 or u8, got f16"):
            k.mma((w,) * 4, (w, w), (x,) * 4, shape="m16n8k32")
        with pytest.raises(ptxgen.errors.PtxTypeError, match="c registers must be s32"):
            k.mma((w,) * 4, (w, w), (x,) * 4, shape="m16n8k32", ab_type="s8")
        with pytest.raises(ptxgen.errors.PtxTypeError, match="a takes 2 registers"):
            k.mma((w,) * 4, (w,), (x,) * 4, shape="m16n8k8")
        with pytest.raises(ptxgen.errors.PtxBuildError, match="satfinite"):
            k.mma((w,) * 4, (w, w), (x,) * 4, satfinite=True)


# ------------------------------------------------------- ldmatrix, stmatrix
def _slots(rng, num):
    """A row slot (16-byte unit of a 64-slot shared array) for each lane."""
    return rng.permutation(64)[:32].astype(np.uint32)


def _matrix_regs(mats, lane, trans):
    """What lane ``lane`` holds for 8x8 matrices ``mats`` (num, 8, 8) of uint16."""
    r, c = lane // 4, 2 * (lane % 4)
    out = []
    for mtx in mats:
        lo, hi = (mtx[c, r], mtx[c + 1, r]) if trans else (mtx[r, c], mtx[r, c + 1])
        out.append(int(lo) | int(hi) << 16)
    return out


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix(backend, request, num, trans):
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    smem = rng.integers(0, 1 << 16, (64, 8), dtype=np.uint16)   # 64 rows of 16 bytes
    slots = _slots(rng, num)
    m = ptxgen.Module("sm_80")
    with m.kernel("ld", reqntid=32) as k:
        src, sl, out = (k.param_ptr(n, u32) for n in ("src", "slots", "out"))
        sh = k.shared_array("sh", T.u32, 256, align=16)
        t = k.tid.x
        with k.for_range(0, 8) as j:
            k.st(sh[t * 8 + j], k.ld(src[t * 8 + j]))
        k.bar_sync()
        row = k.mov(sh, T.u32) + k.ld(sl[t]) * 16
        regs = k.ldmatrix(Address(row, 0, "shared", T.b16), num, trans=trans)
        for i, r in enumerate(regs):
            k.st(out[t * num + i], k.bitcast(T.u32, r))
    mod = backend.load(m)
    out = backend.poisoned(32 * num, np.uint32)
    backend.launch_positional(mod["ld"], 1, 32, backend.array(smem.view(np.uint32).reshape(-1)),
                              backend.array(slots), out)
    mats = np.stack([smem[slots[8 * i:8 * i + 8]] for i in range(num)])
    want = np.array([_matrix_regs(mats, lane, trans) for lane in range(32)], np.uint32)
    np.testing.assert_array_equal(out.to_numpy().reshape(32, num), want, err_msg=f"seed={seed}")


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_stmatrix(backend, request, num, trans):
    backend.require_sm(90)
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    regs = rng.integers(0, 1 << 32, (32, num), dtype=np.uint32)
    slots = _slots(rng, num)
    m = ptxgen.Module("sm_90")
    with m.kernel("stm", reqntid=32) as k:
        rp, sl, out = (k.param_ptr(n, u32) for n in ("regs", "slots", "out"))
        sh = k.shared_array("sh", T.u32, 256, align=16)
        t = k.tid.x
        with k.for_range(0, 8) as j:
            k.st(sh[t * 8 + j], 0xDEADBEEF)
        k.bar_sync()
        vals = tuple(k.bitcast(T.b32, k.ld(rp[t * num + i])) for i in range(num))
        row = k.mov(sh, T.u32) + k.ld(sl[t]) * 16
        k.stmatrix(Address(row, 0, "shared", T.b16), vals, trans=trans)
        k.bar_sync()
        with k.for_range(0, 8) as j:
            k.st(out[t * 8 + j], k.ld(sh[t * 8 + j]))
    mod = backend.load(m)
    out = backend.poisoned(256, np.uint32)
    backend.launch_positional(mod["stm"], 1, 32, backend.array(regs), backend.array(slots), out)
    got = out.to_numpy().view(np.uint16).reshape(64, 8)
    mats = np.zeros((num, 8, 8), np.uint16)
    for lane in range(32):
        r, c = lane // 4, 2 * (lane % 4)
        for i in range(num):
            lo, hi = regs[lane, i] & 0xFFFF, regs[lane, i] >> 16
            if trans:
                mats[i, c, r], mats[i, c + 1, r] = lo, hi
            else:
                mats[i, r, c], mats[i, r, c + 1] = lo, hi
    for i in range(num):
        np.testing.assert_array_equal(got[slots[8 * i:8 * i + 8]], mats[i],
                                      err_msg=f"seed={seed} matrix {i}")


# ------------------------------------------------------------- targets
def test_stmatrix_is_refused_before_sm90_at_the_users_line():
    m = ptxgen.Module("sm_80")
    with m.kernel("k") as k:
        sh = k.shared_array("sh", T.b16, 64, align=16)
        r = k.bitcast(T.b32, k.param("x", u32))
        with pytest.raises(TargetError, match=rf"{HERE}:{line_of(HERE, '# stm-80')}:.*sm_90"):
            k.stmatrix(sh[0], (r,))  # stm-80


def test_ldmatrix_and_mma_need_sm75_and_sm80_in_the_table():
    from ptxgen.isa import TABLE
    assert (TABLE["ldmatrix"].min_sm, TABLE["ldmatrix"].min_ptx) == (75, (6, 5))
    assert (TABLE["mma"].min_sm, TABLE["mma"].min_ptx) == (80, (7, 0))
    assert (TABLE["stmatrix"].min_sm, TABLE["stmatrix"].min_ptx) == (90, (7, 8))
