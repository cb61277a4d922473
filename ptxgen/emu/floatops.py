"""Floating-point semantics: f32, f64, f16, bf16 and the packed x2 forms.

* ``add/sub/mul/div/sqrt/rcp`` with ``.rn`` on f32 and f64 run natively in
  numpy (IEEE, correctly rounded).  Every other form (directed rounding,
  ``fma``, the half types) computes the exact result as a float64 value
  plus the sign of its remainder and rounds it once (see
  :mod:`ptxgen.emu.numerics`): correctly rounded, bit-exact with hardware.
  f64 ``fma`` is correctly rounded except in pathological cancellations.
* ``.approx`` functions (``rcp, sqrt, rsqrt, ex2, lg2, sin, cos, tanh``, and
  ``div.approx``/``div.full``) are computed in float64 and rounded to
  nearest: they are *more* accurate than hardware, which is within the PTX
  ISA's stated error bounds of them (see docs/emulator.md).
* ``.ftz`` flushes f32 (and half) subnormal inputs and results to
  sign-preserving zero; ``.sat`` clamps to [0, 1] (NaN to +0); ``.relu``
  clamps negatives to +0.
"""

from __future__ import annotations

import numpy as np

from ..isa import TABLE
from .numerics import (bf16_to_f32, f16_to_f64, f64_to_bf16_bits, f64_to_f16_bits,
                       flush32, flush_half, float_result, fma_pair, sign_dir,
                       two_prod, two_sum)
from .operands import Op, finish_op, getter, semantics, setter

__all__ = ["build", "decode", "encode"]

_MODES = ("rn", "rz", "rm", "rp")


def _fmt(ty):
    return {"f16x2": "f16", "bf16x2": "bf16"}.get(ty.name, ty.name)


def decode(x, ty):
    """Natural value of ``ty`` -> list of float64 lanes (two for x2 types)."""
    x = np.asarray(x)
    n = ty.name
    if n in ("f32", "f64", "f16"):
        return [x.astype(np.float64)]
    if n == "bf16":
        return [bf16_to_f32(x).astype(np.float64)]
    lo = (x & np.uint32(0xFFFF)).astype(np.uint16)
    hi = (x >> np.uint32(16)).astype(np.uint16)
    if n == "f16x2":
        return [f16_to_f64(lo), f16_to_f64(hi)]
    return [bf16_to_f32(lo).astype(np.float64), bf16_to_f32(hi).astype(np.float64)]


def encode(lanes, ty):
    """float64 lanes (already representable in the format) -> natural value."""
    n = ty.name
    if n == "f32":
        return np.asarray(lanes[0]).astype(np.float32)
    if n == "f64":
        return np.asarray(lanes[0], dtype=np.float64)
    if n == "f16":
        return f64_to_f16_bits(lanes[0]).view(np.float16)
    if n == "bf16":
        return f64_to_bf16_bits(lanes[0])
    conv = f64_to_f16_bits if n == "f16x2" else f64_to_bf16_bits
    lo, hi = (conv(v).astype(np.uint32) for v in lanes)
    return lo | (hi << np.uint32(16))


def _pair(kind, a, b=None, c=None, exact_product=False):
    """The exact result of ``kind`` as (float64 s, remainder sign or None)."""
    with np.errstate(all="ignore"):
        if kind == "add":
            s, e = two_sum(a, b)
            return s, sign_dir(e)
        if kind == "sub":
            s, e = two_sum(a, -b)
            return s, sign_dir(e)
        if kind == "mul":
            p, e = two_prod(a, b)
            return p, sign_dir(e)
        if kind == "fma":
            if exact_product:                 # f32/f16/bf16: a*b is exact in f64
                s, e = two_sum(a * b, c)
                return s, sign_dir(e)
            return fma_pair(a, b, c)
        if kind in ("div", "rcp"):
            if kind == "rcp":
                a, b = np.ones_like(a), a
            q = a / b
            ph, pl = two_prod(q, b)
            d = sign_dir((a - ph) - pl) * np.sign(b)
            return q, np.where(np.isfinite(q) & (b != 0), d, 0.0)
        if kind == "sqrt":
            q = np.sqrt(a)
            ph, pl = two_prod(q, q)
            return q, np.where(np.isfinite(q), sign_dir((a - ph) - pl), 0.0)
    raise AssertionError(kind)


_APPROX = {
    "ex2": np.exp2, "lg2": np.log2, "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
    "rsqrt": lambda x: 1.0 / np.sqrt(x), "rcp": lambda x: 1.0 / x, "sqrt": np.sqrt,
}


def _post(lanes, fmt, ftz, sat, relu):
    out = []
    for r in lanes:
        if ftz:
            r = flush_half(r, fmt)
        if sat:
            r = np.where(np.isnan(r), 0.0, np.clip(r, 0.0, 1.0))
        if relu:
            r = np.where(r < 0, 0.0, r)
        out.append(r)
    return out


def _pre(lanes, fmt, ftz):
    # .ftz flushes subnormal inputs, f64 ones too (rcp/rsqrt.approx.ftz.f64:
    # an H100 gives inf for rsqrt of an f64 subnormal)
    if not ftz:
        return lanes
    return [flush_half(x, fmt) for x in lanes]


