"""Integer, bit, comparison and selection semantics against Python
reimplementations of the PTX ISA pseudocode."""

import math

import numpy as np
import pytest

from backends import run_map
from ptxgen import isa
from ptxgen import types as T

N = 257


def rand(rng, ty, n=N):
    t = T.type_by_name(ty)
    if t.is_signed:
        return rng.integers(-2 ** (t.bits - 1), 2 ** (t.bits - 1), n, dtype=np.int64).astype(t.np_dtype)
    return rng.integers(0, 2 ** t.bits, n, dtype=np.uint64).astype(t.np_dtype)


def wrap(v, bits, signed):
    v &= (1 << bits) - 1
    return v - (1 << bits) if signed and v >> (bits - 1) else v


@pytest.mark.parametrize("ty", ["u64", "s64", "u32", "s32", "s16"])
def test_mul_hi_lo_wide(backend, ty, rng):
    t = T.type_by_name(ty)
    a, b = rand(rng, ty), rand(rng, ty)
    hi = run_map(backend, lambda k, x, y: k.mul_hi(x, y), [a, b], [ty, ty], ty)
    lo = run_map(backend, lambda k, x, y: x * y, [a, b], [ty, ty], ty)
    for x, y, h, l in zip(a.tolist(), b.tolist(), hi.tolist(), lo.tolist()):
        assert h == wrap((x * y) >> t.bits, t.bits, t.is_signed)
        assert l == wrap(x * y, t.bits, t.is_signed)
    if t.bits == 32:
        wide = run_map(backend, lambda k, x, y: k.mul_wide(x, y), [a, b], [ty, ty],
                       ty[0] + "64")
        assert wide.tolist() == [x * y for x, y in zip(a.tolist(), b.tolist())]


@pytest.mark.parametrize("ty", ["s32", "u32", "s64", "u64"])
def test_div_rem_truncate(backend, ty, rng):
    t = T.type_by_name(ty)
    a, b = rand(rng, ty), rand(rng, ty)
    b[b == 0] = 3
    b[:20] = (rng.integers(1, 50, 20) * (-1 if t.is_signed else 1)).astype(b.dtype)
    q = run_map(backend, lambda k, x, y: k.div(x, y), [a, b], [ty, ty], ty)
    r = run_map(backend, lambda k, x, y: x % y, [a, b], [ty, ty], ty)
    for x, y, qq, rr in zip(a.tolist(), b.tolist(), q.tolist(), r.tolist()):
        want = abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1)
        assert qq == wrap(want, t.bits, t.is_signed)
        assert rr == wrap(x - want * y, t.bits, t.is_signed)


def test_add_sat_and_wrap(backend, rng):
    a, b = rand(rng, "s32"), rand(rng, "s32")
    sat = run_map(backend, lambda k, x, y: k.add(x, y, sat=True), [a, b], ["s32"] * 2, "s32")
    assert sat.tolist() == [max(-2 ** 31, min(2 ** 31 - 1, x + y)) for x, y in zip(a.tolist(), b.tolist())]
    u, v = rand(rng, "u32"), rand(rng, "u32")
    np.testing.assert_array_equal(run_map(backend, lambda k, x, y: x - y, [u, v], ["u32"] * 2, "u32"),
                                  u - v)


def field_operands(pos, ln, bits):
    """bfe/bfi's (position, length): the ISA's ``& 0xff`` on the 32-bit
    forms; the whole u32 value on the 64-bit forms, whose sm_90 lowering
    (64-bit shifts saturating at 64) applies no mask."""
    return (pos & 0xFF, ln & 0xFF) if bits == 32 else (pos, ln)


def ref_bfe(a, pos, ln, bits, signed):
    pos, ln = field_operands(pos, ln, bits)
    ua = a & ((1 << bits) - 1)
    sbit = 0 if (ln == 0 or not signed) else (ua >> min(pos + ln - 1, bits - 1)) & 1
    d = 0
    for i in range(bits):
        bit = (ua >> (pos + i)) & 1 if (i < ln and pos + i <= bits - 1) else sbit
        d |= bit << i
    return wrap(d, bits, signed)


