"""Prefill entry points (re-exported by ``ptxgen.driver.ops``): attention of
a chunk of prompt tokens on tensor cores, over a contiguous KV cache
(:func:`flash_prefill`) or a paged one (:func:`flash_prefill_paged`)."""

from __future__ import annotations

import math

import numpy as np

from ptxgen.kernels import flash_prefill as _fp
from ptxgen.kernels.spec_fields import has_griddepcontrol

from .ops_backend import op_args
from .ops_gemm import gemm_target

__all__ = ["flash_prefill", "flash_prefill_paged", "flash_prefill_plan"]


def flash_prefill_plan(head_dim, group, *, target, device=None, pdl=None, out_type="f32",
                       paged=0, window=0, **config):
    """The plan (spec and tuned config, ``config`` fields replacing its own)
    for ``target``; ``pdl`` defaults to on for sm_90 and newer.  On an sm_90
    device the family is built for sm_90a (as the GEMM's, :func:`.gemm_target`),
    so the tuning table can choose the warpgroup kernel there."""
    target = gemm_target(target)
    spec = _fp.FlashPrefillSpec(head_dim=head_dim, group=group, target=target, out_type=out_type,
                                paged=paged, window=window,
                                pdl=has_griddepcontrol(target) if pdl is None else bool(pdl))
    tuned = _fp.plan(spec, device=device)
    if not config:
        return tuned
    if "kernel" not in config and tuned.config.kernel == "wgmma":
        # fields that rule out the tuned warpgroup kernel (heads not a
        # multiple of 4, 2 stages) get the mma.sync one instead
        try:
            return tuned.evolve(**config)
        except ValueError:
            return tuned.evolve(kernel="mma", **config)
    return tuned.evolve(**config)


def flash_prefill(q, k_cache, v_cache, start, n_tokens, out=None, *, sm_scale=None,
                  n_q_heads=None, max_tokens=None, pdl=None, stream=None, backend=None,
                  window=0, **config):
    """Causal attention of a chunk of ``T`` query rows at positions ``start
    .. start + T - 1`` against the first ``start + T`` cache rows.

    Parameters
    ----------
    q : float32 [T_max, n_q_heads, head_dim], or [T_max, row] with ``n_q_heads``
        The chunk's queries (RoPE applied); a 2-D q holds each row's
        queries at the start of a longer row (a QKV GEMM's output).
    k_cache, v_cache : float16 [n_kv_heads, capacity, head_dim]
        Rows ``start .. start + T - 1`` (the chunk's own keys and values)
        must already be written.
    start, n_tokens : device int32 scalar, or int
        ``L`` and ``T``, read by the kernel (device arrays: graph-replay
        safe; a Python int is copied into a fresh device scalar).
    out : float32 or float16 [T_max, n_q_heads, head_dim], optional
        Rows ``[0, T)`` written; allocated (float32) when None.  Its dtype
        picks the kernel's ``out_type`` (float16: the result rounded once).
    sm_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    max_tokens : int, optional
        The most rows a launch covers (the grid); default ``T_max``.
    window : int
        A sliding window: row ``i`` sees the keys ``start + i - window + 1
        .. start + i`` (0: all of ``0 .. start + i``).
    **config
        FlashPrefillConfig fields (``warps``, ``heads``,
        ``block_keys``, ``stages``, ``kernel``); where they rule out the
        tuned warpgroup kernel and name no ``kernel``, the mma.sync one.

    Returns
    -------
    ``out``.

    Raises
    ------
    ValueError
        Mismatched shapes, a head_dim other than 64/128/256.
    TypeError
        A cache not float16, q not float32, out neither float32 nor float16.
    """
    a = op_args(backend, writes=("out",), stream=stream, q=q, k_cache=k_cache,
                v_cache=v_cache, start=start, n_tokens=n_tokens, out=out)
    kc, vc = a.array("k_cache"), a.array("v_cache")
    if kc.ndim != 3 or kc.shape != vc.shape:
        raise ValueError(f"k_cache {tuple(kc.shape)} and v_cache {tuple(vc.shape)} must both "
                         "be [n_kv_heads, capacity, head_dim]")
    n_kv, cap, d = kc.shape
    qa, t_max, n_q, q_stride = _queries(a, kc, vc, n_kv, d, n_q_heads)
    odt = a.out_dtype("out")
    be = a.backend
    plan = flash_prefill_plan(d, n_q // n_kv, target=be.target, device=be.device_name,
                              pdl=pdl, out_type="f16" if odt == np.float16 else "f32",
                              window=window, **config)
    o = a.out("out", (t_max, n_q, d), odt)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    args = dict(q=qa, k_cache=kc, v_cache=vc, start_ptr=a.scalar_i32("start"),
                n_tokens_ptr=a.scalar_i32("n_tokens"), out=o, capacity=cap, sm_scale=scale,
                q_stride=q_stride)
    maps = _fp.cache_maps(plan, int(kc.ptr), int(vc.ptr), n_kv, cap)
    if maps is not None:
        args["k_map"], args["v_map"] = (be.tensor_map(mp) for mp in maps)
    a.launch(be.function(_fp.build, plan), _fp.launch_geometry(plan, n_q, max_tokens or t_max),
             args, pdl=plan.pdl)
    return a.result(o)


