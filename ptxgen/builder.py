"""The kernel builder: a cursor that appends checked instructions to a kernel.

A :class:`KernelBuilder` owns one kernel's registers, parameters, shared
arrays, directives and instruction list.  It is created by
``Module.kernel(...)``; nothing in ptxgen is global, so several kernels can
be built at once from different threads.

Every instruction passes through :meth:`KernelBuilder.emit`, which checks it
against the instruction table (:mod:`ptxgen.isa`) and the module's target,
and records the user's source line for error messages and annotations.
The instruction methods themselves (``add``, ``ld``, ``shfl_sync`` ...) live
in :mod:`ptxgen.instructions`; structured control flow in
:mod:`ptxgen.control`.

Nothing a builder makes points back at it strongly: registers and shared
arrays hold its :class:`~ptxgen.values.KernelRef` (a weak reference), the
builder holds its module weakly, and the module holds its builders.  So a
dropped module is freed by reference counting alone, with nothing left for
Python's cyclic garbage collector (whose runs are costly with many objects
alive, and must not happen inside a CUDA graph capture).
"""

from __future__ import annotations

import re
import weakref

from . import isa
from . import types as T
from .checks import check_operands, verify_kernel
from .control import ControlFlowMixin
from .errors import PtxBuildError, PtxTypeError, TargetError, caller_loc
from .target import MAX_PTX, MAX_STATIC_SHARED, SHARED_LINE
from .instr import Comment, Instr, LabelDef, Vec, leaves
from .instructions import InstructionsMixin
from .tensorcore import TensorCoreMixin
from .values import (Address, Imm, KernelRef, Label, NotPred, Operand, Ptr, Reg,
                     SpecialReg, Symbol, TensorRef, Var)

__all__ = ["KernelBuilder", "Param"]

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")


class Param:
    """A declared kernel parameter."""

    __slots__ = ("name", "type", "pointer_space", "align", "symbol", "count")

    def __init__(self, name, ty, pointer_space=None, align=None, count=None):
        self.name = name
        self.type = ty
        self.pointer_space = pointer_space
        self.align = align
        #: element count of a by-value byte array (``.b8 name[count]``), else None
        self.count = count
        self.symbol = Symbol(name, "param", ty, ty=ty if count is None else T.u64)

    def render_decl(self) -> str:
        if self.count is not None:
            return f".param .align {self.align} .{self.type.name} {self.name}[{self.count}]"
        s = f".param .{self.type.name}"
        if self.pointer_space is not None:
            s += f" .ptr .{self.pointer_space}"
            if self.align:
                s += f" .align {self.align}"
        return f"{s} {self.name}"


class _Dims:
    """``k.tid.x`` style access to a special register triple (made on each
    ``k.tid``, so the builder does not hold it: it would be a cycle)."""

    __slots__ = ("kb", "base")

    def __init__(self, kb, base):
        self.kb = kb
        self.base = base

    def _get(self, c):
        return self.kb.mov(SpecialReg(f"%{self.base}.{c}", T.u32))

    x = property(lambda self: self._get("x"))
    y = property(lambda self: self._get("y"))
    z = property(lambda self: self._get("z"))


