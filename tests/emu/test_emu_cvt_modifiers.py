"""Every ``cvt`` and ``mov`` form of the instruction table against an exact
oracle written here: Python integers and fractions (``ref_round``,
tests/emu/test_emu_rounding.py, for rounding to a float format).

cvt: float -> float rounds once to the destination with the rounding
modifier (``.rn`` to nearest even, ``.rz/.rm/.rp``), or to an integral
value of the same format with ``.rni/.rzi/.rmi/.rpi``; float -> integer
rounds with the integer rounding, saturates to the destination's range and
gives 0 for NaN (the ISA's rule; an H100 gives the destination's top bit
alone for a 64-bit destination or an f64 source, and so does the
emulator); integer -> float rounds like float -> float; integer ->
integer wraps (sign- or zero-extending by the source's signedness) or, with
``.sat``, clamps to the destination's range.  ``.sat`` on a float
destination clamps to [0, 1] (NaN to 0).  ``.ftz`` flushes an f32 subnormal
source and an f32 subnormal result to a signed zero.

Which forms exist is decided by tests/emu/isa_coverage.py (``not_ptx``,
checked against ptxas); the enumeration in test_emu_isa_coverage.py fails
on a table combination that is neither run here (``COVERED``) nor
elsewhere.  One kernel per source type runs every conversion from it over
128 values: the type's edges (zeros, infinities, NaN, subnormals, ties,
the limits of every destination) and seeded random ones.
"""

import math
from fractions import Fraction

import numpy as np
import pytest

import isa_coverage as IC
import ptxgen
from ptxgen import types as T
from test_emu_rounding import ref_round

N = 128
FLOATS = ("f16", "bf16", "f32", "f64")
_P_EMIN = {"f16": (11, -14), "bf16": (8, -126), "f32": (24, -126), "f64": (53, -1022)}
_IROUND = ("rni", "rzi", "rmi", "rpi")
_FROUND = ("rn", "rz", "rm", "rp")

COMBOS = sorted(c for c in IC.table_combos(["cvt"]) if not IC.not_ptx(*c))
MOVS = sorted(IC.table_combos(["mov"]))
COVERED = set(COMBOS) | set(MOVS)
SOURCES = sorted({c[2].split(".")[1] for c in COMBOS})


# ------------------------------------------------------------ encodings

def _ubits(ty):
    return 1 if ty == "pred" else T.type_by_name(ty).bits


def _udtype(ty):
    return np.dtype(f"u{max(_ubits(ty), 8) // 8}")


def _to_bits(x, fmt):
    """Python float (exactly representable in ``fmt``) -> its bit pattern."""
    if fmt == "f64":
        return int(np.float64(x).view(np.uint64))
    if fmt == "f32":
        return int(np.float32(x).view(np.uint32))
    if fmt == "f16":
        return int(np.float16(x).view(np.uint16))
    return int(np.float32(x).view(np.uint32)) >> 16


def _from_bits(b, fmt):
    if fmt == "f64":
        return float(np.uint64(b).view(np.float64))
    if fmt == "f32":
        return float(np.uint32(b).view(np.float32))
    if fmt == "f16":
        return float(np.uint16(b).view(np.float16))
    return float(np.uint32(b << 16).view(np.float32))


def _value(b, ty):
    """Bit pattern -> the value a cvt reads: float, or int (signed or not)."""
    if ty in FLOATS:
        return _from_bits(b, ty)
    t = T.type_by_name(ty)
    return b - (1 << t.bits) if t.is_signed and b >> (t.bits - 1) else b


def _bits_of(v, ty):
    if ty in FLOATS:
        return _to_bits(v, ty)
    return v & ((1 << T.type_by_name(ty).bits) - 1)


def _rep(x, fmt):
    """The ``fmt`` value nearest ``x`` (inputs must be representable)."""
    with np.errstate(all="ignore"):
        if fmt == "bf16":
            return _from_bits(_to_bits(float(np.float32(x)), "f32") >> 16, "bf16")
        return float({"f16": np.float16, "f32": np.float32, "f64": np.float64}[fmt](x))


# ------------------------------------------------------------ inputs

