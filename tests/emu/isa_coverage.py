"""Every (opcode, modifier, type) the instruction table allows, and what
covers each.

A *combination* is ``(opcode, modifier, types)``: one modifier of the
table's groups (``""`` for none) on one choice of type suffixes (joined by
dots, ``"s32.f32"`` for ``cvt.s32.f32``; ``""`` for an opcode without
types).  :func:`table_combos` lists every combination ``ptxgen.isa.TABLE``
lets the builder emit.  tests/emu/test_emu_isa_coverage.py fails on one
that is neither

- run against an exact oracle: the float forms in
  tests/emu/test_emu_modifiers.py, the integer, bit, compare/select forms
  in test_emu_int_modifiers.py, cvt and mov in test_emu_cvt_modifiers.py,
  ld/st/atom/red in test_emu_memory_modifiers.py, barriers, fences,
  branches, cvta and cp.async in test_emu_sync_forms.py (their ``COVERED``
  sets), or an opcode named in test_emu_isa_coverage.py's ``BY_TEST`` with
  the existing tests that run its forms (tensor cores, asynchronous
  copies, mbarriers); nor
- named by :func:`not_ptx` as one PTX does not define (with the ISA's
  reason; ptxas refuses each, see the ``test_ptxas_agrees_*`` tests).
"""

from __future__ import annotations

import itertools

from ptxgen import types as T
from ptxgen.isa import TABLE

__all__ = ["TABLE", "table_combos", "ptxas_takes", "ALU_OPS", "MEM_OPS", "emitted_mods", "mem_mods", "emit_combo",
           "not_ptx", "type_tuple"]

#: the opcodes tests/emu/test_emu_int_modifiers.py and test_emu_cvt_modifiers.py
#: build from their table entry alone (register operands, no memory)
ALU_OPS = ("add", "sub", "mul", "mad", "div", "rem", "neg", "abs", "min", "max",
           "popc", "clz", "and", "or", "xor", "not", "shl", "shr", "bfe", "bfi",
           "prmt", "dp4a", "dp2a", "setp", "selp", "cvt", "mov")
FLOAT = ("f32", "f64", "f16", "f16x2", "bf16", "bf16x2")
#: the opcodes tests/emu/test_emu_memory_modifiers.py builds from their table entry
MEM_OPS = ("ld", "st", "atom", "red")


def table_combos(ops=None):
    """Every (op, modifier, types) of ``ops`` (default: the whole table)."""
    out = set()
    for op in ops or TABLE:
        sp = TABLE[op]
        mods = [""] + [m for g in sp.mods for m in g]
        for tys in itertools.product(*sp.types):
            ty = ".".join(tys)
            for m in mods:
                if not any((m, t) in sp.exclude for t in tys):
                    out.add((op, m, ty))
    return out


def type_tuple(ty):
    return tuple(T.type_by_name(t) for t in ty.split(".")) if ty else ()


def emitted_mods(op, mod, ty):
    """The modifiers a test emits for a combination: ``mod`` plus what the
    instruction needs to exist (integer ``mul``/``mad`` a mode, ``.sat`` on
    ``mad`` the ``.hi``, a conversion its rounding, ``setp`` a comparison)."""
    tys = ty.split(".")
    if op == "mul" and mod == "" and tys[0] not in FLOAT:
        return ["lo"]
    if op == "mad" and mod in ("", "sat"):
        return ["hi", "sat"] if mod == "sat" else ["lo"]
    if op == "setp" and mod in ("and", "or", "xor", "ftz", ""):
        cmp = "eq" if tys[0].startswith("b") else "lt"
        return [cmp] + ([mod] if mod else [])
    if op == "cvt":
        d, s = (T.type_by_name(t) for t in tys)
        need = None
        if d.is_float and s.is_float:
            if d.bits < s.bits or (d.bits == s.bits and d is not s):
                need = "rn"
        elif d.is_float:
            need = "rn"
        elif s.is_float:
            need = "rzi"
        if mod in ("", "ftz", "sat") and need:
            return [need] + ([mod] if mod else [])
    if op == "dp2a" and mod == "":
        return ["lo"]
    return [mod] if mod else []


