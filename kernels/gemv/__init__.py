"""GEMV ``y = W x`` of GGUF weights (K-quants, Q4_0 ... Q8_0, F16, BF16) with fused epilogues.

``W`` is ``[M, K]`` in GGUF byte layout (``uint8 [M, row_bytes]``, rows of
blocks), ``x`` and ``y`` float32.  Epilogues: ``residual`` (``y = W x + r``),
``swiglu`` (``y = silu(Wg x) * (Wu x)``, one kernel reading both
matrices), ``geglu`` (the same with GELU's tanh form) and ``rope`` (the
decode step's stacked Q/K/V projection with RoPE on q and k and the K/V-cache
append, optionally after a bias add, in the interleaved or the NeoX
layout; the cache contiguous or paged: ``paged``).  K is a spec field; M is a launch argument and arbitrary.

What is computed is a :class:`GemvSpec`; how it runs is a :class:`GemvConfig`
chosen by :func:`select_config` from the per-device tuning table
(``kernels/tuning/gemv.json``).  Kernel bodies: :mod:`.q4k` (Q4_K, x and
weights in registers), :mod:`.staged` (every other format tile by tile
through shared memory), :mod:`.ring` (every format through a ``cp.async``
ring of row-group stages; the tuned choice almost everywhere), :mod:`.batched`
(``GemvSpec(batch=B)``: B rows of x against each weight read once, Q4_K,
Q6_K and Q8_0, configs from ``kernels/tuning/gemv_batch.json`` by
:func:`batch_plan`).  The other
formats' piece decoders: :mod:`.staged` (Q6_K, Q8_0), :mod:`.legacy` (Q4_0,
Q4_1, Q5_0, Q5_1), :mod:`.q5k` (Q5_K), :mod:`.floats` (F16, BF16).
Measurements: docs/notes/gemv.md.

Launch: ``launch_geometry(plan, M)`` (a :class:`~ptxgen.kernels.plan.LaunchGeometry`
that brings the argument ``rpc``); parameters ``w[, wu], x[, nw, eps][, r |
[bias,] freqs, pos_ptr, k_cache, v_cache, capacity], y, m, rpc`` (``paged``:
``freqs, pos_ptr, slots, k_pool, v_pool, n_slots``).
"""

from __future__ import annotations

import ptxgen
from ptxgen import registry

from .common import declare_params
from .batched import build_batched
from .layout import launch_geometry, threads
from .q4k import build_q4k
from .reference import reference, rope_reference
from .ring import build_ring
from .spec import (BATCH_QTYPES, EPILOGUES, GEMV_QTYPES, MAX_BATCH, MAX_RING_BYTES, GemvConfig,
                   GemvPlan, GemvSpec, check_k, neox_pair_rows, read_unit)
from .staged import build_staged
from .tuning import (balanced, batch_config, batch_crossover, candidate_configs, crossover_call,
                     select_config)

__all__ = ["GemvSpec", "GemvConfig", "GemvPlan", "build", "plan", "default_plan",
           "select_config", "candidate_configs", "launch_geometry", "reference",
           "rope_reference", "check_k", "read_unit", "threads", "GEMV_QTYPES",
           "EPILOGUES", "MAX_RING_BYTES", "CANONICAL", "neox_pair_rows", "batch_plan",
           "batch_crossover", "crossover_call", "MAX_BATCH", "BATCH_QTYPES"]


def plan(spec: GemvSpec, config: GemvConfig | None = None, *, m: int | None = None,
         sm_count: int | None = None, device: str | None = None) -> GemvPlan:
    """``spec`` with ``config`` (default: :func:`select_config` for ``m``
    rows on ``sm_count`` SMs of ``device``), checked together."""
    if isinstance(spec, GemvPlan):
        return spec
    return GemvPlan(spec, config or select_config(spec, m, sm_count, device))


def default_plan(qtype: str, k: int, epilogue: str = "none", *, target: str = "sm_80",
                 m: int | None = None, sm_count: int | None = None, norm: bool = False,
                 rope: tuple = (), bias: bool = False, rope_layout: str = "interleaved",
                 paged: int = 0, pdl: bool = False, device: str | None = None,
                 norm_out: bool = False,
                 **config) -> GemvPlan:
    """The plan of the tuned config for a call; ``config`` fields given here
    replace the table's (a combination the kernels do not build is refused)."""
    import attrs
    spec = GemvSpec(qtype.upper() if isinstance(qtype, str) else qtype, k, epilogue=epilogue,
                    norm=norm, rope=rope, bias=bias, rope_layout=rope_layout, paged=paged,
                    target=target, pdl=pdl, norm_out=norm_out)
    if not config:
        return GemvPlan(spec, select_config(spec, m, sm_count, device))
    cfg = select_config(spec, m)
    if config:
        if config.get("stages") == 0:
            # the direct kernel: the ring's fields go back to their defaults
            ring_only = {"ahead", "per_sm", "bulk", "interleave"}
            cfg = attrs.evolve(cfg, **{f: attrs.fields_dict(GemvConfig)[f].default
                                       for f in ring_only})
            cfg = attrs.evolve(cfg, dot="fma", pieces=0)
        cfg = attrs.evolve(cfg, **config)
    GemvPlan(spec, cfg)                     # refuse a combination before balancing
    return GemvPlan(spec, balanced(spec, cfg, m, sm_count))


