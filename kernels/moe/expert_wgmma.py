"""The experts' GEMM of a prompt chunk on sm_90a warpgroups: the warpgroup
GEMM of :mod:`ptxgen.kernels.gemm.wgmma_q4k` (weights decoded into A
registers, X brought by TMA into 128B-swizzled shared memory, its stage
ring and formats: Q4_K, Q6_K and the other warpgroup types) run over the
pairs grouped by expert (:mod:`.group`), X already in the experts' order.

X is f16 ``[P, K]`` (``P = T n_used``, the pairs), row ``offsets[e] + i``
the row of expert ``e``'s ``i``-th pair: the chunk's rows gathered by
:mod:`.permute` (gate and up) or the activations this kernel's SwiGLU
epilogue stored (down).  An expert's rows are one block of X, so its
column tile ``n0 ..`` is one TMA box at row ``offsets[e] + n0``; the box's
rows past ``counts[e]`` belong to the next expert (or are past ``P``: the
map's zeros) and are computed, not stored.

Grid (as the ``mma.sync`` experts' GEMM's packed grid,
:func:`.expert_gemm.packed_tile`): CTA ``(s, ctaid.y)`` takes the ``s``-th
nonempty (expert, column tile) in expert order, found by a block scan of
``ceil(counts[e] / bn)``, and weight rows ``ctaid.y bm ..`` of expert
``e``'s matrix of the 3-D ``*_exps`` tensor (byte ``e M row_bytes``); past
the last tile the CTA exits.  The scan's words in shared memory are
overwritten by the ring's TMA loads, so every thread fences the async proxy
after it.  Then the stage loop of :func:`.wgmma_q4k.build_wgmma` as it is.

Epilogue (``out``), element ``(row, i)`` of the tile, stored where ``row <
M`` and ``i < counts[e]``, ``q = offsets[e] + n0 + i``:

- ``"sorted"``: f32 ``y[q M + row]`` (the gate values, in X's order);
- ``"swiglu"``: f16 ``y[q M + row] = silu(r[q M + row]) * acc`` (``r``: the
  gate values; in f32 as :func:`ptxgen.kernels.swiglu.silu_mul` but its
  quotient ``div.full``, rounded to f16 once: the down launch's X, which
  the ``mma.sync`` kernel rounds to f16 on its way into shared memory
  alike);
- ``"pairs"``: f32 ``y[pairs[q] M + row]``, each pair's row where
  :mod:`.combine` reads it (the down projection).

Parameters: ``w[, r], y, m, counts, offsets[, pairs], xmap`` (the tensor
map of X, :func:`ptxgen.kernels.gemm.x_map` of the plan over ``P_max``
rows).  Launch (:func:`launch_geometry`): ``(packed columns, ceil(M / bm),
1)`` CTAs of ``2 bm`` threads, the plan's dynamic shared memory.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import f16, f32, u8, u32

from .. import gemm as _gemm
from ..gemm.wgmma_q4k import build_wgmma
from ..plan import LaunchGeometry
from ..spec_fields import pdl_prologue
from ..swiglu import silu_mul
from .expert_gemm import packed_tile

__all__ = ["ExpertWgmmaSpec", "OUTS", "build", "launch_geometry", "reference"]

#: the epilogues: f32 rows in X's order, SwiGLU into f16 rows in X's
#: order, f32 rows of the pairs
OUTS = ("sorted", "swiglu", "pairs")


def _plan(inst, attr, v):
    if not isinstance(v, _gemm.GemmPlan):
        raise ValueError(f"plan must be a GemmPlan, got {type(v).__name__}")
    if v.config.kernel != "wgmma":
        raise ValueError(f"the experts' warpgroup GEMM runs the wgmma kernel, not "
                         f"{v.config.kernel!r}")
    s = v.spec
    if (s.x_type, s.epilogue, s.t_device, s.y_stride, v.config.split_k) != (
            "f16", "none", False, 0, 1):
        raise ValueError("the experts' warpgroup GEMM takes a plan of f16 X, epilogue 'none', "
                         "no t_device, y_stride or split_k (it reads its own counts)")


@attrs.frozen(init=False)
class ExpertWgmmaSpec:
    """The grouped warpgroup GEMM of ``plan`` over ``n_expert`` experts; the
    plan's spec fields given as keywords (``target``) replace its own.

    Parameters
    ----------
    plan : GemmPlan
        The ``wgmma`` GEMM run for each expert (rows of ``K``, f16 X).
    n_expert : int
        The experts (1..1024), for the packed grid's scan.
    out : {"sorted", "swiglu", "pairs"}
        The epilogue (:data:`OUTS`).
    """

    plan: object = attrs.field(validator=_plan)
    n_expert: int = attrs.field()
    out: str = attrs.field(default="sorted")

    def __init__(self, plan, n_expert, out="sorted", **spec_changes):
        if spec_changes:
            _plan(self, None, plan)
            plan = _gemm.GemmPlan(attrs.evolve(plan.spec, **spec_changes), plan.config)
        self.__attrs_init__(plan, n_expert, out)

    @n_expert.validator
    def _check_experts(self, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1024):
            raise ValueError(f"n_expert must be an int in 1..1024, got {v!r}")

    @out.validator
    def _check_out(self, attr, v):
        if v not in OUTS:
            raise ValueError(f"out must be one of {', '.join(OUTS)}, got {v!r}")

    @property
    def target(self) -> str:
        return self.plan.target

    def evolve(self, **changes) -> "ExpertWgmmaSpec":
        """This spec with its own fields or the plan's (``target``) changed."""
        return attrs.evolve(self, **changes)

    @property
    def kernel_name(self) -> str:
        return f"moe_{self.plan.kernel_name}_e{self.n_expert}_{self.out}"


