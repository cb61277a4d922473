"""Spec fields every kernel family shares: the target, the block size, and
programmatic dependent launch."""

from __future__ import annotations

import attrs

from ptxgen.isa import TABLE
from ptxgen.target import TARGETS

__all__ = ["target_field", "block_field", "check_block", "pdl_field", "pdl_prologue",
           "pdl_wait", "has_griddepcontrol", "has_bulk_copy"]


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


def has_griddepcontrol(target: str) -> bool:
    """Whether ``target`` has ``griddepcontrol`` (programmatic dependent
    launch): sm_90 and newer.  Where it does, the driver's entry points and
    the model launch with PDL unless told otherwise."""
    return TARGETS[target].sm >= 90


def has_bulk_copy(target: str) -> bool:
    """Whether ``target`` has the bulk copy engine (``cp.async.bulk`` onto
    an mbarrier; the instruction table's minimum, sm_90)."""
    return TARGETS[target].sm >= TABLE["cp.async.bulk"].min_sm


def _check_pdl(inst, attr, v):
    if not isinstance(v, bool):
        raise ValueError(f"{attr.name} must be a bool, got {v!r}")
    if v and not has_griddepcontrol(inst.target):
        raise ValueError(f"{attr.name}=True needs griddepcontrol (sm_90 or newer); "
                         f"target is {inst.target}")


def pdl_field():
    """``pdl``: built for programmatic dependent launch (sm_90+).

    The kernel waits for the grid before it (``griddepcontrol.wait``) before
    it reads anything earlier grids write, and right after the wait lets the
    next grid launch (``griddepcontrol.launch_dependents``); only reads of
    data no kernel writes (weights) may come before the wait.  Launch it with
    ``pdl=True`` (the executor does so for every spec with ``pdl=True``);
    launched without, the instructions cost nothing.

    Why the release comes after the wait: the next grid can then start only
    once every grid before this one has finished, so at most two grids share
    the GPU and nothing but this grid can leave lines in an SM's L1 after the
    next one starts.  Released on entry instead, a chain of grids can be
    resident at once; a block of grid N then sees L1 lines that grid N-2 read
    from a buffer which grid N-1 has since rewritten (the planner reuses
    buffers), and a model replayed from a CUDA graph computed wrong logits
    that way.
    """
    return attrs.field(default=False, validator=_check_pdl)


def pdl_wait(k, spec) -> None:
    """For ``spec.pdl`` kernels: wait for the previous grid, then let the next
    one launch (see :func:`pdl_field`).  Emits nothing otherwise."""
    if spec.pdl:
        k.griddep_wait()
        k.griddep_launch_dependents()


def pdl_prologue(k, spec, wait: bool = True) -> None:
    """Emit the PDL entry sequence for ``spec.pdl`` kernels.  With ``wait``,
    :func:`pdl_wait` here; without, the kernel calls :func:`pdl_wait` itself
    once the loads that may precede it (weights) are out."""
    if wait:
        pdl_wait(k, spec)
