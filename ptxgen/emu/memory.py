"""The emulator's device memory: one flat 64-bit address space of numpy buffers.

Global allocations live at ``GLOBAL_BASE`` and up, 256-byte aligned with an
unmapped gap after each, so a running-off-the-end access faults instead of
landing in a neighbour.  Shared memory is per block, addressed by offsets
from 0 (what ``mov.u32 %r, array`` gives); generic addresses of shared
memory are ``SHARED_WINDOW + offset`` (``cvta.shared`` / ``cvta.to.shared``
convert), and ``.global`` addresses equal generic ones (``cvta.to.global``
is the identity).  A kernel parameter's generic address (``cvta.param``)
is ``PARAM_WINDOW`` plus its offset in the launch's parameter buffer.

:class:`DeviceArray` mirrors ``ptxgen.driver.DeviceArray`` (``empty``,
``zeros``, ``from_numpy``, ``to_numpy``, ``copy_from``, ``fill``, ``ptr``,
``shape``, ``dtype``, ``free``) over this memory.
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np

from ..device_array import DeviceArrayBase, normalize_shape
from .errors import Fault, MemoryFault

__all__ = ["DeviceArray", "Memory", "MEMORY", "GLOBAL_BASE", "SHARED_WINDOW", "PARAM_WINDOW",
           "UINT", "gather", "scatter"]

GLOBAL_BASE = 0x7F00_0000_0000
SHARED_WINDOW = 0x0100_0000_0000
#: generic address of byte 0 of the launch's parameter buffer (``mov`` of a
#: parameter's name, then ``cvta.param``, the identity here)
PARAM_WINDOW = 0x0200_0000_0000
_ALIGN = 256
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class Memory:
    """Global allocations; lookups by address."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = GLOBAL_BASE
        self._allocs = {}          # base -> (nbytes, uint8 buffer)
        self._table = None         # (bases, ends, bufs) sorted, rebuilt lazily
        self._freed = []           # bases freed while the lock was taken

    def alloc(self, nbytes: int) -> int:
        padded = (max(nbytes, 1) + 15) // 16 * 16
        with self._lock:
            self._drain()
            base = self._next
            self._next = (base + padded + _ALIGN + _ALIGN - 1) // _ALIGN * _ALIGN
            self._allocs[base] = (nbytes, np.zeros(padded, np.uint8))
            self._table = None
        return base

    def free(self, base: int) -> None:
        """Release the allocation at ``base``.  Never waits for the lock: a
        ``DeviceArray``'s finalizer calls this, and the garbage collector can
        run it inside :meth:`alloc` or :meth:`table` (any allocation there may
        collect), on the thread that already holds the lock; the base is then
        queued and dropped by the next locked section."""
        self._freed.append(base)
        self._table = None
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        """Drop the queued frees (the lock is held)."""
        while self._freed:
            self._allocs.pop(self._freed.pop(), None)

    def table(self):
        t = self._table
        if t is None:
            with self._lock:
                self._drain()
                keys = sorted(self._allocs)
                bases = np.array(keys, dtype=np.uint64)
                ends = np.array([k + self._allocs[k][0] for k in keys], dtype=np.uint64)
                bufs = [self._allocs[k][1] for k in keys]
                t = (bases, ends, bufs)
                if not self._freed:        # nothing was freed while it was built
                    self._table = t
        return t

    def buffer(self, base: int, nbytes: int) -> np.ndarray:
        """The uint8 bytes ``[base, base+nbytes)`` of one allocation (a view)."""
        bases, ends, bufs = self.table()
        i = int(np.searchsorted(bases, np.uint64(base), "right")) - 1
        if i < 0 or base + nbytes > int(ends[i]):
            raise ValueError(f"0x{base:x}+{nbytes} is not inside a live emulator allocation")
        off = base - int(bases[i])
        return bufs[i][off:off + nbytes]

    def locate(self, addr: np.ndarray, nbytes: int, what: str):
        """Allocation buffer and byte offsets for ``addr`` (uint64 array), or
        a :class:`Fault` naming the first bad thread index (into ``addr``)."""
        bases, ends, bufs = self.table()
        if addr.size == 0:
            return [], []
        lo = addr.min()
        hi = addr.max()
        i = int(np.searchsorted(bases, lo, "right")) - 1
        if i >= 0 and int(hi) + nbytes <= int(ends[i]):
            return [(bufs[i], (addr - bases[i]).astype(np.int64), None)], None
        idx = np.searchsorted(bases, addr, "right").astype(np.int64) - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        if len(bases):
            ok &= (addr + np.uint64(nbytes)) <= ends[safe]
        else:
            ok &= False
        if not ok.all():
            j = int(np.flatnonzero(~ok)[0])
            raise Fault(MemoryFault, f"{what} of {nbytes} bytes at 0x{int(addr[j]):x}: "
                        + self.describe(int(addr[j]), nbytes), j)
        parts = []
        for k in np.unique(idx):
            sel = idx == k
            parts.append((bufs[k], (addr[sel] - bases[k]).astype(np.int64), sel))
        return parts, None

    def describe(self, a: int, nbytes: int) -> str:
        bases, ends, _ = self.table()
        if not len(bases):
            return "no emulator memory is allocated"
        i = int(np.searchsorted(bases, np.uint64(a), "right")) - 1
        if i >= 0 and a < int(ends[i]):
            return (f"runs {a + nbytes - int(ends[i])} bytes past the end of the "
                    f"{int(ends[i] - bases[i])}-byte allocation at 0x{int(bases[i]):x}")
        if i >= 0:
            return (f"{a - int(ends[i])} bytes past the end of the "
                    f"{int(ends[i] - bases[i])}-byte allocation at 0x{int(bases[i]):x}")
        return f"{int(bases[0]) - a} bytes before the first allocation (0x{int(bases[0]):x})"


