"""What the driver's and the emulator's device arrays share.

:class:`DeviceArrayBase` is a contiguous (C-order) block of device memory at
an address, with a shape and a numpy dtype: the bookkeeping (size, freeing,
views, reshapes) is here; allocation and copies are the backend's
(``ptxgen.driver.DeviceArray`` through the CUDA driver,
``ptxgen.emu.DeviceArray`` in the emulator's address space).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["DeviceArrayBase", "normalize_shape"]


def normalize_shape(shape) -> tuple[int, ...]:
    """``shape`` as a tuple of ints (an int is a 1-D shape); refuses negatives."""
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape


class DeviceArrayBase:
    """Device memory with a shape and dtype; subclasses allocate and copy.

    Attributes
    ----------
    shape : tuple of int
    dtype : numpy.dtype
    nbytes : int
    """

    __slots__ = ("shape", "dtype", "nbytes", "_ptr", "_owner", "_finalizer", "__weakref__")
    _repr_name = "DeviceArray"

    def __init__(self, ptr: int, shape, dtype, owner=None, finalizer=None):
        self._ptr = int(ptr)
        self.shape = normalize_shape(shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self._owner = owner  # keeps the memory's owner (base array, torch tensor) alive
        self._finalizer = finalizer

    @property
    def ptr(self) -> int:
        """Device address. Raises ValueError once freed."""
        if self._ptr == 0 and self.nbytes:
            raise ValueError("DeviceArray was freed")
        return self._ptr

    @property
    def freed(self) -> bool:
        """True after :meth:`free` (or once the owner released the memory)."""
        return self._ptr == 0

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def free(self) -> None:
        """Release the memory now. Views of this array must not be used afterwards."""
        if self._finalizer is not None:
            self._finalizer()
        self._ptr = 0
        self._owner = None

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"0x{self._ptr:x}"
        return f"<{self._repr_name} shape={self.shape} dtype={self.dtype} {state}>"

    def view(self, dtype=None, shape=None, offset: int = 0):
        """A new array over the same memory (no copy), keeping this one alive.

        Parameters
        ----------
        dtype : optional
            Element type of the view (default: same).
        shape : optional
            Shape of the view (default: as many elements as fit after ``offset``).
        offset : int
            Byte offset into this array.
        """
        dt = np.dtype(dtype) if dtype is not None else self.dtype
        avail = self.nbytes - offset
        if shape is None:
            if avail % dt.itemsize:
                raise ValueError(f"{avail} bytes is not a whole number of {dt} elements")
            shape = (avail // dt.itemsize,)
        shape = normalize_shape(shape)
        need = math.prod(shape) * dt.itemsize
        if offset < 0 or need > avail:
            raise ValueError(f"view of {need} bytes at offset {offset} exceeds the "
                             f"{self.nbytes}-byte array")
        return self._view_array(self.ptr + offset, shape, dt)

    def _view_array(self, ptr: int, shape, dtype):
        """An array of this class at ``ptr`` that keeps ``self`` alive."""
        raise NotImplementedError

    def reshape(self, *shape):
        """Same memory, new shape (one dimension may be -1)."""
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        if shape.count(-1) == 1:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape {self.shape} into {shape}")
        return self.view(self.dtype, shape)
