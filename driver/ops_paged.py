"""Batched-decode entry points (re-exported by ``ptxgen.driver.ops``):
attention of one token per sequence over a paged KV cache
(:func:`paged_attention`)."""

from __future__ import annotations

import math

import attrs
import numpy as np

from ptxgen.kernels import paged_attention as _pa
from ptxgen.kernels.spec_fields import has_griddepcontrol

from .ops_backend import op_args

__all__ = ["paged_attention", "paged_attention_plan"]


def paged_attention_plan(head_dim, group, block_size, *, target, device=None, batch=None,
                         pdl=None, **config):
    """The plan (spec and the tuned config for ``batch`` sequences,
    ``config`` fields replacing its own); ``pdl`` defaults to on for sm_90
    and newer."""
    spec = _pa.PagedAttentionSpec(head_dim=head_dim, group=group, block_size=block_size,
                                  target=target,
                                  pdl=has_griddepcontrol(target) if pdl is None else bool(pdl))
    cfg = _pa.select_config(spec, device, batch)
    return _pa.PagedAttentionPlan(spec, attrs.evolve(cfg, **config) if config else cfg)


def paged_attention(q, k_pool, v_pool, block_table, seq_lens, out=None, *, sm_scale=None,
                    n_q_heads=None, n_splits=None, blocks_per_sm=None, pdl=None, stream=None,
                    backend=None, **config):
    """Attention of one query token per sequence over its paged keys and
    values (the layout of :mod:`ptxgen.kernels.paged_attention`).

    Parameters
    ----------
    q : float32 [B, n_q_heads, head_dim], or [B, row] with ``n_q_heads``
        A 2-D q holds each sequence's queries at the start of a longer row
        (a QKV GEMM's output; the row a multiple of 4 elements).
    k_pool, v_pool : float16 [num_blocks, n_kv_heads, block_size, head_dim]
    block_table : int32 [B, max_blocks]
    seq_lens : int32 [B]
        Read by the kernel (device arrays: graph-replay safe).
    out : float32 [B, n_q_heads, head_dim], optional
    sm_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    n_splits : int, optional
        Splits per sequence (fixed per batch size); default
        :func:`~ptxgen.kernels.paged_attention.choose_splits` for this
        device, ``B`` and the table's capacity, with ``blocks_per_sm``
        defaulting to the driver's occupancy of the split kernel.  With 1
        the split kernel writes ``out`` and there is no combine.
    pdl : bool, optional
        Programmatic dependent launch (default: on for sm_90 and newer).
    **config
        PagedAttentionConfig fields (``warps``, ``unroll``, ``min_keys``,
        ``l2_prefetch``, ``l1_bypass``, ``combine_warps``).

    Returns
    -------
    ``out``.
    """
    a = op_args(backend, writes=("out",), stream=stream, q=q, k_pool=k_pool, v_pool=v_pool,
                block_table=block_table, seq_lens=seq_lens, out=out)
    qa = a.array("q", np.float32)
    kp, vp = a.array("k_pool", np.float16), a.array("v_pool", np.float16)
    if kp.ndim != 4 or kp.shape != vp.shape:
        raise ValueError(f"k_pool {kp.shape} and v_pool {vp.shape} must both be "
                         "[num_blocks, n_kv_heads, block_size, head_dim]")
    nb, n_kv, bs, d = kp.shape
    if kp.size >= 2**32:
        raise ValueError(f"a pool of {kp.size} elements is past the kernels' 32-bit offsets")
    tab = a.array("block_table", np.int32)
    if tab.ndim != 2:
        raise ValueError(f"block_table must be [B, max_blocks], got shape {tab.shape}")
    B, max_blocks = tab.shape
    lens = a.array("seq_lens", np.int32, B)
    if n_q_heads is None:
        if qa.size % (B * d):
            raise ValueError(f"q ({qa.size} values) is not {B} sequences of heads of {d}")
        n_q_heads = qa.size // (B * d)
        q_stride = n_q_heads * d
    else:
        if qa.ndim != 2 or qa.shape[0] != B or qa.shape[1] < n_q_heads * d:
            raise ValueError(f"q {qa.shape} must be [{B}, row] with a row of at least "
                             f"{n_q_heads} x {d}")
        q_stride = qa.shape[1]
    if n_q_heads % n_kv or q_stride % 4:
        raise ValueError(f"{n_q_heads} query heads are not a multiple of {n_kv} KV heads, or "
                         f"the q row ({q_stride}) is not a multiple of 4")
    be = a.backend
    plan = paged_attention_plan(d, n_q_heads // n_kv, bs, target=be.target,
                                device=be.device_name, batch=B, pdl=pdl, **config)
    split = be.function(_pa.build, plan, plan.split_name)
    if n_splits is None:
        if blocks_per_sm is None:
            blocks_per_sm = be.resident(split, 32 * plan.warps)
        n_splits = _pa.choose_splits(plan, be.sm_count, B, n_kv, max_blocks * bs,
                                     blocks_per_sm)
    out = a.out("out", (B, n_q_heads, d))
    geos = _pa.launch_geometry(plan, B, n_kv, n_splits)
    comb = len(geos) > 1
    if comb:
        part_o = be.workspace(("pa_o", B, n_q_heads, n_splits, d), (B, n_q_heads, n_splits, d),
                              np.float32)
        part_ml = be.workspace(("pa_ml", B, n_q_heads, n_splits), (B, n_q_heads, n_splits, 2),
                               np.float32)
    else:
        part_o = part_ml = out           # not written: the split stores out itself
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    a.launch(split, geos[0], dict(q=qa, k_pool=kp, v_pool=vp, block_table=tab, seq_lens=lens,
                                  part_o=part_o, part_ml=part_ml, out=out, q_stride=q_stride,
                                  max_blocks=max_blocks, num_blocks=nb, sm_scale=scale),
             pdl=plan.pdl)
    if comb:
        a.launch(be.function(_pa.build, plan, plan.combine_name), geos[1],
                 dict(part_o=part_o, part_ml=part_ml, out=out), pdl=plan.pdl)
    return a.result(out)
