"""Quantized GEMV ``y = W x`` (Q4_K, Q6_K, Q8_0) with optional fused epilogues.

``W`` is ``[M, K]`` in GGUF byte layout (``uint8 [M, row_bytes]``, rows of
blocks), ``x`` and ``y`` float32.  Epilogues: ``residual`` (``y = W x + r``),
``swiglu`` (``y = silu(Wg x) * (Wu x)``, one kernel reading both
matrices) and ``rope`` (the decode step's stacked Q/K/V projection with
RoPE on q and k and the K/V-cache append, ``GemvSpec.rope``).  K is a spec
field (a multiple of the block size, else ValueError); M is a launch
argument and arbitrary (with ``rope``, the heads' row count).

Q4_K: :mod:`gemv_q4k` (x in registers, 16-byte weight loads), or with
``stages`` :mod:`gemv_stream` (weights through a ``cp.async`` ring in
shared memory; also Q6_K/Q8_0 where a tile is the whole row).  Q6_K, Q8_0:
:mod:`gemv_staged` (tiles staged through shared memory).  Design notes and
measurements: docs/gemv.md.

Launch: ``grid, block, shared, rpc = launch_geometry(spec, M)``; arguments
``(w[, wu], x[, nw, eps][, r | freqs, pos_ptr, k_cache, v_cache, capacity],
y, M, rpc)``.
"""

from __future__ import annotations

import math

import attrs

import ptxgen
from ptxgen import registry

from .gemv_common import (EPILOGUES, MAX_RING_BYTES, QTYPE_INFO, GemvSpec, check_k,
                          groups_per_cta, launch_geometry, reference, rope_reference,
                          threads)
from .gemv_q4k import build_q4k
from .gemv_staged import build_staged
from .gemv_stream import build_stream
from .spec_fields import has_bulk_copy

__all__ = ["GemvSpec", "build", "launch_geometry", "reference", "rope_reference", "default_spec",
           "check_k", "threads", "QTYPE_INFO", "EPILOGUES", "CANONICAL"]


def build(spec: GemvSpec) -> ptxgen.Module:
    """The PTX module (one kernel, ``spec.kernel_name``) for ``spec``."""
    if spec.stages:
        return build_stream(spec)
    if spec.qtype == "Q4_K":
        return build_q4k(spec)
    return build_staged(spec)


#: tuned knobs (sweep on H100 80GB HBM3, 2026-11-22; docs/gemv.md); the same
#: for every target until other devices are measured
_DEFAULTS = {
    "Q4_K": dict(rows=8, max_ctas=2112, prefetch=False, early=True),
    "Q6_K": dict(rows=2, tile=2048, max_ctas=2112),
    "Q8_0": dict(rows=8, tile=2048, max_ctas=2112),
}


