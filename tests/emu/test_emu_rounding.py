"""Float rounding: cvt with every mode, f32/f16/bf16 arithmetic with every
mode, checked bit-for-bit against an exact rational oracle."""

import math
from fractions import Fraction

import numpy as np
import pytest

from backends import run_map
from ptxgen import types as T

MODES = ["rn", "rz", "rm", "rp"]
_FMT = {"f16": (11, -14, 15), "bf16": (8, -126, 127), "f32": (24, -126, 127),
        "f64": (53, -1022, 1023)}


def ref_round(x, fmt, mode):
    """Exact rational ``x`` rounded to ``fmt`` with ``mode`` (a Python float)."""
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return x
        x = Fraction(x)
    p, emin, emax = _FMT[fmt]
    if x == 0:
        return 0.0
    sign = -1 if x < 0 else 1
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    e = max(e, emin)
    ulp = Fraction(2) ** (e - p + 1)
    q = a / ulp
    fl = q.numerator // q.denominator
    rem = q - fl
    up = {"rn": rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1),
          "rz": False, "rp": rem > 0 and sign > 0, "rm": rem > 0 and sign < 0}[mode]
    val = (fl + up) * ulp
    maxf = (2 - Fraction(2) ** (1 - p)) * Fraction(2) ** emax
    if val > maxf:
        to_inf = {"rn": True, "rz": False, "rp": sign > 0, "rm": sign < 0}[mode]
        return sign * (math.inf if to_inf else float(maxf))
    return sign * float(val)


def bits(values, fmt):
    v = np.asarray(values, dtype=np.float64)
    if fmt == "f16":
        return v.astype(np.float16).view(np.uint16)
    if fmt == "bf16":
        return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if fmt == "f32":
        return v.astype(np.float32).view(np.uint32)
    return v.view(np.uint64)


def got_bits(arr, fmt):
    return np.asarray(arr).view({"f16": np.uint16, "bf16": np.uint16, "f32": np.uint32,
                                 "f64": np.uint64}[fmt])


