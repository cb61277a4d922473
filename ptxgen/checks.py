"""Checks: each instruction's operands against its table entry, and the
whole-kernel checks that run before emission (labels, open blocks).

Errors carry the user's ``file:line`` recorded when the instruction was built.
"""

from __future__ import annotations

from . import types as T
from .errors import PtxTypeError, PtxVerifyError
from .instr import Vec
from .values import Address, Imm, Label, NotPred, Reg, SpecialReg, Symbol

__all__ = ["check_operands", "verify_kernel", "wide_of"]

_WIDE = {T.u16: T.u32, T.s16: T.s32, T.u32: T.u64, T.s32: T.s64,
         T.b16: T.b32, T.b32: T.b64}


def wide_of(ty: T.PtxType) -> T.PtxType:
    try:
        return _WIDE[ty]
    except KeyError:
        raise PtxTypeError(f".wide is not defined for {ty.name}") from None


def _desc(o) -> str:
    if isinstance(o, Reg):
        return f"{o.name} ({o.type.name})"
    if isinstance(o, Imm):
        return f"immediate {o.render()} ({o.type.name})"
    if isinstance(o, (SpecialReg, Symbol)):
        return f"{o.name} ({o.type.name})"
    if isinstance(o, Vec):
        return "{" + ", ".join(_desc(x) for x in o.items) + "}"
    return repr(o)


def _fits(o, want: T.PtxType, *, widen_ok=False) -> bool:
    if isinstance(o, NotPred):
        return want.is_pred
    if isinstance(o, Symbol):
        return want.bits in (32, 64) and not want.is_float
    ty = getattr(o, "type", None)
    if ty is None:
        return False
    if T.compatible(ty, want):
        return True
    if widen_ok and want.bits <= 16 and not ty.is_pred and not ty.is_float \
            and ty.bits >= want.bits and (want.is_int or want.is_bits or want.is_float):
        # ld/st/cvt of 8/16-bit memory types through a wider integer register
        return ty.bits >= 16
    return False


def check_operands(kb, sp, ins, loc):
    """Check the operand list of ``ins`` against the spec ``sp``."""
    ops = ins.operands
    codes = sp.operands
    required = [c for c in codes if not c.endswith("?")]
    if not len(required) <= len(ops) <= len(codes):
        raise PtxTypeError(f"{ins.opcode} takes {len(required)}"
                           + (f" to {len(codes)}" if len(codes) != len(required) else "")
                           + f" operands, got {len(ops)}", loc)
    tys = ins.types
    t1 = tys[0] if tys else None
    t2 = tys[1] if len(tys) > 1 else None
    wide = "wide" in ins.mods
    if sp.name in ("dp4a", "dp2a"):
        acc = T.u32 if t1 is T.u32 and t2 is T.u32 else T.s32
        want = [acc, T.b32, T.b32, acc]
        for i, (o, w) in enumerate(zip(ops, want)):
            if not _fits(o, w):
                raise PtxTypeError(f"{ins.opcode} operand {i + 1} must be {w.name}, "
                                   f"got {_desc(o)}", loc)
        return
    for i, (code, o) in enumerate(zip(codes, ops)):
        code = code.rstrip("?")
        what = _What(ins, i)
        if code in ("d", "s"):
            want = t1
        elif code in ("D", "C"):
            want = wide_of(t1) if wide else t1
        elif code in ("d2", "s2"):
            want = t2
        elif code in ("u", "du"):
            want = T.u32
        elif code in ("p", "q"):
            if not _fits(o, T.pred) or isinstance(o, Imm):
                raise PtxTypeError(f"{what} must be a predicate, got {_desc(o)}", loc)
            if code == "p" and isinstance(o, NotPred):
                raise PtxTypeError(f"{what} is written and cannot be negated", loc)
            continue
        elif code == "m":
            _check_address(ins, o, what, loc)
            continue
        elif code == "l":
            if not isinstance(o, Label):
                raise PtxTypeError(f"{what} must be a label, got {_desc(o)}", loc)
            continue
        elif code in ("V", "W"):
            _check_vector(ins, o, t1, what, loc)
            continue
        elif code in ("fA", "fB", "fC", "fD"):
            _check_fragment(ins, code, o, what, loc)
            continue
        elif code in ("xd", "xs", "gD", "gA", "g", "i", "t"):
            check_tensorcore_operand(ins, code, o, what, loc)
            continue
        else:  # pragma: no cover - table error
            raise AssertionError(f"unknown operand code {code}")
        if code in ("d", "D", "d2", "du") and not isinstance(o, Reg):
            raise PtxTypeError(f"{what} is written, so it must be a register, "
                               f"got read-only {_desc(o)}", loc)
        widen = sp.name == "cvt" and code in ("d", "s2")
        if isinstance(o, Imm):
            if not T.compatible(o.type, want) and not (want.bits == o.type.bits):
                raise PtxTypeError(f"{what} should be {want.name}, got {_desc(o)}", loc)
        elif not _fits(o, want, widen_ok=widen):
            raise PtxTypeError(f"{what}: {ins.opcode} got a {_opnd_type(o)} operand "
                               f"{_desc(o)} where {want.name} is expected", loc)