def _float_inputs(rng, fmt):
    p, emin = _P_EMIN[fmt]
    tiny = 2.0 ** (emin - p + 1)
    edges = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 0.5, -0.5, 1.5, 2.5, -2.5,
             3.5, 0.75, -0.25, tiny, -tiny, 2.0 ** emin - tiny, 3 * tiny, 2.0 ** emin,
             65504.0, 65520.0, -65536.0, 65519.0, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11,
             1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -24, 2.0 ** -24, 3 * 2.0 ** -26,
             2.0 ** -25, 2.0 ** -14 - 2.0 ** -25, 255.5, 256.0, -128.5, -129.0, 32767.5,
             32768.0, -32769.0, 65535.5, 65536.0, 2.0 ** 31, -(2.0 ** 31), 2.0 ** 31 - 0.5,
             2.0 ** 32, 2.0 ** 32 - 1, -(2.0 ** 31) - 1, 2.0 ** 63, -(2.0 ** 63), 2.0 ** 64,
             1e30, -1e30, 1.0000001e-39, 2.0 ** -130, 0.3, -0.7]
    vals = [_rep(x, fmt) for x in edges]
    width = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}[fmt]
    while len(vals) < N:
        r = rng.random()
        if r < 0.4:        # any bit pattern of the format
            b = int(rng.integers(0, 1 << min(width, 63))) | (int(rng.integers(0, 2)) << (width - 1))
            vals.append(_from_bits(b, fmt))
        elif r < 0.7:      # quarters: ties and fractions for the integer roundings
            vals.append(_rep(int(rng.integers(-4000, 4000)) / 4, fmt))
        else:              # wide magnitudes with long mantissas
            vals.append(_rep(float(rng.standard_normal()) * 2.0 ** int(rng.integers(-30, 70)), fmt))
    return vals


def _int_inputs(rng, ty):
    t = T.type_by_name(ty)
    lo, hi = (-(1 << (t.bits - 1)), (1 << (t.bits - 1)) - 1) if t.is_signed else (0, (1 << t.bits) - 1)
    edges = [0, 1, -1, lo, hi, lo + 1, hi - 1, 2049, 2051, 65504, 65519, 65520, 70000, 255, 256,
             -129, 32768, (1 << 24) + 1, (1 << 24) + 3, (1 << 53) + 1, (1 << 62) + 1,
             (1 << 31) - 64, 1 << 31, (1 << 32) - 1]
    vals = [v for v in edges if lo <= v <= hi]
    while len(vals) < N:
        if rng.random() < 0.5:
            vals.append(int(rng.integers(lo, hi, endpoint=True, dtype=np.int64 if t.is_signed
                                         else np.uint64)))
        else:
            vals.append(max(lo, min(hi, int(rng.integers(-300, 300)))))
    return vals


# ------------------------------------------------------------ the oracle

def _int_round(x, mode):
    """Float ``x`` rounded to an integral float with ``rni/rzi/rmi/rpi``."""
    if not math.isfinite(x):
        return x
    r = {"rni": round, "rzi": math.trunc, "rmi": math.floor, "rpi": math.ceil}[mode](x)
    return math.copysign(float(r), x) if r == 0 else float(r)


def _subnormal(x, fmt):
    return x != 0 and math.isfinite(x) and abs(x) < 2.0 ** _P_EMIN[fmt][1]


def _to_float(x, fmt, mode):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return x
    if x == 0:
        return math.copysign(0.0, x) if isinstance(x, float) else 0.0
    return ref_round(Fraction(x), fmt, mode)