@pytest.mark.parametrize("ty", ["u32", "s32", "u64", "s64"])
def test_bfe(backend, ty, rng):
    t = T.type_by_name(ty)
    a = rand(rng, ty)
    pos = rng.integers(0, t.bits + 8, N).astype(np.uint32)
    ln = rng.integers(0, t.bits + 8, N).astype(np.uint32)
    got = run_map(backend, lambda k, x, p, l: k.bfe(x, p, l), [a, pos, ln], [ty, "u32", "u32"], ty)
    for x, p, l, g in zip(a.tolist(), pos.tolist(), ln.tolist(), got.tolist()):
        assert g == ref_bfe(x, p, l, t.bits, t.is_signed), (x, p, l)


def test_bfe_bfi_positions_past_255(backend):
    """Position and length above 255: the 32-bit forms keep their low byte
    (259 is bit 3), the 64-bit forms saturate (259 is past bit 63).
    Expected values written out by hand."""
    a32, a64 = 0xF0F0_5A5A, 0xF0F0_5A5A_0F0F_A5A5
    pos = np.array([259, 3, 64, 259, 0xFFFF_FFFF], np.uint32)
    ln = np.array([3, 259, 3, 259, 8], np.uint32)
    want = {"u32": [3, 3, 0, 3, 0],
            "s32": [3, 3, -1, 3, -1],
            "u64": [0, a64 >> 3, 0, 0, 0],
            "s64": [-1, (a64 >> 3) - (1 << 61), -1, -1, -1]}
    for ty, w in want.items():
        bits = int(ty[1:])
        a = np.full(len(pos), a32 if bits == 32 else a64, f"u{bits // 8}").view(
            f"{'i' if ty[0] == 's' else 'u'}{bits // 8}")
        got = run_map(backend, lambda k, x, p, l: k.bfe(x, p, l), [a, pos, ln],
                      [ty, "u32", "u32"], ty)
        assert got.tolist() == w, (ty, got.tolist(), w)
    f, b = np.full(5, 0xFFFF_FFFF_FFFF_FFFF, np.uint64), np.zeros(5, np.uint64)
    got = run_map(backend, lambda k, x, y, p, l: k.bfi(x, y, p, l), [f, b, pos, ln],
                  ["u64", "u64", "u32", "u32"], "u64")
    assert got.tolist() == [0, 0xFFFF_FFFF_FFFF_FFF8, 0, 0, 0]
    got = run_map(backend, lambda k, x, y, p, l: k.bfi(x, y, p, l),
                  [f.astype(np.uint32), b.astype(np.uint32), pos, ln],
                  ["u32", "u32", "u32", "u32"], "u32")
    assert got.tolist() == [0b111000, 0b111000, 0, 0b111000, 0]


@pytest.mark.parametrize("ty,bits", [("u32", 32), ("u64", 64)])
def test_bfi(backend, ty, bits, rng):
    f, b = rand(rng, ty), rand(rng, ty)
    pos = rng.integers(0, bits + 4, N).astype(np.uint32)
    ln = rng.integers(0, bits + 4, N).astype(np.uint32)
    got = run_map(backend, lambda k, x, y, p, l: k.bfi(x, y, p, l), [f, b, pos, ln],
                  [ty, ty, "u32", "u32"], ty)
    for x, y, p, l, g in zip(f.tolist(), b.tolist(), pos.tolist(), ln.tolist(), got.tolist()):
        d = y
        p, l = field_operands(p, l, bits)
        for i in range(min(l, bits)):
            if p + i > bits - 1:
                break
            d = (d & ~(1 << (p + i))) | (((x >> i) & 1) << (p + i))
        assert g == d


_MODES = {
    "f4e": [(0, 1, 2, 3), (1, 2, 3, 4), (2, 3, 4, 5), (3, 4, 5, 6)],
    "b4e": [(0, 7, 6, 5), (1, 0, 7, 6), (2, 1, 0, 7), (3, 2, 1, 0)],
    "rc8": [(0,) * 4, (1,) * 4, (2,) * 4, (3,) * 4],
    "ecl": [(0, 1, 2, 3), (1, 1, 2, 3), (2, 2, 2, 3), (3, 3, 3, 3)],
    "ecr": [(0, 0, 0, 0), (0, 1, 1, 1), (0, 1, 2, 2), (0, 1, 2, 3)],
    "rc16": [(0, 1, 0, 1), (2, 3, 2, 3), (0, 1, 0, 1), (2, 3, 2, 3)],
}


