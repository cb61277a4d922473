"""Every integer, bit, compare and select form of the instruction table
against an exact oracle: Python integers (wrapping written out per width),
IEEE comparison rules written out for setp on floats.

Which combinations exist is decided by tests/emu/isa_coverage.py
(``not_ptx``); the enumeration in test_emu_isa_coverage.py fails on a
table combination that is neither run here (``COVERED``) nor elsewhere.
Inputs are seeded random values plus the edges: 0, 1, -1 (all ones), the
type's MIN and MAX, shift/position/length amounts at and past the width.
"""

import math

import numpy as np
import pytest

import isa_coverage as IC
from backends import run_map
from ptxgen import types as T
from test_emu_intops import field_operands, ref_bfe

INT_OPS = tuple(o for o in IC.ALU_OPS if o not in ("cvt", "mov"))
FLOAT = IC.FLOAT
N = 96
COMBOS = sorted(c for c in IC.table_combos(INT_OPS)
                if not IC.not_ptx(*c)
                and not (c[2] in FLOAT and c[0] not in ("setp", "selp")))
COVERED = set(COMBOS)


def _wrap(v, bits, signed):
    v &= (1 << bits) - 1
    return v - (1 << bits) if signed and v >> (bits - 1) else v


def _ints(rng, t, n=N):
    """``n`` values of integer/bit type ``t`` with its edge values first."""
    bits, signed = t.bits, t.is_signed
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    edges = [0, 1, hi, lo, _wrap(-1, bits, signed), lo + 1, hi - 1]
    draw = [int(v) for v in rng.integers(lo, hi, n - len(edges), dtype=np.int64 if signed or
                                          bits < 64 else np.uint64, endpoint=True)]
    vals = edges + draw
    rng.shuffle(vals)
    return vals


_TINY = {"f32": 1e-40, "f16": 3e-6, "bf16": 1e-39, "f64": 1e-310}    # subnormals


def _floats(rng, ty, n=N):
    tiny = _TINY[ty]
    base = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, tiny, -tiny, tiny / 2]
    v = list(np.float64(rng.integers(-3, 4, n - len(base))) / 2) + base
    rng.shuffle(v)
    return v


