"""PTX text to kernels: the subset of PTX that ptxgen emits.

A module is ``.version``/``.target``/``.address_size`` and ``.entry``
kernels.  A kernel has parameters (parsed by :func:`ptxgen.abi.parse_entries`),
``.maxntid``/``.reqntid``/``.minnctapersm``/``.reqnctapercluster`` directives, ``.reg``
declarations (``%r<18>`` ranges or single names), ``.shared`` and
``.extern .shared`` arrays, labels and instructions.  Instructions are
checked against :data:`ptxgen.isa.TABLE` (opcode, modifiers, type
suffixes).  Anything else is refused with a :class:`PtxParseError` naming
the construct and its line.

Operands are tuples:

``("reg", name)``, ``("not", name)`` (``!%p``), ``("sreg", name)``
(``%tid.x``), ``("imm", kind, value)`` with kind ``int``/``f32``/``f64``
(float kinds carry the bit pattern, ``float`` a Python float),
``("sym", name)`` (a label, shared array or parameter),
``("addr", base, offset)`` (``[base+offset]``), ``("vec", [operands])``,
``("tensor", base, [coordinates])`` (``[%rd1, {%r1, %r2}]``, TMA).
"""

from __future__ import annotations

import re

from .. import isa
from ..abi import PTXSignatureError, param_layout, parse_entries
from ..types import type_by_name
from .errors import PtxParseError

__all__ = ["Stmt", "KernelText", "parse_module", "SPECIAL_REGS"]

SPECIAL_REGS = frozenset(
    [f"%{b}.{c}" for b in ("tid", "ntid", "ctaid", "nctaid") for c in "xyz"]
    + ["%laneid", "%warpid", "%nwarpid", "%clock", "%clock64", "%smid", "%nsmid",
       "%lanemask_eq", "%lanemask_le", "%lanemask_lt", "%lanemask_ge", "%lanemask_gt",
       "%globaltimer", "%cluster_ctarank", "%cluster_nctarank"])

_IDENT = r"[A-Za-z_$][\w$]*"
_LABEL_RE = re.compile(rf"^({_IDENT})\s*:")
_REG_RANGE = re.compile(r"^(%[A-Za-z_$][\w$]*)<(\d+)>$")
_REG_NAME = re.compile(r"^%[A-Za-z_$][\w$]*$")
_SHARED_RE = re.compile(
    rf"^(\.extern\s+)?\.shared\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+({_IDENT})\s*\[\s*(\d*)\s*\]$")
_INT_RE = re.compile(r"^(-?)(0[xX][0-9A-Fa-f]+|\d+)[Uu]?$")
_F32_RE = re.compile(r"^0[fF]([0-9A-Fa-f]{8})$")
_F64_RE = re.compile(r"^0[dD]([0-9A-Fa-f]{16})$")
_FLOAT_RE = re.compile(r"^-?\d+\.\d*(?:[eE][-+]?\d+)?$")
_ADDR_RE = re.compile(rf"^\[\s*(%?{_IDENT}(?:\.[xyz])?|-?\d+|-?0[xX][0-9A-Fa-f]+)\s*"
                      r"(?:\+\s*(-?(?:0[xX][0-9A-Fa-f]+|\d+)))?\s*\]$")
_DIRECTIVES = (".maxntid", ".reqntid", ".minnctapersm", ".maxnreg", ".reqnctapercluster")


class Stmt:
    """One instruction as written."""

    __slots__ = ("line", "text", "guard", "op", "mods", "types", "operands")

    def __init__(self, line, text, guard, op, mods, types, operands):
        self.line = line
        self.text = text
        #: ``(register name, negated)`` or None
        self.guard = guard
        self.op = op
        self.mods = mods
        self.types = types
        self.operands = operands

    def __repr__(self):
        return f"Stmt({self.line}: {self.text})"


