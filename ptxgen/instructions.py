"""Instruction methods of the kernel builder.

Each method picks the opcode form from its operands' types, makes the
destination register, and hands the instruction to ``KernelBuilder.emit``
(which checks it against the table).  Python keywords get a trailing
underscore (``and_``, ``or_``, ``not_``).  Every method takes ``guard=`` (a
predicate register, or ``~p`` for ``@!p``) and, where it makes a value,
``out=`` to write into an existing :class:`~ptxgen.values.Var`.
"""

from __future__ import annotations

from . import types as T
from .checks import wide_of
from .errors import PtxBuildError, PtxTypeError
from .instr import Vec
from .values import (Address, Imm, NotPred, Operand, Ptr, Reg, SpecialReg,
                     Symbol, Var, as_operand)

__all__ = ["InstructionsMixin"]

FULL_MASK = 0xFFFFFFFF


def _type_of(x):
    return x.type if isinstance(x, Operand) else None


class InstructionsMixin:
    # ----------------------------------------------------------- helpers
    def _unify(self, opname, *xs) -> T.PtxType:
        """The common type of the operands; strict: registers must agree."""
        ty = None
        for x in xs:
            if isinstance(x, (Reg, SpecialReg, Imm)):
                other = x.type
                if ty is None:
                    ty = other
                    continue
                if other is ty:
                    continue
                raise PtxTypeError(
                    f"{opname} got {ty.name} and {other.name} operands; convert one "
                    f"explicitly (x.to({ty.name}) or x.to({other.name}))")
        if ty is None:
            raise PtxTypeError(f"{opname}: at least one operand must be a register")
        return ty

    def _out(self, ty, out):
        if out is None:
            return self.reg(ty)
        if not isinstance(out, Reg):
            raise PtxTypeError(f"out= must be a register, got {out!r}")
        if not T.compatible(out.type, ty):
            raise PtxTypeError(f"out= register {out.name} is {out.type.name}, "
                               f"the result is {ty.name}")
        return out

    def _src(self, x, ty):
        if x.__class__ is Reg or x.__class__ is Var:
            return x
        if isinstance(x, (int, float)) and _is_half(ty):
            return self.const(ty, x)
        return as_operand(x, ty)

    def _bits_type(self, ty):
        return {16: T.b16, 32: T.b32, 64: T.b64}[ty.bits] if not ty.is_pred else T.pred

    # -------------------------------------------------------------- moves
    def mov(self, src, ty=None, *, out=None, guard=None):
        """Copy ``src`` (register, special register, immediate, or a shared
        symbol's address) into a new register."""
        if isinstance(src, Symbol):
            ty = ty or src.type
        ty = T.type_by_name(ty) if ty is not None else _type_of(src)
        if ty is None:
            raise PtxTypeError(f"mov of {src!r} needs ty=")
        if isinstance(src, (int, float)) and _is_half(ty):
            return self.const(ty, src) if out is None else self.assign(out, src)
        d = self._out(ty, out)
        s = as_operand(src, ty) if not isinstance(src, Symbol) else src
        self.emit("mov", [], [self._bits_type(ty) if _is_half(ty) else ty], [d, s], guard=guard,
                  _own_frames=1)
        return d

    def const(self, ty, value):
        """A register holding the constant ``value`` of type ``ty`` (f16/bf16
        and the packed types are written by their bit patterns)."""
        ty = T.type_by_name(ty)
        if ty.is_float and (ty.bits == 16 or ty.is_packed):
            bits = _half_bits(ty, value)
            d = self.reg(ty)
            self.emit("mov", [], [self._bits_type(ty)], [d, Imm(bits, self._bits_type(ty))],
                      _own_frames=1)
            return d
        return self.mov(as_operand(value, ty), ty)

    def assign(self, var, value, *, guard=None):
        """``var = value`` for a :class:`Var` (``mov``)."""
        if not getattr(var, "mutable", False):
            raise PtxBuildError(f"{getattr(var, 'name', var)} is not a Var; only "
                                "k.var(...) registers can be assigned")
        ty = var.type
        if isinstance(value, Reg) and value.type is not ty and not T.compatible(value.type, ty):
            raise PtxTypeError(f"cannot assign {value.type.name} {value.name} to "
                               f"{ty.name} {var.name}")
        if isinstance(value, (int, float)) and _is_half(ty):
            value = Imm(_half_bits(ty, value), self._bits_type(ty))
        s = as_operand(value, ty)
        mty = self._bits_type(ty) if _is_half(ty) else ty
        self.emit("mov", [], [mty], [var, s], guard=guard, _own_frames=1)
        return var

    def bitcast(self, ty, x, *, out=None):
        """Reinterpret ``x`` as ``ty`` of the same width (``mov.bN``)."""
        ty = T.type_by_name(ty)
        if ty.bits != x.type.bits:
            raise PtxTypeError(f"bitcast from {x.type.name} to {ty.name} changes the width")
        d = self._out(ty, out)
        self.emit("mov", [], [self._bits_type(ty)], [d, x], _own_frames=1)
        return d

    def pack(self, ty, *parts):
        """``mov.bN d, {a, b, ...}``: join registers into one of type ``ty``."""
        ty = T.type_by_name(ty)
        d = self.reg(ty)
        self.emit("mov", [], [self._bits_type(ty)], [d, Vec(parts)], _own_frames=1)
        return d

    def unpack(self, x, ty, n=2):
        """``mov.bN {a, b, ...}, x``: split ``x`` into ``n`` registers of ``ty``."""
        ty = T.type_by_name(ty)
        parts = tuple(self.reg(ty) for _ in range(n))
        self.emit("mov", [], [self._bits_type(x.type)], [Vec(parts), x], dsts=1, _own_frames=1)
        return parts

    # --------------------------------------------------------- arithmetic
    def _binary(self, op, a, b, out, guard, mods=(), ity=None, ty=None):
        """``op d, a, b``; ``ty`` is the operands' type if the caller has
        already worked it out with :meth:`_unify`."""
        if ty is None:
            ty = self._unify(op, a, b)
        d = self.reg(ty) if out is None else self._out(ty, out)
        self.emit(op, mods, (ity or ty,), (d, self._src(a, ty), self._src(b, ty)), guard=guard,
                  _own_frames=2)
        return d

    # Float add/sub/mul carry an explicit rounding mode (``.rn`` unless
    # ``rnd=`` says otherwise): PTX lets ptxas fuse a plain ``mul.f32`` and
    # ``add.f32`` into one fma, which rounds differently; with ``.rn`` each
    # is rounded as written, so the CPU emulator reproduces the GPU's bits.
    # Write ``k.fma`` where a fused multiply-add is wanted, or pass
    # ``rnd=None, contract=True`` to leave the choice to ptxas.
    def _arith_mods(self, op, a, b, rnd, ftz, sat, contract):
        ty = self._unify(op, a, b)
        if ty.is_float and rnd is None and not contract:
            rnd = "rn"
        return ty, _fmods(rnd, ftz, sat)

    def add(self, a, b, *, out=None, sat=False, rnd=None, ftz=False, contract=False, guard=None):
        ty, mods = self._arith_mods("add", a, b, rnd, ftz, sat, contract)
        return self._binary("add", a, b, out, guard, mods, ty=ty)

    def sub(self, a, b, *, out=None, sat=False, rnd=None, ftz=False, contract=False, guard=None):
        ty, mods = self._arith_mods("sub", a, b, rnd, ftz, sat, contract)
        return self._binary("sub", a, b, out, guard, mods, ty=ty)

    def mul(self, a, b, *, out=None, rnd=None, ftz=False, sat=False, contract=False, guard=None):
        """``a * b``: ``mul.lo`` for integers (low half), ``mul.rn`` for floats."""
        ty, mods = self._arith_mods("mul", a, b, rnd, ftz, sat, contract)
        if ty.is_int:
            mods = ("lo",)
        return self._binary("mul", a, b, out, guard, mods, ty=ty)

    def mul_hi(self, a, b, *, out=None, guard=None):
        return self._binary("mul", a, b, out, guard, ("hi",))

    def mul_wide(self, a, b, *, out=None, guard=None):
        """``mul.wide``: the full product, twice the operands' width."""
        ty = self._unify("mul.wide", a, b)
        d = self._out(wide_of(ty), out)
        self.emit("mul", ["wide"], [ty], [d, self._src(a, ty), self._src(b, ty)], guard=guard,
                  _own_frames=1)
        return d

    def mad(self, a, b, c, *, out=None, wide=False, guard=None):
        """Integer ``a * b + c`` (``mad.lo``, or ``mad.wide`` with a wide ``c``)."""
        ty = self._unify("mad", a, b)
        if not ty.is_int:
            raise PtxTypeError(f"mad is for integers; use fma for {ty.name}")
        cty = wide_of(ty) if wide else ty
        if isinstance(c, Reg) and c.type is not cty:
            raise PtxTypeError(f"mad{'.wide' if wide else ''} addend must be {cty.name}, "
                               f"got {c.type.name}")
        d = self._out(cty, out)
        self.emit("mad", ["wide" if wide else "lo"], [ty],
                  [d, self._src(a, ty), self._src(b, ty), self._src(c, cty)], guard=guard,
                  _own_frames=1)
        return d

    def fma(self, a, b, c, *, out=None, rnd="rn", ftz=False, sat=False, relu=False, guard=None):
        """Fused ``a * b + c`` for floats and packed halves (``fma.rn``)."""
        ty = self._unify("fma", a, b, c)
        d = self._out(ty, out)
        mods = [rnd] + (["ftz"] if ftz else []) + (["sat"] if sat else []) + (["relu"] if relu else [])
        self.emit("fma", mods, [ty], [d, self._src(a, ty), self._src(b, ty), self._src(c, ty)],
                  guard=guard, _own_frames=1)
        return d

    def div(self, a, b, *, out=None, approx=False, full=False, rnd=None, ftz=False, guard=None):
        """Division: IEEE ``div.rn`` for floats unless ``approx``/``full``."""
        ty = self._unify("div", a, b)
        if ty.is_float:
            mods = ["approx" if approx else "full" if full else (rnd or "rn")]
            if ftz:
                mods.append("ftz")
        else:
            mods = []
        return self._binary("div", a, b, out, guard, mods)

    def rem(self, a, b, *, out=None, guard=None):
        ty = self._unify("rem", a, b)
        if not ty.is_int:
            raise PtxTypeError(f"rem (%) needs integers, got {ty.name}")
        return self._binary("rem", a, b, out, guard)

    def min(self, a, b, *, out=None, guard=None):
        return self._binary("min", a, b, out, guard)

    def max(self, a, b, *, out=None, guard=None):
        return self._binary("max", a, b, out, guard)

    def neg(self, a, *, out=None, guard=None):
        if a.type.kind == "u":
            raise PtxTypeError(f"neg of unsigned {a.type.name} {a.name}; convert to signed first")
        d = self._out(a.type, out)
        self.emit("neg", [], [a.type], [d, a], guard=guard, _own_frames=1)
        return d

    def abs(self, a, *, out=None, guard=None):
        d = self._out(a.type, out)
        self.emit("abs", [], [a.type], [d, a], guard=guard, _own_frames=1)
        return d

    def popc(self, a, *, out=None):
        d = self._out(T.u32, out)
        self.emit("popc", [], [self._bits_type(a.type)], [d, a], _own_frames=1)
        return d

    def clz(self, a, *, out=None):
        d = self._out(T.u32, out)
        self.emit("clz", [], [self._bits_type(a.type)], [d, a], _own_frames=1)
        return d

    # ----------------------------------------------------- special functions
    def _unary_f(self, op, a, mods, out, guard):
        ty = a.type
        d = self._out(ty, out)
        self.emit(op, mods, [ty], [d, a], guard=guard, _own_frames=2)
        return d

    def rcp(self, a, *, approx=False, ftz=False, out=None, guard=None):
        """``1/a``: ``rcp.rn`` (IEEE) or ``rcp.approx``."""
        return self._unary_f("rcp", a, ["approx" if approx else "rn"] + (["ftz"] if ftz else []),
                             out, guard)

    def sqrt(self, a, *, approx=False, ftz=False, out=None, guard=None):
        return self._unary_f("sqrt", a, ["approx" if approx else "rn"] + (["ftz"] if ftz else []),
                             out, guard)

    def rsqrt(self, a, *, ftz=False, out=None, guard=None):
        """``rsqrt.approx`` (max relative error 2^-22.9 for f32)."""
        return self._unary_f("rsqrt", a, ["approx"] + (["ftz"] if ftz else []), out, guard)

    def ex2(self, a, *, ftz=False, out=None, guard=None):
        """``2**a`` with ``ex2.approx`` (max relative error 2^-22 for f32)."""
        return self._unary_f("ex2", a, ["approx"] + (["ftz"] if ftz else []), out, guard)

    def lg2(self, a, *, ftz=False, out=None, guard=None):
        return self._unary_f("lg2", a, ["approx"] + (["ftz"] if ftz else []), out, guard)

    def sin(self, a, *, ftz=False, out=None, guard=None):
        return self._unary_f("sin", a, ["approx"] + (["ftz"] if ftz else []), out, guard)

    def cos(self, a, *, ftz=False, out=None, guard=None):
        return self._unary_f("cos", a, ["approx"] + (["ftz"] if ftz else []), out, guard)

    def tanh(self, a, *, out=None, guard=None):
        return self._unary_f("tanh", a, ["approx"], out, guard)

    # ------------------------------------------------------------ logic/bits
    def _logic(self, op, a, b, out, guard):
        ty = self._unify(op, a, b)
        if ty.is_float:
            raise PtxTypeError(f"{op} is a bitwise operation; bitcast {ty.name} first")
        return self._binary(op, a, b, out, guard, (), self._bits_type(ty))

    def and_(self, a, b, *, out=None, guard=None):
        return self._logic("and", a, b, out, guard)

    def or_(self, a, b, *, out=None, guard=None):
        return self._logic("or", a, b, out, guard)

    def xor(self, a, b, *, out=None, guard=None):
        return self._logic("xor", a, b, out, guard)

    def not_(self, a, *, out=None, guard=None):
        if a.type.is_float:
            raise PtxTypeError(f"not is a bitwise operation; bitcast {a.type.name} first")
        d = self._out(a.type, out)
        self.emit("not", [], [self._bits_type(a.type)], [d, a], guard=guard, _own_frames=1)
        return d

    def _shift_amount(self, b):
        if isinstance(b, Reg) and b.type.bits != 32:
            raise PtxTypeError(f"a shift amount must be a 32-bit register, got {b.type.name}")
        return as_operand(b, T.u32)

    def shl(self, a, b, *, out=None, guard=None):
        if a.type.is_float or a.type.is_pred:
            raise PtxTypeError(f"shl needs an integer, got {a.type.name}")
        d = self._out(a.type, out)
        self.emit("shl", [], [self._bits_type(a.type)], [d, a, self._shift_amount(b)], guard=guard,
                  _own_frames=1)
        return d

    def shr(self, a, b, *, out=None, guard=None):
        """Shift right: arithmetic for signed types, logical otherwise."""
        if a.type.is_float or a.type.is_pred:
            raise PtxTypeError(f"shr needs an integer, got {a.type.name}")
        d = self._out(a.type, out)
        self.emit("shr", [], [a.type], [d, a, self._shift_amount(b)], guard=guard, _own_frames=1)
        return d

    def bfe(self, a, pos, length, *, out=None):
        """Extract ``length`` bits at ``pos`` (sign-extended for signed types)."""
        d = self._out(a.type, out)
        self.emit("bfe", [], [a.type], [d, a, as_operand(pos, T.u32), as_operand(length, T.u32)],
                  _own_frames=1)
        return d

    def bfi(self, field, base, pos, length, *, out=None):
        """Insert the low ``length`` bits of ``field`` into ``base`` at ``pos``."""
        ty = self._unify("bfi", field, base)
        d = self._out(ty, out)
        self.emit("bfi", [], [self._bits_type(ty)],
                  [d, self._src(field, ty), self._src(base, ty),
                   as_operand(pos, T.u32), as_operand(length, T.u32)], _own_frames=1)
        return d

    def prmt(self, a, b, selector, *, mode=None, out=None):
        """Byte permute of the 8 bytes of ``{b, a}`` by ``selector``."""
        d = self._out(a.type, out)
        self.emit("prmt", [mode] if mode else [], [T.b32],
                  [d, a, as_operand(b, T.b32), as_operand(selector, T.b32)], _own_frames=1)
        return d

    def dp4a(self, a, b, c, *, signed_a=False, signed_b=False, out=None):
        """Four-way byte dot product plus ``c`` (u32 if both unsigned, else s32)."""
        ta, tb = (T.s32 if signed_a else T.u32), (T.s32 if signed_b else T.u32)
        acc = T.u32 if not (signed_a or signed_b) else T.s32
        d = self._out(acc, out)
        self.emit("dp4a", [], [ta, tb], [d, a, as_operand(b, T.b32), as_operand(c, acc)],
                  _own_frames=1)
        return d

    def dp2a(self, a, b, c, *, hi=False, signed_a=False, signed_b=False, out=None):
        ta, tb = (T.s32 if signed_a else T.u32), (T.s32 if signed_b else T.u32)
        acc = T.u32 if not (signed_a or signed_b) else T.s32
        d = self._out(acc, out)
        self.emit("dp2a", ["hi" if hi else "lo"], [ta, tb],
                  [d, a, as_operand(b, T.b32), as_operand(c, acc)], _own_frames=1)
        return d

    # -------------------------------------------------- compare and select
    def setp(self, cmp, a, b, *, combine=None, with_=None, out=None, ftz=False, guard=None):
        """``setp.cmp``: a predicate; ``combine=('and', q)`` chains a predicate."""
        ty = self._unify(f"setp.{cmp}", a, b)
        d = self._out(T.pred, out)
        mods = [cmp]
        ops = [d, self._src(a, ty), self._src(b, ty)]
        if combine is not None:
            bop, q = combine
            mods.append(bop)
            ops.append(q)
        if ftz:
            mods.append("ftz")
        self.emit("setp", mods, [ty], ops, guard=guard, _own_frames=1)
        return d

    def select(self, p, a, b, *, out=None):
        """``p ? a : b`` (``selp``)."""
        ty = self._unify("selp", a, b)
        d = self._out(ty, out)
        self.emit("selp", [], [ty], [d, self._src(a, ty), self._src(b, ty), p], _own_frames=1)
        return d

    def pand(self, p, q):
        """Predicate and: ``and.pred``."""
        return self._binary("and", p, q, None, None)

    def por(self, p, q):
        return self._binary("or", p, q, None, None)

    # --------------------------------------------------------- conversion
    def cvt(self, ty, x, *, rnd=None, sat=False, ftz=False, out=None, guard=None):
        """Convert ``x`` to ``ty``.

        Rounding defaults follow C: ``.rn`` into a narrower float or from an
        integer to a float, ``.rzi`` (truncation) from a float to an integer;
        widening float and integer conversions take none.
        """
        ty = T.type_by_name(ty)
        src = x.type
        if src.is_packed or ty.is_packed:
            raise PtxTypeError("cvt does not take packed half types; use unpack/pack")
        if rnd is None:
            if ty.is_float and src.is_float and ty.bits < src.bits:
                rnd = "rn"
            elif ty.is_float and src.is_int:
                rnd = "rn"
            elif ty.is_int and src.is_float:
                rnd = "rzi"
            elif ty.is_float and src.is_float and ty.bits == src.bits and ty is not src:
                rnd = "rn"
        d = self._out(ty, out)
        mods = ([rnd] if rnd else []) + (["ftz"] if ftz else []) + (["sat"] if sat else [])
        self.emit("cvt", mods, [ty, src], [d, x], guard=guard, _own_frames=1)
        return d

    def cvta(self, x, space, *, to=True):
        d = self.reg(T.u64)
        self.emit("cvta", (["to"] if to else []) + [space], [T.u64], [d, x], _own_frames=1)
        return d

    # -------------------------------------------------------------- memory
    def element(self, base, i) -> Address:
        """Address of element ``i`` of a :class:`Ptr` or shared :class:`Symbol`."""
        elem = base.elem
        size = elem.bytes
        space = base.space
        if isinstance(i, int):
            return Address(base, i * size, space, elem)
        if not isinstance(i, Reg) or not i.type.is_int:
            raise PtxTypeError(f"an index must be an integer register or int, got {i!r}")
        if isinstance(base, Symbol):
            if i.type.bits != 32:
                raise PtxTypeError(f"index a shared array with a 32-bit register, got {i.type.name}")
            b = self.mov(base)
            a = self.mad(i, size, b.bitcast(i.type) if b.type is not i.type else b)
            return Address(a, 0, space, elem)
        if i.type.bits == 32:
            a = self.reg(T.u64)
            self.emit("mad", ["wide"], [i.type], [a, i, as_operand(size, i.type), base],
                      _own_frames=1)
        elif i.type.bits == 64:
            a = self.mad(i, size, base.bitcast(i.type) if i.type is not base.type else base)
        else:
            raise PtxTypeError(f"an index must be 32 or 64 bits, got {i.type.name}")
        return Address(a, 0, space, elem)

    def ptr_add(self, p: Ptr, i) -> Ptr:
        """``p + i`` in elements, as a new :class:`Ptr`."""
        addr = self.element(p, i)
        out = self.ptr_reg(p.elem, p.space)
        if addr.offset:
            self.emit("add", [], [T.u64], [out, addr.base, Imm(addr.offset, T.u64)], _own_frames=1)
        else:
            self.emit("mov", [], [T.u64], [out, addr.base], _own_frames=1)
        return out

    def _mem_mods(self, addr, *, sem=None, scope=None, cache=None, nc=False, evict=None,
                  prefetch=None, vec=1, volatile=False):
        mods = []
        if volatile:
            mods.append("volatile")
        if sem:
            mods.append(sem)
        if scope:
            mods.append(scope)
        if addr.space != "generic":
            mods.append(addr.space)
        if cache:
            mods.append(cache)
        if nc:
            if addr.space != "global":
                raise PtxBuildError(".nc loads read .global memory only")
            mods.append("nc")
        if evict:
            mods.append(evict)
        if prefetch:
            mods.append(prefetch)
        if vec not in (1, 2, 4):
            raise PtxBuildError(f"vector width must be 1, 2 or 4, got {vec}")
        if vec > 1:
            mods.append(f"v{vec}")
        return mods

    def _as_addr(self, addr):
        if isinstance(addr, Ptr):
            return Address(addr, 0, addr.space, addr.elem)
        if not isinstance(addr, Address):
            raise PtxTypeError(f"a memory operand must be an Address (p[i]), got {addr!r}")
        return addr

    def ld(self, addr, ty=None, *, vec=1, nc=False, cache=None, evict=None, prefetch=None,
           sem=None, scope=None, volatile=False, guard=None, out=None):
        """Load ``vec`` values of ``ty`` (default: the pointer's element type).

        Returns one register, or a tuple of ``vec`` registers.  8-bit types
        load into 32-bit registers (zero- or sign-extended).
        """
        addr = self._as_addr(addr)
        ty = T.type_by_name(ty) if ty is not None else addr.elem
        if ty is None:
            raise PtxTypeError("ld needs ty= for an untyped address")
        rty = ty if ty.bits >= 16 else (T.s32 if ty.is_signed else T.u32)
        mods = self._mem_mods(addr, sem=sem, scope=scope, cache=cache, nc=nc, evict=evict,
                              prefetch=prefetch, vec=vec, volatile=volatile)
        if vec == 1:
            d = self._out(rty, out)
            dst = d
        else:
            d = tuple(self.reg(rty) for _ in range(vec))
            dst = Vec(d)
        self.emit("ld", mods, [self._bits_type(ty) if _is_half(ty) else ty], [dst, addr],
                  guard=guard, _own_frames=1)
        return d

    def st(self, addr, value, ty=None, *, cache=None, evict=None, sem=None, scope=None,
           volatile=False, guard=None):
        """Store a register (or a tuple of registers with ``.v2``/``.v4``)."""
        addr = self._as_addr(addr)
        vals = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        given = ty is not None
        ty = T.type_by_name(ty) if given else addr.elem
        if ty is None:
            ty = _type_of(vals[0])
        elif not given and ty.bits == 16:
            wide = next((v for v in vals if isinstance(v, Reg) and v.type.bits > 16), None)
            if wide is not None:
                raise PtxTypeError(
                    f"st of the {wide.type.name} register {wide.name} through a pointer to "
                    f"{ty.name} would store only its low 16 bits; pass ty= for the "
                    f"stored type (e.g. ty='{wide.type.name}' with an address of that "
                    f"width) or convert the value to {ty.name}")
        regs = tuple(v if isinstance(v, Reg) else self.const(ty, v) if ty.bits >= 16
                     else self.const(T.u32, v) for v in vals)
        mods = self._mem_mods(addr, cache=cache, evict=evict, sem=sem, scope=scope,
                              vec=len(regs), volatile=volatile)
        src = regs[0] if len(regs) == 1 else Vec(regs)
        ity = self._bits_type(ty) if _is_half(ty) else ty
        return self.emit("st", mods, [ity], [addr, src], guard=guard, dsts=0, _own_frames=1)

    def cp_async(self, dst, src, nbytes=16, *, prefetch=None, guard=None):
        """``cp.async`` (sm_80): copy ``nbytes`` (4, 8 or 16) from global
        ``src`` to shared ``dst`` without holding registers.  16-byte copies
        bypass L1 (``.cg``), smaller ones go through it (``.ca``).  The data
        may land any time before the thread's :meth:`cp_async_wait` that
        covers the copy's group (:meth:`cp_async_commit`); other threads see
        it only after that wait and a barrier."""
        dst, src = self._as_addr(dst), self._as_addr(src)
        if dst.space != "shared":
            raise PtxBuildError(f"cp.async writes shared memory; the destination is {dst.space}")
        if src.space != "global":
            raise PtxBuildError(f"cp.async reads global memory; the source is {src.space}")
        if nbytes not in (4, 8, 16):
            raise PtxBuildError(f"cp.async copies 4, 8 or 16 bytes, got {nbytes!r}")
        mods = ["cg" if nbytes == 16 else "ca", "shared", "global"] + ([prefetch] if prefetch else [])
        return self.emit("cp.async", mods, [], [dst, src, as_operand(nbytes, T.u32)],
                         guard=guard, dsts=0, _own_frames=1)

    def cp_async_commit(self):
        """``cp.async.commit_group``: the thread's copies since the last commit
        form one group (an empty group is allowed)."""
        return self.emit("cp.async.commit_group", [], [], [], dsts=0, _own_frames=1)

    def cp_async_wait(self, pending=0):
        """``cp.async.wait_group pending``: wait until at most ``pending`` of
        the thread's most recent committed groups are still in flight."""
        if not isinstance(pending, int) or isinstance(pending, bool) or not 0 <= pending <= 63:
            raise PtxBuildError(f"cp.async.wait_group takes a constant 0..63, got {pending!r}")
        return self.emit("cp.async.wait_group", [], [], [as_operand(pending, T.u32)], dsts=0,
                         _own_frames=1)

    def prefetch_l2_bulk(self, src, nbytes, *, guard=None):
        """``cp.async.bulk.prefetch.L2.global [src], nbytes`` (sm_90): ask the
        memory system to bring ``nbytes`` bytes from ``src`` into L2, without
        waiting and without holding registers.  ``src`` must be 16-byte aligned
        and ``nbytes`` (a u32 register or constant) a multiple of 16; it is a
        hint, so nothing waits for it and no later read depends on it."""
        src = self._as_addr(src)
        if src.space != "global":
            raise PtxBuildError(f"cp.async.bulk.prefetch.L2 reads global memory; the source is "
                                f"{src.space}")
        if isinstance(nbytes, int) and (isinstance(nbytes, bool) or nbytes <= 0 or nbytes % 16):
            raise PtxBuildError(f"cp.async.bulk.prefetch.L2 takes a positive multiple of 16 "
                                f"bytes, got {nbytes!r}")
        return self.emit("cp.async.bulk.prefetch.L2", ["global"], [], [src, as_operand(nbytes, T.u32)],
                         guard=guard, dsts=0, _own_frames=1)

    def cp_async_bulk(self, dst, src, nbytes, mbar, *, guard=None):
        """``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes``
        (sm_90): the bulk copy engine copies ``nbytes`` (a u32 register or
        constant, a multiple of 16) from global ``src`` to shared ``dst``, both
        16-byte aligned, and completes that many bytes on the mbarrier at
        shared ``mbar``.  One thread issues it; whoever waits for the
        mbarrier's phase (:meth:`mbarrier_wait`) sees the data.  Pair it with
        :meth:`mbarrier_arrive_expect_tx` for the same bytes."""
        dst, src, mbar = self._as_addr(dst), self._as_addr(src), self._as_addr(mbar)
        for what, a, want in (("destination", dst, "shared"), ("source", src, "global"),
                              ("mbarrier", mbar, "shared")):
            if a.space != want:
                raise PtxBuildError(f"cp.async.bulk: the {what} must be in .{want} memory, "
                                    f"got .{a.space}")
        if isinstance(nbytes, int) and (isinstance(nbytes, bool) or nbytes <= 0 or nbytes % 16):
            raise PtxBuildError(f"cp.async.bulk copies a positive multiple of 16 bytes, "
                                f"got {nbytes!r}")
        return self.emit("cp.async.bulk", ["shared::cluster", "global", "mbarrier::complete_tx::bytes"],
                         [], [dst, src, as_operand(nbytes, T.u32), mbar], guard=guard, dsts=0,
                         _own_frames=1)

    def mbarrier_init(self, mbar, count, *, guard=None):
        """``mbarrier.init.shared.b64 [mbar], count``: phase 0, ``count``
        arrivals expected per phase (1 ..  2^20 - 1).  Make it visible with
        :meth:`fence_mbarrier_init` and a barrier before anyone uses it."""
        mbar = self._mbar(mbar, "mbarrier.init")
        if isinstance(count, int) and not 1 <= count < 1 << 20:
            raise PtxBuildError(f"mbarrier.init takes a count of 1..{(1 << 20) - 1}, got {count!r}")
        return self.emit("mbarrier.init", ["shared"], [T.b64], [mbar, as_operand(count, T.u32)],
                         guard=guard, dsts=0, _own_frames=1)

    def mbarrier_arrive_expect_tx(self, mbar, nbytes, *, guard=None):
        """``mbarrier.arrive.expect_tx.shared.b64``: the current phase also
        waits for ``nbytes`` more bytes (from :meth:`cp_async_bulk`), then
        this thread arrives.  Returns the (opaque) phase state."""
        mbar = self._mbar(mbar, "mbarrier.arrive.expect_tx")
        d = self.reg(T.b64)
        self.emit("mbarrier.arrive.expect_tx", ["shared"], [T.b64],
                  [d, mbar, as_operand(nbytes, T.u32)], guard=guard, _own_frames=1)
        return d

    def mbarrier_try_wait_parity(self, mbar, parity):
        """``mbarrier.try_wait.parity.shared.b64``: a predicate, true once the
        phase with parity ``parity`` (0 or 1, a u32) has completed; the
        hardware may hold the thread a while before answering false."""
        mbar = self._mbar(mbar, "mbarrier.try_wait.parity")
        p = self.reg(T.pred)
        self.emit("mbarrier.try_wait.parity", ["shared"], [T.b64],
                  [p, mbar, as_operand(parity, T.u32)], _own_frames=1)
        return p

    def mbarrier_wait(self, mbar, parity):
        """Wait until the mbarrier's phase of parity ``parity`` has completed
        (a :meth:`mbarrier_try_wait_parity` loop); its bulk copies' bytes are
        then visible to this thread."""
        top = self._auto_label("mbar_wait")
        self.place(top)
        done = self.mbarrier_try_wait_parity(mbar, parity)
        self.bra(top, guard=NotPred(done))

    def fence_mbarrier_init(self):
        """``fence.mbarrier_init.release.cluster`` (sm_90): order this thread's
        :meth:`mbarrier_init` before the bulk copy engine's use of them."""
        return self.emit("fence.mbarrier_init", ["release", "cluster"], [], [], dsts=0,
                         _own_frames=1)

    def _mbar(self, mbar, what):
        mbar = self._as_addr(mbar)
        if mbar.space != "shared":
            raise PtxBuildError(f"{what}: an mbarrier lives in .shared memory, got .{mbar.space}")
        return mbar

    def atom(self, op, addr, value, cmp=None, *, ty=None, sem=None, scope=None, guard=None):
        """Atomic ``op`` (add, min, max, inc, dec, and, or, xor, exch, cas) at
        ``addr``; returns the old value.  ``cas`` compares with ``cmp``."""
        addr = self._as_addr(addr)
        ty = self._atom_type(op, addr, value, ty)
        d = self.reg(ty if not ty.is_bits else T.u32 if ty.bits == 32 else T.u64)
        ops = [d, addr, self._src(value, ty)]
        if op == "cas":
            if cmp is None:
                raise PtxBuildError("atom cas needs the compare value (cmp=...)")
            ops = [d, addr, self._src(cmp, ty), self._src(value, ty)]
        mods = [m for m in (sem, scope) if m] + [addr.space, op] + _noftz(op, ty)
        self.emit("atom", mods, [ty], ops, guard=guard, _own_frames=1)
        return d

    def red(self, op, addr, value, *, ty=None, sem=None, scope=None, guard=None):
        """Reduction to memory (``red``): like :meth:`atom` without a result."""
        addr = self._as_addr(addr)
        ty = self._atom_type(op, addr, value, ty)
        mods = [m for m in (sem, scope) if m] + [addr.space, op] + _noftz(op, ty)
        return self.emit("red", mods, [ty], [addr, self._src(value, ty)], guard=guard, dsts=0,
                         _own_frames=1)

    def _atom_type(self, op, addr, value, ty):
        ty = T.type_by_name(ty) if ty is not None else (addr.elem or _type_of(value))
        if op in ("and", "or", "xor", "cas", "exch") and ty.is_int:
            ty = self._bits_type(ty)
        if op in ("inc", "dec") and ty is not T.u32:
            raise PtxTypeError(f"atom.{op} works on u32 only, got {ty.name}")
        return ty

    # ------------------------------------------------ sync and communication
    def bar_sync(self, barrier=0, count=None, *, guard=None):
        """``bar.sync barrier[, count]``: block-wide barrier."""
        ops = [as_operand(barrier, T.u32)] + ([as_operand(count, T.u32)] if count is not None else [])
        return self.emit("bar", ["sync"], [], ops, guard=guard, dsts=0, _own_frames=1)

    def membar(self, level="gl"):
        return self.emit("membar", [level], [], [], dsts=0, _own_frames=1)

    def fence(self, sem="acq_rel", scope="gpu"):
        return self.emit("fence", [sem, scope], [], [], dsts=0, _own_frames=1)

    def nanosleep(self, ns, *, guard=None):
        """``nanosleep.u32 ns`` (sm_70): suspend the thread for about ``ns``
        nanoseconds (a u32 register or a constant 0..1,000,000), the pause of
        a spin-wait on memory another CTA writes.  The emulator switches to
        other threads there (see docs/emulator.md, "Spin-waits")."""
        if isinstance(ns, int) and not 0 <= ns <= 1_000_000:
            raise PtxBuildError(f"nanosleep takes 0..1000000 ns, got {ns}")
        return self.emit("nanosleep", [], [T.u32], [as_operand(ns, T.u32)], guard=guard,
                         dsts=0, _own_frames=1)

    def griddep_launch_dependents(self):
        """``griddepcontrol.launch_dependents`` (sm_90): the next grid in the
        stream, if launched with programmatic dependent launch, may start once
        every block of this grid has executed this (or exited)."""
        return self.emit("griddepcontrol", ["launch_dependents"], [], [], dsts=0, _own_frames=1)

    def griddep_wait(self):
        """``griddepcontrol.wait`` (sm_90): block until the grids this one
        depends on have completed and their memory is visible.  A kernel
        launched with programmatic dependent launch must execute this before
        it touches anything the previous kernels write."""
        return self.emit("griddepcontrol", ["wait"], [], [], dsts=0, _own_frames=1)

    # ------------------------------------------------- thread-block clusters
    def mapa(self, addr, rank) -> Address:
        """``mapa.shared::cluster.u32``: the address of the byte ``addr`` (a
        ``.shared`` address of this kernel) in the shared memory of the CTA
        of cluster rank ``rank`` (sm_90, a kernel built with ``cluster=``).
        Load and store through it with :meth:`ld` / :meth:`st`
        (``.shared::cluster``).  The peer must have started before the first
        access and must not exit before the last: fence both with a
        :meth:`cluster_sync` or an arrive/wait pair."""
        if self.cluster is None:
            raise PtxBuildError(f"mapa: kernel {self.name} is not built with cluster=..., so "
                                "it has no peer CTAs to address")
        addr = self._as_addr(addr)
        if addr.space != "shared":
            raise PtxBuildError(f"mapa maps a .shared address, got .{addr.space}")
        base = addr.base
        if isinstance(base, Symbol):
            a = self.mov(base, T.u32)
        elif isinstance(base, Reg) and base.type.bits == 32:
            a = base
        else:
            raise PtxTypeError(f"mapa needs a 32-bit shared address, got {base!r}")
        if addr.offset:
            a = self.add(a, addr.offset)
        d = self.reg(T.u32)
        self.emit("mapa", ["shared::cluster"], [T.u32], [d, a, as_operand(rank, T.u32)],
                  _own_frames=1)
        return Address(d, 0, "shared::cluster", addr.elem)

    def barrier_cluster_arrive(self, sem="release"):
        """``barrier.cluster.arrive{.release|.relaxed}.aligned`` (sm_90): this
        thread arrives at the cluster's barrier; :meth:`barrier_cluster_wait`
        then waits for every thread of every CTA of the cluster.  ``release``
        makes this thread's earlier writes (to its own or a peer's shared
        memory) visible to the waiters; ``"relaxed"`` orders nothing (an arrival
        that only says "this CTA has started")."""
        if sem not in ("release", "relaxed"):
            raise PtxBuildError(f"barrier.cluster.arrive takes sem='release' or 'relaxed', "
                                f"got {sem!r}")
        return self.emit("barrier.cluster.arrive", [sem, "aligned"], [], [], dsts=0,
                         _own_frames=1)

    def barrier_cluster_wait(self):
        """``barrier.cluster.wait.acquire.aligned`` (sm_90): wait until every
        thread of the cluster has arrived (:meth:`barrier_cluster_arrive`)."""
        return self.emit("barrier.cluster.wait", ["acquire", "aligned"], [], [], dsts=0,
                         _own_frames=1)

    def cluster_sync(self):
        """Arrive (release) and wait (acquire): a barrier over the cluster."""
        self.barrier_cluster_arrive("release")
        self.barrier_cluster_wait()

    def fence_proxy_async(self, space="shared::cta"):
        """``fence.proxy.async.<space>`` (sm_90): order this thread's earlier
        ordinary (generic-proxy) accesses of ``space`` before later accesses
        by the bulk copy engine (async proxy), e.g. before a stage that was
        read or written with ``ld``/``st`` is refilled by ``cp.async.bulk``."""
        return self.emit("fence.proxy.async", [space], [], [], dsts=0, _own_frames=1)

    def shfl_sync(self, mode, value, lane, clamp=None, mask=FULL_MASK, *, out=None):
        """``shfl.sync.mode.b32``: ``mode`` is up, down, bfly or idx.

        ``clamp`` defaults to 0 for ``up`` and 31 (0x1f) otherwise."""
        if value.type.bits != 32:
            raise PtxTypeError(f"shfl.sync moves 32-bit values, got {value.type.name}")
        if clamp is None:
            clamp = 0 if mode == "up" else 0x1F
        d = self._out(value.type, out)
        self.emit("shfl", ["sync", mode], [T.b32],
                  [d, value, as_operand(lane, T.u32), as_operand(clamp, T.u32),
                   as_operand(mask, T.u32)], _own_frames=1)
        return d

    def shfl_down(self, value, delta, mask=FULL_MASK):
        return self.shfl_sync("down", value, delta, mask=mask)

    def shfl_up(self, value, delta, mask=FULL_MASK):
        return self.shfl_sync("up", value, delta, mask=mask)

    def shfl_xor(self, value, lanemask, mask=FULL_MASK):
        return self.shfl_sync("bfly", value, lanemask, mask=mask)

    def shfl_idx(self, value, lane, mask=FULL_MASK):
        return self.shfl_sync("idx", value, lane, mask=mask)

    def vote_sync(self, mode, p, mask=FULL_MASK):
        """``vote.sync.{all,any,uni}.pred`` or ``vote.sync.ballot.b32``."""
        if mode == "ballot":
            d = self.reg(T.u32)
            self.emit("vote", ["sync", "ballot"], [T.b32], [d, p, as_operand(mask, T.u32)],
                      _own_frames=1)
        else:
            d = self.reg(T.pred)
            self.emit("vote", ["sync", mode], [T.pred], [d, p, as_operand(mask, T.u32)],
                      _own_frames=1)
        return d

    # ------------------------------------------------------------- control
    def ret(self, *, guard=None):
        return self.emit("ret", [], [], [], guard=guard, dsts=0, _own_frames=1)

    def exit(self, *, guard=None):
        return self.emit("exit", [], [], [], guard=guard, dsts=0, _own_frames=1)

    # ------------------------------------------------- special registers
    @property
    def laneid(self):
        return self.mov(SpecialReg("%laneid", T.u32))

    @property
    def warpid(self):
        return self.mov(SpecialReg("%warpid", T.u32))

    @property
    def smid(self):
        """``%smid``: the SM this thread runs on (a u32 register; 0 in the
        emulator).  Valid only for the read: a CTA stays on its SM, but the
        numbering need not be contiguous."""
        return self.mov(SpecialReg("%smid", T.u32))

    @property
    def cluster_ctarank(self):
        """``%cluster_ctarank``: this CTA's rank in its cluster (u32, sm_90)."""
        return self.mov(SpecialReg("%cluster_ctarank", T.u32, 90))

    @property
    def cluster_nctarank(self):
        """``%cluster_nctarank``: the number of CTAs in the cluster (u32, sm_90)."""
        return self.mov(SpecialReg("%cluster_nctarank", T.u32, 90))

    def clock64(self):
        """``%clock64``: this SM's cycle counter (not comparable across SMs)."""
        return self.mov(SpecialReg("%clock64", T.u64))

    def globaltimer(self):
        """``%globaltimer``: the GPU's nanosecond timer, one clock for every SM
        (a fresh u64 register per call; 0 in the emulator)."""
        return self.mov(SpecialReg("%globaltimer", T.u64))

    def global_id(self, dim="x"):
        """``ctaid * ntid + tid`` along ``dim`` (a u32 register)."""
        c = getattr(self.ctaid, dim)
        n = getattr(self.ntid, dim)
        t = getattr(self.tid, dim)
        return self.mad(c, n, t)


def _noftz(op, ty) -> list:
    """Packed-half atomic adds must say ``.noftz`` (PTX ISA, atom)."""
    return ["noftz"] if op == "add" and ty.is_packed else []


def _is_half(ty) -> bool:
    return ty.is_float and (ty.bits == 16 or ty.is_packed)


def _fmods(rnd, ftz, sat):
    if not (ftz or sat):   # the common case, written out: it is hot
        return (rnd,) if rnd else ()
    return tuple(m for m, on in ((rnd, rnd), ("ftz", ftz), ("sat", sat)) if on)


def _half_bits(ty, value) -> int:
    import numpy as np
    vals = value if isinstance(value, (tuple, list)) else (value,) * (2 if ty.is_packed else 1)
    out = 0
    for i, v in enumerate(vals):
        if ty.name.startswith("bf16"):
            b = int(np.array(v, dtype=np.float32).view(np.uint32))
            # round to nearest even into the top 16 bits
            b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        else:
            b = int(np.array(v, dtype=np.float16).view(np.uint16))
        out |= (b & 0xFFFF) << (16 * i)
    return out


_ = NotPred
