"""GGML's 32-weight block formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.

Byte maps (little-endian; see docs/quants.md). In every format weight ``j``
(0..31) of a block with ``j < 16`` sits in the low nibble of ``qs[j]`` and
weight ``j + 16`` in the high nibble of the same byte; Q5's fifth bit of
weight ``j`` is bit ``j`` of the little-endian u32 ``qh``.

- Q4_0, 18 bytes: ``d:f16 | qs:u8[16]``; ``w = d * (q - 8)``.
- Q4_1, 20 bytes: ``d:f16 | m:f16 | qs:u8[16]``; ``w = d * q + m``.
- Q5_0, 22 bytes: ``d:f16 | qh:u8[4] | qs:u8[16]``; ``w = d * (q - 16)``.
- Q5_1, 24 bytes: ``d:f16 | m:f16 | qh:u8[4] | qs:u8[16]``; ``w = d * q + m``.
- Q8_0, 34 bytes: ``d:f16 | q:int8[32]``; ``w = d * q``.

The quantizers follow GGML's reference ones (``quantize_row_*_ref``):
round to nearest against the block's extreme values, in float32, so they
give the same bytes; the symmetric formats put the largest-magnitude weight
exactly on the grid's end (``-8`` or ``-16``).
"""
from __future__ import annotations

import numpy as np

from .qtypes import (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, QType, f16_field, quantize_rows,
                     raw_blocks, rint_half_away, to_f16)

__all__ = [
    "quantize_q4_0", "dequantize_q4_0", "quantize_q4_1", "dequantize_q4_1",
    "quantize_q5_0", "dequantize_q5_0", "quantize_q5_1", "dequantize_q5_1",
    "quantize_q8_0", "dequantize_q8_0",
]

_F32 = np.float32