class KernelText:
    """A parsed ``.entry``: what the executor needs to compile it."""

    def __init__(self, name, line):
        self.name = name
        self.line = line
        self.params = []          # list of ptxgen.abi.ParamInfo
        self.param_offsets = {}   # name -> byte offset in the param buffer
        self.param_size = 0
        self.regs = {}            # register name -> PtxType of its declaration
        self.shared = []          # (name, align, nbytes or None for .extern)
        self.body = []            # list of Stmt
        self.labels = {}          # label -> index into body
        self.directives = {}      # ".maxntid" -> (x, y, z)

    def shared_layout(self):
        """Offsets of the shared arrays and the static size.  Every dynamic
        (``.extern``) array starts at the same offset after the static ones,
        aligned to the largest ``.extern`` alignment."""
        off = 0
        offsets = {}
        for name, align, nbytes in self.shared:
            if nbytes is not None:
                off = (off + align - 1) // align * align
                offsets[name] = off
                off += nbytes
        dyn_align = max([a for _, a, nb in self.shared if nb is None], default=1)
        dyn = (off + dyn_align - 1) // dyn_align * dyn_align
        for name, align, nbytes in self.shared:
            if nbytes is None:
                offsets[name] = dyn
        return offsets, dyn


def _strip_comments(text):
    return re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)


def parse_module(text: str) -> dict[str, KernelText]:
    """Parse a PTX module; returns its kernels by name."""
    try:
        entries = parse_entries(text)
    except PTXSignatureError as e:
        raise PtxParseError(f"bad .entry signature: {e}") from None
    lines = _strip_comments(text).split("\n")
    kernels: dict[str, KernelText] = {}
    externs = []          # module-scope .extern .shared arrays (all kernels see them)
    i = 0
    n = len(lines)
    while i < n:
        raw = lines[i].strip()
        lineno = i + 1
        if not raw:
            i += 1
            continue
        head = raw.split()[0]
        if head in (".version", ".target", ".address_size"):
            if head == ".address_size" and raw.split()[1:2] != ["64"]:
                raise PtxParseError("only .address_size 64 is supported", line=lineno, text=raw)
            i += 1
            continue
        if head in (".visible", ".entry"):
            k, i = _parse_kernel(lines, i, entries)
            kernels[k.name] = k
            continue
        if head == ".extern":
            m = _SHARED_RE.match(raw.rstrip(";").strip())
            if not m or not m.group(1) or m.group(5):
                raise PtxParseError("only `.extern .shared .align N .b8 name[];` is supported "
                                    "at module scope", line=lineno, text=raw)
            externs.append((m.group(4), int(m.group(2) or 1), None))
            i += 1
            continue
        raise PtxParseError(f"unsupported module-level construct {head!r}", line=lineno, text=raw)
    for k in kernels.values():
        k.shared += [e for e in externs if e[0] not in {s[0] for s in k.shared}]
    return kernels


def _parse_kernel(lines, i, entries):
    start = i
    header = []
    while i < len(lines) and "{" not in lines[i]:
        header.append(lines[i].strip())
        i += 1
    if i == len(lines):
        raise PtxParseError("kernel without a body", line=start + 1, text=lines[start].strip())
    before, _, after = lines[i].partition("{")
    header.append(before.strip())
    if after.strip():
        raise PtxParseError("put the kernel body on the lines after '{'", line=i + 1,
                            text=lines[i].strip())
    htext = " ".join(h for h in header if h)
    m = re.match(rf"^(?:\.visible\s+)?\.entry\s+({_IDENT})\s*(\([^)]*\))?\s*(.*)$", htext)
    if not m:
        raise PtxParseError("cannot parse the .entry header", line=start + 1, text=lines[start].strip())
    k = KernelText(m.group(1), start + 1)
    k.params = list(entries.get(k.name, []))
    offsets, k.param_size = param_layout(k.params)
    k.param_offsets = {p.name: off for p, off in zip(k.params, offsets)}
    rest = m.group(3).strip()
    for d in re.finditer(r"(\.\w+)\s+([\d,\s]+)", rest):
        if d.group(1) not in _DIRECTIVES:
            raise PtxParseError(f"unsupported kernel directive {d.group(1)}", line=start + 1,
                                text=htext)
        vals = tuple(int(v) for v in d.group(2).replace(",", " ").split())
        k.directives[d.group(1)] = vals
    i += 1
    pending = ""
    pending_line = None
    while i < len(lines):
        lineno = i + 1
        s = lines[i].strip()
        i += 1
        if not s:
            continue
        if s == "}" and not pending:
            _check_labels(k)
            return k, i
        if not pending:
            lm = _LABEL_RE.match(s)
            while lm:
                if lm.group(1) in k.labels:
                    raise PtxParseError(f"label {lm.group(1)} is defined twice", line=lineno, text=s)
                k.labels[lm.group(1)] = len(k.body)
                s = s[lm.end():].strip()
                lm = _LABEL_RE.match(s)
            if not s:
                continue
            pending_line = lineno
        pending = (pending + " " + s).strip()
        while ";" in pending:
            stmt, _, pending = pending.partition(";")
            pending = pending.strip()
            _statement(k, stmt.strip(), pending_line)
            pending_line = lineno
    raise PtxParseError(f"kernel {k.name} has no closing '}}'", line=start + 1)