def _dest_type(op, code, tys, mods):
    t0 = tys[0] if tys else None
    if code == "d":
        return t0
    if code == "D":
        return _wide(t0) if "wide" in mods else t0
    if code == "d2":
        return tys[1] if op == "cvt" else (T.s32 if T.s32 in tys else T.u32)
    if code == "du":
        return T.u32
    if code == "p":
        return T.pred
    raise AssertionError(code)


def _src_type(op, code, tys, mods):
    if code == "s":
        return tys[0]
    if code == "C":
        return _wide(tys[0]) if "wide" in mods else tys[0]
    if code == "s2":
        if op in ("dp4a", "dp2a"):
            return T.s32 if T.s32 in tys else T.u32
        return tys[1]
    if code == "u":
        return T.u32
    if code == "q":
        return T.pred
    raise AssertionError(code)


def _wide(t):
    return T.type_by_name(f"{t.name[0]}{t.bits * 2}")


def operand_types(op, mods, tys):
    """(destination type, [source types]) of an ALU form."""
    sp = TABLE[op]
    codes = [c.rstrip("?") for c in sp.operands]
    if op == "cvt":
        return tys[0], [tys[1]]
    if op in ("dp4a", "dp2a"):
        acc = T.s32 if T.s32 in tys else T.u32
        return acc, [T.b32, T.b32, acc]
    if op in ("mov",):
        return tys[0], [tys[0]]
    srcs = []
    for c in codes[1:]:
        if c == "q" and op == "setp" and not any(m in ("and", "or", "xor") for m in mods):
            continue
        srcs.append(_src_type(op, c, tys, mods))
    return _dest_type(op, codes[0], tys, mods), srcs


def emit_combo(k, op, mods, tys, srcs):
    """Emit ``op.mods.tys d, srcs...`` with a fresh destination; return it."""
    dty, _ = operand_types(op, mods, tys)
    d = k.reg(dty)
    k.emit(op, list(mods), list(tys), [d, *srcs])
    return d


def load_sources(k, stys, tag=""):
    """Registers of types ``stys`` loaded from fresh pointer parameters
    (a predicate from a u32 that is nonzero)."""
    out = []
    for j, t in enumerate(stys):
        if t is T.pred:
            p = k.param_ptr(f"q{tag}{j}", T.u32)
            out.append(k.setp("ne", k.ld(p[0]), 0))
        else:
            lt = T.type_by_name({"b16": "u16", "b32": "u32", "b64": "u64"}.get(t.name, t.name))
            p = k.param_ptr(f"s{tag}{j}", lt)
            r = k.ld(p[0])
            out.append(r if lt is t else k.bitcast(t, r))
    return out


_FLOAT_MODS = ("rn", "rz", "rm", "rp", "ftz", "approx", "full", "NaN")
_INTS = ("u16", "u32", "u64", "s16", "s32", "s64")


def _cvt_not_ptx(mod, d, s):
    df, sf = d in FLOAT, s in FLOAT
    if mod == "ftz" and "f32" not in (d, s):
        return "cvt.ftz needs an f32 source or destination"
    if mod in ("rn", "rz", "rm", "rp"):
        if not df:
            return "an integer destination takes .rni/.rzi/.rmi/.rpi"
        if sf and (d == s or s != "bf16" and T.type_by_name(d).bits > T.type_by_name(s).bits):
            return "a widening or same-type float cvt is exact: no float rounding"
    if mod in ("rni", "rzi", "rmi", "rpi") and not (sf and (not df or d == s)):
        return "integer rounding belongs to float -> integer and float -> same float"
    if mod == "sat":
        if "bf16" in (d, s):
            return "no cvt.sat form with bf16"
        if not (df or sf):
            dt, st = T.type_by_name(d), T.type_by_name(s)
            lo_ok = dt.is_signed or not st.is_signed
            hi_ok = dt.bits - dt.is_signed >= st.bits - st.is_signed
            if lo_ok and hi_ok:
                return "the destination holds every source value: .sat has nothing to clamp"
    return None


