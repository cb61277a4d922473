"""The GEMV config selector: the tuning table (``kernels/tuning/gemv.json``),
then the rules that follow from the grid and the device rather than from
measurements of one shape, one function each."""

from __future__ import annotations

import math

import attrs

from ptxgen.target import CTA_RESERVED_SHARED, TARGETS

from .. import tuning
from .layout import groups_per_cta, launch_geometry, pieces_per_row, threads
from .spec import MAX_RING_BYTES, GemvConfig, GemvPlan, GemvSpec

__all__ = ["select_config", "call_of", "ring_aligned", "candidate_configs", "balanced", "batch_config",
           "batch_crossover", "crossover_call"]


def call_of(spec: GemvSpec, m: int | None) -> dict:
    """The keys a tuning rule may test for ``spec`` at ``m`` rows (a geglu
    GEMV reads and costs as a swiglu one: it takes swiglu's rules)."""
    epi = "swiglu" if spec.epilogue == "geglu" else spec.epilogue
    return {"qtype": spec.qtype, "epilogue": epi, "k": spec.k, "m": m,
            "sm": TARGETS[spec.target].sm, "target": spec.target}


def select_config(spec: GemvSpec, m: int | None = None, sm_count: int | None = None,
                  device: str | None = None) -> GemvConfig:
    """The config for ``spec`` at ``m`` rows (when known) on a device with
    ``sm_count`` SMs (when known; a ring's CTAs are then spread evenly over
    them).  An entry the user's ``python -m ptxgen tune`` stored for
    ``device`` wins over the shipped table."""
    call = call_of(spec, m)
    stored = tuning.user_config("gemv", device, call)
    if stored is not None:
        return balanced(spec, GemvConfig(**stored), m, sm_count)
    knobs = tuning.cascade("gemv", call)
    free_slots = knobs.pop("_free_slots", False)
    unaligned = knobs.pop("_unaligned_rows", False)
    if knobs.get("stages") and spec.qtype != "Q4_K":
        knobs["tile"] = spec.k
    knobs = _fit_ring(spec, knobs, m if unaligned else None)
    if free_slots and m is not None and knobs.get("stages"):
        _free_slots(knobs, m)
    if m is not None and knobs.get("stages", 0) > 2 and \
            groups_per_cta(m, knobs["rows"], knobs["max_ctas"]) <= knobs["stages"] - 1:
        knobs["ahead"] = 1
    if spec.epilogue == "rope" and knobs.get("rows", 4) % 2:
        knobs["rows"] *= 2
    return balanced(spec, GemvConfig(**knobs), m, sm_count)


#: rows of the direct kernel where a ring does not fit (F16/BF16 rows of a
#: 2048-weight tile take 4 KB of static shared memory each)
_DIRECT_ROWS = {"Q6_K": 2, "F16": 4, "BF16": 4}


