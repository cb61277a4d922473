"""A float64 numpy reference forward pass for decoder GGUF files.

Decodes weights with ``gguf.quants.dequantize`` (the reference decoder) and
runs one token at a time with a KV cache, in float64.  It is the oracle the
decode step is checked against, so it reads the file's conventions itself
(:func:`read_conventions`, written apart from :mod:`.gguf_loader`, which only
validates the file first) and follows llama.cpp's graphs for ``llama``
(and ``mistral``), ``qwen2``, ``qwen3``, ``qwen3moe`` and ``gemma3``:

- RMSNorm: ``x / sqrt(mean(x^2) + eps) * w`` with the file's eps;
- q, k, v projections plus their biases where the file has them; for
  qwen3 an RMSNorm of every q and k head (``attn_q_norm``/``attn_k_norm``);
- RoPE at angle ``pos * freq_scale * base^(-2i/d) / factor_i`` (factors
  from ``rope_freqs.weight``, llama only), rotating consecutive pairs
  ``(x[2i], x[2i+1])`` for llama (llama.cpp's NORM type) and halves
  ``(x[i], x[i+d/2])`` for qwen2/qwen3 (NEOX);
- GQA: query head h reads KV head ``h // (n_head / n_head_kv)``, scores
  scaled by ``1 / sqrt(head_dim)``;
- the KV cache rounded to ``kv_dtype`` (float16 by default, as the GPU keeps
  it) and upcast to float64 for the attention arithmetic;
- SwiGLU FFN ``down(silu(gate(x)) * up(x))``, or for qwen3moe llama.cpp's
  ``build_moe_ffn`` with softmax gating and renormalised weights:
  ``p = softmax(W_router x)``, the ``expert_used_count`` experts of largest
  ``p`` (a stable sort: ties to the lower id), weights ``p_e / max(sum,
  2^-14)``, ``sum_e w_e down_e(silu(gate_e x) * up_e x)``; output norm;
  output projection (token_embd when output.weight is absent);
- gemma3 (llama.cpp's ``llama_model_gemma3`` graph): the embedding scaled by
  ``sqrt(embedding_length)``; q/k head norms; NeoX RoPE at the file's base
  and scaling on global layers, at ``rope.freq_base_swa`` (default 10000)
  unscaled on sliding-window layers (``il % n < n - 1`` for the pattern's
  period ``n``, default 6, or the file's per-layer bools; none without
  ``attention.sliding_window``), whose query at position p sees the keys
  ``p - window + 1 .. p``; q multiplied by the attention scale (``1 /
  sqrt(key_length)``, for 62 layers ``1 / sqrt(embedding_length /
  head_count)``) and the scores left unscaled; the attention and FFN
  outputs each RMS-normed (``post_attention_norm``, ``post_ffw_norm``)
  before the residual add; the GELU-tanh gated FFN ``down(gelu(gate(x)) *
  up(x))``.

All weights live in memory as float64, so this is for small models (the tiny
synthetic ones: a few MB); a Llama-3-8B-shaped file would need 64 GB.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import attrs
import numpy as np

from ptxgen.llm.gguf.file import LlamaFile, LlamaHParams

__all__ = ["LlamaHParams", "RefConventions", "LlamaReference", "load_llama_gguf",
           "read_conventions", "rms_norm", "rope_norm", "rope_neox", "attention", "silu",
           "gelu_tanh"]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * w`` over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _angles(pos, theta, n_rot, freq_scale=1.0, freq_factors=None):
    i = np.arange(n_rot // 2, dtype=np.float64)
    ang = pos * freq_scale * theta ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        ang = ang / np.asarray(freq_factors, dtype=np.float64)
    return ang


def rope_norm(x: np.ndarray, pos: int, theta: float, n_rot: int, *, freq_scale: float = 1.0,
              freq_factors=None) -> np.ndarray:
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
    freq_scale : float
        Every angle is multiplied by this (linear scaling, 1 / factor).
    freq_factors : (n_rot / 2,) array, optional
        Per-frequency divisors of the angle (``rope_freqs.weight``).
    """
    x = np.array(x, dtype=np.float64, copy=True)
    ang = _angles(pos, theta, n_rot, freq_scale, freq_factors)
    c, s = np.cos(ang), np.sin(ang)
    x0 = x[..., 0:n_rot:2].copy()
    x1 = x[..., 1:n_rot:2].copy()
    x[..., 0:n_rot:2] = x0 * c - x1 * s
    x[..., 1:n_rot:2] = x0 * s + x1 * c
    return x