@pytest.mark.parametrize("mode", [None] + list(_MODES))
def test_prmt(backend, mode, rng):
    a, b, c = rand(rng, "u32"), rand(rng, "u32"), rand(rng, "u32")
    got = run_map(backend, lambda k, x, y, z: k.prmt(x, y, z, mode=mode), [a, b, c],
                  ["u32"] * 3, "u32")
    for x, y, z, g in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist()):
        src = x | (y << 32)
        d = 0
        for i in range(4):
            if mode is None:
                sel = (z >> (4 * i)) & 0xF
                byte = (src >> (8 * (sel & 7))) & 0xFF
                if sel & 8:
                    byte = 0xFF if byte & 0x80 else 0
            else:
                byte = (src >> (8 * _MODES[mode][z & 3][i])) & 0xFF
            d |= byte << (8 * i)
        assert g == d


@pytest.mark.parametrize("sa,sb", [(False, False), (True, False), (True, True)])
def test_dp4a_dp2a(backend, sa, sb, rng):
    a, b, c = rand(rng, "u32"), rand(rng, "u32"), rand(rng, "s32" if (sa or sb) else "u32")
    acc = "s32" if (sa or sb) else "u32"
    ab = a.view(np.int8 if sa else np.uint8).reshape(-1, 4).astype(np.int64)
    bb = b.view(np.int8 if sb else np.uint8).reshape(-1, 4).astype(np.int64)
    got = run_map(backend, lambda k, x, y, z: k.dp4a(x, y, z, signed_a=sa, signed_b=sb),
                  [a, b, c], ["u32", "u32", acc], acc)
    want = ((ab * bb).sum(1) + c.astype(np.int64)) & 0xFFFFFFFF
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.uint32))
    ah = a.view(np.int16 if sa else np.uint16).reshape(-1, 2).astype(np.int64)
    for hi in (False, True):
        got = run_map(backend, lambda k, x, y, z: k.dp2a(x, y, z, hi=hi, signed_a=sa, signed_b=sb),
                      [a, b, c], ["u32", "u32", acc], acc)
        sel = bb[:, 2:] if hi else bb[:, :2]
        want = ((ah * sel).sum(1) + c.astype(np.int64)) & 0xFFFFFFFF
        np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.uint32))


def test_popc_clz_shifts_neg_abs(backend, rng):
    a = rand(rng, "u32")
    a[:3] = [0, 1, 0xFFFFFFFF]
    assert run_map(backend, lambda k, x: k.popc(x), [a], ["u32"], "u32").tolist() == \
        [bin(v).count("1") for v in a.tolist()]
    assert run_map(backend, lambda k, x: k.clz(x), [a], ["u32"], "u32").tolist() == \
        [32 - v.bit_length() for v in a.tolist()]
    d = rand(rng, "u64")
    assert run_map(backend, lambda k, x: k.clz(x), [d], ["u64"], "u32").tolist() == \
        [64 - v.bit_length() for v in d.tolist()]
    sh = rng.integers(0, 40, N).astype(np.uint32)
    assert run_map(backend, lambda k, x, s: x << s, [a, sh], ["u32", "u32"], "u32").tolist() == \
        [(v << s) & 0xFFFFFFFF for v, s in zip(a.tolist(), sh.tolist())]
    assert run_map(backend, lambda k, x, s: x >> s, [a, sh], ["u32", "u32"], "u32").tolist() == \
        [v >> s for v, s in zip(a.tolist(), sh.tolist())]
    s = rand(rng, "s32")
    assert run_map(backend, lambda k, x, q: x >> q, [s, sh], ["s32", "u32"], "s32").tolist() == \
        [v >> min(q, 31) for v, q in zip(s.tolist(), sh.tolist())]
    s[0] = -2 ** 31
    assert run_map(backend, lambda k, x: k.abs(x), [s], ["s32"], "s32").tolist() == \
        [wrap(abs(v), 32, True) for v in s.tolist()]
    assert run_map(backend, lambda k, x: -x, [s], ["s32"], "s32").tolist() == \
        [wrap(-v, 32, True) for v in s.tolist()]


