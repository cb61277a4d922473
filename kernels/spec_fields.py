"""Spec fields every kernel family shares: the target and the block size."""

from __future__ import annotations

import attrs

from ptxgen.target import TARGETS

__all__ = ["target_field", "block_field", "check_block"]


def check_block(_, attr, v):
    """A block size must be a multiple of 32 threads, 32..1024."""
    if not (isinstance(v, int) and 32 <= v <= 1024 and v % 32 == 0):
        raise ValueError(f"{attr.name} must be a multiple of 32 in 32..1024, got {v!r}")


def target_field(default: str = "sm_80"):
    """``target``: one of ptxgen's targets (``sm_80`` .. ``sm_90a``)."""
    return attrs.field(default=default, validator=attrs.validators.in_(tuple(TARGETS)))


def block_field(default: int = 256):
    """``block``: threads per block, a multiple of 32 in 32..1024."""
    return attrs.field(default=default, validator=check_block)
