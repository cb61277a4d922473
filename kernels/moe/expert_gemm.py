"""The experts' GEMM of a prompt chunk: for each expert, the rows of the
(token, slot) pairs that chose it (grouped on the device by :mod:`.group`)
times that expert's weights, so each chosen expert's weights are read once
per tile of its tokens rather than once per token.

The quantized tensor-core GEMM of :mod:`ptxgen.kernels.gemm.kernel` (the
``mma.sync`` kernel: its ``cp.async`` ring, its formats' fragment decoders
and its stage loop, Q4_K, Q6_K and Q8_0 weights, f32 X) with three changes:

- CTA plane ``e = ctaid.z`` is expert ``e``: W moves to the expert's matrix
  of the 3-D ``*_exps`` tensor (byte ``e M row_bytes``) and the CTA's
  columns are the expert's pairs ``pairs[offsets[e] + n0 ..]`` (``n0 =
  ctaid.x bn``), ``counts[e]`` of them; CTAs with ``n0 >= counts[e]`` exit.
  The grid is sized for the worst case (every token choosing the expert),
  so it needs no host sync.
- X's rows are gathered: pair ``p = t n_used + j`` reads row ``t = p /
  n_used`` of X ``[T, K]`` (``x_token``: the gate/up projections of the
  normed hidden state) or row ``p`` of X ``[T n_used, K]`` (the down
  projection of each pair's activations).
- Y's rows are scattered to row ``p`` of ``y`` ``[T n_used, M]``, where the
  next GEMM and :mod:`.combine` read them; with ``swiglu`` the kernel reads
  the gate values there (the first launch's ``y``, given as ``r``) and
  stores ``silu(gate) * acc`` in their place (the SwiGLU of
  :func:`ptxgen.kernels.swiglu.silu_mul`).

X is f32, read with plain loads (not ``cp.async``) and rounded to f16 on its
way into the stage.  By default a thread loads the stage ``stages - 1``
ahead and stores it before the current stage's MMAs, so each step waits
for X's round trip to L2; with ``x_ahead`` it issues those loads before the
MMAs and converts and stores them after, so the round trip overlaps the
compute (at the price of holding the stage's X chunks in registers).

With ``n_expert`` (the experts, known when building) the grid packs the
column tiles instead: CTA ``(s, ctaid.y)`` takes the ``s``-th nonempty
(expert, column tile), in expert order, found from the counts by a block
scan of ``ceil(counts[e] / bn)`` (each thread a run of experts), so the grid
needs only ``ceil((T_max n_used + n_expert (bn - 1)) / bn)`` columns, or
``T_max n_used`` where fewer (the most nonempty tiles there can be), rather
than ``n_expert ceil(T_max / bn)``, of which nearly all exit at once.

With the plan's ``pdl`` the kernel waits for the grid before it before it
reads the counts.  Parameters: ``w, x[, r], y, m, counts, offsets, pairs``.  Launch:
``(ceil(T_max / bn), ceil(M / bm), n_expert)`` CTAs (with ``n_expert`` in
the spec, ``(packed columns, ceil(M / bm), 1)``) of the plan's threads and
dynamic shared memory.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import b32, f16, f32, u8, u32

from .. import gemm as _gemm
from ..gemm.kernel import XCopies, kernel_directives, mma_ring, sh
from ..plan import LaunchGeometry
from ..spec_fields import pdl_prologue
from ..swiglu import silu_mul

__all__ = ["ExpertGemmSpec", "build", "launch_geometry", "packed_tile", "reference"]


def _plan(inst, attr, v):
    if not isinstance(v, _gemm.GemmPlan):
        raise ValueError(f"plan must be a GemmPlan, got {type(v).__name__}")
    if v.config.kernel != "mma":
        raise ValueError(f"the experts' GEMM runs the mma kernel, not {v.config.kernel!r}")
    if v.qtype not in _gemm.FORMATS:
        raise ValueError(f"the experts' GEMM reads {', '.join(_gemm.FORMATS)}, not {v.qtype}")
    s = v.spec
    if (s.x_type, s.epilogue, s.t_device, s.y_stride) != ("f32", "none", False, 0):
        raise ValueError("the experts' GEMM takes a plan of f32 X, epilogue 'none', no "
                         "t_device or y_stride (it reads its own counts)")


@attrs.frozen(init=False)
class ExpertGemmSpec:
    """The grouped GEMM of ``plan`` over the experts' pairs; the plan's
    spec fields given as keywords (``target``) replace its own.

    Parameters
    ----------
    plan : GemmPlan
        The ``mma`` GEMM run for each expert (rows of ``K``, f32 X).
    n_used : int
        Experts a token.
    x_token : bool
        X is ``[T, K]``, row ``p / n_used`` for pair ``p``; else ``[T n_used, K]``.
    swiglu : bool
        Store ``silu(r) * acc`` (``r``: the gate values at ``y``'s rows).
    x_ahead : bool
        Load the next X stage before the MMAs, store it after.
    n_expert : int
        The experts, for a grid of packed column tiles; 0: a CTA plane
        an expert.
    """

    plan: object = attrs.field(validator=_plan)
    n_used: int = attrs.field()
    x_token: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    swiglu: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    x_ahead: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    n_expert: int = attrs.field(default=0)

    def __init__(self, plan, n_used, x_token=False, swiglu=False, x_ahead=False, n_expert=0,
                 **spec_changes):
        if spec_changes:
            _plan(self, None, plan)
            plan = _gemm.GemmPlan(attrs.evolve(plan.spec, **spec_changes), plan.config)
        self.__attrs_init__(plan, n_used, x_token, swiglu, x_ahead, n_expert)

    @n_expert.validator
    def _check_experts(self, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1024):
            raise ValueError(f"n_expert must be an int in 0..1024 (0: a CTA plane an "
                             f"expert), got {v!r}")

    @n_used.validator
    def _check_used(self, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 64):
            raise ValueError(f"n_used must be an int in 1..64, got {v!r}")

    @property
    def target(self) -> str:
        return self.plan.target

    def evolve(self, **changes) -> "ExpertGemmSpec":
        """This spec with its own fields or the plan's (``target``) changed."""
        return attrs.evolve(self, **changes)

    @property
    def kernel_name(self) -> str:
        return (f"moe_{self.plan.kernel_name}_k{self.n_used}{'_xt' if self.x_token else ''}"
                f"{'_swiglu' if self.swiglu else ''}{'_xa' if self.x_ahead else ''}"
                f"{f'_p{self.n_expert}' if self.n_expert else ''}")


class _GatherX(XCopies):
    """X's stage tile of the CTA's pairs: chunk offsets fixed for the
    kernel, the row of each pair (clamped to the expert's last) gathered;
    with the spec's ``x_ahead`` the step's stage is loaded before the MMAs
    and stored after them."""

    def __init__(self, k, spec, tid, x, pairs, first, n0, count):
        def row(n):
            p = k.ld(pairs[first + k.min(n0 + n, count - 1)])
            return p // spec.n_used if spec.x_token else p

        super().__init__(k, spec.plan, tid, x, row)
        self.ahead = spec.x_ahead

    def issue_ahead(self, ring, buf, ahead):
        k = self.k
        if not self.ahead:
            # as XCopies.issue_ahead, but the buffer's address formed inside
            # the branch (the order this kernel's PTX has always had)
            with k.if_(ahead < ring.nk):
                ring.issue(ring.stage(buf), ahead * ring.bk)
            return None
        nb = ring.stage(buf)
        more = ahead < ring.nk
        with k.if_(more):
            ring.wcp.issue_stage(nb, ahead * ring.bk)
        loaded = self.load(ahead * ring.bk, more)
        return lambda: self.store(nb, loaded, more)

    def load(self, kk, ok):
        """Issue the loads of the stage at ``kk`` where ``ok``; returns what
        :meth:`store` takes (the chunks' registers, not yet waited on)."""
        k = self.k
        out = []
        for guard, off, dst in self.x:
            g = ok if guard is None else k.pand(guard, ok)
            out.append((g, dst, k.ld(self.xp[off + kk], f32, vec=4, nc=True, guard=g)))
        return out

    def store(self, base, loaded, ok):
        """Round the chunks of :meth:`load` (given ``ok``) to f16 into the
        stage at ``base``."""
        k = self.k
        with k.if_(ok):
            for g, dst, vals in loaded:
                h = [k.cvt(f16, v, rnd="rn") for v in vals]
                k.st(sh(base + dst), (k.pack(b32, h[0], h[1]), k.pack(b32, h[2], h[3])),
                     guard=g)


def build(spec: ExpertGemmSpec) -> ptxgen.Module:
    """PTX for ``spec``: the kernel ``spec.kernel_name``."""
    plan = spec.plan
    c = plan.config
    mod = ptxgen.Module(plan.target)
    with mod.kernel(spec.kernel_name, **kernel_directives(plan)) as k:
        w = k.param_ptr("w", u8, align=16)
        x = k.param_ptr("x", f32, align=16)
        r = k.param_ptr("r", f32) if spec.swiglu else None
        y = k.param_ptr("y", f32)
        mrows = k.param("m", u32)
        counts = k.param_ptr("counts", u32)
        offsets = k.param_ptr("offsets", u32)
        pairs = k.param_ptr("pairs", u32)
        smem = k.dynamic_shared("smem", u8)
        pdl_prologue(k, plan.spec)
        if spec.n_expert:
            e, n0 = packed_tile(k, spec, counts, k.mov(smem, u32))
            count = k.ld(counts[e])
        else:
            e = k.ctaid.z
            count = k.ld(counts[e])
            n0 = k.ctaid.x * c.bn
            k.exit(guard=n0 >= count)
        first = k.ld(offsets[e])
        w = k.ptr_add(w, k.mul_wide(e * mrows, plan.row_bytes))
        m0 = k.ctaid.y * c.bm
        wt = mma_ring(k, plan, _gemm.FORMATS[plan.qtype], smem, w, m0, mrows,
                      lambda tid: _GatherX(k, spec, tid, x, pairs, first, n0, count))
        _store(k, spec, wt.acc, y, r, m0 + wt.wrow, n0 + wt.wcol, wt.g, wt.tq, mrows, count,
               pairs, first)
    return mod


def packed_tile(k, spec, counts, base):
    """``(e, n0)`` of this CTA's nonempty tile, the ``ctaid.x``-th in
    expert order (the CTA exits past the last).  Thread ``i`` owns the
    experts ``i per ..`` (``per`` a thread), sums their tiles, and the block
    scans the sums (a warp scan, then the warps' totals through shared
    memory at ``base``, which the stages overwrite after a barrier)."""
    E, bn, thr = spec.n_expert, spec.plan.config.bn, spec.plan.threads
    per, nw = -(-E // thr), thr // 32
    tid = k.tid.x
    lane, warp = tid & 31, tid >> 5
    slot = k.ctaid.x
    tiles = []
    own = k.var(u32, 0)
    for q in range(per):
        eq = tid * per + q if per > 1 else tid
        cq = k.var(u32, 0)
        with k.if_(eq < E):
            cq.set(k.ld(counts[eq]))
        tq = (cq + (bn - 1)) // bn
        tiles.append((eq, tq))
        own.set(own + tq)
    inc = k.var(u32, own)
    for d in (1, 2, 4, 8, 16):
        up = k.shfl_up(inc, d)
        inc.set(k.select(lane >= d, inc + up, inc))
    with k.if_(lane.eq(31)):
        k.st(sh(base + warp * 4), inc)
    with k.if_(tid.eq(0)):
        k.st(sh(base + 4 * nw), k.mov(0xFFFFFFFF, u32))
    k.bar_sync()
    run = k.var(u32, inc - own)
    for w in range(nw - 1):
        tot = k.ld(sh(base + 4 * w), u32)
        run.set(k.select(warp > w, run + tot, run))
    for eq, tq in tiles:
        with k.if_(k.pand(slot >= run, slot < run + tq)):
            k.st(sh(base + 4 * nw), eq)
            k.st(sh(base + 4 * (nw + 1)), (slot - run) * bn)
        run.set(run + tq)
    k.bar_sync()
    e = k.ld(sh(base + 4 * nw), u32)
    n0 = k.ld(sh(base + 4 * (nw + 1)), u32)
    k.exit(guard=e.eq(0xFFFFFFFF))
    k.bar_sync()
    return e, n0


def _store(k, spec, acc, y, r, row0, col0, g, tq, mrows, count, pairs, first):
    """D element ``e`` of tile ``(mt, nt)``: weight row ``row0 + 16 mt + g +
    8 (e >= 2)`` of the expert's column ``col0 + 8 nt + 2 tq + (e & 1)``
    (pair ``pairs[first + column]``), stored at ``y[pair M + row]`` when both
    are in range."""
    rows = [row0 + (16 * mt + 8 * h) + g for mt in range(len(acc)) for h in range(2)]
    cols = [col0 + (8 * nt + e) + 2 * tq for nt in range(len(acc[0])) for e in range(2)]
    rok = [rr < mrows for rr in rows]
    cok = [cc < count for cc in cols]
    prow = [k.ld(pairs[first + k.min(cc, count - 1)]) * mrows for cc in cols]
    for mt in range(len(acc)):
        for nt in range(len(acc[0])):
            for e in range(4):
                ri, ci = 2 * mt + (e >> 1), 2 * nt + (e & 1)
                ok = k.pand(rok[ri], cok[ci])
                idx = prow[ci] + rows[ri]
                v = acc[mt][nt][e]
                if r is not None:
                    # plain ld, not .nc: r is y itself
                    with k.if_(ok):
                        k.st(y[idx], silu_mul(k, k.ld(r[idx]), v))
                else:
                    k.st(y[idx], v, guard=ok)


def launch_geometry(spec: ExpertGemmSpec, m: int, t_max: int, n_expert: int):
    """The launch for ``m`` weight rows of each of ``n_expert`` experts, at
    most ``t_max`` tokens (so at most ``t_max`` pairs an expert)."""
    for what, v in (("M", m), ("T", t_max), ("n_expert", n_expert)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{what} must be a positive int, got {v!r}")
    p = spec.plan
    bn, rows = p.config.bn, math.ceil(m / p.config.bm)
    if spec.n_expert:
        if n_expert != spec.n_expert:
            raise ValueError(f"n_expert={n_expert} is not the spec's {spec.n_expert}")
        pairs = t_max * spec.n_used            # a nonempty tile holds at least one
        cols = min(math.ceil((pairs + n_expert * (bn - 1)) / bn), pairs,
                   n_expert * math.ceil(t_max / bn))
        return LaunchGeometry(spec.kernel_name, (cols, rows, 1), p.threads, p.dynamic_shared)
    return LaunchGeometry(spec.kernel_name, (math.ceil(t_max / bn), rows, n_expert),
                          p.threads, p.dynamic_shared)


def reference(spec: ExpertGemmSpec, w_deq, ids, x, gate=None):
    """float64 ``[T n_used, M]``: row ``p = t n_used + j`` the product of
    expert ``ids[t, j]``'s float64 weights (``w_deq``: ``[n_expert, M, K]``)
    and X's row of the pair; with ``swiglu``, ``silu(gate[p]) *`` that."""
    ids = np.asarray(ids).reshape(-1)
    x = np.asarray(x, np.float64)
    rows = np.arange(ids.size) // spec.n_used if spec.x_token else np.arange(ids.size)
    out = np.einsum("pmk,pk->pm", np.asarray(w_deq, np.float64)[ids], x[rows])
    if spec.swiglu:
        g = np.asarray(gate, np.float64)
        out = g / (1.0 + np.exp(-g)) * out
    return out


def _canon(qtype, k, n_used=8, x_token=False, swiglu=False, x_ahead=False, n_expert=0,
           target="sm_90", **config):
    return ExpertGemmSpec(_gemm.GemmPlan.make(qtype, k, target=target, **config), n_used,
                          x_token=x_token, swiglu=swiglu, x_ahead=x_ahead, n_expert=n_expert)


CANONICAL = {
    "moe_gemm_q4_k_xt": _canon("Q4_K", 2048, x_token=True, bm=128, bn=32, bk=64, warps_m=2,
                               warps_n=2, stages=4),
    "moe_gemm_q4_k_xt_swiglu": _canon("Q4_K", 2048, x_token=True, swiglu=True, pdl=True,
                                      bm=128, bn=32, bk=64, warps_m=2, warps_n=2, stages=4),
    "moe_gemm_q6_k": _canon("Q6_K", 768, bm=128, bn=32, bk=128, warps_m=2, warps_n=2,
                            stages=3),
    "moe_gemm_q4_k_xt_swiglu_xa": _canon("Q4_K", 2048, x_token=True, swiglu=True,
                                         x_ahead=True, pdl=True, bm=128, bn=64, bk=64,
                                         warps_m=2, warps_n=2, stages=4),
    "moe_gemm_q6_k_xa": _canon("Q6_K", 768, x_ahead=True, bm=128, bn=64, bk=128, warps_m=2,
                               warps_n=2, stages=3),
    "moe_gemm_q4_k_xt_packed": _canon("Q4_K", 2048, x_token=True, n_expert=128, bm=128, bn=32,
                                      bk=64, warps_m=2, warps_n=2, stages=4),
}

registry.register("moe_gemm", ExpertGemmSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