#: Q4_K calls with at most this many rows use rows=4 (K <= 8192, not swiglu)
_Q4K_SMALL_M = 2048
#: Q4_K calls with at least this many rows (K <= 4096, not swiglu) take the
#: "large" ring knobs below
_Q4K_STREAM_M = 32768
#: Q4_K calls with rows in this range (K <= 4096, not swiglu or rope) take the
#: "tall" ring knobs below
_Q4K_TALL_M = range(8192, 16384)
#: Q4_K by default: weights through the cp.async ring, products by dp4a
#: against int8 planes of x (H100 sweeps, PDL on, docs/gemv.md "Seventh
#: pass"; against the direct fma kernel): 1024x4096 3.64 -> 3.51 us,
#: 6144x4096 8.16 -> 7.94, 14336x4096 15.9 -> 12.9, 128256x4096 110.7 -> 99.0,
#: 4096x14336 17.4 -> 14.4, gate/up SwiGLU 14336x4096 32.4 -> 23.2;
#: the four-GEMV layer chain 65.0 -> 52.9 us.  ``max_ctas`` fills the 132 SMs of
#: an H100 (3 CTAs per SM of 128 threads for "mid", 2 of 448 threads at K=14336,
#: 1 where two would leave fewer than 72 registers a thread: "wider_k").
#: ``ahead=1`` where a CTA's whole share of rows would otherwise go out
#: before the PDL wait (at most ``stages - 1`` row groups): one group before
#: it, the others after x (decode step 2.368 -> 2.270 ms at context 128;
#: docs/gemv.md "Ninth pass"); with more groups per CTA the full prologue
#: stays (14336x4096 alone: 13.4 us, 14.4 with ahead=1).  "rope": the stacked
#: Q/K/V GEMV with the RoPE epilogue and the attention RMSNorm folded in (the
#: decode step's default) is faster with 3 stages than with 4: 2.065-2.069 ->
#: 2.049-2.053 ms per token at context 128, 2.238-2.241 -> 2.215-2.219 at 4096
#: (H100, two calls, docs/gemv.md "Fourteenth pass"); 3 stages for the O
#: projection were level.  "tall": fewer CTAs with more row groups each at
#: 8192 <= M < 16384, alone (H100, 4 rounds, one call; 396 -> 330 max CTAs):
#: 8192x4096 9.53-9.61 -> 8.41-8.48 us, 11008 10.84-10.87 -> 10.30-10.34,
#: 12288 12.54-12.64 -> 11.07-11.09, 14336 12.79-12.85 -> 12.48-12.54; at
#: 16384 and more rows the 396 CTAs win (14.02-14.11 against 14.29-14.33)
#: (docs/gemv.md "Fifteenth pass")
_Q4K_STREAM = {"small": dict(rows=2, stages=4, max_ctas=1056),
               "mid": dict(rows=8, stages=4, max_ctas=396),
               "tall": dict(rows=8, stages=4, max_ctas=330),
               "rope": dict(rows=8, stages=3, max_ctas=396),
               "large": dict(rows=16, stages=3, max_ctas=264),
               "wide_k": dict(rows=4, stages=2, max_ctas=264, min_ctas=2),
               "wider_k": dict(rows=8, stages=2, max_ctas=132),
               "swiglu": dict(rows=4, stages=2, max_ctas=528)}


def _ring_ctas_per_sm(k: int) -> int:
    """CTAs of the K > 4096 Q4_K ring (``k // 32`` threads at the 72
    registers it needs) that fit an SM's 65536 registers."""
    return 65536 // ((k // 32) * 72)


def _free_slots(knobs: dict, m: int) -> None:
    """Two CTAs an SM of the K > 8192 ring (``max_ctas`` 264, no room for a
    third) where the round-robin deal would fill all but a few slots with 3
    row groups each: one group more per CTA instead, so that the next
    launch's CTAs find free slots and issue their first copies early (H100,
    3 rounds, µs): 3072x14336 11.20-11.33 -> 10.63-10.74 (256 -> 192 CTAs),
    3072x12288 9.96-10.15 -> 9.40-9.52.  With 4 groups a CTA it paid while
    the dp4a dot's split of x was long (4096x14336 13.55-13.97 -> 13.26-13.66
    at 205 CTAs), and lost once the split was cheap (12.75-12.91 at 256 CTAs
    against 13.03-13.19; also 4096x12288 and 4096x11008, by 0.3-0.45): what
    the free slots buy is the next launch's prologue landing before the
    wait, and what they cost is parallelism after it.  Where the deal leaves
    slots free already (3584 rows: 224 CTAs, 4608: 231), has 5 or more
    groups (5120, 8192 rows) or 2 (2048), fewer CTAs were slower by 0.3-2.3
    µs, and with the residual epilogue by 0.7 at 4096x14336; with 3 CTAs an
    SM (K = 8192, 396 slots) by 1.5 (docs/gemv.md "Twenty-fourth pass",
    "Twenty-fifth pass")."""
    rows, slots = knobs["rows"], knobs["max_ctas"]
    g = groups_per_cta(m, rows, slots)
    if g == 3 and math.ceil(m / (g * rows)) > slots - 16:
        knobs["max_ctas"] = math.ceil(math.ceil(m / rows) / (g + 1))


