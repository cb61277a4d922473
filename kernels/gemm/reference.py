"""float64 reference of the GEMM family: the weights dequantized by
:func:`ptxgen.kernels.quants.dequantize` (bit-exact against gguf's decoder)
times X, as float64."""

from __future__ import annotations

import numpy as np

__all__ = ["reference"]


def reference(qtype: str, w_raw, x, residual=None):
    """``Y[T, M] = X[T, K] . W[M, K]^T (+ residual)`` in float64.

    Parameters
    ----------
    qtype : str
    w_raw : uint8 [M, row_bytes]
    x : float [T, K]
    residual : float [T, M] or [M], optional
        Added to Y (a bias ``[M]`` to every row).
    """
    from ..quants import dequantize
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, K], got shape {x.shape}")
    m = w_raw.shape[0]
    w = dequantize(np.ascontiguousarray(w_raw), qtype, (m, x.shape[1])).astype(np.float64)
    y = x @ w.T
    if residual is not None:
        y = y + np.asarray(residual, dtype=np.float64)
    return y