class _What:
    """``"add.f32 operand 2"``, rendered only when an error needs it."""

    __slots__ = ("ins", "i")

    def __init__(self, ins, i):
        self.ins, self.i = ins, i

    def __str__(self) -> str:
        return f"{self.ins.opcode} operand {self.i + 1}"

    __format__ = lambda self, spec: str(self)  # noqa: E731


def _opnd_type(o) -> str:
    ty = getattr(o, "type", None)
    return ty.name if ty is not None else type(o).__name__


def _vec_count(ins) -> int:
    if "v4" in ins.mods:
        return 4
    if "v2" in ins.mods:
        return 2
    return 1


def _check_vector(ins, o, t1, what, loc):
    items = o.items if isinstance(o, Vec) else (o,)
    if ins.op == "mov":
        if isinstance(o, Vec):
            total = sum(x.type.bits for x in items)
            if total != t1.bits:
                raise PtxTypeError(f"{what}: the vector {_desc(o)} has {total} bits; "
                                   f"{ins.opcode} needs {t1.bits}", loc)
            return
        if not _fits(o, t1):
            raise PtxTypeError(f"{what}: {ins.opcode} got a {_opnd_type(o)} operand "
                               f"{_desc(o)} where {t1.name} is expected", loc)
        return
    n = _vec_count(ins)
    if len(items) != n:
        raise PtxTypeError(f"{what}: {ins.opcode} moves {n} value(s), got {len(items)}", loc)
    for x in items:
        if isinstance(x, Imm):
            raise PtxTypeError(f"{what}: {ins.opcode} needs registers, got {_desc(x)}", loc)
        if not _fits(x, t1, widen_ok=True):
            raise PtxTypeError(f"{what}: {ins.opcode} got a {_opnd_type(x)} operand "
                               f"{_desc(x)} where {t1.name} is expected", loc)


def _check_address(ins, a, what, loc):
    if not isinstance(a, Address):
        raise PtxTypeError(f"{what} must be a memory address [..], got {_desc(a)}", loc)
    spaces = {"global", "shared", "shared::cta", "shared::cluster", "param", "local", "const"}
    inst_space = next((m for m in ins.mods if m in spaces), None)
    if inst_space == "shared::cta":
        inst_space = "shared"
    elif inst_space == "shared::cluster" and a.space == "shared":
        # a CTA's own shared address is also its address in the cluster window
        inst_space = "shared"
    if ins.op == "cp.async":       # cp.async.shared.global [dst], [src]
        inst_space = "shared" if a is ins.operands[0] else "global"
    elif ins.op == "cp.async.bulk":    # [dst] shared, [src] global, size, [mbarrier] shared
        inst_space = "global" if a is ins.operands[1] else "shared"
    elif ins.op == "cp.async.bulk.tensor":     # [dst] shared, [map, {..}], [mbarrier] shared
        inst_space = "shared"
    if inst_space is not None and a.space != inst_space and a.space != "generic":
        raise PtxTypeError(f"{what}: a {a.space} address used by {ins.opcode}", loc)
    if inst_space is None and a.space not in ("generic",):
        raise PtxTypeError(f"{what}: {ins.opcode} has no state space but the address "
                           f"is in .{a.space}", loc)
    base = a.base
    if isinstance(base, Symbol):
        if base.space == "param" and ins.op == "ld" and ins.types:
            want = base.type
            got = ins.types[0]
            if not T.compatible(got, want):
                raise PtxTypeError(f"parameter {base.name} is {want.name} but is loaded "
                                   f"as {got.name}", loc)
        return
    if not isinstance(base, Reg) or base.type.bits not in (32, 64) or base.type.is_float:
        raise PtxTypeError(f"{what}: an address base must be a 32/64-bit integer "
                           f"register or a symbol, got {_desc(base)}", loc)
    if base.type.bits == 32 and a.space not in ("shared", "shared::cluster", "local"):
        raise PtxTypeError(f"{what}: a 32-bit address register {base.name} can only "
                           f"address .shared or .local, not .{a.space}", loc)


