"""Warp shuffles and votes, mma.sync fragments, atomics and memory widths."""

import numpy as np
import pytest

import ptxgen
from backends import np_dtype, run_map
from ptxgen import types as T
from ptxgen.types import f32, u32


def ref_shfl(vals, mode, b, c):
    """The PTX ISA pseudocode of shfl.sync, one warp at a time."""
    out = np.empty_like(vals)
    for w in range(0, len(vals), 32):
        for lane in range(32):
            bval, cval, seg = b & 31, c & 31, (c >> 8) & 31
            max_lane = (lane & seg) | (cval & ~seg)
            min_lane = lane & seg
            if mode == "up":
                j, ok = lane - bval, lane - bval >= max_lane
            elif mode == "down":
                j, ok = lane + bval, lane + bval <= max_lane
            elif mode == "bfly":
                j, ok = lane ^ bval, (lane ^ bval) <= max_lane
            else:
                j = min_lane | (bval & ~seg)
                ok = j <= max_lane
            out[w + lane] = vals[w + (j if ok else lane)]
    return out


@pytest.mark.parametrize("mode", ["up", "down", "bfly", "idx"])
def test_shfl_modes_with_clamp_and_segments(backend, mode, rng):
    x = rng.integers(0, 2 ** 32, 64, dtype=np.uint64).astype(np.uint32)
    for b in (0, 1, 3, 7, 16, 31):
        for c in ((0 if mode == "up" else 31), 7, 15, 0x1818, 0x1C00, 0x1F07):
            got = run_map(backend, lambda k, v: k.shfl_sync(mode, v, b, c), [x], ["u32"], "u32",
                          block=64)
            np.testing.assert_array_equal(got, ref_shfl(x, mode, b, c), err_msg=f"b={b} c={c:#x}")


