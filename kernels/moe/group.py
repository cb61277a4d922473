"""A chunk's (token, slot) pairs grouped by expert on the device: a counting
sort of the router's ids, so the experts' GEMM (:mod:`.expert_gemm`) reads
each chosen expert's weights once for all the tokens that chose it.

From ``ids`` (s32 ``[T, n_used]``, T read from ``t_ptr``) it writes
``counts[e]`` (u32 ``[n_expert]``, the pairs that chose expert ``e``),
``offsets[e]`` (u32, the exclusive prefix sum of the counts) and ``pairs``
(u32 ``[T n_used]``): the pair indices ``p = t n_used + j`` of expert
``e`` at ``pairs[offsets[e] ..]``, in increasing ``p`` (a stable sort, so the
result is the same on every run).

One CTA of ``block`` threads, its warps each owning a contiguous segment of
the ``T n_used`` ids (a whole number of 32-id rounds), so the pairs of an
expert are placed warp by warp and, within a warp, round by round.  A round
gives each lane one id; the lanes holding the same expert find each other
with one ballot per bit of the id (their *peer mask*), and the highest
of them (the *leader*) speaks for the group with one shared-memory atomic
add (leaders of the warp's later rounds add to the same words):

1. each warp counts its segment's pairs per expert into its own row of a
   ``[warps, n_expert]`` table in shared memory (the leader adds the
   popcount of the peer mask);
2. a thread per expert turns its column into the exclusive prefix over the
   warps and the expert's count, and one warp scans the counts into the
   offsets (shuffles across its lanes, each lane summing a run of experts);
3. each warp walks its segment again: a lane's pair goes to ``offsets[e]``
   plus its warp's prefix plus the peers below it in the round, the leader
   taking the prefix as its add's old value and shuffling it to its peers
   (the shuffle waits for the add, so the warp's rounds advance the prefix
   in order).

Ids outside ``0 .. n_expert - 1`` are dropped (counted and placed nowhere).

Launch: one CTA of ``block`` threads.
"""

from __future__ import annotations

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import s32, u32

from ..plan import LaunchGeometry
from ..spec_fields import check_block, pdl_field, pdl_prologue, target_field

