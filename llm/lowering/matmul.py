"""Matrix products lowered to launches: GEMVs for one token, GEMMs for the
rows of a chunk.

For one token (:func:`gemv`): ``y = W x`` (or ``y = W x + r`` with
``residual``; ``y`` may be ``r`` itself), :func:`gemv_swiglu` the fused
``silu(Wg x) * (Wu x)`` (or GeGLU's ``gelu``) and :func:`gemv_rope` the
stacked Q/K/V projection with its biases, RoPE and the KV-cache append in
its epilogue.  With ``norm=(nw, eps)``
the RMSNorm of ``x`` is folded in front (``W (x / rms(x) * nw)``; Q4_K
only, see :func:`can_fuse_norm`).

For a chunk (:func:`gemm`): ``Y = X W^T`` over the rows of ``X`` (with a
residual ``R`` of Y's shape, or a bias vector broadcast over the rows), the
number of rows read from a device int32 so one captured launch serves any
chunk up to its size; a weight type with no GEMM on the target falls back
to a GEMV per row.

Weights stay in their GGUF format.
"""

from __future__ import annotations

import numpy as np

from ptxgen.driver.executor import TensorMapOf
from ptxgen.kernels import gemm as _gemm
from ptxgen.kernels import gemv as _gemv
from ptxgen.kernels.quants.qtypes import names_for, qtype_of
from ptxgen.kernels.spec_fields import has_griddepcontrol

from .common import Lowering, Tuning

__all__ = ["gemv", "gemv_plan", "gemv_swiglu", "gemv_rope", "gemm", "gemm_target", "has_gemm",
           "can_fuse_norm"]


def can_fuse_norm(*tensors) -> bool:
    """Whether GEMVs over all of ``tensors`` can take the RMSNorm fused."""
    return all(t.qtype == "Q4_K" for t in tensors)


def _gemv_plan(t, epilogue, target, norm, tuning: Tuning, rope=(), norm_out=False,
               **rope_fields):
    if not qtype_of(t.qtype).read_by("gemv"):
        raise ValueError(f"tensor {t.name!r} is {t.qtype}; MulMat supports "
                         f"{', '.join(names_for('gemv'))}")
    m, k = t.shape
    ov = tuning.overrides
    knobs = ov(m, k, epilogue) if callable(ov) else ov
    if t.qtype != "Q4_K" or not knobs:
        return _gemv.plan(_gemv.GemvSpec(t.qtype, k, epilogue=epilogue, norm=norm, rope=rope,
                                         target=target, norm_out=norm_out, **rope_fields),
                          m=m, sm_count=tuning.sm_count, device=tuning.device), m
    try:
        return _gemv.default_plan(t.qtype, k, epilogue, target=target, m=m, norm=norm,
                                  rope=rope, norm_out=norm_out, **rope_fields, **knobs), m
    except ValueError as e:
        raise ValueError(f"gemv_knobs {knobs!r} for {t.name} ({m}x{k}, {epilogue}): {e}") from None


def gemv_plan(t, epilogue: str, target: str, tuning: Tuning, norm: bool = False):
    """The GEMV plan for the weight ``t`` (a :class:`TensorInfo` of one
    matrix) with ``epilogue``, as :func:`gemv` chooses it, and its rows."""
    return _gemv_plan(t, epilogue, target, norm, tuning)


def _gemv_launch(plan, m, **args):
    norm = args.pop("norm", None)
    if norm is not None:
        args.update(nw=norm[0], eps=float(norm[1]))
        if len(norm) > 2:
            args["h"] = norm[2]
    return Lowering.launch("gemv", plan, _gemv.launch_geometry(plan, m), m=m, **args)


