"""The GEMM config selector: the rules of ``kernels/tuning/gemm.json``,
keyed by qtype, x_type, epilogue, K, M, T and the device's sm."""

from __future__ import annotations

from ptxgen.target import TARGETS

from .. import tuning
from .spec import GemmConfig, GemmSpec

__all__ = ["select_config", "call_of"]


def call_of(spec: GemmSpec, m: int | None, t: int | None) -> dict:
    """The keys a tuning rule may test for ``spec`` at ``m`` rows and ``t``
    tokens (either may be unknown: None)."""
    return {"qtype": spec.qtype, "x_type": spec.x_type, "epilogue": spec.epilogue,
            "k": spec.k, "m": m, "t": t, "sm": TARGETS[spec.target].sm,
            "target": spec.target}


def select_config(spec: GemmSpec, m: int | None = None, t: int | None = None,
                  device: str | None = None) -> GemmConfig:
    """The config for ``spec`` at ``m`` weight rows and ``t`` tokens (when
    known); an entry stored by ``python -m ptxgen tune`` for ``device`` wins
    over the shipped table."""
    call = call_of(spec, m, t)
    stored = tuning.user_config("gemm", device, call)
    if stored is not None:
        return GemmConfig(**stored)
    return GemmConfig(**tuning.cascade("gemm", call))
