"""Integer, bit, comparison and selection semantics.

Integer arithmetic wraps exactly (numpy fixed-width arrays); ``.hi`` and
``.wide`` products are computed exactly (64-bit high halves from 32-bit
pieces).  Float forms of the shared opcodes (``add.f32`` ...) are handed
to :mod:`ptxgen.emu.floatops`.
"""

from __future__ import annotations

import numpy as np

from ..isa import TABLE
from ..types import u32 as U32
from . import floatops
from .numerics import bf16_to_f32
from .operands import NAT, SINT, UINT, Op, finish_op, getter, semantics, setter

__all__ = ["elementwise", "mulhi"]

_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def elementwise(stmt, ctx, compute, src_types=None, dst_type=None):
    """An Op computing ``d = compute(*sources)`` lane-wise."""
    ty = stmt.types[0]
    ops = stmt.operands
    srcs = [getter(ctx, o, t) for o, t in zip(ops[1:], src_types or [ty] * (len(ops) - 1))]
    put = setter(ctx, ops[0], dst_type or ty)
    if len(srcs) == 1:
        (a,) = srcs

        def fn(st, m):
            put(st, compute(a(st)), m)
    elif len(srcs) == 2:
        a, b = srcs

        def fn(st, m):
            put(st, compute(a(st), b(st)), m)
    else:
        def fn(st, m):
            put(st, compute(*[g(st) for g in srcs]), m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE[stmt.op])


def mulhi(a, b, w, signed):
    """High ``w`` bits of the exact product of two ``w``-bit integers."""
    if w < 64:
        big = np.int64 if signed else np.uint64
        p = np.asarray(a).astype(big) * np.asarray(b).astype(big)
        return (p >> w).astype(SINT[w] if signed else UINT[w])
    ua = np.asarray(a).view(np.uint64) if signed else np.asarray(a, dtype=np.uint64)
    ub = np.asarray(b).view(np.uint64) if signed else np.asarray(b, dtype=np.uint64)
    al, ah, bl, bh = ua & _M32, ua >> _S32, ub & _M32, ub >> _S32
    ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh
    mid = (ll >> _S32) + (lh & _M32) + (hl & _M32)
    hi = hh + (lh >> _S32) + (hl >> _S32) + (mid >> _S32)
    if signed:
        hi = hi - np.where(np.asarray(a) < 0, ub, 0).astype(np.uint64) \
                - np.where(np.asarray(b) < 0, ua, 0).astype(np.uint64)
        return hi.view(np.int64)
    return hi


def _wide(ty):
    return NAT[("s" if ty.is_signed else "u") + str(ty.bits * 2)]


def _sat32(x):
    return np.clip(x, -2 ** 31, 2 ** 31 - 1).astype(np.int32)


# ---------------------------------------------------------------- arithmetic
@semantics("add", "sub")
def _add(stmt, ctx):
    ty = stmt.types[0]
    if ty.is_float:
        return floatops.build(stmt, ctx)
    sub = stmt.op == "sub"
    if "sat" in stmt.mods:
        def f(a, b):
            a64, b64 = np.asarray(a, np.int64), np.asarray(b, np.int64)
            return _sat32(a64 - b64 if sub else a64 + b64)
        return elementwise(stmt, ctx, f)
    return elementwise(stmt, ctx, np.subtract if sub else np.add)


@semantics("mul")
def _mul(stmt, ctx):
    ty = stmt.types[0]
    if ty.is_float:
        return floatops.build(stmt, ctx)
    w = ty.bits
    if "hi" in stmt.mods:
        return elementwise(stmt, ctx, lambda a, b: mulhi(a, b, w, ty.is_signed))
    if "wide" in stmt.mods:
        wide = _wide(ty)
        from ..types import type_by_name
        dty = type_by_name(("s" if ty.is_signed else "u") + str(w * 2))
        return elementwise(stmt, ctx, lambda a, b: np.asarray(a).astype(wide) * np.asarray(b).astype(wide),
                           dst_type=dty)
    return elementwise(stmt, ctx, np.multiply)


