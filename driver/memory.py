"""Device arrays and pinned host buffers.

A :class:`DeviceArray` is a contiguous (C-order) block of device memory with a
shape and a numpy dtype. It is freed by ``weakref.finalize`` when the last
reference goes (or by :meth:`DeviceArray.free`), through
:func:`ptxgen.driver.release.release` (held while a stream capture is open);
views keep their base alive.
It exports ``__cuda_array_interface__`` (version 3) so torch and cupy can view
it without a copy, and :func:`as_device_array` wraps any object that exports
one (a torch tensor, a cupy array) the other way round.
"""

from __future__ import annotations

import math
import operator
import weakref

import numpy as np

from ptxgen.abi import register_pointer_type
from ptxgen.device_array import DeviceArrayBase, normalize_shape

from .device import call_in_context, get_device
from .errors import check, cuda
from .release import release
from .stream import stream_handle

__all__ = ["DeviceArray", "as_device_array", "pinned_empty", "pinned_zeros"]


class DeviceArray(DeviceArrayBase):
    """Contiguous device memory with a shape and dtype.

    Create with :meth:`empty`, :meth:`zeros`, :meth:`from_numpy` or
    :func:`as_device_array`; never from a raw pointer you do not own.

    Attributes
    ----------
    shape : tuple[int, ...]
    dtype : numpy.dtype
    nbytes : int
    device : Device
    """

    __slots__ = ("device",)

    def __init__(self, ptr: int, shape, dtype, device, owner=None, finalizer=None):
        super().__init__(ptr, shape, dtype, owner, finalizer)
        self.device = device

    # ------------------------------------------------------------------ factories

    @classmethod
    def empty(cls, shape, dtype=np.float32, *, device=None) -> "DeviceArray":
        """Uninitialised device array (``cuMemAlloc``)."""
        dev = get_device(device)
        shape = normalize_shape(shape)
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        ptr = int(check(cuda().cuMemAlloc(max(nbytes, 1)), f"cuMemAlloc({nbytes})"))
        arr = cls(ptr, shape, dtype, dev)
        arr._finalizer = weakref.finalize(arr, release, f"cuMemFree(0x{ptr:x}, {nbytes} bytes)",
                                          call_in_context, dev.context, "cuMemFree", ptr)
        return arr

    @classmethod
    def zeros(cls, shape, dtype=np.float32, *, device=None) -> "DeviceArray":
        """Device array filled with zero bytes."""
        arr = cls.empty(shape, dtype, device=device)
        if arr.nbytes:
            check(cuda().cuMemsetD8(arr._ptr, 0, arr.nbytes), "cuMemsetD8")
        return arr

    @classmethod
    def from_numpy(cls, host, *, device=None, stream=None) -> "DeviceArray":
        """Copy a host array (any numpy-convertible object) to a new device array."""
        host = np.ascontiguousarray(host)
        arr = cls.empty(host.shape, host.dtype, device=device)
        arr.copy_from(host, stream=stream)
        return arr

    # ------------------------------------------------------------------ views

    def _view_array(self, ptr, shape, dtype) -> "DeviceArray":
        return DeviceArray(ptr, shape, dtype, self.device, owner=self)

    # ------------------------------------------------------------------ copies

    def _check_host(self, host: np.ndarray) -> None:
        if host.nbytes != self.nbytes:
            raise ValueError(f"size mismatch: device array is {self.nbytes} bytes "
                             f"{self.shape} {self.dtype}, host is {host.nbytes} bytes {host.shape} {host.dtype}")

    def copy_from(self, src, *, stream=None) -> "DeviceArray":
        """Copy ``src`` into this array: a host array (numpy-convertible), a
        :class:`DeviceArray`, or any object with ``__cuda_array_interface__``.

        With ``stream`` the copy is asynchronous (pin host memory for real overlap).
        """
        self.device.activate()         # any thread: the context made current here
        d = cuda()
        if isinstance(src, DeviceArray) or hasattr(src, "__cuda_array_interface__"):
            other = src if isinstance(src, DeviceArray) else as_device_array(src)
            if other.nbytes != self.nbytes:
                raise ValueError(f"size mismatch: {self.nbytes} bytes <- {other.nbytes} bytes")
            if self.nbytes:
                if stream is None:
                    check(d.cuMemcpyDtoD(self.ptr, other.ptr, self.nbytes), "cuMemcpyDtoD")
                else:
                    check(d.cuMemcpyDtoDAsync(self.ptr, other.ptr, self.nbytes, stream_handle(stream)),
                          "cuMemcpyDtoDAsync")
            return self
        host = np.ascontiguousarray(src, dtype=self.dtype if not isinstance(src, np.ndarray) else None)
        self._check_host(host)
        if self.nbytes:
            if stream is None:
                check(d.cuMemcpyHtoD(self.ptr, host.ctypes.data, self.nbytes), "cuMemcpyHtoD")
            else:
                check(d.cuMemcpyHtoDAsync(self.ptr, host.ctypes.data, self.nbytes, stream_handle(stream)),
                      "cuMemcpyHtoDAsync")
        return self

    def to_numpy(self, out: np.ndarray | None = None, *, stream=None) -> np.ndarray:
        """Copy to a host array (``out`` if given, e.g. a pinned buffer).

        With ``stream`` the copy is queued there and the stream is synchronised
        before returning.
        """
        self.device.activate()         # any thread: the context made current here
        d = cuda()
        host = np.empty(self.shape, self.dtype) if out is None else out
        if not host.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        self._check_host(host)
        if self.nbytes:
            if stream is None:
                check(d.cuMemcpyDtoH(host.ctypes.data, self.ptr, self.nbytes), "cuMemcpyDtoH")
            else:
                h = stream_handle(stream)
                check(d.cuMemcpyDtoHAsync(host.ctypes.data, self.ptr, self.nbytes, h), "cuMemcpyDtoHAsync")
                check(d.cuStreamSynchronize(h), "cuStreamSynchronize")
        return host

    def fill(self, value, *, stream=None) -> "DeviceArray":
        """Set every element to ``value`` (``cuMemsetD8/D16/D32`` by bit pattern)."""
        self.device.activate()         # any thread: the context made current here
        if not self.nbytes:
            return self
        d = cuda()
        bits = np.array(value, dtype=self.dtype).reshape(1)
        size = self.dtype.itemsize
        h = stream_handle(stream)
        if size in (1, 2, 4):
            word = int(bits.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size])[0])
            fn = {1: "cuMemsetD8", 2: "cuMemsetD16", 4: "cuMemsetD32"}[size]
            if stream is None:
                check(getattr(d, fn)(self.ptr, word, self.size), fn)
            else:
                check(getattr(d, fn + "Async")(self.ptr, word, self.size, h), fn + "Async")
        else:
            self.copy_from(np.full(self.shape, value, dtype=self.dtype), stream=stream)
            if stream is not None:
                check(d.cuStreamSynchronize(h), "cuStreamSynchronize")  # host temp must outlive the copy
        return self

    def copy(self) -> "DeviceArray":
        """A new device array with the same contents."""
        return DeviceArray.empty(self.shape, self.dtype, device=self.device).copy_from(self)

    # ------------------------------------------------------------------ interop

    @property
    def __cuda_array_interface__(self) -> dict:
        """Version-3 interface (C-contiguous, no stream synchronisation required)."""
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }


