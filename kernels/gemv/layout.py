"""GEMV launch layout: threads per CTA, pieces per thread, tiles and the
grid, as plain functions of a plan (no DSL); the kernel bodies, the spec's
checks and the selector all read them from here."""

from __future__ import annotations

import math

from ..plan import LaunchGeometry

__all__ = ["threads", "warp_threads", "groups_per_cta", "launch_geometry", "q4k_layout",
           "staged_layout", "pieces_per_row", "PIECES_PER_BLOCK", "BATCH_PIECES",
           "batch_layout"]


def threads(spec) -> int:
    """Threads per CTA."""
    if spec.batch > 1:
        return batch_layout(spec)["threads"]
    if spec.qtype == "Q4_K":
        return q4k_layout(spec)[1]
    return staged_layout(spec)["threads"]


def warp_threads(pieces: int, per_thread: int) -> int:
    """Threads for ``pieces`` pieces at ``per_thread`` a thread, rounded up
    to whole warps (at least one)."""
    return max(32, math.ceil(math.ceil(pieces / per_thread) / 32) * 32)


def groups_per_cta(m: int, unit: int, max_ctas: int) -> int:
    """Row groups of ``unit`` rows each CTA takes when ``m`` rows are dealt
    out over at most ``max_ctas`` CTAs (``launch_geometry``'s split)."""
    return math.ceil(math.ceil(m / unit) / max_ctas)


def launch_geometry(spec, m: int):
    """The launch for ``m`` rows (``shared``: :attr:`.GemvPlan.dynamic_shared`,
    the ``stages`` ring and any ``per_sm`` cap).

    Its argument ``rpc`` (rows per CTA) is the smallest multiple of
    ``spec.rows`` that keeps the grid within ``spec.max_ctas``.
    """
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"M must be a positive int, got {m!r}")
    if spec.stages and spec.batch == 1 and spec.qtype != "Q4_K" and (m * spec.row_bytes) % 16:
        raise ValueError(f"the ring copies 16-byte chunks up to the matrix's last one: {m} rows "
                         f"of {spec.row_bytes} bytes are not a whole number of them; use the "
                         "direct kernel (stages=0) for this M")
    unit = spec.rows
    rpc = groups_per_cta(m, unit, spec.max_ctas) * unit
    grid = math.ceil(m / rpc)
    return LaunchGeometry(spec.kernel_name, grid, threads(spec), spec.dynamic_shared,
                          {"rpc": rpc})


def q4k_layout(spec) -> tuple[int, int, int]:
    """``(pieces_per_thread, threads, total_pieces)`` for a Q4_K spec."""
    total = spec.k // 256 * 8
    ppt = spec.pieces or max(1, math.ceil(total / 1024))
    thr = warp_threads(total, ppt)
    if thr > 1024:
        raise ValueError(f"Q4_K K={spec.k}: {ppt} pieces per thread need {thr} threads "
                         f"(> 1024); raise pieces")
    return ppt, thr, total


PIECES_PER_BLOCK = {"Q6_K": 16, "Q8_0": 4, "Q4_0": 2, "Q4_1": 2, "Q5_0": 2, "Q5_1": 2,
                     "F16": 1, "BF16": 1, "Q5_K": 8}


def pieces_per_row(spec) -> int:
    """Pieces in a row of ``spec.k`` weights (the ring's tile)."""
    return spec.k // spec.block_weights * PIECES_PER_BLOCK[spec.qtype]


def staged_layout(spec) -> dict:
    """Tile geometry: blocks per tile, bytes, load width, threads."""
    nb = spec.k // spec.block_weights
    limit = max(1, spec.tile // spec.block_weights)
    tb = max(d for d in range(1, min(nb, limit) + 1) if nb % d == 0)
    tile_bytes = tb * spec.block_bytes
    align = math.gcd(spec.row_bytes, tile_bytes)
    lw = next(w for w in (16, 8, 4, 2) if align % w == 0)
    pieces = tb * PIECES_PER_BLOCK[spec.qtype]
    # pieces per thread: more than one only through the ring (.ring)
    ppt = spec.pieces or 1
    thr = warp_threads(pieces, ppt)
    if thr > 1024:
        raise ValueError(f"{spec.qtype} tile of {tb} blocks has {pieces} pieces (> 1024 "
                         f"threads at {ppt} a thread); lower tile or raise pieces")
    return dict(tile_blocks=tb, tiles=nb // tb, tile_bytes=tile_bytes,
                stride=math.ceil(tile_bytes / 16) * 16, lw=lw, pieces=pieces, threads=thr,
                ppt=ppt)


#: the batched GEMV's pieces (:mod:`.batched_pieces`): qtype -> (weights a
#: piece covers, 32-bit words of x byte planes it keeps per row of x, f32
#: values beside them)
BATCH_PIECES = {"Q4_K": (32, 24, 3), "Q6_K": (16, 12, 1), "Q8_0": (16, 12, 1)}


def batch_layout(spec) -> dict:
    """The batched GEMV's geometry: ``pieces`` of a K slice of a row
    (:attr:`.GemvConfig.kslices`), ``ppt`` a thread
    (the config's ``pieces``, 0: as few as fit 1024 threads), ``threads``
    (``team`` threads a team, :attr:`.GemvConfig.teams` teams),
    the per-piece-and-row words of x (``planes``, ``extras``) and the
    shared memory x of one slice takes (``x_bytes``: every thread's slots,
    ``batch`` rows each)."""
    weights, planes, extras = BATCH_PIECES[spec.qtype]
    pieces = spec.k // spec.kslices // weights
    ppt = spec.pieces or max(1, math.ceil(pieces * spec.teams / 1024))
    team = warp_threads(pieces, ppt)
    thr = team * spec.teams
    if thr > 1024:
        raise ValueError(f"batched {spec.qtype} K={spec.k}: {ppt} pieces per thread in "
                         f"{spec.teams} teams need {thr} threads (> 1024); raise pieces or "
                         f"kslices, or lower teams")
    return dict(weights=weights, pieces=pieces, ppt=ppt, threads=thr, team=team,
                planes=planes, extras=extras,
                x_bytes=4 * ppt * team * spec.batch * (planes + extras))
