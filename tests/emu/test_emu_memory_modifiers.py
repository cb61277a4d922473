"""Every ld, st, atom and red form of the instruction table against an
exact oracle: the bytes in memory (numpy), the extension rules of narrow
loads, and each atomic operation written out on Python numbers.

A form is one modifier of the table (a memory order, scope, state space,
cache or eviction hint, L2 prefetch size, vector width, operation) on one
type, completed by what the instruction needs (tests/emu/isa_coverage.py,
``mem_mods``): the orders and hints do not change a value, so each form is
checked for the value it moves.  Which forms exist is decided by
``isa_coverage.not_ptx`` (checked against ptxas); the enumeration in
test_emu_isa_coverage.py fails on a table combination that is neither run
here (``COVERED``) nor elsewhere.  One kernel per type and instruction
runs every form of it, 64 threads, each on its own elements.
"""

import math
from fractions import Fraction

import numpy as np
import pytest

import isa_coverage as IC
import ptxgen
from ptxgen import types as T
from ptxgen.instr import Vec
from ptxgen.values import Address
from test_emu_rounding import ref_round

NT = 64          # threads; thread i owns elements 4i .. 4i+3
SHARED = ("shared", "shared::cta", "shared::cluster")


def _combos(op):
    return sorted(c for c in IC.table_combos([op]) if not IC.not_ptx(*c))


LD, ST, ATOM, RED = (_combos(o) for o in ("ld", "st", "atom", "red"))
COVERED = set(LD) | set(ST) | set(ATOM) | set(RED)


def _space(mods):
    return next((m for m in mods if m in ("global", "param") + SHARED), "generic")


def _vec(mods):
    return 4 if "v4" in mods else 2 if "v2" in mods else 1


def _bits(ty):
    return 8 if ty.endswith("8") else T.type_by_name(ty).bits


def _u(bits):
    return T.type_by_name(f"u{bits}")


def _reg_type(ty):
    """The register a value of memory type ``ty`` travels in."""
    if _bits(ty) == 8:
        return T.s32 if ty == "s8" else T.u32
    return T.type_by_name(ty)


def _as_u(k, r):
    return r if r.type.name.startswith("u") else k.bitcast(_u(r.type.bits), r)


def _generic(k, name, elem_bytes, i, j=0):
    """A generic address of element ``4i + j`` of the array in param ``name``."""
    base = k.param(name, T.u64)
    off = k.mul(k.cvt(T.u64, i), 4 * elem_bytes)
    return Address(k.add(base, off), j * elem_bytes, "generic")


# ------------------------------------------------------------ ld and st

def _memory(rng, ty):
    bits = _bits(ty)
    if ty in ("f32", "f64"):     # floats as values, NaN payloads and subnormals included
        raw = rng.integers(0, 1 << min(bits, 63), 4 * NT, dtype=np.uint64)
        raw[:4] = [0x7FC0_0001 if bits == 32 else 0x7FF0_0000_0000_0001, 1, 1 << (bits - 1), 0]
        return raw.astype(f"u{bits // 8}")
    return rng.integers(0, 1 << bits, 4 * NT, dtype=np.uint64).astype(f"u{max(bits, 8) // 8}")


def _loaded(mem, ty):
    """What a load of each element puts in its register (as unsigned bits)."""
    v = [int(x) for x in mem]
    if ty == "s8":
        return [(x - 256 if x >= 128 else x) & 0xFFFF_FFFF for x in v]
    return v


def _ld_kernel(ty, combos):
    m = ptxgen.Module("sm_90")
    size = max(_bits(ty), 8) // 8
    with m.kernel("lds", reqntid=NT) as k:
        xp = k.param_ptr("x", _u(size * 8))
        outs = [k.param_ptr(f"o{j}", _u(_reg_type(ty).bits)) for j in range(len(combos))]
        pty = _u(_bits(ty)) if ty.startswith("b") else T.type_by_name(ty)
        pv = k._declare_param("pv", pty)
        sh = k.shared_array("sh", _u(size * 8), 4 * NT)
        i = k.tid.x
        e = i * 4
        for j in range(4):
            k.st(sh[e + j], k.ld(xp[e + j]))
        k.bar_sync()
        for c, out in zip(combos, outs):
            mods = IC.mem_mods("ld", c[1], ty)
            space, vec = _space(mods), _vec(mods)
            if space == "param":        # the first bytes of the u64 parameter pv
                addr = Address(pv.symbol, 0, "param")
            elif space in SHARED:        # the CTA's own address serves .shared::cluster
                addr = Address(k.element(sh, e).base, 0, "shared")
            elif space == "global":
                addr = Address(k.element(xp, e).base, 0, "global")
            else:
                addr = _generic(k, f"g{len(k.params)}", size, i)
            regs = tuple(k.reg(_reg_type(ty)) for _ in range(vec))
            k.emit("ld", mods, [T.type_by_name(ty)], [regs[0] if vec == 1 else Vec(regs), addr])
            for jj, r in enumerate(regs):
                k.st(out[e + jj], _as_u(k, r))
    return m


