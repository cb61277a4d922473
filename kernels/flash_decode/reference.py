"""float64 attention, the flash-decode family's reference (written without
any of the kernels' helpers)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["reference"]


def reference(q, k_cache, v_cache, kv_len: int, sm_scale: float | None = None, window: int = 0):
    """float64 attention of ``q [n_q, d]`` over the first ``kv_len`` rows of
    ``k_cache``/``v_cache [n_kv, cap, d]`` (values as stored); with a
    ``window``, over the last ``window`` of them."""
    q = np.asarray(q, dtype=np.float64)
    n_q, d = q.shape
    n_kv = k_cache.shape[0]
    G = n_q // n_kv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros((n_q, d))
    if kv_len == 0:
        return out
    for qh in range(n_q):
        lo = max(kv_len - window, 0) if window else 0
        kk = np.asarray(k_cache[qh // G, lo:kv_len], dtype=np.float64)
        vv = np.asarray(v_cache[qh // G, lo:kv_len], dtype=np.float64)
        s = kk @ q[qh] * scale
        p = np.exp(s - s.max())
        out[qh] = p @ vv / p.sum()
    return out
