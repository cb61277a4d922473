"""Releases held while a stream capture is open (driver/release.py), without a GPU.

The release functions are fakes that record their calls; the captures are
either counted directly (open_capture/close_capture) or made by the real
``capture`` context manager over a fake driver module.
"""

import gc
import threading
import weakref

import numpy as np
import pytest

from ptxgen.driver import errors, memory, release as rel
from ptxgen.driver.errors import CUDAError, GraphCaptureError, check, error_from_result
from ptxgen.driver.graph import capture
from ptxgen.driver.memory import DeviceArray
from ptxgen.driver.stream import Stream

real = pytest.importorskip("cuda.bindings.driver")
R = real.CUresult


@pytest.fixture(autouse=True)
def no_capture_left_open():
    assert not rel.capture_open(), "a capture was left open before this test"
    yield
    left = list(rel._open)
    for watch in left:                       # so that one failure does not fail the tests after it
        rel.close_capture(watch)
    assert not left, "the test left a capture open"


class Recorder:
    """A fake release function: records what it was asked to release, in order."""

    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def __call__(self, handle):
        with self.lock:
            self.calls.append(handle)


class Owner:
    """Owns a fake resource released through release() by its finalizer."""

    def __init__(self, fn, handle):
        self.handle = handle
        self.finalizer = weakref.finalize(self, rel.release, f"fake({handle})", fn, handle)


# ----------------------------------------------------------------------------- the record


def test_release_without_a_capture_is_made_at_once():
    fn = Recorder()
    rel.release("fake(1)", fn, 1)
    assert fn.calls == [1]


def test_releases_during_a_capture_wait_for_its_end_in_order():
    fn = Recorder()
    watch = rel.open_capture()
    try:
        for h in (3, 1, 2):
            rel.release(f"fake({h})", fn, h)
        assert fn.calls == [] and rel.capture_open()
        assert watch.held == 3 and watch.first_held == "fake(3)"
    finally:
        rel.close_capture(watch)
    assert fn.calls == [3, 1, 2]
    rel.release("fake(4)", fn, 4)           # none open: at once again
    assert fn.calls == [3, 1, 2, 4]


def test_release_from_another_thread_is_held():
    fn = Recorder()
    with rel.hold_releases() as watch:
        t = threading.Thread(target=lambda: [rel.release(f"fake({h})", fn, h) for h in range(5)])
        t.start()
        t.join()
        assert fn.calls == [] and watch.held == 5
    assert sorted(fn.calls) == list(range(5))


def test_release_from_a_collected_cycle_is_held():
    fn = Recorder()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()                             # only the explicit collect below may run it
    try:
        a, b = Owner(fn, 10), Owner(fn, 11)
        a.other, b.other = b, a              # a reference cycle: only the collector frees it
        with rel.hold_releases() as watch:
            del a, b
            assert fn.calls == []
            gc.collect()                     # the finalizers run here, inside the capture
            assert fn.calls == [] and watch.held == 2
        assert sorted(fn.calls) == [10, 11]
    finally:
        if was_enabled:
            gc.enable()


def test_release_made_only_when_the_last_open_capture_ends():
    fn = Recorder()
    first, second = rel.open_capture(), rel.open_capture()
    rel.release("fake(1)", fn, 1)
    rel.close_capture(first)
    assert fn.calls == [] and rel.capture_open()
    rel.close_capture(second)
    assert fn.calls == [1]


def test_capture_opened_in_another_thread_holds_this_threads_releases():
    fn = Recorder()
    opened, done = threading.Event(), threading.Event()
    box = {}

    def capturer():
        box["watch"] = rel.open_capture()
        opened.set()
        done.wait(10)
        rel.close_capture(box["watch"])

    t = threading.Thread(target=capturer)
    t.start()
    try:
        assert opened.wait(10)
        rel.release("fake(7)", fn, 7)
        assert fn.calls == []
    finally:
        done.set()
        t.join()
    assert fn.calls == [7]