def f32_inputs(rng, n, lo=-30, hi=30):
    """Random f32 values spread over exponents, incl. f16/bf16 ties, tiny
    and huge ones."""
    x = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(lo, hi, n)
         * rng.choice([-1, 1], n)).astype(np.float32)
    # exact ties for f16 and bf16 rounding
    h = rng.standard_normal(n // 4).astype(np.float16).astype(np.float32)
    ties = h + np.spacing(h.astype(np.float16)).astype(np.float32) / 2
    b = (rng.integers(0, 2 ** 16, n // 4).astype(np.uint32) << 16 | 0x8000).view(np.float32)
    x = np.concatenate([x, ties, b[np.isfinite(b)]])
    return x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dst", ["f16", "bf16"])
def test_cvt_f32_to_half(backend, mode, dst, rng):
    x = f32_inputs(rng, 400, -28, 20)
    got = run_map(backend, lambda k, a: k.cvt(dst, a, rnd=mode), [x], ["f32"], dst)
    want = bits([ref_round(float(v), dst, mode) for v in x], dst)
    np.testing.assert_array_equal(got_bits(got, dst), want)


@pytest.mark.parametrize("mode", MODES)
def test_cvt_f64_to_f32(backend, mode, rng):
    x = rng.standard_normal(300) * 2.0 ** rng.integers(-140, 130, 300)
    got = run_map(backend, lambda k, a: k.cvt(T.f32, a, rnd=mode), [x], ["f64"], "f32")
    want = bits([ref_round(float(v), "f32", mode) for v in x], "f32")
    np.testing.assert_array_equal(got_bits(got, "f32"), want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("src,dst", [("s64", "f32"), ("u64", "f64"), ("s64", "f64"),
                                     ("s32", "f16"), ("u32", "f32")])
def test_cvt_int_to_float(backend, mode, src, dst, rng):
    bits_ = int(src[1:])
    signed = src[0] == "s"
    lo, hi = (-(2 ** (bits_ - 1)), 2 ** (bits_ - 1)) if signed else (0, 2 ** bits_)
    shifts = rng.integers(0, bits_, 300)
    raw = [int(v) >> int(s) for v, s in zip(rng.integers(0, 2 ** 63, 300, dtype=np.int64), shifts)]
    vals = [max(lo, min(hi - 1, v * (1 if not signed or rng.random() < .5 else -1))) for v in raw]
    x = np.array(vals, dtype=np.dtype(src.replace("s", "int").replace("u", "uint")))
    if dst == "f16":
        x = (x % 70000 - 35000).astype(np.int32)
    got = run_map(backend, lambda k, a: k.cvt(dst, a, rnd=mode), [x], [src], dst)
    want = bits([ref_round(Fraction(int(v)), dst, mode) for v in x], dst)
    np.testing.assert_array_equal(got_bits(got, dst), want)


@pytest.mark.parametrize("mode", ["rni", "rzi", "rmi", "rpi"])
@pytest.mark.parametrize("src,dst", [("f32", "s32"), ("f32", "u32"), ("f64", "s64"),
                                     ("f32", "s16")])
def test_cvt_float_to_int_saturates(backend, mode, src, dst, rng):
    n = 300
    x = rng.standard_normal(n) * 2.0 ** rng.integers(0, 70, n)
    x[:8] = [np.nan, np.inf, -np.inf, 0.5, -0.5, 1.5, -2.5, 2.5]
    x = x.astype(np.dtype("float32" if src == "f32" else "float64"))
    got = run_map(backend, lambda k, a: k.cvt(dst, a, rnd=mode), [x], [src], dst)
    w = int(dst[1:])
    lo, hi = (-(2 ** (w - 1)), 2 ** (w - 1) - 1) if dst[0] == "s" else (0, 2 ** w - 1)
    rnd = {"rni": lambda v: round(v), "rzi": math.trunc, "rmi": math.floor, "rpi": math.ceil}[mode]
    want = []
    for v in x.astype(np.float64):
        if math.isnan(v):
            # NaN -> 0, except f64 -> s64, where the GPU gives INT64_MIN
            want.append(lo if (src, dst) == ("f64", "s64") else 0)
        elif math.isinf(v):
            want.append(hi if v > 0 else lo)
        else:
            want.append(min(hi, max(lo, rnd(Fraction(float(v))))))
    np.testing.assert_array_equal(got.astype(object), np.array(want, dtype=object))


@pytest.mark.parametrize("mode", MODES)
def test_cvt_rounds_to_integral_float(backend, mode, rng):
    x = (rng.standard_normal(200) * 100).astype(np.float32)
    r = {"rn": "rni", "rz": "rzi", "rm": "rmi", "rp": "rpi"}[mode]
    got = run_map(backend, lambda k, a: k.cvt(T.f32, a, rnd=r), [x], ["f32"], "f32")
    f = {"rn": np.rint, "rz": np.trunc, "rm": np.floor, "rp": np.ceil}[mode]
    np.testing.assert_array_equal(got, f(x))


def test_cvt_sat_and_widening(backend, rng):
    x = (rng.standard_normal(200) * 2).astype(np.float32)
    x[:2] = [np.nan, -0.0]
    got = run_map(backend, lambda k, a: k.cvt(T.f32, a, rnd="rn", sat=True)
                  if False else k.cvt(T.f16, a, sat=True), [x], ["f32"], "f16")
    want = np.where(np.isnan(x), 0, np.clip(x, 0, 1)).astype(np.float16)
    np.testing.assert_array_equal(got.view(np.uint16)[2:], want.view(np.uint16)[2:])
    assert got[0] == 0
    h = rng.standard_normal(200).astype(np.float16)
    np.testing.assert_array_equal(
        run_map(backend, lambda k, a: k.cvt(T.f32, a), [h], ["f16"], "f32"), h.astype(np.float32))
    i = rng.integers(-2 ** 31, 2 ** 31, 200).astype(np.int32)
    np.testing.assert_array_equal(
        run_map(backend, lambda k, a: k.cvt(T.s64, a), [i], ["s32"], "s64"), i.astype(np.int64))
    np.testing.assert_array_equal(
        run_map(backend, lambda k, a: k.cvt(T.s16, a, sat=True), [i], ["s32"], "s16"),
        np.clip(i, -32768, 32767).astype(np.int16))
    np.testing.assert_array_equal(
        run_map(backend, lambda k, a: k.cvt(T.u16, a), [i], ["s32"], "u16"), i.astype(np.uint16))


def _exact(op, a, b=None, c=None):
    A = Fraction(float(a))
    if op == "add":
        return A + Fraction(float(b))
    if op == "sub":
        return A - Fraction(float(b))
    if op == "mul":
        return A * Fraction(float(b))
    if op == "div":
        return A / Fraction(float(b))
    return A * Fraction(float(b)) + Fraction(float(c))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "fma"])
def test_f32_arithmetic_every_mode(backend, op, mode, rng):
    n = 300
    a = f32_inputs(rng, n, -20, 20)[:n]
    b = f32_inputs(rng, n, -20, 20)[:n]
    # operands far apart: the exact sum needs more than float64's 53 bits
    b[:60] = (a[:60] * 2.0 ** -rng.integers(24, 90, 60)).astype(np.float32)
    c = -(a.astype(np.float64) * b).astype(np.float32)  # cancellation for fma
    c[::2] = f32_inputs(rng, n, -20, 20)[:n][::2]
    # products that are exact f32 midpoints, nudged by a tiny addend: rounding
    # the float64 sum again would give the wrong neighbour (double rounding)
    i, j = rng.integers(1, 4096, 60) | 1, rng.integers(1, 4096, 60) | 1
    sc = 2.0 ** rng.integers(-10, 10, 60)
    a[60:120] = ((1 + i * 2.0 ** -12) * sc).astype(np.float32)
    b[60:120] = ((1 + j * 2.0 ** -12) * rng.choice([-1, 1], 60)).astype(np.float32)
    c[60:120] = (rng.choice([-1, 1], 60) * sc * 2.0 ** -60).astype(np.float32)
    ins = [a, b, c] if op == "fma" else [a, b]
    if op == "fma":
        body = lambda k, x, y, z: k.fma(x, y, z, rnd=mode)  # noqa: E731
    else:
        body = lambda k, x, y: getattr(k, op)(x, y, rnd=mode)  # noqa: E731
    got = run_map(backend, body, ins, ["f32"] * len(ins), "f32")
    want = bits([ref_round(_exact(op, *v), "f32", mode) for v in zip(*ins)], "f32")
    np.testing.assert_array_equal(got_bits(got, "f32"), want)


@pytest.mark.parametrize("op", ["add", "mul", "fma"])
@pytest.mark.parametrize("ty", ["f16x2", "bf16x2", "f16"])
def test_half_arithmetic(backend, op, ty, rng):
    n = 200
    fmt = "bf16" if ty.startswith("bf") else "f16"
    lanes = 2 if ty.endswith("x2") else 1
    vals = [rng.standard_normal((n, lanes)) * 4 for _ in range(3)]
    hb = [bits([ref_round(float(v), fmt, "rn") for v in x.ravel()], fmt).reshape(n, lanes)
          for x in vals]
    if lanes == 2:
        packed = [(h[:, 0].astype(np.uint32) | (h[:, 1].astype(np.uint32) << 16)) for h in hb]
    else:
        packed = [h[:, 0].view(np.float16) for h in hb]
    if op == "fma":
        body = lambda k, x, y, z: k.fma(x, y, z)  # noqa: E731
        ins = packed
    else:
        body = lambda k, x, y: getattr(k, op)(x, y)  # noqa: E731
        ins = packed[:2]
    got = run_map(backend, body, ins, [ty] * len(ins), ty, target="sm_90")
    gb = np.asarray(got).view(np.uint32 if lanes == 2 else np.uint16)
    got_lanes = np.stack([gb & 0xFFFF, gb >> 16], 1) if lanes == 2 else gb[:, None]
    dec = (lambda h: float(np.uint16(h).view(np.float16))) if fmt == "f16" else \
        (lambda h: float(np.uint32(int(h) << 16).view(np.float32)))
    for i in range(n):
        for j in range(lanes):
            x = [Fraction(dec(h[i, j])) for h in hb]
            exact = {"add": x[0] + x[1], "mul": x[0] * x[1], "fma": x[0] * x[1] + x[2]}[op]
            want = bits([ref_round(exact, fmt, "rn")], fmt)[0]
            assert int(got_lanes[i, j]) == int(want), (op, ty, i, j, x)


@pytest.mark.parametrize("mode", ["rn", "rz", "rp"])
def test_sqrt_and_rcp(backend, mode, rng):
    from ptxgen.types import f32
    x = np.abs(f32_inputs(rng, 300, -30, 30))
    x = x[(x > 2.0 ** -120) & (x < 2.0 ** 120)]       # results stay finite and normal

    def body(k, a, op):
        d = k.reg(f32)
        k.emit(op, [mode], [f32], [d, a])
        return d
    for op in ("sqrt", "rcp"):
        got = run_map(backend, lambda k, a: body(k, a, op), [x], ["f32"], "f32").astype(np.float64)
        for v, r in zip(x.astype(np.float64), got):
            R, V = Fraction(float(r)), Fraction(float(v))
            up = Fraction(float(np.nextafter(np.float32(r), np.float32(np.inf))))
            dn = Fraction(float(np.nextafter(np.float32(r), np.float32(0))))
            if op == "rcp":
                want = ref_round(1 / V, "f32", mode)
                assert float(R) == want
            elif mode == "rz":                   # r^2 <= v < next(r)^2
                assert R * R <= V < up * up
            elif mode == "rp":                   # prev(r)^2 < v <= r^2
                assert dn * dn < V <= R * R
            else:                                # nearest
                assert ((R + dn) / 2) ** 2 <= V <= ((R + up) / 2) ** 2