@semantics("mad")
def _mad(stmt, ctx):
    ty = stmt.types[0]
    if ty.is_float:
        return floatops.build(stmt, ctx)
    w = ty.bits
    from ..types import type_by_name
    if "wide" in stmt.mods:
        wide = _wide(ty)
        dty = type_by_name(("s" if ty.is_signed else "u") + str(w * 2))
        return elementwise(stmt, ctx,
                           lambda a, b, c: np.asarray(a).astype(wide) * np.asarray(b).astype(wide) + c,
                           src_types=[ty, ty, dty], dst_type=dty)
    if "hi" in stmt.mods:
        if "sat" in stmt.mods:
            return elementwise(stmt, ctx, lambda a, b, c: _sat32(
                mulhi(a, b, 32, True).astype(np.int64) + np.asarray(c, np.int64)))
        return elementwise(stmt, ctx, lambda a, b, c: mulhi(a, b, w, ty.is_signed) + c)
    return elementwise(stmt, ctx, lambda a, b, c: a * b + c)


def _divide(a, b, ty):
    """Truncating quotient and remainder; x/0 gives all ones, x%0 gives x."""
    w = ty.bits
    a, b = np.broadcast_arrays(np.asarray(a), np.asarray(b))
    dt = a.dtype
    zero = b == 0
    if not ty.is_signed:
        safe = np.where(zero, 1, b).astype(dt)
        q, r = a // safe, a % safe
    else:
        u64 = np.uint64
        ua = np.where(a < 0, -(a.astype(np.int64).view(u64)), a.astype(np.int64).view(u64))
        ub = np.where(b < 0, -(b.astype(np.int64).view(u64)), b.astype(np.int64).view(u64))
        ub = np.where(zero, u64(1), ub)
        qm, rm = ua // ub, ua % ub
        q = np.where((a < 0) != (b < 0), -qm, qm).astype(UINT[w]).view(dt)
        r = np.where(a < 0, -rm, rm).astype(UINT[w]).view(dt)
    ones = np.array(-1).astype(dt) if ty.is_signed else np.iinfo(dt).max
    return np.where(zero, ones, q).astype(dt), np.where(zero, a, r).astype(dt)


@semantics("div")
def _div(stmt, ctx):
    ty = stmt.types[0]
    if ty.is_float:
        return floatops.build(stmt, ctx)
    return elementwise(stmt, ctx, lambda a, b: _divide(a, b, ty)[0])


@semantics("rem")
def _rem(stmt, ctx):
    ty = stmt.types[0]
    return elementwise(stmt, ctx, lambda a, b: _divide(a, b, ty)[1])


@semantics("neg", "abs")
def _neg_abs(stmt, ctx):
    ty = stmt.types[0]
    if ty.is_float:
        return floatops.build(stmt, ctx)
    if stmt.op == "neg":
        return elementwise(stmt, ctx, np.negative)
    return elementwise(stmt, ctx, np.abs)


@semantics("min", "max")
def _minmax(stmt, ctx):
    ty = stmt.types[0]
    if ty.is_float:
        return floatops.build(stmt, ctx)
    return elementwise(stmt, ctx, np.minimum if stmt.op == "min" else np.maximum)


def _smear(x, w):
    x = np.asarray(x, dtype=UINT[w])
    s = 1
    while s < w:
        x = x | (x >> UINT[w](s))
        s *= 2
    return x


@semantics("popc", "clz")
def _bits_count(stmt, ctx):
    sty = stmt.types[0]
    w = sty.bits
    if stmt.op == "popc":
        f = lambda a: np.bitwise_count(np.asarray(a)).astype(np.uint32)  # noqa: E731
    else:
        f = lambda a: (w - np.bitwise_count(_smear(a, w)).astype(np.int64)).astype(np.uint32)  # noqa: E731
    return elementwise(stmt, ctx, f, src_types=[sty], dst_type=U32)


