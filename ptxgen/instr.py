"""Instructions as built: opcode, modifiers, type suffixes, operands, guard.

An :class:`Instr` is plain data; rendering it to PTX text is
``Instr.render()``.  Labels placed in the instruction stream are
:class:`LabelDef` entries; comments are :class:`Comment` entries.
"""

from __future__ import annotations

from .values import Address, NotPred, Operand, TensorRef

__all__ = ["Instr", "LabelDef", "Comment", "Vec", "render_operand"]


class Vec:
    """A brace-enclosed operand vector ``{%f1, %f2, %f3, %f4}``."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = tuple(items)

    @property
    def type(self):
        return self.items[0].type

    def render(self) -> str:
        return "{" + ", ".join(render_operand(x) for x in self.items) + "}"

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


def render_operand(x) -> str:
    return x.render()


class Instr:
    """One PTX instruction."""

    __slots__ = ("op", "mods", "types", "operands", "guard", "loc", "dsts", "opcode")

    def __init__(self, op, mods, types, operands, guard=None, loc=None, dsts=1, opcode=None):
        self.op = op
        self.mods = mods if mods.__class__ is tuple else tuple(mods)
        self.types = types if types.__class__ is tuple else tuple(types)
        self.operands = operands if operands.__class__ is tuple else tuple(operands)
        self.guard = guard
        self.loc = loc
        #: how many leading operands are written (0 for st/red/bar/bra)
        self.dsts = dsts
        #: the full dotted opcode, e.g. ``ld.global.nc.v4.f32`` (the builder
        #: passes it in from its cache of instruction forms)
        if opcode is None:
            opcode = ".".join([op, *self.mods, *(t.name for t in self.types)])
        self.opcode = opcode

    def written(self):
        """Registers this instruction writes."""
        out = []
        for o in self.operands[:self.dsts]:
            if isinstance(o, Vec):
                out.extend(o.items)
            else:
                out.append(o)
        return out

    def read(self):
        """Operands this instruction reads (registers inside addresses too)."""
        out = []
        for o in self.operands[self.dsts:]:
            cls = o.__class__
            if cls is Address:
                out.append(o.base)
            elif cls is Vec or cls is NotPred or cls is TensorRef:
                out.extend(leaves(o))
            else:
                out.append(o)
        if self.guard is not None:
            out.extend(leaves(self.guard))
        return out

    def render(self) -> str:
        ops = ", ".join([o.render() for o in self.operands])
        text = f"{self.opcode} \t{ops};" if ops else self.opcode + ";"
        if self.guard is not None:
            return f"@{self.guard.render()} {text}"
        return text

    def __repr__(self) -> str:
        return f"Instr({self.render()})"


def leaves(o):
    if isinstance(o, Vec):
        out = []
        for x in o.items:
            out.extend(leaves(x))
        return out
    if isinstance(o, Address):
        return [o.base]
    if isinstance(o, NotPred):
        return [o.pred]
    if isinstance(o, TensorRef):
        return [o.base, *o.coords]
    return [o]


class LabelDef:
    """A label placed in the instruction stream."""

    __slots__ = ("label", "loc")

    def __init__(self, label, loc=None):
        self.label = label
        self.loc = loc

    def render(self) -> str:
        return f"{self.label.name}:"


class Comment:
    __slots__ = ("text", "loc")

    def __init__(self, text, loc=None):
        self.text = text
        self.loc = loc

    def render(self) -> str:
        return f"// {self.text}"


_ = Operand  # re-exported type for annotations
