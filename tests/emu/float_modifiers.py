"""The float forms of the instruction table and which of them PTX defines.

A *combination* is ``(opcode, modifier, type)``: one modifier of the
table's groups (``""`` for none) on one type suffix.  :func:`table_combos`
lists every combination the table (``ptxgen.isa.TABLE``) lets the builder
emit for the float arithmetic and special-function opcodes;
:data:`NOT_PTX` names, with the PTX ISA's reason, those the table allows but
PTX does not define (ptxas refuses them, so no oracle can be run on a GPU).
Every other combination must be in :data:`COVERED`, the set
tests/emu/test_emu_modifiers.py runs against exact oracles;
``test_every_float_combination_is_tested`` fails on one that is not, and
``test_ptxas_agrees_with_the_split`` has ptxas accept every tested form and
refuse every one named here.
"""

from __future__ import annotations

from ptxgen.isa import TABLE

FLOAT_OPS = ("add", "sub", "mul", "fma", "div", "neg", "abs", "min", "max",
             "rcp", "sqrt", "rsqrt", "ex2", "lg2", "sin", "cos", "tanh")
FLOAT_TYPES = ("f32", "f64", "f16", "f16x2", "bf16", "bf16x2")
HALVES = ("f16", "f16x2", "bf16", "bf16x2")
ROUND = ("rn", "rz", "rm", "rp")
APPROX_ONLY = ("rsqrt", "ex2", "lg2", "sin", "cos", "tanh")


def table_combos():
    """Every (op, modifier, type) of FLOAT_OPS on a float type the table allows."""
    out = set()
    for op in FLOAT_OPS:
        sp = TABLE[op]
        mods = [""] + [m for g in sp.mods for m in g]
        for ty in sp.types[0]:
            if ty not in FLOAT_TYPES:
                continue
            for m in mods:
                if (m, ty) not in sp.exclude:
                    out.add((op, m, ty))
    return out


def not_ptx(op, mod, ty):
    """The PTX ISA's reason it has no ``op.mod.ty``, or None where it has."""
    if mod in ("lo", "hi", "wide"):
        return "lo/hi/wide select the half of an integer product"
    if mod in ("sat",) and ty not in ("f32", "f16", "f16x2"):
        return ".sat is defined on f32, f16 and f16x2 only"
    if mod == "sat" and op not in ("add", "sub", "mul", "fma"):
        return ".sat belongs to add, sub, mul and fma"
    if mod == "ftz" and ty not in ("f32", "f16", "f16x2"):
        if not (op == "rsqrt" and ty == "f64"):
            return ".ftz is defined on f32 (and f16/f16x2 arithmetic) only"
    if mod == "ftz" and ty in ("f16", "f16x2") and op not in (
            "add", "sub", "mul", "fma", "neg", "abs", "min", "max"):
        return "no .ftz form of this half-precision instruction"
    if mod == "relu" and ty not in HALVES:
        return "fma.relu is defined on f16, f16x2, bf16 and bf16x2 only"
    if mod in ROUND[1:] and ty in HALVES:
        return "half-precision arithmetic rounds to nearest (.rn) only"
    if mod == "NaN" and ty == "f64":
        return "min/max.NaN is not defined on f64"
    if mod in ("approx", "full") and ty != "f32" and not (op == "rsqrt" and ty == "f64"):
        return ".approx/.full forms are f32 (rsqrt also f64)"
    if mod == "" and op in ("fma", "rcp", "sqrt") + APPROX_ONLY:
        return "this instruction needs a rounding modifier or .approx"
    if mod == "" and op == "div" and ty in ("f32", "f64"):
        return "div on floats needs .approx, .full or a rounding modifier"
    if mod in ROUND and op in APPROX_ONLY:
        return "only an .approx form exists"
    if op in ("rcp", "sqrt", "div") and ty in HALVES:
        return "no half-precision form"
    if op in ("min", "max") and mod in ROUND:
        return "min/max do not round"
    return None


NOT_PTX = {c: not_ptx(*c) for c in table_combos() if not_ptx(*c)}