# ------------------------------------------------------------------- logic
@semantics("and", "or", "xor")
def _logic(stmt, ctx):
    f = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[stmt.op]
    return elementwise(stmt, ctx, f)


@semantics("not")
def _not(stmt, ctx):
    return elementwise(stmt, ctx, np.invert)


@semantics("shl", "shr")
def _shift(stmt, ctx):
    from ..types import u32
    ty = stmt.types[0]
    w = ty.bits
    nat = NAT[ty.name]
    left = stmt.op == "shl"

    def f(a, b):
        b = np.asarray(b, dtype=np.uint32)
        a = np.asarray(a)
        if ty.is_signed and not left:
            return a >> np.minimum(b, w - 1).astype(nat)
        amt = np.minimum(b, w - 1).astype(a.dtype)
        r = (a << amt) if left else (a >> amt)
        return np.where(b >= w, nat(0), r).astype(nat)
    return elementwise(stmt, ctx, f, src_types=[ty, u32])


def _lowmask(n, w):
    """``(1 << n) - 1`` for ``0 <= n <= w`` as UINT[w]."""
    n = np.asarray(n, dtype=np.uint64)
    full = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - w)
    sh = np.minimum(n, 63)
    m = (np.uint64(1) << sh) - np.uint64(1)
    return np.where(n >= w, full, m).astype(UINT[w])


def _field_operands(pos, ln, w):
    """bfe/bfi's position and length as uint64.

    The PTX ISA's pseudo-code takes both ``& 0xff``.  The 32-bit forms do
    so on sm_90; the 64-bit forms do not: ptxas lowers ``bfe.{u,s}64`` and
    ``bfi.b64`` to 64-bit funnel shifts and a ``(1 << len) - 1`` mask that
    use the whole u32 operand, shifts saturating at 64 (as ``shl``/``shr``
    do).  Within 0..255 the two agree; above 255 the hardware's rule is
    the one a GPU runs (a position of 259 is past the msb, not bit 3).
    """
    pos, ln = np.asarray(pos, np.uint32), np.asarray(ln, np.uint32)
    if w == 32:
        pos, ln = pos & 0xFF, ln & 0xFF
    return pos.astype(np.uint64), ln.astype(np.uint64)


@semantics("bfe")
def _bfe(stmt, ctx):
    from ..types import u32
    ty = stmt.types[0]
    w = ty.bits

    def f(a, b, c):
        u = UINT[w]
        a = np.asarray(a).view(u) if np.asarray(a).dtype != u else np.asarray(a)
        pos, ln = _field_operands(b, c, w)
        valid = np.where(pos >= w, 0, np.minimum(ln, w - np.minimum(pos, w)))
        shifted = np.where(pos >= w, u(0), a >> np.minimum(pos, w - 1).astype(u))
        field = shifted & _lowmask(valid, w)
        if ty.is_signed:
            top = np.minimum(pos + ln - 1, w - 1).astype(u)
            sbit = np.where(ln == 0, u(0), (a >> top) & u(1))
            field = np.where(sbit == 1, field | ~_lowmask(valid, w), field)
        return field.astype(u).view(NAT[ty.name])
    return elementwise(stmt, ctx, f, src_types=[ty, u32, u32])


@semantics("bfi")
def _bfi(stmt, ctx):
    from ..types import u32
    ty = stmt.types[0]
    w = ty.bits
    u = UINT[w]

    def f(a, b, c, d):
        pos, ln = _field_operands(c, d, w)
        valid = np.where(pos >= w, 0, np.minimum(ln, w - np.minimum(pos, w)))
        sh = np.minimum(pos, w - 1).astype(u)
        mask = (_lowmask(valid, w) << sh).astype(u)
        return ((np.asarray(b, u) & ~mask) | ((np.asarray(a, u) << sh) & mask)).astype(u)
    return elementwise(stmt, ctx, f, src_types=[ty, ty, u32, u32])


