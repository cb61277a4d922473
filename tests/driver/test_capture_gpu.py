"""Releases during a real stream capture, and the capture error's first cause
(skipped cleanly without a driver or device)."""

import gc
import threading

import numpy as np
import pytest

from driver_ptx import VADD_PTX
from ptxgen.driver import CUDAError, DeviceArray, GraphCaptureError, Module, Stream, capture, launch
from ptxgen.driver.release import capture_open

pytestmark = pytest.mark.gpu

MIB = 1 << 20


@pytest.fixture
def vadd(gpu_device, cache_root):
    return Module.from_ptx(VADD_PTX)["vadd"]


def _settled_free(dev) -> int:
    gc.collect()
    dev.synchronize()
    return dev.mem_info()[0]


def test_arrays_dropped_during_a_capture_are_freed_after_it(gpu_device, vadd, rng):
    """Arrays held only by a reference cycle, collected inside a global-mode
    capture, and an array freed by another thread during it: the capture
    succeeds, its graph computes the right thing, and the memory comes back
    when it ends."""
    dev = gpu_device
    n = 4096
    a = rng.standard_normal(n, np.float32)
    b = rng.standard_normal(n, np.float32)
    da, db = DeviceArray.from_numpy(a), DeviceArray.from_numpy(b)
    dc, dd = (DeviceArray.from_numpy(np.full(n, np.nan, np.float32)) for _ in range(2))
    s = Stream()
    blocks = (n + 255) // 256
    with capture(s) as g:                    # warm-up capture: the first one allocates driver state
        launch(vadd, blocks, 256, da, db, dc, n, stream=s)
    del g
    free0 = _settled_free(dev)

    junk = [DeviceArray.empty(8 * MIB, np.uint8) for _ in range(4)]
    junk.append(junk)                        # held only by this cycle once the name goes
    other = DeviceArray.empty(8 * MIB, np.uint8)
    dev.synchronize()
    free_held = dev.mem_info()[0]
    assert free0 - free_held >= 40 * MIB - 2 * MIB, (free0, free_held)
    del junk
    with capture(s) as g:
        launch(vadd, blocks, 256, da, db, dc, n, stream=s)      # c = a + b
        assert gc.collect() > 0                                 # the cycle goes here
        t = threading.Thread(target=other.free)                 # and a free from another thread
        t.start()
        t.join()
        assert capture_open()
        launch(vadd, blocks, 256, dc, db, dd, n, stream=s)      # d = c + b: the capture still works
    assert other.freed and not capture_open()
    dev.synchronize()
    free_after = dev.mem_info()[0]
    # the 40 MiB came back when the capture ended (a graph holds a little)
    assert free_after - free_held >= 40 * MIB - 4 * MIB, (free_held, free_after)

    exe = g.instantiate()
    exe.launch(s)
    s.synchronize()
    ref = (a.astype(np.float64) + b) + b
    got = dd.to_numpy().astype(np.float64)
    # two float32 roundings: |error| <= eps * (|a| + 2|b|) (relative to the terms, as a + 2b may cancel)
    assert np.all(np.abs(got - ref) <= np.finfo(np.float32).eps * (np.abs(a) + 2 * np.abs(b)))
    del exe, g
    free1 = _settled_free(dev)
    assert abs(free1 - free0) <= 2 * MIB, (free0, free1)


def test_capture_error_names_the_call_that_broke_it(gpu_device, vadd):
    """A synchronous copy during a global-mode capture breaks it; the error
    is noticed later (the next launch, or the end) but the message leads
    with the copy."""
    n = 1024
    da, dc = DeviceArray.zeros(n), DeviceArray.zeros(n)
    s = Stream()
    with pytest.raises(GraphCaptureError) as ei:
        with capture(s):
            launch(vadd, 4, 256, da, da, dc, n, stream=s)
            try:
                dc.to_numpy()                # illegal while capturing
            except CUDAError:
                pass                         # swallowed, as library code might
            launch(vadd, 4, 256, da, da, dc, n, stream=s)
    msg = str(ei.value)
    assert msg.startswith("stream capture failed: the first driver call to fail while it was open: "
                          "cuMemcpyDtoH"), msg
    assert ei.value.first_failure.startswith("cuMemcpyDtoH")
    assert "; then " in msg
    launch(vadd, 4, 256, da, da, dc, n, stream=s)   # the stream is usable again
    s.synchronize()
