"""Tensor maps: what a TMA copy (``cp.async.bulk.tensor``) reads.

A :class:`TensorMap` describes a tiled view of a global tensor the way
``cuTensorMapEncodeTiled`` takes it: element type, global address, the
dimensions (innermost first), the byte strides of dimensions 1 and up, the
box one copy moves, the shared-memory swizzle and the fill for elements
outside the tensor.  It is checked when made (the driver's encoder only
says ``CUDA_ERROR_INVALID_VALUE``).

The same description serves both backends: pass it to an emulator launch
for a ``.param .align 64 .b8 name[128]`` parameter
(:meth:`ptxgen.tensorcore.TensorCoreMixin.tensor_map_param`), and give it
to :func:`ptxgen.driver.tensor_map.encode_tiled` for the real
``CUtensorMap`` on a GPU.  The emulator's 128 bytes (:meth:`emu_bytes`)
are its own encoding, never the driver's.

Element strides are 1 (every element of the box), interleave none and no
L2 promotion: what a dense tile load needs.
"""

from __future__ import annotations

import struct

import attrs

from .smem_layout import SWIZZLES

__all__ = ["TensorMap", "TMA_DTYPES", "decode_emu_bytes"]

#: element type -> (bytes, CU_TENSOR_MAP_DATA_TYPE_* value)
TMA_DTYPES = {"u8": (1, 0), "u16": (2, 1), "u32": (4, 2), "s32": (4, 3), "u64": (8, 4),
              "s64": (8, 5), "f16": (2, 6), "f32": (4, 7), "f64": (8, 8), "bf16": (2, 9)}
_SWIZZLE_CODE = {"none": 0, "32B": 1, "64B": 2, "128B": 3}
_OOB = ("zero", "nan")
_MAGIC = b"ptxgTMAP"
_LAYOUT = struct.Struct("<8sQBBBB5I4Q5H")


def _ints(v, what):
    try:
        out = tuple(int(x) for x in v)
    except TypeError:
        raise ValueError(f"TensorMap {what} must be a sequence of ints, got {v!r}") from None
    return out


