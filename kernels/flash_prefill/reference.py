"""A float64 model of the flash-prefill kernel, for tests and checks."""

from __future__ import annotations

import numpy as np

__all__ = ["reference"]


def reference(q, k_cache, v_cache, start, n_tokens, sm_scale=None, window=0):
    """``out[i, qh] = softmax_j(q[i, qh] . K[h, j] * sm_scale) V[h, j]`` over
    keys ``j <= start + i`` (with a ``window``, also ``j > start + i -
    window``; ``h = qh // group``), float64, ``[T, n_q, d]``."""
    q = np.asarray(q, np.float64)[:n_tokens]
    kc, vc = np.asarray(k_cache, np.float64), np.asarray(v_cache, np.float64)
    n_kv, _, d = kc.shape
    nq = q.shape[1]
    scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros((n_tokens, nq, d))
    for qh in range(nq):
        h = qh // (nq // n_kv)
        s = q[:, qh] @ kc[h, :start + n_tokens].T * scale
        j, p = np.arange(s.shape[1])[None, :], start + np.arange(n_tokens)[:, None]
        s[j > p] = -np.inf
        if window:
            s[j <= p - window] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, qh] = (p / p.sum(axis=1, keepdims=True)) @ vc[h, :start + n_tokens]
    return out
