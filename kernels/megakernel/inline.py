"""A kernel's PTX made into a piece of the persistent kernel's body: the
entry's registers, labels and shared arrays renamed apart, its parameters
read from a table in global memory, its CTA index a register the caller
sets, its returns a branch to its end.

ptxgen's PTX has one shape (``.reg`` ranges and names, ``$``-labels,
``ld.param`` of each parameter once, ``bar.sync 0``), so the rewrite is
textual; anything outside that shape is refused with the line named.

Markers left in the body for the caller to fill (:meth:`Inlined.render`):
the registers holding the CTA's index and the grid (``%ctaid``,
``%nctaid``), the address of the node's parameter table (parameter ``j``
in the 8 bytes at ``8 * j``), and the barrier the body's ``bar.sync 0``
becomes (a named barrier over the body's threads where the persistent CTA
has more).  Loads through the non-coherent path (``ld.global.nc``) become
plain ``ld.global``: another CTA may write what a body reads while the
kernel runs.  ``griddepcontrol`` (programmatic dependent launch) is dropped:
inside the persistent kernel the tape's counters order the bodies.
"""

from __future__ import annotations

import re

import attrs

__all__ = ["Inlined", "inline_entry", "DYNAMIC_SHARED"]

#: the persistent kernel's one dynamic shared array (every body's ``.extern .shared``)
DYNAMIC_SHARED = "mk_dynamic_smem"
#: the named barrier a body's ``bar.sync 0`` becomes when it has fewer threads than the CTA
BODY_BARRIER = 15

_PARAM = re.compile(r"\.param\s+\.(\w+)(?:\s+\.ptr\s+\.\w+)?(?:\s+\.align\s+\d+)?\s+(\w+)\s*,?$")
_REG = re.compile(r"\.reg\s+\.\w+\s+(.*);$")
_SHARED = re.compile(r"\.shared\s+\.align\s+(\d+)\s+\.b8\s+(\w+)\[(\d+)\];$")
_EXTERN = re.compile(r"\.extern\s+\.shared\s+\.align\s+(\d+)\s+\.b8\s+(\w+)\[\];$")
_LDPARAM = re.compile(r"ld\.param\.(\w+)\s+(%\w+),\s*\[(\w+)(?:\+(\d+))?\];$")
_THREADS = re.compile(r"\.(?:reqntid|maxntid)\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+)")
_SPECIAL = {"%ctaid.x": "@CX@", "%ctaid.y": "@CY@", "%ctaid.z": "@CZ@",
            "%nctaid.x": "@NX@", "%nctaid.y": "@NY@", "%nctaid.z": "@NZ@"}


@attrs.frozen
class Inlined:
    """An entry's body ready to inline.

    Attributes
    ----------
    entry : str
    params : tuple of (name, type)
        In declaration order: parameter ``j`` is read from table word ``j``.
    threads : int
        The body's threads (its ``.reqntid`` / ``.maxntid``).
    decls : tuple of str
        Its renamed ``.reg`` and ``.shared`` declarations.
    body : tuple of str
        Its renamed instructions, with markers.
    align : int
        The alignment its dynamic shared array asks (0: it has none).
    """

    entry: str
    params: tuple
    threads: int
    decls: tuple
    body: tuple
    align: int = 0

    def render(self, ctaid, nctaid, table: str, cta_threads: int) -> list:
        """The body's lines with ``ctaid`` / ``nctaid`` (three register
        names each), ``table`` (a u64 register holding the parameter
        table's address) and the barrier for a CTA of ``cta_threads``."""
        bar = ("bar.sync \t0;" if self.threads == cta_threads
               else f"bar.sync \t{BODY_BARRIER}, {self.threads};")
        subs = dict(zip(("@CX@", "@CY@", "@CZ@"), ctaid))
        subs.update(zip(("@NX@", "@NY@", "@NZ@"), nctaid))
        subs["@TABLE@"] = table
        subs["@BAR@"] = bar
        pat = re.compile("|".join(map(re.escape, subs)))
        return [pat.sub(lambda m: subs[m.group(0)], line) for line in self.body]


def _entry_text(ptx: str, entry: str):
    """The module-scope lines, the entry's header lines and its body lines."""
    lines = ptx.splitlines()
    start = next((i for i, l in enumerate(lines) if re.search(rf"\.entry\s+{entry}\(", l)), None)
    if start is None:
        raise ValueError(f"no entry {entry!r} in the PTX")
    open_ = next(i for i in range(start, len(lines)) if lines[i].strip() == "{")
    depth, end = 0, None
    for i in range(open_, len(lines)):
        s = lines[i].strip()
        depth += s.count("{") - s.count("}") if not s.startswith("//") else 0
        if depth == 0:
            end = i
            break
    return lines[:start], lines[start:open_], lines[open_ + 1:end]


