"""Run a piece of test code in a child process under time and memory limits.

Hostile inputs (a GGUF file declaring 2^62 array elements, a template that
doubles a string forever) must be refused quickly and cheaply; a test that
ran them in the pytest process would hang or take the machine's memory when
the code under test regresses.  :func:`run_limited` runs ``fn(*args)`` in a
fresh process (``multiprocessing`` "spawn", so no state leaks in) with its
address space capped (``RLIMIT_AS``) and a wall-clock deadline, and reports
what happened: the value returned, the exception raised (type and message),
or that the limit was hit.  ``fn`` must be importable (a module-level
function) and its arguments and result picklable.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import time
import traceback

import attrs

__all__ = ["Outcome", "run_limited", "Pool"]


@attrs.frozen
class Outcome:
    """What a limited run did: ``kind`` is ``"ok"`` (``value`` returned),
    ``"error"`` (``error`` is ``"Type: message"``), ``"timeout"`` or
    ``"crash"`` (the child died: killed for memory, a signal); ``seconds``
    is the wall time and ``peak_mb`` the child's peak resident memory."""

    kind: str
    value: object = None
    error: str = ""
    seconds: float = 0.0
    peak_mb: float = 0.0

    @property
    def error_type(self) -> str:
        return self.error.partition(":")[0]


def _call(fn, args):
    """``(kind, value, error)`` of ``fn(*args)``."""
    try:
        return ("ok", fn(*args), "")
    except MemoryError:
        return ("error", None, "MemoryError: over the test's memory limit")
    except BaseException as e:                       # noqa: BLE001 - reported to the parent
        msg = f"{type(e).__name__}: {e}"
        if isinstance(e, (AssertionError, NameError, AttributeError, TypeError)):
            msg += "\n" + traceback.format_exc(limit=-3)
        return ("error", None, msg)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(conn, mem_mb):
    if mem_mb:
        limit = int(mem_mb) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        fn, args = job
        before = _rss_mb()
        t0 = time.perf_counter()
        kind, value, error = _call(fn, args)
        try:
            conn.send((kind, value, error, time.perf_counter() - t0, _rss_mb() - before))
        except Exception as e:                       # noqa: BLE001 - an unpicklable value
            conn.send(("error", None, f"unpicklable result: {e}", 0.0, 0.0))


class Pool:
    """A child process reused for many cases (starting one costs a few
    tenths of a second); a case that times out or crashes the child gets a
    fresh one.  ``peak_mb`` of an outcome is how far the child's peak
    resident memory rose during the case (0 when an earlier case had already
    reached that peak), so a memory check belongs in a fresh pool or
    :func:`run_limited`."""

    def __init__(self, mem_mb: int = 1024):
        self.mem_mb = mem_mb
        self._ctx = mp.get_context("spawn")
        self._proc = self._conn = None

    def _start(self):
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_worker, args=(child, self.mem_mb), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent

    def _stop(self):
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None

    def close(self):
        self._stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def run(self, fn, *args, timeout: float = 10.0) -> Outcome:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        t0 = time.perf_counter()
        try:
            self._conn.send((fn, args))
            if not self._conn.poll(timeout):
                self._stop()
                return Outcome("timeout", seconds=time.perf_counter() - t0)
            kind, value, error, secs, peak = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            code = self._proc.exitcode if self._proc is not None else None
            self._stop()
            return Outcome("crash", error=f"child exited with {code}",
                           seconds=time.perf_counter() - t0)
        return Outcome(kind, value, error, secs, peak)


def run_limited(fn, *args, timeout: float = 10.0, mem_mb: int = 1024) -> Outcome:
    """``fn(*args)`` in a fresh child process under ``timeout`` seconds and
    ``mem_mb`` MiB of address space."""
    with Pool(mem_mb) as pool:
        return pool.run(fn, *args, timeout=timeout)
