"""Per-CTA timelines: when every CTA of a kernel started, got past
``griddepcontrol.wait`` and finished, and on which SM.

:func:`instrument` rewrites a module's PTX text so that thread 0 of every CTA
reads ``%globaltimer`` (the GPU's nanosecond clock, the same for every SM) on
entry, after each ``griddepcontrol.wait`` and before it leaves, and writes one
record to a buffer in the module's own global memory (``ptxgen_timeline``).
On entry the thread takes its launch number from a counter of its own
(kernel, CTA) pair (``ptxgen_timeline_n``, an uncontended ``atom.add``
whose latency overlaps the kernel's work), so the records of every launch of
a kernel are kept apart: a graph that launches a kernel once per layer
leaves one record per CTA per layer.  At exit the thread only stores (32
bytes).

:func:`instrumenting` makes :meth:`ptxgen.driver.Module.from_ptx` instrument
every module loaded inside it (the disk cache is bypassed), and
:func:`read` / :func:`reset` fetch and clear a module's records.

A record is ``(start, wait, end, kernel, launch, cta, sm)``: three
``%globaltimer`` readings in ns (``wait`` equals ``start`` in a kernel without
``griddepcontrol.wait``), the kernel's index in the module (``.entry``
order, as :attr:`Module.names`), the launch number since the last
:func:`reset`, the CTA's linear index and ``%smid``.  The clock's granularity is the GPU's (32 ns on an
H100); measure it from the records rather than assume nanoseconds.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np

from ptxgen.abi import parse_entries

__all__ = ["instrument", "instrumenting", "read", "reset", "RECORD_FIELDS"]

RECORD_FIELDS = ("start", "wait", "end", "kernel", "launch", "cta", "sm")
_BUF = "ptxgen_timeline"
_CNT = "ptxgen_timeline_n"
_GEOM = "ptxgen_timeline_geom"      # (kernels, launches, max_ctas)
_REC_BYTES = 32     # start, wait, end (u64), cta (u32), sm (u32)

_ENTRY = re.compile(r"^\s*(?:\.(?:visible|weak)\s+)?\.entry\s+[A-Za-z_$][\w$]*")
_EXIT = re.compile(r"^(\s*)(@(!?)(%\w+)\s+)?(ret|exit)\s*;\s*$")


def instrument(ptx: str, launches: int = 128, max_ctas: int = 2048) -> str:
    """``ptx`` with per-CTA timeline records added to every kernel.

    ``launches``: launches per kernel recorded until the next :func:`reset`
    (later ones record nothing); ``max_ctas``: CTAs per launch recorded (CTAs
    whose linear index is past it record nothing).
    """
    if _BUF in ptx:
        raise ValueError("this PTX is already instrumented")
    for name, v in (("launches", launches), ("max_ctas", max_ctas)):
        if not isinstance(v, int) or not 1 <= v <= 1 << 16:
            raise ValueError(f"{name} must be in 1..65536, got {v!r}")
    n_kernels = len(parse_entries(ptx))
    if not n_kernels:
        raise ValueError("no .entry in this PTX")
    if n_kernels * launches * max_ctas * _REC_BYTES > 1 << 30:
        raise ValueError(f"{n_kernels} kernels x {launches} launches x {max_ctas} CTAs of "
                         f"records exceed 1 GiB; record fewer")
    out = []
    kernel = -1
    in_body = declared = False
    for line in ptx.splitlines():
        s = line.strip()
        if _ENTRY.match(line):
            if kernel < 0:
                out.append(f".global .align 16 .b8 {_BUF}"
                           f"[{n_kernels * launches * max_ctas * _REC_BYTES}];")
                out.append(f".global .align 4 .u32 {_CNT}[{n_kernels * max_ctas}];")
                out.append(f".global .align 4 .u32 {_GEOM}[3] = "
                           f"{{{n_kernels}, {launches}, {max_ctas}}};")
            kernel += 1
            in_body = declared = False
            out.append(line)
            continue
        if s == "{" and kernel >= 0 and not in_body:
            in_body = True
            out.append(line)
            out.append("\t.reg .u64 \t%tlt<3>;")
            out.append("\t.reg .u64 \t%tla<2>;")
            out.append("\t.reg .u32 \t%tls<6>;")
            out.append("\t.reg .pred \t%tlp<3>;")
            continue
        if in_body and not declared and s and not s.startswith((".reg", ".shared", ".local")):
            declared = True
            out.extend(_entry(kernel, launches, max_ctas))
        if in_body and s == "griddepcontrol.wait;":
            out.append(line)
            out.append("\tmov.u64 \t%tlt1, %globaltimer;")
            continue
        m = _EXIT.match(line)
        if in_body and m:
            out.extend(_record(kernel, launches, max_ctas, m.group(3), m.group(4)))
            out.append(line)
            continue
        if in_body and s == "}":
            in_body = False
        out.append(line)
    if kernel + 1 != n_kernels:
        raise ValueError(f"found {kernel + 1} of the {n_kernels} .entry lines to instrument")
    return "\n".join(out) + "\n"


def _entry(kernel: int, launches: int, max_ctas: int) -> list[str]:
    """The entry reading; thread 0 of a recorded CTA (%tlp0) issues the
    atomic that gives its launch number (%tls2, first used at the exit)."""
    return [
        "\tmov.u64 \t%tlt0, %globaltimer;",
        "\tmov.u64 \t%tlt1, %tlt0;",
        "\tmov.u32 \t%tls0, %tid.x;",
        "\tmov.u32 \t%tls1, %tid.y;",
        "\tor.b32 \t%tls0, %tls0, %tls1;",
        "\tmov.u32 \t%tls1, %tid.z;",
        "\tor.b32 \t%tls0, %tls0, %tls1;",
        # linear CTA index: x + nx * (y + ny * z)
        "\tmov.u32 \t%tls3, %ctaid.z;",
        "\tmov.u32 \t%tls4, %nctaid.y;",
        "\tmov.u32 \t%tls5, %ctaid.y;",
        "\tmad.lo.u32 \t%tls3, %tls3, %tls4, %tls5;",
        "\tmov.u32 \t%tls4, %nctaid.x;",
        "\tmov.u32 \t%tls5, %ctaid.x;",
        "\tmad.lo.u32 \t%tls3, %tls3, %tls4, %tls5;",
        f"\tsetp.lt.u32 \t%tlp0, %tls3, {max_ctas};",
        "\tsetp.eq.and.u32 \t%tlp0, %tls0, 0, %tlp0;",
        f"\tmov.u64 \t%tla0, {_CNT};",
        f"\tadd.u32 \t%tls4, %tls3, {kernel * max_ctas};",
        "\tmul.wide.u32 \t%tla1, %tls4, 4;",
        "\tadd.u64 \t%tla0, %tla0, %tla1;",
        "\tmov.u32 \t%tls2, 0;",
        "\t@%tlp0 atom.global.add.u32 \t%tls2, [%tla0], 1;",
    ]


def _record(kernel: int, launches: int, max_ctas: int, neg: str | None,
            guard: str | None) -> list[str]:
    """At a ret/exit (for a guarded one, only where the guard holds); the
    launch number's atomic was issued on entry, so its latency is long past."""
    pred = "%tlp1"
    code = [
        f"\tsetp.lt.u32 \t%tlp1, %tls2, {launches};",
        "\tand.pred \t%tlp1, %tlp1, %tlp0;",
        # record (kernel * launches + launch) * max_ctas + cta
        f"\tmad.lo.u32 \t%tls4, %tls2, {max_ctas}, %tls3;",
        f"\tadd.u32 \t%tls4, %tls4, {kernel * launches * max_ctas};",
        f"\tmov.u64 \t%tla0, {_BUF};",
        f"\tmul.wide.u32 \t%tla1, %tls4, {_REC_BYTES};",
        "\tadd.u64 \t%tla0, %tla0, %tla1;",
    ]
    if guard:
        code.append(f"\tand.pred \t%tlp2, %tlp1, {'!' if neg else ''}{guard};")
        pred = "%tlp2"
    code += [
        "\tmov.u64 \t%tlt2, %globaltimer;",
        "\tmov.u32 \t%tls5, %smid;",
        f"\t@{pred} st.global.v2.u64 \t[%tla0], {{%tlt0, %tlt1}};",
        f"\t@{pred} st.global.u64 \t[%tla0+16], %tlt2;",
        f"\t@{pred} st.global.v2.u32 \t[%tla0+24], {{%tls3, %tls5}};",
    ]
    return code


