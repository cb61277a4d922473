"""Operands: registers, immediates, addresses, special registers, symbols.

Registers are typed and belong to one kernel.  Arithmetic operators on them
emit instructions through that kernel's builder, with strict typing: both
sides must have the same type (a Python ``int``/``float`` takes the
register's type).  ``<``, ``<=``, ``>``, ``>=`` give predicate registers;
equality is spelled ``a.eq(b)`` / ``a.ne(b)`` because ``==`` stays identity.

A register or shared array reaches its builder through a
:class:`KernelRef`, a weak reference: the builder holds the instructions
that hold the registers, so a strong one would make every kernel a
reference cycle, freed only by Python's cyclic garbage collector.
"""

from __future__ import annotations

import struct
import weakref

from . import types as T
from .errors import PtxBuildError, PtxTypeError

__all__ = ["Operand", "Reg", "Var", "Ptr", "Imm", "Address", "SpecialReg",
           "NotPred", "Symbol", "Label", "TensorRef", "KernelRef", "format_imm",
           "as_operand"]


class KernelRef(weakref.ref):
    """A weak reference to a kernel's builder that remembers the kernel's
    name, for the error when a value outlives its kernel.

    Each builder makes one (``kb.ref``) and hands it to every register and
    shared array it makes, so ``value.kernel_ref is kb.ref`` tells whether
    a value belongs to ``kb``.
    """

    __slots__ = ("name",)

    def __new__(cls, kb):
        return super().__new__(cls, kb)

    def __init__(self, kb):
        super().__init__(kb)
        self.name = kb.name

    def gone(self, what: str) -> PtxBuildError:
        """The error for ``what`` (such as ``register %r5``) used after the
        kernel is gone."""
        return PtxBuildError(f"{what} belongs to kernel {self.name}, which is gone: its "
                             "Module was dropped, so it can no longer be built on "
                             "(keep the Module while its values are in use)")