def test_shfl_idx_lane_from_register_and_float_payload(backend, rng):
    x = rng.standard_normal(96).astype(np.float32)
    lanes = rng.integers(0, 32, 96).astype(np.uint32)
    got = run_map(backend, lambda k, v, l: k.shfl_idx(v, l), [x, lanes], ["f32", "u32"], "f32",
                  block=96)
    want = x[(np.arange(96) // 32) * 32 + lanes]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", ["all", "any", "uni", "ballot"])
def test_vote(backend, mode, rng):
    x = rng.integers(0, 2, 128).astype(np.uint32)
    x[32:64] = 1          # a uniform warp
    x[64:96] = 0

    def body(k, v):
        p = k.setp("ne", v, 0)
        r = k.vote_sync(mode, p)
        if mode == "ballot":
            return r
        return k.select(r, k.const(u32, 1), k.const(u32, 0))
    got = run_map(backend, body, [x], ["u32"], "u32", block=128)
    for w in range(4):
        bits = x[32 * w:32 * w + 32]
        want = {"all": int(bits.all()), "any": int(bits.any()),
                "uni": int(bits.all() or not bits.any()),
                "ballot": int(sum(int(b) << i for i, b in enumerate(bits)))}[mode]
        assert (got[32 * w:32 * w + 32] == want).all(), (mode, w)


def test_vote_with_partial_membermask(emu_backend, rng):
    m = ptxgen.Module("sm_80")
    with m.kernel("half") as k:
        x = k.param_ptr("x", u32)
        out = k.param_ptr("out", u32)
        t = k.tid.x
        with k.if_(t < 16):
            k.st(out[t], k.vote_sync("ballot", k.setp("ne", k.ld(x[t]), 0), mask=0xFFFF))
    host = rng.integers(0, 2, 32).astype(np.uint32)
    out = emu_backend.poisoned(32, np.uint32)
    mod = emu_backend.load(m)
    emu_backend.launch_positional(mod["half"], 1, 32, emu_backend.array(host), out)
    want = sum(int(b) << i for i, b in enumerate(host[:16]))
    assert (out.to_numpy()[:16] == want).all()


def _frag_rows_cols():
    lane = np.arange(32)
    g, t = lane[:, None] >> 2, lane[:, None] % 4
    i8, i4 = np.arange(8)[None, :], np.arange(4)[None, :]
    a_r = np.where((i8 < 2) | ((i8 >= 4) & (i8 < 6)), g, g + 8)
    a_c = np.where(i8 < 4, t * 2 + (i8 & 1), t * 2 + (i8 & 1) + 8)
    b_r = np.where(i4 < 2, t * 2 + (i4 & 1), t * 2 + (i4 & 1) + 8)
    b_c = np.broadcast_to(g, (32, 4))
    c_r = np.where(i4 < 2, g, g + 8)
    c_c = t * 2 + (i4 & 1)
    return (a_r, a_c), (b_r, b_c), (c_r, c_c)


@pytest.mark.parametrize("ab", ["f16", "bf16"])
def test_mma_m16n8k16_fragments(backend, ab, rng):
    tiles = 3
    A = rng.standard_normal((tiles, 16, 16))
    B = rng.standard_normal((tiles, 16, 8))
    C = rng.standard_normal((tiles, 16, 8)).astype(np.float32)
    if ab == "f16":
        A, B = A.astype(np.float16), B.astype(np.float16)
        hbits = lambda v: v.view(np.uint16).astype(np.uint32)  # noqa: E731
        Af, Bf = A.astype(np.float64), B.astype(np.float64)
    else:
        A32, B32 = A.astype(np.float32), B.astype(np.float32)
        A32 = ((A32.view(np.uint32) >> 16) << 16).view(np.float32)
        B32 = ((B32.view(np.uint32) >> 16) << 16).view(np.float32)
        A, B = A32, B32
        hbits = lambda v: (v.view(np.uint32) >> 16).astype(np.uint32)  # noqa: E731
        Af, Bf = A.astype(np.float64), B.astype(np.float64)
    (ar, ac), (br, bc), (cr, cc) = _frag_rows_cols()
    fa = np.zeros((tiles, 32, 4), np.uint32)
    fb = np.zeros((tiles, 32, 2), np.uint32)
    fc = np.zeros((tiles, 32, 4), np.float32)
    for tt in range(tiles):
        ea = hbits(A[tt][ar, ac])            # (32, 8) elements a0..a7
        eb = hbits(B[tt][br, bc])
        fa[tt] = ea[:, 0::2] | (ea[:, 1::2] << 16)
        fb[tt] = eb[:, 0::2] | (eb[:, 1::2] << 16)
        fc[tt] = C[tt][cr, cc]
    m = ptxgen.Module("sm_80")
    with m.kernel("mma") as k:
        pa = k.param_ptr("fa", u32)
        pb = k.param_ptr("fb", u32)
        pc = k.param_ptr("fc", f32)
        po = k.param_ptr("out", f32)
        i = k.global_id()
        a = tuple(k.bitcast(T.b32, k.ld(pa[i * 4 + j])) for j in range(4))
        b = tuple(k.bitcast(T.b32, k.ld(pb[i * 2 + j])) for j in range(2))
        c = tuple(k.ld(pc[i * 4 + j]) for j in range(4))
        d = k.mma_m16n8k16(a, b, c, ab_type=ab)
        for j in range(4):
            k.st(po[i * 4 + j], d[j])
    mod = backend.load(m)
    out = backend.poisoned(tiles * 32 * 4, np.float32)
    backend.launch_positional(mod["mma"], tiles, 32, backend.array(fa), backend.array(fb),
                              backend.array(fc), out)
    got = out.to_numpy().reshape(tiles, 32, 4)
    for tt in range(tiles):
        D = np.zeros((16, 8))
        D[cr, cc] = got[tt]
        want = Af[tt] @ Bf[tt] + C[tt]
        scale = np.abs(Af[tt]) @ np.abs(Bf[tt]) + np.abs(C[tt])
        assert np.all(np.abs(D - want) <= 2.0 ** -21 * scale), (tt, np.abs(D - want).max())


def test_atomic_histogram_returns_serial_old_values(backend, rng):
    n, bins = 1000, 7
    keys = rng.integers(0, bins, n).astype(np.uint32)
    m = ptxgen.Module("sm_80")
    with m.kernel("hist") as k:
        kp = k.param_ptr("keys", u32)
        hp = k.param_ptr("hist", u32)
        op = k.param_ptr("old", u32)
        nn = k.param("n", u32)
        i = k.global_id()
        with k.if_(i < nn):
            k.st(op[i], k.atom("add", hp[k.ld(kp[i])], 1))
    mod = backend.load(m)
    hist = backend.array(np.zeros(bins, np.uint32))
    old = backend.poisoned(n, np.uint32)
    backend.launch_positional(mod["hist"], (n + 127) // 128, 128, backend.array(keys), hist, old, n)
    counts = np.bincount(keys, minlength=bins)
    np.testing.assert_array_equal(hist.to_numpy(), counts)
    olds = old.to_numpy()
    for b in range(bins):       # every old value of a bin seen exactly once
        np.testing.assert_array_equal(np.sort(olds[keys == b]), np.arange(counts[b]))


@pytest.mark.parametrize("op", ["min", "max", "exch", "inc", "dec", "cas", "and", "or", "xor"])
def test_atomic_ops_per_thread(backend, op, rng):
    n = 200
    mem = rng.integers(0, 50, n).astype(np.uint32)
    val = rng.integers(0, 50, n).astype(np.uint32)
    cmpv = np.where(rng.random(n) < 0.5, mem, val).astype(np.uint32)
    m = ptxgen.Module("sm_80")
    with m.kernel("at") as k:
        mp = k.param_ptr("mem", u32)
        vp = k.param_ptr("val", u32)
        cp = k.param_ptr("cmp", u32)
        op_ = k.param_ptr("old", u32)
        nn = k.param("n", u32)
        i = k.global_id()
        with k.if_(i < nn):
            v = k.ld(vp[i])
            if op == "cas":
                r = k.atom("cas", mp[i], v, k.ld(cp[i]))
            else:
                r = k.atom(op, mp[i], v)
            k.st(op_[i], r)
    mod = backend.load(m)
    dm, old = backend.array(mem), backend.poisoned(n, np.uint32)
    backend.launch_positional(mod["at"], 2, 128, dm, backend.array(val), backend.array(cmpv), old, n)
    f = {"min": np.minimum, "max": np.maximum, "exch": lambda o, v: v,
         "inc": lambda o, v: np.where(o >= v, 0, o + 1),
         "dec": lambda o, v: np.where((o == 0) | (o > v), v, o - 1),
         "cas": lambda o, v: np.where(o == cmpv, v, o),
         "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[op]
    np.testing.assert_array_equal(old.to_numpy(), mem)
    np.testing.assert_array_equal(dm.to_numpy(), f(mem, val).astype(np.uint32))


def test_float_atomic_add_and_shared_red(backend, rng):
    n = 512
    x = rng.uniform(0.5, 1.5, n).astype(np.float32)
    m = ptxgen.Module("sm_80")
    with m.kernel("fsum") as k:
        xp = k.param_ptr("x", f32)
        sp = k.param_ptr("s", f32)
        cnt = k.param_ptr("cnt", u32)
        sh = k.shared_array("c", u32, 1)
        t = k.tid.x
        with k.if_(t.eq(0)):
            k.st(sh[0], 0, ty=u32)
        k.bar_sync(0)
        k.red("add", sh[0], 1)
        k.atom("add", sp[0], k.ld(xp[k.global_id()]))
        k.bar_sync(0)
        with k.if_(t.eq(0)):
            k.red("add", cnt[0], k.ld(sh[0]))
    mod = backend.load(m)
    s = backend.array(np.zeros(1, np.float32))
    c = backend.array(np.zeros(1, np.uint32))
    backend.launch_positional(mod["fsum"], 4, 128, backend.array(x), s, c)
    assert c.to_numpy()[0] == n
    assert abs(float(s.to_numpy()[0]) - x.astype(np.float64).sum()) <= 1e-6 * n * 1.5


@pytest.mark.parametrize("ty", ["s8", "u8", "s16", "u16"])
def test_narrow_loads_extend(backend, ty, rng):
    x = np.frombuffer(rng.bytes(300 * T.type_by_name(ty).bytes), np_dtype(ty)).copy()
    wide = "s32" if ty[0] == "s" else "u32"
    body = lambda k, v: v if v.type.bits == 32 else k.cvt(wide, v)  # noqa: E731
    got = run_map(backend, body, [x], [ty], wide)
    np.testing.assert_array_equal(got, x.astype(np.int64).astype(np_dtype(wide)))


def test_vector_loads_and_byte_stores(backend, rng):
    n = 40
    x = rng.standard_normal(4 * n).astype(np.float32)
    m = ptxgen.Module("sm_80")
    with m.kernel("vec") as k:
        xp = k.param_ptr("x", f32, align=16)
        yp = k.param_ptr("y", f32, align=8)
        bp = k.param_ptr("b", T.u8)
        nn = k.param("n", u32)
        i = k.global_id()
        with k.if_(i < nn):
            a0, a1, a2, a3 = k.ld(xp[i * 4], vec=4)
            k.st(yp[i * 2], (a0 + a1, a2 + a3))
            k.st(bp[i], k.bitcast(u32, a0), ty=T.u8)      # low byte of the bits
    mod = backend.load(m)
    y = backend.poisoned(2 * n, np.float32)
    bb = backend.poisoned(n, np.uint8)
    backend.launch_positional(mod["vec"], 1, 64, backend.array(x), y, bb, n)
    np.testing.assert_array_equal(y.to_numpy(), (x[0::2] + x[1::2]))
    np.testing.assert_array_equal(bb.to_numpy(), (x[0::4].view(np.uint32) & 0xFF).astype(np.uint8))


def test_generic_addresses_of_shared_memory(emu_backend):
    text = """.version 7.8
.target sm_80
.address_size 64
.visible .entry g(
\t.param .u64 .ptr .global .align 4 out
)
{
\t.reg .u32 %r<6>;
\t.reg .u64 %rd<8>;
\t.shared .align 4 .b8 buf[128];
\tld.param.u64 %rd1, [out];
\tcvta.to.global.u64 %rd2, %rd1;
\tmov.u32 %r1, %tid.x;
\tmov.u64 %rd3, buf;
\tcvta.shared.u64 %rd4, %rd3;
\tmul.wide.u32 %rd5, %r1, 4;
\tadd.u64 %rd6, %rd4, %rd5;
\tmul.lo.u32 %r2, %r1, 3;
\tst.u32 [%rd6], %r2;
\tbar.sync 0;
\tcvta.to.shared.u64 %rd7, %rd6;
\tld.shared.u32 %r3, [%rd7];
\tadd.u64 %rd5, %rd2, %rd5;
\tst.global.u32 [%rd5], %r3;
\tret;
}
"""
    mod = emu_backend.load(text)
    out = emu_backend.poisoned(32, np.uint32)
    emu_backend.launch_positional(mod["g"], 1, 32, out)
    np.testing.assert_array_equal(out.to_numpy(), np.arange(32) * 3)


# PTX ISA bounds for the approximate functions (f32), used as tolerances
@pytest.mark.parametrize("fn,ref,lo,hi,rel,abs_", [
    ("ex2", np.exp2, -20, 20, 2.0 ** -22, 0),
    # lg2: 2^-22 absolute near 1, relative 2^-22 away from it (an H100
    # showed 8.8e-7 absolute error at log2(x) = 9.7)
    ("lg2", np.log2, 1e-3, 1e3, 2.0 ** -22, 2.0 ** -22),
    ("sin", np.sin, -np.pi, np.pi, 0, 2.0 ** -20.5),
    ("cos", np.cos, -np.pi, np.pi, 0, 2.0 ** -20.5),
    ("rsqrt", lambda v: 1 / np.sqrt(v), 1e-3, 1e3, 2.0 ** -22, 0),
    ("tanh", np.tanh, -5, 5, 2.0 ** -10.9, 0),
])
def test_approx_functions_within_isa_bounds(backend, fn, ref, lo, hi, rel, abs_, rng):
    x = rng.uniform(lo, hi, 300).astype(np.float32)
    got = run_map(backend, lambda k, v: getattr(k, fn)(v), [x], ["f32"], "f32").astype(np.float64)
    want = ref(x.astype(np.float64))
    # plus the rounding of the f32 result itself
    assert np.all(np.abs(got - want) <= (rel + 2.0 ** -24) * np.abs(want) + abs_ + 1e-45)
