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

from ptxgen.driver.executor import Launch

__all__ = ["mul_mat", "mul_mat_swiglu", "mul_mat_rope", "can_fuse_norm", "Tuning"]


def can_fuse_norm(*tensors) -> bool:
    """Whether GEMVs over all of ``tensors`` can take the RMSNorm fused."""
    return all(t.qtype == "Q4_K" for t in tensors)


@attrs.frozen
class Tuning:
    """How the model's GEMVs are configured, passed down explicitly:
    ``sm_count`` (a ring's CTAs are spread evenly over the SMs) and
    ``overrides``, GemvConfig fields for every Q4_K GEMV (a dict, or a
    function ``(m, k, epilogue) -> dict``).  An override a shape cannot take
    is refused with the shape named."""

    sm_count: int | None = None
    overrides: object = attrs.field(factory=dict)
    #: the device's name: configs ``python -m ptxgen tune`` stored for it win
    device: str | None = None


def _spec(t, epilogue, target, norm, tuning: Tuning, rope=()):
    if t.qtype not in gemv.QTYPE_INFO:
        raise ValueError(f"tensor {t.name!r} is {t.qtype}; MulMat supports "
                         f"{', '.join(gemv.QTYPE_INFO)}")
    m, k = t.shape
    ov = tuning.overrides
    knobs = ov(m, k, epilogue) if callable(ov) else ov
    if t.qtype != "Q4_K" or not knobs:
        return gemv.plan(gemv.GemvSpec(t.qtype, k, epilogue=epilogue, norm=norm, rope=rope,
                                       target=target), m=m, sm_count=tuning.sm_count,
                         device=tuning.device), m
    try:
        return gemv.default_plan(t.qtype, k, epilogue, target=target, m=m, norm=norm, rope=rope,
                                 **knobs), m
    except ValueError as e:
        raise ValueError(f"gemv_knobs {knobs!r} for {t.name} ({m}x{k}, {epilogue}): {e}") from None


def _norm_args(norm):
    return () if norm is None else (norm[0], float(norm[1]))


def mul_mat(g, name, w, t, x, y, *, residual=None, norm=None, target="sm_80", tuning=Tuning()):
    spec, m = _spec(t, "residual" if residual is not None else "none", target, norm is not None,
                    tuning)
    geo = gemv.launch_geometry(spec, m)
    args = ((w, x) + _norm_args(norm) + ((residual,) if residual is not None else ())
            + (y, m, geo.args["rpc"]))
    ins = [w, x] + ([norm[0]] if norm is not None else []) + (
        [residual] if residual is not None else [])
    return g.add("MulMat", name, ins, [y], [Launch("gemv", spec, geo, args)])


def mul_mat_swiglu(g, name, wg, tg, wu, tu, x, y, *, norm=None, target="sm_80",
                   tuning=Tuning()):
    if (tg.qtype, tg.shape) != (tu.qtype, tu.shape):
        raise ValueError(f"{name}: gate {tg.qtype}{tg.shape} and up {tu.qtype}{tu.shape} "
                         "must have one type and shape to fuse")
    spec, m = _spec(tg, "swiglu", target, norm is not None, tuning)
    geo = gemv.launch_geometry(spec, m)
    ins = [wg, wu, x] + ([norm[0]] if norm is not None else [])
    return g.add("MulMatSwiGLU", name, ins, [y],
                 [Launch("gemv", spec, geo,
                         (wg, wu, x) + _norm_args(norm) + (y, m, geo.args["rpc"]))])


def mul_mat_rope(g, name, w, t, x, qkv, rope_heads, freqs, pos_ptr, k_cache, v_cache,
                 capacity, *, state, norm=None, target="sm_80", tuning=Tuning()):
    """``qkv = [Wq; Wk; Wv] x`` with q and k rotated (interleaved RoPE at the
    device position ``pos_ptr``, table ``freqs``) and this token's k and v
    rows written to the f16 caches: one GEMV launch (``GemvSpec.rope``).
    ``rope_heads = (head_dim, n_q_heads, n_kv_heads)``; ``state`` is the
    buffer ``pos_ptr`` points into."""
    spec, m = _spec(t, "rope", target, norm is not None, tuning, rope=tuple(rope_heads))
    if m != spec.rope_rows:
        raise ValueError(f"{name}: {t.name} has {m} rows; {rope_heads[1]} query and "
                         f"{rope_heads[2]} KV heads of {rope_heads[0]} need {spec.rope_rows}")
    geo = gemv.launch_geometry(spec, m)
    args = ((w, x) + _norm_args(norm) + (freqs, pos_ptr, k_cache, v_cache, capacity)
            + (qkv, m, geo.args["rpc"]))
    ins = [w, x] + ([norm[0]] if norm is not None else []) + [freqs, state]
    return g.add("MulMatRopeKv", name, ins, [qkv, k_cache, v_cache],
                 [Launch("gemv", spec, geo, args)])