MEMORY = Memory()


def _words(buf, size):
    """``buf`` viewed as ``size``-byte words; a tail shorter than one word is
    left out (accesses are bounds-checked and aligned before they get here)."""
    n = buf.shape[0] // size * size
    return buf[:n].view(UINT[size])


def gather(buf, offs, size, vec):
    """Read ``vec`` consecutive ``size``-byte words at byte offsets ``offs``
    (aligned) from the uint8 ``buf``; returns a list of ``vec`` arrays."""
    view = _words(buf, size)
    idx = offs // size
    return [view[idx + j] for j in range(vec)]


def scatter(buf, offs, size, values):
    view = _words(buf, size)
    idx = offs // size
    for j, v in enumerate(values):
        view[idx + j] = v


class DeviceArray(DeviceArrayBase):
    """Emulator device memory with a shape and dtype (like the driver's).

    Attributes
    ----------
    shape : tuple of int
    dtype : numpy.dtype
    nbytes : int
    """

    __slots__ = ()
    _repr_name = "emu.DeviceArray"

    @classmethod
    def empty(cls, shape, dtype=np.float32) -> "DeviceArray":
        """An array of unspecified contents (the emulator fills it with 0xAB bytes)."""
        shape = normalize_shape(shape)
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        ptr = MEMORY.alloc(nbytes)
        MEMORY.buffer(ptr, nbytes)[:] = 0xAB
        arr = cls(ptr, shape, dtype)
        arr._finalizer = weakref.finalize(arr, MEMORY.free, ptr)
        return arr

    @classmethod
    def zeros(cls, shape, dtype=np.float32) -> "DeviceArray":
        arr = cls.empty(shape, dtype)
        arr._bytes()[:] = 0
        return arr

    @classmethod
    def from_numpy(cls, host) -> "DeviceArray":
        """Copy a host array to a new device array."""
        host = np.ascontiguousarray(host)
        arr = cls.empty(host.shape, host.dtype)
        arr.copy_from(host)
        return arr

    def _bytes(self):
        return MEMORY.buffer(self.ptr, self.nbytes)

    def _view_array(self, ptr, shape, dtype) -> "DeviceArray":
        return DeviceArray(ptr, shape, dtype, owner=self)

    def copy_from(self, src) -> "DeviceArray":
        """Copy a host array (or another emulator DeviceArray) into this one."""
        if isinstance(src, DeviceArray):
            data = src._bytes()
        else:
            host = np.ascontiguousarray(src, dtype=None if isinstance(src, np.ndarray) else self.dtype)
            data = host.reshape(-1).view(np.uint8)
        if data.size != self.nbytes:
            raise ValueError(f"size mismatch: device array is {self.nbytes} bytes, source is {data.size}")
        self._bytes()[:] = data
        return self

    def to_numpy(self, out=None) -> np.ndarray:
        """Copy to a host array (``out`` if given)."""
        host = np.empty(self.shape, self.dtype) if out is None else out
        if host.nbytes != self.nbytes:
            raise ValueError("size mismatch")
        host.reshape(-1).view(np.uint8)[:] = self._bytes()
        return host

    def fill(self, value) -> "DeviceArray":
        self.copy_from(np.full(self.shape, value, dtype=self.dtype))
        return self

    def copy(self) -> "DeviceArray":
        return DeviceArray.empty(self.shape, self.dtype).copy_from(self)