@pytest.mark.parametrize("ty", sorted({c[2] for c in LD}))
def test_ld_forms(backend, ty, rng):
    combos = [c for c in LD if c[2] == ty]
    mem = _memory(rng, ty)
    pbits = _bits(ty)
    pv = int(rng.integers(0, 1 << min(pbits, 63))) | 1 << (pbits - 1)     # sign bit set
    if ty in ("f32", "f64"):
        pv &= ~(1 << (pbits - 2))             # a finite value, not a NaN
    pdt = {"f32": np.float32, "f64": np.float64}.get(
        ty, np.dtype(f"{'i' if ty.startswith('s') else 'u'}{max(pbits, 8) // 8}"))
    parg = np.array(pv, f"u{max(pbits, 8) // 8}").view(pdt)[()]
    mod = backend.load(_ld_kernel(ty, combos))
    rdt = f"u{_reg_type(ty).bits // 8}"
    outs = [backend.poisoned(4 * NT, rdt) for _ in combos]
    generic = [backend.array(mem) for c in combos if _space(IC.mem_mods("ld", c[1], ty)) == "generic"]
    args = [backend.array(mem), *outs, parg]
    # the generic-address parameters were declared after pv, one per generic form
    backend.launch_positional(mod["lds"], 1, NT, *args, *generic)
    want_mem = _loaded(mem, ty)
    pwant = _loaded(np.array([pv]), ty)[0]
    bad = []
    for c, out in zip(combos, outs):
        mods = IC.mem_mods("ld", c[1], ty)
        got = out.to_numpy().tolist()
        vec = _vec(mods)
        for i in range(NT):
            for j in range(vec):
                want = pwant if _space(mods) == "param" else want_mem[4 * i + j]
                if got[4 * i + j] != want:
                    bad.append((".".join(["ld", *mods, ty]), i, j, hex(got[4 * i + j]), hex(want)))
    assert not bad, f"{len(bad)} wrong loads, first: {bad[:6]}"


def _st_kernel(ty, combos):
    m = ptxgen.Module("sm_90")
    size = max(_bits(ty), 8) // 8
    with m.kernel("sts", reqntid=NT) as k:
        xp = k.param_ptr("x", _u(size * 8))
        outs = [k.param_ptr(f"o{j}", _u(size * 8)) for j in range(len(combos))]
        sh = k.shared_array("sh", _u(size * 8), 4 * NT * len(combos))
        i = k.tid.x
        e = i * 4
        vals = [k.ld(xp[e + j], ty=ty if _bits(ty) == 8 else None) for j in range(4)]
        vals = [v if v.type is _reg_type(ty) else k.bitcast(_reg_type(ty), v) for v in vals]
        for n, (c, out) in enumerate(zip(combos, outs)):
            mods = IC.mem_mods("st", c[1], ty)
            space, vec = _space(mods), _vec(mods)
            if space in SHARED:
                addr = Address(k.element(sh, e + n * 4 * NT).base, 0, "shared")
            elif space == "global":
                addr = Address(k.element(out, e).base, 0, "global")
            else:
                addr = _generic(k, f"g{n}", size, i)
            src = vals[0] if vec == 1 else Vec(tuple(vals[:vec]))
            k.emit("st", mods, [T.type_by_name(ty)], [addr, src], dsts=0)
            if space in SHARED:          # read the thread's own elements back
                for jj in range(vec):
                    k.st(out[e + jj], k.ld(sh[e + n * 4 * NT + jj]))
    return m


@pytest.mark.parametrize("ty", sorted({c[2] for c in ST}))
def test_st_forms(backend, ty, rng):
    combos = [c for c in ST if c[2] == ty]
    mem = _memory(rng, ty)
    mod = backend.load(_st_kernel(ty, combos))
    dt = mem.dtype
    outs = [backend.poisoned(4 * NT, dt) for _ in combos]
    generic = {n: outs[n] for n, c in enumerate(combos)
               if _space(IC.mem_mods("st", c[1], ty)) == "generic"}
    backend.launch_positional(mod["sts"], 1, NT, backend.array(mem), *outs, *generic.values())
    bad = []
    for c, out in zip(combos, outs):
        mods = IC.mem_mods("st", c[1], ty)
        got = out.to_numpy()
        for i in range(NT):
            for j in range(_vec(mods)):
                if int(got[4 * i + j]) != int(mem[4 * i + j]):
                    bad.append((".".join(["st", *mods, ty]), i, j, hex(int(got[4 * i + j]))))
    assert not bad, f"{len(bad)} wrong stores, first: {bad[:6]}"


