"""The paged-attention config selector (``kernels/tuning/paged_attention.json``)
and the split count of a batch's fixed grid."""

from __future__ import annotations

from ptxgen.target import TARGETS

from .. import tuning
from .spec import MAX_SPLITS, PagedAttentionConfig, PagedAttentionPlan, PagedAttentionSpec

__all__ = ["select_config", "resident_blocks", "choose_splits", "call_of"]


def call_of(spec: PagedAttentionSpec, batch: int | None = None) -> dict:
    return {"head_dim": spec.head_dim, "group": spec.group, "block_size": spec.block_size,
            "batch": batch, "sm": TARGETS[spec.target].sm, "target": spec.target}


def select_config(spec: PagedAttentionSpec, device: str | None = None,
                  batch: int | None = None) -> PagedAttentionConfig:
    """The tuned config for ``spec`` at ``batch`` sequences (None: any; an
    entry ``python -m ptxgen tune`` stored for ``device`` first, then the
    shipped table)."""
    call = call_of(spec, batch)
    stored = tuning.user_config("paged_attention", device, call)
    return PagedAttentionConfig(**(stored if stored is not None
                                   else tuning.cascade("paged_attention", call)))


def resident_blocks(plan: PagedAttentionPlan) -> int:
    """Split blocks one SM holds at once, estimated as for flash decode's
    tensor-core split (about 168 registers at one chunk a trip, 60 more per
    further chunk, 20 more with ``early_kv``); the ops ask the driver instead."""
    regs = min(256, 168 + 60 * (plan.unroll - 1) + (20 if plan.early_kv else 0))
    return max(1, min(32 // plan.warps, 65536 // (regs * 32 * plan.warps)))


def choose_splits(plan: PagedAttentionPlan, sm_count: int, batch: int, n_kv_heads: int,
                  max_len: int, blocks_per_sm: int | None = None) -> int:
    """Splits per sequence for a fixed grid of ``batch`` sequences: as many
    as fill ``blocks_per_sm`` blocks on every SM in one wave (default
    :func:`resident_blocks`), never more than ``ceil(max_len / min_keys)``
    (``max_len``: the most keys a sequence may have), nor more than
    ``MAX_SPLITS``; 1 (no combine) once the batch alone fills the wave."""
    if blocks_per_sm is None:
        blocks_per_sm = resident_blocks(plan)
    whole = sm_count * blocks_per_sm // (batch * n_kv_heads)
    return max(1, min(whole, -(-max_len // plan.min_keys), MAX_SPLITS))