def _inverse(d: np.ndarray) -> np.ndarray:
    """``1/d`` in float32, 0 where ``d`` is 0 (GGML's ``id``)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, _F32(0), _F32(1) / d).astype(_F32)


def _signed_extreme(x: np.ndarray) -> np.ndarray:
    """Per block (row), the value of largest magnitude, first one on ties, +0 for an all-zero block."""
    ax = np.abs(x)
    idx = ax.argmax(axis=1)[:, None]
    v = np.take_along_axis(x, idx, axis=1)
    # GGML starts its search from +0 and only takes a value of larger magnitude
    return np.where(np.take_along_axis(ax, idx, axis=1) > 0, v, _F32(0))


def _truncated(v: np.ndarray, top: int) -> np.ndarray:
    """``min(top, (int)v)`` for v >= 0 (C's conversion truncates), as uint8."""
    return np.minimum(np.trunc(v), _F32(top)).astype(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(nb, 32) values -> (nb, 16) bytes: weight j low nibble, weight j+16 high nibble."""
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """(nb, 16) bytes -> (nb, 32) uint8 nibbles in weight order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """(nb, 32) 5-bit values -> (nb, 4) bytes holding bit 4 of weight j at bit j."""
    return np.packbits((q >> 4) & 1, axis=1, bitorder="little")


def _unpack_high_bits(qh: np.ndarray) -> np.ndarray:
    """(nb, 4) bytes -> (nb, 32) uint8 0/16."""
    return np.unpackbits(qh, axis=1, bitorder="little") << 4


# ---------------------------------------------------------------------------
# symmetric: Q4_0, Q5_0

def _symmetric_blocks(x: np.ndarray, q: QType, half: int) -> tuple[np.ndarray, np.ndarray]:
    """(f16 scale bytes (nb, 2), codes (nb, 32) in 0..2*half-1) for the ``-half`` grid."""
    d = (_signed_extreme(x) / _F32(-half)).astype(_F32)
    codes = _truncated(x * _inverse(d) + _F32(half + 0.5), 2 * half - 1)
    return to_f16(d, q, "scale d").view(np.uint8), codes


def _q4_0_blocks(x: np.ndarray) -> np.ndarray:
    d, codes = _symmetric_blocks(x, Q4_0, 8)
    return np.concatenate([d, _pack_nibbles(codes)], axis=1)


def _q5_0_blocks(x: np.ndarray) -> np.ndarray:
    d, codes = _symmetric_blocks(x, Q5_0, 16)
    return np.concatenate([d, _pack_high_bits(codes), _pack_nibbles(codes)], axis=1)


def quantize_q4_0(x) -> np.ndarray:
    """Quantize floats (..., K), K a multiple of 32, to Q4_0 bytes (..., K/32*18)."""
    return quantize_rows(_q4_0_blocks, x, Q4_0)


def quantize_q5_0(x) -> np.ndarray:
    """Quantize floats (..., K), K a multiple of 32, to Q5_0 bytes (..., K/32*22)."""
    return quantize_rows(_q5_0_blocks, x, Q5_0)


def dequantize_q4_0(raw, shape) -> np.ndarray:
    """Decode Q4_0 bytes to float32 of ``shape`` (last dim K)."""
    b, shape = raw_blocks(raw, Q4_0, shape)
    d = f16_field(b, 0)
    qv = (_unpack_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)).astype(_F32)
    return (d * qv).reshape(shape)


def dequantize_q5_0(raw, shape) -> np.ndarray:
    """Decode Q5_0 bytes to float32 of ``shape`` (last dim K)."""
    b, shape = raw_blocks(raw, Q5_0, shape)
    d = f16_field(b, 0)
    codes = _unpack_nibbles(b[:, 6:]) | _unpack_high_bits(b[:, 2:6])
    qv = (codes.astype(np.int8) - np.int8(16)).astype(_F32)
    return (d * qv).reshape(shape)


# ---------------------------------------------------------------------------
# with an offset: Q4_1, Q5_1

def _offset_blocks(x: np.ndarray, q: QType, top: int) -> tuple[np.ndarray, np.ndarray]:
    """(f16 d and m bytes (nb, 4), codes (nb, 32) in 0..top) for ``x ~ d*code + min``."""
    lo = x.min(axis=1, keepdims=True)
    hi = x.max(axis=1, keepdims=True)
    d = ((hi - lo) / _F32(top)).astype(_F32)
    codes = _truncated((x - lo) * _inverse(d) + _F32(0.5), top)
    head = np.concatenate([to_f16(d, q, "scale d").view(np.uint8),
                           to_f16(lo, q, "minimum m").view(np.uint8)], axis=1)
    return head, codes


def _q4_1_blocks(x: np.ndarray) -> np.ndarray:
    head, codes = _offset_blocks(x, Q4_1, 15)
    return np.concatenate([head, _pack_nibbles(codes)], axis=1)


def _q5_1_blocks(x: np.ndarray) -> np.ndarray:
    head, codes = _offset_blocks(x, Q5_1, 31)
    return np.concatenate([head, _pack_high_bits(codes), _pack_nibbles(codes)], axis=1)


def quantize_q4_1(x) -> np.ndarray:
    """Quantize floats (..., K), K a multiple of 32, to Q4_1 bytes (..., K/32*20)."""
    return quantize_rows(_q4_1_blocks, x, Q4_1)


def quantize_q5_1(x) -> np.ndarray:
    """Quantize floats (..., K), K a multiple of 32, to Q5_1 bytes (..., K/32*24)."""
    return quantize_rows(_q5_1_blocks, x, Q5_1)


def dequantize_q4_1(raw, shape) -> np.ndarray:
    """Decode Q4_1 bytes to float32 of ``shape`` (last dim K)."""
    b, shape = raw_blocks(raw, Q4_1, shape)
    d, m = f16_field(b, 0), f16_field(b, 2)
    qv = _unpack_nibbles(b[:, 4:]).astype(_F32)
    return (d * qv + m).reshape(shape)


def dequantize_q5_1(raw, shape) -> np.ndarray:
    """Decode Q5_1 bytes to float32 of ``shape`` (last dim K)."""
    b, shape = raw_blocks(raw, Q5_1, shape)
    d, m = f16_field(b, 0), f16_field(b, 2)
    qv = (_unpack_nibbles(b[:, 8:]) | _unpack_high_bits(b[:, 4:8])).astype(_F32)
    return (d * qv + m).reshape(shape)


# ---------------------------------------------------------------------------
# Q8_0

def _q8_0_blocks(x: np.ndarray) -> np.ndarray:
    # GGML's reference: d = max|x| / 127, q = roundf(x / d) (ties away from zero).
    amax = np.abs(x).max(axis=1, keepdims=True)
    d = amax / _F32(127)
    qv = rint_half_away(x * _inverse(d))
    out = np.empty((x.shape[0], Q8_0.type_size), dtype=np.uint8)
    out[:, 0:2] = to_f16(d, Q8_0, "scale d").view(np.uint8)
    out[:, 2:] = np.clip(qv, -127, 127).astype(np.int8).view(np.uint8)
    return out


def quantize_q8_0(x) -> np.ndarray:
    """Quantize floats (..., K), K a multiple of 32, to Q8_0 bytes (..., K/32*34)."""
    return quantize_rows(_q8_0_blocks, x, Q8_0)


def dequantize_q8_0(raw, shape) -> np.ndarray:
    """Decode Q8_0 bytes to float32 of ``shape`` (last dim K)."""
    b, shape = raw_blocks(raw, Q8_0, shape)
    d = f16_field(b, 0)
    qv = b[:, 2:].view(np.int8).astype(_F32)
    return (qv * d).reshape(shape)