class KernelBuilder(InstructionsMixin, TensorCoreMixin, ControlFlowMixin):
    """Builds one ``.entry`` kernel.

    Parameters
    ----------
    module : ptxgen.Module
        The module the kernel belongs to (gives the target; held weakly,
        the module holds the kernel).
    name : str
        The kernel's PTX name.
    maxntid, reqntid : tuple of int, optional
        ``.maxntid`` / ``.reqntid`` launch bounds (1 to 3 dimensions).
    minnctapersm : int, optional
        ``.minnctapersm`` occupancy hint (needs ``maxntid`` or ``reqntid``).
    cluster : int or tuple of int, optional
        ``.reqnctapercluster``: the kernel runs in thread-block clusters of
        this shape (sm_90), so its CTAs can use :meth:`mapa` and
        :meth:`barrier_cluster_arrive` / :meth:`barrier_cluster_wait`; every
        launch's grid must be a multiple of it.  At most 8 CTAs (the portable
        cluster size).
    """

    def __init__(self, module, name, *, maxntid=None, reqntid=None, minnctapersm=None,
                 cluster=None):
        if not _IDENT.match(name):
            raise PtxBuildError(f"kernel name {name!r} is not a valid PTX identifier")
        self._module = weakref.ref(module)
        self.target = module.target
        self.name = name
        #: the weak reference to this builder that its values hold
        self.ref = KernelRef(self)
        self.maxntid = _dims3(maxntid, "maxntid")
        self.reqntid = _dims3(reqntid, "reqntid")
        if minnctapersm is not None and self.maxntid is None and self.reqntid is None:
            raise PtxBuildError(".minnctapersm needs .maxntid or .reqntid as well")
        self.minnctapersm = minnctapersm
        self.cluster = _dims3(cluster, "cluster")
        #: the newest PTX ISA version one of its instructions needs
        self.ptx_needed: tuple[int, int] = self.target.ptx_version
        if self.cluster is not None:
            if self.target.sm < 90:
                raise TargetError(f"cluster={cluster!r}: thread-block clusters need sm_90, the "
                                  f"target is {self.target.name}")
            n = self.cluster[0] * self.cluster[1] * self.cluster[2]
            if n > 8:
                raise PtxBuildError(f"cluster={cluster!r} has {n} CTAs; the portable limit "
                                    f"is 8")
            self.ptx_needed = max(self.ptx_needed, (7, 8))
        self.params: list[Param] = []
        self.shared: list[Symbol] = []
        self.body: list = []
        self._reg_counts: dict[T.PtxType, int] = {}
        self._defined: set[int] = set()      # id() of written registers
        self._labels: dict[str, Label] = {}
        self._placed: set[str] = set()
        self._branches: list[tuple[Label, object]] = []
        self._label_seq = 0
        self._guards: list = []
        self._loops: list = []
        self._open_blocks = 0
        self.finished = False
        self.loc = caller_loc(1)

    @property
    def module(self):
        """The module the kernel belongs to (None once it is dropped)."""
        return self._module()

    tid = property(lambda self: _Dims(self, "tid"))
    ntid = property(lambda self: _Dims(self, "ntid"))
    ctaid = property(lambda self: _Dims(self, "ctaid"))
    nctaid = property(lambda self: _Dims(self, "nctaid"))

    # ------------------------------------------------------------------ regs
    def reg(self, ty: T.PtxType) -> Reg:
        """A fresh write-once register of type ``ty``."""
        # the check is for type names and 8-bit types; skip it when ty is
        # already a register type (the hot case)
        rty = ty if ty in _REGISTER_TYPES else self._check_reg_type(ty)
        return Reg(self.ref, rty, self._next_index(rty))

    def var(self, ty: T.PtxType, init=None) -> Var:
        """A mutable register, optionally initialised (``mov``) to ``init``."""
        ty = self._check_reg_type(ty)
        v = Var(self.ref, ty, self._next_index(ty))
        if init is not None:
            self.assign(v, init)
        return v

    def ptr_reg(self, elem: T.PtxType, space: str = "global") -> Ptr:
        return Ptr(self.ref, self._next_index(T.u64), T.type_by_name(elem), space)

    def _check_reg_type(self, ty):
        if ty.__class__ is not T.PtxType:
            ty = T.type_by_name(ty)
        if not ty.can_be_register:
            raise PtxTypeError(f"PTX has no {ty.name} registers; load {ty.name} "
                               "values into a 16- or 32-bit register")
        return ty

    def _next_index(self, ty) -> int:
        n = self._reg_counts.get(ty, 0) + 1
        self._reg_counts[ty] = n
        return n

    def reg_counts(self) -> list[tuple[T.PtxType, int]]:
        """(type, count) for the register declarations, in type order."""
        return [(t, self._reg_counts[t]) for t in T.ALL_TYPES if t in self._reg_counts]

    # ---------------------------------------------------------------- params
    def param(self, name: str, ty) -> Reg:
        """Declare a scalar parameter and return a register holding its value."""
        p = self._declare_param(name, T.type_by_name(ty))
        r = self.reg(p.type)
        self.emit("ld", ["param"], [p.type], [r, Address(p.symbol, 0, "param")], _own_frames=1)
        return r

    def param_ptr(self, name: str, elem, space: str = "global", align: int | None = None) -> Ptr:
        """Declare a pointer parameter (``.param .u64 .ptr .global``) and return
        a :class:`Ptr` to ``elem`` values in ``space``, converted from the
        generic address with ``cvta.to``."""
        elem = T.type_by_name(elem)
        if space not in ("global", "shared"):
            raise PtxBuildError(f"pointer space {space!r} is not one of global, shared "
                                "(ptxgen declares no .const variables to point at)")
        p = self._declare_param(name, T.u64, pointer_space=space, align=align or elem.bytes)
        raw = self.reg(T.u64)
        self.emit("ld", ["param"], [T.u64], [raw, Address(p.symbol, 0, "param")], _own_frames=1)
        out = self.ptr_reg(elem, space)
        self.emit("cvta", ["to", space], [T.u64], [out, raw], _own_frames=1)
        return out

    def _declare_param(self, name, ty, pointer_space=None, align=None, count=None) -> Param:
        if not _IDENT.match(name):
            raise PtxBuildError(f"parameter name {name!r} is not a valid PTX identifier")
        if any(p.name == name for p in self.params):
            raise PtxBuildError(f"parameter {name!r} is declared twice")
        if count is None and (ty.is_pred or ty.bits < 16 and not ty.is_int):
            raise PtxTypeError(f"a kernel parameter cannot be {ty.name}")
        p = Param(name, ty, pointer_space, align, count)
        self.params.append(p)
        return p

    def param_symbol(self, name: str) -> Symbol:
        for p in self.params:
            if p.name == name:
                return p.symbol
        raise PtxBuildError(f"kernel {self.name} has no parameter {name!r}")

    # ---------------------------------------------------------------- shared
    def shared_array(self, name: str, elem, count: int, align: int | None = None) -> Symbol:
        """A static ``.shared`` array of ``count`` ``elem`` values."""
        elem = T.type_by_name(elem)
        if not isinstance(count, int) or count <= 0:
            raise PtxBuildError(f"shared array {name!r} needs a positive count, got {count!r}")
        return self._add_shared(name, elem, count, align or elem.bytes)

    def dynamic_shared(self, name: str, elem, align: int = SHARED_LINE) -> Symbol:
        """The ``.extern .shared`` array sized at launch time.  It is placed
        after the static arrays at ``align``, by default a whole line
        (:data:`ptxgen.target.SHARED_LINE`), so wide copies into it do not
        straddle lines."""
        if any(s.count is None for s in self.shared):
            raise PtxBuildError("a kernel has at most one dynamic shared array")
        return self._add_shared(name, T.type_by_name(elem), None, align)

    def _add_shared(self, name, elem, count, align):
        if not _IDENT.match(name):
            raise PtxBuildError(f"shared array name {name!r} is not a valid PTX identifier")
        if align & (align - 1):
            raise PtxBuildError(f"alignment {align} of {name!r} is not a power of two")
        if any(s.name == name for s in self.shared):
            raise PtxBuildError(f"shared array {name!r} is declared twice")
        sym = Symbol(name, "shared", elem, count, align, kernel_ref=self.ref)
        total = self.static_shared_bytes + (sym.nbytes if count is not None else 0)
        if total > MAX_STATIC_SHARED:
            raise PtxBuildError(f"shared array {name!r} brings the static shared memory of "
                                f"kernel {self.name!r} to {total} bytes; at most "
                                f"{MAX_STATIC_SHARED} can be static (use dynamic_shared for "
                                f"more)")
        self.shared.append(sym)
        return sym

    @property
    def static_shared_bytes(self) -> int:
        return sum(s.nbytes for s in self.shared if s.count is not None)

    # --------------------------------------------------------------- emitting
    def emit(self, op: str, mods, types, operands, *, guard=None, dsts=None,
             _own_frames=0) -> Instr:
        """Append one instruction after checking it against the table.

        This is the single path every instruction takes; the instruction
        methods build their operands and call it.  They pass ``_own_frames``:
        how many frames above this one are certainly ptxgen's (1 for a method
        that calls ``emit`` itself, 2 for a private helper, whose caller is
        always a ptxgen method), so :func:`caller_loc` need not look at them.
        """
        if self.finished:
            raise PtxBuildError(f"kernel {self.name} is already finished")
        loc = caller_loc(1 + _own_frames)
        if guard is None and self._guards:
            guard = self._guards[-1]
        if mods.__class__ is not tuple:
            mods = tuple(mods)
        if types.__class__ is not tuple:
            types = tuple(types)
        if operands.__class__ is not tuple:
            operands = tuple(operands)
        # The table checks depend only on the form and the operands' kinds and
        # types, so a form seen before with the same signature is known good.
        # The cache keeps what the instructions of a form have in common: the
        # number of destinations, the opcode text, and the first instance's
        # mods and types tuples (equal ones), which later instances share:
        # fewer objects for the garbage collector to walk.
        key = (op, mods, types, self.target, dsts, _signature(operands))
        form = _FORMS.get(key)
        if form is None:
            sp = _TABLE.get(op) or isa.spec(op)
            ndst = sp.ndst if dsts is None else dsts
            ins = Instr(op, mods, types, operands, guard, loc, ndst)
            need = self._check_form(sp, ins, loc)
            # an ISA beyond the target's default raises the module's .version
            newer = need if need > self.target.ptx_version else None
            form = _FORMS[key] = (mods, types, ndst, ins.opcode, newer)
        mods, types, ndst, opcode, newer = form
        if newer is not None and newer > self.ptx_needed:
            self.ptx_needed = newer
        ins = Instr(op, mods, types, operands, guard, loc, ndst, opcode)
        defined = self._defined
        me = self.ref
        for o in operands[ndst:]:
            cls = o.__class__
            if cls is Reg or cls is Var or cls is Ptr:
                if o.kernel_ref is me and id(o) in defined:
                    continue
                self._use(o, loc)
            elif cls is Imm or cls is Label or cls is Symbol:
                continue
            elif cls is Address:
                if o.base.__class__ is not Symbol:
                    self._use(o.base, loc)
            else:
                for x in leaves(o):
                    self._use(x, loc)
        if guard is not None:
            for x in leaves(guard):
                self._use(x, loc)
        for r in operands[:ndst]:
            cls = r.__class__
            if cls is Reg or cls is Ptr:
                if r.kernel_ref is me and id(r) not in defined:
                    defined.add(id(r))
                    continue
            elif cls is Var and r.kernel_ref is me:
                defined.add(id(r))
                continue
            for x in (r.items if cls is Vec else (r,)):
                self._define(x, loc, guarded=guard is not None)
        self.body.append(ins)
        return ins

    def _check_form(self, sp, ins, loc):
        op, mods, types = ins.op, ins.mods, ins.types
        err = sp.check_mods(mods) or sp.check_types(types) or sp.check_combination(mods, types)
        if err:
            raise PtxTypeError(err, loc)
        need_sm, need_ptx = sp.requirement(mods, types)
        if not self.target.supports(need_sm, need_ptx):
            full = ".".join([op, *mods, *(t.name for t in types)])
            raise TargetError(
                f"{full} needs sm_{need_sm} and PTX ISA {need_ptx[0]}.{need_ptx[1]}; "
                f"target {self.target.name} has sm_{self.target.sm} and "
                f"PTX ISA {self.target.version_text} (at most {MAX_PTX[0]}.{MAX_PTX[1]})", loc)
        if sp.arch_specific and not self.target.arch_specific:
            full = ".".join([op, *mods, *(t.name for t in types)])
            raise TargetError(
                f"{full} needs the architecture-specific target sm_{need_sm}a; target "
                f"{self.target.name} lacks it (build for sm_{need_sm}a)", loc)
        check_operands(self, sp, ins, loc)
        return need_ptx

    def _define(self, r, loc, guarded):
        if not isinstance(r, Reg):
            raise PtxBuildError(f"cannot write to read-only operand {r.render()}", loc)
        if r.kernel_ref is not self.ref:
            raise self._foreign(r, loc)
        key = id(r)
        if key in self._defined and not r.mutable:
            raise PtxBuildError(
                f"register {r.name} is written twice; make it with k.var(...) "
                "if its value changes", loc)
        self._defined.add(key)

    def _use(self, o, loc):
        if isinstance(o, Reg):
            if o.kernel_ref is not self.ref:
                raise self._foreign(o, loc)
            if id(o) not in self._defined:
                raise PtxBuildError(f"register {o.name} ({o.type}) is read before "
                                    "anything writes it", loc)
        elif isinstance(o, SpecialReg) and o.min_sm > self.target.sm:
            raise TargetError(f"{o.name} needs sm_{o.min_sm}", loc)

    def _foreign(self, r, loc):
        """The error for a register of another kernel, alive or gone."""
        ref = r.kernel_ref
        gone = ", which is gone (its Module was dropped)" if ref() is None else ""
        return PtxBuildError(f"register {r.name} belongs to kernel {ref.name}{gone}, "
                             f"not {self.name}", loc)

    def comment(self, text: str):
        """Put a ``// comment`` line in the emitted body."""
        self.body.append(Comment(text.replace("\n", " "), caller_loc(1)))

    # ---------------------------------------------------------------- labels
    def label(self, name: str | None = None) -> Label:
        """A new label; place it with :meth:`place` and jump with :meth:`bra`.

        Without ``name`` a unique one is made."""
        if name is None:
            return self._auto_label("L")
        if not _IDENT.match(name.lstrip("$")):
            raise PtxBuildError(f"label name {name!r} is not a valid PTX identifier")
        if name in self._labels:
            return self._labels[name]
        lab = Label(name, caller_loc(1))
        self._labels[name] = lab
        return lab

    def _auto_label(self, hint: str) -> Label:
        self._label_seq += 1
        name = f"$L_{hint}_{self._label_seq}"
        lab = Label(name, caller_loc(2))   # its callers are ptxgen's: label(), control.py
        self._labels[name] = lab
        return lab

    def place(self, label: Label):
        """Place ``label`` at the current point."""
        loc = caller_loc(1)
        if label.name in self._placed:
            raise PtxBuildError(f"label {label.name} is placed twice", loc)
        if self._labels.get(label.name) is not label:
            raise PtxBuildError(f"label {label.name} was not made by kernel {self.name}", loc)
        self._placed.add(label.name)
        self.body.append(LabelDef(label, loc))

    def bra(self, label: Label, *, guard=None, uni=False):
        """Branch to ``label`` (``@guard`` when given)."""
        if not isinstance(label, Label):
            raise PtxTypeError(f"bra needs a Label, got {label!r}")
        ins = self.emit("bra", ["uni"] if uni else [], [], [label], guard=guard, dsts=0,
                        _own_frames=1)
        self._branches.append((label, ins.loc))
        return ins

    # ------------------------------------------------------------- finishing
    def finish(self):
        """Run the whole-kernel checks; called by the module before emission."""
        if self.finished:
            return self
        verify_kernel(self)
        self.finished = True
        return self

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            self.finish()
        return False