def cvt_oracle(d, s, mods, x):
    """``cvt.mods.d.s`` of ``x`` (a float or an int) exactly."""
    frnd = next((m for m in mods if m in _FROUND), "rn")
    irnd = next((m for m in mods if m in _IROUND), None)
    if "ftz" in mods and s == "f32" and _subnormal(x, "f32"):
        x = math.copysign(0.0, x)
    if d in FLOATS:
        if irnd:
            x = _int_round(x, irnd)
        v = _to_float(x, d, frnd)
        if "ftz" in mods and d == "f32" and _subnormal(v, "f32"):
            v = math.copysign(0.0, v)
        if "sat" in mods:
            v = 0.0 if math.isnan(v) else min(1.0, max(0.0, v))
        return v
    t = T.type_by_name(d)
    lo, hi = (-(1 << (t.bits - 1)), (1 << (t.bits - 1)) - 1) if t.is_signed else (0, (1 << t.bits) - 1)
    if s in FLOATS:
        if math.isnan(x):
            # the ISA says 0; an H100 gives the destination's top bit alone
            # (INT_MIN, or 2^(n-1) unsigned) for a 64-bit destination or an
            # f64 source
            if t.bits == 64 or s == "f64":
                return lo if t.is_signed else 1 << (t.bits - 1)
            return 0
        if math.isinf(x):
            return hi if x > 0 else lo
        r = _int_round(x, irnd or "rzi")
        return max(lo, min(hi, int(r)))
    if "sat" in mods:
        return max(lo, min(hi, x))
    v = x & ((1 << t.bits) - 1)
    return v - (1 << t.bits) if t.is_signed and v >> (t.bits - 1) else v


def _same(got_bits, want, d, loose_zero):
    if d not in FLOATS:
        return got_bits == _bits_of(want, d)
    g = _from_bits(got_bits, d)
    if math.isnan(want):
        return math.isnan(g)
    if loose_zero and want == 0:
        return g == 0
    return got_bits == _to_bits(want, d)


# ------------------------------------------------------------ the kernels

def _cvt_kernel(src, combos):
    """``out_j[i] = cvt_j(x[i])`` for every combination j from ``src``."""
    m = ptxgen.Module("sm_90")
    sty = T.type_by_name(src)
    with m.kernel("cvts") as k:
        xp = k.param_ptr("x", T.type_by_name(f"u{sty.bits}"))
        outs = [k.param_ptr(f"o{j}", T.type_by_name(f"u{max(_ubits(c[2].split('.')[0]), 8)}"))
                for j, c in enumerate(combos)]
        n = k.param("n", T.u32)
        i = k.global_id()
        with k.if_(i < n):
            raw = k.ld(xp[i])
            x = raw if raw.type is sty else k.bitcast(sty, raw)
            for (op, mod, ty), o in zip(combos, outs):
                tys = IC.type_tuple(ty)
                d = IC.emit_combo(k, op, IC.emitted_mods(op, mod, ty), tys, [x])
                k.st(o[i], d if d.type.name.startswith("u") else
                     k.bitcast(T.type_by_name(f"u{d.type.bits}"), d))
    return m