def _queries(a, kc, vc, n_kv, d, n_q_heads):
    """``(q, T_max, n_q_heads, q_stride)`` of a call whose caches (or pools)
    ``kc``, ``vc`` hold ``n_kv`` heads of ``d``, checked."""
    qa = a.array("q")
    if np.dtype(qa.dtype) != np.float32:
        raise TypeError(f"q must be float32, got {np.dtype(qa.dtype).name}")
    if np.dtype(kc.dtype) != np.float16 or np.dtype(vc.dtype) != np.float16:
        raise TypeError(f"the KV cache must be float16, got {np.dtype(kc.dtype).name}")
    if qa.ndim == 2 and n_q_heads is not None and qa.shape[1] >= n_q_heads * d:
        t_max, n_q, q_stride = int(qa.shape[0]), int(n_q_heads), int(qa.shape[1])
    elif qa.ndim == 3 and qa.shape[2] == d:
        t_max, n_q = int(qa.shape[0]), int(qa.shape[1])
        q_stride = n_q * d
    else:
        raise ValueError(f"q must be [T, n_q_heads, {d}] (or [T, row] with n_q_heads), "
                         f"got shape {tuple(qa.shape)}")
    if n_q % n_kv:
        raise ValueError(f"{n_q} query heads are not a multiple of {n_kv} KV heads")
    if d not in (64, 128, 256):
        raise ValueError(f"flash_prefill takes head_dim 64, 128 or 256, got {d}")
    return qa, t_max, n_q, q_stride


def flash_prefill_paged(q, k_pool, v_pool, block_table, start, n_tokens, out=None, *,
                        sm_scale=None, n_q_heads=None, max_tokens=None, pdl=None, stream=None,
                        backend=None, **config):
    """Causal attention of a chunk of ``T`` query rows of one sequence at
    positions ``start .. start + T - 1`` against its first ``start + T``
    keys, which sit in a paged KV cache (the layout of
    :mod:`ptxgen.kernels.paged_attention`).

    Parameters
    ----------
    q : float32 [T_max, n_q_heads, head_dim], or [T_max, row] with ``n_q_heads``
    k_pool, v_pool : float16 [num_blocks, n_kv_heads, block_size, head_dim]
        The chunk's own keys and values (positions ``start .. start + T -
        1``) must already be written at their slots.
    block_table : int32 [max_blocks]
        The sequence's row of the block table (key ``p`` in pool block
        ``block_table[p // block_size]``), read by the kernel.
    start, n_tokens : device int32 scalar, or int
        ``L`` and ``T`` (clamped to the table's ``max_blocks *
        block_size`` keys).
    out : float32 or float16 [T_max, n_q_heads, head_dim], optional
    sm_scale, max_tokens, pdl, stream, backend, **config
        As for :func:`flash_prefill`.

    Returns
    -------
    ``out``.

    Raises
    ------
    ValueError
        Mismatched shapes, a head_dim other than 64/128/256, a block size the
        kernel is not built for.
    TypeError
        Pools not float16, a table not int32, q not float32, out neither
        float32 nor float16.
    """
    a = op_args(backend, writes=("out",), stream=stream, q=q, k_pool=k_pool, v_pool=v_pool,
                block_table=block_table, start=start, n_tokens=n_tokens, out=out)
    kp, vp = a.array("k_pool"), a.array("v_pool")
    if kp.ndim != 4 or kp.shape != vp.shape:
        raise ValueError(f"k_pool {tuple(kp.shape)} and v_pool {tuple(vp.shape)} must both be "
                         "[num_blocks, n_kv_heads, block_size, head_dim]")
    num_blocks, n_kv, bs, d = kp.shape
    if bs not in _fp.PAGED_SIZES:
        raise ValueError(f"block size {bs} is not one of {_fp.PAGED_SIZES}")
    tab = a.array("block_table", np.int32)
    if tab.ndim != 1 or tab.shape[0] < 1:
        raise ValueError(f"block_table must be the sequence's row, int32 [max_blocks] with "
                         f"max_blocks >= 1, got shape {tuple(tab.shape)}")
    qa, t_max, n_q, q_stride = _queries(a, kp, vp, n_kv, d, n_q_heads)
    odt = a.out_dtype("out")
    be = a.backend
    plan = flash_prefill_plan(d, n_q // n_kv, target=be.target, device=be.device_name,
                              pdl=pdl, out_type="f16" if odt == np.float16 else "f32",
                              paged=bs, **config)
    o = a.out("out", (t_max, n_q, d), odt)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    args = dict(q=qa, k_pool=kp, v_pool=vp, block_table=tab, start_ptr=a.scalar_i32("start"),
                n_tokens_ptr=a.scalar_i32("n_tokens"), out=o, max_blocks=int(tab.shape[0]),
                sm_scale=scale, q_stride=q_stride, num_blocks=num_blocks)
    maps = _fp.pool_maps(plan, int(kp.ptr), int(vp.ptr), n_kv, num_blocks)
    if maps is not None:
        args["k_map"], args["v_map"] = (be.tensor_map(mp) for mp in maps)
    a.launch(be.function(_fp.build, plan), _fp.launch_geometry(plan, n_q, max_tokens or t_max),
             args, pdl=plan.pdl)
    return a.result(o)