class _Tiles:
    """The hook of :func:`.wgmma_q4k.build_wgmma`: the packed tile's
    expert and columns, its weights and X's rows, and the epilogue."""

    def __init__(self, spec):
        self.spec = spec
        self.kernel_name = spec.kernel_name

    def interface(self, k):
        spec, plan = self.spec, self.spec.plan
        w = k.param_ptr("w", u8, align=16)
        r = k.param_ptr("r", f32) if spec.out == "swiglu" else None
        y = k.param_ptr("y", f16 if spec.out == "swiglu" else f32)
        mrows = k.param("m", u32)
        counts = k.param_ptr("counts", u32)
        offsets = k.param_ptr("offsets", u32)
        pairs = k.param_ptr("pairs", u32) if spec.out == "pairs" else None
        smem = k.dynamic_shared("smem", u8, align=1024)
        pdl_prologue(k, plan.spec)
        e, n0 = packed_tile(k, spec, counts, k.mov(smem, u32))
        # the scan's shared words, written by the generic proxy, are the
        # first stage's X tile, which TMA (the async proxy) writes next
        k.fence_proxy_async()
        count = k.ld(counts[e])
        first = k.ld(offsets[e]) + n0
        w = k.ptr_add(w, k.mul_wide(e * mrows, plan.row_bytes))

        def store(acc, row0, tok0):
            _store(k, spec, acc, y, r, pairs, row0, tok0, mrows, count - n0, first)
        return w, mrows, smem, first, store


def _store(k, spec, acc, y, r, pairs, row0, tok0, mrows, left, first):
    """Accumulator ``i``: weight row ``row0 + 8 ((i >> 1) & 1)`` of column
    ``c = tok0 + 8 (i >> 2) + (i & 1)`` of the tile (X's row ``first +
    c``), stored by the spec's epilogue where the row is below M and ``c``
    below ``left`` (the expert's pairs from the tile's first on)."""
    cols = {}
    for i in range(len(acc)):
        tt = 8 * (i >> 2) + (i & 1)
        if tt not in cols:
            c = tok0 + tt if tt else tok0
            q = first + c
            if spec.out == "pairs":
                q = k.ld(pairs[first + k.min(c, left - 1)])
            cols[tt] = (c < left, q * mrows)
    rok = [row0 < mrows, (row0 + 8) < mrows]
    for i, v in enumerate(acc):
        h, tt = (i >> 1) & 1, 8 * (i >> 2) + (i & 1)
        cok, qrow = cols[tt]
        row = row0 + 8 if h else row0
        ok = k.pand(rok[h], cok)
        idx = qrow + row
        if spec.out == "swiglu":
            with k.if_(ok):
                k.st(y[idx], k.cvt(f16, silu_mul(k, k.ld(r[idx]), v, full=True), rnd="rn"))
        else:
            k.st(y[idx], v, guard=ok)