def test_a_failing_release_neither_raises_nor_stops_the_others():
    fn = Recorder()

    def failing(handle):
        raise CUDAError(f"cuMemFree({handle}): CUDA_ERROR_INVALID_VALUE")

    with rel.hold_releases():
        rel.release("fake(1)", fn, 1)
        rel.release("bad(2)", failing, 2)
        rel.release("fake(3)", fn, 3)
    assert fn.calls == [1, 3]
    rel.release("bad(4)", failing, 4)        # none open: made at once, still swallowed


def test_a_release_that_releases_again_does_not_deadlock():
    fn = Recorder()

    def outer(handle):                       # e.g. the collector running inside a release
        fn(handle)
        rel.release("fake(inner)", fn, handle + 1)

    with rel.hold_releases():
        rel.release("fake(outer)", outer, 1)
    assert fn.calls == [1, 2]


def test_close_capture_refuses_a_capture_that_is_not_open():
    watch = rel.open_capture()
    rel.close_capture(watch)
    with pytest.raises(ValueError, match="not open"):
        rel.close_capture(watch)


def test_failures_are_noted_for_open_captures_only():
    error_from_result(R.CUDA_ERROR_INVALID_VALUE, "cuBefore")   # no capture: noted nowhere
    with rel.hold_releases() as watch:
        assert watch.first_failure is None
        e1 = error_from_result(R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "cuMemcpyDtoH")
        t = threading.Thread(target=error_from_result, args=(R.CUDA_ERROR_INVALID_VALUE, "cuLater"),
                             name="other")
        t.start()
        t.join()
    assert watch.first_message == str(e1)
    assert watch.first_message.startswith("cuMemcpyDtoH: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
    assert watch.cause().startswith("the first driver call to fail while it was open: cuMemcpyDtoH")
    assert watch.cause(str(e1)) == ""       # it is the error being reported: not repeated
    with rel.hold_releases() as watch2:
        t = threading.Thread(target=error_from_result, args=(R.CUDA_ERROR_INVALID_VALUE, "cuElsewhere"),
                             name="worker-7")
        t.start()
        t.join()
    assert "cuElsewhere" in watch2.cause() and "(in thread 'worker-7')" in watch2.cause()


# ----------------------------------------------------------------------------- capture() over a fake driver


class FakeDriver:
    """The bindings calls capture(), Graph and the release functions make."""

    def __init__(self):
        self.CUresult = R
        self.CUstreamCaptureMode = real.CUstreamCaptureMode
        self.CUgraphNodeType = real.CUgraphNodeType
        self.log = []
        self.contexts = []                   # the pushed-context stack
        self.begin_result = R.CUDA_SUCCESS
        self.end_result = R.CUDA_SUCCESS
        self.next_ptr = 0x7000

    def cuStreamBeginCapture(self, h, mode):
        self.log.append(("begin", h))
        return (self.begin_result,)

    def cuStreamEndCapture(self, h):
        self.log.append(("end", h))
        if self.end_result:
            return (self.end_result, None)
        return (R.CUDA_SUCCESS, 0x6000)

    def cuGraphGetNodes(self, h, n):
        return (R.CUDA_SUCCESS, [], 0)

    def cuCtxPushCurrent(self, ctx):
        self.contexts.append(ctx)
        return (R.CUDA_SUCCESS,)

    def cuCtxPopCurrent(self):
        return (R.CUDA_SUCCESS, self.contexts.pop())

    def _release(self, call, handle):
        self.log.append((call, handle, self.contexts[-1] if self.contexts else None))
        return (R.CUDA_SUCCESS,)

    def cuMemFree(self, ptr):
        return self._release("cuMemFree", ptr)

    def cuGraphDestroy(self, h):
        return self._release("cuGraphDestroy", h)

    def cuMemAlloc(self, nbytes):
        self.next_ptr += 0x1000
        return (R.CUDA_SUCCESS, self.next_ptr)


class FakeDevice:
    context = "ctx0"

    def activate(self, force=False):
        return self


@pytest.fixture
def fake(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(errors, "_driver_mod", drv)
    monkeypatch.setattr(memory, "get_device", lambda device=None: FakeDevice())
    return drv


def fake_stream():
    s = Stream.__new__(Stream)               # no driver stream behind it
    s.handle, s.device = 0x5000, FakeDevice()
    return s


def _frees(drv):
    return [e for e in drv.log if e[0] == "cuMemFree"]


def test_capture_holds_a_freed_array_until_after_the_end(fake):
    s = fake_stream()
    a = DeviceArray.empty(256, np.float32)
    ptr = a._ptr
    with capture(s) as g:
        a.free()                             # user code freeing during the capture
        assert a.freed and _frees(fake) == []
    assert fake.log[:3] == [("begin", 0x5000), ("end", 0x5000), ("cuMemFree", ptr, "ctx0")]
    assert g.handle == 0x6000
    del g
    gc.collect()
    assert fake.log[-1] == ("cuGraphDestroy", 0x6000, "ctx0")


def test_capture_holds_arrays_dropped_in_a_collected_cycle(fake):
    s = fake_stream()
    a, b = DeviceArray.empty(16), DeviceArray.empty(32)
    ptrs = {a._ptr, b._ptr}
    box = [a, b]
    box.append(box)                          # the arrays are held only by a cycle
    del a, b, box
    with capture(s):
        gc.collect()                         # the collector runs during the capture
        assert _frees(fake) == []
    assert {e[1] for e in _frees(fake)} == ptrs
    assert fake.log.index(("end", 0x5000)) < fake.log.index(_frees(fake)[0])


def test_failed_capture_still_makes_the_held_releases(fake):
    s = fake_stream()
    a = DeviceArray.empty(8)
    ptr = a._ptr
    with pytest.raises(GraphCaptureError, match="KeyError") as ei:
        with capture(s):
            del a
            raise KeyError("user code failed")
    assert _frees(fake) == [("cuMemFree", ptr, "ctx0")]
    assert "1 release asked for while it was open (first: cuMemFree(0x" in str(ei.value)

    b = DeviceArray.empty(8)
    ptr = b._ptr
    fake.end_result = R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    with pytest.raises(GraphCaptureError, match="cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"):
        with capture(s):
            b.free()
    assert _frees(fake)[-1] == ("cuMemFree", ptr, "ctx0")


def test_failed_begin_leaves_no_capture_open(fake):
    fake.begin_result = R.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CUDAError, match="cuStreamBeginCapture"):
        with capture(fake_stream()):
            pass                             # pragma: no cover - never entered
    # (the autouse fixture checks that nothing was left open)


def test_capture_error_names_the_first_failure_not_the_launch_that_noticed(fake):
    s = fake_stream()
    with pytest.raises(GraphCaptureError) as ei:
        with capture(s):
            try:
                check((R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,), "cuMemcpyDtoH")
            except CUDAError:
                pass                         # swallowed by the code that made the call
            raise error_from_result(R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                                    "cuLaunchKernelEx(swiglu)")
    e = ei.value
    msg = str(e)
    first = msg.index("cuMemcpyDtoH: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
    assert msg.startswith("stream capture failed: the first driver call to fail while it was open")
    assert first < msg.index("then CUDAError: cuLaunchKernelEx(swiglu): CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
    assert e.first_failure.startswith("cuMemcpyDtoH: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
    assert e.name == "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"

    # the first failure is the error itself: said once
    with pytest.raises(GraphCaptureError) as ei:
        with capture(s):
            check((R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,), "cuMemcpyDtoH")
    msg = str(ei.value)
    assert msg.startswith("stream capture failed: CUDAError: cuMemcpyDtoH") and msg.count("cuMemcpyDtoH") == 1

    # a failure noted before the end's own error is named first
    fake.end_result = R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    with pytest.raises(GraphCaptureError) as ei:
        with capture(s):
            error_from_result(R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "cuMemFree(0x1)")
    msg = str(ei.value)
    assert msg.index("cuMemFree(0x1)") < msg.index("cuStreamEndCapture")
    assert ei.value.first_failure.startswith("cuMemFree(0x1)")


def test_release_pushes_the_owners_context_and_restores_the_threads(fake, monkeypatch):
    fake.contexts.append("ctx-of-this-thread")
    a = DeviceArray.empty(4)
    ptr = a._ptr
    del a
    assert _frees(fake) == [("cuMemFree", ptr, "ctx0")]
    assert fake.contexts == ["ctx-of-this-thread"]