@pytest.mark.parametrize("src", SOURCES)
def test_cvt_from(backend, src, rng):
    combos = [c for c in COMBOS if c[2].split(".")[1] == src]
    xs = _float_inputs(rng, src) if src in FLOATS else _int_inputs(rng, src)
    xbits = np.array([_bits_of(x, src) for x in xs], _udtype(src))
    mod = backend.load(_cvt_kernel(src, combos))
    outs = [backend.poisoned(N, _udtype(c[2].split(".")[0])) for c in combos]
    backend.launch_positional(mod["cvts"], (N + 63) // 64, 64, backend.array(xbits), *outs, N)
    bad = []
    for (op, m, ty), out in zip(combos, outs):
        d = ty.split(".")[0]
        mods = IC.emitted_mods(op, m, ty)
        got = out.to_numpy().tolist()
        for x, xb, g in zip(xs, xbits.tolist(), got):
            want = cvt_oracle(d, src, mods, _value(xb, src))
            if not _same(g, want, d, "sat" in mods):
                bad.append((".".join(["cvt", *mods, ty]), x, hex(g), want))
    assert not bad, f"{len(bad)} wrong conversions, first: {bad[:8]}"


def test_mov_every_type(backend, rng):
    """mov of each type copies its bits; mov.b32/.b64 pack and unpack."""
    m = ptxgen.Module("sm_90")
    with m.kernel("movs") as k:
        x = k.param_ptr("x", T.u64)
        o = k.param_ptr("o", T.u64)
        i = k.global_id()
        v = k.ld(x[i])
        lo32, hi32 = k.unpack(v, T.b32)
        j = 0
        for _, _, ty in MOVS:
            t = T.type_by_name(ty)
            if t is T.pred:
                src = k.setp("ne", k.bitcast(T.u32, lo32), 0)
                d = k.reg(t)
                k.emit("mov", [], [t], [d, src])
                r = k.select(d, k.const(T.u64, 1), k.const(T.u64, 0))
            else:
                w = k.bitcast(T.u64, k.pack(T.b64, lo32, hi32))
                src = w if t.bits == 64 else k.cvt(T.type_by_name(f"u{t.bits}"), w)
                src = k.bitcast(t, src) if src.type is not t else src
                d = k.reg(t)
                k.emit("mov", [], [t], [d, src])
                u = d if d.type.name == f"u{t.bits}" else k.bitcast(T.type_by_name(f"u{t.bits}"), d)
                r = u if t.bits == 64 else k.cvt(T.u64, u)
            k.st(o[i * len(MOVS) + j], r)
            j += 1
    xs = rng.integers(0, 2 ** 63, 64, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    xs[:4] = [0, 1 << 63, 0xFFFF_FFFF, 0xFFFF_0000_0000_0000]
    out = backend.poisoned(64 * len(MOVS), np.uint64)
    backend.launch_positional(backend.load(m)["movs"], 1, 64, backend.array(xs), out)
    got = out.to_numpy().reshape(64, len(MOVS))
    for j, (_, _, ty) in enumerate(MOVS):
        bits = _ubits(ty)
        for x, g in zip(xs.tolist(), got[:, j].tolist()):
            want = int(x & 0xFFFF_FFFF != 0) if ty == "pred" else x & ((1 << bits) - 1)
            assert g == want, (ty, hex(x), hex(g))


def test_oracle_spot_values():
    """The oracle on values worked out by hand (ties to even, saturation,
    NaN, sign extension), so a wrong oracle cannot pass with a wrong
    emulator."""
    assert cvt_oracle("s32", "f32", ["rni"], 2.5) == 2
    assert cvt_oracle("s32", "f32", ["rni"], -3.5) == -4
    assert cvt_oracle("u16", "f32", ["rzi"], -7.9) == 0
    assert cvt_oracle("s16", "f64", ["rpi"], 40000.2) == 32767
    assert cvt_oracle("u32", "f32", ["rzi"], math.nan) == 0
    assert cvt_oracle("u64", "f16", ["rmi"], math.nan) == 1 << 63
    assert cvt_oracle("s16", "f64", ["rni"], math.nan) == -(1 << 15)
    assert cvt_oracle("f16", "f32", ["rn"], 65520.0) == math.inf
    assert cvt_oracle("f16", "f32", ["rz"], 65520.0) == 65504.0
    assert cvt_oracle("f16", "f32", ["rn"], 1 + 2.0 ** -11) == 1.0
    assert cvt_oracle("f16", "f32", ["rp"], 1 + 2.0 ** -24) == 1 + 2.0 ** -10
    assert cvt_oracle("f32", "s32", ["rn"], (1 << 24) + 3) == float((1 << 24) + 4)
    assert cvt_oracle("f32", "s32", ["rm"], -((1 << 24) + 1)) == -float((1 << 24) + 2)
    assert cvt_oracle("s64", "s16", [], -2) == -2
    assert cvt_oracle("u64", "s16", [], -2) == (1 << 64) - 2
    assert cvt_oracle("u16", "s32", ["sat"], -5) == 0
    assert cvt_oracle("s16", "u32", ["sat"], 40000) == 32767
    assert cvt_oracle("u16", "s32", [], 70000) == 70000 - 65536
    assert cvt_oracle("f32", "f32", ["rpi", "ftz"], 1e-40) == 0.0
    assert cvt_oracle("f32", "f32", ["rpi"], 1e-40) == 1.0
    assert cvt_oracle("f32", "f64", ["rn", "sat"], 1.5) == 1.0
    assert math.copysign(1, cvt_oracle("f32", "f32", ["rni"], -0.3)) < 0