def _array(vals, ty):
    """Python values -> the array run_map takes for type name ``ty``."""
    if ty == "pred":
        return np.array([int(bool(v)) for v in vals], np.uint32)
    if ty in ("f32", "f64", "f16"):
        return np.array(vals, {"f32": np.float32, "f64": np.float64, "f16": np.float16}[ty])
    if ty == "bf16":
        return (np.array(vals, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    t = T.type_by_name(ty)
    return np.array([v & ((1 << t.bits) - 1) for v in vals], f"u{t.bits // 8}")


def _value(arr_vals, ty):
    """Loaded values as Python numbers (what the oracle computes on)."""
    if ty in ("f32", "f64", "f16"):
        return [float(x) for x in arr_vals]
    if ty == "bf16":
        return [float(x) for x in (np.asarray(arr_vals, np.uint32) << 16).view(np.float32)]
    return list(arr_vals)


def _io_type(t):
    """The type run_map loads and stores a value of ``t`` as."""
    if t is T.pred:
        return "u32"
    if t.name in FLOAT:
        return t.name
    return f"u{t.bits}"


_UCMP = {"lo": "lt", "ls": "le", "hi": "gt", "hs": "ge"}


def _cmp(c, x, y, signed):
    if isinstance(x, float):
        un = math.isnan(x) or math.isnan(y)
        if c in ("num", "nan"):
            return (not un) if c == "num" else un
        base = c[:-1] if c.endswith("u") and c != "nu" else c
        r = {"eq": x == y, "ne": x != y, "lt": x < y, "le": x <= y, "gt": x > y,
             "ge": x >= y}[base] if not un else False
        return (un or r) if c.endswith("u") else r
    if c in _UCMP:
        c = _UCMP[c]            # unsigned order: x, y are already unsigned here
    return {"eq": x == y, "ne": x != y, "lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y}[c]


def oracle(op, mods, tys, xs):
    """The exact result of ``op.mods.tys`` on Python values ``xs``."""
    t = tys[0]
    w, sg = t.bits, t.is_signed
    wr = lambda v: _wrap(v, w, sg)     # noqa: E731
    if op == "setp":
        c = mods[0]
        if "ftz" in mods:        # subnormal inputs compare as signed zeros
            tiny = {"f32": 2.0 ** -126, "f16": 2.0 ** -14}[t.name]
            xs = [math.copysign(0.0, x) if 0 < abs(x) < tiny else x for x in xs[:2]] + xs[2:]
        r = _cmp(c, xs[0], xs[1], sg)
        b = next((m for m in mods if m in ("and", "or", "xor")), None)
        if b:
            q = bool(xs[2])
            r = {"and": r and q, "or": r or q, "xor": r != q}[b]
        return int(r)
    if op == "selp":
        return xs[0] if xs[2] else xs[1]
    if op in ("add", "sub"):
        v = xs[0] + xs[1] if op == "add" else xs[0] - xs[1]
        return max(-2 ** 31, min(2 ** 31 - 1, v)) if "sat" in mods else wr(v)
    if op == "mul":
        p = xs[0] * xs[1]
        if "hi" in mods:
            return wr(p >> w)
        return _wrap(p, 2 * w, sg) if "wide" in mods else wr(p)
    if op == "mad":
        p = xs[0] * xs[1]
        if "wide" in mods:
            return _wrap(p + xs[2], 2 * w, sg)
        if "hi" in mods:
            v = (p >> w) + xs[2]
            return max(-2 ** 31, min(2 ** 31 - 1, v)) if "sat" in mods else wr(v)
        return wr(p + xs[2])
    if op in ("div", "rem"):
        a, b = xs
        q = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)
        return wr(q) if op == "div" else wr(a - q * b)
    if op == "neg":
        return wr(-xs[0])
    if op == "abs":
        return wr(abs(xs[0]))
    if op in ("min", "max"):
        return min(xs) if op == "min" else max(xs)
    u = [x & ((1 << w) - 1) if isinstance(x, int) else x for x in xs]
    if op == "popc":
        return bin(u[0]).count("1")
    if op == "clz":
        return w - u[0].bit_length()
    if t is T.pred:
        a = [bool(x) for x in xs]
        return int({"and": lambda: a[0] and a[1], "or": lambda: a[0] or a[1],
                    "xor": lambda: a[0] != a[1], "not": lambda: not a[0]}[op]())
    if op in ("and", "or", "xor"):
        return {"and": u[0] & u[1], "or": u[0] | u[1], "xor": u[0] ^ u[1]}[op]
    if op == "not":
        return ~u[0] & ((1 << w) - 1)
    if op == "shl":
        return (u[0] << xs[1]) & ((1 << w) - 1) if xs[1] < w else 0
    if op == "shr":
        if sg:
            return xs[0] >> min(xs[1], w - 1)
        return u[0] >> xs[1] if xs[1] < w else 0
    if op == "bfe":
        return ref_bfe(xs[0], xs[1], xs[2], w, sg)
    if op == "bfi":
        d = u[1]
        p, ln = field_operands(xs[2], xs[3], w)
        for i in range(min(ln, w)):
            if p + i >= w:
                break
            d = (d & ~(1 << (p + i))) | (((u[0] >> i) & 1) << (p + i))
        return d
    if op == "prmt":
        return _prmt(u[0], u[1], u[2], mods[0] if mods else None)
    if op in ("dp4a", "dp2a"):
        sa, sb = tys[0].is_signed, tys[1].is_signed
        acc_signed = sa or sb
        n_a, size_a = (4, 8) if op == "dp4a" else (2, 16)
        av = [_wrap(u[0] >> (size_a * i), size_a, sa) for i in range(n_a)]
        bv = [_wrap(u[1] >> (8 * i), 8, sb) for i in range(4)]
        if op == "dp2a":
            bv = bv[2:] if "hi" in mods else bv[:2]
        return _wrap(sum(x * y for x, y in zip(av, bv)) + xs[2], 32, acc_signed)
    raise AssertionError(op)


def _prmt(a, b, c, mode):
    src = a | (b << 32)
    table = {"f4e": lambda s: [(s + i) & 7 for i in range(4)],
             "b4e": lambda s: [(s - i) & 7 for i in range(4)],
             "rc8": lambda s: [s] * 4,
             "ecl": lambda s: [max(s, i) for i in range(4)],
             "ecr": lambda s: [min(s, i) for i in range(4)],
             "rc16": lambda s: [2 * (s & 1), 2 * (s & 1) + 1] * 2}
    d = 0
    for i in range(4):
        if mode is None:
            sel = (c >> (4 * i)) & 0xF
            byte = (src >> (8 * (sel & 7))) & 0xFF
            if sel & 8:
                byte = 0xFF if byte & 0x80 else 0
        else:
            byte = (src >> (8 * table[mode](c & 3)[i])) & 0xFF
        d |= byte << (8 * i)
    return d


def _source_values(rng, op, i, st, tys):
    if st is T.pred:
        return [int(v) for v in rng.integers(0, 2, N)]
    if st.name in FLOAT:
        return _floats(rng, st.name)
    amount = {"shl": 1, "shr": 1, "bfe": 1, "bfi": 2}.get(op)
    if amount is not None and i >= amount:
        w = tys[0].bits
        edge = [0, 1, w - 1, w, w + 1, 255, 256 + 3, 2 ** 32 - 1]
        return edge + [int(v) for v in rng.integers(0, w + 9, N - len(edge))]
    vals = _ints(rng, st)
    if op in ("div", "rem") and i == 1:
        vals = [v if v != 0 else 7 for v in vals]
    return vals


@pytest.mark.parametrize("op,mod,ty", COMBOS, ids=lambda v: v or "-")
def test_int_combination(backend, op, mod, ty, rng):
    tys = IC.type_tuple(ty)
    mods = IC.emitted_mods(op, mod, ty)
    dty, stys = IC.operand_types(op, mods, tys)
    xs = [_source_values(rng, op, i, st, tys) for i, st in enumerate(stys)]
    if op in ("div", "rem") and tys[0].is_signed:      # MIN / -1 wraps
        lo = -(1 << (tys[0].bits - 1))
        xs[0][:2], xs[1][:2] = [lo, lo], [-1, 1]
    if op == "setp" and tys[0].name in FLOAT:       # pairs that differ once flushed
        tiny = _TINY[tys[0].name]
        xs[0][:3], xs[1][:3] = [-tiny, 0.0, tiny / 2], [0.0, tiny, tiny]
    io = [_io_type(t) for t in stys]
    arrs = [_array(v, t if t in FLOAT else "pred" if s is T.pred else t)
            for v, t, s in zip(xs, io, stys)]
    vals = [_value(a, t) if t in FLOAT else v for a, v, t in zip(arrs, xs, io)]

    def body(k, *regs):
        srcs = []
        for r, st in zip(regs, stys):
            if st is T.pred:
                srcs.append(k.setp("ne", r, 0))
            elif r.type is not st:
                srcs.append(k.bitcast(st, r))
            else:
                srcs.append(r)
        d = IC.emit_combo(k, op, mods, tys, srcs)
        if d.type is T.pred:
            return k.select(d, k.const(T.u32, 1), k.const(T.u32, 0))
        return d if d.type.name in FLOAT else k.bitcast(T.type_by_name(f"u{d.type.bits}"), d)
    out_io = _io_type(dty)
    got = run_map(backend, body, arrs, io, out_io)
    for i in range(N):
        x = [v[i] for v in vals]
        want = oracle(op, mods, tys, x)
        g = got[i]
        if isinstance(want, float):
            g = _value(got[i:i + 1], out_io)[0]
            ok = (math.isnan(g) and math.isnan(want)) or (
                g == want and math.copysign(1, g) == math.copysign(1, want))
        else:
            mask = (1 << (2 * tys[0].bits if "wide" in mods else dty.bits)) - 1 \
                if dty is not T.pred else 1
            ok = int(g) == want & mask
        assert ok, (op, mods, ty, x, g, want)