__all__ = ["MoeGroupSpec", "build", "default_block", "launch_geometry", "reference"]


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
        Threads of the one CTA (a warp a segment of the ids), by default
        :func:`default_block`; the ``[block / 32, n_expert]`` u32 table must
        fit :data:`TABLE_BYTES`.
    """

    n_expert: int = attrs.field(validator=_positive(1024))
    n_used: int = attrs.field(validator=_positive(64))
    block: int = attrs.field(default=attrs.Factory(lambda s: default_block(s.n_expert),
                                                   takes_self=True), validator=check_block)
    target: str = target_field()
    pdl: bool = pdl_field()

    def __attrs_post_init__(self):
        if self.n_used > self.n_expert:
            raise ValueError(f"n_used={self.n_used} is more than n_expert={self.n_expert}")
        if _table_bytes(self) > TABLE_BYTES:
            raise ValueError(f"block={self.block} gives {self.block // 32} warps whose "
                             f"[warps, n_expert={self.n_expert}] count table is "
                             f"{_table_bytes(self)} bytes, more than {TABLE_BYTES}; "
                             f"take fewer threads (default_block)")

    @property
    def kernel_name(self) -> str:
        return f"moe_group_e{self.n_expert}_k{self.n_used}_b{self.block}"


#: the most shared memory the per-warp count table may take
TABLE_BYTES = 32768


def _table_bytes(spec) -> int:
    return (spec.block // 32) * spec.n_expert * 4


def default_block(n_expert: int) -> int:
    """Threads for ``n_expert`` experts: 16 warps (short segments), fewer
    where their count table would pass :data:`TABLE_BYTES`."""
    return 32 * max(1, min(16, TABLE_BYTES // (4 * n_expert)))


def _peers(k, v, valid, bits):
    """The lanes of the warp holding the same id as this one, among the
    ``valid`` ones (one ballot per bit of the id; garbage where not valid)."""
    m = k.vote_sync("ballot", valid)
    for b in range(bits):
        one = ((v >> b) & 1).eq(1)
        bal = k.vote_sync("ballot", one)
        m = m & k.select(one, bal, ~bal)
    return m


def _rounds(k, spec, ids, n, warp, lane, visit):
    """Walk this warp's segment of the ``n`` ids 32 at a time, every lane
    of the warp in every round; ``visit(p, v, valid, peers)`` with the
    lane's pair index, its id (u32), whether it is a pair of a known expert
    and its peer mask."""
    W = spec.block // 32
    bits = max(1, (spec.n_expert - 1).bit_length())
    seg = ((n + (W - 1)) // W + 31) & 0xFFFFFFE0
    lo = warp * seg
    hi = k.min(lo + seg, n)
    with k.for_range(lo, hi, 32) as base:
        p = base + lane
        v = k.var(u32, 0xFFFFFFFF)
        with k.if_(p < hi):
            v.set(k.ld(ids[p]).bitcast(u32))
        valid = v < spec.n_expert
        visit(p, v, valid, _peers(k, v, valid, bits))


def build(spec: MoeGroupSpec) -> ptxgen.Module:
    """PTX for ``spec``; parameters ``ids, t_ptr, counts, offsets, pairs``."""
    E, B, W = spec.n_expert, spec.block, spec.block // 32
    mod = ptxgen.Module(spec.target)
    with mod.kernel(spec.kernel_name, reqntid=B) as k:
        ids = k.param_ptr("ids", s32)
        t_ptr = k.param_ptr("t_ptr", u32)
        counts = k.param_ptr("counts", u32)
        offsets = k.param_ptr("offsets", u32)
        pairs = k.param_ptr("pairs", u32)
        table = k.shared_array("warp_counts", u32, W * E)
        sums = k.shared_array("expert_offsets", u32, E)
        pdl_prologue(k, spec)
        tid = k.tid.x
        lane, warp = tid & 31, tid >> 5
        for i in k.strided(tid, W * E, B):
            k.st(table[i], 0)
        n = k.ld(t_ptr[0]) * spec.n_used
        k.bar_sync()

        def count(p, v, valid, m):
            lead = k.pand(valid, (m >> lane).eq(1))
            k.red("add", table[warp * E + v], k.popc(m), guard=lead)
        _rounds(k, spec, ids, n, warp, lane, count)
        k.bar_sync()
        for e in k.strided(tid, E, B):          # the warps' prefix of each expert
            run = k.var(u32, 0)
            for w in range(W):
                c = k.ld(table[w * E + e])
                k.st(table[w * E + e], run)
                run.set(run + c)
            k.st(counts[e], run)
            k.st(sums[e], run)
        k.bar_sync()
        per = -(-E // 32)                        # experts a lane of warp 0 sums
        with k.if_(warp.eq(0)):
            first = lane * per
            cs = []
            tot = k.var(u32, 0)
            for j in range(per):
                c = k.var(u32, 0)
                with k.if_(first + j < E):
                    c.set(k.ld(sums[first + j]))
                cs.append(c)
                tot.set(tot + c)
            inc = k.var(u32, tot)
            for d in (1, 2, 4, 8, 16):
                up = k.shfl_up(inc, d)
                inc.set(k.select(lane >= d, inc + up, inc))
            run = k.var(u32, inc - tot)
            for j, c in enumerate(cs):
                ok = first + j < E
                k.st(sums[first + j], run, guard=ok)
                k.st(offsets[first + j], run, guard=ok)
                run.set(run + c)
        k.bar_sync()
        below = (k.mov(1, u32) << lane) - 1

        def place(p, v, valid, m):
            lead = k.pand(valid, (m >> lane).eq(1))
            at = k.var(u32, 0)
            with k.if_(lead):
                h = k.atom("add", table[warp * E + v], k.popc(m))
                at.set(h + k.ld(sums[v]))
            start = k.shfl_idx(at, (31 - k.clz(m)) & 31)
            k.st(pairs[start + k.popc(m & below)], p, guard=valid)
        _rounds(k, spec, ids, n, warp, lane, place)
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