def inline_entry(ptx: str, entry: str, prefix: str) -> Inlined:
    """``entry`` of the module text ``ptx`` renamed with ``prefix`` (a
    PTX identifier fragment unique in the persistent kernel)."""
    module, header, body = _entry_text(ptx, entry)
    params = []
    for line in header[1:]:
        s = line.strip()
        if s in (")", ""):
            continue
        m = _PARAM.match(s)
        if m:
            params.append((m.group(2), m.group(1)))
            continue
        t = _THREADS.match(s)
        if t:
            threads = int(t.group(1)) * int(t.group(2)) * int(t.group(3))
            continue
        if s.startswith((".minnctapersm", ".maxnreg", ".pragma", ".reqnctapercluster")):
            if s.startswith(".reqnctapercluster"):
                raise ValueError(f"{entry}: a cluster kernel cannot be inlined ({s!r})")
            continue
        raise ValueError(f"{entry}: header line {s!r} is not one the inliner knows")
    if "threads" not in locals():
        raise ValueError(f"{entry}: no .reqntid or .maxntid; the body's thread count is unknown")
    align = 0
    symbols = {}
    for line in module:
        m = _EXTERN.match(line.strip())
        if m:
            align = max(align, int(m.group(1)))
            symbols[m.group(2)] = DYNAMIC_SHARED
    regs, names, decls, out = set(), set(), [], []
    index = {name: j for j, (name, _) in enumerate(params)}
    for line in body:
        s = line.strip()
        if not s or s.startswith("//"):
            continue
        m = _REG.match(s)
        if m:
            for part in m.group(1).split(","):
                r = part.strip()
                rng = re.fullmatch(r"%(\w+)<\d+>", r)
                if rng:
                    regs.add(rng.group(1))
                else:
                    names.add(r.lstrip("%"))
            decls.append(s)
            continue
        m = _SHARED.match(s)
        if m:
            symbols[m.group(2)] = f"{prefix}{m.group(2)}"
            decls.append(s)
            continue
        if s.startswith(".extern") or s.startswith(".local") or s.startswith(".shared"):
            raise ValueError(f"{entry}: declaration {s!r} is not one the inliner knows")
        m = _LDPARAM.match(s)
        if m:
            ty, dst, name, off = m.groups()
            if name not in index:
                raise ValueError(f"{entry}: {s!r} reads a parameter it does not declare")
            s = f"ld.global.nc.{ty} \t{dst}, [@TABLE@+{8 * index[name] + int(off or 0)}];"
        elif re.match(r"(@!?%\w+\s+)?(ret|exit);$", s):
            g = re.match(r"(@!?%\w+\s+)?", s).group(0)
            s = f"{g}bra.uni \t$@END@;" if not g else f"{g}bra \t$@END@;"
        elif re.match(r"bar\.sync\s+0;$", s):
            s = "@BAR@"
        elif re.match(r"(bar|barrier)\.", s) and not s.startswith("bar.warp.sync"):
            raise ValueError(f"{entry}: barrier {s!r} is not one the inliner knows")
        elif s.startswith("griddepcontrol."):
            continue        # the tape's counters order the bodies
        elif "%ntid.y" in s or "%ntid.z" in s:
            raise ValueError(f"{entry}: {s!r} cannot run inside the persistent kernel")
        # data other CTAs write while the kernel runs must come through the
        # coherent path; only the parameter table stays non-coherent
        s = re.sub(r"\bld\.global\.nc\.", "ld.global.", s) if not m else s
        out.append(s)
    rename = _renamer(prefix, regs, names, symbols, threads)
    decls = [rename(d) for d in decls]
    # the body's threads meet at its end: the next CTA the loop runs reuses
    # its shared memory (a launch gives each CTA its own)
    out = [rename(s).replace("$@END@", f"${prefix}end") for s in out] + [f"${prefix}end:",
                                                                         "@BAR@"]
    return Inlined(entry, tuple(params), threads, tuple(decls), tuple(out), align)


def _renamer(prefix, regs, names, symbols, threads):
    reg_pat = re.compile(r"%([A-Za-z_]\w*?)(\d*)(?=<|\b)")
    special = re.compile("|".join(map(re.escape, sorted(_SPECIAL, key=len, reverse=True))))
    label = re.compile(r"\$(\w+)")
    sym = re.compile(r"(?<![%$.\w])(" + "|".join(map(re.escape, symbols)) + r")\b") if symbols \
        else None

    def reg(m):
        base, digits = m.group(1), m.group(2)
        if base + digits in names:
            return f"%{prefix}{base}{digits}"
        if base in regs:
            return f"%{prefix}{base}{digits}"
        return m.group(0)

    def rename(s):
        s = special.sub(lambda m: _SPECIAL[m.group(0)], s)
        s = s.replace("%ntid.x", str(threads))
        s = label.sub(lambda m: m.group(0) if m.group(1) == "@END@" else f"${prefix}{m.group(1)}",
                      s)
        s = reg_pat.sub(reg, s)
        if sym is not None:
            s = sym.sub(lambda m: symbols[m.group(1)], s)
        return s
    return rename
