"""A float64 numpy reference forward pass for Llama-architecture GGUF files.

Loads hyperparameters and tensors with ``gguf.GGUFReader``, decodes weights
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

import os
from pathlib import Path
from typing import Optional

import attrs
import numpy as np

__all__ = ["LlamaHParams", "LlamaReference", "load_llama_gguf",
           "rms_norm", "rope_norm", "attention", "silu", "SUPPORTED_TYPES"]

SUPPORTED_TYPES = ("F32", "F16", "Q8_0", "Q4_K", "Q6_K")


@attrs.frozen
class LlamaHParams:
    """Llama hyperparameters as read from ``llama.*`` GGUF metadata."""

    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    context_length: int
    rope_theta: float
    rope_dim: int
    rms_eps: float


# ---------------------------------------------------------------------------
# the maths, as free functions (tested on their own)

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

def _field(reader, key: str, *, required: bool = True, default=None):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    v = f.contents()
    return v


def _open_reader(path):
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    size = os.path.getsize(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:         # the reader raises ValueError/IndexError/... on bad bytes
        raise ValueError(f"{path}: not a readable GGUF file ({size} bytes; truncated or "
                         f"corrupt?): {type(e).__name__}: {e}") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise ValueError(f"{path}: truncated GGUF file: tensor {t.name!r} needs bytes up to "
                             f"{end}, the file has {size}")
    return reader


def _hparams(reader, path) -> LlamaHParams:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: unsupported architecture {arch!r}: this reference "
                         f"implements 'llama' only")
    g = lambda k, **kw: _field(reader, f"llama.{k}", **kw)  # noqa: E731
    hidden = int(g("embedding_length"))
    n_heads = int(g("attention.head_count"))
    n_kv = int(g("attention.head_count_kv", required=False, default=n_heads))
    if hidden % n_heads or n_heads % n_kv:
        raise ValueError(f"{path}: inconsistent heads: hidden={hidden}, heads={n_heads}, "
                         f"kv heads={n_kv}")
    head_dim = hidden // n_heads
    rope_dim = int(g("rope.dimension_count", required=False, default=head_dim))
    vocab = g("vocab_size", required=False)
    if vocab is None:
        emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if emb is None:
            raise ValueError(f"{path}: missing tensor 'token_embd.weight'")
        vocab = int(emb.shape[1])
    return LlamaHParams(
        n_layers=int(g("block_count")), hidden=hidden, ffn=int(g("feed_forward_length")),
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, vocab=int(vocab),
        context_length=int(g("context_length")),
        rope_theta=float(g("rope.freq_base", required=False, default=10000.0)),
        rope_dim=rope_dim, rms_eps=float(g("attention.layer_norm_rms_epsilon")))


def _expected_shapes(hp: LlamaHParams) -> dict[str, tuple]:
    q_dim, kv_dim = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
    s = {"token_embd.weight": (hp.vocab, hp.hidden), "output_norm.weight": (hp.hidden,),
         "output.weight": (hp.vocab, hp.hidden)}
    for i in range(hp.n_layers):
        b = f"blk.{i}."
        s.update({
            b + "attn_norm.weight": (hp.hidden,), b + "attn_q.weight": (q_dim, hp.hidden),
            b + "attn_k.weight": (kv_dim, hp.hidden), b + "attn_v.weight": (kv_dim, hp.hidden),
            b + "attn_output.weight": (hp.hidden, q_dim), b + "ffn_norm.weight": (hp.hidden,),
            b + "ffn_gate.weight": (hp.ffn, hp.hidden), b + "ffn_up.weight": (hp.ffn, hp.hidden),
            b + "ffn_down.weight": (hp.hidden, hp.ffn)})
    return s


def load_llama_gguf(path) -> tuple[LlamaHParams, dict[str, np.ndarray]]:
    """Read a llama GGUF: hyperparameters and every needed tensor as float64.

    Raises
    ------
    ValueError
        Not a readable/complete GGUF, an architecture other than llama, a
        missing tensor, a tensor of the wrong shape or of an unsupported type.
    """
    import gguf

    reader = _open_reader(path)
    hp = _hparams(reader, path)
    by_name = {t.name: t for t in reader.tensors}
    weights: dict[str, np.ndarray] = {}
    for name, shape in _expected_shapes(hp).items():
        t = by_name.get(name)
        if t is None:
            if name == "output.weight":
                continue                     # tied embeddings: use token_embd
            raise ValueError(f"{path}: missing tensor {name!r}")
        tname = t.tensor_type.name
        if tname not in SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported type {tname}; "
                             f"supported: {', '.join(SUPPORTED_TYPES)}")
        got = tuple(int(d) for d in reversed(list(t.shape)))
        if got != shape:
            raise ValueError(f"{path}: tensor {name!r} has shape {got} (numpy order), "
                             f"expected {shape}")
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        weights[name] = np.asarray(w, dtype=np.float64).reshape(shape)
    if "output.weight" not in weights:
        weights["output.weight"] = weights["token_embd.weight"]
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

    def reset(self) -> None:
        """Empty the KV cache (start a new sequence)."""
        self.pos = 0

    def _cache(self, a: np.ndarray) -> np.ndarray:
        if self.kv_dtype is None:
            return a
        return a.astype(self.kv_dtype).astype(np.float64)

    def step(self, token_id: int) -> np.ndarray:
        """Feed one token at the next position; return its logits (vocab,) float64.

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
        for i in range(hp.n_layers):
            b = f"blk.{i}."
            h = rms_norm(x, W[b + "attn_norm.weight"], hp.rms_eps)
            q = (W[b + "attn_q.weight"] @ h).reshape(hp.n_heads, hp.head_dim)
            k = (W[b + "attn_k.weight"] @ h).reshape(hp.n_kv_heads, hp.head_dim)
            v = (W[b + "attn_v.weight"] @ h).reshape(hp.n_kv_heads, hp.head_dim)
            q = rope_norm(q, p, hp.rope_theta, hp.rope_dim)
            k = rope_norm(k, p, hp.rope_theta, hp.rope_dim)
            self._k[i, :, p] = self._cache(k)
            self._v[i, :, p] = self._cache(v)
            a = attention(q, self._k[i, :, :p + 1], self._v[i, :, :p + 1])
            x = x + W[b + "attn_output.weight"] @ a.reshape(-1)
            h = rms_norm(x, W[b + "ffn_norm.weight"], hp.rms_eps)
            g = silu(W[b + "ffn_gate.weight"] @ h) * (W[b + "ffn_up.weight"] @ h)
            x = x + W[b + "ffn_down.weight"] @ g
        self.pos = p + 1
        h = rms_norm(x, W["output_norm.weight"], hp.rms_eps)
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
