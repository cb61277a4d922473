"""Real TMA tensor maps (``CUtensorMap``) from a :class:`ptxgen.tensor_map.TensorMap`.

``encode_tiled(desc)`` calls ``cuTensorMapEncodeTiled`` with the
description's element type, address, dimensions, strides, box, swizzle and
out-of-bounds fill (element strides 1, no interleave, L2 promotion 128 B)
and returns an :class:`EncodedTensorMap`: 128 opaque bytes that a launch
passes by value to a ``.param .align 64 .b8 name[128]`` parameter (the
kernel reads it in place through ``cvta.param``; see
:meth:`ptxgen.tensorcore.TensorCoreMixin.tensor_map_param`).  The map holds
the tensor's address: keep the array alive while launches use it.  Needs a
GPU of compute capability 9.0 or newer.
"""

from __future__ import annotations

from ptxgen.tensor_map import TMA_DTYPES, TensorMap

from .errors import check, cuda
from .device import get_device

__all__ = ["EncodedTensorMap", "encode_tiled"]


class EncodedTensorMap:
    """A driver-encoded ``CUtensorMap`` (128 bytes) and the description it came from.

    Attributes
    ----------
    desc : ptxgen.tensor_map.TensorMap
    raw : cuda.bindings.driver.CUtensorMap
    """

    __slots__ = ("desc", "raw", "_bytes")

    def __init__(self, desc, raw):
        self.desc = desc
        self.raw = raw
        self._bytes = b"".join(int(w).to_bytes(8, "little") for w in raw.opaque)

    def tobytes(self) -> bytes:
        """The 128 bytes a launch passes for the map's parameter."""
        return self._bytes

    def __repr__(self) -> str:
        return f"<EncodedTensorMap {self.desc.dtype} shape={self.desc.shape} box={self.desc.box}>"


def _stride_array(desc):
    """The ``globalStrides`` array: the map's rank - 1 byte strides.  A
    rank-1 map has none, but an empty list reaches the driver as a null
    pointer, which ``cuTensorMapEncodeTiled`` refuses with
    CUDA_ERROR_INVALID_VALUE; it gets one entry (the row's bytes rounded
    up to 16, a valid stride) that the driver does not read."""
    if desc.strides:
        return desc.strides
    row = desc.shape[0] * TMA_DTYPES[desc.dtype][0]
    return (row + 15) // 16 * 16,


def encode_tiled(desc: TensorMap) -> EncodedTensorMap:
    """Encode ``desc`` with ``cuTensorMapEncodeTiled`` (see the module docstring).

    Raises
    ------
    TypeError
        ``desc`` is not a :class:`ptxgen.tensor_map.TensorMap`.
    ptxgen.driver.CUDAError
        The driver refused the map (or the device is older than sm_90).
    """
    if not isinstance(desc, TensorMap):
        raise TypeError(f"encode_tiled takes a ptxgen.tensor_map.TensorMap, "
                        f"got {type(desc).__name__}")
    dev = get_device()
    dev.activate()
    if dev.compute_capability < (9, 0):
        raise ValueError(f"tensor maps need compute capability 9.0; {dev.name} has "
                         f"{dev.compute_capability}")
    d = cuda()
    dtype = d.CUtensorMapDataType(TMA_DTYPES[desc.dtype][1])
    swizzle = {"none": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
               "32B": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
               "64B": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
               "128B": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B}[desc.swizzle]
    fill = (d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE if desc.oob_fill == "zero"
            else d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA)
    raw = check(d.cuTensorMapEncodeTiled(
        dtype, d.cuuint32_t(desc.rank), desc.address, [d.cuuint64_t(n) for n in desc.shape],
        [d.cuuint64_t(n) for n in _stride_array(desc)], [d.cuuint32_t(n) for n in desc.box],
        [d.cuuint32_t(1)] * desc.rank, d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B, fill),
        f"cuTensorMapEncodeTiled({desc!r})")
    return EncodedTensorMap(desc, raw)