#: mma.sync fragment sizes (registers of A, B) by shape; C and D take 4
MMA_FRAGMENTS = {"m16n8k16": (4, 2), "m16n8k8": (2, 1), "m16n8k32": (4, 2)}


def _check_fragment(ins, code, o, what, loc):
    shape = next((m for m in ins.mods if m in MMA_FRAGMENTS), "m16n8k16")
    na, nb = MMA_FRAGMENTS[shape]
    n = {"fA": na, "fB": nb}.get(code, 4)
    want = T.b32 if code in ("fA", "fB") else ins.types[0]
    items = o.items if isinstance(o, Vec) else ()
    if len(items) != n:
        raise PtxTypeError(f"{what}: {ins.opcode} needs a fragment of {n} registers", loc)
    for x in items:
        if not _fits(x, want) or isinstance(x, Imm):
            raise PtxTypeError(f"{what}: fragment element {_desc(x)} should be {want.name}", loc)


def check_tensorcore_operand(ins, code, o, what, loc):
    """ldmatrix/stmatrix vectors, wgmma operands and TMA tensor operands."""
    from .values import TensorRef
    if code in ("xd", "xs"):
        n = {"x1": 1, "x2": 2, "x4": 4}[next(m for m in ins.mods if m in ("x1", "x2", "x4"))]
        items = o.items if isinstance(o, Vec) else (o,)
        if len(items) != n or any(isinstance(x, Imm) or not _fits(x, T.b32) for x in items):
            raise PtxTypeError(f"{what}: {ins.opcode} takes {n} b32 register(s), "
                               f"got {_desc(o)}", loc)
    elif code == "gD":
        items = o.items if isinstance(o, Vec) else ()
        if not items or any(not isinstance(x, Reg) or not _fits(x, ins.types[0]) for x in items):
            raise PtxTypeError(f"{what}: {ins.opcode} accumulates in a vector of "
                               f"{ins.types[0].name} registers, got {_desc(o)}", loc)
    elif code in ("gA", "g"):
        if code == "gA" and isinstance(o, Vec):
            if len(o.items) != 4 or any(isinstance(x, Imm) or not _fits(x, T.b32)
                                        for x in o.items):
                raise PtxTypeError(f"{what}: A in registers is 4 b32 registers, got "
                                   f"{_desc(o)}", loc)
        elif not isinstance(o, Reg) or o.type.bits != 64 or o.type.is_float:
            raise PtxTypeError(f"{what}: a matrix descriptor is a 64-bit integer register, "
                               f"got {_desc(o)}", loc)
    elif code == "i":
        if not isinstance(o, Imm) or not (o.type.is_int or o.type.is_bits):
            raise PtxTypeError(f"{what} must be an integer constant, got {_desc(o)}", loc)
    elif code == "t":
        if not isinstance(o, TensorRef):
            raise PtxTypeError(f"{what} must be a tensor operand [map, {{coords}}], "
                               f"got {_desc(o)}", loc)
        rank = int(next(m for m in ins.mods if m.endswith("d") and m[:-1].isdigit())[:-1])
        if len(o.coords) != rank:
            raise PtxTypeError(f"{what}: a {rank}d tensor copy takes {rank} coordinates, "
                               f"got {len(o.coords)}", loc)


def verify_kernel(kb):
    """Whole-kernel checks: branches to labels never placed, unclosed blocks."""
    if kb._open_blocks:
        raise PtxVerifyError(f"kernel {kb.name} has {kb._open_blocks} control-flow "
                             "block(s) still open", kb.loc)
    for label, loc in kb._branches:
        if label.name not in kb._placed:
            raise PtxVerifyError(f"branch to label {label.name}, which is never placed", loc)
