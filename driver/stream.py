"""Streams and events (destroyed through :func:`ptxgen.driver.release.release`)."""

from __future__ import annotations

import weakref

from .device import call_in_context, get_device
from .errors import check, cuda
from .release import release

__all__ = ["Event", "Stream", "elapsed_ms", "stream_handle"]


class Stream:
    """A CUDA stream on the current device.

    Parameters
    ----------
    non_blocking : bool
        When False (default) the stream synchronises with the legacy default
        stream, so the synchronous copies of :class:`DeviceArray` are ordered
        with it; True gives ``CU_STREAM_NON_BLOCKING``.
    priority : int
        Lower numbers are higher priority (``cuCtxGetStreamPriorityRange``).
    device : Device or int, optional

    Attributes
    ----------
    handle : CUstream
    """

    __slots__ = ("handle", "device", "_finalizer", "__weakref__")

    def __init__(self, *, non_blocking: bool = False, priority: int = 0, device=None):
        self.device = get_device(device)
        d = cuda()
        flags = d.CUstream_flags.CU_STREAM_NON_BLOCKING if non_blocking else d.CUstream_flags.CU_STREAM_DEFAULT
        self.handle = check(d.cuStreamCreateWithPriority(int(flags), priority), "cuStreamCreateWithPriority")
        self._finalizer = weakref.finalize(self, release, f"cuStreamDestroy({self.handle})",
                                           call_in_context, self.device.context, "cuStreamDestroy",
                                           self.handle)

    @property
    def ptr(self) -> int:
        """The ``CUstream`` as an integer (for torch/cupy ``ExternalStream``)."""
        return int(self.handle)

    def synchronize(self) -> None:
        """Block until all work queued on the stream has finished."""
        check(cuda().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def query(self) -> bool:
        """True when all queued work has finished (non-blocking)."""
        d = cuda()
        err = d.cuStreamQuery(self.handle)[0]
        if err == d.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((err,), "cuStreamQuery")
        return True

    def record(self, event: "Event | None" = None) -> "Event":
        """Record ``event`` (a new timing event if None) on this stream and return it."""
        event = event if event is not None else Event()
        event.record(self)
        return event

    def wait(self, event: "Event") -> None:
        """Make future work on this stream wait for ``event``."""
        check(cuda().cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")

    def close(self) -> None:
        """Destroy the stream now (after this it must not be used)."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"<Stream 0x{self.ptr:x}>"


def stream_handle(stream):
    """The driver handle for ``stream``: None -> 0 (legacy default stream), a
    :class:`Stream`, a raw ``CUstream``, an int, or an object with ``cuda_stream``
    (torch) or ``__cuda_stream__`` (cuda.core protocol)."""
    if stream is None:
        return 0
    h = getattr(stream, "handle", None)
    if h is not None and isinstance(stream, Stream):
        return h
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    d = cuda()
    if isinstance(stream, d.CUstream):
        return stream
    raise TypeError(f"expected a Stream, None, an int handle or a torch/cupy stream, got {type(stream).__name__}")


class Event:
    """A CUDA event.

    Parameters
    ----------
    timing : bool
        Record timestamps (needed for :meth:`elapsed_ms`); disable for pure sync events.
    """

    __slots__ = ("handle", "timing", "_finalizer", "__weakref__")

    def __init__(self, timing: bool = True):
        dev = get_device()
        d = cuda()
        F = d.CUevent_flags
        flags = int(F.CU_EVENT_DEFAULT) if timing else int(F.CU_EVENT_DISABLE_TIMING)
        self.timing = timing
        self.handle = check(d.cuEventCreate(flags), "cuEventCreate")
        self._finalizer = weakref.finalize(self, release, f"cuEventDestroy({self.handle})",
                                           call_in_context, dev.context, "cuEventDestroy", self.handle)

    def record(self, stream=None) -> "Event":
        """Record on ``stream`` (default: the legacy default stream); returns self."""
        check(cuda().cuEventRecord(self.handle, stream_handle(stream)), "cuEventRecord")
        return self

    def synchronize(self) -> None:
        """Block until the event has completed."""
        check(cuda().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def query(self) -> bool:
        """True when the event has completed."""
        d = cuda()
        err = d.cuEventQuery(self.handle)[0]
        if err == d.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((err,), "cuEventQuery")
        return True

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to ``end`` (both recorded; waits for ``end``)."""
        return elapsed_ms(self, end)


def elapsed_ms(start: Event, end: Event) -> float:
    """Milliseconds between two recorded timing events (synchronises on ``end``)."""
    if not (start.timing and end.timing):
        raise ValueError("elapsed_ms needs events created with timing=True")
    end.synchronize()
    return float(check(cuda().cuEventElapsedTime(start.handle, end.handle), "cuEventElapsedTime"))
