"""Paged decode attention: one query token for each of a batch of sequences, over a paged KV cache.

``out[b, qh] = softmax(q[b, qh] . K_b[h]^T * sm_scale) @ V_b[h]`` over the
first ``seq_lens[b]`` keys of sequence ``b``, for every query head ``qh``
and its KV head ``h = qh // group`` (GQA), every sequence of the batch in
one launch whatever its length.

Layout (paged KV cache)
    ``k_pool``, ``v_pool``: f16 ``[num_blocks, n_kv_heads, block_size,
    head_dim]``, one pair per layer: block ``n`` holds ``block_size``
    consecutive tokens of one sequence for every KV head, head ``h``'s rows
    contiguous (``block_size * head_dim * 2`` bytes), so token ``p`` of a
    sequence whose ``p // block_size``-th block is ``n`` has its head-``h``
    row at element ``((n * n_kv_heads + h) * block_size + p % block_size) *
    head_dim``.  A token's slot (vLLM's ``slot_mapping``) is ``n *
    block_size + p % block_size``; :mod:`~ptxgen.kernels.rope` with
    ``paged=block_size`` writes rows there.  Each pool has fewer than
    ``2**32`` elements (32-bit element offsets); 16-byte aligned.
    ``block_table``: int32 ``[B, max_blocks]``, row ``b`` the pool blocks of
    sequence ``b`` in token order (any blocks, in any order; entries past
    the sequence's last block are never read, and an entry outside
    ``[0, num_blocks)`` reads block ``num_blocks - 1``, so a bad table stays
    inside the pool).  ``seq_lens``: int32 ``[B]``, each clamped to ``[0,
    max_blocks * block_size]``.  Table and lengths are read from device
    memory, so a replayed CUDA graph sees them change.
    ``q`` f32: sequence ``b``'s heads ``[n_q_heads, head_dim]`` start at
    element ``b * q_stride`` (``q_stride = n_q_heads * head_dim`` for a
    packed ``[B, n_q_heads, head_dim]``; a multiple of 4).  ``out`` f32
    ``[B, n_q_heads, head_dim]``.  Workspace (``n_splits > 1``): ``part_o``
    f32 ``[B, n_q_heads, n_splits, head_dim]``, ``part_ml`` f32 ``[B,
    n_q_heads, n_splits, 2]``.

What is computed is a :class:`PagedAttentionSpec`; how it runs a
:class:`PagedAttentionConfig` from :func:`select_config` (the tuning table
``kernels/tuning/paged_attention.json``).

Kernels (:mod:`.split`; the combine is flash decode's)
    ``split``: ``grid = (n_splits, n_kv_heads, B)``, ``block = 32 * warps``,
    on tensor cores (``mma.sync.m16n8k16``; see :func:`.split.build_split`).
    Sequence ``b`` of length ``L`` works on its first ``n = min(n_splits,
    ceil(L / min_keys))`` splits, its 16-key chunks dealt out evenly (split
    ``s`` takes chunks ``[s c / n, (s + 1) c / n)`` of ``c = ceil(L / 16)``);
    a split past ``n`` writes a neutral partial ``(m, l, o) = (-1e30, 0,
    0)`` and exits, so one fixed grid serves every mix of lengths.  A launch
    of one split per sequence writes ``out`` directly and needs no combine.
    ``combine`` (``n_splits > 1``): flash decode's, ``grid = B * n_q_heads``
    (the partials of sequence ``b``, head ``qh`` are row ``b * n_q_heads +
    qh`` of flash decode's), ``block = 32 * combine_warps``; an empty
    sequence gives 0.

Accuracy: within 1e-4 (relative to the largest output of the batch) of
float64 attention over the same f16 K/V (q and the probabilities carried to
22 bits, ``ex2.approx``: 2^-22 relative).
"""

from __future__ import annotations

import ptxgen
from ptxgen import registry

from ..plan import LaunchGeometry

from ..flash_decode.combine import build_combine
from .reference import gather, reference
from .spec import (BLOCK_SIZES, MAX_SPLITS, PagedAttentionConfig, PagedAttentionPlan,
                   PagedAttentionSpec)
from .split import build_split
from .tuning import choose_splits, resident_blocks, select_config

__all__ = ["PagedAttentionSpec", "PagedAttentionConfig", "PagedAttentionPlan", "build", "plan",
           "select_config", "launch_geometry", "choose_splits", "resident_blocks", "reference",
           "gather", "BLOCK_SIZES", "MAX_SPLITS", "CANONICAL"]


def plan(spec: PagedAttentionSpec, config: PagedAttentionConfig | None = None, *,
         device: str | None = None, batch: int | None = None) -> PagedAttentionPlan:
    """``spec`` with ``config`` (default: the tuned one for ``batch``)."""
    if isinstance(spec, PagedAttentionPlan):
        return spec
    return PagedAttentionPlan(spec, config or select_config(spec, device, batch))


def build(spec, config: PagedAttentionConfig | None = None) -> ptxgen.Module:
    """PTX with the plan's ``split_name`` and ``combine_name`` kernels.

    split parameters: ``q, k_pool, v_pool, block_table: s32*, seq_lens:
    s32*, part_o, part_ml, out, q_stride: u32, max_blocks: u32, num_blocks:
    u32, sm_scale: f32``; combine parameters: ``part_o, part_ml, out,
    n_splits: u32``.
    """
    p = plan(spec, config)
    m = ptxgen.Module(p.target)
    build_split(m, p)
    build_combine(m, p)
    return m


def launch_geometry(plan: PagedAttentionPlan, batch: int, n_kv_heads: int, n_splits: int):
    """``(split,)`` or ``(split, combine)``: no combine for one split per
    sequence (the combine's ``n_splits`` is a geometry argument)."""
    if not 1 <= n_splits <= MAX_SPLITS:
        raise ValueError(f"n_splits must be in 1..{MAX_SPLITS}, got {n_splits}")
    if batch < 1 or n_kv_heads < 1:
        raise ValueError(f"batch and n_kv_heads must be positive, got {batch}, {n_kv_heads}")
    split = LaunchGeometry(plan.split_name, (n_splits, n_kv_heads, batch), 32 * plan.warps)
    if n_splits == 1:
        return (split,)
    return split, LaunchGeometry(plan.combine_name, batch * n_kv_heads * plan.group,
                                 32 * plan.combine_warps, args={"n_splits": n_splits})


CANONICAL = {
    # the 8B Llama shape (32 query / 8 KV heads of 128) in 16-token blocks
    "paged_attention": PagedAttentionPlan.make(),
    # the batched engine's: f16 out for the f16-X GEMM of the output projection
    "paged_attention_out_f16": PagedAttentionPlan.make(out_type="f16"),
    "paged_attention_d64_b64": PagedAttentionPlan.make(
        head_dim=64, group=3, block_size=64, warps=4, unroll=2, l2_prefetch=False,
        l1_bypass=False, combine_warps=1),
}

registry.register("paged_attention", PagedAttentionPlan, build, CANONICAL,
                  doc=__doc__.splitlines()[0], launch_geometry=launch_geometry)