# ------------------------------------------------------------ atom and red

def _half_lanes(v, fmt):
    out = []
    for h in (v & 0xFFFF, v >> 16):
        if fmt == "f16":
            out.append(float(np.uint16(h).view(np.float16)))
        else:
            out.append(float(np.uint32(h << 16).view(np.float32)))
    return out


def _half_bits(x, fmt):
    if fmt == "f16":
        return int(np.float16(x).view(np.uint16))
    return int(np.float32(x).view(np.uint32)) >> 16


def atom_oracle(kind, ty, old, b, c):
    """The new memory value of ``atom.kind.ty`` (unsigned bits in and out)."""
    bits = T.type_by_name(ty).bits
    mask = (1 << bits) - 1
    signed = ty.startswith("s")
    sv = (lambda x: x - (1 << bits) if signed and x >> (bits - 1) else x)
    if ty in ("f16x2", "bf16x2"):
        fmt = ty[:-2]
        lanes = [ref_round(Fraction(x) + Fraction(y), fmt, "rn")
                 for x, y in zip(_half_lanes(old, fmt), _half_lanes(b, fmt))]
        return _half_bits(lanes[0], fmt) | _half_bits(lanes[1], fmt) << 16
    if ty == "f32":
        x, y = (float(np.uint32(v).view(np.float32)) for v in (old, b))
        return int(np.float32(ref_round(Fraction(x) + Fraction(y), "f32", "rn")).view(np.uint32))
    if ty == "f64":
        x, y = (float(np.uint64(v).view(np.float64)) for v in (old, b))
        return int(np.float64(ref_round(Fraction(x) + Fraction(y), "f64", "rn")).view(np.uint64))
    if kind == "add":
        return (old + b) & mask
    if kind in ("min", "max"):
        return (min if kind == "min" else max)(old, b, key=sv)
    if kind == "inc":
        return 0 if old >= b else old + 1
    if kind == "dec":
        return b if old == 0 or old > b else old - 1
    if kind in ("and", "or", "xor"):
        return {"and": old & b, "or": old | b, "xor": old ^ b}[kind]
    if kind == "exch":
        return b
    return c if old == b else old           # cas: b is the compare value


def _atom_values(rng, ty, kind, n):
    bits = T.type_by_name(ty).bits
    if ty in ("f32", "f64", "f16x2", "bf16x2"):     # normal values, sums stay normal
        def one():
            x = float(rng.standard_normal()) * 2.0 ** int(rng.integers(-6, 7))
            fmt = {"f16x2": "f16", "bf16x2": "bf16"}.get(ty, ty)
            if fmt in ("f16", "bf16"):
                return _half_bits(x, fmt)
            return int(np.array(x, {"f32": np.float32, "f64": np.float64}[fmt]).view(
                f"u{bits // 8}"))
        vals = [one() for _ in range(n)]
        if ty.endswith("x2"):
            vals = [v | one() << 16 for v in vals]
        return vals
    if kind in ("inc", "dec"):
        return [int(v) for v in rng.integers(0, 12, n)]
    return [int(v) for v in rng.integers(0, 1 << bits, n, dtype=np.uint64)]


def _atom_kernel(op, ty, combos):
    m = ptxgen.Module("sm_90")
    t = T.type_by_name(ty)
    ut = _u(t.bits)
    size = t.bits // 8
    with m.kernel("atoms", reqntid=NT) as k:
        mem = k.param_ptr("mem", ut)
        old = k.param_ptr("old", ut)
        bp, cp = k.param_ptr("b", ut), k.param_ptr("c", ut)
        sh = k.shared_array("sh", ut, NT * len(combos))
        i = k.tid.x
        for n, c in enumerate(combos):
            mods = IC.mem_mods(op, c[1], ty)
            space = _space(mods)
            e = i + n * NT
            val = k.bitcast(t, k.ld(bp[e])) if t is not ut else k.ld(bp[e])
            if space in SHARED:
                k.st(sh[e], k.ld(mem[e]))
                addr = Address(k.element(sh, e).base, 0, "shared")
            elif space == "global":
                addr = Address(k.element(mem, e).base, 0, "global")
            else:
                base = k.param(f"g{n}", T.u64)
                addr = Address(k.add(base, k.mul(k.cvt(T.u64, e), size)), 0, "generic")
            srcs = [val]
            if "cas" in mods:
                srcs = [val, k.bitcast(t, k.ld(cp[e])) if t is not ut else k.ld(cp[e])]
            if op == "atom":
                d = k.reg(t)
                k.emit("atom", mods, [t], [d, addr, *srcs])
                k.st(old[e], _as_u(k, d))
            else:
                k.emit("red", mods, [t], [addr, *srcs], dsts=0)
            if space in SHARED:
                k.st(mem[e], k.ld(sh[e]))
    return m