def rope_neox(x: np.ndarray, pos: int, theta: float, n_rot: int, *, freq_scale: float = 1.0,
              freq_factors=None) -> np.ndarray:
    """Rotate the pairs ``(x[i], x[i + n_rot/2])`` of the last axis
    (llama.cpp's NEOX RoPE); parameters as :func:`rope_norm`."""
    x = np.array(x, dtype=np.float64, copy=True)
    ang = _angles(pos, theta, n_rot, freq_scale, freq_factors)
    c, s = np.cos(ang), np.sin(ang)
    h = n_rot // 2
    x0 = x[..., :h].copy()
    x1 = x[..., h:n_rot].copy()
    x[..., :h] = x0 * c - x1 * s
    x[..., h:n_rot] = x0 * s + x1 * c
    return x


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale=None) -> np.ndarray:
    """Causal decode attention for one query position with GQA.

    Parameters
    ----------
    q : (n_heads, d)
    k, v : (n_kv_heads, L, d) — the cache rows this position sees.
    scale : float, optional
        The scores' factor (default ``1 / sqrt(d)``).

    Returns
    -------
    (n_heads, d) : ``softmax(q·K^T · scale) · V`` per head, query head h
    reading KV head ``h // (n_heads // n_kv_heads)``.
    """
    n_heads, d = q.shape
    group = n_heads // k.shape[0]
    kk = np.repeat(k, group, axis=0)                 # (n_heads, L, d)
    vv = np.repeat(v, group, axis=0)
    s = np.einsum("hd,hld->hl", q, kk) * (1.0 / np.sqrt(d) if scale is None else scale)
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hl,hld->hd", p, vv)


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``."""
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation: ``x/2 (1 + tanh(z))``, ``z = sqrt(2/pi) (x +
    0.044715 x^3)``, written as the equal ``x / (1 + exp(-2 z))`` (no
    cancellation for negative x)."""
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-2.0 * np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


# ---------------------------------------------------------------------------
# loading

@attrs.frozen
class RefConventions:
    """What the reference reads from a file's metadata (its own reading)."""

    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    context_length: int
    eps: float
    rope_theta: float
    rope_dim: int
    neox: bool
    freq_scale: float
    #: per layer: the sliding window (0: the whole sequence)
    windows: tuple = ()
    #: the local layers' RoPE base (unscaled)
    rope_theta_swa: float = 10000.0
    #: q's factor before unscaled scores (None: scores scaled by 1 / sqrt(d))
    attn_scale: float | None = None
    #: the embedding's factor (None: none)
    embed_scale: float | None = None
    #: attention and FFN outputs RMS-normed before the residual add
    post_norms: bool = False
    #: the gated FFN's activation: "silu" or "gelu_tanh"
    act: str = "silu"
    #: a mixture of experts: experts run per token (0: a dense FFN)
    n_expert_used: int = 0


