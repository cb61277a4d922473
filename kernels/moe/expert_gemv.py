"""The experts' GEMV: the selected experts' matrices times x, the expert ids
read from device memory (the router's), so a decode step's graph serves
every choice of experts.

A GEMV plan of the GEMV family (:mod:`ptxgen.kernels.gemv`, any weight
type, kernel body and config; epilogue ``none`` or ``swiglu``) run once per
selected expert: CTA row ``j = ctaid.y`` (of ``n_used``) reads ``e =
ids[j]`` and computes ``y[j] = W_e x_j`` (``silu(Wg_e x) * (Wu_e x)`` with
``swiglu``), ``W`` holding the experts' ``[M, K]`` matrices back to back
(a GGUF 3-D ``*_exps`` tensor, expert ``e`` at byte ``e M row_bytes``).
``x`` is one vector every expert reads (the gate/up projection; with the
plan's fused RMSNorm too) or, with ``x_slot``, one per expert, ``x_j`` at
``x + j K`` (the down projection of each expert's activations); ``y`` is
``[n_used, M]``.

With ``tokens`` (a prompt chunk) CTA plane ``t = ctaid.z`` is token ``t`` of
up to T (read from ``t_ptr``; planes at or past it exit): ids ``[T,
n_used]``, x ``[T, K]`` (``[T, n_used, K]`` with ``x_slot``), y ``[T,
n_used, M]`` -- each token's experts run as at one token.

With ``combine`` (one token's down projection) the experts' outputs are
also summed, each times its router weight, into the residual: ``out = r +
sum_j weights[j] y[j]`` (:mod:`.combine`'s order and rounding, so one launch
does what the GEMV and the combine did).  The ``n_used`` CTAs of a row
group (one per expert, same ``ctaid.x``) each store their ``y[j]`` rows,
then count themselves on ``counter[ctaid.x]`` (release fence, ``atom.add``);
the last to arrive reads the group's ``n_used`` rows back (``ld.cg``, after
an acquire fence), sums them in slot order, stores ``out`` and resets its
counter to 0, so the launch replays from a CUDA graph.  No float atomics:
the sum's order is fixed whichever CTA arrives last.

Only the weight, x and y pointers move: the GEMV body is the family's.  Its
parameters come first, then ``ids`` (s32 ``[n_used]``), with ``tokens``
``t_ptr`` (u32) and with ``combine`` ``weights`` (f32 ``[n_used]``), ``r``
and ``out`` (f32 ``[M]``, ``out`` may be ``r``) and ``counter`` (u32, one
per CTA of ``grid.x``, zero before the first launch).  With ``pdl`` the
kernel waits for the grid before it (``griddepcontrol.wait``) before it
reads the ids, so before any weight load: which weights to read is known
only then.

Launch: the plan's geometry for M rows with ``grid.y = n_used`` (and
``grid.z = T`` with ``tokens``); ``combine``'s counter holds ``grid.x``
words (:func:`counter_words`).
"""

from __future__ import annotations

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import f32, s32, u32

from .. import gemv as _gemv
from ..gemv.common import declare_params
from ..spec_fields import has_griddepcontrol, pdl_wait

__all__ = ["ExpertGemvSpec", "build", "launch_geometry", "counter_words", "reference",
           "combine_reference"]


def _plan(inst, attr, v):
    if not isinstance(v, _gemv.GemvPlan):
        raise ValueError(f"plan must be a GemvPlan, got {type(v).__name__}")
    if v.epilogue not in ("none", "swiglu"):
        raise ValueError(f"the experts' GEMV takes epilogue 'none' or 'swiglu', not "
                         f"{v.epilogue!r}")
    if v.pdl:
        raise ValueError("the plan must have pdl=False: the experts' GEMV waits for the "
                         "ids itself (ExpertGemvSpec.pdl)")


