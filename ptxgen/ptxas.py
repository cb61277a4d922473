"""Run NVIDIA's ptxas on emitted text: validity and the resource report.

ptxas is looked up, in order, from ``$PTXGEN_PTXAS``, the ``nvidia-cuda-nvcc``
wheel (``pip install ptxgen[test]``) and the ``PATH``.  The driver uses it,
where it is found, to build the disk cache's cubins as whole programs
(:func:`ptxgen.driver.jit.compile_cubin`); nothing needs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

import functools

import attrs

__all__ = ["PtxasNotFound", "PtxasError", "FunctionReport", "find_ptxas", "assemble",
           "quote_ptx_lines", "ptxas_version"]


class PtxasNotFound(RuntimeError):
    """No ptxas binary could be found."""


class PtxasError(RuntimeError):
    """ptxas rejected the PTX; the message quotes the offending line(s)."""

    def __init__(self, log: str, ptx: str, arch: str):
        self.log = log
        self.arch = arch
        quoted = quote_ptx_lines(log, ptx)
        super().__init__(f"ptxas -arch={arch} rejected the PTX:\n{log.strip()}"
                         + (f"\n{quoted}" if quoted else ""))


@attrs.frozen
class FunctionReport:
    """What ``ptxas -v`` says about one kernel."""

    name: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    shared_bytes: int = 0
    local_bytes: int = 0
    barriers: int = 0
    #: ptxas's "Potential Performance Loss" notes (``info`` lines, e.g.
    #: ``C7509``/``C7520``: wgmma instructions serialized), code first
    advisories: tuple = ()


def find_ptxas() -> str:
    env = os.environ.get("PTXGEN_PTXAS")
    if env:
        if not os.access(env, os.X_OK):
            raise PtxasNotFound(f"PTXGEN_PTXAS={env} is not an executable file")
        return env
    try:
        import nvidia  # namespace package from the nvidia-cuda-nvcc wheel
        for base in list(getattr(nvidia, "__path__", [])):
            for sub in ("cu13/bin/ptxas", "cuda_nvcc/bin/ptxas", "cu12/bin/ptxas"):
                p = os.path.join(base, sub)
                if os.access(p, os.X_OK):
                    return p
    except ImportError:
        pass
    p = shutil.which("ptxas")
    if p:
        return p
    raise PtxasNotFound("ptxas not found: install it with `pip install nvidia-cuda-nvcc` "
                        "(or `pip install ptxgen[test]`), put CUDA's bin/ on PATH, or "
                        "set PTXGEN_PTXAS=/path/to/ptxas")


@functools.lru_cache(maxsize=8)
def ptxas_version(exe: str) -> str:
    """The release line of ``exe --version`` (e.g. ``"Cuda compilation tools,
    release 13.0, V13.0.88"``): what a cubin it wrote depends on."""
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise PtxasNotFound(f"{exe} --version failed: {proc.stderr.strip() or proc.returncode}")
    return next((ln for ln in lines if "release" in ln), lines[-1])


_LINE_RE = re.compile(r"line (\d+);")


def quote_ptx_lines(log: str, ptx: str, context: int = 0) -> str:
    """The PTX lines a ptxas/JIT log names (``line N;``), quoted."""
    lines = ptx.splitlines()
    seen = []
    for m in _LINE_RE.finditer(log):
        n = int(m.group(1))
        if n not in seen:
            seen.append(n)
    out = []
    for n in seen:
        for j in range(max(1, n - context), min(len(lines), n + context) + 1):
            out.append(f"  PTX line {j}: {lines[j - 1].strip()}")
    return "\n".join(out)


_FUNC_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers")
_BAR_RE = re.compile(r"used (\d+) barriers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_LMEM_RE = re.compile(r"(\d+) bytes lmem")
_ADVICE_RE = re.compile(r"\((C\d+)\) Potential Performance Loss: (.*)")
_NAMED_RE = re.compile(r"in the function '([^']+)'")


def _parse_report(log: str) -> list[FunctionReport]:
    reports = []
    cur = None
    advice = []                      # (function or None, "C7509: text")
    for line in log.splitlines():
        m = _FUNC_RE.search(line)
        if m:
            cur = {"name": m.group(1)}
            reports.append(cur)
            continue
        m = _ADVICE_RE.search(line)
        if m:
            named = _NAMED_RE.search(line)
            advice.append((named.group(1) if named else cur and cur["name"],
                           f"{m.group(1)}: {m.group(2).strip()}"))
            continue
        if cur is None:
            continue
        m = _PROPS_RE.search(line)
        if m:
            cur["stack_bytes"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        m = _USED_RE.search(line)
        if m:
            cur["registers"] = int(m.group(1))
            if (b := _BAR_RE.search(line)):
                cur["barriers"] = int(b.group(1))
            if (s := _SMEM_RE.search(line)):
                cur["shared_bytes"] = int(s.group(1))
            if (lm := _LMEM_RE.search(line)):
                cur["local_bytes"] = int(lm.group(1))
    for r in reports:
        r["advisories"] = tuple(text for name, text in advice if name == r["name"])
    return [FunctionReport(**r) for r in reports]


def assemble(ptx: str, arch: str, *, extra_args=(), timeout: float = 120.0, exe=None):
    """Assemble ``ptx`` for ``arch`` (e.g. ``"sm_90"``) with ``exe`` (default
    :func:`find_ptxas`).

    Returns ``(cubin_bytes, [FunctionReport, ...])``; raises
    :class:`PtxasError` with ptxas's message and the offending PTX lines.
    """
    exe = exe or find_ptxas()
    with tempfile.TemporaryDirectory(prefix="ptxgen-") as d:
        src = os.path.join(d, "kernel.ptx")
        out = os.path.join(d, "kernel.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([exe, f"-arch={arch}", "-v", *extra_args, src, "-o", out],
                              capture_output=True, text=True, timeout=timeout)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise PtxasError(log.replace(src, "kernel.ptx"), ptx, arch)
        with open(out, "rb") as f:
            cubin = f.read()
    return cubin, _parse_report(log)