def read_conventions(reader) -> RefConventions:
    """The hyperparameters a ``gguf.GGUFReader``'s metadata gives, with
    llama.cpp's defaults (head size ``embedding_length / head_count`` unless
    ``attention.key_length`` says otherwise; freq base 10000; linear RoPE
    scaling by ``1 / rope.scaling.factor``; vocabulary from the token list,
    else ``vocab_size``, else the embedding rows)."""
    fields = reader.fields

    def get(key, default=None):
        f = fields.get(key)
        if f is None:
            if default is None:
                raise KeyError(key)
            return default
        v = f.contents()
        return v[0] if isinstance(v, list) else v

    arch = get("general.architecture")
    hidden = int(get(f"{arch}.embedding_length"))
    n_heads = int(get(f"{arch}.attention.head_count"))
    n_layers = int(get(f"{arch}.block_count"))
    head_dim = int(get(f"{arch}.attention.key_length", hidden // n_heads))
    factor = float(get(f"{arch}.rope.scaling.factor", get(f"{arch}.rope.scale_linear", 0.0)))
    kind = get(f"{arch}.rope.scaling.type", "linear")
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    if "tokenizer.ggml.tokens" in fields:
        vocab = len(fields["tokenizer.ggml.tokens"].data)
    else:
        vocab = int(get(f"{arch}.vocab_size", int(emb.shape[1])))
    gemma = {}
    if arch == "gemma3":
        window = int(get(f"{arch}.attention.sliding_window", -1))
        local = [False] * n_layers
        if window > 0:
            f = fields.get(f"{arch}.attention.sliding_window_pattern")
            pat = 6 if f is None else f.contents()
            if isinstance(pat, list):
                local = [bool(b) for b in pat]
            else:
                local = [pat == 0 or il % pat < pat - 1 for il in range(n_layers)]
        gemma = dict(windows=tuple(window if lo else 0 for lo in local),
                     rope_theta_swa=float(get(f"{arch}.rope.freq_base_swa", 10000.0)),
                     attn_scale=1.0 / np.sqrt(hidden // n_heads if n_layers == 62 else head_dim),
                     embed_scale=np.sqrt(hidden), post_norms=True, act="gelu_tanh")
    return RefConventions(
        arch=arch, n_layers=n_layers, hidden=hidden, n_heads=n_heads,
        n_kv_heads=int(get(f"{arch}.attention.head_count_kv", n_heads)), head_dim=head_dim,
        vocab=vocab, context_length=int(get(f"{arch}.context_length")),
        eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        rope_dim=int(get(f"{arch}.rope.dimension_count", head_dim)),
        neox=arch in ("qwen2", "qwen3", "gemma3", "qwen3moe"),
        freq_scale=1.0 if kind == "none" or factor == 0.0 else 1.0 / factor,
        n_expert_used=int(get(f"{arch}.expert_used_count", 0)) if arch == "qwen3moe" else 0,
        **gemma)


def load_llama_gguf(path) -> tuple[RefConventions, dict[str, np.ndarray]]:
    """Read a supported GGUF: its conventions and every tensor as float64.

    The file is first validated by :class:`.gguf_loader.LlamaFile` (any
    weight type); the conventions are then read by :func:`read_conventions`
    and the weights decoded by ``gguf.quants.dequantize``, independently of
    the decode step's loader and kernels.  ``output.weight`` is the
    embedding when the file has none.

    Raises
    ------
    GGUFError (a ValueError)
        Not a readable/complete GGUF, an unsupported architecture or
        convention, a missing or unexpected tensor, a tensor of the wrong
        shape or of a type that holds no weights.
    """
    f = LlamaFile(path, check_kernels=False)
    hp = read_conventions(f.reader)
    weights = {n: f.dequantized(n).astype(np.float64) for n in f.names}
    weights.setdefault("output.weight", weights["token_embd.weight"])
    return hp, weights


# ---------------------------------------------------------------------------
# the model

class LlamaReference:
    """Token-at-a-time float64 decode with a KV cache (llama, mistral,
    qwen2, qwen3, qwen3moe, gemma3).

    Parameters
    ----------
    path : str or Path
        A GGUF file of a supported architecture.
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

    def step(self, token_id: int, kv=None, experts=None) -> np.ndarray:
        """Feed one token at the next position; return its logits (vocab,) float64.

        ``kv`` (optional): per layer, the ``(k, v)`` rows (``[n_kv_heads,
        head_dim]``) to cache at this position instead of this pass's own
        rounded values, e.g. the rows another implementation cached, so that
        its logits can be checked without one cache rounding flip spreading
        into every later step.  This pass's unrounded rows are kept in
        ``last_kv`` either way.

        ``experts`` (optional, a mixture of experts): per layer, the expert
        ids to run instead of this pass's own choice, e.g. those another
        implementation chose, for the same reason (a near tie in the router
        decided the other way).  ``last_experts`` keeps this pass's own
        choice and ``last_router`` its router logits, per layer.

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
        if hp.embed_scale is not None:
            x = x * hp.embed_scale
        act = gelu_tanh if hp.act == "gelu_tanh" else silu
        self.last_kv = []
        #: per layer, the experts this step chose and its router logits
        self.last_experts, self.last_router = [], []
        for i in range(hp.n_layers):
            b = f"blk.{i}."
            h = rms_norm(x, W[b + "attn_norm.weight"], hp.eps)
            q, k, v = (self._proj(b + n, h) for n in ("attn_q", "attn_k", "attn_v"))
            q = q.reshape(hp.n_heads, hp.head_dim)
            k = k.reshape(hp.n_kv_heads, hp.head_dim)
            v = v.reshape(hp.n_kv_heads, hp.head_dim)
            if b + "attn_q_norm.weight" in W:
                q = rms_norm(q, W[b + "attn_q_norm.weight"], hp.eps)
                k = rms_norm(k, W[b + "attn_k_norm.weight"], hp.eps)
            q, k = self._rope(q, p, i), self._rope(k, p, i)
            self.last_kv.append((k, v))
            if kv is None:
                self._k[i, :, p] = self._cache(k)
                self._v[i, :, p] = self._cache(v)
            else:
                self._k[i, :, p], self._v[i, :, p] = (np.asarray(a, dtype=np.float64)
                                                      for a in kv[i])
            win = hp.windows[i] if hp.windows else 0
            lo = max(0, p + 1 - win) if win else 0
            kk, vv = self._k[i, :, lo:p + 1], self._v[i, :, lo:p + 1]
            if hp.attn_scale is None:
                a = attention(q, kk, vv)
            else:
                a = attention(q * hp.attn_scale, kk, vv, scale=1.0)
            o = W[b + "attn_output.weight"] @ a.reshape(-1)
            if hp.post_norms:
                o = rms_norm(o, W[b + "post_attention_norm.weight"], hp.eps)
            x = x + o
            h = rms_norm(x, W[b + "ffn_norm.weight"], hp.eps)
            if hp.n_expert_used:
                x = x + self._experts(b, h, None if experts is None else experts[i])
            else:
                g = act(W[b + "ffn_gate.weight"] @ h) * (W[b + "ffn_up.weight"] @ h)
                f = W[b + "ffn_down.weight"] @ g
                if hp.post_norms:
                    f = rms_norm(f, W[b + "post_ffw_norm.weight"], hp.eps)
                x = x + f
        self.pos = p + 1
        h = rms_norm(x, W["output_norm.weight"], hp.eps)
        return W["output.weight"] @ h

    def _experts(self, b, h, forced=None):
        """A mixture of experts' FFN of ``h`` (llama.cpp's ``build_moe_ffn``,
        softmax gating, ``norm_w``), running ``forced`` experts if given."""
        W, n = self.weights, self.hparams.n_expert_used
        z = W[b + "ffn_gate_inp.weight"] @ h
        p = np.exp(z - z.max())
        p /= p.sum()
        ids = np.argsort(-p, kind="stable")[:n]
        self.last_experts.append(ids)
        self.last_router.append(z)
        if forced is not None:
            ids = np.asarray(forced)
        w = p[ids] / max(p[ids].sum(), 2.0 ** -14)
        out = np.zeros_like(h)
        for e, we in zip(ids, w):
            g = silu(W[b + "ffn_gate_exps.weight"][e] @ h) * (W[b + "ffn_up_exps.weight"][e] @ h)
            out += we * (W[b + "ffn_down_exps.weight"][e] @ g)
        return out

    def _proj(self, name, h):
        y = self.weights[name + ".weight"] @ h
        bias = self.weights.get(name + ".bias")
        return y if bias is None else y + bias

    def _rope(self, x, pos, layer):
        hp = self.hparams
        rot = rope_neox if hp.neox else rope_norm
        ff = None if hp.neox else self.weights.get("rope_freqs.weight")
        if hp.windows and hp.windows[layer]:
            # a sliding-window layer: its own base, unscaled
            return rot(x, pos, hp.rope_theta_swa, hp.rope_dim)
        return rot(x, pos, hp.rope_theta, hp.rope_dim, freq_scale=hp.freq_scale,
                   freq_factors=ff)

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
