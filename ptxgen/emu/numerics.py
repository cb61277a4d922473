"""Exact floating-point rounding for the emulator, vectorised with numpy.

Every float result is obtained as an exact value, or as a float64 ``s``
together with the sign of the exact remainder (``exact - s``), and then
rounded once to the destination format with the instruction's rounding mode:

* ``round_to_odd(s, dir)`` folds the remainder's sign into the last bit of
  ``s`` (round-to-odd at 53 bits).  Rounding that value to any format of at
  most 51 significant bits, in any mode, gives the correctly rounded result
  of the exact value (Boldo & Melquiond).  f16, bf16 and f32 qualify.
* ``round_format(x, fmt, mode)`` rounds float64 ``x`` to f16, bf16 or f32
  (subnormals, overflow to inf or to the largest finite value per mode).
* ``adjust64(s, dir, mode)`` gives directed rounding of f64 results from the
  RN result and the remainder's sign.

The error-free transformations (``two_sum``, ``two_prod``) give those
remainders for add/sub/mul/fma, and residuals give them for div and sqrt.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FORMATS", "round_to_odd", "round_format", "round_int", "adjust64",
           "two_sum", "two_prod", "f16_to_f64", "bf16_to_f32", "f64_to_f16_bits",
           "f64_to_bf16_bits", "flush32", "flush_half", "float_result",
           "sign_dir", "fma_pair"]

# name -> (significand bits incl. the implicit one, emin, emax)
FORMATS = {"f16": (11, -14, 15), "bf16": (8, -126, 127), "f32": (24, -126, 127),
           "f64": (53, -1022, 1023)}

_ROUND = {"rn": np.rint, "rz": np.trunc, "rm": np.floor, "rp": np.ceil,
          "rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}

_F32_TINY = np.float32(2.0 ** -126)


def sign_dir(x):
    """-1, 0 or +1 as float64 (the direction of a remainder)."""
    return np.sign(x).astype(np.float64)


def round_to_odd(s, direction):
    """Fold the sign of the remainder ``direction`` into ``s`` (float64)."""
    if direction is None:
        return s
    s = np.asarray(s, dtype=np.float64)
    d = np.broadcast_to(np.asarray(direction, dtype=np.float64), s.shape)
    even = (s.view(np.uint64) & np.uint64(1)) == 0
    nudge = (d != 0) & even & np.isfinite(s)
    if not nudge.any():
        return s
    step = np.nextafter(s, np.where(d > 0, np.inf, -np.inf))
    return np.where(nudge, step, s)


def round_int(x, mode):
    """Round float64 ``x`` to an integral float64 value (rni/rzi/rmi/rpi)."""
    return _ROUND[mode](x)


def round_format(x, fmt, mode="rn"):
    """Round float64 ``x`` to the values of ``fmt`` (returned as float64)."""
    p, emin, emax = FORMATS[fmt]
    x = np.asarray(x, dtype=np.float64)
    _, e = np.frexp(x)
    exp = np.maximum(e.astype(np.int64) - 1, emin)
    scale = np.ldexp(1.0, (exp - (p - 1)).astype(np.int32))
    r = _ROUND[mode](x / scale) * scale
    maxf = (2.0 - 2.0 ** (1 - p)) * 2.0 ** emax
    over = (np.abs(r) > maxf) & np.isfinite(x)
    if over.any():
        neg = x < 0
        if mode in ("rn", "rni"):
            big = np.inf
            r = np.where(over, np.where(neg, -big, big), r)
        elif mode in ("rz", "rzi"):
            r = np.where(over, np.where(neg, -maxf, maxf), r)
        elif mode in ("rm", "rmi"):
            r = np.where(over, np.where(neg, -np.inf, maxf), r)
        else:
            r = np.where(over, np.where(neg, -maxf, np.inf), r)
    return r


def adjust64(q, direction, mode):
    """Directed rounding of an f64 result ``q`` (RN) whose exact value lies
    in ``direction`` (-1, 0, +1) from it."""
    if mode == "rn" or direction is None:
        return q
    d = np.broadcast_to(np.asarray(direction), np.shape(q))
    if mode == "rz":
        move = (d != 0) & (np.sign(d) != np.sign(q)) & (q != 0)
        target = 0.0
        return np.where(move, np.nextafter(q, target), q)
    if mode == "rm":
        return np.where(d < 0, np.nextafter(q, -np.inf), q)
    return np.where(d > 0, np.nextafter(q, np.inf), q)


def two_sum(a, b):
    """``s = fl(a+b)`` and the exact error ``e`` with ``a + b = s + e``."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, np.where(np.isfinite(s), e, 0.0)


def _split(a):
    c = 134217729.0 * a
    hi = c - (c - a)
    return hi, a - hi


def two_prod(a, b):
    """``p = fl(a*b)`` and the exact error ``e`` (Dekker, no FMA needed)."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    e = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    return p, np.where(np.isfinite(p), e, 0.0)


def fma_pair(a, b, c):
    """``a*b + c`` in float64 as ``(s, dir)``: ``s`` its RN value (correctly
    rounded except in pathological cancellations of f64 inputs) and ``dir``
    the sign of the remainder."""
    ph, pl = two_prod(a, b)
    s1, e1 = two_sum(ph, c)
    t, e3 = two_sum(e1, pl)
    t = round_to_odd(t, sign_dir(e3))
    s, e2 = two_sum(s1, t)
    return s, sign_dir(e2 + e3)


def f16_to_f64(bits):
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float64)


def bf16_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f64_to_f16_bits(x):
    """Bits of float64 values that f16 represents exactly (NaN -> 0x7FFF)."""
    x = np.asarray(x, dtype=np.float64)
    out = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    return np.where(nan, np.uint16(0x7FFF), out) if nan.any() else out


def f64_to_bf16_bits(x):
    """Bits of float64 values that bf16 represents exactly (NaN -> 0x7FFF)."""
    x = np.asarray(x, dtype=np.float64)
    out = (x.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    return np.where(nan, np.uint16(0x7FFF), out) if nan.any() else out


def flush32(x):
    """``.ftz``: f32 subnormals to sign-preserving zero."""
    x = np.asarray(x)
    sub = (np.abs(x) < _F32_TINY) & (x != 0)
    if not sub.any():
        return x
    return np.where(sub, np.copysign(np.zeros_like(x), x), x)


def flush_half(x, fmt):
    """Flush subnormals of format ``fmt`` (float64 values) to signed zero."""
    tiny = 2.0 ** FORMATS[fmt][1]
    sub = (np.abs(x) < tiny) & (x != 0)
    return np.where(sub, np.copysign(0.0, x), x) if sub.any() else x


def float_result(s, direction, fmt, mode="rn"):
    """The exact value ``s (+ remainder of sign direction)`` rounded to ``fmt``
    with ``mode``; float64 values for f16/bf16/f32, float64 for f64."""
    if fmt == "f64":
        return adjust64(np.asarray(s, dtype=np.float64), direction, mode)
    x = round_to_odd(s, direction)
    if fmt == "f32" and mode == "rn":       # numpy's f64 -> f32 cast is IEEE RN
        return x.astype(np.float32).astype(np.float64)
    return round_format(x, fmt, mode)
