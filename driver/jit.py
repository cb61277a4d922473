"""PTX to machine code: the driver's JIT, ptxas for the disk cache, and JIT error reports.

``load_ptx`` calls ``cuModuleLoadDataEx`` with error and info log buffers and
raises :class:`PTXJitError` quoting the JIT log and the PTX line(s) it points
at. It compiles the module as a whole program.

The disk cache needs the cubin's bytes, which a loaded module does not give
back. ``compile_cubin`` gets them from ptxas (found as :mod:`ptxgen.ptxas`
finds it), also as a whole program, so a cached kernel is the same machine
code the driver's JIT would make. The driver's linker (``link_cubin``,
``cuLink*``) is the other way to get bytes, but it compiles PTX as
relocatable code, which costs kernels registers and speed and turns
``div.rn`` into an extern call that makes ptxas serialize every ``wgmma``
of the kernel (docs/driver.md, "The module cache"). It is kept for
measurements only.
"""

from __future__ import annotations

import ctypes
import re
import threading

from ptxgen import ptxas as _ptxas

from .errors import PTXJitError, check, cuda, error_from_result

__all__ = ["compile_cubin", "cubin_compiler", "jit_error", "link_cubin", "load_cubin",
           "load_ptx", "normalize_options", "ptx_text", "ptxas_arch", "refuse_compiler"]

LOG_SIZE = 16384
_LINE_RE = re.compile(r"ptx(?:as)?[^,\n]*?,\s*line\s+(\d+)", re.I)
_OPTION_NAMES = ("max_registers", "opt_level", "line_info", "debug_info")


def ptx_text(ptx) -> str:
    """PTX text of a str, bytes, or an object with ``to_ptx()`` (a ptxgen module)."""
    if hasattr(ptx, "to_ptx"):
        ptx = ptx.to_ptx()
    if isinstance(ptx, (bytes, bytearray)):
        ptx = bytes(ptx).decode()
    if not isinstance(ptx, str):
        raise TypeError(f"expected PTX text or an object with to_ptx(), got {type(ptx).__name__}")
    return ptx


def normalize_options(options) -> dict:
    """Check JIT options; returns a plain dict with only the options that are set.

    Parameters
    ----------
    options : dict or None
        ``max_registers`` (int), ``opt_level`` (0..4), ``line_info`` (bool),
        ``debug_info`` (bool).
    """
    out = {}
    for k, v in dict(options or {}).items():
        if k not in _OPTION_NAMES:
            raise ValueError(f"unknown JIT option {k!r}; known: {', '.join(_OPTION_NAMES)}")
        if v is None:
            continue
        if k == "opt_level" and (not isinstance(v, int) or not 0 <= v <= 4):
            raise ValueError(f"opt_level must be an int in 0..4, got {v!r}")
        if k == "max_registers" and (not isinstance(v, int) or not 16 <= v <= 255):
            raise ValueError(f"max_registers must be an int in 16..255, got {v!r}")
        if k in ("line_info", "debug_info"):
            v = bool(v)
        out[k] = v
    return out


def _jit_options(options: dict):
    d = cuda()
    J = d.CUjit_option
    err_buf = bytearray(LOG_SIZE)
    info_buf = bytearray(LOG_SIZE)
    opts = [
        J.CU_JIT_ERROR_LOG_BUFFER, J.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        J.CU_JIT_INFO_LOG_BUFFER, J.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
    ]
    vals = [err_buf, LOG_SIZE, info_buf, LOG_SIZE]
    if "max_registers" in options:
        opts.append(J.CU_JIT_MAX_REGISTERS)
        vals.append(options["max_registers"])
    if "opt_level" in options:
        opts.append(J.CU_JIT_OPTIMIZATION_LEVEL)
        vals.append(options["opt_level"])
    if options.get("line_info"):
        opts.append(J.CU_JIT_GENERATE_LINE_INFO)
        vals.append(1)
    if options.get("debug_info"):
        opts.append(J.CU_JIT_GENERATE_DEBUG_INFO)
        vals.append(1)
    return opts, vals, err_buf, info_buf


def _log(buf: bytearray) -> str:
    return bytes(buf).split(b"\0", 1)[0].decode(errors="replace").strip()


def jit_error(err, text: str, log: str, info_log: str = "", what: str = "PTX JIT") -> PTXJitError:
    """Build a :class:`PTXJitError` quoting ``log`` and the PTX lines it names."""
    base = error_from_result(err, what) if err is not None else None
    lines = text.splitlines()
    bad = []
    for n in dict.fromkeys(int(m.group(1)) for m in _LINE_RE.finditer(log)):
        if 1 <= n <= len(lines):
            bad.append((n, lines[n - 1]))
    kernels = re.findall(r"\.entry\s+([A-Za-z_$%][\w$]*)", text)
    parts = [f"{what} rejected the PTX" + (f" of {', '.join(kernels)}" if kernels else "")]
    if base is not None:
        parts[0] += f" ({base.name}: {base.text})" if base.text else f" ({base.name})"
    parts.append("JIT log:\n" + (log or "(empty)"))
    if bad:
        width = len(str(max(n for n, _ in bad)))
        parts.append("offending PTX:\n" + "\n".join(f"  {n:>{width}} | {s}" for n, s in bad))
    return PTXJitError(
        "\n".join(parts),
        base.code if base else 0,
        base.name if base else "",
        base.text if base else "",
        log=log,
        info_log=info_log,
        bad_lines=bad,
    )