@attrs.frozen
class TensorMap:
    """A tiled tensor map (see the module docstring).

    Attributes
    ----------
    dtype : str
        Element type: u8, u16, u32, s32, u64, s64, f16, bf16, f32, f64.
    address : int
        Global address of element (0, ..., 0), 16-byte aligned.
    shape : tuple of int
        Elements along each dimension, innermost first (1 to 5 dimensions).
    strides : tuple of int
        Byte stride of dimensions 1 .. rank-1 (multiples of 16, below 2**40).
    box : tuple of int
        Elements one copy moves along each dimension (1 .. 256); the
        innermost row of the box is a multiple of 16 bytes, and with a
        swizzle exactly the swizzle's span (32, 64 or 128 bytes).
    swizzle : str
        "none", "32B", "64B" or "128B" (:mod:`ptxgen.smem_layout`).
    oob_fill : str
        "zero", or "nan" (floats only): the value of box elements outside
        the tensor (their bytes still count toward the copy's size).
    """

    dtype: str
    address: int
    shape: tuple = attrs.field(converter=lambda v: _ints(v, "shape"))
    strides: tuple = attrs.field(converter=lambda v: _ints(v, "strides"))
    box: tuple = attrs.field(converter=lambda v: _ints(v, "box"))
    swizzle: str = "none"
    oob_fill: str = "zero"

    def __attrs_post_init__(self):
        if self.dtype not in TMA_DTYPES:
            raise ValueError(f"TensorMap dtype {self.dtype!r} is not one of "
                             f"{', '.join(TMA_DTYPES)}")
        size = TMA_DTYPES[self.dtype][0]
        rank = len(self.shape)
        if not 1 <= rank <= 5:
            raise ValueError(f"TensorMap has {rank} dimensions; TMA takes 1 to 5")
        if len(self.strides) != rank - 1 or len(self.box) != rank:
            raise ValueError(f"a {rank}-dimensional TensorMap takes {rank - 1} strides and "
                             f"{rank} box sizes, got {len(self.strides)} and {len(self.box)}")
        if self.address % 16 or self.address < 0:
            raise ValueError(f"TensorMap address 0x{self.address:x} is not 16-byte aligned")
        if any(not 1 <= d <= 1 << 32 for d in self.shape):
            raise ValueError(f"TensorMap shape {self.shape}: each dimension is 1 .. 2**32")
        if any(s % 16 or not 0 < s < 1 << 40 for s in self.strides):
            raise ValueError(f"TensorMap strides {self.strides} must be positive multiples "
                             f"of 16 bytes below 2**40")
        if any(not 1 <= b <= 256 for b in self.box):
            raise ValueError(f"TensorMap box {self.box}: each size is 1 .. 256")
        row = self.box[0] * size
        if row % 16:
            raise ValueError(f"TensorMap box row of {row} bytes is not a multiple of 16")
        if self.swizzle not in SWIZZLES:
            raise ValueError(f"TensorMap swizzle {self.swizzle!r} is not one of "
                             f"{', '.join(SWIZZLES)}")
        if self.swizzle != "none" and row != SWIZZLES[self.swizzle]:
            raise ValueError(f"a {self.swizzle}-swizzled TensorMap needs a box row of exactly "
                             f"{SWIZZLES[self.swizzle]} bytes, got {row}")
        if self.oob_fill not in _OOB or (self.oob_fill == "nan"
                                         and self.dtype not in ("f16", "bf16", "f32", "f64")):
            raise ValueError(f"TensorMap oob_fill {self.oob_fill!r}: 'zero', or 'nan' for "
                             f"float types")

    @classmethod
    def for_array(cls, array, box, *, swizzle="none", oob_fill="zero", dtype=None):
        """The map of a C-contiguous device array (numpy axis order, e.g.
        rows x cols); ``box`` is in the same order.  The dtype comes from
        the array (``dtype=`` for bf16 data held as uint16)."""
        shape = tuple(array.shape)
        if dtype is None:
            names = {"uint8": "u8", "uint16": "u16", "uint32": "u32", "int32": "s32",
                     "uint64": "u64", "int64": "s64", "float16": "f16", "float32": "f32",
                     "float64": "f64"}
            dtype = names.get(str(array.dtype))
            if dtype is None:
                raise ValueError(f"no TMA element type for {array.dtype}; pass dtype=")
        size = TMA_DTYPES[dtype][0]
        strides, acc = [], size
        for d in reversed(shape[1:]):
            acc *= d
            strides.append(acc)
        return cls(dtype, int(array.ptr), tuple(reversed(shape)), tuple(strides),
                   tuple(reversed(tuple(box))), swizzle, oob_fill)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def elem_bytes(self) -> int:
        return TMA_DTYPES[self.dtype][0]

    @property
    def box_bytes(self) -> int:
        """Bytes one copy writes to shared memory (and completes on the mbarrier)."""
        n = self.elem_bytes
        for b in self.box:
            n *= b
        return n

    def emu_bytes(self) -> bytes:
        """The emulator's 128-byte encoding of this map (a launch argument)."""
        r = self.rank
        pad = lambda v, n: tuple(v) + (0,) * (n - len(v))  # noqa: E731
        body = _LAYOUT.pack(_MAGIC, self.address, r, TMA_DTYPES[self.dtype][1],
                            _SWIZZLE_CODE[self.swizzle], _OOB.index(self.oob_fill),
                            *pad([d - 1 for d in self.shape], 5), *pad(self.strides, 4),
                            *pad(self.box, 5))
        return body + bytes(128 - len(body))


def decode_emu_bytes(data: bytes) -> TensorMap | None:
    """The :class:`TensorMap` of an emulator encoding, or None if ``data``
    is not one (e.g. a driver ``CUtensorMap``)."""
    data = bytes(data[:_LAYOUT.size])
    if len(data) < _LAYOUT.size or data[:8] != _MAGIC:
        return None
    v = _LAYOUT.unpack(data)
    r = v[2]
    codes = {c: name for name, (_, c) in TMA_DTYPES.items()}
    swz = {c: n for n, c in _SWIZZLE_CODE.items()}
    return TensorMap(codes[v[3]], v[1], [d + 1 for d in v[6:6 + r]], v[11:11 + r - 1],
                     v[15:15 + r], swz[v[4]], _OOB[v[5]])
