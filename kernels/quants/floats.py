"""The float weight types: F32, F16 and BF16 (blocks of one weight).

- F32: IEEE binary32, 4 bytes per weight.
- F16: IEEE binary16, 2 bytes; the conversion rounds to nearest, ties to even.
- BF16: the top 16 bits of the binary32 value, 2 bytes; the conversion rounds
  to nearest, ties to even (as GGML's ``ggml_compute_fp32_to_bf16``), and
  decoding puts the 16 bits back on top of 16 zero bits (exact).

Encoders return the bytes as uint8 (..., K * type_size), like the block formats.
"""
from __future__ import annotations

import numpy as np

from .qtypes import BF16, F16, F16_MAX, F32, as_float_rows, raw_blocks, row_bytes

__all__ = ["quantize_f32", "dequantize_f32", "quantize_f16", "dequantize_f16",
           "quantize_bf16", "dequantize_bf16"]


def _as_bytes(v: np.ndarray, lead: tuple, q) -> np.ndarray:
    return np.ascontiguousarray(v).view(np.uint8).reshape(*lead, row_bytes(q, v.shape[-1]))


def quantize_f32(x) -> np.ndarray:
    """Store floats (..., K) as F32 bytes (..., 4K)."""
    x = as_float_rows(x, F32)
    return _as_bytes(x, x.shape[:-1], F32)


def quantize_f16(x) -> np.ndarray:
    """Round floats (..., K) to F16 bytes (..., 2K), nearest with ties to even.

    Raises
    ------
    ValueError
        For a value whose magnitude rounds past F16's largest finite value (65504).
    """
    x = as_float_rows(x, F16)
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    if not np.isfinite(h).all():
        bad = float(np.abs(x[~np.isfinite(h)]).max())
        raise ValueError(f"F16 quantize: a value ({bad:.6g}) does not fit in float16 "
                         f"(max {F16_MAX})")
    return _as_bytes(h, x.shape[:-1], F16)


def quantize_bf16(x) -> np.ndarray:
    """Round floats (..., K) to BF16 bytes (..., 2K), nearest with ties to even.

    Raises
    ------
    ValueError
        For a value that rounds past BF16's largest finite value (about 3.39e38).
    """
    x = as_float_rows(x, BF16)
    u = x.view(np.uint32)
    # add just under half an ulp of bf16, plus one when the kept part is odd (ties to even);
    # finite inputs stay below 0xFF7FFFFF + 0x8000, so uint32 does not overflow
    top = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    if ((top & 0x7F80) == 0x7F80).any():
        bad = float(np.abs(x[(top & 0x7F80) == 0x7F80]).max())
        raise ValueError(f"BF16 quantize: a value ({bad:.6g}) rounds past bfloat16's largest "
                         f"finite value")
    return _as_bytes(top.astype(np.uint16), x.shape[:-1], BF16)


def dequantize_f32(raw, shape) -> np.ndarray:
    """Decode F32 bytes to float32 of ``shape``."""
    b, shape = raw_blocks(raw, F32, shape)
    return b.view(np.float32).reshape(shape).copy()


def dequantize_f16(raw, shape) -> np.ndarray:
    """Decode F16 bytes to float32 of ``shape`` (exact)."""
    b, shape = raw_blocks(raw, F16, shape)
    return b.view(np.float16).astype(np.float32).reshape(shape)


def dequantize_bf16(raw, shape) -> np.ndarray:
    """Decode BF16 bytes to float32 of ``shape`` (exact)."""
    b, shape = raw_blocks(raw, BF16, shape)
    return (b.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)