@attrs.frozen(init=False)
class ExpertGemvSpec:
    """The experts' GEMV of ``plan`` (a :class:`~ptxgen.kernels.gemv.GemvPlan`
    with ``pdl=False``); the plan's fields given as keywords (``target``,
    ``rows``, ...) replace its own, as a plan takes them.

    Parameters
    ----------
    plan : GemvPlan
        The GEMV run for each selected expert (``M`` rows of ``K``).
    x_slot : bool
        Each expert reads its own x (``x + j K``), else all read one.
    tokens : bool
        Up to T tokens (``grid.z``), T read from ``t_ptr``.
    combine : bool
        The experts' outputs weighted and added into the residual in the
        same launch (one token; epilogue ``none``).
    pdl : bool
        Built for programmatic dependent launch (waits before reading the ids).
    """

    plan: object = attrs.field(validator=_plan)
    x_slot: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    tokens: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    pdl: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    combine: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __init__(self, plan, x_slot=False, tokens=False, pdl=False, combine=False,
                 **plan_changes):
        if plan_changes:
            _plan(self, None, plan)
            plan = plan.evolve(**plan_changes)
        self.__attrs_init__(plan, x_slot, tokens, pdl, combine)

    def __attrs_post_init__(self):
        if self.x_slot and self.plan.norm:
            raise ValueError("x_slot: the fused RMSNorm is for one x that every expert reads")
        if self.plan.norm_out:
            raise ValueError("the experts' GEMV stores no normed x (norm_out)")
        if self.combine and (self.tokens or self.plan.epilogue != "none"):
            raise ValueError("combine sums one token's down projections: it takes epilogue "
                             f"'none' and no tokens, not epilogue {self.plan.epilogue!r}"
                             f"{' with tokens' if self.tokens else ''}")
        if self.pdl and not has_griddepcontrol(self.target):
            raise ValueError(f"pdl=True needs griddepcontrol (sm_90 or newer); target is "
                             f"{self.target}")

    @property
    def target(self) -> str:
        return self.plan.target

    def evolve(self, **changes) -> "ExpertGemvSpec":
        """This spec with ``pdl``, ``x_slot``, ``tokens`` or the plan's fields (``target``
        included) changed."""
        own = {n: changes.pop(n) for n in ("pdl", "x_slot", "tokens", "combine", "plan")
               if n in changes}
        return attrs.evolve(self, **own, **changes)

    @property
    def kernel_name(self) -> str:
        return (f"moe_{self.plan.kernel_name}{'_xs' if self.x_slot else ''}"
                f"{'_tok' if self.tokens else ''}{'_cmb' if self.combine else ''}")


def _expert_params(spec: ExpertGemvSpec, held: dict):
    """The GEMV's parameters with ``ids`` (and ``combine``'s) added, and its
    weight, x and y pointers moved to the CTA row's expert
    (:func:`declare_params`'s result); ``held`` receives what
    :func:`_combine_finish` reads."""
    def params(k, plan, warps):
        ws, x, r, y, mrows, rpc, red, norm = declare_params(k, plan, warps)
        ids = k.param_ptr("ids", s32)
        t_ptr = k.param_ptr("t_ptr", u32) if spec.tokens else None
        if spec.combine:
            held.update(y=y, m=mrows, weights=k.param_ptr("weights", f32),
                        r=k.param_ptr("r", f32), out=k.param_ptr("out", f32),
                        counter=k.param_ptr("counter", u32),
                        last=k.shared_array("is_last", u32, 4, align=16))
        pdl_wait(k, spec)
        slot = k.ctaid.y
        if spec.tokens:
            t = k.ctaid.z
            k.exit(guard=t >= k.ld(t_ptr[0]))
            if not spec.x_slot:
                x = k.ptr_add(x, t * plan.k)
            slot = t * k.nctaid.y + slot
        e = k.ld(ids[slot]).bitcast(u32)
        off = k.mul_wide(e * mrows, plan.row_bytes)
        ws = [k.ptr_add(w, off) for w in ws]
        y = k.ptr_add(y, slot * mrows)
        if spec.x_slot:
            x = k.ptr_add(x, slot * plan.k)
        return ws, x, r, y, mrows, rpc, red, norm
    return params


def _combine_finish(spec: ExpertGemvSpec, held: dict):
    """The end of a ``combine`` kernel: the row group's last CTA sums the
    experts' rows into ``out`` (the module docstring)."""
    R = spec.plan.rows

    def finish(k, rows, tid):
        row0, row_end, step = rows
        y, m, wts, last = held["y"], held["m"], held["weights"], held["last"]
        cnt = held["counter"][k.ctaid.x]
        n_used = k.nctaid.y
        # this CTA's y rows are visible to the gpu before it counts itself
        k.fence("acq_rel", "gpu")
        k.bar_sync(0)
        with k.if_(tid.eq(0)):
            old = k.atom("add", cnt, 1)
            k.st(last[0], k.select((old + 1).eq(n_used), k.mov(1, u32), k.mov(0, u32)))
        k.bar_sync(0)
        with k.if_(k.ld(last[0]).eq(1)):
            k.fence("acq_rel", "gpu")
            with k.if_(tid < R):
                with k.for_range(row0, row_end, step) as rg:
                    row = rg + tid
                    with k.if_(row < row_end):
                        acc = k.var(f32, 0.0)
                        acc.set(k.mul(k.ld(y[row], cache="cg"), k.ld(wts[0]), rnd="rn"))
                        with k.for_range(1, n_used) as j:
                            v = k.mul(k.ld(y[j * m + row], cache="cg"), k.ld(wts[j]), rnd="rn")
                            acc.set(k.add(acc, v, rnd="rn"))
                        # plain ld, not .nc: out may be r
                        k.st(held["out"][row], k.add(acc, k.ld(held["r"][row]), rnd="rn"))
            with k.if_(tid.eq(0)):
                k.st(cnt, 0)
    return finish


