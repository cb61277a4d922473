"""One path for releasing driver resources, held back while a stream capture is open.

Every object of this layer that owns a driver resource (device and pinned
host memory, modules, graphs and their executables, streams, events)
releases it through :func:`release`, from its ``weakref.finalize`` or from
an explicit ``free()``, ``unload()`` or ``close()``.

While a stream capture is open, a release that reached the driver would
break it: in the default global mode a ``cuMemFree``, unload or destroy is
an unsafe call from whichever thread makes it, it invalidates the capture,
and the error only surfaces at the next call into the capture, naming that
call. Python's cyclic collector makes this likely rather than rare: it runs
at an arbitrary allocation, and the objects it collects release their
resources right there, inside whatever capture is open. So while a capture
is open, releases are held, whoever asks for them (the collector, another
thread, user code dropping an array), and the held ones are made when the
last open capture ends, whether it succeeded or failed.

Open captures are counted process-wide, not per context: the driver's rule
for global mode speaks of threads, not contexts, and a release held a
little longer costs nothing.

The same record notes the first driver call that failed while a capture was
open (:func:`note_failure`, from ``errors.error_from_result``), so that a
failed capture can name its first cause rather than the launch that noticed.

Limit: only captures opened through :class:`ptxgen.driver.capture` (or
:func:`hold_releases`) are seen. A capture that other code opens on the same
context (``torch.cuda.graph``, cupy) is invisible here: the driver answers
``cuStreamIsCapturing`` for one stream at a time, and there is no call that
says whether any stream of a context is capturing. Wrap such a capture in
:func:`hold_releases` when ptxgen objects may be dropped while it is open.

This module calls no driver function itself; the release functions do.
"""

from __future__ import annotations

import collections
import contextlib
import threading

__all__ = ["CaptureWatch", "capture_open", "close_capture", "hold_releases", "note_failure",
           "open_capture", "release"]

# Re-entrant: the collector may run a finalizer, and so call release(), inside
# any allocation, including one made while this thread holds the lock.
_lock = threading.RLock()
_open: list["CaptureWatch"] = []
_held: "collections.deque[tuple]" = collections.deque()


class CaptureWatch:
    """What happened while one capture was open.

    Attributes
    ----------
    thread : str
        Name of the thread that opened the capture.
    first_failure : tuple[str, str] or None
        ``(message, thread name)`` of the first driver call that failed while
        the capture was open, from any thread.
    held : int
        Releases asked for while it was open (held until no capture is open).
    first_held : str or None
        What the first of them releases.
    """

    __slots__ = ("thread", "first_failure", "held", "first_held")

    def __init__(self):
        self.thread = threading.current_thread().name
        self.first_failure = None
        self.held = 0
        self.first_held = None

    @property
    def first_message(self) -> str | None:
        """The first failure's message, or None."""
        return None if self.first_failure is None else self.first_failure[0]

    def cause(self, noticed: str = "") -> str:
        """The first failure as a phrase, or ``""`` when there was none or
        it is ``noticed`` itself (the error already being reported)."""
        if self.first_failure is None:
            return ""
        message, thread = self.first_failure
        if message == noticed:
            return ""
        where = "" if thread == self.thread else f" (in thread {thread!r})"
        return f"the first driver call to fail while it was open: {message}{where}"

    def held_note(self) -> str:
        """The releases held back during the capture, as a phrase (``""`` when none)."""
        if not self.held:
            return ""
        what = f"{self.held} releases" if self.held > 1 else "1 release"
        verb = "were" if self.held > 1 else "was"
        return (f"{what} asked for while it was open (first: {self.first_held}) "
                f"{verb} held back until it ended")


def open_capture() -> CaptureWatch:
    """Count a capture as open (before ``cuStreamBeginCapture``): from now on
    releases are held. Pair with :func:`close_capture`."""
    watch = CaptureWatch()
    with _lock:
        _open.append(watch)
    return watch


def close_capture(watch: CaptureWatch) -> None:
    """Count ``watch``'s capture as ended (after ``cuStreamEndCapture``, also
    when it failed); when no other capture is open, make the held releases."""
    with _lock:
        for i, w in enumerate(_open):
            if w is watch:
                del _open[i]
                break
        else:
            raise ValueError("close_capture: this capture is not open")
        # still under the lock: no capture can open while the held ones are made
        while not _open and _held:
            _what, fn, args = _held.popleft()
            _run(fn, args)


@contextlib.contextmanager
def hold_releases():
    """Hold releases while the ``with`` block runs: wrap a capture made by
    other code (``torch.cuda.graph``) around which ptxgen objects may be dropped.

    Yields
    ------
    CaptureWatch
    """
    watch = open_capture()
    try:
        yield watch
    finally:
        close_capture(watch)


def capture_open() -> bool:
    """True while any capture is counted open (releases are being held)."""
    return bool(_open)


def release(what: str, fn, *args) -> None:
    """Call ``fn(*args)`` to release a driver resource, now or, while a
    capture is open, when the last open capture ends.

    Parameters
    ----------
    what : str
        What is released (``"cuMemFree(0x7f0000000000, 4096 bytes)"``), for messages.
    fn : callable
        Makes the driver call and raises on failure; its exception is
        swallowed (a finalizer has nowhere to raise to).
    *args
        Its arguments.
    """
    with _lock:
        if _open:
            _held.append((what, fn, args))
            for w in _open:
                if not w.held:
                    w.first_held = what
                w.held += 1
            return
        _run(fn, args)


def _run(fn, args) -> None:
    try:
        fn(*args)
    except Exception:
        pass


def note_failure(message: str) -> None:
    """Record ``message`` (a failed driver call) as the first failure of
    each open capture that has none yet."""
    if not _open:
        return
    thread = threading.current_thread().name
    with _lock:
        for w in _open:
            if w.first_failure is None:
                w.first_failure = (message, thread)
