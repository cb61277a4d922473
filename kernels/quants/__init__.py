"""Numpy quantizers and dequantizers for GGML's weight types.

The byte layouts are GGML's, byte for byte, so that a tensor quantized here and
written into a GGUF file is read back by ``gguf``/llama.cpp unchanged, and the
dequantizers give the same float32 values as ``gguf.quants.dequantize`` bit for
bit (same order of float32 operations).

=========  =======  ==========================  ====================================
type       weights  bytes                       module
=========  =======  ==========================  ====================================
Q4_0       32       18                          :mod:`.legacy`
Q4_1       32       20                          :mod:`.legacy`
Q5_0       32       22                          :mod:`.legacy`
Q5_1       32       24                          :mod:`.legacy`
Q8_0       32       34                          :mod:`.legacy`
Q2_K       256      84 (decoding only)          :mod:`.kquants`
Q3_K       256      110 (decoding only)         :mod:`.kquants`
Q4_K       256      144                         :mod:`.kquants`
Q5_K       256      176                         :mod:`.kquants`
Q6_K       256      210                         :mod:`.kquants`
F32        1        4                           :mod:`.floats`
F16        1        2                           :mod:`.floats`
BF16       1        2                           :mod:`.floats`
=========  =======  ==========================  ====================================

``quantize(x, qtype)`` and ``dequantize(raw, qtype, shape)`` dispatch on the
type; docs/quants.md draws every byte map. This package imports numpy and
attrs only (no gguf, no GPU).
"""
from __future__ import annotations

import numpy as np

from .floats import (dequantize_bf16, dequantize_f16, dequantize_f32, quantize_bf16,
                     quantize_f16, quantize_f32)
from .kquants import (dequantize_q2_k, dequantize_q3_k, dequantize_q4_k, dequantize_q5_k,
                      dequantize_q6_k, quantize_q4_k, quantize_q5_k, quantize_q6_k)
from .legacy import (dequantize_q4_0, dequantize_q4_1, dequantize_q5_0, dequantize_q5_1,
                     dequantize_q8_0, quantize_q4_0, quantize_q4_1, quantize_q5_0,
                     quantize_q5_1, quantize_q8_0)
from .qtypes import (BF16, F16, F32, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K,
                     Q8_0, QTYPES, READERS, QType, QTypeLike, names_for, qtype_of, qtypes_for,
                     row_bytes)

__all__ = [
    "QType", "QTypeLike", "QTYPES", "QUANTIZABLE", "READERS", "qtype_of", "qtypes_for",
    "names_for", "row_bytes",
    "quantize", "dequantize",
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "quantize_f32", "dequantize_f32", "quantize_f16", "dequantize_f16",
    "quantize_bf16", "dequantize_bf16",
    "quantize_q4_0", "dequantize_q4_0", "quantize_q4_1", "dequantize_q4_1",
    "quantize_q5_0", "dequantize_q5_0", "quantize_q5_1", "dequantize_q5_1",
    "quantize_q8_0", "dequantize_q8_0",
    "dequantize_q2_k", "dequantize_q3_k",
    "quantize_q4_k", "dequantize_q4_k", "quantize_q5_k", "dequantize_q5_k",
    "quantize_q6_k", "dequantize_q6_k",
]

_QUANTIZE = {
    "F32": quantize_f32, "F16": quantize_f16, "BF16": quantize_bf16,
    "Q4_0": quantize_q4_0, "Q4_1": quantize_q4_1, "Q5_0": quantize_q5_0,
    "Q5_1": quantize_q5_1, "Q8_0": quantize_q8_0,
    "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k,
}
_DEQUANTIZE = {
    "F32": dequantize_f32, "F16": dequantize_f16, "BF16": dequantize_bf16,
    "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1, "Q5_0": dequantize_q5_0,
    "Q5_1": dequantize_q5_1, "Q8_0": dequantize_q8_0,
    "Q2_K": dequantize_q2_k, "Q3_K": dequantize_q3_k,
    "Q4_K": dequantize_q4_k, "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k,
}
#: The types :func:`quantize` can write (all of QTYPES but the decode-only Q2_K and Q3_K).
QUANTIZABLE: tuple[str, ...] = tuple(n for n in QTYPES if n in _QUANTIZE)


def quantize(x, qtype: QTypeLike) -> np.ndarray:
    """Quantize floats of shape (..., K) to GGML blocks, uint8 (..., row_bytes).

    A 2-D [rows, K] matrix gives [rows, row_bytes(qtype, K)], the byte shape
    GGUF stores for a quantized tensor.

    Raises
    ------
    ValueError
        K not a multiple of the block size, NaN/inf input, scales out of f16 range,
        unsupported qtype.
    TypeError
        A non-floating input dtype.
    NotImplementedError
        For Q2_K and Q3_K, which this package decodes but does not write.
    """
    q = qtype_of(qtype)
    fn = _QUANTIZE.get(q.name)
    if fn is None:
        raise NotImplementedError(f"{q.name}: this package decodes {q.name} but has no quantizer "
                                  f"for it; quantizable types: {', '.join(QUANTIZABLE)}")
    return fn(x)


def dequantize(raw, qtype: QTypeLike, shape) -> np.ndarray:
    """Decode GGML blocks (uint8, any shape with the right byte count) to float32 ``shape``.

    Raises
    ------
    ValueError
        K not a multiple of the block size, or a byte count that does not match ``shape``.
    TypeError
        Raw data that is not uint8.
    """
    return _DEQUANTIZE[qtype_of(qtype).name](raw, shape)
