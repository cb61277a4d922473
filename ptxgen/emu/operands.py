"""Compiled instructions and operand access.

Each PTX instruction becomes an :class:`Op` whose ``fn(st, m)`` runs it for
the threads of one block: ``st`` is the block state (registers, memory),
``m`` a boolean mask of the executing threads or ``None`` for all of them.

Registers are stored as unsigned integer arrays of their declared width
(bool for predicates), one element per thread, and are never modified in
place: a write replaces the array (``np.where`` for a partial mask), so one
array may safely back several registers.  Operands are read in the
*natural* numpy type of the instruction type (:data:`NAT`): ``u32`` as
uint32, ``s32`` as int32, ``f32`` as float32, ``f16`` as float16; ``bf16``
and the packed ``f16x2``/``bf16x2`` as their raw bits.
"""

from __future__ import annotations

import numpy as np

from .errors import PtxParseError, UnsupportedError
from .memory import PARAM_WINDOW
from ..isa import DEST_CODES

__all__ = ["Op", "NAT", "UINT", "SINT", "Ctx", "SEMANTICS", "semantics", "getter",
           "setter", "width", "NORMAL", "BRA", "EXIT", "BAR", "CBAR", "YIELD"]

NORMAL, BRA, EXIT, BAR, CBAR, YIELD = 0, 1, 2, 3, 4, 5

UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
SINT = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}
NAT = {
    "pred": np.bool_, "b8": np.uint8, "u8": np.uint8, "s8": np.int8,
    "b16": np.uint16, "u16": np.uint16, "s16": np.int16, "f16": np.float16, "bf16": np.uint16,
    "b32": np.uint32, "u32": np.uint32, "s32": np.int32, "f32": np.float32,
    "f16x2": np.uint32, "bf16x2": np.uint32,
    "b64": np.uint64, "u64": np.uint64, "s64": np.int64, "f64": np.float64,
}

#: opcode -> builder(stmt, ctx) -> Op
SEMANTICS: dict = {}


def semantics(*names):
    """Register a builder for the opcodes ``names``."""
    def deco(fn):
        for n in names:
            SEMANTICS[n] = fn
        return fn
    return deco


def width(ty) -> int:
    return 1 if ty.is_pred else ty.bits


class Op:
    """One compiled instruction."""

    __slots__ = ("kind", "fn", "guard", "neg", "reads", "writes", "line", "text",
                 "src", "target", "pc", "extra")

    def __init__(self, kind=NORMAL, fn=None):
        self.kind = kind
        self.fn = fn
        self.guard = None     # register index of the guard predicate
        self.neg = False
        self.reads = ()
        self.writes = ()
        self.line = 0
        self.text = ""
        self.src = None       # the builder's SourceLoc of the instruction, if known
        self.target = None    # branch target pc
        self.pc = 0
        self.extra = None     # bar: (id getter, count getter)


class Ctx:
    """What compiling one kernel needs: register indices and types, symbols."""

    def __init__(self, kt, sources=None):
        self.kt = kt
        self.sources = sources or {}
        self.reg_index = {}
        self.reg_types = []
        for name, ty in kt.regs.items():
            self.reg_index[name] = len(self.reg_types)
            self.reg_types.append(ty)
        self.shared_offsets, self.static_shared = kt.shared_layout()
        self.params = {p.name: p for p in kt.params}
        self.stmt = None

    def error(self, msg, cls=PtxParseError):
        s = self.stmt
        return cls(msg, line=s.line if s else None, text=s.text if s else None,
                   source=self.sources.get(s.line) if s else None)

    def reg(self, name):
        return self.reg_index[name]


def _imm_value(o, ty, ctx):
    """A numpy scalar of ``NAT[ty]`` for an immediate operand."""
    _, kind, v = o
    nat = NAT[ty.name]
    w = width(ty)
    if ty.is_pred:
        return np.bool_(v)
    if ty.name in ("f32", "f64"):
        if kind == "f32":
            val = float(np.uint32(v).view(np.float32))
        elif kind == "f64":
            val = float(np.uint64(v).view(np.float64))
        else:
            val = float(v)
        return nat(val)
    if kind != "int":
        raise ctx.error(f"a float immediate is not valid for .{ty.name}")
    bits = UINT[w](v % (1 << w))
    return bits.view(nat) if nat is not np.float16 else bits.view(np.float16)