class Operand:
    """Base of everything that can appear as an instruction operand."""

    __slots__ = ()
    type: T.PtxType
    readonly = True

    def render(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError


# --------------------------------------------------------------------------
# immediates

def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _f64_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def format_imm(value, ty: T.PtxType) -> str:
    """Render a Python number as an exact PTX immediate of type ``ty``."""
    if ty.is_float:
        if ty is T.f32:
            return f"0f{_f32_bits(float(value)):08X}"
        if ty is T.f64:
            return f"0d{_f64_bits(float(value)):016X}"
        raise PtxTypeError(f"PTX has no {ty.name} immediates; load the value "
                           f"into a register with k.const({ty.name}, ...)")
    if ty.is_pred:
        return "1" if value else "0"
    v = int(value)
    if ty.is_signed:
        return str(v)
    # unsigned and bit types: hex keeps bit patterns readable
    if v < 0:
        v &= (1 << ty.bits) - 1
    return str(v) if v < 1024 else f"0x{v:X}"


class Imm(Operand):
    """An immediate value of a given type."""

    __slots__ = ("value", "type", "_text")

    def __init__(self, value, ty: T.PtxType):
        if ty.is_int or ty.is_bits:
            v = int(value)
            lo = -(1 << (ty.bits - 1)) if ty.is_signed else -(1 << (ty.bits - 1))
            hi = (1 << (ty.bits - 1)) - 1 if ty.is_signed else (1 << ty.bits) - 1
            if not lo <= v <= hi:
                raise PtxTypeError(f"immediate {value} does not fit in {ty.name}")
            value = v
        elif ty.is_float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PtxTypeError(f"immediate {value!r} is not a number for {ty.name}")
            value = float(value)
        self.value = value
        self.type = ty
        self._text = None

    def render(self) -> str:
        # kept: one Imm is shared by every use of a common value (as_operand)
        if self._text is None:
            self._text = format_imm(self.value, self.type)
        return self._text

    def __repr__(self) -> str:
        return f"Imm({self.value!r}, {self.type})"


# --------------------------------------------------------------------------
# registers

class Reg(Operand):
    """A typed virtual register of one kernel.

    A plain register is written once (by the instruction that made it); use
    :class:`Var` (``k.var(...)``) for values that change, such as loop
    counters and accumulators.
    """

    __slots__ = ("kernel_ref", "type", "index", "name", "__weakref__")
    readonly = False
    mutable = False

    def __init__(self, kernel_ref: KernelRef, ty: T.PtxType, index: int):
        #: the :class:`KernelRef` of the kernel the register belongs to
        self.kernel_ref = kernel_ref
        self.type = ty
        self.index = index
        self.name = f"{ty.reg_prefix}{index}"

    @property
    def kb(self):
        """The builder of the register's kernel (a :class:`PtxBuildError`
        if that kernel is gone)."""
        kb = self.kernel_ref()
        if kb is None:
            raise self.kernel_ref.gone(f"register {self.name}")
        return kb

    def render(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {self.type}>"

    __hash__ = object.__hash__

    # -- arithmetic --------------------------------------------------------
    def __add__(self, o):
        return self.kb.add(self, o)

    def __radd__(self, o):
        return self.kb.add(o, self)

    def __sub__(self, o):
        return self.kb.sub(self, o)

    def __rsub__(self, o):
        return self.kb.sub(o, self)

    def __mul__(self, o):
        return self.kb.mul(self, o)

    def __rmul__(self, o):
        return self.kb.mul(o, self)

    def __truediv__(self, o):
        return self.kb.div(self, o)

    def __rtruediv__(self, o):
        return self.kb.div(o, self)

    def __floordiv__(self, o):
        if self.type.is_float:
            raise PtxTypeError("'//' is integer division; use '/' for floats")
        return self.kb.div(self, o)

    def __mod__(self, o):
        return self.kb.rem(self, o)

    def __neg__(self):
        return self.kb.neg(self)

    def __and__(self, o):
        return self.kb.and_(self, o)

    def __rand__(self, o):
        return self.kb.and_(o, self)

    def __or__(self, o):
        return self.kb.or_(self, o)

    def __ror__(self, o):
        return self.kb.or_(o, self)

    def __xor__(self, o):
        return self.kb.xor(self, o)

    def __rxor__(self, o):
        return self.kb.xor(o, self)

    def __invert__(self):
        if self.type.is_pred:
            return NotPred(self)
        return self.kb.not_(self)

    def __lshift__(self, o):
        return self.kb.shl(self, o)

    def __rshift__(self, o):
        return self.kb.shr(self, o)

    # -- comparisons (give predicates) ------------------------------------
    def __lt__(self, o):
        return self.kb.setp("lt", self, o)

    def __le__(self, o):
        return self.kb.setp("le", self, o)

    def __gt__(self, o):
        return self.kb.setp("gt", self, o)

    def __ge__(self, o):
        return self.kb.setp("ge", self, o)

    def eq(self, o):
        return self.kb.setp("eq", self, o)

    def ne(self, o):
        return self.kb.setp("ne", self, o)

    def __bool__(self):
        raise PtxBuildError(
            f"a register ({self.name}) has no Python truth value: it is only known "
            "on the GPU; use k.if_(pred) instead of 'if', and k.for_range instead of 'range'")

    # -- conversions --------------------------------------------------------
    def to(self, ty: T.PtxType, rnd: str | None = None, sat: bool = False):
        """Convert to ``ty`` with ``cvt`` (rounding picked like C for floats)."""
        return self.kb.cvt(ty, self, rnd=rnd, sat=sat)

    def bitcast(self, ty: T.PtxType):
        """Reinterpret the bits as ``ty`` (same width), with ``mov``."""
        return self.kb.bitcast(ty, self)


class Var(Reg):
    """A mutable register: loop-carried state, accumulators, counters.

    ``v.set(x)`` writes it; ``v += x`` updates it in place.
    """

    __slots__ = ()
    mutable = True

    def set(self, value) -> "Var":
        self.kb.assign(self, value)
        return self

    def __iadd__(self, o):
        self.kb.add(self, o, out=self)
        return self

    def __isub__(self, o):
        self.kb.sub(self, o, out=self)
        return self

    def __imul__(self, o):
        self.kb.mul(self, o, out=self)
        return self

    def __iand__(self, o):
        self.kb.and_(self, o, out=self)
        return self

    def __ior__(self, o):
        self.kb.or_(self, o, out=self)
        return self

    def __ixor__(self, o):
        self.kb.xor(self, o, out=self)
        return self

    def __ilshift__(self, o):
        self.kb.shl(self, o, out=self)
        return self

    def __irshift__(self, o):
        self.kb.shr(self, o, out=self)
        return self


class Ptr(Reg):
    """A 64-bit address register that knows the element type it points at
    and its state space (``global`` or ``shared``), so ``p[i]`` builds an
    :class:`Address` with the index scaled by the element size."""

    __slots__ = ("elem", "space")

    def __init__(self, kernel_ref, index: int, elem: T.PtxType, space: str, ty=T.u64):
        super().__init__(kernel_ref, ty, index)
        self.elem = elem
        self.space = space

    def __getitem__(self, i) -> "Address":
        return self.kb.element(self, i)

    def __add__(self, i) -> "Ptr":
        """``p + i``: advanced by ``i`` elements, like C pointer arithmetic."""
        return self.kb.ptr_add(self, i)

    __radd__ = __add__

    def __repr__(self) -> str:
        return f"<Ptr {self.name}: {self.space} {self.elem}*>"


class NotPred(Operand):
    """A negated predicate, ``!%p1``: usable as a guard or a setp/selp input."""

    __slots__ = ("pred",)

    def __init__(self, p: Reg):
        if not p.type.is_pred:
            raise PtxTypeError(f"'~' on {p.name} for a guard needs a predicate")
        self.pred = p

    @property
    def type(self):
        return T.pred

    def render(self) -> str:
        return "!" + self.pred.render()

    def __invert__(self):
        return self.pred


class SpecialReg(Operand):
    """A read-only special register such as ``%tid.x`` or ``%laneid``."""

    __slots__ = ("name", "type", "min_sm")

    def __init__(self, name: str, ty: T.PtxType, min_sm: int = 20):
        self.name = name
        self.type = ty
        self.min_sm = min_sm

    def render(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"SpecialReg({self.name})"


class Symbol(Operand):
    """A named variable in a state space (``.shared`` array, kernel param)."""

    __slots__ = ("name", "space", "type", "elem", "count", "align", "kernel_ref")

    def __init__(self, name, space, elem, count=1, align=None, ty=None, kernel_ref=None):
        self.name = name
        self.space = space
        self.elem = elem
        self.count = count
        self.align = align
        #: the value type when used as a ``mov`` source (its address)
        self.type = ty if ty is not None else T.u32 if space == "shared" else T.u64
        #: the :class:`KernelRef` of the kernel that declared a shared
        #: array (None for a parameter)
        self.kernel_ref = kernel_ref

    @property
    def kernel(self):
        """The builder of the kernel that declared a shared array, None for
        a parameter (a :class:`PtxBuildError` if that kernel is gone)."""
        ref = self.kernel_ref
        if ref is None:
            return None
        kb = ref()
        if kb is None:
            raise ref.gone(f"shared array {self.name}")
        return kb

    def render(self) -> str:
        return self.name

    def __getitem__(self, i) -> "Address":
        kb = self.kernel
        if kb is None:
            raise PtxBuildError(f"{self.name} cannot be indexed here")
        return kb.element(self, i)

    @property
    def nbytes(self) -> int | None:
        return None if self.count is None else self.count * self.elem.bytes

    def __repr__(self) -> str:
        return f"Symbol({self.space} {self.elem} {self.name}[{self.count}])"


class Address(Operand):
    """A memory operand ``[base+offset]`` in a state space.

    ``base`` is a register (u64 for generic/global, u32 or u64 for shared) or
    a :class:`Symbol`; ``offset`` a byte offset.
    """

    __slots__ = ("base", "offset", "space", "elem")

    def __init__(self, base, offset: int = 0, space: str = "global", elem=None):
        self.base = base
        self.offset = int(offset)
        self.space = space
        self.elem = elem

    @property
    def type(self):
        return self.base.type

    def render(self) -> str:
        b = self.base.render()
        if self.offset > 0:
            return f"[{b}+{self.offset}]"
        if self.offset < 0:
            return f"[{b}+{self.offset}]"
        return f"[{b}]"

    def __add__(self, nbytes: int) -> "Address":
        """Byte offset: ``addr + 16`` is ``[base+16]``."""
        if not isinstance(nbytes, int):
            raise PtxTypeError("an Address offset must be a Python int (bytes)")
        return Address(self.base, self.offset + nbytes, self.space, self.elem)

    def __repr__(self) -> str:
        return f"Address({self.space} {self.render()})"


class TensorRef(Operand):
    """A TMA tensor operand ``[map, {c0, c1, ...}]``: the generic address of a
    tensor map (a u64 register) and the box's start coordinates (s32, the
    innermost dimension first)."""

    __slots__ = ("base", "coords")

    def __init__(self, base, coords):
        self.base = base
        self.coords = tuple(coords)

    @property
    def type(self):
        return self.base.type

    def render(self) -> str:
        return f"[{self.base.render()}, {{{', '.join(c.render() for c in self.coords)}}}]"

    def __repr__(self) -> str:
        return f"TensorRef({self.render()})"


class Label(Operand):
    """A branch target."""

    __slots__ = ("name", "loc")
    type = None

    def __init__(self, name: str, loc=None):
        self.name = name
        self.loc = loc

    def render(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Label({self.name})"


_int_imms: dict[tuple[int, T.PtxType], Imm] = {}
_MAX_INT_IMMS = 1 << 14


def as_operand(x, ty: T.PtxType | None):
    """Turn a Python number into an :class:`Imm` of type ``ty``."""
    if isinstance(x, Operand):
        return x
    if x.__class__ is int and ty is not None:
        # Immediates are never changed after they are made, and the same few
        # (shuffle masks, strides, offsets) recur in every unrolled block:
        # make each (value, type) once and share it.
        key = (x, ty)
        imm = _int_imms.get(key)
        if imm is None:
            imm = Imm(x, ty)
            if len(_int_imms) < _MAX_INT_IMMS:   # bound the memory
                _int_imms[key] = imm
        return imm
    if isinstance(x, bool):
        raise PtxTypeError("a Python bool is not a PTX operand; use a predicate register")
    if isinstance(x, (int, float)):
        if ty is None:
            raise PtxTypeError(f"cannot infer a PTX type for the Python value {x!r}")
        if isinstance(x, float) and not ty.is_float:
            raise PtxTypeError(f"float {x!r} used where {ty.name} is expected")
        return Imm(x, ty)
    raise PtxTypeError(f"{x!r} ({type(x).__name__}) is not a PTX operand")