def _cmp(op, x, y):
    unord = math.isnan(x) or math.isnan(y)
    if op == "num":
        return not unord
    if op == "nan":
        return unord
    base = op[:-1] if op.endswith("u") else op
    r = {"eq": x == y, "ne": x != y, "lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y}[base]
    if op.endswith("u"):
        return unord or r
    return (not unord) and r


@pytest.mark.parametrize("cmp", [c for c in isa.CMP_OPS if c not in ("lo", "ls", "hi", "hs")])
@pytest.mark.parametrize("ty", ["f32", "f16", "bf16"])
def test_setp_float_incl_unordered(backend, cmp, ty, rng):
    x = rng.integers(-3, 4, N).astype(np.float32)
    y = rng.integers(-3, 4, N).astype(np.float32)
    x[::7], y[::11] = np.nan, np.nan
    if ty == "f32":
        xs, ys = x, y
    elif ty == "f16":
        xs, ys = x.astype(np.float16), y.astype(np.float16)
    else:
        xs, ys = ((v.view(np.uint32) >> 16).astype(np.uint16) for v in (x, y))
    got = run_map(backend, lambda k, a, b: k.select(k.setp(cmp, a, b), k.const(T.u32, 1),
                                                    k.const(T.u32, 0)),
                  [xs, ys], [ty, ty], "u32")
    assert got.tolist() == [int(_cmp(cmp, a, b)) for a, b in zip(x.tolist(), y.tolist())]


@pytest.mark.parametrize("bop", ["and", "or", "xor"])
def test_setp_combine_and_unsigned_compares(backend, bop, rng):
    a, b, c = rand(rng, "s32"), rand(rng, "s32"), rand(rng, "s32")
    body = lambda k, x, y, z: k.select(  # noqa: E731
        k.setp("lt", x, y, combine=(bop, k.setp("hi", z.bitcast(T.u32), y.bitcast(T.u32)))),
        k.const(T.u32, 1), k.const(T.u32, 0))
    got = run_map(backend, body, [a, b, c], ["s32"] * 3, "u32")
    f = {"and": lambda p, q: p and q, "or": lambda p, q: p or q, "xor": lambda p, q: p != q}[bop]
    for x, y, z, g in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist()):
        assert g == int(f(x < y, (z & 0xFFFFFFFF) > (y & 0xFFFFFFFF)))


_INT_CMPS = {"eq": lambda x, y: x == y, "ne": lambda x, y: x != y, "lt": lambda x, y: x < y,
             "le": lambda x, y: x <= y, "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y,
             "lo": lambda x, y: x < y, "ls": lambda x, y: x <= y, "hi": lambda x, y: x > y,
             "hs": lambda x, y: x >= y}


@pytest.mark.parametrize("cmp", list(_INT_CMPS))
@pytest.mark.parametrize("ty", ["u32", "s32", "u64", "s64"])
def test_setp_every_integer_compare(backend, cmp, ty, rng):
    """Each comparison on random operands, a third of them equal (where
    lt/le, lo/ls and gt/ge differ) and some differing only in the sign bit."""
    if cmp in ("lo", "ls", "hi", "hs") and ty[0] == "s":
        pytest.skip("PTX defines lo/ls/hi/hs on unsigned and bit types only")
    a, b = rand(rng, ty), rand(rng, ty)
    b[: N // 3] = a[: N // 3]
    b[N // 3: N // 3 + 20] = a[N // 3: N // 3 + 20] ^ np.array(1 << (int(ty[1:]) - 1)).astype(a.dtype)
    body = lambda k, x, y: k.select(k.setp(cmp, x, y), k.const(T.u32, 1),  # noqa: E731
                                    k.const(T.u32, 0))
    got = run_map(backend, body, [a, b], [ty, ty], "u32")
    want = [int(_INT_CMPS[cmp](x, y)) for x, y in zip(a.tolist(), b.tolist())]
    assert got.tolist() == want


def test_min_max_float_nan_and_zero(backend):
    x = np.array([1.0, np.nan, np.nan, -0.0, 0.0, 2.0] * 10, np.float32)
    y = np.array([np.nan, 3.0, np.nan, 0.0, -0.0, -5.0] * 10, np.float32)
    mn = run_map(backend, lambda k, a, b: k.min(a, b), [x, y], ["f32"] * 2, "f32")[:6]
    mx = run_map(backend, lambda k, a, b: k.max(a, b), [x, y], ["f32"] * 2, "f32")[:6]
    np.testing.assert_array_equal(mn[[0, 1, 5]], [1.0, 3.0, -5.0])
    assert np.isnan(mn[2]) and np.signbit(mn[3]) and np.signbit(mn[4])
    np.testing.assert_array_equal(mx[[0, 1, 5]], [1.0, 3.0, 2.0])
    assert not np.signbit(mx[3]) and not np.signbit(mx[4])
