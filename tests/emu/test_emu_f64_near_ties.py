"""Rounding modifiers on f64 sources where rounding twice would go wrong,
against exact rationals (``ref_round``, tests/emu/test_emu_rounding.py).

Random f64 inputs almost never come this close to a rounding boundary, so
the inputs are built to:

* ``fma.{rn,rz,rm,rp}.f64`` whose product's low part is tiny next to a
  sum that is exactly a midpoint between two f64 values: ``a * b = ph + pl``
  with ``ph + c`` a midpoint and ``|pl|`` at most ``2^-104 |ph| ...``; the
  exact result lies just off the midpoint, on ``pl``'s side.  Rounding the
  low parts to nearest before the final rounding lands on the midpoint and
  goes to even (half of these cases wrong); the emulator must round once.
* ``cvt.{rn,rz,rm,rp}.{f16,bf16,f32}.f64`` of values a hair (below f32's
  resolution) off a midpoint or a grid point of the destination: through
  f32 first, they would land on the midpoint or the grid point.

The backend fixture runs both on the GPU as well.
"""

import math
from fractions import Fraction

import numpy as np
import pytest

from backends import run_map
from ptxgen import types as T
from test_emu_rounding import _FMT, bits, got_bits, ref_round

MODES = ["rn", "rz", "rm", "rp"]


def _rn64(x):
    """Rational ``x`` rounded to the nearest f64, ties to even."""
    return Fraction(ref_round(x, "f64", "rn"))


def fma_near_ties(rng, n):
    """``n`` triples (a, b, c) of f64 (as Fractions): ``a*b = ph + pl``
    exactly with ``ph + c`` a midpoint between two f64 values (binade
    ``[2^k, 2^(k+1))``, k = 2..4, before scaling) and ``|pl| <=
    2^(k-106)``: half an ulp of the sum's rounding error or less.  Random
    signs (``c`` with the product's sign) and power-of-two scalings."""
    out = []
    while len(out) < n:
        k = int(rng.integers(2, 5))
        big_a = 2 * int(rng.integers(1 << 51, 1 << 52)) + 1          # odd, in [2^52, 2^53)
        lo = int(rng.integers(1, (1 << (k - 2)) + 1)) * int(rng.choice([-1, 1]))
        mod = 1 << (k + 52)
        # a*b*2^104 = (an odd multiple of 2^(k+51)) + lo
        big_b = ((1 << (k + 51)) + lo) * pow(big_a, -1, mod) % mod
        if not (1 << 52) <= big_b < (1 << 53):
            continue
        ph = Fraction(big_a * big_b - lo, 1 << 104)
        c = Fraction(int(rng.integers(1 << 52, 1 << 53)), 1 << (52 - k))
        if not 2 ** k <= ph + c < 2 ** (k + 1):
            continue
        a, b = Fraction(big_a, 1 << 52), Fraction(big_b, 1 << 52)
        assert a * b - ph == Fraction(lo, 1 << 104) and _rn64(a * b) == ph
        sa, sb = (int(rng.choice([-1, 1])) for _ in range(2))
        p, q = (int(rng.integers(-40, 41)) for _ in range(2))
        out.append((sa * a * Fraction(2) ** p, sb * b * Fraction(2) ** q,
                    sa * sb * c * Fraction(2) ** (p + q)))
    return out


def _double_rounded_fma(a, b, c):
    """What rounding the low part to nearest first gives: ``RN(s1 +
    RN(e1 + pl))`` with ``s1 = RN(ph + c)``."""
    ph = _rn64(a * b)
    pl = a * b - ph
    s1 = _rn64(ph + c)
    return _rn64(s1 + _rn64((ph + c - s1) + pl))


@pytest.mark.parametrize("mode", MODES)
def test_fma_f64_rounds_once(backend, mode, rng):
    n = 192
    cases = fma_near_ties(rng, n)
    exact = [a * b + c for a, b, c in cases]
    # the inputs do what they are for: rounding twice is wrong in many of them
    wrong = sum(_double_rounded_fma(*t) != _rn64(e) for t, e in zip(cases, exact))
    assert wrong >= n // 8, wrong
    ins = [np.array([float(t[j]) for t in cases], np.float64) for j in range(3)]
    assert all(Fraction(float(v)) == t[j] for j in range(3) for v, t in zip(ins[j], cases))
    ty = T.f64

    def body(k, x, y, z):
        d = k.reg(ty)
        k.emit("fma", [mode], [ty], [d, x, y, z])
        return d
    got = run_map(backend, body, ins, ["f64"] * 3, "f64")
    want = bits([ref_round(e, "f64", mode) for e in exact], "f64")
    bad = np.flatnonzero(got_bits(got, "f64") != want)
    assert bad.size == 0, [(cases[i], float(got[i]), float(np.uint64(want[i]).view(np.float64)))
                           for i in bad[:3]]


def _ulp(g, fmt):
    """The spacing of ``fmt``'s values at ``g`` (a value of ``fmt``)."""
    p, emin, _ = _FMT[fmt]
    e = emin if g == 0 else max(math.frexp(float(g))[1] - 1, emin)
    return Fraction(2) ** (e - p + 1)


def cvt_near_ties(rng, fmt, n):
    """f64 values at a midpoint of ``fmt`` (or at one of its values), or
    off it by ``2^-j`` of its ulp, too little for f32 to resolve."""
    p, emin, emax = _FMT[fmt]
    out = []
    while len(out) < n:
        e = int(rng.integers(emin - p + 1, min(emax, 40)))          # subnormals too
        g = Fraction(int(rng.integers(1 << (p - 1), 1 << p)), 1 << (p - 1)) * Fraction(2) ** e
        g = Fraction(ref_round(g, fmt, "rz"))                       # a value of fmt
        ulp = _ulp(g, fmt)
        base = g + ulp / 2 if rng.random() < 0.7 else g             # midpoint, or grid point
        # f32 resolves 2^-(25-p) of fmt's ulp: j past that (halves)
        j = int(rng.integers(26 - p if fmt != "f32" else 2, 53 - p))
        off = int(rng.choice([-1, 0, 1]))
        x = (base + off * ulp * Fraction(1, 1 << j)) * int(rng.choice([-1, 1]))
        if Fraction(float(x)) == x and abs(x) < 2 ** emax:
            out.append(x)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dst", ["f16", "bf16", "f32"])
def test_cvt_from_f64_rounds_once(backend, dst, mode, rng):
    n = 256
    xs = cvt_near_ties(rng, dst, n)
    if dst != "f32":
        via32 = sum(ref_round(Fraction(float(np.float32(float(x)))), dst, "rn")
                    != ref_round(x, dst, "rn") for x in xs)
        assert via32 >= n // 8, via32
    x = np.array([float(v) for v in xs], np.float64)
    got = run_map(backend, lambda k, a: k.cvt(dst, a, rnd=mode), [x], ["f64"], dst)
    want = bits([ref_round(v, dst, mode) for v in xs], dst)
    bad = np.flatnonzero(got_bits(got, dst) != want)
    assert bad.size == 0, [(float(xs[i]), hex(int(got_bits(got, dst)[i])), hex(int(want[i])))
                           for i in bad[:4]]
