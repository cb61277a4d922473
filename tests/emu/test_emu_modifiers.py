"""Every float (opcode, modifier, type) of the instruction table against an
exact oracle: rounding modes, ``.ftz`` (inputs and results), ``.sat``,
``.relu``, ``.NaN``, and the ``.approx``/``.full`` forms within the PTX
ISA's error bounds (plus the exact values ``.ftz`` forces).

Oracles: exact rational arithmetic rounded by ``ref_round``
(tests/emu/test_emu_rounding.py) for add/sub/mul/fma/div/rcp, an exact
bracket for sqrt, IEEE rules written out for neg/abs/min/max, numpy float64
with the ISA's bounds for the approximate functions.  Which combinations
exist is decided by tests/emu/float_modifiers.py;
``test_every_float_combination_is_tested`` fails on a table combination
that is neither run here nor named there as one PTX does not define.
"""

import math
from fractions import Fraction

import numpy as np
import pytest

import float_modifiers as FM
import isa_coverage as IC
from backends import run_map
from ptxgen import types as T
from test_emu_rounding import ref_round

_FMT = {"f32": (24, -126), "f64": (53, -1022), "f16": (11, -14), "bf16": (8, -126)}


def _fmt(ty):
    return {"f16x2": "f16", "bf16x2": "bf16"}.get(ty, ty)


def _lanes(ty):
    return 2 if ty.endswith("x2") else 1


def _subnormal(x, fmt):
    return x != 0 and math.isfinite(x) and abs(x) < 2.0 ** _FMT[fmt][1]


def _flush(x, fmt):
    return math.copysign(0.0, x) if _subnormal(x, fmt) else x


# ---------------------------------------------------------------- encodings

def to_bits(vals, fmt):
    v = np.asarray(vals, np.float64)
    if fmt == "f16":
        return v.astype(np.float16).view(np.uint16)
    if fmt == "bf16":
        return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if fmt == "f32":
        return v.astype(np.float32).view(np.uint32)
    return v.view(np.uint64)


def from_bits(b, fmt):
    b = np.asarray(b)
    if fmt == "f16":
        return b.astype(np.uint16).view(np.float16).astype(np.float64)
    if fmt == "bf16":
        return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if fmt == "f32":
        return b.astype(np.uint32).view(np.float32).astype(np.float64)
    return b.astype(np.uint64).view(np.float64)


def pack(lanes_vals, ty):
    """float64 lane values [n, lanes] -> the array run_map takes for ``ty``."""
    fmt = _fmt(ty)
    b = [to_bits(lanes_vals[:, j], fmt) for j in range(lanes_vals.shape[1])]
    if ty.endswith("x2"):
        return b[0].astype(np.uint32) | (b[1].astype(np.uint32) << 16)
    if ty == "bf16":
        return b[0]
    return from_bits(b[0], fmt).astype({"f16": np.float16, "f32": np.float32,
                                        "f64": np.float64}[fmt])


def unpack(arr, ty):
    fmt = _fmt(ty)
    a = np.asarray(arr)
    if ty.endswith("x2"):
        u = a.view(np.uint32)
        return np.stack([from_bits(u & 0xFFFF, fmt), from_bits(u >> 16, fmt)], 1)
    if ty == "bf16":
        return from_bits(a.view(np.uint16), fmt)[:, None]
    return a.astype(np.float64)[:, None]


# ---------------------------------------------------------------- inputs

