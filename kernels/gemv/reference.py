"""float64 references of the GEMV family: the weights dequantized (by
:func:`ptxgen.kernels.quants.dequantize`, itself checked bit-exact against
the gguf package) times x, with the epilogues written out in numpy."""

from __future__ import annotations

import numpy as np

__all__ = ["reference", "rope_reference"]


def rope_reference(y, pos: int, spec, inv_freq, k_cache=None, v_cache=None, bias=None,
                   slot=None):
    """float64 model of the rope epilogue applied to the plain product
    ``y`` (float64, ``spec.rope_rows``, natural row order): returns the
    stored ``y`` (``bias`` added where given, then q and k heads rotated in
    ``spec.rope_layout`` by ``pos * inv_freq``, v as it is) and, when ``0 <=
    pos < capacity``, writes this token's k and v rows into the f16 caches
    ``[n_kv_heads, capacity, head_dim]`` in place; with ``spec.paged``, into
    the pools ``[num_blocks, n_kv_heads, paged, head_dim]`` at ``slot`` when
    ``0 <= slot < num_blocks * paged``."""
    from ..rope import rotate
    d, nq, nkv = spec.rope
    y = np.array(y, dtype=np.float64)
    if y.shape != (spec.rope_rows,):
        raise ValueError(f"y has shape {y.shape}, the rope epilogue writes {spec.rope_rows} rows")
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float64)
    qk = (nq + nkv) * d
    y[:qk] = rotate(y[:qk].reshape(nq + nkv, d), pos, inv_freq, spec.rope_layout).reshape(-1)
    if k_cache is None:
        return y
    k_rows, v_rows = y[nq * d:(nq + nkv) * d].reshape(nkv, d), y[(nq + nkv) * d:].reshape(nkv, d)
    if spec.paged:
        bs = spec.paged
        if slot is not None and 0 <= slot < k_cache.shape[0] * bs:
            k_cache[slot // bs, :, slot % bs, :] = k_rows
            v_cache[slot // bs, :, slot % bs, :] = v_rows
    elif 0 <= pos < k_cache.shape[1]:
        k_cache[:, pos, :] = k_rows
        v_cache[:, pos, :] = v_rows
    return y


def reference(spec_or_qtype, w_raw, x, residual=None, w_up=None, epilogue=None,
              norm_w=None, eps=None):
    """float64 reference: gguf-dequantized weights (as float64) times x.

    Parameters
    ----------
    spec_or_qtype : GemvSpec, GemvPlan or str
    w_raw : uint8 [M, row_bytes]
        Weights (gate weights for swiglu and geglu).
    x : float [K]
    residual : float [M], optional
    w_up : uint8 [M, row_bytes], optional
        Up weights for swiglu and geglu.
    epilogue : str, optional
        Defaults to the spec's (or "none" for a bare qtype).
    norm_w, eps : optional
        Fused RMSNorm: x is replaced by ``x / sqrt(mean(x^2) + eps) * norm_w``.
    """
    from ..quants import dequantize
    if not isinstance(spec_or_qtype, str):
        qtype, epi = spec_or_qtype.qtype, spec_or_qtype.epilogue
    else:
        qtype, epi = spec_or_qtype, "none"
    epi = epilogue or epi
    x = np.asarray(x, dtype=np.float64)
    if norm_w is not None:
        x = x / np.sqrt(np.mean(x * x) + float(eps)) * np.asarray(norm_w, dtype=np.float64)
    m = w_raw.shape[0]
    w = dequantize(np.ascontiguousarray(w_raw), qtype, (m, x.size)).astype(np.float64)
    y = w @ x
    if epi == "residual":
        y = y + np.asarray(residual, dtype=np.float64)
    elif epi in ("swiglu", "geglu"):
        from ..swiglu import reference as gated
        wu = dequantize(np.ascontiguousarray(w_up), qtype, (m, x.size)).astype(np.float64)
        y = gated(y, wu @ x, "silu" if epi == "swiglu" else "gelu_tanh")
    return y

