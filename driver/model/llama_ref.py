"""A float64 numpy reference forward pass for Llama-architecture GGUF files.

Loads hyperparameters and tensors through :mod:`.gguf_loader`, decodes weights
with ``gguf.quants.dequantize`` (the reference decoder), and runs one token
at a time with a KV cache, in float64. It is the oracle the GPU decode is
checked against, so it follows llama.cpp's ``llama`` architecture:

- RMSNorm: ``x / sqrt(mean(x^2) + eps) * w`` with the file's eps;
- RoPE of type NORM (``LLAMA_ROPE_TYPE_NORM``): consecutive pairs
  ``(x[2i], x[2i+1])`` rotated by ``pos * theta^(-2i/n_rot)``, applied to the
  GGUF (already permuted) Q/K weights' outputs; dims past n_rot untouched;
- GQA: query head h reads KV head ``h // (n_head / n_head_kv)``;
- the KV cache rounded to ``kv_dtype`` (float16 by default, as the GPU keeps
  it) and upcast to float64 for the attention arithmetic;
- SwiGLU FFN ``down(silu(gate(x)) * up(x))``; output norm; output projection
  (token_embd when output.weight is absent).

All weights live in memory as float64, so this is for small models (the tiny
synthetic one: a few MB); a Llama-3-8B-shaped file would need 64 GB.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from .gguf_loader import SUPPORTED_TYPES, LlamaFile, LlamaHParams, layer_tensor_names

__all__ = ["LlamaHParams", "LlamaReference", "load_llama_gguf",
           "rms_norm", "rope_norm", "attention", "silu", "SUPPORTED_TYPES"]



def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * w`` over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_norm(x: np.ndarray, pos: int, theta: float, n_rot: int) -> np.ndarray:
    """Rotate consecutive pairs of the last axis (llama.cpp's NORM RoPE).

    Parameters
    ----------
    x : (..., head_dim) array
    pos : int
        Token position.
    theta : float
        Frequency base (rope.freq_base).
    n_rot : int
        Rotated dimensions (rope.dimension_count); the rest pass through.
    """
    x = np.array(x, dtype=np.float64, copy=True)
    i = np.arange(n_rot // 2, dtype=np.float64)
    ang = pos * theta ** (-2.0 * i / n_rot)
    c, s = np.cos(ang), np.sin(ang)
    x0 = x[..., 0:n_rot:2].copy()
    x1 = x[..., 1:n_rot:2].copy()
    x[..., 0:n_rot:2] = x0 * c - x1 * s
    x[..., 1:n_rot:2] = x0 * s + x1 * c
    return x


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal decode attention for one query position with GQA.

    Parameters
    ----------
    q : (n_heads, d)
    k, v : (n_kv_heads, L, d) — the cache up to and including this position.

    Returns
    -------
    (n_heads, d) : ``softmax(q·K^T / sqrt(d)) · V`` per head, query head h
    reading KV head ``h // (n_heads // n_kv_heads)``.
    """
    n_heads, d = q.shape
    group = n_heads // k.shape[0]
    kk = np.repeat(k, group, axis=0)                 # (n_heads, L, d)
    vv = np.repeat(v, group, axis=0)
    s = np.einsum("hd,hld->hl", q, kk) / np.sqrt(d)
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hl,hld->hd", p, vv)


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``."""
    return x / (1.0 + np.exp(-x))


# ---------------------------------------------------------------------------
# loading

def load_llama_gguf(path) -> tuple[LlamaHParams, dict[str, np.ndarray]]:
    """Read a llama GGUF: hyperparameters and every needed tensor as float64.

    The file is opened and validated by :class:`.gguf_loader.LlamaFile`;
    weights are decoded by ``gguf.quants.dequantize``, independently of the
    GPU kernels' decoding.

    Raises
    ------
    GGUFError (a ValueError)
        Not a readable/complete GGUF, an architecture other than llama, a
        missing tensor, a tensor of the wrong shape or of an unsupported type.
    """
    f = LlamaFile(path)
    hp = f.hparams
    names = ["token_embd.weight", "output_norm.weight"]
    for i in range(hp.n_layers):
        names += layer_tensor_names(i)
    if f.has("output.weight"):
        names.append("output.weight")
    weights = {n: f.dequantized(n).astype(np.float64) for n in names}
    weights.setdefault("output.weight", weights["token_embd.weight"])
    return hp, weights


# ---------------------------------------------------------------------------
# the model

class LlamaReference:
    """Token-at-a-time float64 Llama decode with a KV cache.

    Parameters
    ----------
    path : str or Path
        A llama-architecture GGUF file.
    kv_dtype : numpy dtype, optional
        K/V are rounded to this dtype when cached (float16 by default, like the
        GPU's cache); None keeps them in float64.
    max_context : int, optional
        Cache length; defaults to the file's context_length.
    """

    def __init__(self, path, *, kv_dtype=np.float16, max_context: Optional[int] = None):
        self.path = Path(path)
        self.hparams, self.weights = load_llama_gguf(path)
        self.kv_dtype = None if kv_dtype is None else np.dtype(kv_dtype)
        hp = self.hparams
        self.max_context = int(max_context or hp.context_length)
        shape = (hp.n_layers, hp.n_kv_heads, self.max_context, hp.head_dim)
        self._k = np.zeros(shape, dtype=np.float64)
        self._v = np.zeros(shape, dtype=np.float64)
        self.pos = 0
        self.last_kv = []

    def reset(self) -> None:
        """Empty the KV cache (start a new sequence)."""
        self.pos = 0

    def _cache(self, a: np.ndarray) -> np.ndarray:
        if self.kv_dtype is None:
            return a
        return a.astype(self.kv_dtype).astype(np.float64)

    def step(self, token_id: int, kv=None) -> np.ndarray:
        """Feed one token at the next position; return its logits (vocab,) float64.

        ``kv`` (optional): per layer, the ``(k, v)`` rows (``[n_kv_heads,
        head_dim]``) to cache at this position instead of this pass's own
        rounded values, e.g. the rows another implementation cached, so that
        its logits can be checked without one cache rounding flip spreading
        into every later step.  This pass's unrounded rows are kept in
        ``last_kv`` either way.

        Raises
        ------
        ValueError
            A token id outside the vocabulary, or a full context.
        """
        hp, W = self.hparams, self.weights
        tok = int(token_id)
        if not 0 <= tok < hp.vocab:
            raise ValueError(f"token id {tok} is outside the vocabulary (0..{hp.vocab - 1})")
        p = self.pos
        if p >= self.max_context:
            raise ValueError(f"context is full: {self.max_context} positions used")
        x = W["token_embd.weight"][tok].copy()
        self.last_kv = []
        for i in range(hp.n_layers):
            b = f"blk.{i}."
            h = rms_norm(x, W[b + "attn_norm.weight"], hp.eps)
            q = (W[b + "attn_q.weight"] @ h).reshape(hp.n_heads, hp.head_dim)
            k = (W[b + "attn_k.weight"] @ h).reshape(hp.n_kv_heads, hp.head_dim)
            v = (W[b + "attn_v.weight"] @ h).reshape(hp.n_kv_heads, hp.head_dim)
            q = rope_norm(q, p, hp.rope_theta, hp.rope_dim)
            k = rope_norm(k, p, hp.rope_theta, hp.rope_dim)
            self.last_kv.append((k, v))
            if kv is None:
                self._k[i, :, p] = self._cache(k)
                self._v[i, :, p] = self._cache(v)
            else:
                self._k[i, :, p], self._v[i, :, p] = (np.asarray(a, dtype=np.float64)
                                                      for a in kv[i])
            a = attention(q, self._k[i, :, :p + 1], self._v[i, :, :p + 1])
            x = x + W[b + "attn_output.weight"] @ a.reshape(-1)
            h = rms_norm(x, W[b + "ffn_norm.weight"], hp.eps)
            g = silu(W[b + "ffn_gate.weight"] @ h) * (W[b + "ffn_up.weight"] @ h)
            x = x + W[b + "ffn_down.weight"] @ g
        self.pos = p + 1
        h = rms_norm(x, W["output_norm.weight"], hp.eps)
        return W["output.weight"] @ h

    def generate(self, token_ids, max_new_tokens: int) -> list[int]:
        """Greedy decoding: feed ``token_ids``, then append argmax tokens."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("generate needs at least one prompt token")
        logits = None
        for t in ids:
            logits = self.step(t)
        out = []
        for _ in range(int(max_new_tokens)):
            nxt = int(np.argmax(logits))
            out.append(nxt)
            logits = self.step(nxt)
        return out