def _q4k_ring(k: int, epilogue: str, m: int | None, target: str):
    """The ring knobs for a Q4_K call, or None where the direct kernel stays."""
    if epilogue == "swiglu":
        knobs = dict(_Q4K_STREAM["swiglu"]) if k <= 8192 else None
    elif k > 4096:
        # two CTAs per SM while `.minnctapersm 2` leaves each thread 72
        # registers (the ring needs 72 at K = 14336; the driver's JIT took 121
        # without the hint, one CTA of 448 threads per SM): decode step 2.193 ->
        # 2.178 ms at context 128 (docs/gemv.md, eleventh pass)
        wide = _ring_ctas_per_sm(k) >= 2
        knobs = dict(_Q4K_STREAM["wide_k" if wide else "wider_k"])
        bulk = has_bulk_copy(target)
        if wide and (epilogue == "none" or (epilogue == "residual" and bulk)):
            # a third stage: 4096x14336 alone 14.60-14.64 -> 14.09-14.13 us
            # (H100, 4 rounds, one call); with cp.async the decode step's down
            # projection (residual) kept two, 2.0495-2.053 against
            # 2.0686-2.0691 ms per token with three (docs/gemv.md "Fifteenth
            # pass").  On sm_90 the bulk copy engine fills the stages:
            # 4096x14336 14.19-14.21 -> 13.80-13.83 us, residual (2 stages)
            # 14.58-14.60 -> 13.96-14.10 with three; the step level with it
            # (2.0438-2.0451 against 2.0438-2.0485 ms at context 128) (H100, 3
            # rounds, two calls; docs/gemv.md "Nineteenth pass")
            knobs["stages"] = 3
            knobs["bulk"] = bulk
    elif m is not None and m <= _Q4K_SMALL_M:
        knobs = dict(_Q4K_STREAM["small"])
    elif m is not None and m >= _Q4K_STREAM_M:
        knobs = dict(_Q4K_STREAM["large"])
    elif m is not None and m in _Q4K_TALL_M and epilogue != "rope":
        knobs = dict(_Q4K_STREAM["tall"])
    else:
        knobs = dict(_Q4K_STREAM["rope" if epilogue == "rope" else "mid"])
    if knobs is None:
        return None
    # n_mats and row_bytes
    shape = GemvSpec("Q4_K", k, epilogue="swiglu" if epilogue == "swiglu" else "none")

    def ring_bytes():
        return knobs["stages"] * shape.n_mats * knobs["rows"] * shape.row_bytes

    while knobs["rows"] > 1 and ring_bytes() > MAX_RING_BYTES:
        knobs["rows"] //= 2
    if ring_bytes() > MAX_RING_BYTES:
        return None
    knobs["dot"] = "dp4a"
    if m is not None and epilogue == "none" and _ring_ctas_per_sm(k) == 2:
        _free_slots(knobs, m)
    if (m is not None and knobs["stages"] > 2
            and groups_per_cta(m, knobs["rows"], knobs["max_ctas"]) <= knobs["stages"] - 1):
        knobs["ahead"] = 1
    return knobs