def build(spec: ExpertGemvSpec) -> ptxgen.Module:
    """PTX for ``spec``: the plan's GEMV parameters, then ``ids`` (and
    ``combine``'s); the kernel named ``spec.kernel_name``."""
    held = {}
    finish = _combine_finish(spec, held) if spec.combine else None
    mod = _gemv.build(spec.plan, params=_expert_params(spec, held), finish=finish)
    mod[spec.plan.kernel_name].name = spec.kernel_name
    return mod


def launch_geometry(spec: ExpertGemvSpec, m: int, n_used: int, t_rows: int = 1):
    """The launch for ``m`` rows of each of ``n_used`` experts (of each of
    ``t_rows`` tokens, the most a ``tokens`` launch serves)."""
    for name, v in (("n_used", n_used), ("t_rows", t_rows)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not spec.tokens and t_rows != 1:
        raise ValueError(f"an experts' GEMV without tokens takes one token, not {t_rows}")
    g = _gemv.launch_geometry(spec.plan, m)
    return g.evolve(kernel=spec.kernel_name, grid=(g.grid[0], n_used, t_rows))


def counter_words(spec: ExpertGemvSpec, m: int) -> int:
    """The u32 words a ``combine`` launch of ``m`` rows counts on (its
    ``grid.x``)."""
    if not spec.combine:
        raise ValueError("only a combine spec counts its row groups")
    return _gemv.launch_geometry(spec.plan, m).grid[0]


def reference(spec: ExpertGemvSpec, w_raw, ids, x, w_up=None, norm_w=None, eps=None):
    """float64: ``[n_used, M]``, row ``j`` the plan's GEMV reference of expert
    ``ids[j]`` (``w_raw``: ``uint8 [n_expert, M, row_bytes]``) and ``x``
    (``[K]``, or ``[n_used, K]`` with ``x_slot``): one token's."""
    x = np.asarray(x)
    out = []
    for j, e in enumerate(ids):
        xj = x[j] if spec.x_slot else x
        out.append(_gemv.reference(spec.plan, w_raw[e], xj,
                                   w_up=None if w_up is None else w_up[e],
                                   norm_w=norm_w, eps=eps))
    return np.stack(out)


def combine_reference(spec: ExpertGemvSpec, w_raw, ids, x, weights, r):
    """float64 ``r + sum_j weights[j] y[j]`` with ``y`` :func:`reference`'s."""
    y = reference(spec, w_raw, ids, x)
    return np.asarray(r, np.float64) + np.asarray(weights, np.float64) @ y


def _canon(qtype, k, epilogue="none", x_slot=False, tokens=False, target="sm_80",
           combine=False, **config):
    return ExpertGemvSpec(_gemv.GemvPlan(_gemv.GemvSpec(qtype, k, epilogue=epilogue,
                                                        target=target),
                                         _gemv.GemvConfig(**config)), x_slot=x_slot,
                          tokens=tokens, combine=combine)


CANONICAL = {
    "moe_gemv_q4_k_swiglu": _canon("Q4_K", 2048, "swiglu", rows=4, stages=3, dot="dp4a"),
    "moe_gemv_q6_k_xs": _canon("Q6_K", 768, x_slot=True, rows=2),
    "moe_gemv_q4_k_xs": _canon("Q4_K", 768, x_slot=True, rows=4),
    "moe_gemv_q6_k_xs_cmb": _canon("Q6_K", 768, x_slot=True, combine=True, rows=2),
    "moe_gemv_q4_k_xs_cmb": _canon("Q4_K", 768, x_slot=True, combine=True, rows=4, stages=3,
                                   dot="dp4a", target="sm_90"),
    "moe_gemv_q4_k_swiglu_tok": _canon("Q4_K", 2048, "swiglu", tokens=True, rows=4, stages=2,
                                       dot="dp4a", target="sm_90"),
}

registry.register("moe_gemv", ExpertGemvSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