# byte indices (b0, b1, b2, b3) of the result for each mode and c[1:0]
_PRMT_MODES = {
    "f4e": [(0, 1, 2, 3), (1, 2, 3, 4), (2, 3, 4, 5), (3, 4, 5, 6)],
    "b4e": [(0, 7, 6, 5), (1, 0, 7, 6), (2, 1, 0, 7), (3, 2, 1, 0)],
    "rc8": [(0, 0, 0, 0), (1, 1, 1, 1), (2, 2, 2, 2), (3, 3, 3, 3)],
    "ecl": [(0, 1, 2, 3), (1, 1, 2, 3), (2, 2, 2, 3), (3, 3, 3, 3)],
    "ecr": [(0, 0, 0, 0), (0, 1, 1, 1), (0, 1, 2, 2), (0, 1, 2, 3)],
    "rc16": [(0, 1, 0, 1), (2, 3, 2, 3), (0, 1, 0, 1), (2, 3, 2, 3)],
}


def prmt(a, b, c, mode=None):
    """``prmt.b32{.mode}``: bytes of ``{b, a}`` (a = bytes 0-3) picked by ``c``."""
    a, b, c = (np.asarray(x, dtype=np.uint32) for x in (a, b, c))
    if c.ndim == 0 and (a.ndim or b.ndim):
        return _prmt_const(a, b, int(c), mode)
    a, b, c = np.broadcast_arrays(a, b, c)
    src = (a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32)))
    out = np.zeros(a.shape, np.uint32)
    table = np.array(_PRMT_MODES[mode], dtype=np.uint32) if mode else None
    for i in range(4):
        if mode is None:
            sel = (c >> np.uint32(4 * i)) & np.uint32(0xF)
            idx = sel & np.uint32(7)
        else:
            idx = table[c & np.uint32(3), i]
            sel = idx
        byte = ((src >> (idx.astype(np.uint64) * np.uint64(8))) & np.uint64(0xFF)).astype(np.uint32)
        if mode is None:
            sign = np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0))
            byte = np.where(sel & np.uint32(8), sign, byte)
        out |= byte << np.uint32(8 * i)
    return out


def _prmt_const(a, b, c, mode):
    """prmt with one selector for all threads: a byte gather."""
    a, b = np.broadcast_arrays(a, b)
    src = np.empty(a.shape + (2,), "<u4")
    src[..., 0] = a
    src[..., 1] = b
    src = src.view(np.uint8)                      # (..., 8) bytes, byte 0 of a first
    if mode is None:
        sel = [(c >> (4 * i)) & 0xF for i in range(4)]
    else:
        sel = list(_PRMT_MODES[mode][c & 3])
    out = np.ascontiguousarray(src[..., [s & 7 for s in sel]])
    for i, s in enumerate(sel):
        if s & 8:
            out[..., i] = np.where(out[..., i] & 0x80, np.uint8(0xFF), np.uint8(0))
    return out.view("<u4")[..., 0].astype(np.uint32)


@semantics("prmt")
def _prmt(stmt, ctx):
    mode = stmt.mods[0] if stmt.mods else None
    return elementwise(stmt, ctx, lambda a, b, c: prmt(a, b, c, mode))


def _bytes(x, signed, n, size):
    x = np.asarray(x).view(np.uint32) if np.asarray(x).dtype != np.uint32 else np.asarray(x)
    out = []
    for i in range(n):
        v = ((x >> np.uint32(size * i)) & np.uint32((1 << size) - 1)).astype(np.int64)
        if signed:
            v = np.where(v >= 1 << (size - 1), v - (1 << size), v)
        out.append(v)
    return out


