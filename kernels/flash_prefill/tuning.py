"""The flash-prefill config selector (``kernels/tuning/flash_prefill.json``)."""

from __future__ import annotations

from ptxgen.target import TARGETS

from .. import tuning
from .spec import FlashPrefillConfig, FlashPrefillSpec

__all__ = ["select_config", "call_of"]


def call_of(spec: FlashPrefillSpec) -> dict:
    return {"head_dim": spec.head_dim, "group": spec.group, "sm": TARGETS[spec.target].sm,
            "target": spec.target}


def select_config(spec: FlashPrefillSpec, device: str | None = None) -> FlashPrefillConfig:
    """The tuned config for ``spec`` (an entry ``python -m ptxgen tune``
    stored for ``device`` first, then the shipped table)."""
    call = call_of(spec)
    stored = tuning.user_config("flash_prefill", device, call)
    return FlashPrefillConfig(**(stored if stored is not None
                                 else tuning.cascade("flash_prefill", call)))