def default_spec(qtype: str, k: int, epilogue: str = "none",
                 target: str = "sm_80", m: int | None = None, **overrides) -> GemvSpec:
    """The spec with the default tuning knobs for ``qtype`` on ``target``
    (``m``, the row count of the call when known, picks Q4_K's ``rows``).

    Raises
    ------
    ValueError
        Unknown qtype/epilogue, or ``k`` not a multiple of the block size.
    """
    qtype = qtype.upper() if isinstance(qtype, str) else qtype
    check_k(qtype, k)
    knobs = dict(_DEFAULTS[qtype])
    if epilogue == "swiglu":
        # two matrices' loads in flight: fewer rows (Q4_K at K > 8192 has 448+
        # threads and spills at rows=2)
        knobs["rows"] = {"Q4_K": 2 if k <= 8192 else 1, "Q6_K": 2, "Q8_0": 4}[qtype]
        knobs.pop("early", None)    # not measured with two matrices
    elif qtype == "Q4_K" and k > 8192:
        # 448+ threads: 16 rows per group beat 8 at 4096x14336 (18.2 vs 21.3 us)
        knobs["rows"] = 16
    elif qtype == "Q4_K":
        # the driver's JIT gives rows=8 111 registers (local ptxas: 72); capping it
        # at 5 CTAs/SM (93) measured 6.95 -> 6.68 us at 4096x4096, 16.68 -> 16.25
        # at 14336x4096 (docs/gemv.md)
        # (measured at K=4096, 128 threads; at K=8192, 256 threads, it would spill)
        if k <= 4096:
            knobs["min_ctas"] = 5
        if m is not None and m <= _Q4K_SMALL_M:
            # few rows: more, smaller CTAs (1024x4096: 3.54 vs 4.05 us at rows=8)
            knobs["rows"] = 4
        elif m is not None and m <= 8192 and k <= 4096:
            # two slices share x in shared memory (H100, PDL on: 4096x4096 6.78 ->
            # 5.37 us, 6144x4096 8.76 -> 7.91; 14336x4096 and the SwiGLU kernel
            # were slower with slices, docs/gemv.md)
            knobs.update(slices=2, min_ctas=2)
    ring = (_q4k_ring(k, epilogue, m, target) if qtype == "Q4_K" and _stream_allowed(overrides)
            else None)
    if ring is not None:
        # weights through a cp.async ring, dp4a against int8 planes of x:
        # faster at every shape measured, alone and in the layer's chain
        knobs.pop("min_ctas", None)
        knobs.pop("slices", None)
        knobs.update(ring)
    if (qtype in _STAGED_STREAM and k <= 4096 and k % _STAGED_STREAM[qtype][0] == 0
            and _stream_allowed(overrides)):
        # the ring beat tile-by-tile staging at every M measured with K=4096
        # (H100, docs/gemv.md fifth pass): Q6_K 128256x4096 217.8 -> 150.1 us,
        # Q8_0 251.0 -> 187.5 us; 14336x4096 and 4096x4096 as well; SwiGLU
        # 14336x4096: Q6_K 51.0 -> 38.6 us, Q8_0 59.3 -> 45.1 us
        knobs.update(_STAGED_STREAM[qtype][2 if epilogue == "swiglu" else 1], tile=k)
        if (qtype == "Q6_K" and epilogue == "none" and m is not None and m in _Q6K_BULK_M
                and has_bulk_copy(target)):
            # the bulk copy engine fills the stages (H100, 3 rounds, two calls):
            # 14336x4096 18.74-18.89 -> 18.12-18.27 us, 28672 36.29-36.40 ->
            # 35.13-35.17; slower at 8192 (12.42-12.48 -> 12.61-12.68) and
            # 128256 rows (150 -> 170), level at 4096 and for SwiGLU
            # (docs/gemv.md "Nineteenth pass")
            knobs["bulk"] = True
        if qtype == "Q6_K" and m is not None and m in _Q6K_TWO_PIECES_M:
            # two pieces a thread (128 threads): 2048x4096 5.33 -> 4.78 us,
            # 4096 8.45 -> 7.96, 8192 13.16 -> 12.55, 14336 19.85-19.96 ->
            # 19.00-19.06, SwiGLU 14336x4096 39.6-39.8 -> 36.2-36.4; level at
            # 28672 rows, slower at 1024 (3.04 -> 3.17) and from 32768 (128256:
            # 150.1 -> 161.1) (H100, 3 rounds; docs/gemv.md "Sixteenth pass")
            knobs["pieces"] = 2
    elif (qtype == "Q6_K" and 12288 <= k <= 16384 and k % 2048 == 0 and epilogue != "swiglu"
          and _stream_allowed(overrides)):
        # two CTAs of K/32 threads per SM (two pieces a thread), two 4-row
        # stages: 4096x14336 21.14-21.59 -> 20.08-20.22 us, with the residual
        # epilogue 21.46-21.56 -> 20.18-20.32 (H100, 3 rounds; one CTA of K/16
        # threads with 8-row stages before; docs/gemv.md "Sixteenth pass")
        knobs.update(_Q6K_WIDE_RING, tile=k)
    elif (qtype == "Q8_0" and 12288 <= k <= 16384 and k % 256 == 0 and epilogue != "swiglu"
          and _stream_allowed(overrides)):
        # through the ring, 8 pieces (64 weights) a thread, so two CTAs of
        # K/64 threads share an SM: 4096x14336 28.0-28.2 -> 22.3-22.6 us,
        # residual 28.1-28.2 -> 23.6 (H100, 3 rounds; tiles of 1024 before;
        # docs/gemv.md "Sixteenth pass")
        knobs.update(_Q8_WIDE_RING, tile=k)
    elif qtype == "Q8_0" and k > 4096 and epilogue != "swiglu":
        # tiles of 1024 weights (128 threads): 4096x14336 29.04-29.30 ->
        # 27.79-27.86 us (H100, one call; 4 rows or 2: 30.4-33.6)
        knobs["tile"] = 1024
    if overrides.get("slices", 1) > 1 and "min_ctas" not in overrides:
        # the min_ctas defaults were measured for one slice of 128 threads
        knobs.pop("min_ctas", None)
    if knobs.get("stages") and not (qtype == "Q4_K" and (
            (m is not None and m <= _Q4K_SMALL_M) or (epilogue == "residual" and k > 4096))):
        # row groups dealt round robin over the CTAs (H100, 3 rounds, one
        # call each; docs/gemv.md "Twentieth pass"): Q4_K 4096x14336
        # 13.73-13.77 -> 13.60-13.64 us, 14336x4096 12.49-12.53 -> 12.23-12.35,
        # 4096x4096 5.68-5.75 -> 5.54-5.55 (residual 5.96-6.07 -> 5.85-5.88),
        # 128256x4096 99.4-99.6 -> 98.3, SwiGLU 14336x4096 25.7-25.8 ->
        # 25.5; Q6_K 4096x14336 20.07-20.11 -> 19.69-19.75, 14336x4096
        # 18.07-18.11 -> 17.81-17.85, 128256x4096 149.2-149.4 -> 146.0-146.1;
        # Q8_0 4096x14336 22.08-22.10 -> 21.56-21.60, 14336x4096 21.52-21.53 ->
        # 21.04-21.15; level at Q6_K/Q8_0 4096x4096.  Slower, so not taken:
        # Q4_K 1024x4096 (4.30-4.35 -> 4.78-4.85) and the residual at K =
        # 14336 (13.94-14.17 -> 14.63-14.93).  Decode step (Q4_K GEMVs but the
        # down projection): 2.0435-2.0472 -> 2.0269-2.0289 ms at context 128
        knobs["interleave"] = True
    if epilogue == "rope" and knobs["rows"] % 2:
        # the rope epilogue rotates row pairs inside a row group
        knobs["rows"] *= 2
    knobs.update(overrides)
    return GemvSpec(qtype, k, epilogue=epilogue, target=target, **knobs)