@semantics("dp4a", "dp2a")
def _dp(stmt, ctx):
    from ..types import b32, s32, u32
    ta, tb = stmt.types
    acc = u32 if (ta is u32 and tb is u32) else s32
    hi = "hi" in stmt.mods

    def f(a, b, c):
        if stmt.op == "dp4a":
            av = _bytes(a, ta.is_signed, 4, 8)
            bv = _bytes(b, tb.is_signed, 4, 8)
        else:
            av = _bytes(a, ta.is_signed, 2, 16)
            bv = _bytes(b, tb.is_signed, 4, 8)[2:] if hi else _bytes(b, tb.is_signed, 4, 8)[:2]
        tot = np.asarray(c).astype(np.int64)
        for x, y in zip(av, bv):
            tot = tot + x * y
        return (tot & 0xFFFFFFFF).astype(np.uint32).view(NAT[acc.name])
    ops = stmt.operands
    srcs = [getter(ctx, ops[1], b32), getter(ctx, ops[2], b32), getter(ctx, ops[3], acc)]
    put = setter(ctx, ops[0], acc)

    def fn(st, m):
        put(st, f(srcs[0](st), srcs[1](st), srcs[2](st)), m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE[stmt.op])


# ------------------------------------------------------ compare and select
_INT_CMP = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal,
            "lo": np.less, "ls": np.less_equal, "hi": np.greater, "hs": np.greater_equal}
_BOOL = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}


def _float_lanes(x, ty):
    """A compare operand as float64 lanes."""
    x = np.asarray(x)
    if ty.name == "bf16":
        return bf16_to_f32(x).astype(np.float64)
    return x.astype(np.float64)


def compare(cmp, a, b, ty, ftz=False):
    """The PTX comparison ``cmp`` of ``a`` and ``b`` (natural type of ``ty``)."""
    if not ty.is_float:
        if cmp in ("lo", "ls", "hi", "hs") and ty.is_signed:
            u = UINT[ty.bits]
            a, b = np.asarray(a).view(u), np.asarray(b).view(u)
        return _INT_CMP[cmp](a, b)
    a, b = _float_lanes(a, ty), _float_lanes(b, ty)
    if ftz and ty.name in ("f32", "f16"):
        from .numerics import flush_half
        a, b = flush_half(a, ty.name), flush_half(b, ty.name)
    unord = np.isnan(a) | np.isnan(b)
    if cmp == "num":
        return ~unord
    if cmp == "nan":
        return unord
    unordered = cmp in ("equ", "neu", "ltu", "leu", "gtu", "geu")
    r = _INT_CMP[cmp[:-1] if unordered else cmp](a, b)
    if unordered:
        return r | unord
    return r & ~unord


@semantics("setp")
def _setp(stmt, ctx):
    from ..types import pred
    ty = stmt.types[0]
    cmp = stmt.mods[0]
    bop = next((m for m in stmt.mods if m in _BOOL), None)
    ftz = "ftz" in stmt.mods
    ops = stmt.operands
    a, b = getter(ctx, ops[1], ty), getter(ctx, ops[2], ty)
    put = setter(ctx, ops[0], pred)
    if bop is None:
        def fn(st, m):
            put(st, compare(cmp, a(st), b(st), ty, ftz), m)
    else:
        if len(ops) < 4:
            raise ctx.error(f"setp.{cmp}.{bop} needs a predicate operand c")
        c = getter(ctx, ops[3], pred)
        comb = _BOOL[bop]

        def fn(st, m):
            put(st, comb(compare(cmp, a(st), b(st), ty, ftz), c(st)), m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE["setp"])


@semantics("selp")
def _selp(stmt, ctx):
    from ..types import pred
    ty = stmt.types[0]
    ops = stmt.operands
    a, b, c = getter(ctx, ops[1], ty), getter(ctx, ops[2], ty), getter(ctx, ops[3], pred)
    put = setter(ctx, ops[0], ty)
    nat = NAT[ty.name]

    def fn(st, m):
        put(st, np.where(c(st), a(st), b(st)).astype(nat, copy=False), m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE["selp"])

