"""Device time of launches as a CUDA graph replays them: no host time per
launch, as in the decode step's graph.  The tuner, the benchmarks and the
tuning scripts all time calls this way.  And the bandwidth ceiling they
compare with: a device-to-device copy (:func:`copy_bandwidth`)."""

from __future__ import annotations

import statistics

__all__ = ["copy_bandwidth", "copy_ceiling", "graph_timer", "graph_us"]


def graph_timer(launch, stream, calls: int, warmup: int = 2):
    """A function timing ``launch(i)`` (the i-th call) captured ``calls``
    times in one CUDA graph on ``stream``: each call of it replays the graph
    once between two events and returns microseconds per call.

    ``warmup`` calls run outside the graph first (they build, load and
    allocate whatever the launches need, which a capture cannot)."""
    from .graph import capture
    from .stream import Event
    for i in range(warmup):
        launch(i)
    stream.synchronize()
    with capture(stream) as g:
        for i in range(calls):
            launch(i)
    exe = g.instantiate()
    exe.launch(stream)
    stream.synchronize()

    def replay() -> float:
        e0, e1 = Event(), Event()
        e0.record(stream)
        exe.launch(stream)
        e1.record(stream)
        e1.synchronize()
        return e0.elapsed_ms(e1) * 1e3 / calls
    return replay


def graph_us(launch, stream, calls: int = 20, repeats: int = 5) -> float:
    """Median microseconds per call of ``launch(i)`` over ``repeats``
    replays of a graph of ``calls`` calls (:func:`graph_timer`)."""
    replay = graph_timer(launch, stream, calls)
    return statistics.median(replay() for _ in range(repeats))


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> tuple:
    """``(bytes read + written per second, seconds per copy)`` of a
    device-to-device copy (``cuMemcpyDtoDAsync``) of ``nbytes`` between two
    device buffers: CUDA events around each copy, the median of ``reps``
    after two warm-ups.  Shares of "the read floor" divide by this figure,
    measured in the same run."""
    from cuda.bindings import driver as cu
    import numpy as np

    from .errors import check
    from .memory import DeviceArray
    from .stream import Event, Stream
    a = DeviceArray.empty((nbytes,), np.uint8)
    b = DeviceArray.empty((nbytes,), np.uint8)
    try:
        s = Stream()
        times = []
        for _ in range(reps + 2):
            e0, e1 = Event(), Event()
            e0.record(s)
            check(cu.cuMemcpyDtoDAsync(b.ptr, a.ptr, nbytes, s.handle), "cuMemcpyDtoDAsync")
            e1.record(s)
            e1.synchronize()
            times.append(e0.elapsed_ms(e1) / 1e3)
    finally:
        a.free()
        b.free()
    t = statistics.median(times[2:])
    return 2 * nbytes / t, t


def copy_ceiling(rounds: int = 3) -> float:
    """The device's copy ceiling in bytes read + written per second: the
    best of ``rounds`` medians of :func:`copy_bandwidth` (1 GiB).  One median
    once read 2.83 TB/s where every other measurement of the same call read
    2.98-2.99, which made the shares of the floor look 4 points better than
    they were; the best of three keeps a dip from doing that."""
    return max(copy_bandwidth()[0] for _ in range(rounds))