#: Q6_K/Q8_0 through the ring: (K multiple giving 16-byte rows, knobs, SwiGLU
#: knobs); the tile is the whole row.  Q8_0 with two pieces a thread (256
#: threads at K = 4096): 14336x4096 23.78-23.88 -> 21.65-21.80 us, 4096x4096
#: 9.18-9.21 -> 8.94-9.01, 1024x4096 3.46-3.48 -> 3.41-3.42, SwiGLU
#: 14336x4096 45.4-45.5 -> 41.9-42.0, 128256x4096 level (187.8-188.0 ->
#: 187.0-187.6) (H100, 3 rounds; docs/gemv.md "Sixteenth pass").  Q6_K SwiGLU
#: with the dp4a dot (H100, 3 rounds): 4096x4096 12.82-12.88 -> 12.51-12.57 us,
#: 14336x4096 34.55-34.83 -> 34.10-34.18, 28672x4096 74.6-75.1 -> 66.5-66.9;
#: without an epilogue at K = 4096 the dp4a dot was slower at 1024-8192 and
#: 28672-128256 rows (4096x4096 7.82-7.98 -> 8.36-8.40) and faster only at
#: 14336 (17.81-17.92 -> 17.59-17.63), so it stays "fma" there
#: (docs/gemv.md "Twenty-fifth pass")
_STAGED_STREAM = {"Q6_K": (2048, dict(rows=4, stages=4, max_ctas=528),
                           dict(rows=4, stages=3, max_ctas=264, dot="dp4a")),
                  "Q8_0": (256, dict(rows=4, stages=4, max_ctas=396, pieces=2),
                           dict(rows=4, stages=3, max_ctas=264, pieces=2))}