def batch_plan(qtype: str, k: int, epilogue: str = "none", *, batch: int,
               target: str = "sm_80", m: int | None = None, sm_count: int | None = None,
               pdl: bool = False) -> GemvPlan:
    """The batched GEMV's plan (:mod:`.batched`) for ``batch`` rows of x
    (:func:`.tuning.batch_config`); ValueError where it is not built (the
    type, the epilogue, or x and the ring do not fit shared memory)."""
    spec = GemvSpec(qtype, k, epilogue=epilogue, target=target, pdl=pdl, batch=batch)
    return GemvPlan(spec, batch_config(spec, m, sm_count))


def build(spec, config: GemvConfig | None = None, *, params=declare_params,
          finish=None) -> ptxgen.Module:
    """The PTX module (one kernel, ``plan.kernel_name``) for ``spec`` (a
    :class:`GemvSpec` with ``config``, default the selected one, or a
    :class:`GemvPlan`).  ``params`` declares the kernel's parameters
    (:func:`.common.declare_params`, or a function with its signature and
    result that adds to it: the experts' GEMV, :mod:`ptxgen.kernels.moe`).
    ``finish(k, rows, tid)``, where given, ends the kernel after the CTA's
    last row group is stored; ``rows`` is ``(row0, row_end, step)``, the
    CTA's row groups as its loop visits them (not the batched GEMV)."""
    p = plan(spec, config)
    if p.batch > 1:
        if finish is not None:
            raise ValueError("the batched GEMV takes no finish")
        return build_batched(p)
    if p.stages:
        return build_ring(p, params, finish)
    if p.qtype == "Q4_K":
        return build_q4k(p, params, finish)
    return build_staged(p, params, finish)


def _canon(qtype, k, epilogue="none", rope=(), target="sm_80", bias=False,
           rope_layout="interleaved", batch=1, **config):
    return GemvPlan(GemvSpec(qtype, k, epilogue=epilogue, rope=rope, bias=bias,
                             rope_layout=rope_layout, target=target, batch=batch),
                    GemvConfig(**config))


CANONICAL = {
    "gemv_q4_k": _canon("Q4_K", 512),
    "gemv_q6_k_swiglu": _canon("Q6_K", 512, "swiglu"),
    "gemv_q8_0_residual": _canon("Q8_0", 256, "residual"),
    "gemv_q4_k_stream": _canon("Q4_K", 512, rows=2, stages=3),
    "gemv_q8_0_ring": _canon("Q8_0", 768, rows=2, stages=3, tile=768, pieces=2),
    "gemv_q6_k_dp4a": _canon("Q6_K", 2048, rows=2, stages=2, tile=2048, pieces=2, dot="dp4a"),
    "gemv_q4_k_bulk": _canon("Q4_K", 512, rows=2, stages=3, dot="dp4a", bulk=True,
                             target="sm_90"),
    "gemv_q4_k_rope": _canon("Q4_K", 512, "rope", rope=(64, 4, 2), rows=4, stages=3,
                             dot="dp4a"),
    "gemv_q4_0_dp4a": _canon("Q4_0", 512, rows=2, stages=3, tile=512, pieces=2, dot="dp4a"),
    "gemv_q4_1_swiglu": _canon("Q4_1", 256, "swiglu", rows=2),
    "gemv_q4_k_geglu": _canon("Q4_K", 512, "geglu", rows=2, stages=2, dot="dp4a"),
    "gemv_q5_0_residual": _canon("Q5_0", 96, "residual", rows=2),
    "gemv_q5_1_ring": _canon("Q5_1", 512, rows=2, stages=2, tile=512),
    "gemv_q5_k_dp4a": _canon("Q5_K", 512, "residual", rows=2, stages=3, tile=512, dot="dp4a"),
    "gemv_f16_swiglu": _canon("F16", 512, "swiglu", rows=2, stages=3, tile=512, pieces=2),
    "gemv_bf16_rope": _canon("BF16", 256, "rope", rope=(32, 2, 1), rows=4, stages=3, tile=256),
    # Qwen2's decode step: the q/k/v biases added before the NeoX rotation
    "gemv_q4_k_rope_bias": _canon("Q4_K", 512, "rope", rope=(64, 4, 2), bias=True,
                                  rope_layout="neox", rows=8, stages=3, dot="dp4a", ahead=1),
    # a decode step's q and k where v has another type: the norm folded, h stored for v's GEMV
    "gemv_q4_k_normh": GemvPlan(GemvSpec("Q4_K", 2048, norm=True, norm_out=True,
                                         target="sm_90"),
                                GemvConfig(rows=8, stages=4, ahead=1, dot="dp4a",
                                           interleave=True)),
    "gemv_q4_k_batch": _canon("Q4_K", 512, "residual", batch=4, rows=4, stages=3, dot="dp4a",
                              teams=2, kslices=2),
    "gemv_q6_k_batch_swiglu": _canon("Q6_K", 2048, "swiglu", batch=2, rows=1, stages=2,
                                     dot="dp4a"),
    "gemv_q8_0_batch_bias": _canon("Q8_0", 512, "bias", batch=3, rows=2, stages=2, dot="dp4a"),
}

registry.register("gemv", GemvPlan, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