def _fit_ring(spec: GemvSpec, knobs: dict, m: int | None = None) -> dict:
    """Halve a ring's rows until its stages fit the shared memory, and give
    a thread more pieces until a row's pieces fit 1024 threads; where the
    ring's 16-byte copies do not fit the rows (:func:`ring_aligned`; rows
    not 16-byte aligned only where the table's rule says ``_unaligned_rows``
    and so passes ``m``) or nothing fits, the direct kernel's config (no
    ring fields)."""
    if not knobs.get("stages"):
        return knobs
    direct = {"rows": _DIRECT_ROWS.get(spec.qtype, 8), "max_ctas": 2112}

    def ring_bytes():
        return knobs["stages"] * spec.n_mats * knobs["rows"] * spec.row_bytes

    while knobs["rows"] > 1 and ring_bytes() > MAX_RING_BYTES:
        knobs["rows"] //= 2
    if ring_bytes() > MAX_RING_BYTES or not ring_aligned(spec, knobs["rows"], m,
                                                         knobs.get("bulk", False)):
        return direct
    if spec.qtype != "Q4_K":
        while -(-pieces_per_row(spec) // max(1, knobs.get("pieces", 0))) > 1024:
            if knobs.get("pieces", 0) >= 8:
                return direct
            knobs["pieces"] = max(2, 2 * knobs.get("pieces", 0))
    return knobs


def ring_aligned(spec: GemvSpec, rows: int, m: int | None, bulk: bool = False) -> bool:
    """Whether the ring's 16-byte copies fit ``spec``'s rows: Q4_K rows
    always (144-byte blocks); the other formats' when a row group of
    ``rows`` rows is a whole number of 16-byte chunks, and, where a row is
    not (Q6_K's 210-byte blocks at K = 3584: 2,940 bytes), when the matrix
    of ``m`` rows is too (its last chunk is where copies past it are
    clamped; unknown ``m``: not known to fit) and the copies are not the
    bulk copy engine's (a group cut short by M is then no whole chunk)."""
    rb = spec.row_bytes
    if spec.qtype == "Q4_K" or rb % 16 == 0:
        return True
    return (rows * rb) % 16 == 0 and m is not None and (m * rb) % 16 == 0 and not bulk


def _free_slots(knobs: dict, m: int) -> None:
    """Where the round-robin deal gives nearly every CTA slot of a two-CTA-
    an-SM ring 3 row groups, give each CTA one group more, so that the next
    launch's CTAs find free slots and issue their first copies early."""
    rows, slots = knobs["rows"], knobs["max_ctas"]
    g = groups_per_cta(m, rows, slots)
    if g == 3 and math.ceil(m / (g * rows)) > slots - 16:
        knobs["max_ctas"] = math.ceil(math.ceil(m / rows) / (g + 1))


def balanced(spec: GemvSpec, config: GemvConfig, m: int | None,
              sm_count: int | None) -> GemvConfig:
    """``per_sm = ceil(grid / sm_count)`` where that binds: a ring's shared
    memory often lets more CTAs share an SM than an even spread needs, and
    under PDL a grid placed while the one before drains piles onto the SMs
    freed first."""
    if not sm_count or m is None or not config.stages or config.per_sm:
        return config
    plan = GemvPlan(spec, config)
    n = -(-launch_geometry(plan, m).grid[0] // sm_count)
    try:
        capped = GemvPlan(spec, attrs.evolve(config, per_sm=n))
    except ValueError:           # n CTAs do not fit: the ring allows fewer already
        return config
    return capped.config if capped.dynamic_shared > plan.ring_bytes else config


def candidate_configs(spec: GemvSpec, m: int, sm_count: int | None = None) -> list:
    """Configs ``python -m ptxgen tune`` times for ``spec`` at ``m`` rows:
    the selected one and its neighbours (rows halved and doubled, one stage
    fewer and more, the grid cap halved and doubled), each kept only where
    the plan builds."""
    base = select_config(spec, m, sm_count)
    out = [base]
    moves = [dict(rows=base.rows // 2), dict(rows=base.rows * 2),
             dict(max_ctas=max(1, base.max_ctas // 2)), dict(max_ctas=base.max_ctas * 2)]
    if base.stages:
        moves += [dict(stages=base.stages - 1, ahead=0), dict(stages=base.stages + 1, ahead=0)]
    for mv in moves:
        try:
            c = attrs.evolve(base, **mv)
            GemvPlan(spec, c)
        except ValueError:
            continue
        if c not in out:
            out.append(c)
    return out


def _batch_call(spec: GemvSpec, m: int | None) -> dict:
    return dict(call_of(spec, m), batch=spec.batch)


def crossover_call(target: str) -> dict:
    """The user tuning cache's key for the crossover measured on a device
    of ``target`` (``scripts/bench_batchgemv.py`` stores it there)."""
    return {"kind": "crossover", "target": target}


def batch_crossover(spec: GemvSpec, m: int | None = None, device: str | None = None) -> int:
    """The most rows of x a decode step runs through the batched GEMV for
    ``spec``'s weight (its ``batch`` is ignored): the crossover measured on
    ``device`` where one is stored in the user tuning cache, else the
    tuning table's (``kernels/tuning/gemv_batch.json``, ``crossover``)."""
    stored = tuning.user_config("gemv_batch", device, crossover_call(spec.target))
    if stored is not None:
        return int(stored["crossover"])
    call = _batch_call(spec, m)
    return int(tuning.cascade("gemv_batch", call).get("crossover", 0))


#: the most threads of a batched GEMV CTA: 128 registers a thread still fit
#: one CTA on an SM (65536 registers), so ptxas need not squeeze them
MAX_BATCH_THREADS = 512


def batch_config(spec: GemvSpec, m: int | None = None,
                 sm_count: int | None = None) -> GemvConfig:
    """The batched GEMV's config for ``spec`` (``batch >= 2``) at ``m`` rows
    on ``sm_count`` SMs: the table's, where x and the ring do not fit a
    CTA's shared memory (or the CTA would pass :data:`MAX_BATCH_THREADS`)
    with K in the fewest slices (``kslices``) that fit at the most rows a
    team, then the most teams, then the most stages; the grid as many CTAs
    as fit the SMs at once.  Raises the table config's ValueError where
    nothing fits (or the spec is not built)."""
    knobs = tuning.cascade("gemv_batch", _batch_call(spec, m))
    knobs.pop("crossover", None)
    teams0 = knobs.get("teams", 1)
    per_team = max(1, knobs["rows"] // teams0)
    first_error = None
    for cand in _batch_candidates(knobs, teams0, per_team):
        try:
            plan = GemvPlan(spec, GemvConfig(**cand))
        except ValueError as e:
            first_error = first_error or e
            continue
        if threads(plan) > MAX_BATCH_THREADS:
            continue
        break
    else:
        raise first_error or ValueError(
            f"batch={spec.batch}: no batched GEMV of {spec.qtype} K={spec.k} fits "
            f"{MAX_BATCH_THREADS} threads")
    if sm_count:
        per_cta = plan.dynamic_shared + plan.ring_static_bytes + CTA_RESERVED_SHARED
        thr = threads(plan)
        fit = max(1, min(TARGETS[spec.target].shared_per_sm // per_cta, 2048 // thr,
                         65536 // (128 * thr)))
        cand["max_ctas"] = sm_count * fit
    return GemvConfig(**cand)


def _batch_candidates(knobs, teams0, per_team):
    """Configs in :func:`batch_config`'s order of preference."""
    for stages in range(knobs["stages"], 1, -1):
        for teams in (teams0 >> i for i in range(teams0.bit_length())):
            for rt in (per_team >> i for i in range(per_team.bit_length())):
                for kslices in range(1, 17):
                    yield dict(knobs, stages=stages, teams=teams, rows=teams * rt,
                               kslices=kslices)
