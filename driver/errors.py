"""One error path for the CUDA driver: ``check()`` turns a ``CUresult`` into an exception.

``cuda.bindings.driver`` is imported lazily by :func:`cuda` so that importing
``ptxgen.driver`` needs neither a GPU nor ``libcuda``; the driver library is
loaded by :func:`init` (``cuInit``), whose failure says what to install.
"""

from __future__ import annotations

import re
import threading

from .release import note_failure

__all__ = [
    "CUDAError",
    "CUDAUnavailableError",
    "GraphCaptureError",
    "LaunchConfigError",
    "PTXJitError",
    "check",
    "cuda",
    "init",
    "is_available",
]

_INSTALL_HINT = (
    "install the NVIDIA display driver (it provides libcuda.so) on a machine with an NVIDIA GPU; "
    "without one, run kernels on the CPU emulator (ptxgen.emu)"
)


class CUDAError(RuntimeError):
    """A CUDA driver call failed.

    Attributes
    ----------
    code : int
        The ``CUresult`` value (0 when the error is not from a driver call).
    name : str
        ``cuGetErrorName`` of the code, e.g. ``"CUDA_ERROR_INVALID_VALUE"``.
    text : str
        ``cuGetErrorString`` of the code.
    """

    def __init__(self, message: str, code: int = 0, name: str = "", text: str = ""):
        super().__init__(message)
        self.code = code
        self.name = name
        self.text = text


class CUDAUnavailableError(CUDAError):
    """No usable CUDA driver library or GPU (raised on first use, never at import)."""


class PTXJitError(CUDAError):
    """The driver's PTX JIT rejected a module.

    Attributes
    ----------
    log : str
        The JIT error log (ptxas messages).
    info_log : str
        The JIT info log.
    bad_lines : list[tuple[int, str]]
        ``(line number, PTX text)`` of each line the log points at.
    """

    def __init__(self, message, code=0, name="", text="", log="", info_log="", bad_lines=()):
        super().__init__(message, code, name, text)
        self.log = log
        self.info_log = info_log
        self.bad_lines = list(bad_lines)


class LaunchConfigError(ValueError):
    """A launch's grid, block or shared-memory request is refused before the driver is called."""


class GraphCaptureError(CUDAError):
    """A stream capture failed; the capture was ended and its partial graph discarded.

    Attributes
    ----------
    first_failure : str or None
        The first driver call that failed while the capture was open (from
        any thread), e.g. ``"cuMemcpyDtoH: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: ..."``;
        the message leads with it when it is not the error that ended the capture.
    """

    def __init__(self, message, code=0, name="", text="", first_failure=None):
        super().__init__(message, code, name, text)
        self.first_failure = first_failure


# ----------------------------------------------------------------------------- the bindings

_lock = threading.Lock()
_driver_mod = None
_initialized = False


def cuda():
    """The ``cuda.bindings.driver`` module, imported on first use.

    Raises
    ------
    CUDAUnavailableError
        When the ``cuda-bindings`` package is not installed.
    """
    global _driver_mod
    if _driver_mod is None:
        try:
            from cuda.bindings import driver as mod
        except ImportError as exc:
            raise CUDAUnavailableError(
                f"cuda-python is not installed ({exc}); install it with "
                "`pip install cuda-bindings` (ptxgen depends on it)"
            ) from exc
        _driver_mod = mod
    return _driver_mod


def _error_strings(err) -> tuple[str, str]:
    d = cuda()
    name = getattr(err, "name", None) or f"CUresult {int(err)}"
    text = ""
    try:
        r, s = d.cuGetErrorName(err)
        if not r and s:
            name = s.decode() if isinstance(s, bytes) else str(s)
        r, s = d.cuGetErrorString(err)
        if not r and s:
            text = s.decode() if isinstance(s, bytes) else str(s)
    except Exception:  # the driver library itself may be missing
        pass
    return name, text


def error_from_result(err, context: str = "", cls=CUDAError) -> CUDAError:
    """Build (not raise) the exception for a failed ``CUresult``.

    While a stream capture is open, the failure is also noted for it
    (:func:`ptxgen.driver.release.note_failure`), so that a failed capture
    names its first cause.
    """
    name, text = _error_strings(err)
    msg = f"{name}: {text}" if text else name
    if context:
        msg = f"{context}: {msg}"
    note_failure(msg)
    return cls(msg, int(err), name, text)


def check(ret, context: str = ""):
    """Unpack a ``cuda.bindings`` return tuple, raising on failure.

    Parameters
    ----------
    ret : tuple
        ``(CUresult, value...)`` as every ``cuda.bindings.driver`` call returns.
    context : str, optional
        Prefix for the error message (what was being done).

    Returns
    -------
    None, the single value, or a tuple of the values after the ``CUresult``.

    Raises
    ------
    CUDAError
        ``"NAME: explanation"`` from ``cuGetErrorName``/``cuGetErrorString``.
    """
    err = ret[0]
    if err:
        raise error_from_result(err, context)
    n = len(ret)
    if n == 1:
        return None
    if n == 2:
        return ret[1]
    return ret[1:]


def _is_missing_library(exc: BaseException) -> bool:
    if type(exc).__name__ == "DynamicLibNotFoundError":
        return True
    return isinstance(exc, OSError) or (
        isinstance(exc, RuntimeError) and re.search(r"libcuda|driver library|nvcuda", str(exc)) is not None
    )


def init() -> None:
    """Initialise the driver once (``cuInit(0)``).

    Raises
    ------
    CUDAUnavailableError
        No driver library (``libcuda``), no GPU, or a driver too old for the bindings.
    """
    global _initialized
    if _initialized:
        return
    with _lock:
        if _initialized:
            return
        d = cuda()
        try:
            ret = d.cuInit(0)
        except Exception as exc:
            if _is_missing_library(exc):
                raise CUDAUnavailableError(
                    f"no NVIDIA driver / no GPU found: the CUDA driver library could not be "
                    f"loaded ({exc}). To run on a GPU, {_INSTALL_HINT}."
                ) from exc
            raise
        err = ret[0]
        if err:
            e = error_from_result(err, "cuInit", CUDAUnavailableError)
            R = d.CUresult
            if err == R.CUDA_ERROR_NO_DEVICE:
                hint = "the NVIDIA driver is installed but reports no GPU (check CUDA_VISIBLE_DEVICES)"
            elif err == R.CUDA_ERROR_INSUFFICIENT_DRIVER:
                hint = "the installed NVIDIA driver is older than cuda-bindings needs: update the driver"
            else:
                hint = f"the CUDA driver failed to initialise; {_INSTALL_HINT}"
            raise CUDAUnavailableError(f"no NVIDIA driver / no GPU found: {e} ({hint})",
                                       e.code, e.name, e.text) from None
        _initialized = True


def is_available() -> bool:
    """True when a CUDA driver and at least one GPU can be used."""
    try:
        init()
        return check(cuda().cuDeviceGetCount()) > 0
    except CUDAError:
        return False


def _reset_for_tests() -> None:
    """Forget the cached bindings module and init state (tests only)."""
    global _driver_mod, _initialized
    _driver_mod = None
    _initialized = False