def _native32(op, ftz, sat):
    """RN f32 arithmetic straight in numpy float32."""
    f = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}.get(op)
    if op == "sqrt":
        f1 = np.sqrt
    elif op == "rcp":
        def f1(x):
            return np.float32(1.0) / x
    if op in ("sqrt", "rcp"):
        def g(a):
            if ftz:
                a = flush32(a)
            r = f1(a)
            return _fin32(r, ftz, sat)
        return g

    def h(a, b):
        if ftz:
            a, b = flush32(a), flush32(b)
        return _fin32(f(a, b), ftz, sat)
    return h


def _fin32(r, ftz, sat):
    if ftz:
        r = flush32(r)
    if sat:
        r = np.where(np.isnan(r), np.float32(0), np.clip(r, np.float32(0), np.float32(1)))
    return np.asarray(r, dtype=np.float32)


def _generic(kind, ty, mode, ftz, sat, relu):
    fmt = _fmt(ty)

    def g(*vals):
        lanes = [_pre(decode(v, ty), fmt, ftz) for v in vals]
        out = []
        for parts in zip(*lanes):
            s, d = _pair(kind, *parts, exact_product=fmt != "f64")
            out.append(float_result(s, d, fmt, mode))
        return encode(_post(out, fmt, ftz, sat, relu), ty)
    return g


def _approx(kind, ty, ftz):
    fmt = _fmt(ty)
    f = _APPROX[kind]

    def g(a):
        lanes = _pre(decode(a, ty), fmt, ftz)
        with np.errstate(all="ignore"):
            out = [f(x) for x in lanes]
        if fmt == "f32":
            out = [np.asarray(x).astype(np.float32).astype(np.float64) for x in out]
        return encode(_post(out, fmt, ftz, False, False), ty)
    return g


def _signbits(ty):
    return {"f16": 0x8000, "bf16": 0x8000, "f16x2": 0x80008000, "bf16x2": 0x80008000,
            "f32": 0x80000000, "f64": 0x8000000000000000}[ty.name]


def _negabs(op, ty, ftz):
    from .operands import NAT, UINT
    w = 32 if ty.name.endswith("x2") else ty.bits
    u = UINT[w]
    sign = u(_signbits(ty))
    fmt = _fmt(ty)

    def g(a):
        if ftz:
            a = encode(_pre(decode(a, ty), fmt, True), ty)
        bits = np.asarray(a).view(u)
        r = bits ^ sign if op == "neg" else bits & ~sign
        return r.view(NAT[ty.name])
    return g


def _minmax(op, ty, ftz, nan):
    fmt = _fmt(ty)

    def g(a, b):
        out = []
        for x, y in zip(_pre(decode(a, ty), fmt, ftz), _pre(decode(b, ty), fmt, ftz)):
            if op == "min":
                r = np.fmin(x, y)
                r = np.where((x == y) & (x == 0), np.where(np.signbit(x), x, y), r)
            else:
                r = np.fmax(x, y)
                r = np.where((x == y) & (x == 0), np.where(np.signbit(x), y, x), r)
            if nan:
                r = np.where(np.isnan(x) | np.isnan(y), np.nan, r)
            out.append(r)
        return encode(out, ty)
    return g


@semantics("fma", "rcp", "sqrt", "rsqrt", "ex2", "lg2", "sin", "cos", "tanh")
def build(stmt, ctx):
    """An Op for a float form of add/sub/mul/mad/fma/div/neg/abs/min/max or
    of a special function."""
    ty = stmt.types[0]
    mods = stmt.mods
    op = stmt.op
    mode = next((m for m in mods if m in _MODES), "rn")
    ftz, sat, relu = "ftz" in mods, "sat" in mods, "relu" in mods
    if op == "mad":
        op = "fma"
    if op in ("neg", "abs"):
        f = _negabs(op, ty, ftz)
    elif op in ("min", "max"):
        f = _minmax(op, ty, ftz, "NaN" in mods)
    elif op in ("ex2", "lg2", "sin", "cos", "tanh", "rsqrt") or "approx" in mods \
            or (op == "div" and "full" in mods):
        if op == "div":
            def f(a, b):
                with np.errstate(all="ignore"):
                    x = decode(a, ty)[0] / decode(b, ty)[0]
                if ty.name == "f32":
                    x = np.asarray(x).astype(np.float32).astype(np.float64)
                return encode(_post([x], _fmt(ty), ftz, False, False), ty)
        else:
            f = _approx(op, ty, ftz)
    elif ty.name == "f32" and mode == "rn" and op in ("add", "sub", "mul", "div", "sqrt", "rcp") \
            and not relu:
        f = _native32(op, ftz, sat)
    elif ty.name == "f64" and mode == "rn" and op in ("add", "sub", "mul", "div", "sqrt", "rcp"):
        f = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
             "sqrt": np.sqrt, "rcp": lambda x: 1.0 / x}[op]
    else:
        f = _generic(op, ty, mode, ftz, sat, relu)
    ops = stmt.operands
    srcs = [getter(ctx, o, ty) for o in ops[1:]]
    put = setter(ctx, ops[0], ty)
    if len(srcs) == 1:
        (a,) = srcs

        def fn(st, m):
            put(st, f(a(st)), m)
    elif len(srcs) == 2:
        a, b = srcs

        def fn(st, m):
            put(st, f(a(st), b(st)), m)
    else:
        a, b, c = srcs

        def fn(st, m):
            put(st, f(a(st), b(st), c(st)), m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE[stmt.op])