def not_ptx(op, mod, ty):
    """The PTX ISA's reason it has no ``op.mod.ty`` (integer, bit, compare,
    select and conversion forms), or None where it has (ptxas agrees, see
    ``test_ptxas_agrees_with_the_int_split``)."""
    tys = ty.split(".")
    t0 = tys[0]
    if op == "cvt":
        return _cvt_not_ptx(mod, *tys)
    if op in MEM_OPS:
        return _mem_not_ptx(op, mod, ty)
    if op in ("mma", "wgmma.mma_async"):
        return _tc_not_ptx(op, mod, ty)
    if op == "setp" and mod == "ftz" and t0 not in ("f32", "f16"):
        return "setp.ftz is defined on f32 (and f16) only"
    if op == "selp" and ty in ("f16", "bf16"):
        return "ptxas refuses selp.f16/.bf16 (select on .b16)"
    if t0 in FLOAT:
        return None                        # float forms: float_modifiers.py
    if op in ("add", "sub", "mul", "div", "neg", "abs", "min", "max") and mod in _FLOAT_MODS:
        return f".{mod} is a floating-point modifier"
    if mod == "sat" and op in ("add", "sub", "mad") and t0 != "s32":
        return "integer .sat is defined on s32 only"
    if mod == "sat" and op == "mul":
        return "integer mul has no .sat"
    if mod == "wide" and t0 in ("u64", "s64"):
        return ".wide doubles 16- and 32-bit operands only"
    if op == "setp" and mod == "ftz":
        return "setp.ftz is defined on f32 (and f16) only"
    if op == "setp" and mod in ("lo", "ls", "hi", "hs") and t0.startswith("b"):
        return "ptxas refuses the unsigned compares on .bN (use .uN)"
    return None



# ------------------------------------------------------------ memory forms

ATOM_OPS = ("add", "min", "max", "inc", "dec", "and", "or", "xor", "cas", "exch")
_SCOPES = ("cta", "cluster", "gpu", "sys")
_GLOBAL_ONLY = ("ca", "cg", "cs", "lu", "cv", "nc", "wb", "wt", "L2::64B", "L2::128B",
                "L2::256B", "L1::evict_normal", "L1::evict_unchanged", "L1::evict_first",
                "L1::evict_last", "L1::no_allocate", "v2", "v4")
#: the operation an atom/red runs when the combination names none
DEFAULT_ATOM_OP = {"u32": "add", "s32": "add", "u64": "add", "s64": "min", "f32": "add",
                   "f64": "add", "f16x2": "add", "bf16x2": "add", "b32": "xor", "b64": "xor"}


def mem_mods(op, mod, ty):
    """The modifiers a test emits for a memory combination, in the table's
    order: ``mod`` plus what the instruction needs (a scope with
    .relaxed/.acquire/.release, .relaxed with a scope, .global with a cache,
    eviction, prefetch or vector modifier, an operation for atom/red, .noftz
    on packed halves).  No state space means a generic address."""
    m = [mod] if mod else []
    if mod in ("relaxed", "acquire", "release", "acq_rel"):
        m.append("gpu")
    if mod in _SCOPES:
        m.append("relaxed")
    if op in ("ld", "st"):
        if mod in _GLOBAL_ONLY:
            m.append("global")
    else:
        if mod in ("relaxed", "acquire", "release", "acq_rel") + _SCOPES:
            m.append("global")
        if not any(x in ATOM_OPS for x in m):
            m.append(DEFAULT_ATOM_OP[ty])
        if ty in ("f16x2", "bf16x2") and "noftz" not in m:
            m.append("noftz")
    order = [x for g in TABLE[op].mods for x in g]
    return sorted(set(m), key=order.index)