def values(rng, fmt, n, kinds):
    """``n`` values of ``fmt`` (float64), drawn from ``kinds``: "mid"
    (|x| in [2^-6, 2^6]), "unit" ([0, 1.5]), "low" (just above the smallest
    normal), "half" (about its square root: products underflow), "sub"
    (subnormals), "nan"."""
    p, emin = _FMT[fmt]
    out = np.empty(n)
    pick = rng.choice(list(kinds), n)
    for i, kind in enumerate(pick):
        frac = 1 + int(rng.integers(0, 2 ** (p - 1))) / 2 ** (p - 1)
        sign = -1.0 if rng.random() < 0.5 else 1.0
        if kind == "mid":
            v = sign * frac * 2.0 ** int(rng.integers(-6, 7))
        elif kind == "unit":
            v = frac * 2.0 ** int(rng.integers(-3, 1)) * (sign if rng.random() < .3 else 1.0)
        elif kind == "low":
            v = sign * frac * 2.0 ** (emin + int(rng.integers(0, 2)))
        elif kind == "half":
            v = sign * frac * 2.0 ** (emin // 2 + int(rng.integers(-3, 3)))
        elif kind == "sub":
            v = sign * int(rng.integers(1, 2 ** (p - 1))) * 2.0 ** (emin - p + 1)
        else:
            v = math.nan
        out[i] = v
    return from_bits(to_bits(out, fmt), fmt)       # exactly representable


# ---------------------------------------------------------------- oracles

def _zero_sign_add(x, y, mode):
    if x == 0 and y == 0:
        both_neg = math.copysign(1, x) < 0 and math.copysign(1, y) < 0
        any_neg = math.copysign(1, x) < 0 or math.copysign(1, y) < 0
        return -0.0 if (any_neg if mode == "rm" else both_neg) else 0.0
    return -0.0 if mode == "rm" else 0.0


def exact_op(op, mode, fmt, xs):
    """Correctly rounded ``op`` of finite-or-NaN float64 inputs ``xs``."""
    if any(math.isnan(x) for x in xs):
        return math.nan
    if op == "sub":
        op, xs = "add", [xs[0], -xs[1]]
    F = [Fraction(x) for x in xs]
    if op == "add":
        e = F[0] + F[1]
        return ref_round(e, fmt, mode) if e != 0 else _zero_sign_add(xs[0], xs[1], mode)
    if op == "mul":
        e = F[0] * F[1]
        return ref_round(e, fmt, mode) if e != 0 else math.copysign(0.0, xs[0] * 0 + 1) * \
            math.copysign(1, xs[0]) * math.copysign(1, xs[1]) * 0.0
    if op == "fma":
        e = F[0] * F[1] + F[2]
        if e != 0:
            return ref_round(e, fmt, mode)
        prod = math.copysign(0.0, math.copysign(1, xs[0]) * math.copysign(1, xs[1])) \
            if F[0] * F[1] == 0 else 1.0
        return _zero_sign_add(prod, xs[2], mode) if prod == 0 else (-0.0 if mode == "rm" else 0.0)
    if op == "div":
        if F[1] == 0:
            return math.nan if F[0] == 0 else math.copysign(math.inf, xs[0]) * math.copysign(1, xs[1])
        e = F[0] / F[1]
        return ref_round(e, fmt, mode) if e != 0 else \
            math.copysign(0.0, math.copysign(1, xs[0]) * math.copysign(1, xs[1]))
    if op == "rcp":
        if F[0] == 0:
            return math.copysign(math.inf, xs[0])
        return ref_round(1 / F[0], fmt, mode)
    raise AssertionError(op)


def _post(r, fmt, mods):
    if "ftz" in mods and fmt != "f64":
        r = _flush(r, fmt)
    if "sat" in mods:
        r = 0.0 if math.isnan(r) else min(1.0, max(0.0, r))
    if "relu" in mods and not math.isnan(r) and r < 0:
        r = 0.0
    return r


def minmax(op, x, y, nan_mod):
    if math.isnan(x) or math.isnan(y):
        if nan_mod or (math.isnan(x) and math.isnan(y)):
            return math.nan
        return y if math.isnan(x) else x
    if x == y == 0:
        neg = [math.copysign(1, v) < 0 for v in (x, y)]
        pick_neg = any(neg) if op == "min" else all(neg)
        return -0.0 if pick_neg else 0.0
    return min(x, y) if op == "min" else max(x, y)


def same(got, want, loose_zero=False):
    if math.isnan(want):
        return math.isnan(got)
    if got != want:
        return False
    return loose_zero or want != 0 or math.copysign(1, got) == math.copysign(1, want)


# approximate forms: (domain kinds, float64 function, relative bound, absolute bound).
# sin/cos: the ISA bounds the absolute error by 2^-20.5 on [-pi, pi] and by
# 2^-14.7 on [-100 pi, 100 pi] (the hardware reduces the argument in f32:
# about |x| * 2^-24 of error); _sincos_bound picks by |x|.  rsqrt.approx.ftz.f64
# reads the 1.11.20 high word of its input and writes one (the low 32 bits
# of the result are zero): 2^-21 from the dropped input bits, 2^-20 from
# the dropped result bits, 2^-22.9 of the f32-class approximation, < 2^-19.
_APPROX = {
    "rcp": (("mid",), lambda v: 1 / v, 2.0 ** -23, 0.0),
    "sqrt": (("mid", "unit"), math.sqrt, 2.0 ** -23, 0.0),
    "rsqrt": (("mid", "unit"), lambda v: 1 / math.sqrt(v), 2.0 ** -22, 0.0),
    "ex2": (("mid", "unit"), lambda v: 2.0 ** v, 2.0 ** -22, 0.0),
    "lg2": (("mid", "unit", "sub"), math.log2, 2.0 ** -22, 2.0 ** -22),
    "sin": (("mid", "unit"), math.sin, 0.0, 2.0 ** -20.5),
    "cos": (("mid", "unit"), math.cos, 0.0, 2.0 ** -20.5),
    "tanh": (("mid", "unit"), math.tanh, 2.0 ** -10.9, 0.0),
    "div": (("mid",), None, 2.0 ** -22, 0.0),
}
_RSQRT_F64_FTZ = 2.0 ** -19
#: beyond 100 pi the ISA gives sin/cos.approx no bound: only |d| <= 1 is checked
_SINCOS_FAR = (1e3, 3e4, 1e5, -2e3, -7e4, 4.5e5)


def _sincos_bound(x):
    if abs(x) <= math.pi:
        return 2.0 ** -20.5
    return 2.0 ** -14.7 if abs(x) <= 100 * math.pi else None


_AT_ZERO = {"rcp": math.inf, "sqrt": 0.0, "rsqrt": math.inf, "ex2": 1.0, "lg2": -math.inf,
            "sin": 0.0, "cos": 1.0, "tanh": 0.0}


def emitted_mods(op, mod):
    """The modifiers the test emits for the combination: ``mod`` plus the
    rounding or ``.approx`` an instruction needs to exist."""
    if mod == "ftz" and op in ("rcp", "sqrt", "rsqrt") + FM.APPROX_ONLY:
        return ["approx", "ftz"]
    if mod in ("ftz", "sat", "relu") and op == "fma" or mod == "ftz" and op == "div":
        return ["rn", mod]
    return [mod] if mod else []


ARITY = {"add": 2, "sub": 2, "mul": 2, "fma": 3, "div": 2, "min": 2, "max": 2}
COMBOS = sorted(FM.table_combos() - set(FM.NOT_PTX))
COVERED = set(COMBOS)


def _target(ty):
    return "sm_90"


@pytest.mark.parametrize("op,mod,ty", COMBOS, ids=lambda v: v or "-")
def test_float_combination(backend, op, mod, ty, rng):
    fmt, lanes = _fmt(ty), _lanes(ty)
    mods = emitted_mods(op, mod)
    n = 96
    approx = "approx" in mods or "full" in mods or op in FM.APPROX_ONLY
    ar = ARITY.get(op, 1)
    if approx:
        kinds = _APPROX[op][0] + (("sub",) if "ftz" in mods else ())
    elif op in ("min", "max"):
        kinds = ("mid", "sub", "nan", "unit")
    elif op in ("sqrt",):
        kinds = ("mid", "unit", "sub")
    else:
        kinds = ("mid", "unit", "low", "half", "sub")
    if fmt == "f64" and not approx and op not in ("neg", "abs", "min", "max"):
        # the emulator's f64 forms other than native .rn are error-free
        # transforms in float64, which lose the remainder when a product or
        # residual leaves float64's normal range: f64 inputs stay within
        # [2^-6, 2^6] here (a known limit, docs/emulator.md)
        kinds = ("mid", "unit")
    ins = [np.stack([values(rng, fmt, n, kinds) for _ in range(lanes)], 1) for _ in range(ar)]
    if op in ("div", "rcp") and approx:
        ins[-1] = np.abs(ins[-1]) * np.where(rng.random((n, lanes)) < .5, -1, 1)
    if op == "ex2" and "ftz" in mods:
        ins[0][:8] = -float(rng.integers(127, 140))   # results that are subnormal
    if op in ("lg2", "rsqrt", "sqrt") and approx:
        ins[0] = np.abs(ins[0])
    if op in ("sin", "cos"):                # far outside the ISA's bounded range
        ins[0][-len(_SINCOS_FAR):, 0] = from_bits(to_bits(_SINCOS_FAR, fmt), fmt)
    ty_ = T.type_by_name(ty)

    def body(k, *regs):
        d = k.reg(ty_)
        k.emit(op, mods, [ty_], [d, *regs])
        return d
    got = unpack(run_map(backend, body, [pack(x, ty) for x in ins], [ty] * ar, ty,
                         target=_target(ty)), ty)
    mode = next((m for m in mods if m in FM.ROUND), "rn")
    for i in range(n):
        for j in range(lanes):
            xs = [float(x[i, j]) for x in ins]
            g = float(got[i, j])
            if "ftz" in mods:              # f64 too: rcp/rsqrt.approx.ftz.f64
                xs = [_flush(x, fmt) for x in xs]
            where = (op, mods, ty, [float(x[i, j]) for x in ins], g)
            if approx:
                fn, rel, ab = _APPROX[op][1:]
                if "ftz" in mods and (xs[-1] == 0 or op == "ex2" and _subnormal(2.0 ** xs[0], fmt)):
                    if op == "div":
                        continue          # a zero divisor: no bound, checked elsewhere
                    w = 0.0 if op == "ex2" and xs[0] != 0 else _AT_ZERO[op]
                    if op in ("rcp", "rsqrt", "sin", "tanh", "sqrt"):
                        w = math.copysign(w, xs[0])     # odd at zero: the flushed sign
                    assert same(g, w, loose_zero=True), where
                    continue
                w = xs[0] / xs[1] if op == "div" else fn(xs[0])
                if op in ("sin", "cos"):
                    ab = _sincos_bound(xs[0])
                    if ab is None:
                        assert math.isfinite(g) and abs(g) <= 1.0, where
                        continue
                elif op == "rsqrt" and fmt == "f64":
                    rel = _RSQRT_F64_FTZ
                ok = abs(g - w) <= (rel + 2.0 ** -24) * abs(w) + ab + 2.0 ** -149
                assert ok and not ("ftz" in mods and _subnormal(g, fmt)), where
            elif op in ("neg", "abs"):
                w = -xs[0] if op == "neg" else abs(xs[0])
                assert same(g, w), where
            elif op in ("min", "max"):
                assert same(g, minmax(op, xs[0], xs[1], "NaN" in mods)), where
            elif op == "sqrt":
                v = xs[0]
                if v < 0:
                    assert math.isnan(g), where
                    continue
                R = Fraction(g)
                tiny = 2.0 ** (_FMT[fmt][1] - _FMT[fmt][0] + 1)
                up, dn = Fraction(g + tiny * 0) + Fraction(math.ulp(g) if fmt == "f64" else
                                                            float(np.spacing(np.float32(g)))), None
                dn = R - Fraction(math.ulp(g) if fmt == "f64" else float(np.spacing(np.float32(g))))
                V = Fraction(v)
                if mode in ("rz", "rm"):
                    assert R * R <= V < up * up, where
                elif mode == "rp":
                    assert dn * dn < V <= R * R, where
                else:
                    assert ((R + dn) / 2) ** 2 <= V <= ((R + up) / 2) ** 2, where
            else:
                w = _post(exact_op(op, mode, fmt, xs), fmt, mods)
                assert same(g, w, loose_zero="sat" in mods or "relu" in mods), where


def test_every_float_combination_is_tested():
    allowed = FM.table_combos()
    missing = sorted(allowed - COVERED - set(FM.NOT_PTX))
    assert not missing, f"table combinations with no test: {missing}"
    assert not COVERED & set(FM.NOT_PTX)
    assert COVERED <= allowed
    assert all(FM.NOT_PTX.values())


def _ptx_of(combos):
    """One sm_90 kernel holding an instruction of each combination."""
    import ptxgen
    m = ptxgen.Module("sm_90")
    with m.kernel("combos") as k:
        ptrs = {ty: k.param_ptr(f"p_{ty}", T.type_by_name(ty)) for ty in FM.FLOAT_TYPES}
        for op, mod, ty in combos:
            t = T.type_by_name(ty)
            srcs = [k.ld(ptrs[ty][j]) for j in range(ARITY.get(op, 1))]
            d = k.reg(t)
            k.emit(op, emitted_mods(op, mod), [t], [d, *srcs])
            k.st(ptrs[ty][0], d)
    return m.to_ptx()


def test_ptxas_agrees_with_the_split(ptxas):
    """ptxas assembles every tested form (all in one kernel) and refuses
    each form named as not PTX (or the builder already does), so neither
    list hides a mistake."""
    from ptxgen.ptxas import assemble
    assemble(_ptx_of(COMBOS), "sm_90")
    accepted = IC.ptxas_takes(sorted(FM.NOT_PTX), lambda c: _ptx_of([c]), (TypeError,))
    assert not accepted, f"named as not PTX, but ptxas takes them: {accepted}"
