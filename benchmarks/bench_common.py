"""The bandwidth ceiling every benchmark compares against.

``copy_bandwidth()`` times ``cuMemcpyDtoDAsync`` of 1 GiB between two device
buffers (CUDA events around each copy, median of 10 after 2 warm-ups) and
returns bytes read + written per second.  Every GPU benchmark (GEMV, decode
kernels, the model) divides by this one figure, measured in its own run.

(An elementwise ``torch`` copy of a ``uint8`` tensor stays well below this on
an H100, so it is not used as the ceiling; a float32 ``torch`` copy agrees
with the driver's copy.)
"""

from __future__ import annotations

__all__ = ["copy_bandwidth", "graph_us", "torch_graph_us"]


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> tuple[float, float]:
    """``(bytes read + written per second, seconds per copy)`` of a
    device-to-device copy of ``nbytes`` (:func:`ptxgen.driver.timing.copy_bandwidth`)."""
    from ptxgen.driver.timing import copy_bandwidth as copy
    return copy(nbytes, reps)


def graph_us(fn, stream, reps: int, repeats: int) -> float:
    """Median µs per call of ``fn(stream)``: ``reps`` calls captured in one
    ptxgen CUDA graph, replayed ``repeats`` times between CUDA events
    (:func:`ptxgen.driver.timing.graph_us`), after torch's stream, where
    the inputs were made, has finished."""
    import torch

    from ptxgen.driver.timing import graph_us as _graph_us
    torch.cuda.synchronize()
    return _graph_us(lambda i: fn(stream), stream, reps, repeats)


def torch_graph_us(fn, reps: int, repeats: int, *, eager_fallback: bool = False):
    """Median µs per call of the torch work ``fn()``: ``reps`` calls
    captured in one ``torch.cuda.CUDAGraph`` (after two warm-up calls on a
    side stream), replayed ``repeats`` times between CUDA events: the peer's
    figure beside :func:`graph_us`.  With ``eager_fallback`` a torch whose
    ops refuse capture is timed issuing the calls one by one instead, and
    the result is ``(µs, "graph" | "eager")``."""
    import statistics

    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        run, mode = g.replay, "graph"
    except Exception as e:                      # a torch whose ops refuse capture
        if not eager_fallback:
            raise
        print(f"torch graph capture failed ({type(e).__name__}: {e}); timing eagerly")
        torch.cuda.synchronize()

        def run():
            for _ in range(reps):
                fn()
        mode = "eager"
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / reps)
    med = statistics.median(times)
    return (med, mode) if eager_fallback else med