def _check_labels(k):
    for st in k.body:
        if st.op == "bra":
            tgt = st.operands[0]
            if tgt[0] != "sym" or tgt[1] not in k.labels:
                raise PtxParseError(f"branch to an undefined label {tgt[-1]}", line=st.line,
                                    text=st.text)


def _statement(k, s, lineno):
    if s.startswith(".reg"):
        return _reg_decl(k, s, lineno)
    if s.startswith(".shared") or s.startswith(".extern"):
        m = _SHARED_RE.match(s)
        if not m:
            raise PtxParseError("cannot parse this shared declaration", line=lineno, text=s)
        ext, align, ty, name, count = m.groups()
        elem = _decl_type(ty, s, lineno).bytes
        if ext and count:
            raise PtxParseError(".extern .shared arrays take no size", line=lineno, text=s)
        if not ext and not count:
            raise PtxParseError("a .shared array needs a size", line=lineno, text=s)
        nbytes = None if ext else int(count) * elem
        k.shared.append((name, int(align or elem), nbytes))
        return None
    if s.startswith("."):
        raise PtxParseError(f"unsupported declaration or directive {s.split()[0]}",
                            line=lineno, text=s)
    k.body.append(_instruction(k, s, lineno))
    return None


def _decl_type(name, s, lineno):
    try:
        return type_by_name(name)
    except ValueError:
        raise PtxParseError(f"unknown type .{name}", line=lineno, text=s) from None


def _reg_decl(k, s, lineno):
    parts = s[len(".reg"):].strip().split(None, 1)
    if len(parts) != 2 or not parts[0].startswith("."):
        raise PtxParseError("cannot parse this register declaration", line=lineno, text=s)
    ty = _decl_type(parts[0][1:], s, lineno)
    if ty.bits < 16 and not ty.is_pred:
        raise PtxParseError(f".reg .{ty.name} is not supported", line=lineno, text=s)
    for item in parts[1].split(","):
        item = item.strip()
        m = _REG_RANGE.match(item)
        if m:
            for j in range(int(m.group(2))):
                k.regs[f"{m.group(1)}{j}"] = ty
        elif _REG_NAME.match(item):
            k.regs[item] = ty
        else:
            raise PtxParseError(f"cannot parse register name {item!r}", line=lineno, text=s)