@pytest.mark.parametrize("op,ty", sorted({("atom", c[2]) for c in ATOM}
                                         | {("red", c[2]) for c in RED}))
def test_atomic_forms(backend, op, ty, rng):
    combos = [c for c in (ATOM if op == "atom" else RED) if c[2] == ty]
    kinds = [next(m for m in IC.mem_mods(op, c[1], ty) if m in IC.ATOM_OPS) for c in combos]
    n = NT * len(combos)
    init, b, c = [], [], []
    for kind in kinds:
        o = _atom_values(rng, ty, kind, NT)
        bb = _atom_values(rng, ty, kind, NT)
        if kind == "cas":       # half the threads compare equal
            bb = [o[i] if i % 2 == 0 else bb[i] for i in range(NT)]
        init += o
        b += bb
        c += _atom_values(rng, ty, kind, NT)
    dt = f"u{T.type_by_name(ty).bits // 8}"
    mem = backend.array(np.array(init, dt))
    olds = backend.poisoned(n, dt)
    mod = backend.load(_atom_kernel(op, ty, combos))
    generic = [mem for cc in combos if _space(IC.mem_mods(op, cc[1], ty)) == "generic"]
    backend.launch_positional(mod["atoms"], 1, NT, mem, olds, backend.array(np.array(b, dt)),
                              backend.array(np.array(c, dt)), *generic)
    got_mem, got_old = mem.to_numpy().tolist(), olds.to_numpy().tolist()
    bad = []
    for n_, (cc, kind) in enumerate(zip(combos, kinds)):
        name = ".".join([op, *IC.mem_mods(op, cc[1], ty), ty])
        for i in range(NT):
            e = n_ * NT + i
            want = atom_oracle(kind, ty, init[e], b[e], c[e])
            if got_mem[e] != want or op == "atom" and got_old[e] != init[e]:
                bad.append((name, i, hex(init[e]), hex(b[e]), hex(got_mem[e]), hex(want),
                            hex(got_old[e]) if op == "atom" else None))
    assert not bad, f"{len(bad)} wrong atomics, first: {bad[:6]}"


def test_atom_oracle_spot_values():
    """The oracle on values worked out by hand."""
    assert atom_oracle("inc", "u32", 5, 5, 0) == 0 and atom_oracle("inc", "u32", 4, 5, 0) == 5
    assert atom_oracle("dec", "u32", 0, 7, 0) == 7 and atom_oracle("dec", "u32", 9, 7, 0) == 7
    assert atom_oracle("dec", "u32", 3, 7, 0) == 2
    assert atom_oracle("min", "s32", 0xFFFF_FFFF, 3, 0) == 0xFFFF_FFFF
    assert atom_oracle("min", "u32", 0xFFFF_FFFF, 3, 0) == 3
    assert atom_oracle("add", "u64", (1 << 64) - 1, 2, 0) == 1
    assert atom_oracle("cas", "b32", 7, 7, 9) == 9 and atom_oracle("cas", "b32", 7, 8, 9) == 7
    one, two = 0x3C00, 0x4000                      # f16 1.0, 2.0
    assert atom_oracle("add", "f16x2", one | two << 16, one | one << 16, 0) == two | 0x4200 << 16
    assert math.isclose(float(np.uint32(atom_oracle("add", "f32", 0x3F800000, 0x3F800000, 0))
                              .view(np.float32)), 2.0)


def _kernel_for(op, ty, combos):
    if op in ("atom", "red"):
        return _atom_kernel(op, ty, combos)
    return (_ld_kernel if op == "ld" else _st_kernel)(ty, combos)


def test_ptxas_agrees_with_the_memory_split(ptxas):
    """ptxas assembles the kernels run here (every tested form) and refuses
    one form per (opcode, reason) named as not PTX, unless the builder
    already does."""
    from ptxgen.ptxas import assemble
    for op, forms in (("ld", LD), ("st", ST), ("atom", ATOM), ("red", RED)):
        for ty in sorted({c[2] for c in forms}):
            assemble(_kernel_for(op, ty, [c for c in forms if c[2] == ty]).to_ptx(), "sm_90")
    seen, forms = set(), []
    for c in sorted(IC.table_combos(IC.MEM_OPS)):
        why = IC.not_ptx(*c)
        if why and (c[0], why) not in seen:     # one form per reason
            seen.add((c[0], why))
            forms.append(c)
    accepted = IC.ptxas_takes(forms, lambda c: _kernel_for(c[0], c[2], [c]).to_ptx(),
                              (ValueError,))
    assert not accepted, f"named as not PTX, but ptxas takes them: {accepted}"
