"""Quantized GEMM ``Y[T, M] = X[T, K] . W[M, K]^T`` on tensor cores (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0, F16, BF16).

``W`` is ``[M, K]`` in GGUF byte layout (``uint8 [M, row_bytes]``), ``X``
f32 or f16 ``[T, K]`` row-major, ``Y`` f32 ``[T, M]``; epilogues ``none``
and ``residual`` (``Y = X W^T + R``).  K is a spec field; M and T are launch
arguments (T by value, or read from device memory with ``t_device`` so one
captured launch serves any T up to the one it was sized for).

What is computed is a :class:`GemmSpec`; how it runs a :class:`GemmConfig`
from the per-device table ``kernels/tuning/gemm.json``
(:func:`select_config`).  Two kernels (``GemmConfig.kernel``): ``mma``
(:mod:`.kernel`), a ``cp.async`` ring of raw weight bytes and f16 X tiles,
the blocks decoded straight into ``mma.sync.m16n8k16`` A fragments (f16,
f32 accumulation) by the format's decoder (:mod:`.q4k`, :mod:`.q6k`,
:mod:`.q8_0`); and on sm_90a for Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0, F16 and BF16 ``wgmma`` (:mod:`.wgmma_q4k`,
:mod:`.wgmma_q6k`, :mod:`.wgmma_blocks32`, :mod:`.wgmma_f16`),
warpgroups running ``wgmma.m64nNk16`` with the decoded weights as A in
registers and X brought by TMA into swizzled shared memory.  Design, counts and accuracy:
docs/notes/gemm.md.

Launch: ``launch_geometry(plan, M, T_max)``; parameters ``w, x[, r], y, m,
t | t_ptr``, with ``split_k > 1`` a workspace ``ws`` and counters
``counters`` (sizes from :func:`split_scratch`), and, where :func:`x_map`
gives one, the tensor map of X, ``xmap``.
"""

from __future__ import annotations

import ptxgen
from ptxgen import registry

from ..quants.qtypes import QTYPES
from . import q4k, q6k, q8_0
from .kernel import build_gemm, launch_geometry, split_scratch
from .reference import reference
from .spec import (EPILOGUES, GEMM_QTYPES, KERNELS, MAX_SHARED, MMA_QTYPES, WGMMA_QTYPES,
                   X_TYPES, GemmConfig, GemmPlan, GemmSpec)
from .tuning import select_config
from .wgmma_q4k import Q4KFormat, Q5KFormat, build_wgmma, x_tensor_map
from .wgmma_q6k import Q6KFormat
from .wgmma_blocks32 import Q40Format, Q50Format, Q80Format
from .wgmma_f16 import BF16Format, F16Format

__all__ = ["GemmSpec", "GemmConfig", "GemmPlan", "build", "plan", "default_plan",
           "select_config", "launch_geometry", "reference", "GEMM_QTYPES", "X_TYPES", "EPILOGUES",
           "MAX_SHARED", "KERNELS", "WGMMA_QTYPES", "MMA_QTYPES", "CANONICAL", "FORMATS", "x_map",
           "supported", "split_scratch"]


def plan(spec, config: GemmConfig | None = None, *, m: int | None = None,
         t: int | None = None, device: str | None = None) -> GemmPlan:
    """``spec`` with ``config`` (default: :func:`select_config` for ``m``
    rows and ``t`` tokens), checked together."""
    if isinstance(spec, GemmPlan):
        return spec
    return GemmPlan(spec, config or select_config(spec, m, t, device))


def default_plan(qtype: str, k: int, *, x_type: str = "f32", epilogue: str = "none",
                 t_device: bool = False, target: str = "sm_80", pdl: bool = False,
                 y_stride: int = 0, m: int | None = None, t: int | None = None,
                 device: str | None = None,
                 **config) -> GemmPlan:
    """The plan of the tuned config for a call; ``config`` fields given here
    replace the table's."""
    import attrs
    spec = GemmSpec(qtype, k, x_type=x_type, epilogue=epilogue, t_device=t_device,
                    target=target, pdl=pdl, y_stride=y_stride)
    cfg = select_config(spec, m, t, device)
    return GemmPlan(spec, attrs.evolve(cfg, **config) if config else cfg)


def build(spec, config: GemmConfig | None = None) -> ptxgen.Module:
    """The PTX module (one kernel, ``plan.kernel_name``) of ``spec`` (a
    :class:`GemmSpec` with ``config``, default the table's, or a
    :class:`GemmPlan`)."""
    p = plan(spec, config)
    if p.config.kernel == "wgmma":
        return build_wgmma(p, WGMMA_FORMATS[p.qtype])
    return build_gemm(p, FORMATS[p.qtype])


def x_map(plan, x_address: int, t_rows: int):
    """The tensor map (:class:`ptxgen.tensor_map.TensorMap`) the kernel of
    ``plan`` takes as its last argument for X at device address
    ``x_address`` with ``t_rows`` rows, or None where it takes none (the
    ``mma`` kernels read X through its pointer)."""
    return x_tensor_map(plan, x_address, t_rows) if plan.config.kernel == "wgmma" else None


#: qtype -> the warpgroup kernel's weight format
WGMMA_FORMATS = {"Q4_K": Q4KFormat, "Q6_K": Q6KFormat, "Q8_0": Q80Format, "Q4_0": Q40Format,
                 "Q5_0": Q50Format, "Q5_K": Q5KFormat, "F16": F16Format, "BF16": BF16Format}


def supported(qtype: str, k: int, target: str) -> bool:
    """Whether a GEMM of ``qtype`` weights with rows of ``k`` (f16 X) can be
    built for ``target`` (the family's own target, e.g. sm_90a on an H100:
    ``ops_gemm.gemm_target``): the mma.sync types anywhere, the others
    only on the sm_90a warpgroup kernel, with K whole super-blocks of 256."""
    if qtype not in GEMM_QTYPES or k % QTYPES[qtype].block_size:
        return False
    return qtype in MMA_QTYPES or (target == "sm_90a" and k % 256 == 0)

#: qtype -> the format module's stage copies, scales and fragment decoder
FORMATS = {"Q4_K": q4k.FORMAT, "Q6_K": q6k.FORMAT, "Q8_0": q8_0.FORMAT}


def _canon(k, qtype="Q4_K", **fields):
    return GemmPlan.make(qtype, k, **fields)


CANONICAL = {
    "gemm_q4_k": _canon(512, bm=64, bn=32, warps_m=2, warps_n=2, stages=3),
    "gemm_q4_k_f16_residual": _canon(4096, x_type="f16", epilogue="residual", t_device=True,
                                     target="sm_90"),
    "gemm_wg_q4_k_f16_residual": _canon(1024, x_type="f16", epilogue="residual", t_device=True,
                                        target="sm_90a", pdl=True, kernel="wgmma", bm=128,
                                        bn=128, bk=64, stages=4),
    "gemm_q6_k": _canon(512, "Q6_K", bm=64, bn=32, bk=128, warps_m=2, warps_n=2, stages=3),
    "gemm_q8_0_f16_residual": _canon(1024, "Q8_0", x_type="f16", epilogue="residual",
                                     t_device=True, target="sm_90", bm=128, bn=128, bk=64,
                                     warps_m=2, warps_n=4, stages=4),
}

registry.register("gemm", GemmPlan, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