def build(spec: ExpertWgmmaSpec) -> ptxgen.Module:
    """PTX for ``spec``: the kernel ``spec.kernel_name``."""
    return build_wgmma(spec.plan, _gemm.WGMMA_FORMATS[spec.plan.qtype], tiles=_Tiles(spec))


def launch_geometry(spec: ExpertWgmmaSpec, m: int, t_max: int, n_used: int):
    """The launch for ``m`` weight rows of each expert and at most ``t_max``
    tokens of ``n_used`` experts each (so at most ``t_max`` pairs an
    expert); an expert's matrix must start 16-byte aligned (``m
    row_bytes``)."""
    for what, v in (("M", m), ("T", t_max), ("n_used", n_used)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{what} must be a positive int, got {v!r}")
    p = spec.plan
    if (m * p.row_bytes) % 16:
        raise ValueError(f"M={m} rows of {p.row_bytes} bytes: an expert's matrix would not "
                         f"start 16-byte aligned (the weight copies need it)")
    bn, E = p.config.bn, spec.n_expert
    pairs = t_max * n_used                     # a nonempty tile holds at least one
    cols = min(math.ceil((pairs + E * (bn - 1)) / bn), pairs, E * math.ceil(t_max / bn))
    return LaunchGeometry(spec.kernel_name, (cols, math.ceil(m / p.config.bm), 1), p.threads,
                          p.dynamic_shared)


def reference(spec: ExpertWgmmaSpec, w_deq, xs, counts, pairs=None, gate=None):
    """float64 ``[P, M]`` of the pairs ``P = sum(counts)`` (grouped as
    :mod:`.group` groups them: expert ``e``'s at rows ``offsets[e] ..``,
    the exclusive prefix sum of ``counts``): row ``q`` the product of its
    expert's float64 weights (``w_deq``: ``[n_expert, M, K]``) and
    ``xs[q]``; with ``"swiglu"``, ``silu(gate[q]) *`` that; with
    ``"pairs"``, row ``pairs[q]`` holds row ``q``'s."""
    experts = np.repeat(np.arange(len(counts)), np.asarray(counts, np.int64))
    x = np.asarray(xs, np.float64)[:experts.size]
    out = np.einsum("qmk,qk->qm", np.asarray(w_deq, np.float64)[experts], x)
    if spec.out == "swiglu":
        g = np.asarray(gate, np.float64)[:experts.size]
        out = g / (1.0 + np.exp(-g)) * out
    if spec.out == "pairs":
        res = np.empty_like(out)
        res[np.asarray(pairs, np.int64)[:experts.size]] = out
        out = res
    return out


def _canon(qtype, k, out, pdl=True, **config):
    return ExpertWgmmaSpec(_gemm.GemmPlan.make(qtype, k, x_type="f16", target="sm_90a",
                                               pdl=pdl, kernel="wgmma", **config), 128, out)


CANONICAL = {
    # the family's name dumps the first spec: no PDL in it
    "moe_wg_q4_k": _canon("Q4_K", 2048, "sorted", pdl=False, bm=128, bn=32, stages=4),
    "moe_wg_q4_k_sorted": _canon("Q4_K", 2048, "sorted", bm=128, bn=32, stages=4),
    "moe_wg_q4_k_swiglu": _canon("Q4_K", 2048, "swiglu", bm=128, bn=32, stages=4),
    "moe_wg_q6_k_pairs": _canon("Q6_K", 768, "pairs", bm=128, bn=32, stages=4),
}

registry.register("moe_wgmma", ExpertWgmmaSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