#: Q6_K calls at K = 4096 with this many rows take two pieces a thread
_Q6K_TWO_PIECES_M = range(2048, 28672)
#: Q6_K calls at K = 4096 (no epilogue) with this many rows fill the ring with
#: the bulk copy engine on sm_90 (measured at 14336 and 28672; 8192 slower)
_Q6K_BULK_M = range(14336, 32768)
#: Q6_K through the ring at 12288 <= K <= 16384 (two CTAs of K/32 threads per SM).
#: The dp4a dot (H100, 3 rounds, two calls; docs/gemv.md "Twenty-fifth pass"):
#: 4096x14336 19.69-20.02 -> 18.83-19.05 us, residual 20.53-20.63 -> 19.87,
#: 4096x12288 17.00-17.09 -> 16.34-16.42, 2048x16384 15.23-15.28 -> 11.63-11.82
_Q6K_WIDE_RING = dict(rows=4, stages=2, max_ctas=264, min_ctas=2, pieces=2, dot="dp4a")
#: Q8_0 through the ring at 12288 <= K <= 16384 (two CTAs of K/64 threads per SM)
_Q8_WIDE_RING = dict(rows=1, stages=4, max_ctas=264, pieces=8)


def _stream_allowed(overrides) -> bool:
    """Whether the overrides leave room for the stages ring (it is built for
    x in registers, one slice, no prefetch/stage; ``stages=0`` asks for
    the direct kernel)."""
    return (overrides.get("stages") != 0 and overrides.get("slices", 1) == 1
            and overrides.get("xmode", "reg") == "reg"
            and not any(overrides.get(f) for f in ("prefetch", "stage")))


CANONICAL = {
    "gemv_q4_k": GemvSpec("Q4_K", 512),
    "gemv_q6_k_swiglu": GemvSpec("Q6_K", 512, epilogue="swiglu"),
    "gemv_q8_0_residual": GemvSpec("Q8_0", 256, epilogue="residual"),
    "gemv_q4_k_stream": GemvSpec("Q4_K", 512, rows=2, stages=3),
    "gemv_q8_0_ring": GemvSpec("Q8_0", 768, rows=2, stages=3, tile=768, pieces=2),
    "gemv_q6_k_dp4a": GemvSpec("Q6_K", 2048, rows=2, stages=2, tile=2048, pieces=2, dot="dp4a"),
    "gemv_q4_k_bulk": GemvSpec("Q4_K", 512, rows=2, stages=3, dot="dp4a", bulk=True,
                               target="sm_90"),
    "gemv_q4_k_rope": GemvSpec("Q4_K", 512, epilogue="rope", rope=(64, 4, 2), rows=4, stages=3,
                               dot="dp4a"),
}

registry.register("gemv", GemvSpec, build, CANONICAL, doc=__doc__.splitlines()[0])

_ = attrs
