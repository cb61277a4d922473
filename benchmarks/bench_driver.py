"""Driver-layer benchmarks, each beside the raw ``cuda.bindings.driver`` equivalent.

Run on a GPU with ``python -m benchmarks.bench_driver [out.json]`` or call
:func:`run_all`. Goals (issue 4): one ``launch`` of an empty kernel costs at
most 1.5x a raw ``cuLaunchKernel`` and at most 6 us of host time; a small
kernel inside a replayed graph costs at most 1 us; a cached module load takes
at most 5 ms; 10,000 load/unload and allocate/free cycles leave device memory
where it started.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np

from ptxgen.driver import cache as _cache
from ptxgen.driver.device import get_device
from ptxgen.driver.errors import check, cuda
from ptxgen.driver.graph import capture
from ptxgen.driver.launch import launch
from ptxgen.driver.memory import DeviceArray
from ptxgen.driver.module import Module
from ptxgen.driver.stream import Event, Stream

__all__ = ["bench_graph", "bench_launch", "bench_leaks", "bench_module_load", "run_all"]

def _dsl_ptx():
    """The benchmark kernels, written with the DSL: an empty kernel and the
    registered vector add (``c[i] = a[i] + b[i]``, params a, b, c, n)."""
    import ptxgen
    from ptxgen.kernels import vector_add
    m = ptxgen.Module()
    with m.kernel("empty"):
        pass
    vadd = vector_add.build(vector_add.VectorAddSpec())
    return m.to_ptx(), vadd.to_ptx(), vector_add.VectorAddSpec().kernel_name


EMPTY_PTX, VADD_PTX, VADD_NAME = _dsl_ptx()


def _raw_params(values_and_ctypes):
    """A raw ``void**`` kernelParams block, as a cuda.bindings user would build it."""
    holders = [ct(v) for v, ct in values_and_ctypes]
    ptrs = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    return holders, ptrs, ctypes.addressof(ptrs)


def _per_call_us(fn, batches: int, batch: int, sync) -> float:
    """Median over batches of host microseconds per call (synchronising between batches)."""
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        fn(batch)
        times.append((time.perf_counter() - t0) / batch * 1e6)
        sync()
    return statistics.median(times)


def bench_launch(batches: int = 40, batch: int = 500) -> dict:
    """Host cost of one launch: ``launch()`` vs raw ``cuLaunchKernel`` (empty kernel and vadd)."""
    d = cuda()
    get_device()
    s = Stream()
    hs = s.handle
    f = Module.from_ptx(EMPTY_PTX)["empty"]
    h = f.handle

    def raw_empty(k):
        for _ in range(k):
            d.cuLaunchKernel(h, 1, 1, 1, 32, 1, 1, 0, hs, 0, 0)

    def ours_empty(k):
        for _ in range(k):
            launch(f, 1, 32, stream=s)

    n = 1024
    v = Module.from_ptx(VADD_PTX)[VADD_NAME]
    a, b, c = (DeviceArray.zeros(n) for _ in range(3))
    _keep, _ptrs, kp = _raw_params([(a.ptr, ctypes.c_uint64), (b.ptr, ctypes.c_uint64),
                                    (c.ptr, ctypes.c_uint64), (n, ctypes.c_uint32)])
    hv = v.handle

    def raw_vadd(k):
        for _ in range(k):
            d.cuLaunchKernel(hv, 4, 1, 1, 256, 1, 1, 0, hs, kp, 0)

    def ours_vadd(k):
        for _ in range(k):
            launch(v, 4, 256, a, b, c, n, stream=s)

    sync = s.synchronize
    for fn in (raw_empty, ours_empty, raw_vadd, ours_vadd):  # warm up
        fn(200)
        sync()
    res = {}
    # interleave to share any drift between the two sides
    for name, raw, ours in (("empty", raw_empty, ours_empty), ("vadd", raw_vadd, ours_vadd)):
        r, o = [], []
        for _ in range(4):
            r.append(_per_call_us(raw, batches // 4, batch, sync))
            o.append(_per_call_us(ours, batches // 4, batch, sync))
        res[f"raw_{name}_us"] = statistics.median(r)
        res[f"launch_{name}_us"] = statistics.median(o)
        res[f"ratio_{name}"] = res[f"launch_{name}_us"] / res[f"raw_{name}_us"]
    res["goal_launch_us"] = 6.0
    res["goal_ratio"] = 1.5
    res["pass"] = res["launch_empty_us"] <= 6.0 and res["ratio_empty"] <= 1.5
    return res


def _replay_us_per_kernel(exe_launch, s, kernels: int, replays: int) -> float:
    for _ in range(3):
        exe_launch()
    s.synchronize()
    start, end = Event(), Event()
    start.record(s)
    for _ in range(replays):
        exe_launch()
    end.record(s)
    return start.elapsed_ms(end) * 1e3 / (replays * kernels)


def bench_graph(kernels: int = 100, replays: int = 50, kernel: str = "empty") -> dict:
    """Per-kernel GPU time of ~100 small launches replayed as a graph; ours vs raw capture.

    ``kernel`` is ``"empty"`` (no parameters: the per-node cost itself) or
    ``"vadd"`` (4 blocks of 256 threads adding 1024 floats).
    """
    d = cuda()
    get_device()
    s = Stream()
    hs = s.handle
    n = 1024
    if kernel == "empty":
        f = Module.from_ptx(EMPTY_PTX)["empty"]
        args, geom, kp = (), (1, 32), 0
        _keep = None
    else:
        f = Module.from_ptx(VADD_PTX)[VADD_NAME]
        a, b, c = (DeviceArray.zeros(n) for _ in range(3))
        args, geom = (a, b, c, n), (4, 256)
        _keep, _ptrs, kp = _raw_params([(a.ptr, ctypes.c_uint64), (b.ptr, ctypes.c_uint64),
                                        (c.ptr, ctypes.c_uint64), (n, ctypes.c_uint32)])
    grid, block = geom

    with capture(s) as g:
        for _ in range(kernels):
            launch(f, grid, block, *args, stream=s)
    exe = g.instantiate()
    ours = _replay_us_per_kernel(lambda: exe.launch(s), s, kernels, replays)

    check(d.cuStreamBeginCapture(hs, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    for _ in range(kernels):
        d.cuLaunchKernel(f.handle, grid, 1, 1, block, 1, 1, 0, hs, kp, 0)
    raw_graph = check(d.cuStreamEndCapture(hs))
    raw_exec = check(d.cuGraphInstantiate(raw_graph, 0))
    raw = _replay_us_per_kernel(lambda: d.cuGraphLaunch(raw_exec, hs), s, kernels, replays)
    d.cuGraphExecDestroy(raw_exec)
    d.cuGraphDestroy(raw_graph)

    def eager():
        for _ in range(kernels):
            launch(f, grid, block, *args, stream=s)

    eager_us = _replay_us_per_kernel(eager, s, kernels, max(replays // 5, 3))
    t0 = time.perf_counter()
    for _ in range(replays):
        exe.launch(s)
    host_replay_us = (time.perf_counter() - t0) / replays * 1e6
    s.synchronize()
    return {
        "kernel": kernel,
        "kernels_per_graph": kernels,
        "graph_us_per_kernel": ours,
        "raw_graph_us_per_kernel": raw,
        "eager_us_per_kernel": eager_us,
        "host_us_per_replay": host_replay_us,
        "goal_us_per_kernel": 1.0,
        "pass": ours <= 1.0,
    }


def bench_module_load(cold: int = 10, warm: int = 50) -> dict:
    """Module load: cold JIT vs the on-disk cubin cache vs the in-process cache, beside raw calls."""
    d = cuda()
    get_device()
    tag = uuid.uuid4().hex
    texts = [VADD_PTX + f"\n// bench {tag} {i}\n" for i in range(cold + warm)]  # defeats every cache

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def ours_cold(text):
        m = Module.from_ptx(text, cache=False)
        m[VADD_NAME]
        m.unload()

    def raw_cold(text):
        mod = check(d.cuModuleLoadDataEx(text.encode() + b"\0", 0, [], []))
        check(d.cuModuleGetFunction(mod, VADD_NAME.encode()))
        check(d.cuModuleUnload(mod))

    cold_ours = [timed(lambda t=t: ours_cold(t)) for t in texts[:cold // 2]]
    cold_raw = [timed(lambda t=t: raw_cold(t)) for t in texts[cold // 2:cold]]

    warm_texts = texts[cold:]
    miss_ms = []                 # a disk-cache miss: ptxas, the cubin written, then loaded
    for t in warm_texts:
        miss_ms.append(timed(lambda t=t: Module.from_ptx(t).unload()))
    disk_ms = []
    for t in warm_texts:
        def load(t=t):
            m = Module.from_ptx(t)
            assert m.source == "disk", m.source
            m[VADD_NAME]
            m.unload()
        disk_ms.append(timed(load))
    from ptxgen.driver.jit import compile_cubin, cubin_compiler, link_cubin

    tool = cubin_compiler()
    cubin = (compile_cubin(warm_texts[0], {}, get_device().target, tool[0])[0] if tool
             else link_cubin(warm_texts[0], {})[0])

    def raw_cubin():
        mod = check(d.cuModuleLoadData(cubin))
        check(d.cuModuleGetFunction(mod, VADD_NAME.encode()))
        check(d.cuModuleUnload(mod))

    raw_cubin_ms = [timed(raw_cubin) for _ in range(warm)]
    m = Module.from_ptx(warm_texts[0])
    mem_us = [timed(lambda: Module.from_ptx(warm_texts[0])) * 1e3 for _ in range(200)]
    m.unload()
    med = statistics.median
    return {
        "cold_jit_ms": med(cold_ours),
        "raw_cold_jit_ms": med(cold_raw),
        "cache_miss_ms": med(miss_ms),
        "disk_cached_ms": med(disk_ms),
        "raw_cubin_load_ms": med(raw_cubin_ms),
        "memory_cached_us": med(mem_us),
        "goal_cached_ms": 5.0,
        "pass": med(disk_ms) <= 5.0,
    }


def bench_leaks(cycles: int = 10_000) -> dict:
    """Free device memory before and after ``cycles`` load/unload and allocate/free cycles."""
    dev = get_device()
    text = VADD_PTX + f"\n// leak check {uuid.uuid4().hex}\n"
    Module.from_ptx(text).unload()  # JIT once; the cycles load the cached cubin
    DeviceArray.empty(1 << 20).free()
    gc.collect()
    dev.synchronize()
    free0, total = dev.mem_info()
    t0 = time.perf_counter()
    for i in range(cycles):
        m = Module.from_ptx(text)
        m[VADD_NAME]
        m.unload()
        a = DeviceArray.empty(1 << 20)
        if i % 2:
            a.free()
        del a  # the other half are freed by their finalizer
    elapsed = time.perf_counter() - t0
    gc.collect()
    dev.synchronize()
    free1, _ = dev.mem_info()
    return {
        "cycles": cycles,
        "free_before": free0,
        "free_after": free1,
        "delta_bytes": free0 - free1,
        "seconds": elapsed,
        "pass": free0 == free1,
    }


def _table(results: dict) -> str:
    rows = []
    L, M, K = (results[k] for k in ("launch", "module_load", "leaks"))
    rows.append(("launch() empty kernel, host us", f"{L['launch_empty_us']:.2f}", f"{L['raw_empty_us']:.2f}",
                 f"<= 6 us and <= 1.5x (x{L['ratio_empty']:.2f})", L["pass"]))
    rows.append(("launch() vadd 4 args, host us", f"{L['launch_vadd_us']:.2f}", f"{L['raw_vadd_us']:.2f}",
                 f"(x{L['ratio_vadd']:.2f})", ""))
    for G in (results["graph"], results["graph_vadd"]):
        rows.append((f"graph replay {G['kernel']}, us/kernel (x{G['kernels_per_graph']})",
                     f"{G['graph_us_per_kernel']:.3f}", f"{G['raw_graph_us_per_kernel']:.3f}", "<= 1 us", G["pass"]))
        rows.append((f"eager stream {G['kernel']}, us/kernel", f"{G['eager_us_per_kernel']:.3f}", "", "", ""))
    rows.append(("cold module load (JIT), ms", f"{M['cold_jit_ms']:.2f}", f"{M['raw_cold_jit_ms']:.2f}", "", ""))
    rows.append(("disk-cache miss (ptxas + store), ms", f"{M['cache_miss_ms']:.2f}", "", "", ""))
    rows.append(("disk-cached module load, ms", f"{M['disk_cached_ms']:.3f}", f"{M['raw_cubin_load_ms']:.3f}",
                 "<= 5 ms", M["pass"]))
    rows.append(("in-process cached load, us", f"{M['memory_cached_us']:.2f}", "", "", ""))
    rows.append((f"leak check ({K['cycles']} cycles), bytes", f"{K['delta_bytes']}", "", "0", K["pass"]))
    head = ("measure", "ptxgen", "raw cuda.bindings", "goal", "pass")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(5)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*(str(x) for x in r)) for r in rows]
    return "\n".join(lines)


def run_all(leak_cycles: int = 10_000) -> dict:
    """Run every benchmark, print a table, and return the numbers.

    The on-disk cache is pointed at a temporary directory for the run.
    """
    dev = get_device()
    old = os.environ.get("PTXGEN_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="ptxgen-bench-") as tmp:
        os.environ["PTXGEN_CACHE_DIR"] = tmp
        _cache.memory_cache.clear()
        try:
            results = {
                "device": dev.summary(),
                "numpy": np.__version__,
                "launch": bench_launch(),
                "graph": bench_graph(kernel="empty"),
                "graph_vadd": bench_graph(kernel="vadd"),
                "module_load": bench_module_load(),
                "leaks": bench_leaks(leak_cycles),
            }
        finally:
            if old is None:
                os.environ.pop("PTXGEN_CACHE_DIR", None)
            else:
                os.environ["PTXGEN_CACHE_DIR"] = old
            _cache.memory_cache.clear()
    try:
        from cuda.bindings import __version__ as cb_version
    except ImportError:
        cb_version = "?"
    results["cuda_bindings"] = cb_version
    results["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    d = results["device"]
    print(f"{d['name']} ({d['target']}), driver {d['driver_version']}, cuda-bindings {cb_version}")
    print(_table(results))
    return results


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    res = run_all()
    if argv:
        with open(argv[0], "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0 if all(res[k]["pass"] for k in ("launch", "graph", "module_load", "leaks")) else 1


if __name__ == "__main__":
    sys.exit(main())
