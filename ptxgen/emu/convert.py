"""Moves and conversions: ``mov`` (incl. vector pack/unpack and shared
symbol addresses), ``cvt`` with every rounding mode, ``.sat`` and ``.ftz``,
and ``cvta``.

``cvt`` rounding is exact (see :mod:`ptxgen.emu.numerics`): the source
value, exact in float64 or as a float64 pair for 64-bit integers, is
rounded once to the destination.  Float-to-integer conversions saturate to
the destination range and give 0 for NaN, as the PTX ISA specifies.
"""

from __future__ import annotations

import numpy as np

from ..isa import TABLE
from ..types import type_by_name
from .errors import UnsupportedError
from .floatops import decode, encode
from .memory import SHARED_WINDOW
from .numerics import (flush_half, float_result, round_format, round_int,
                       sign_dir, two_sum)
from .operands import NAT, UINT, Op, finish_op, getter, semantics, setter, width

__all__ = ["convert"]


@semantics("mov")
def _mov(stmt, ctx):
    ty = stmt.types[0]
    d, s = stmt.operands
    w = width(ty)
    if d[0] == "vec" or s[0] == "vec":
        vec = d if d[0] == "vec" else s
        parts = len(vec[1])
        if w % parts or w // parts < 8:
            raise ctx.error(f"mov.{ty.name} cannot split into {parts} parts")
        pty = type_by_name(f"b{w // parts}")
        pw = UINT[w // parts]
        u = UINT[w]
        if d[0] == "vec":
            src = getter(ctx, s, type_by_name(f"b{w}"))
            puts = [setter(ctx, o, pty) for o in vec[1]]
            shift = [u(i * (w // parts)) for i in range(parts)]

            def fn(st, m):
                x = np.asarray(src(st))
                for put, sh in zip(puts, shift):
                    put(st, (x >> sh).astype(pw), m)
        else:
            gets = [getter(ctx, o, pty) for o in vec[1]]
            put = setter(ctx, d, type_by_name(f"b{w}"))
            shift = [u(i * (w // parts)) for i in range(parts)]

            def fn(st, m):
                acc = u(0)
                for g, sh in zip(gets, shift):
                    acc = acc | (np.asarray(g(st)).astype(u) << sh)
                put(st, acc, m)
        return finish_op(Op(fn=fn), stmt, ctx, TABLE["mov"])
    src = getter(ctx, s, ty)
    put = setter(ctx, d, ty)

    def fn(st, m):
        put(st, src(st), m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE["mov"])


def _int_range(ty):
    if ty.is_signed:
        return -(1 << (ty.bits - 1)), (1 << (ty.bits - 1)) - 1
    return 0, (1 << ty.bits) - 1


def _int_to_pair(x, sty):
    """An integer array as (float64 s, remainder sign or None), exactly."""
    x = np.asarray(x)
    if sty.bits < 64:
        return x.astype(np.float64), None
    if sty.is_signed:
        hi = (x >> np.int64(32)).astype(np.float64) * 4294967296.0
        lo = (x & np.int64(0xFFFFFFFF)).astype(np.float64)
    else:
        hi = (x >> np.uint64(32)).astype(np.float64) * 4294967296.0
        lo = (x & np.uint64(0xFFFFFFFF)).astype(np.float64)
    s, e = two_sum(hi, lo)
    return s, sign_dir(e)


def _float_to_int(x64, dty, mode, src_bits=32):
    """Round float64 ``x64`` to an integer with ``mode``, saturating.  NaN
    gives 0 as the ISA says, except where an H100 gives the destination's
    top bit alone (``0x80..0``: INT_MIN for a signed type, ``2^(n-1)`` for
    an unsigned one): every conversion to a 64-bit integer and every one
    from f64."""
    lo, hi = _int_range(dty)
    r = round_int(x64, mode)
    nan = np.isnan(r)
    r = np.where(nan, 0.0, r)
    nat = NAT[dty.name]
    # the top bit alone: INT_MIN signed, 2^(n-1) unsigned
    top_bit = nat(lo) if dty.is_signed else nat(1 << (dty.bits - 1))
    top = dty.bits == 64 or src_bits == 64
    if dty.bits < 64:
        out = np.clip(r, lo, hi).astype(nat)
        return np.where(nan, top_bit, out).astype(nat) if top else out
    big = r >= float(hi)          # hi is not a float64 value: 2**63 or 2**64
    small = r < float(lo)
    out = np.where(big | small, 0.0, r).astype(nat)
    out = np.where(big, nat(hi), out)
    out = np.where(small, nat(lo), out).astype(nat)
    return np.where(nan, top_bit, out).astype(nat)


def convert(x, dty, sty, mods):
    """``cvt{mods}.dty.sty`` of ``x`` (natural type of ``sty``)."""
    rnd = next((m for m in mods if m in ("rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi")), None)
    sat = "sat" in mods
    ftz = "ftz" in mods
    if sty.is_float:
        (v,) = decode(x, sty)
        if ftz and sty.name == "f32":
            # .ftz flushes f32 subnormal inputs and f32 subnormal results;
            # an f16 input is left alone (cvt.ftz.f32.f16 is the same
            # instruction as cvt.f32.f16 on sm_90), a bf16 one is flushed
            # as the f32 result it becomes
            v = flush_half(v, "f32")
        if dty.is_float:
            if rnd in ("rni", "rzi", "rmi", "rpi"):
                v = round_int(v, rnd)
                rnd = "rn"
            if dty.name != "f64" and (dty.bits < sty.bits or dty.name != sty.name):
                v = round_format(v, dty.name, rnd or "rn")
            if ftz and dty.name in ("f32",):
                v = flush_half(v, "f32")
            if sat:
                v = np.where(np.isnan(v), 0.0, np.clip(v, 0.0, 1.0))
            return encode([v], dty)
        return _float_to_int(v, dty, rnd or "rzi", sty.bits)
    # integer source
    if dty.is_float:
        s, d = _int_to_pair(x, sty)
        v = float_result(s, d, dty.name, rnd if rnd in ("rn", "rz", "rm", "rp") else "rn")
        if sat:
            v = np.where(np.isnan(v), 0.0, np.clip(v, 0.0, 1.0))
        return encode([v], dty)
    x = np.asarray(x)
    nat = NAT[dty.name]
    if sat:
        lo, hi = _int_range(dty)
        if sty.is_signed:
            x64 = x.astype(np.int64)
            x64 = np.maximum(x64, lo)
            if hi < (1 << 63):
                x64 = np.minimum(x64, hi)
            return x64.astype(nat)
        xu = x.astype(np.uint64)
        if hi < (1 << 64) - 1:
            xu = np.minimum(xu, np.uint64(hi))
        return xu.astype(nat)
    return x.astype(UINT[sty.bits]).astype(UINT[dty.bits]).view(nat) if dty.bits <= sty.bits \
        else x.astype(nat)


@semantics("cvt")
def _cvt(stmt, ctx):
    dty, sty = stmt.types
    d, s = stmt.operands
    src = getter(ctx, s, sty)
    put = setter(ctx, d, dty)
    mods = stmt.mods

    def fn(st, m):
        with np.errstate(all="ignore"):
            put(st, convert(src(st), dty, sty, mods), m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE["cvt"])


@semantics("cvta")
def _cvta(stmt, ctx):
    ty = stmt.types[0]
    space = next(m for m in stmt.mods if m != "to")
    to = "to" in stmt.mods
    if space == "local":
        raise ctx.error("cvta with .local: the emulator has no local memory", UnsupportedError)
    d, s = stmt.operands
    src = getter(ctx, s, ty)
    put = setter(ctx, d, ty)
    nat = NAT[ty.name]
    delta = nat(SHARED_WINDOW & ((1 << ty.bits) - 1)) if space == "shared" else nat(0)

    def fn(st, m):
        x = np.asarray(src(st))
        put(st, (x - delta) if to else (x + delta), m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE["cvta"])
