"""The flash-decode config selector (``kernels/tuning/flash_decode.json``),
a caller's overrides merged onto it, and the split count of a fixed grid."""

from __future__ import annotations

import attrs

from ptxgen.target import TARGETS

from .. import tuning
from .spec import MAX_SPLITS, FlashDecodeConfig, FlashDecodePlan, FlashDecodeSpec

__all__ = ["select_config", "with_overrides", "resident_blocks", "choose_splits", "call_of"]

#: config fields only the tensor-core split reads
MMA_ONLY = ("interleave", "l2_prefetch", "l1_bypass", "bypass_from")


def call_of(spec: FlashDecodeSpec) -> dict:
    return {"head_dim": spec.head_dim, "group": spec.group, "kv_dtype": spec.kv_dtype,
            "early_kv": spec.early_kv, "sm": TARGETS[spec.target].sm, "target": spec.target}


def select_config(spec: FlashDecodeSpec, device: str | None = None) -> FlashDecodeConfig:
    """The tuned config for ``spec`` (an entry ``python -m ptxgen tune``
    stored for ``device`` first, then the shipped table)."""
    call = call_of(spec)
    stored = tuning.user_config("flash_decode", device, call)
    return FlashDecodeConfig(**(stored if stored is not None
                                else tuning.cascade("flash_decode", call)))


def with_overrides(spec: FlashDecodeSpec, given: dict, device: str | None = None
                   ) -> FlashDecodePlan:
    """The plan of the tuned config with the fields ``given`` replacing its
    own.  Asking for the CUDA-core split (``mma=False``) drops the tensor-
    core split's own fields, and ``l1_bypass=False`` drops ``bypass_from``,
    unless those are given too; a combination the kernels do not build is
    refused with the reason."""
    cfg = select_config(spec, device)
    defaults = attrs.fields_dict(FlashDecodeConfig)
    reset = {}
    if given.get("mma") is False:
        reset.update({f: defaults[f].default for f in MMA_ONLY})
    if given.get("l1_bypass") is False:
        reset["bypass_from"] = 0
    cfg = attrs.evolve(cfg, **{**{k: v for k, v in reset.items() if k not in given}, **given})
    return FlashDecodePlan(spec, cfg)


def resident_blocks(plan: FlashDecodePlan) -> int:
    """Split blocks one SM holds at once, estimated from the registers the
    CUDA 13 driver's JIT gave on an H100 (d = 128, group 4): the tensor-core
    split 167 / 228 at unroll 1 / 2, 186 / 249 with early_kv; the CUDA-core
    split 157 at unroll 3.  ``ops.flash_decode`` asks the driver instead."""
    if plan.mma:
        regs = min(256, 168 + 60 * (plan.unroll - 1) + (20 if plan.early_kv else 0))
    else:
        regs = -(-(130 + 10 * plan.unroll) // 8) * 8
    n = min(32 // plan.warps, 65536 // (regs * 32 * plan.warps))
    if plan.per_sm:
        n = min(n, plan.per_sm)
    return max(1, n)


def choose_splits(plan: FlashDecodePlan, sm_count: int, n_kv_heads: int, capacity: int,
                  blocks_per_sm: int | None = None) -> int:
    """Split count for a fixed grid: as many splits as fill ``blocks_per_sm``
    blocks on every SM in one wave (default :func:`resident_blocks`), never
    more than ``ceil(capacity / min_keys)``, nor more than ``MAX_SPLITS``."""
    if blocks_per_sm is None:
        blocks_per_sm = resident_blocks(plan)
    whole = sm_count * blocks_per_sm // n_kv_heads
    return max(1, min(whole, -(-capacity // plan.min_keys), MAX_SPLITS))