_FORMS: dict = {}   # see KernelBuilder.emit
_REGISTER_TYPES = frozenset(t for t in T.ALL_TYPES if t.can_be_register)
_TABLE = isa.TABLE


def _signature(operands) -> tuple:
    """What the table checks look at: each operand's kind and type.

    A plain operand adds its class and its type as two flat entries (it is
    the common case, and a tuple for each would cost time); vectors and
    addresses add one tuple each, labels their class alone.  Read left to
    right, the entries still parse one way only.
    """
    out = []
    for o in operands:
        cls = o.__class__
        if cls is Vec:
            out.append((cls, tuple((x.__class__, x.type) for x in o.items)))
        elif cls is Address:
            b = o.base
            out.append((cls, o.space, b.__class__, b.type,
                        b.space if b.__class__ is Symbol else None))
        elif cls is Label:
            out.append(cls)
        elif cls is TensorRef:
            out.append((cls, o.base.__class__, o.base.type,
                        tuple((c.__class__, c.type) for c in o.coords)))
        else:
            out += (cls, o.type)
    return tuple(out)


def _dims3(d, what):
    if d is None:
        return None
    if isinstance(d, int):
        d = (d,)
    d = tuple(int(x) for x in d)
    if not 1 <= len(d) <= 3 or any(x <= 0 for x in d):
        raise PtxBuildError(f".{what} needs 1 to 3 positive sizes, got {d}")
    return d + (1,) * (3 - len(d))


_ = (Imm, NotPred, Operand, Vec)
