"""Lowering of MulMat tensor ops to GEMV launches (used by the decode graph).

``mul_mat`` adds ``y = W x`` (or ``y = W x + r`` with ``residual``; ``y`` may
be ``r`` itself), ``mul_mat_swiglu`` the fused ``silu(Wg x) * (Wu x)`` and
``mul_mat_rope`` the stacked Q/K/V projection with RoPE and the KV-cache
append in its epilogue (one launch for what was a GEMV and a RoPE launch).
With ``norm=(nw, eps)`` the RMSNorm of ``x`` is fused in front
(``W (x / rms(x) * nw)``; Q4_K only, see :func:`can_fuse_norm`).
Weights stay in their GGUF format; Q4_K, Q6_K and Q8_0 are supported and
any other type is refused by name.
"""

from __future__ import annotations

import attrs

from ptxgen.kernels import gemv

from ..executor import Launch

__all__ = ["mul_mat", "mul_mat_swiglu", "mul_mat_rope", "can_fuse_norm", "FAMILIES"]

FAMILIES = {"gemv": gemv}


def can_fuse_norm(*tensors) -> bool:
    """Whether GEMVs over all of ``tensors`` can take the RMSNorm fused."""
    return all(t.qtype == "Q4_K" for t in tensors)


#: the device's SM count, set by :class:`~.llama.LlamaModel` while it builds its
#: graph: a ring GEMV's CTAs are then spread evenly over the SMs (:func:`_balanced`)
SM_COUNT = None

#: knob overrides for Q4_K GEMVs, set by :class:`~.llama.LlamaModel` (``gemv_knobs``)
#: while it builds its graph: a dict, or a function ``(m, k, epilogue) -> dict``;
#: overrides a shape does not allow are skipped
Q4K_KNOBS = {}


def _balanced(spec, m):
    """``spec`` with ``per_sm = ceil(grid / SM_COUNT)`` where that is binding:
    a ring GEMV's shared memory often lets more CTAs share an SM than an even
    spread of its grid needs, and under PDL a grid is placed while the one
    before it drains, so its CTAs pile onto the SMs freed first (decode step
    on an H100: the 4096x4096 O projection, 256 CTAs, capped at 2 per SM,
    2.227 -> 2.189 ms per token at context 128, docs/results.md)."""
    if not SM_COUNT or not spec.stages or spec.per_sm:
        return spec
    n = -(-gemv.launch_geometry(spec, m)[0][0] // SM_COUNT)
    try:
        capped = attrs.evolve(spec, per_sm=n)
    except ValueError:           # n CTAs do not fit: the ring allows fewer already
        return spec
    return capped if capped.dynamic_shared > spec.ring_bytes else spec


def _spec(t, epilogue, target, norm=False, **fields):
    spec, m = _spec_unbalanced(t, epilogue, target, norm, **fields)
    return _balanced(spec, m), m


def _spec_unbalanced(t, epilogue, target, norm=False, **fields):
    if t.qtype not in gemv.QTYPE_INFO:
        raise ValueError(f"tensor {t.name!r} is {t.qtype}; MulMat supports "
                         f"{', '.join(gemv.QTYPE_INFO)}")
    m, k = t.shape
    knobs = Q4K_KNOBS(m, k, epilogue) if callable(Q4K_KNOBS) else Q4K_KNOBS
    if t.qtype == "Q4_K" and knobs:
        try:
            return gemv.default_spec(t.qtype, k, epilogue, target=target, m=m, norm=norm,
                                     **fields, **knobs), m
        except ValueError:
            pass
    return gemv.default_spec(t.qtype, k, epilogue, target=target, m=m, norm=norm, **fields), m


def _norm_args(norm):
    return () if norm is None else (norm[0], float(norm[1]))


def mul_mat(g, name, w, t, x, y, *, residual=None, norm=None, target="sm_80"):
    spec, m = _spec(t, "residual" if residual is not None else "none", target, norm is not None)
    grid, block, shared, rpc = gemv.launch_geometry(spec, m)
    args = ((w, x) + _norm_args(norm) + ((residual,) if residual is not None else ())
            + (y, m, rpc))
    ins = [w, x] + ([norm[0]] if norm is not None else []) + (
        [residual] if residual is not None else [])
    return g.add("MulMat", name, ins, [y],
                 [Launch("gemv", spec, spec.kernel_name, grid, block, args, shared)])


def mul_mat_swiglu(g, name, wg, tg, wu, tu, x, y, *, norm=None, target="sm_80"):
    if (tg.qtype, tg.shape) != (tu.qtype, tu.shape):
        raise ValueError(f"{name}: gate {tg.qtype}{tg.shape} and up {tu.qtype}{tu.shape} "
                         "must have one type and shape to fuse")
    spec, m = _spec(tg, "swiglu", target, norm is not None)
    grid, block, shared, rpc = gemv.launch_geometry(spec, m)
    ins = [wg, wu, x] + ([norm[0]] if norm is not None else [])
    return g.add("MulMatSwiGLU", name, ins, [y],
                 [Launch("gemv", spec, spec.kernel_name, grid, block,
                         (wg, wu, x) + _norm_args(norm) + (y, m, rpc), shared)])


def mul_mat_rope(g, name, w, t, x, qkv, rope_heads, freqs, pos_ptr, k_cache, v_cache,
                 capacity, *, state, norm=None, target="sm_80"):
    """``qkv = [Wq; Wk; Wv] x`` with q and k rotated (interleaved RoPE at the
    device position ``pos_ptr``, table ``freqs``) and this token's k and v
    rows written to the f16 caches: one GEMV launch (``GemvSpec.rope``).
    ``rope_heads = (head_dim, n_q_heads, n_kv_heads)``; ``state`` is the
    buffer ``pos_ptr`` points into."""
    spec, m = _spec(t, "rope", target, norm is not None, rope=tuple(rope_heads))
    if m != spec.rope_rows:
        raise ValueError(f"{name}: {t.name} has {m} rows; {rope_heads[1]} query and "
                         f"{rope_heads[2]} KV heads of {rope_heads[0]} need {spec.rope_rows}")
    grid, block, shared, rpc = gemv.launch_geometry(spec, m)
    args = ((w, x) + _norm_args(norm) + (freqs, pos_ptr, k_cache, v_cache, capacity)
            + (qkv, m, rpc))
    ins = [w, x] + ([norm[0]] if norm is not None else []) + [freqs, state]
    return g.add("MulMatRopeKv", name, ins, [qkv, k_cache, v_cache],
                 [Launch("gemv", spec, spec.kernel_name, grid, block, args, shared)])