def gemv(lw: Lowering, name, w, t, x, y, *, residual=None, norm=None, tuning=Tuning(), **extra):
    """``y = W x (+ residual)``: one GEMV launch (``w``/``t``: the weight's
    buffer and tensor info; ``norm``: ``(weight buffer, eps)`` folded in, or
    ``(weight buffer, eps, h)`` also storing the normed x to ``h``)."""
    plan, m = _gemv_plan(t, "residual" if residual is not None else "none", lw.target,
                         norm is not None, tuning, norm_out=norm is not None and len(norm) > 2)
    args = dict(w=w, x=x, y=y, norm=norm)
    if residual is not None:
        args["r"] = residual
    ins = [w, x] + ([norm[0]] if norm is not None else []) + (
        [residual] if residual is not None else [])
    outs = [y] + list(norm[2:] if norm is not None else ())
    return lw.add("MulMat", name, ins, outs, [_gemv_launch(plan, m, **args)], **extra)


#: the gated GEMV epilogue of each activation
_GATED = {"silu": "swiglu", "gelu_tanh": "geglu"}


def gemv_swiglu(lw: Lowering, name, wg, tg, wu, tu, x, y, *, norm=None, tuning=Tuning(),
                act: str = "silu"):
    """``y = silu(Wg x) * (Wu x)`` (``act="gelu_tanh"``: ``gelu(Wg x) * (Wu
    x)``, GeGLU): one GEMV launch over both weights."""
    if (tg.qtype, tg.shape) != (tu.qtype, tu.shape):
        raise ValueError(f"{name}: gate {tg.qtype}{tg.shape} and up {tu.qtype}{tu.shape} "
                         "must have one type and shape to fuse")
    if act not in _GATED:
        raise ValueError(f"{name}: unknown gated activation {act!r}; "
                         f"give one of {', '.join(map(repr, _GATED))}")
    plan, m = _gemv_plan(tg, _GATED[act], lw.target, norm is not None, tuning)
    ins = [wg, wu, x] + ([norm[0]] if norm is not None else [])
    return lw.add("MulMatSwiGLU", name, ins, [y],
                  [_gemv_launch(plan, m, w=wg, wu=wu, x=x, y=y, norm=norm)])


def gemv_rope(lw: Lowering, name, w, t, x, qkv, freqs, pos_ptr, k_cache, v_cache, *, state,
              norm=None, bias=None, rope_layout="interleaved", tuning=Tuning(), paged=None):
    """``qkv = [Wq; Wk; Wv] x (+ bias)`` with q and k rotated (RoPE in
    ``rope_layout`` at the device position ``pos_ptr``, table ``freqs``) and
    this token's k and v rows written to the f16 caches: one GEMV launch
    (``GemvSpec.rope``).  For ``"neox"``, ``w`` holds the q and k rows in
    pair order (:func:`ptxgen.kernels.gemv.neox_pair_rows`); ``qkv``,
    ``bias`` and the caches are in the natural order.  ``state`` is the
    buffer ``pos_ptr`` points into.  ``paged=(block_size, slots, n_slots)``:
    the caches are paged pools of ``n_slots`` slots and the rows go to the
    slot the device int32 ``slots`` holds (``GemvSpec.paged``; ``slots`` in
    ``state`` too)."""
    hp = lw.hp
    plan, m = _gemv_plan(t, "rope", lw.target, norm is not None, tuning,
                         rope=(hp.head_dim, hp.n_heads, hp.n_kv_heads), bias=bias is not None,
                         rope_layout=rope_layout, paged=paged[0] if paged else 0)
    if m != plan.rope_rows:
        raise ValueError(f"{name}: {t.name} has {m} rows; {hp.n_heads} query and "
                         f"{hp.n_kv_heads} KV heads of {hp.head_dim} need {plan.rope_rows}")
    extra = {} if bias is None else dict(bias=bias)
    if paged:
        extra.update(slots=paged[1], k_pool=k_cache, v_pool=v_cache, n_slots=paged[2])
    else:
        extra.update(k_cache=k_cache, v_cache=v_cache, capacity=lw.capacity)
    ins = [w, x] + ([norm[0]] if norm is not None else []) + (
        [bias] if bias is not None else []) + [freqs, state]
    return lw.add("MulMatRopeKv", name, ins, [qkv, k_cache, v_cache],
                  [_gemv_launch(plan, m, w=w, x=x, norm=norm, freqs=freqs, pos_ptr=pos_ptr,
                                y=qkv, **extra)])