# launch() reads a DeviceArray's address without going through the generic checks;
# a freed array has _ptr == 0, which sends it down the checked path (and its error).
register_pointer_type(DeviceArray, operator.attrgetter("_ptr"))


def as_device_array(obj, *, device=None) -> DeviceArray:
    """View any ``__cuda_array_interface__`` object (torch, cupy, ...) as a DeviceArray.

    No copy: the result keeps ``obj`` alive and never frees its memory.

    Raises
    ------
    ValueError
        The object is not C-contiguous, or does not export the interface.
    """
    if isinstance(obj, DeviceArray):
        return obj
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        raise ValueError(f"{type(obj).__name__} does not export __cuda_array_interface__")
    shape = tuple(cai["shape"])
    dtype = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    if strides is not None:
        expect = []
        acc = dtype.itemsize
        for s in reversed(shape):
            expect.append(acc)
            acc *= s
        if tuple(strides) != tuple(reversed(expect)) and math.prod(shape) > 1:
            raise ValueError(f"only C-contiguous arrays can be viewed, strides {strides} for shape {shape}")
    stream = cai.get("stream")
    if stream not in (None, 0):
        # the producer asks consumers to order after its stream: honour it on the host side
        # (1 and 2 are the legacy and per-thread default stream handles)
        check(cuda().cuStreamSynchronize(int(stream)), "cuStreamSynchronize")
    return DeviceArray(int(cai["data"][0]), shape, dtype, get_device(device), owner=obj)


class _PinnedHolder:
    """Owns a ``cuMemAllocHost`` block; numpy arrays made from it keep it alive."""

    __slots__ = ("ptr", "nbytes", "__array_interface__", "_finalizer", "__weakref__")

    def __init__(self, nbytes: int, shape, dtype):
        dev = get_device()
        self.ptr = int(check(cuda().cuMemAllocHost(max(nbytes, 1)), f"cuMemAllocHost({nbytes})"))
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, release, f"cuMemFreeHost(0x{self.ptr:x}, {nbytes} bytes)",
                                           call_in_context, dev.context, "cuMemFreeHost", self.ptr)
        self.__array_interface__ = {
            "shape": tuple(shape), "typestr": np.dtype(dtype).str, "data": (self.ptr, False), "version": 3,
        }


def pinned_empty(shape, dtype=np.float32) -> np.ndarray:
    """A numpy array in page-locked host memory (fast, asynchronous-capable copies).

    The memory is released (``cuMemFreeHost``) when the array and all its views are gone.
    """
    shape = normalize_shape(shape)
    dt = np.dtype(dtype)
    holder = _PinnedHolder(math.prod(shape) * dt.itemsize, shape, dt)
    return np.asarray(holder)


def pinned_zeros(shape, dtype=np.float32) -> np.ndarray:
    """Like :func:`pinned_empty`, zero-filled."""
    a = pinned_empty(shape, dtype)
    a.fill(0)
    return a

