"""The attention input of a decode layer, lowered to launches: the Q, K and
V projections, their biases, the per-head q/k RMSNorms of qwen3, RoPE and
this token's K/V rows appended to the f16 caches.

Two paths, the first wherever it applies:

1. **Fused** (``MulMatRopeKv``): one GEMV over the stacked ``[Wq; Wk; Wv]``
   rotates q and k and appends k and v in its epilogue.  Needs the three
   weights in one type, interleaved RoPE (llama), no biases, no q/k norms
   and ``fuse_rope``: the Llama decode step.
2. **Split**: the projections (one stacked GEMV when the types agree, else
   three), each bias added by the GEMV's residual epilogue (``y = W x + b``:
   before RoPE, as llama.cpp adds it), for qwen3 one RMSNorm launch over
   the q heads and one over the k heads (rows of ``head_dim``, each head
   scaled by the norm weight, written to a buffer of their own), then one
   RoPE + KV-append launch in the file's layout (interleaved or neox).
"""

from __future__ import annotations

import numpy as np

from ptxgen.kernels import rmsnorm, rope

from ptxgen.driver.executor import Launch
from ptxgen.llm import lowering
from ptxgen.llm.gguf.file import RawTensor

__all__ = ["lower_qkv", "can_fuse_rope"]

_QKV = ("attn_q", "attn_k", "attn_v")


def _bias(model, g, p):
    """One f32 buffer of the layer's q | k | v biases (zeros for a missing
    one: adding 0 is exact), or None when the layer has none."""
    f, hp = model.file, model.hp
    names = [p + n + ".bias" for n in _QKV]
    if not any(f.has(n) for n in names):
        return None
    parts = [f.tensor(n).data.astype(np.float32) if f.has(n) else np.zeros(rows, np.float32)
             for n, rows in zip(names, (hp.q_dim, hp.kv_dim, hp.kv_dim))]
    data = np.concatenate(parts)
    return g.buffer(p + "attn_qkv.bias", data.shape, np.float32, "weight", data)


def can_fuse_rope(model, p) -> bool:
    """Whether layer ``p``'s Q/K/V GEMV can do RoPE and the append itself."""
    f, hp = model.file, model.hp
    return (model.fuse_rope and hp.rope_layout == "interleaved" and not hp.qk_norm
            and not any(f.has(p + n + ".bias") for n in _QKV)
            and len({f.qtype(p + n + ".weight") for n in _QKV}) == 1)


def lower_qkv(model, g, p, x, norm, qkv, freqs, pos_ptr, caches, rope_spec, qk_out=None):
    """Add layer ``p``'s ops from the normed input to the rotated q and the
    appended cache rows.

    ``x``: the GEMVs' input (``norm = (weight, eps)`` when the RMSNorm is
    folded into them, else None); ``qkv``: the f32 buffer of q | k | v;
    ``freqs``: the RoPE table; ``caches``: ``(k_cache, v_cache)``;
    ``qk_out``: a buffer of ``q_dim + kv_dim`` f32 for the normed q and k
    (qwen3).  Returns ``(q, buffer)``: the pointer attention reads the
    rotated q from, and its buffer.
    """
    hp, f = model.hp, model.file
    q, k, v = qkv.at(0), qkv.at(4 * hp.q_dim), qkv.at(4 * (hp.q_dim + hp.kv_dim))
    kc, vc = caches
    tun = dict(target=model.target, tuning=model.tuning)
    ts = [f.tensor(p + n + ".weight") for n in _QKV]
    if len({t.qtype for t in ts}) == 1:
        rows = sum(t.shape[0] for t in ts)
        t = RawTensor(p + "attn_qkv.weight", ts[0].qtype, (rows, ts[0].shape[1]),
                      np.concatenate([t.data for t in ts]))
        w = g.buffer(t.name, t.data.shape, t.data.dtype, "weight", t.data)
        if can_fuse_rope(model, p):
            lowering.mul_mat_rope(
                g, p + "attn_qkv", w, t, x, qkv, (hp.head_dim, hp.n_heads, hp.n_kv_heads),
                freqs, pos_ptr, kc, vc, model.capacity, state=model.state, norm=norm, **tun)
            return q, qkv
        bias = _bias(model, g, p)
        lowering.mul_mat(g, p + "attn_qkv", w, t, x, qkv, residual=bias, norm=norm, **tun)
    else:
        bias = _bias(model, g, p)
        offsets = (0, 4 * hp.q_dim, 4 * (hp.q_dim + hp.kv_dim))
        for name, out, off in zip(_QKV, (q, k, v), offsets):
            w, t = model._weight(p + name + ".weight")
            lowering.mul_mat(g, p + name, w, t, x, out, norm=norm,
                             residual=None if bias is None else bias.at(off), **tun)
    qr, kr, src = q, k, qkv
    if hp.qk_norm:
        if qk_out is None:
            raise ValueError(f"{p}: q/k norms need a buffer for the normed q and k")
        qr, kr, src = qk_out.at(0), qk_out.at(4 * hp.q_dim), qk_out
        _head_norm(model, g, p + "attn_q_norm", qkv, q, qk_out, qr, hp.n_heads)
        _head_norm(model, g, p + "attn_k_norm", qkv, k, qk_out, kr, hp.n_kv_heads)
    geo = rope.launch_geometry(rope_spec, hp.n_heads, hp.n_kv_heads)
    ins = [src, freqs, model.state] + ([qkv] if src is not qkv else [])
    g.add("RopeKvAppend", p + "rope_kv_append", ins, [src, kc, vc],
          [Launch("rope", rope_spec, geo,
                  (qr, kr, freqs, pos_ptr, hp.n_heads, hp.n_kv_heads, v, kc, vc,
                   model.capacity))])
    return qr, src


def _head_norm(model, g, name, src, x, dst, out, heads):
    """RMSNorm of each of ``heads`` rows of ``head_dim`` at ``x`` with the
    file's ``name.weight``, written to ``out`` (in ``dst``)."""
    hp = model.hp
    w, _ = model._weight(name + ".weight")
    spec = rmsnorm.RmsNormSpec(residual=False, target=model.target)
    g.add("RmsNorm", name, [src, w], [dst],
          [Launch("rmsnorm", spec, rmsnorm.launch_geometry(spec, heads),
                  (x, w, out, hp.head_dim, hp.eps))])