# ------------------------------------------------------------------ chunks
def gemm_target(target: str) -> str:
    """The target the GEMM family is built for on a device whose general
    target is ``target``: ``sm_90a`` on sm_90, so the tuning table can
    choose the warpgroup (wgmma) kernel there."""
    return "sm_90a" if target == "sm_90" else target


def has_gemm(file, name, target) -> bool:
    """Whether the weight ``name`` of ``file`` (``[rows, K]``) has a GEMM
    built for ``target`` (the device's); BF16 only where every weight fits
    f16 (the GEMM rounds them to f16)."""
    q, k = file.qtype(name).upper(), int(file.shape(name)[-1])
    return _gemm.supported(q, k, gemm_target(target)) and (q != "BF16" or file.in_f16_range(name))


def gemm(lw: Lowering, name, w, t, x, y, n_tokens, *, rows_max: int, residual=None, bias=None,
         y_stride=None, device=None, pdl=True):
    """``Y = X W^T (+ residual | + bias)`` over the rows of ``X``: ``X`` is
    ``[rows_max, K]`` (f16 or f32), ``Y`` f32 ``[rows_max, M]`` or, with
    ``y_stride``, a column block of a wider array.  ``n_tokens`` is the
    device int32 holding how many rows to compute."""
    m, k = t.shape
    tgt = gemm_target(lw.target)
    epi = "residual" if residual is not None else "bias" if bias is not None else "none"
    xb = x.buffer if hasattr(x, "buffer") else x
    x_type = "f16" if xb.dtype == np.float16 else "f32"
    ys = 0 if y_stride in (None, m) else int(y_stride)
    plan = _gemm.default_plan(t.qtype.upper(), k, x_type=x_type, epilogue=epi, t_device=True,
                              target=tgt, pdl=pdl and has_griddepcontrol(tgt), y_stride=ys,
                              m=m, t=rows_max, device=device)
    args = dict(w=w, x=x, y=y, m=m, t_ptr=n_tokens)
    if residual is not None:
        args["r"] = residual
    if bias is not None:
        args["r"] = bias
    if _gemm.x_map(plan, 0, rows_max) is not None:
        args["xmap"] = TensorMapOf(x, lambda addr: _gemm.x_map(plan, addr, rows_max))
    ins = [w, x] + [a for a in (residual, bias) if a is not None]
    outs = [y]
    ws_n, tiles = _gemm.split_scratch(plan, m, rows_max)
    if tiles:
        args["ws"] = lw.g.buffer(name + ".split_ws", (ws_n,), np.float32)
        args["counters"] = _split_counters(lw, tiles, name)
        outs += [args["ws"], args["counters"]]
    return lw.add("MulMat", name, ins, outs,
                  [lw.launch("gemm", plan, _gemm.launch_geometry(plan, m, rows_max), **args)])


#: tiles of one split-K GEMM launch the graphs' shared counters serve
SPLIT_COUNTERS = 8192


def _split_counters(lw: Lowering, tiles: int, name: str):
    """The split-K GEMMs' tile counters: one zeroed state buffer that every
    such launch of the model's graphs uses in turn (each leaves it zero)."""
    if tiles > SPLIT_COUNTERS:
        raise ValueError(f"{name}: a split-K GEMM of {tiles} tiles; the counters hold "
                         f"{SPLIT_COUNTERS}")
    buf = getattr(lw, "_split_counter_buf", None)
    if buf is None:
        buf = lw._split_counter_buf = lw.g.buffer("gemm_split_counters", (SPLIT_COUNTERS,),
                                                  np.uint32, "state")
    return buf
