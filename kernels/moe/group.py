"""A chunk's (token, slot) pairs grouped by expert on the device: a counting
sort of the router's ids, so the experts' GEMM (:mod:`.expert_gemm`) reads
each chosen expert's weights once for all the tokens that chose it.

From ``ids`` (s32 ``[T, n_used]``, T read from ``t_ptr``) it writes
``counts[e]`` (u32 ``[n_expert]``, the pairs that chose expert ``e``),
``offsets[e]`` (u32, the exclusive prefix sum of the counts) and ``pairs``
(u32 ``[T n_used]``): the pair indices ``p = t n_used + j`` of expert
``e`` at ``pairs[offsets[e] ..]``, in increasing ``p`` (a stable sort, so the
result is the same on every run).

One CTA: thread ``i`` owns the experts ``i, i + block, ..``; it counts each
one's pairs over the ids, thread 0 sums the counts into the offsets (after
a barrier), and each thread then walks the ids again writing its experts'
pairs in order.  The ids are read twice from global memory, a tile of
about :data:`TILE` at a time into shared memory, where every thread reads them
all (the same words at once: broadcasts).

Launch: one CTA of ``block`` threads.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import s32, u32

from ..plan import LaunchGeometry
from ..spec_fields import block_field, pdl_field, pdl_prologue, target_field

__all__ = ["MoeGroupSpec", "build", "launch_geometry", "reference"]


def _positive(limit):
    def check(inst, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= limit):
            raise ValueError(f"{attr.name} must be an int in 1..{limit}, got {v!r}")
    return check


@attrs.frozen
class MoeGroupSpec:
    """The counting sort of ``n_used`` ids a token over ``n_expert`` experts.

    Parameters
    ----------
    n_expert : int
        Experts (1..1024).
    n_used : int
        Experts a token (1..64, at most ``n_expert``).
    block : int
        Threads of the one CTA.
    """

    n_expert: int = attrs.field(validator=_positive(1024))
    n_used: int = attrs.field(validator=_positive(64))
    block: int = block_field(128)
    target: str = target_field()
    pdl: bool = pdl_field()

    def __attrs_post_init__(self):
        if self.n_used > self.n_expert:
            raise ValueError(f"n_used={self.n_used} is more than n_expert={self.n_expert}")

    @property
    def kernel_name(self) -> str:
        return f"moe_group_e{self.n_expert}_k{self.n_used}_b{self.block}"


#: ids staged in shared memory at a time (4 KB; a multiple of the block below)
TILE = 1024


def _tile(spec) -> int:
    return spec.block * max(1, TILE // spec.block)


def _scan(k, spec, ids, tile, n, tid, visit):
    """Walk the ``n`` ids a tile at a time: the CTA stages a tile in shared
    memory (ids past ``n`` as -1, which matches no expert), then every
    thread reads it four ids a load; ``visit(p, id)`` for each pair index
    ``p`` and its id (u32) in increasing ``p``."""
    B, nt = spec.block, _tile(spec)
    with k.for_range(0, n, nt) as base:
        k.bar_sync()
        for i in range(nt // B):
            idx = base + (tid + i * B)
            v = k.var(u32, 0xFFFFFFFF)
            with k.if_(idx < n):
                v.set(k.ld(ids[idx]).bitcast(u32))
            k.st(tile[tid + i * B], v)
        k.bar_sync()
        m = k.min(n - base, nt)
        with k.for_range(0, m, 4) as j:
            vals = k.ld(tile[j], vec=4)
            for q, v in enumerate(vals):
                visit(base + j + q, v)


def build(spec: MoeGroupSpec) -> ptxgen.Module:
    """PTX for ``spec``; parameters ``ids, t_ptr, counts, offsets, pairs``."""
    E, B = spec.n_expert, spec.block
    mod = ptxgen.Module(spec.target)
    with mod.kernel(spec.kernel_name, reqntid=B) as k:
        ids = k.param_ptr("ids", s32)
        t_ptr = k.param_ptr("t_ptr", u32)
        counts = k.param_ptr("counts", u32)
        offsets = k.param_ptr("offsets", u32)
        pairs = k.param_ptr("pairs", u32)
        tile = k.shared_array("ids_tile", u32, _tile(spec), align=16)
        pdl_prologue(k, spec)
        tid = k.tid.x
        n = k.ld(t_ptr[0]) * spec.n_used
        owned = [(tid + i * B, (tid + i * B < E) if (i + 1) * B > E else None)
                 for i in range(math.ceil(E / B))]
        cs = [k.var(u32, 0) for _ in owned]

        def count(p, v):
            for c, (e, _) in zip(cs, owned):
                c.set(k.select(v.eq(e), c + 1, c))
        _scan(k, spec, ids, tile, n, tid, count)
        for c, (e, ok) in zip(cs, owned):
            k.st(counts[e], c, guard=ok)
        k.bar_sync()
        with k.if_(tid.eq(0)):
            run = k.var(u32, 0)
            with k.for_range(0, E) as e:
                c = k.ld(counts[e])
                k.st(offsets[e], run)
                run.set(run + c)
        k.bar_sync()
        os_ = []
        for e, ok in owned:
            o = k.var(u32, 0)
            if ok is None:
                o.set(k.ld(offsets[e]))
            else:
                with k.if_(ok):
                    o.set(k.ld(offsets[e]))
            os_.append(o)

        def place(p, v):
            for o, (e, ok) in zip(os_, owned):
                hit = v.eq(e) if ok is None else k.pand(v.eq(e), ok)
                k.st(pairs[o], p, guard=hit)
                o.set(k.select(hit, o + 1, o))
        _scan(k, spec, ids, tile, n, tid, place)
    return mod


def launch_geometry(spec: MoeGroupSpec):
    """One CTA of ``spec.block`` threads."""
    return LaunchGeometry(spec.kernel_name, (1,), spec.block)


def reference(ids, n_expert: int):
    """``(counts, offsets, pairs)`` of ``ids`` (``[T, n_used]``) in numpy:
    the pair indices sorted by expert, stably."""
    flat = np.asarray(ids, np.int64).reshape(-1)
    counts = np.bincount(flat, minlength=n_expert).astype(np.uint32)
    offsets = (np.cumsum(counts) - counts).astype(np.uint32)
    pairs = np.argsort(flat, kind="stable").astype(np.uint32)
    return counts, offsets, pairs


CANONICAL = {
    # the family's name dumps the first spec for any target: no PDL in it
    "moe_group": MoeGroupSpec(128, 8, target="sm_90"),
    "moe_group_pdl": MoeGroupSpec(128, 8, target="sm_90", pdl=True),
    "moe_group_small": MoeGroupSpec(6, 2, block=32),
}

registry.register("moe_group", MoeGroupSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