def getter(ctx, o, ty):
    """A function ``st -> value`` reading operand ``o`` as type ``ty``."""
    nat = NAT[ty.name]
    w = width(ty)
    kind = o[0]
    if kind == "reg":
        i = ctx.reg(o[1])
        rw = width(ctx.reg_types[i])
        if ty.is_pred or ctx.reg_types[i].is_pred:
            if not (ty.is_pred and ctx.reg_types[i].is_pred):
                raise ctx.error(f"{o[1]} is a {ctx.reg_types[i].name} register, "
                                f"used as .{ty.name}")
            return lambda st: st.regs[i]
        if rw == w:
            if nat is UINT[w]:
                return lambda st: st.regs[i]
            return lambda st: st.regs[i].view(nat)
        if rw > w:
            u = UINT[w]
            return lambda st: st.regs[i].astype(u).view(nat)
        raise ctx.error(f"{o[1]} ({ctx.reg_types[i].name}) is narrower than .{ty.name}")
    if kind == "not":
        i = ctx.reg(o[1])
        return lambda st: ~st.regs[i]
    if kind == "imm":
        val = _imm_value(o, ty, ctx)
        return lambda st: val
    if kind == "sreg":
        name = o[1]
        if ty.is_float or ty.is_pred:
            raise ctx.error(f"{name} read as .{ty.name}")
        if w < 32:
            raise ctx.error(f"{name} read as .{ty.name}")
        return lambda st: st.sreg[name].astype(nat)
    if kind == "sym":
        name = o[1]
        if name in ctx.shared_offsets:
            val = nat(ctx.shared_offsets[name])
            return lambda st: val
        if name in ctx.params:
            if w != 64:
                raise ctx.error(f"the address of parameter {name} is 64 bits, read as "
                                f".{ty.name}")
            val = nat(PARAM_WINDOW + ctx.kt.param_offsets[name])
            return lambda st: val
        raise ctx.error(f"unknown symbol {name}")
    raise ctx.error(f"operand {o!r} cannot be read here")


def _store(i, bits):
    def put(st, value, m):
        v = np.asarray(value)
        if v.dtype != bits:
            v = v.astype(bits)
        if v.ndim == 0 or v.shape[0] != st.n:
            v = np.full(st.n, v, dtype=bits)
        st.regs[i] = v if m is None else np.where(m, v, st.regs[i])
    return put


def setter(ctx, o, ty):
    """A function ``(st, value, mask)`` writing ``value`` (natural type of
    ``ty``) to register operand ``o``, extending per ``ty``'s signedness."""
    if o[0] != "reg":
        raise ctx.error(f"the destination must be a register, got {o!r}")
    i = ctx.reg(o[1])
    rty = ctx.reg_types[i]
    if ty.is_pred or rty.is_pred:
        if not (ty.is_pred and rty.is_pred):
            raise ctx.error(f"{o[1]} is a {rty.name} register, written as .{ty.name}")
        return _store(i, np.bool_)
    w, rw = width(ty), width(rty)
    nat = NAT[ty.name]
    store = _store(i, UINT[rw])
    if rw == w:
        u = UINT[w]

        def put(st, value, m):
            v = np.asarray(value)
            if v.dtype != nat:
                v = v.astype(nat)
            store(st, v.view(u), m)
        return put
    if rw < w:
        raise ctx.error(f"{o[1]} ({rty.name}) is narrower than .{ty.name}")
    ext = SINT[w] if ty.is_signed else UINT[w]
    wide = SINT[rw] if ty.is_signed else UINT[rw]

    def put_ext(st, value, m):
        v = np.asarray(value)
        if v.dtype != nat:
            v = v.astype(nat)
        store(st, v.view(UINT[w]).view(ext).astype(wide).view(UINT[rw]), m)
    return put_ext


def reg_indices(o, ctx):
    """Register indices an operand refers to (vector elements, address base)."""
    if o[0] in ("reg", "not"):
        return [ctx.reg(o[1])]
    if o[0] == "vec":
        out = []
        for x in o[1]:
            out += reg_indices(x, ctx)
        return out
    if o[0] == "addr":
        return reg_indices(o[1], ctx)
    if o[0] == "tensor":
        return reg_indices(o[1], ctx) + reg_indices(("vec", o[2]), ctx)
    return []


_WRITE_CODES = DEST_CODES   # the instruction table's written-operand codes


def finish_op(op, stmt, ctx, spec):
    """Fill in the reads/writes/line of ``op`` from the operand codes."""
    reads, writes = [], []
    for code, o in zip(spec.operands, stmt.operands):
        (writes if code.rstrip("?") in _WRITE_CODES else reads).extend(reg_indices(o, ctx))
    op.reads = tuple(dict.fromkeys(reads))
    op.writes = tuple(dict.fromkeys(writes))
    op.line = stmt.line
    op.text = stmt.text
    if stmt.guard is not None:
        op.guard = ctx.reg(stmt.guard[0])
        op.neg = stmt.guard[1]
    return op

