"""wgmma.mma_async (sm_90a) through shared-memory matrix descriptors with
every swizzle, K- and MN-major operands, A from registers, int8 — against
numpy.  Shared images are built by tests/emu/tc_oracle.py from the PTX
ISA's canonical layouts; D is read back through the ISA's D fragment
figure.  Float results within 2**-21 * (|A|.|B| + |C|) (docs/emulator.md),
integer results bit-exact."""

import os
import zlib

import numpy as np
import pytest

import ptxgen
from backends import line_of
from ptxgen import types as T
from ptxgen.emu.errors import WarpSyncError
from ptxgen.errors import PtxBuildError, TargetError
from ptxgen.types import f32, s32, u32
from tc_oracle import SPAN, a_fragment, d_fragment, place

HERE = os.path.abspath(__file__)
SHARED = 32768


def _seed(request):
    return zlib.crc32(request.node.nodeid.encode())


def _values(rng, ab, shape):
    if ab == "s8":
        return rng.integers(-128, 128, shape).astype(np.int8)
    if ab == "u8":
        return rng.integers(0, 256, shape).astype(np.uint8)
    x = rng.standard_normal(shape)
    if ab == "f16":
        return x.astype(np.float16)
    return ((x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))   # bf16 bits


def _as_f64(mat, ab):
    if ab == "bf16":
        return (mat.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return mat.astype(np.float64) if ab in ("f16",) else mat.astype(np.int64)


class Operand:
    """One wgmma operand in shared memory: where, how laid out, its full tile."""

    def __init__(self, start, mode, kmajor, lbo, sbo, tile, kslice=0):
        self.start, self.mode, self.kmajor = start, mode, kmajor
        self.lbo, self.sbo, self.tile, self.kslice = lbo, sbo, tile, kslice


def _kernel(n, ab, a, b, *, a_regs=False, scale_d=False, neg=(False, False), satfinite=False):
    """128 threads: copy the image to shared memory, one wgmma, store D."""
    integer = ab in ("s8", "u8")
    acc_t = s32 if integer else f32
    kbytes = 32
    m = ptxgen.Module("sm_90a")
    with m.kernel("wg", reqntid=128) as k:
        img, outp = k.param_ptr("img", u32), k.param_ptr("out", acc_t)
        cin, areg = k.param_ptr("c", acc_t), k.param_ptr("areg", u32)
        sh = k.shared_array("sh", T.u32, SHARED // 4, align=1024)
        t = k.tid.x
        with k.for_range(0, SHARED // 4 // 128) as j:
            w = j * 128 + t
            k.st(sh[w], k.ld(img[w]))
        k.fence_proxy_async()
        k.bar_sync()
        base = k.mov(sh, T.u32)

        def desc(op):
            start = op.start + op.kslice * kbytes
            return k.wgmma_desc(base + start, lbo=op.lbo, sbo=op.sbo, swizzle=op.mode)
        acc = tuple(k.var(acc_t, k.ld(cin[t * (n // 2) + i])) for i in range(n // 2))
        a_op = (tuple(k.bitcast(T.b32, k.ld(areg[t * 4 + i])) for i in range(4)) if a_regs
                else desc(a))
        k.wgmma_fence()
        k.wgmma(acc, a_op, desc(b), ab_type=ab, scale_d=scale_d, neg_a=neg[0], neg_b=neg[1],
                trans_a=not a.kmajor if not a_regs else False, trans_b=not b.kmajor,
                satfinite=satfinite)
        k.wgmma_commit()
        k.wgmma_wait(0)
        for i in range(n // 2):
            k.st(outp[t * (n // 2) + i], acc[i])
    return m


def _run(backend, seed, n, ab, a, b, **kw):
    """Build the image, run, return (D from the GPU/emulator, exact D, |A||B|+|C|)."""
    backend.require_sm(90)
    rng = np.random.default_rng(seed)
    integer = ab in ("s8", "u8")
    kk = 32 if integer else 16
    image = np.zeros(SHARED, np.uint8)
    mats = []
    for op in (a, b):
        if op is a and kw.get("a_regs"):
            mats.append(op.tile)
            continue
        place(image, op.start, op.tile, op.mode, op.kmajor, op.lbo, op.sbo)
        mats.append(op.tile)
    A = _as_f64(mats[0], ab)[:, a.kslice * kk:(a.kslice + 1) * kk]
    B = _as_f64(mats[1], ab)[:, b.kslice * kk:(b.kslice + 1) * kk]    # N x K
    cdt = np.int32 if integer else np.float32
    C = kw.pop("c", None)
    if C is None:
        C = (rng.integers(-(1 << 20), 1 << 20, (64, n)) if integer
             else rng.standard_normal((64, n))).astype(cdt)
    cin = np.zeros((128, n // 2), cdt)
    for tid in range(128):
        for i in range(n // 2):
            cin[tid, i] = C[d_fragment(tid, i)]
    areg = np.zeros((128, 4), np.uint32)
    if kw.get("a_regs"):
        bits = mats[0].view(np.uint16)
        for tid in range(128):
            el = [int(bits[a_fragment(tid, e)]) for e in range(8)]
            areg[tid] = [el[2 * j] | el[2 * j + 1] << 16 for j in range(4)]
    mod = backend.load(_kernel(n, ab, a, b, **kw))
    out = backend.poisoned((128, n // 2), cdt)
    backend.launch_positional(mod["wg"], 1, 128, backend.array(image.view(np.uint32)), out,
                              backend.array(cin), backend.array(areg))
    got = out.to_numpy()
    D = np.zeros((64, n), np.float64 if not integer else np.int64)
    for tid in range(128):
        for i in range(n // 2):
            D[d_fragment(tid, i)] = got[tid, i]
    sa, sb = (-1 if x else 1 for x in kw.get("neg", (False, False)))
    Cs = C.astype(D.dtype) if kw.get("scale_d") else 0
    exact = sa * sb * (A @ B.T) + Cs
    scale = np.abs(A) @ np.abs(B.T) + np.abs(Cs)
    return D, exact, scale


def _check(D, exact, scale, seed, integer=False):
    if integer:
        np.testing.assert_array_equal(D, exact, err_msg=f"seed={seed}")
        return
    err = np.abs(D - exact)
    assert np.all(err <= 2.0 ** -21 * scale), f"seed={seed}: max error {err.max():.3g}"


def _kmajor(rng, ab, rows, mode, start, kslice=0, gap=0):
    """A K-major operand: rows x (the mode's row, or 32 bytes) tile."""
    eb = 1 if ab in ("s8", "u8") else 2
    width = max(SPAN[mode], 32) // eb if mode != "none" else 32 // eb * (kslice + 1)
    tile = _values(rng, ab, (rows, width))
    if mode == "none":
        lbo, sbo = 128 + gap, 2 * (128 + gap) * (kslice + 1)
    else:
        lbo, sbo = 16, 8 * SPAN[mode] + gap
    return Operand(start, mode, True, lbo, sbo, tile, kslice)


@pytest.mark.parametrize("mode", ["none", "32B", "64B", "128B"])
def test_wgmma_f16_kmajor_each_swizzle(backend, request, mode):
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    ks = {"none": 0, "32B": 0, "64B": 1, "128B": 3}[mode]    # the last K slice of the row
    gap = 32 if mode == "none" else 8 * SPAN[mode]           # gaps between core matrices /
    #                                                           row groups 2 patterns apart
    a = _kmajor(rng, "f16", 64, mode, 0, ks, gap)
    b = _kmajor(rng, "f16", 64, mode, 16384, ks, gap)
    _check(*_run(backend, seed, 64, "f16", a, b), seed)


@pytest.mark.parametrize("n,ab,mode", [(8, "f16", "128B"), (256, "f16", "none"),
                                       (136, "bf16", "64B"), (64, "bf16", "128B")])
def test_wgmma_shapes_and_bf16(backend, request, n, ab, mode):
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    a = _kmajor(rng, ab, 64, mode, 0)
    b = _kmajor(rng, ab, n, mode, 8192)
    _check(*_run(backend, seed, n, ab, a, b, scale_d=True), seed)


@pytest.mark.parametrize("mode", ["none", "32B", "64B", "128B"])
def test_wgmma_mn_major_each_swizzle(backend, request, mode):
    """trans_a/trans_b: A stored M-major, B N-major (f16)."""
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    span = SPAN[mode]
    blk = 8 if mode == "none" else span // 2           # MN elements of one atom row
    # LBO / SBO per the ISA table for MN-major (interleave vs swizzled roles)
    if mode == "none":
        lbo_a, sbo_a = 64 * 16, 128
        lbo_b, sbo_b = 128 * 16, 128
    else:
        lbo_a, sbo_a = 8 * span, 8 * span * (64 // blk)
        lbo_b, sbo_b = 8 * span, 8 * span * (128 // blk)
    a = Operand(0, mode, False, lbo_a, sbo_a, _values(rng, "f16", (64, 16)))
    b = Operand(8192, mode, False, lbo_b, sbo_b, _values(rng, "f16", (128, 16)))
    _check(*_run(backend, seed, 128, "f16", a, b, neg=(True, False)), seed)


@pytest.mark.parametrize("ab,n,mode", [("s8", 32, "128B"), ("u8", 48, "none"),
                                       ("s8", 256, "64B")])
def test_wgmma_int8_is_exact(backend, request, ab, n, mode):
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    a = _kmajor(rng, ab, 64, mode, 0)
    b = _kmajor(rng, ab, n, mode, 8192)
    _check(*_run(backend, seed, n, ab, a, b, scale_d=True), seed, integer=True)


def test_wgmma_int8_satfinite(backend, request):
    """Sums past the s32 range clamp with .satfinite."""
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    a = _kmajor(rng, "s8", 64, "128B", 0)
    b = _kmajor(rng, "s8", 16, "128B", 8192)
    a.tile[:] = 127
    b.tile[:8] = 127                 # columns 0-7: + 32 * 127 * 127
    b.tile[8:] = -128                # columns 8-15: - 32 * 127 * 128
    c = np.empty((64, 16), np.int32)
    c[:, :8] = (1 << 31) - 1 - rng.integers(0, 1000, (64, 8))
    c[:, 8:] = -(1 << 31) + rng.integers(0, 1000, (64, 8))
    D, exact, _ = _run(backend, seed, 16, "s8", a, b, scale_d=True, satfinite=True, c=c)
    assert (exact[:, :8] > (1 << 31) - 1).all() and (exact[:, 8:] < -(1 << 31)).all()
    np.testing.assert_array_equal(D, np.clip(exact, -(1 << 31), (1 << 31) - 1),
                                  err_msg=f"seed={seed}")


def test_wgmma_a_from_registers(backend, request):
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    a = Operand(0, "none", True, 0, 0, _values(rng, "f16", (64, 16)))
    b = _kmajor(rng, "f16", 64, "128B", 8192)
    _check(*_run(backend, seed, 64, "f16", a, b, a_regs=True, scale_d=True), seed)


# ---------------------------------------------------------------- errors
def test_wgmma_is_refused_on_plain_sm90_at_the_users_line():
    m = ptxgen.Module("sm_90")
    with m.kernel("k") as k:
        with pytest.raises(TargetError, match=rf"{HERE}:{line_of(HERE, '# fence-90')}:.*sm_90a"):
            k.wgmma_fence()  # fence-90


def test_wgmma_refuses_n_the_int8_shape_lacks():
    m = ptxgen.Module("sm_90a")
    with m.kernel("k") as k:
        sh = k.shared_array("sh", T.b8, 8192, align=1024)
        d = k.wgmma_desc(sh, lbo=16, sbo=1024, swizzle="128B")
        with pytest.raises(PtxBuildError, match="N = 40"):
            k.wgmma(k.wgmma_acc(40, "s8"), d, d, ab_type="s8")


def test_reading_an_accumulator_before_the_wait_is_an_error(emu_backend):
    m = ptxgen.Module("sm_90a")
    with m.kernel("early", reqntid=128) as k:
        out = k.param_ptr("out", f32)
        sh = k.shared_array("sh", T.b8, 8192, align=1024)
        d = k.wgmma_desc(sh, lbo=16, sbo=1024, swizzle="128B")
        acc = k.wgmma_acc(8)
        k.wgmma_fence()
        k.wgmma(acc, d, d, scale_d=False)
        k.wgmma_commit()
        k.st(out[k.tid.x], acc[0])
        k.wgmma_wait(0)
    mod = emu_backend.load(m)
    with pytest.raises(WarpSyncError, match="still in flight"):
        emu_backend.launch_positional(mod["early"], 1, 128, emu_backend.poisoned(128, np.float32))


def test_wgmma_needs_whole_warpgroups(emu_backend):
    m = ptxgen.Module("sm_90a")
    with m.kernel("half") as k:
        sh = k.shared_array("sh", T.b8, 8192, align=1024)
        d = k.wgmma_desc(sh, lbo=16, sbo=1024, swizzle="128B")
        acc = k.wgmma_acc(8)
        k.wgmma_fence()
        k.wgmma(acc, d, d, scale_d=False)
    mod = emu_backend.load(m)
    with pytest.raises(WarpSyncError, match="whole warpgroups"):
        emu_backend.launch_positional(mod["half"], 1, 64)


# ------------------------------------------------ every shape of the table
#: the N of m64nNk16 (f16/bf16) and of m64nNk32 (s8/u8) in the PTX ISA's
#: shape table, written out here (not ptxgen's own wgmma_n_ok)
N_FLOAT = tuple(range(8, 257, 8))
N_INT8 = (8, 16, 24, 32) + tuple(range(48, 257, 16))


def _d_index(n):
    """(rows, cols) of every thread's accumulators (the ISA's D figure),
    as arrays [128, n / 2]; tc_oracle.d_fragment spot-checked against it."""
    tid, i = np.arange(128)[:, None], np.arange(n // 2)[None, :]
    rows = 16 * (tid // 32) + (tid % 32) // 4 + 8 * ((i // 2) % 2)
    cols = 8 * (i // 4) + 2 * (tid % 4) + i % 2
    for t, j in ((0, 0), (37, n // 2 - 1), (127, n // 4)):
        assert (rows[t, j], cols[t, j]) == d_fragment(t, j)
    return rows, cols


def _all_shapes_kernel(ab, a, b, ns, satfinite_n):
    """One warpgroup: D = A.B[:N] for each N of ``ns`` (and once more at
    ``satfinite_n`` with .satfinite), each stored after its wait."""
    integer = ab in ("s8", "u8")
    acc_t = s32 if integer else f32
    m = ptxgen.Module("sm_90a")
    with m.kernel("wgs", reqntid=128) as k:
        img, outp = k.param_ptr("img", u32), k.param_ptr("out", acc_t)
        sh = k.shared_array("sh", T.u32, SHARED // 4, align=1024)
        t = k.tid.x
        with k.for_range(0, SHARED // 4 // 128) as j:
            k.st(sh[j * 128 + t], k.ld(img[j * 128 + t]))
        k.fence_proxy_async()
        k.bar_sync()
        base = k.mov(sh, T.u32)
        da = k.wgmma_desc(base + a.start, lbo=a.lbo, sbo=a.sbo)
        db = k.wgmma_desc(base + b.start, lbo=b.lbo, sbo=b.sbo)
        off = 0
        for n, sat in [(n, False) for n in ns] + ([(satfinite_n, True)] if satfinite_n else []):
            acc = k.wgmma_acc(n, ab)
            k.wgmma_fence()
            k.wgmma(acc, da, db, ab_type=ab, scale_d=False, satfinite=sat)
            k.wgmma_commit()
            k.wgmma_wait(0)
            row = k.ptr_add(outp, t * (n // 2) + off)
            for i in range(0, n // 2, 4):                 # v4 stores at fixed offsets
                k.st(row[i], tuple(acc[i:i + 4]))
            off += 64 * n
    return m


@pytest.mark.parametrize("ab", ["f16", "bf16", "s8", "u8"])
def test_wgmma_every_shape(backend, rng, ab):
    """Every m64nNk* the ISA defines for ``ab`` (the table's shape forms,
    and .satfinite for 8-bit) in one kernel: D = A.B against numpy."""
    backend.require_sm(90)
    integer = ab in ("s8", "u8")
    ns = N_INT8 if integer else N_FLOAT
    sat_n = 24 if integer else None
    a = _kmajor(rng, ab, 64, "none", 0)
    b = _kmajor(rng, ab, 256, "none", 8192)
    image = np.zeros(SHARED, np.uint8)
    for op in (a, b):
        place(image, op.start, op.tile, op.mode, op.kmajor, op.lbo, op.sbo)
    A, B = _as_f64(a.tile, ab), _as_f64(b.tile, ab)
    runs = list(ns) + ([sat_n] if sat_n else [])
    total = 64 * sum(runs)
    cdt = np.int32 if integer else np.float32
    out = backend.poisoned(total, cdt)
    mod = backend.load(_all_shapes_kernel(ab, a, b, ns, sat_n))
    backend.launch_positional(mod["wgs"], 1, 128, backend.array(image.view(np.uint32)), out)
    got = out.to_numpy()
    off = 0
    for n in runs:
        rows, cols = _d_index(n)
        D = np.zeros((64, n))
        D[rows, cols] = got[off:off + 64 * n].reshape(128, n // 2)
        off += 64 * n
        exact = A @ B[:n].T
        if integer:
            np.testing.assert_array_equal(D, exact, err_msg=f"{ab} N={n}")
        else:
            err = np.abs(D - exact)
            assert np.all(err <= 2.0 ** -21 * (np.abs(A) @ np.abs(B[:n]).T)), (ab, n, err.max())


def test_ptxas_takes_every_shape(ptxas, rng):
    """The all-shapes kernels assemble for sm_90a (f16 and s8: every N)."""
    from ptxgen.ptxas import assemble
    for ab in ("f16", "s8"):
        a, b = _kmajor(rng, ab, 64, "none", 0), _kmajor(rng, ab, 256, "none", 8192)
        ns = N_INT8 if ab == "s8" else N_FLOAT
        assemble(_all_shapes_kernel(ab, a, b, ns, 24 if ab == "s8" else None).to_ptx(), "sm_90a")
