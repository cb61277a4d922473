"""float64 paged attention, the paged-attention family's reference (written
without any of the kernels' helpers)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["reference", "gather"]


def gather(pool, block_table, b: int, length: int) -> np.ndarray:
    """Sequence ``b``'s first ``length`` rows of ``pool [num_blocks,
    n_kv_heads, block_size, d]`` as ``[n_kv_heads, length, d]`` (values as
    stored), row ``p`` from block ``block_table[b, p // block_size]`` at
    offset ``p % block_size``."""
    bs = pool.shape[2]
    pos = np.arange(length)
    rows = pool[np.asarray(block_table)[b, pos // bs], :, pos % bs, :]    # [L, n_kv, d]
    return np.ascontiguousarray(rows.transpose(1, 0, 2))


def reference(q, k_pool, v_pool, block_table, seq_lens, sm_scale: float | None = None,
              window: int = 0):
    """float64 attention of ``q [B, n_q_heads, d]`` over each sequence's
    paged keys and values: sequence ``b`` has ``seq_lens[b]`` rows (clamped
    to ``[0, max_blocks * block_size]``) found through ``block_table [B,
    max_blocks]``; query head ``qh`` reads KV head ``qh // (n_q_heads /
    n_kv_heads)``; with a ``window``, over the last ``window`` of them only.
    An empty sequence gives zeros."""
    q = np.asarray(q, dtype=np.float64)
    B, n_q, d = q.shape
    n_kv, bs = k_pool.shape[1], k_pool.shape[2]
    G = n_q // n_kv
    cap = np.asarray(block_table).shape[1] * bs
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros((B, n_q, d))
    for b in range(B):
        L = min(max(int(seq_lens[b]), 0), cap)
        if L == 0:
            continue
        lo = max(L - window, 0) if window else 0
        kk = gather(k_pool, block_table, b, L).astype(np.float64)[:, lo:]
        vv = gather(v_pool, block_table, b, L).astype(np.float64)[:, lo:]
        for qh in range(n_q):
            s = kk[qh // G] @ q[b, qh] * scale
            p = np.exp(s - s.max())
            out[b, qh] = p @ vv[qh // G] / p.sum()
    return out