def _global(module, name):
    from .errors import check, cuda
    return check(cuda().cuModuleGetGlobal(module.handle, name.encode()), "cuModuleGetGlobal")


def read(module) -> np.ndarray:
    """The module's records, a structured array with :data:`RECORD_FIELDS`
    ordered by kernel, launch and CTA (``module``: a
    :class:`ptxgen.driver.Module` built from instrumented PTX)."""
    from .errors import check, cuda
    d = cuda()
    gptr, _ = _global(module, _GEOM)
    geom = np.zeros(3, np.uint32)
    check(d.cuMemcpyDtoH(geom.ctypes.data, gptr, 12), "cuMemcpyDtoH")
    nk, nl, nc = (int(v) for v in geom)
    cptr, _ = _global(module, _CNT)
    counts = np.zeros(nk * nc, np.uint32)
    check(d.cuMemcpyDtoH(counts.ctypes.data, cptr, counts.nbytes), "cuMemcpyDtoH")
    counts = np.minimum(counts.reshape(nk, nc), nl)
    bptr, _ = _global(module, _BUF)
    recs = []
    for kern in range(nk):
        nlk = int(counts[kern].max())
        if not nlk:
            continue
        raw = np.zeros(nlk * nc * 4, np.uint64)
        off = kern * nl * nc * _REC_BYTES
        check(d.cuMemcpyDtoH(raw.ctypes.data, int(bptr) + off, raw.nbytes), "cuMemcpyDtoH")
        raw = raw.reshape(nlk, nc, 4)
        launch, cta = np.nonzero(np.arange(nlk)[:, None] < counts[kern][None, :])
        r = raw[launch, cta]
        words = r[:, 3:4].copy().view(np.uint32)
        rec = np.zeros(len(r), dtype=[(f, np.int64) for f in RECORD_FIELDS])
        rec["start"], rec["wait"], rec["end"] = r[:, 0], r[:, 1], r[:, 2]
        rec["kernel"], rec["launch"] = kern, launch
        rec["cta"], rec["sm"] = words[:, 0], words[:, 1]
        recs.append(rec)
    if not recs:
        return np.zeros(0, dtype=[(f, np.int64) for f in RECORD_FIELDS])
    return np.concatenate(recs)


def reset(module) -> None:
    """Zero the module's launch counters (its records are then overwritten)."""
    from .errors import check, cuda
    cptr, nbytes = _global(module, _CNT)
    check(cuda().cuMemsetD32(cptr, 0, nbytes // 4), "cuMemsetD32")


@contextlib.contextmanager
def instrumenting(launches: int = 128, max_ctas: int = 2048):
    """Inside the block, every module :meth:`Module.from_ptx` loads is
    instrumented (and not taken from or put in the disk cache).  Yields the
    list the loaded modules are appended to."""
    from . import module as M
    from .jit import ptx_text
    orig = M.Module.from_ptx.__func__
    loaded = []

    def from_ptx(cls, ptx, *, device=None, options=None, cache=True):
        mod = orig(cls, instrument(ptx_text(ptx), launches, max_ctas), device=device,
                   options=options, cache=False)
        loaded.append(mod)
        return mod

    M.Module.from_ptx = classmethod(from_ptx)
    try:
        yield loaded
    finally:
        M.Module.from_ptx = classmethod(orig)