def load_ptx(text: str, options: dict):
    """``cuModuleLoadDataEx`` on PTX text; returns ``(CUmodule, info_log)``.

    The JIT targets the current context's device.
    """
    d = cuda()
    opts, vals, err_buf, info_buf = _jit_options(options)
    image = text.encode() + b"\0"
    ret = d.cuModuleLoadDataEx(image, len(opts), opts, vals)
    if ret[0]:
        raise jit_error(ret[0], text, _log(err_buf), _log(info_buf), "cuModuleLoadDataEx")
    return ret[1], _log(info_buf)


def link_cubin(text: str, options: dict) -> tuple[bytes, str]:
    """Compile PTX to a cubin for the current device with ``cuLink*``; ``(cubin, info_log)``."""
    d = cuda()
    opts, vals, err_buf, info_buf = _jit_options(options)
    state = check(d.cuLinkCreate(len(opts), opts, vals), "cuLinkCreate")
    try:
        image = text.encode() + b"\0"
        ret = d.cuLinkAddData(state, d.CUjitInputType.CU_JIT_INPUT_PTX, image, len(image),
                              b"ptxgen.ptx", 0, None, None)
        if ret[0]:
            raise jit_error(ret[0], text, _log(err_buf), _log(info_buf), "cuLinkAddData")
        ret = d.cuLinkComplete(state)
        if ret[0]:
            raise jit_error(ret[0], text, _log(err_buf), _log(info_buf), "cuLinkComplete")
        addr, size = int(ret[1]), int(ret[2])
        cubin = ctypes.string_at(addr, size)  # owned by the linker: copy before destroy
    finally:
        d.cuLinkDestroy(state)
    return cubin, _log(info_buf)


_compiler_lock = threading.Lock()
_compiler: dict = {}


def cubin_compiler() -> "tuple[str, str] | None":
    """``(ptxas path, its release line)`` for :func:`compile_cubin`, or None
    where no ptxas is found or this process found that the driver refuses
    its cubins (see :func:`refuse_compiler`)."""
    with _compiler_lock:
        if "tool" not in _compiler:
            try:
                exe = _ptxas.find_ptxas()
                _compiler["tool"] = (exe, _ptxas.ptxas_version(exe))
            except (_ptxas.PtxasNotFound, OSError, ValueError):
                _compiler["tool"] = None
        return _compiler["tool"]


def refuse_compiler() -> None:
    """Stop using ptxas in this process (the driver would not load its cubin:
    a ptxas newer than the driver)."""
    with _compiler_lock:
        _compiler["tool"] = None


_TARGET_RE = re.compile(r"^\s*\.target\s+(sm_\d+[af]?)", re.M)


def ptxas_arch(text: str, device_target: str) -> str:
    """The ``-arch`` for ``text`` on a ``device_target`` device: the module's
    own target where it is that device's architecture-specific variant
    (``sm_90a`` on an ``sm_90``), else the device's."""
    m = _TARGET_RE.search(text)
    if m and m.group(1).rstrip("af") == device_target:
        return m.group(1)
    return device_target


def compile_cubin(text: str, options: dict, arch: str, exe: str) -> tuple[bytes, str]:
    """Compile PTX to a cubin for ``arch`` with ptxas ``exe``, as a whole
    program; ``(cubin, a line a kernel of ptxas's registers and spills)``.
    Raises :class:`ptxgen.ptxas.PtxasError`."""
    args = []
    if "max_registers" in options:
        args.append(f"-maxrregcount={options['max_registers']}")
    if "opt_level" in options:
        args.append(f"-O{options['opt_level']}")
    if options.get("line_info"):
        args.append("-lineinfo")
    if options.get("debug_info"):
        args.append("-g")
    cubin, reports = _ptxas.assemble(text, arch, extra_args=args, exe=exe)
    info = "\n".join(f"ptxas {arch} {r.name}: {r.registers} registers, {r.spill_stores} bytes "
                     f"spill stores, {r.spill_loads} bytes spill loads" for r in reports)
    return cubin, info


def load_cubin(cubin: bytes):
    """``cuModuleLoadData`` on a cubin image; returns the ``CUmodule``."""
    return check(cuda().cuModuleLoadData(cubin), "cuModuleLoadData")