def _mem_not_ptx(op, mod, ty):
    if op in ("ld", "st"):
        if op == "st" and mod == "param":
            return "a kernel's parameters are read-only: st.param writes a call's arguments"
        if mod == "v4" and ty.endswith("64"):
            return "a .v4 of 64-bit elements is a 256-bit access (PTX 8.8, sm_100)"
        return None
    kind = mod if mod in ATOM_OPS else DEFAULT_ATOM_OP[ty]
    if mod == "noftz" and ty not in ("f16x2", "bf16x2"):
        return ".noftz belongs to the f16x2/bf16x2 additions"
    if kind in ("and", "or", "xor", "cas", "exch") and ty not in ("b32", "b64"):
        return "the bitwise operations, exch and cas take .b32/.b64"
    if kind in ("inc", "dec") and ty != "u32":
        return "inc/dec are defined on .u32 only"
    if kind == "add" and ty in ("s64", "b32", "b64"):
        return "add takes .u32/.s32/.u64/.f32/.f64 and the packed halves (no .s64, no .bN)"
    if kind in ("min", "max") and ty in ("f32", "f64", "b32", "b64"):
        return "min/max take .u32/.s32/.u64/.s64 (and halves as vector atomics)"
    if kind in ("min", "max") and ty in ("f16x2", "bf16x2"):
        return "min/max on packed halves exist only as vector atomics (.v2/.v4/.v8, PTX 8.1)"
    return None


# ------------------------------------------------------------ tensor cores

def _tc_not_ptx(op, mod, ty):
    d, a, b = ty.split(".")[:3]
    c = ty.split(".")[3] if op == "mma" else d
    if (a in ("f16", "bf16") or b in ("f16", "bf16")) and a != b:
        return "A and B are both f16, both bf16, or both 8-bit integers"
    integer = a in ("s8", "u8")
    if (d, c) != (("s32", "s32") if integer else ("f32", "f32")):
        return "D and C are f32 for f16/bf16 inputs and s32 for s8/u8"
    if op == "wgmma.mma_async":
        if integer and a != b:
            return "mixed-sign 8-bit wgmma needs PTX ISA 8.4 (ptxgen emits at most 8.0)"
        if mod.startswith("m64n"):
            n, k = (int(x) for x in mod[4:].split("k"))
            if k != (32 if integer else 16):
                return "wgmma is m64nNk16 for f16/bf16 and m64nNk32 for s8/u8"
            if integer and not (n in (8, 16, 24, 32) or n % 16 == 0 and 48 <= n <= 256):
                return "8-bit wgmma takes N = 8, 16, 24, 32, then 48 to 256 by 16"
    return None


# ------------------------------------------------------------ sync, control, cvta

#: what each single-modifier combination of these opcodes emits (its
#: required parts added); the forms tests/emu/test_emu_sync_forms.py runs
SYNC_OPS = ("bar", "fence", "membar", "fence.proxy.async", "fence.mbarrier_init",
            "griddepcontrol", "barrier.cluster.arrive", "barrier.cluster.wait", "bra", "ret",
            "exit", "cvta", "cp.async")


def sync_mods(op, mod):
    """The modifiers a test emits for a combination of :data:`SYNC_OPS`."""
    m = [mod] if mod else []
    need = {"bar": (("sync", "arrive"), "sync"), "fence": (_SCOPES, "gpu"),
            "membar": (("cta", "gl", "sys"), "gl"),
            "griddepcontrol": (("launch_dependents", "wait"), "wait"),
            "cvta": (("global", "shared", "param"), "global"),
            "cp.async": (("ca", "cg"), "cg")}
    if op in need and not any(x in need[op][0] for x in m):
        m.append(need[op][1])
    if op == "fence.mbarrier_init":
        m = ["release", "cluster"]
    if op == "cp.async":
        m += [x for x in ("shared", "global") if x not in m and not (
            x == "shared" and "shared::cta" in m)]
    order = [x for g in TABLE[op].mods for x in g]
    return sorted(set(m), key=order.index)


def ptxas_takes(forms, ptx_of, refused=()):
    """The forms among ``forms`` (each named not PTX) that ptxas for sm_90
    assembles all the same: ``ptx_of(form)`` is its one-instruction kernel;
    a form whose build raises one of ``refused`` (the builder refusing it
    first) is not a finding."""
    from ptxgen.errors import PtxBuildError
    from ptxgen.ptxas import PtxasError, assemble
    taken = []
    for c in forms:
        try:
            text = ptx_of(c)
        except (PtxBuildError, *refused):
            continue
        try:
            assemble(text, "sm_90")
            taken.append(c)
        except PtxasError:
            pass
    return taken