def _split_operands(text):
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _instruction(k, s, lineno):
    text = s + ";"
    guard = None
    if s.startswith("@"):
        m = re.match(r"^@(!?)(%[\w$]+)\s+(.*)$", s)
        if not m:
            raise PtxParseError("cannot parse the guard predicate", line=lineno, text=text)
        _need_reg(k, m.group(2), lineno, text)
        guard = (m.group(2), bool(m.group(1)))
        s = m.group(3)
    opcode, _, rest = s.partition(" ")
    rest = rest.strip()
    if "\t" in opcode:
        opcode, _, more = opcode.partition("\t")
        rest = (more + " " + rest).strip()
    parts = opcode.split(".")
    # the longest table name that prefixes the opcode (cp.async.wait_group)
    n = next((i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in isa.TABLE), 1)
    op = ".".join(parts[:n])
    parts = [op] + parts[n:]
    sp = isa.TABLE.get(op)
    if sp is None:
        raise PtxParseError(f"opcode {opcode!r} is not in ptxgen's instruction table",
                            line=lineno, text=text)
    nty = len(sp.types)
    if len(parts) - 1 < nty:
        raise PtxParseError(f"{opcode} needs {nty} type suffix(es)", line=lineno, text=text)
    tnames = parts[len(parts) - nty:] if nty else []
    mods = tuple(parts[1:len(parts) - nty])
    for slot, t in zip(sp.types, tnames):
        if t not in slot:
            raise PtxParseError(f"{opcode}: .{t} is not an allowed type here "
                                f"(allowed: {', '.join(slot)})", line=lineno, text=text)
    err = sp.check_mods(mods)
    if err:
        raise PtxParseError(err, line=lineno, text=text)
    types = tuple(type_by_name(t) for t in tnames)
    operands = [_operand(k, o, lineno, text) for o in _split_operands(rest)]
    codes = sp.operands
    need = sum(1 for c in codes if not c.endswith("?"))
    if not need <= len(operands) <= len(codes):
        raise PtxParseError(f"{opcode} takes {need}..{len(codes)} operands, got {len(operands)}",
                            line=lineno, text=text)
    return Stmt(lineno, text, guard, op, mods, types, operands)


def _tensor_operand(k, o, lineno, text):
    """``[%rd1, {%r1, %r2}]``: a TMA tensor map address and its coordinates."""
    m = re.match(r"^\[\s*([^,{}\s]+)\s*,\s*(\{[^{}]*\})\s*\]$", o)
    if not m:
        raise PtxParseError(f"cannot parse the tensor operand {o}", line=lineno, text=text)
    base = _operand(k, m.group(1), lineno, text)
    if base[0] != "reg":
        raise PtxParseError("a tensor map address must be a register", line=lineno, text=text)
    return ("tensor", base, _operand(k, m.group(2), lineno, text)[1])


def _int(t):
    neg = t.startswith("-")
    t = t.lstrip("-")
    v = int(t, 16) if t[:2] in ("0x", "0X") else int(t, 10)
    return -v if neg else v


def _need_reg(k, name, lineno, text):
    if name not in k.regs:
        raise PtxParseError(f"register {name} is not declared", line=lineno, text=text)


def _operand(k, o, lineno, text):
    if o.startswith("{") and o.endswith("}"):
        items = [x.strip() for x in o[1:-1].split(",")]
        return ("vec", [_operand(k, x, lineno, text) for x in items])
    if o.startswith("[") and "{" in o:
        return _tensor_operand(k, o, lineno, text)
    if o.startswith("["):
        m = _ADDR_RE.match(o)
        if not m:
            raise PtxParseError(f"cannot parse the address {o}", line=lineno, text=text)
        base = _operand(k, m.group(1), lineno, text)
        if base[0] not in ("reg", "sym", "imm"):
            raise PtxParseError(f"unsupported address base {m.group(1)}", line=lineno, text=text)
        return ("addr", base, _int(m.group(2)) if m.group(2) else 0)
    if o.startswith("!"):
        name = o[1:].strip()
        _need_reg(k, name, lineno, text)
        return ("not", name)
    if o.startswith("%"):
        if o in SPECIAL_REGS:
            return ("sreg", o)
        _need_reg(k, o, lineno, text)
        return ("reg", o)
    m = _F32_RE.match(o)
    if m:
        return ("imm", "f32", int(m.group(1), 16))
    m = _F64_RE.match(o)
    if m:
        return ("imm", "f64", int(m.group(1), 16))
    m = _INT_RE.match(o)
    if m:
        v = _int(m.group(2))
        return ("imm", "int", -v if m.group(1) else v)
    if _FLOAT_RE.match(o):
        return ("imm", "float", float(o))
    if re.match(rf"^{_IDENT}$", o):
        return ("sym", o)
    raise PtxParseError(f"cannot parse the operand {o!r}", line=lineno, text=text)
