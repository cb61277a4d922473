"""Flash decode: one query token against a KV cache, split-KV with online softmax.

``out[qh] = softmax(q[qh] . K[h]^T * sm_scale) @ V[h]`` over the first
``kv_len`` cache rows, for every query head ``qh`` and its KV head
``h = qh // group`` (GQA: ``n_q_heads = group * n_kv_heads``).

Layout
    ``q``, ``out``: f32 ``[n_q_heads, head_dim]``.  ``k_cache``, ``v_cache``:
    ``[n_kv_heads, capacity, head_dim]`` (f16, or f32), row ``pos`` of head
    ``h`` at element ``(h * capacity + pos) * head_dim``; 16-byte aligned.
    ``kv_len_ptr``: a device int32, clamped to ``[0, capacity]``, so a
    replayed CUDA graph sees the current length.
    Workspace: ``part_o`` f32 ``[n_q_heads, n_splits, head_dim]`` and
    ``part_ml`` f32 ``[n_q_heads, n_splits, 2]``.

Kernels (one module)
    ``split``: ``grid = (n_splits, n_kv_heads)``, ``block = 32 * warps``.
    The first ``n = min(n_splits, ceil(kv_len / min_keys))`` splits work:
    the ``g`` row groups (the block's rows loaded at once) of ``[0, kv_len)``
    are dealt out evenly, block ``(s, h)`` taking groups ``[s g / n, (s + 1)
    g / n)``, so the grid is fixed (graph-replay safe) while every length
    uses it and no block has more than one group more than another; a block
    past ``n`` writes a neutral ``(m, l, o) = (-1e30, 0, 0)`` and exits.
    ``head_dim / 8``
    lanes (f16; ``/ 4`` for f32)
    share one key row: each loads 16 bytes of K and of V with
    ``ld.global.nc.v4``, so a warp streams whole rows and the K/V bytes are
    read once for all ``group`` query heads.  Scores are prescaled by
    ``sm_scale * log2(e)`` (folded into q) and exponentiated with
    ``ex2.approx``; each lane group keeps a running max, sum and ``o`` and
    rescales once per tile of ``unroll`` keys (with ``prefetch``, the next
    tile's loads are in flight during this tile's math; with ``stages``, a
    ring of shared-memory stages filled by ``cp.async`` holds ``stages - 1``
    tiles in flight instead).  The lane groups of a warp
    are merged with shuffles, the warps through shared memory.
    ``combine``: ``grid = n_q_heads``, ``block = 32 * combine_warps`` (2 warps
    by default): warp ``w`` merges splits ``w, w + warps, ...``, ``max(6,
    16 // warps)`` at a time with every load of a round issued at once (one
    round for up to 16 splits with 2 warps): all its lanes read a
    split's ``(m, l)`` (one broadcast transaction) and lane ``i`` its
    ``head_dim / 32`` columns of the split's ``o``, merged online (``M = max
    m``, weights ``2^(m - M)``), so the warp needs no shuffles and no
    barrier.  An empty split's block writes ``(m, l, o) = (-1e30, 0, 0)``,
    so its weight needs no test on ``l`` (with one, ptxas predicates the
    ``o`` loads on it: a second round trip).  The warp partials meet in
    shared memory behind one barrier; thread ``j`` merges columns ``j, j +
    32 warps, ...`` and divides (``div.rn``; one warp divides its own
    columns, no barrier); ``kv_len = 0`` gives 0.  At most ``MAX_SPLITS``
    (512) splits.

    ``split`` on tensor cores (``mma=True``): the same parameters, partials
    and key dealing; a warp computes 16 keys at a time with
    ``mma.sync.m16n8k16`` (q and the probabilities as two f16 halves, K and V
    as stored, f32 accumulation); see :func:`_build_split_mma`.

Accuracy: within 1e-4 (relative to the largest output) of float64
attention over the same f16 K/V (``ex2.approx``: 2^-22 relative).
"""

from __future__ import annotations

import math

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.target import CTA_RESERVED_SHARED, MAX_STATIC_SHARED, TARGETS
from ptxgen.types import b32, f16, f32, s32, u8, u32

from .gemv.spec import MAX_RING_BYTES
from .spec_fields import pdl_field, pdl_prologue, pdl_wait

LOG2E = 1.0 / math.log(2.0)
NEG = -1.0e30           # finite "minus infinity" for running maxima
MAX_SPLITS = 512        # the most splits a launch may have
COMBINE_WARPS = 2       # warps of the combine block by default


@attrs.frozen
class FlashDecodeSpec:
    """A flash-decode kernel pair (split + combine).

    Parameters
    ----------
    head_dim : {64, 128, 256}
        (256 with an f16 cache only.)
    group : int
        Query heads per KV head (GQA), 1..16.
    kv_dtype : {"f16", "f32"}
    warps : int
        Warps per split block, 1..8.
    unroll : int
        Keys per lane group per tile (loads in flight), 1..8.
    chunks : {1, 2}
        16-byte chunks of a key row per lane (2 halves the lanes per row and
        the shuffles of the dot products, at the cost of registers).
    prefetch : bool
        Issue the next tile's K/V loads before this tile's math (register
        double buffering).
    min_keys : int
        Fewest keys a split takes: at short lengths only the first
        ``ceil(kv_len / min_keys)`` splits work, the others exit at once and
        the combine skips them (a power of two, 8..1024).
    min_blocks : int
        ``.minnctapersm`` hint for the split kernel (0: none): the driver's
        JIT then keeps the registers low enough for that many blocks per SM.
    fused_combine : bool
        True: one launch; the last split block of each KV head (an
        ``atom.add`` on ``counter[h]``) merges the partials of its ``group``
        heads and writes ``out``.  False (default: measured faster on H100,
        see docs/kernels.md): a separate ``combine`` kernel.
    merge_unroll : int
        Splits whose partials a thread of the fused merge loads per round
        (1..32).
    stages : int
        0 (default): each lane loads its K/V words into registers
        (``prefetch`` decides whether the next tile's are in flight).  2..8:
        the block streams its tiles through a ring of that many
        shared-memory stages with ``cp.async`` (``stages - 1`` tiles in
        flight, holding no registers; ``prefetch`` is then unused); the
        split kernel takes ``ring_bytes`` of dynamic shared memory.
    mma : bool
        The split on tensor cores (``mma.sync``, f16 cache, head_dim 64 or
        128, group at most 8): q and the probabilities enter as two f16
        halves each (22 bits), K and V as stored, f32 accumulation; a warp
        takes ``unroll`` chunks of 16 keys per trip (``prefetch`` does not
        apply: a trip's loads are issued when the trip before is done).
        ``early_kv`` works as for the CUDA-core split.  See
        :func:`_build_split_mma`.
    interleave : int
        (``mma`` only.)  0 (default): each split takes a contiguous range of
        keys.  ``t >= 1``: where the length gives every warp at least ``t``
        trips (``kv_len >= t * splits * warps * 16 * unroll``, decided in the
        kernel), a KV head's keys are dealt a warp trip (``16 * unroll``
        keys) at a time, round robin: block ``s`` of ``n`` takes trips ``s,
        s + n, s + 2 n, ...`` of ``[0, kv_len)``, its warps in turn, so every
        block of a head streams from the same moving window of the cache
        instead of its own contiguous range; shorter lengths keep the
        contiguous ranges (measured faster at L = 1024, docs/kernels.md).
    l2_prefetch : bool
        (``mma`` only.)  The K/V loads carry the ``.L2::256B`` prefetch-size
        hint: a lane's load reads 64 (K) or 128 (V) bytes of a 256-byte row
        (d = 128, f16), and the hint has L2 fetch the whole row from DRAM on
        the first miss, so the row's other loads find it there.
    l1_bypass : bool
        (``mma`` only.)  The K/V loads after the wait are
        ``ld.global.nc.L1::no_allocate``: the cache passes by L1 without
        taking its lines.  Measured on the H100 (docs/kernels.md): faster in
        a decode step and from 16K in a chain of calls over one cache, but
        2.6 and 5 µs slower at 4K and 8K in that chain, where the cache
        largely stays in L2 between calls (``ld.global.cg`` loads, which
        skip L1 too, do not lose there; the cause was not found).
    bypass_from : int
        (``l1_bypass`` only.)  0 (default): the loads bypass L1 at every
        length.  ``t >= 1``: only where every warp has at least ``t`` trips
        (``kv_len >= t * splits * warps * 16 * unroll``, decided in the
        kernel); shorter lengths run a second copy of the loop whose loads
        take L1 lines as without ``l1_bypass``.
    combine_warps : {1, 2, 4, 8, 16}
        Warps of a combine block (one block per query head; default 2).
        Each warp keeps a running merge of splits ``w, w + warps, ...`` in
        registers, ``max(6, 16 // warps)`` splits' loads in flight per round;
        with more than one warp the warps' partials then meet in shared
        memory behind a barrier, with one the warp divides and stores at
        once.  2 warps (one round at 16 splits) against the 16 of before,
        H100, chain of launches: 6.39-6.65 -> 6.03-6.05 us at L = 1024,
        8.09-8.38 -> 7.79-7.81 at 4096, level at 16K and 32K; decode step
        -9 us a token at context 128 (docs/kernels.md).
    per_sm : int
        At most this many split blocks resident on one SM (0: as many as
        registers and shared memory allow): the launch asks for enough
        dynamic shared memory (:attr:`dynamic_shared`) that one more would
        not fit.  Under PDL the split's blocks are placed while the grid
        before it drains, onto the few SMs with room; a cap spreads them.
    early_kv : bool
        Read the length and issue the first tile's K/V loads (``ld.global.cg``)
        before ``griddepcontrol.wait``, so under PDL they overlap the previous
        grid; q is loaded after the wait, and the cache row ``kv_len - 1`` is
        loaded again after it.  The contract (under PDL): the grid launched
        just before may write that row, nothing else the split reads before
        its wait (the length, other rows); as in a decode step, where the
        length is advanced at the end of the step and the RoPE launch appends
        the row.  Needs the register path (``stages=0``, ``prefetch``).
        Without PDL it only changes the order of the loads.
    target : str
    """

    head_dim: int = attrs.field(default=128, validator=attrs.validators.in_((64, 128, 256)))
    group: int = attrs.field(default=4)
    kv_dtype: str = attrs.field(default="f16", validator=attrs.validators.in_(("f16", "f32")))
    warps: int = attrs.field(default=4)
    unroll: int = attrs.field(default=3)
    chunks: int = attrs.field(default=1, validator=attrs.validators.in_((1, 2)))
    prefetch: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    min_keys: int = attrs.field(default=8)
    min_blocks: int = attrs.field(default=0, validator=attrs.validators.in_(range(0, 33)))
    fused_combine: bool = attrs.field(default=False,
                                      validator=attrs.validators.instance_of(bool))
    merge_unroll: int = attrs.field(default=16)
    stages: int = attrs.field(default=0)
    early_kv: bool = attrs.field(default=False)
    per_sm: int = attrs.field(default=0)
    mma: bool = attrs.field(default=False)
    interleave: int = attrs.field(default=0)
    l2_prefetch: bool = attrs.field(default=False)
    l1_bypass: bool = attrs.field(default=False)
    bypass_from: int = attrs.field(default=0)
    combine_warps: int = attrs.field(default=COMBINE_WARPS,
                                     validator=attrs.validators.in_((1, 2, 4, 8, 16)))
    target: str = attrs.field(default="sm_80", validator=attrs.validators.in_(tuple(TARGETS)))
    pdl: bool = pdl_field()

    @group.validator
    def _check_group(self, _, v):
        if not (isinstance(v, int) and 1 <= v <= 16):
            raise ValueError(f"group must be in 1..16, got {v!r}")

    @warps.validator
    def _check_warps(self, _, v):
        if not (isinstance(v, int) and 1 <= v <= 8):
            raise ValueError(f"warps must be in 1..8, got {v!r}")

    @min_keys.validator
    def _check_min_keys(self, _, v):
        if not (isinstance(v, int) and 8 <= v <= 1024 and v & (v - 1) == 0):
            raise ValueError(f"min_keys must be a power of two in 8..1024, got {v!r}")

    @merge_unroll.validator
    def _check_merge_unroll(self, _, v):
        if not (isinstance(v, int) and 1 <= v <= 32):
            raise ValueError(f"merge_unroll must be in 1..32, got {v!r}")

    @stages.validator
    def _check_stages(self, _, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and (v == 0 or 2 <= v <= 8)):
            raise ValueError(f"stages must be 0 (register prefetch) or 2..8 (cp.async ring), "
                             f"got {v!r}")

    @early_kv.validator
    def _check_early_kv(self, _, v):
        if not isinstance(v, bool):
            raise ValueError(f"early_kv must be a bool, got {v!r}")

    @mma.validator
    def _check_mma(self, _, v):
        if not isinstance(v, bool):
            raise ValueError(f"mma must be a bool, got {v!r}")

    @interleave.validator
    def _check_interleave(self, _, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 64):
            raise ValueError(f"interleave must be an int in 0..64 (trips per warp), got {v!r}")

    @l2_prefetch.validator
    @l1_bypass.validator
    def _check_load_hint(self, attr, v):
        """The K/V load hints: bools, for the tensor-core split's loads."""
        if not isinstance(v, bool):
            raise ValueError(f"{attr.name} must be a bool, got {v!r}")
        if v and not self.mma:
            raise ValueError(f"{attr.name} is built for the tensor-core split (mma=True), "
                             "whose K/V loads it marks")

    @bypass_from.validator
    def _check_bypass_from(self, _, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 64):
            raise ValueError(f"bypass_from must be an int in 0..64 (trips per warp), got {v!r}")
        if v and not self.l1_bypass:
            raise ValueError("bypass_from chooses where l1_bypass applies; it needs "
                             "l1_bypass=True")

    @per_sm.validator
    def _check_per_sm(self, _, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 32):
            raise ValueError(f"per_sm must be in 0..32, got {v!r}")

    @unroll.validator
    def _check_unroll(self, _, v):
        if not (isinstance(v, int) and 1 <= v <= 8):
            raise ValueError(f"unroll must be in 1..8, got {v!r}")

    @property
    def early_kv_possible(self) -> bool:
        """Whether the knobs pick the path ``early_kv`` is built for (the
        register prefetch path of the CUDA-core split, or the tensor-core
        split)."""
        return self.mma or (not self.stages and self.prefetch)

    def __attrs_post_init__(self):
        if self.mma:
            bad = _mma_shape_misses(self.head_dim, self.group, self.kv_dtype) + [
                what for what, ok in (
                ("chunks=1", self.chunks == 1),
                ("no ring (stages=0)", not self.stages),
                ("unroll at most 4", self.unroll <= 4)) if not ok]
            if bad:
                raise ValueError("mma=True needs " + ", ".join(bad))
        if self.interleave and not self.mma:
            raise ValueError("interleave needs the tensor-core split (mma=True)")
        if self.early_kv and not self.early_kv_possible:
            raise ValueError("early_kv needs the register prefetch path "
                             "(stages=0, prefetch=True) or mma=True")
        if self.lanes_per_key > 32:
            raise ValueError(f"head_dim {self.head_dim} with a {self.kv_dtype} cache needs "
                             f"{self.lanes_per_key} lanes per key row (at most 32)")
        if self.ring_bytes + self.shared_bytes > MAX_RING_BYTES:
            raise ValueError(f"a ring of {self.stages} stages of {self.tile} K and V rows "
                             f"needs {self.ring_bytes} bytes of shared memory besides "
                             f"{self.shared_bytes} (limit {MAX_RING_BYTES}); use fewer stages, "
                             f"warps or unroll")
        if self.per_sm:
            try:
                self.dynamic_shared
            except ValueError as e:
                raise ValueError(f"per_sm={self.per_sm}: {e}") from None
        if self.shared_bytes > MAX_STATIC_SHARED:
            raise ValueError(f"group {self.group} x head_dim {self.head_dim} x {self.warps} "
                             f"warps needs {self.shared_bytes} bytes of shared memory "
                             f"(limit {MAX_STATIC_SHARED}); use fewer warps")

    @property
    def elems_per_lane(self) -> int:
        return 8 if self.kv_dtype == "f16" else 4

    @property
    def lanes_per_key(self) -> int:
        return self.head_dim // (self.elems_per_lane * self.chunks)

    @property
    def row_groups(self) -> int:
        """Key rows a block loads at once (lane groups per block)."""
        return self.warps * (32 // self.lanes_per_key)

    @property
    def tile(self) -> int:
        """Keys per block per loop iteration (a split's last tile is masked)."""
        if self.mma:
            return 16 * self.warps * self.unroll
        return self.row_groups * self.unroll

    @property
    def shared_bytes(self) -> int:
        """Static shared memory of the split kernel (the warps' partials)."""
        return 4 * self.warps * self.group * (self.head_dim + 2)

    @property
    def row_bytes(self) -> int:
        """Bytes of one K or V cache row."""
        return self.head_dim * (2 if self.kv_dtype == "f16" else 4)

    @property
    def stage_bytes(self) -> int:
        """One ring stage: a tile's K rows, then its V rows."""
        return 2 * self.tile * self.row_bytes

    @property
    def ring_bytes(self) -> int:
        """Dynamic shared memory of the split kernel (0 without the ring)."""
        return self.stages * self.stage_bytes

    @property
    def dynamic_shared(self) -> int:
        """Dynamic shared memory a split launch asks for: the ring, raised
        with ``per_sm`` so that no more than ``per_sm`` blocks fit on an SM."""
        if not self.per_sm:
            return self.ring_bytes
        return TARGETS[self.target].capped_shared(self.per_sm, self.ring_bytes,
                                                  self.shared_bytes)

    @property
    def kernel_name(self) -> str:
        return (f"flash_decode_d{self.head_dim}_g{self.group}_{self.kv_dtype}"
                + ("_mma" if self.mma else "") + f"_w{self.warps}u{self.unroll}"
                + (f"c{self.chunks}" if self.chunks > 1 else "")
                + (f"s{self.stages}" if self.stages else
                   "p" if self.prefetch and not self.mma else "")
                + (f"k{self.min_keys}" if self.min_keys != 8 else "")
                + (f"m{self.min_blocks}" if self.min_blocks else "")
                + ("e" if self.early_kv else "")
                + (f"i{self.interleave}" if self.interleave else "")
                + ("l" if self.l2_prefetch else "") + ("n" if self.l1_bypass else "")
                + (str(self.bypass_from) if self.bypass_from else "")
                + (f"_fused{self.merge_unroll}" if self.fused_combine else ""))

    @property
    def split_name(self) -> str:
        return self.kernel_name + "_split"

    @property
    def combine_name(self) -> str:
        cw = self.combine_warps
        return self.kernel_name + "_combine" + (str(cw) if cw != COMBINE_WARPS else "")


def _build_split(m, spec: FlashDecodeSpec):
    d, G, U = spec.head_dim, spec.group, spec.unroll
    E, LK, RG, C = spec.elems_per_lane, spec.lanes_per_key, spec.row_groups, spec.chunks
    KW = 32 // LK
    nthreads = 32 * spec.warps
    cty = f16 if spec.kv_dtype == "f16" else f32
    with m.kernel(spec.split_name, reqntid=nthreads,
                  minnctapersm=spec.min_blocks or None) as k:
        early = spec.early_kv
        pdl_prologue(k, spec, wait=not early)
        (q, kc, vc, kv_len_ptr, part_o, part_ml, out, counter, cap, sm_scale, merge,
         (sm_m, sm_l, sm_o)) = _split_params(k, spec, cty)
        fused = spec.fused_combine

        tid = k.tid.x
        lane = tid & 31
        sub = lane & (LK - 1)                       # first 16-byte slot within the row
        # element offsets of this lane's chunks: slots sub, sub + LK, ...
        offs = [sub * E + LK * E * c for c in range(C)]
        rg = (tid >> 5) * KW + (lane >> (LK.bit_length() - 1))
        split = k.ctaid.x
        nsplit = k.nctaid.x
        h = k.ctaid.y

        def load_q():
            """This lane's slice of q for every head of the group, prescaled."""
            c = k.mul(sm_scale, LOG2E, rnd="rn")
            qs = []
            for g in range(G):
                qrow = (h * G + g) * d
                vals = []
                for off in offs:
                    for v4 in range(E // 4):
                        vals += list(k.ld(q[qrow + off + 4 * v4], vec=4, nc=True))
                qs.append([k.mul(x, c, rnd="rn") for x in vals])
            return qs

        # q first, so its latency overlaps the length's; with early_kv, q
        # comes from the grid before and is loaded after the wait
        qs = [] if early else load_q()

        L, start, split_end = _deal_keys(k, spec, kv_len_ptr, cap, split, nsplit, RG)

        if early:
            end = split_end()
            last = end - 1
            lastc = k.max(end, 1) - 1          # rows clamped to a valid one (0 when empty)
            row0 = h * cap

        def load_raw(ptr, idx, cg=False):
            """The lane's 16-byte chunks of one row: u32 words (f16) or f32
            (``ld.global.cg`` with ``cg``, else ``.nc``)."""
            out = []
            for c in range(C):
                a = ptr[idx] + LK * 16 * c            # the next 16-byte slot of the row
                out += list(k.ld(a, ty=u32 if cty is f16 else f32, vec=4,
                                 nc=not cg, cache="cg" if cg else None))
            return out

        def tile_row(base, lastrow, u):
            """Row ``u`` of this lane group in the tile at ``base``, clamped."""
            return k.min(base + rg + RG * u, lastrow)

        def row_idx(row):
            """Element index of this lane's first slot in cache row ``row``."""
            return (row0 + row) * d + sub * E

        def loads_at(idxs, cg=False):
            return ([load_raw(kc, i, cg) for i in idxs], [load_raw(vc, i, cg) for i in idxs])

        def tile_loads(base, lastrow):
            """K and V words of the tile at ``base`` (rows clamped to ``lastrow``)."""
            return loads_at([row_idx(tile_row(base, lastrow, u)) for u in range(U)])

        def as_vars(kw, vw):
            """The first tile's words as variables (the pipeline's registers)."""
            wty = u32 if cty is f16 else f32
            return ([[k.var(wty, x) for x in row] for row in kw],
                    [[k.var(wty, x) for x in row] for row in vw])

        if early:
            # the first tile in flight before the wait (a block with no rows
            # loads its clamped row, and drops it); then the grid before may
            # be waited for: q, and the row it may have appended, again
            rows0 = [tile_row(start, lastc, u) for u in range(U)]
            idx0 = [row_idx(r) for r in rows0]
            cur_k, cur_v = as_vars(*loads_at(idx0, cg=True))
            pdl_wait(k, spec)
            qs[:] = load_q()
            newest = L - 1
            for r, i, ck, cv in zip(rows0, idx0, cur_k, cur_v):
                with k.if_(r.eq(newest)):
                    for cur, ptr in ((ck, kc), (cv, vc)):
                        for c_, n_ in zip(cur, load_raw(ptr, i, cg=True)):
                            k.assign(c_, n_)
        with k.if_(start >= L):
            _write_empty_split(k, spec, part_o, part_ml, h, split, nsplit, tid, merge)
        if not early:
            end = split_end()
            last = end - 1

        m_run = [k.var(f32, NEG) for _ in range(G)]
        l_run = [k.var(f32, 0.0) for _ in range(G)]
        o_run = [[k.var(f32, 0.0) for _ in range(E * C)] for _ in range(G)]
        if not early:
            row0 = h * cap

        def to_f32(words):
            if cty is f32:
                return words
            out = []
            for w in words:
                lo, hi = k.unpack(w, f16, 2)
                out += [lo.to(f32), hi.to(f32)]
            return out

        def tile_math(base, kw, vw):
            valid = [base + rg + RG * u < end for u in range(U)]
            kf = [to_f32(x) for x in kw]
            vf = [to_f32(x) for x in vw]
            for g in range(G):
                s = []
                for u in range(U):
                    dot = k.mul(qs[g][0], kf[u][0], rnd="rn")
                    for e in range(1, E * C):
                        dot = k.fma(qs[g][e], kf[u][e], dot)
                    off = LK // 2
                    while off:
                        dot = dot + k.shfl_xor(dot, off)
                        off //= 2
                    s.append(k.select(valid[u], dot, k.mov(float("-inf"), f32)))
                mt = s[0]
                for x in s[1:]:
                    mt = k.max(mt, x)
                m_new = k.max(m_run[g], mt)
                alpha = k.ex2(m_run[g] - m_new)
                ps = [k.ex2(x - m_new) for x in s]
                psum = ps[0]
                for x in ps[1:]:
                    psum = psum + x
                k.fma(l_run[g], alpha, psum, out=l_run[g])
                for e in range(E * C):
                    acc = k.mul(o_run[g][e], alpha, rnd="rn")
                    for u in range(U):
                        acc = k.fma(ps[u], vf[u][e], acc)
                    k.assign(o_run[g][e], acc)
                k.assign(m_run[g], m_new)

        if spec.stages:
            _ring_loop(k, spec, kc, vc, row0, start, end, rg, sub, tid, tile_math)
        elif not spec.prefetch:
            with k.for_range(start, end, spec.tile) as base:
                tile_math(base, *tile_loads(base, last))
        else:
            # software pipeline: the next tile's loads are issued before this
            # tile's math; rows are clamped to a valid one (row 0 when empty)
            if not early:
                lastc = k.max(end, 1) - 1
                cur_k, cur_v = as_vars(*tile_loads(start, lastc))
            with k.for_range(start, end, spec.tile) as base:
                nk, nv = tile_loads(base + spec.tile, lastc)
                tile_math(base, cur_k, cur_v)
                for cur, nxt in ((cur_k, nk), (cur_v, nv)):
                    for crow, nrow in zip(cur, nxt):
                        for c_, n_ in zip(crow, nrow):
                            k.assign(c_, n_)

        # merge the lane groups of each warp with shuffles, then the warps
        # through shared memory (slot = warp * G + g)
        warp = tid >> 5
        for g in range(G):
            mw = m_run[g]
            off = LK
            while off < 32:
                mw = k.max(mw, k.shfl_xor(mw, off))
                off *= 2
            scale = k.ex2(m_run[g] - mw)
            vals = [k.mul(l_run[g], scale, rnd="rn")]
            vals += [k.mul(x, scale, rnd="rn") for x in o_run[g]]
            off = LK
            while off < 32:
                vals = [v + k.shfl_xor(v, off) for v in vals]
                off *= 2
            slot = warp * G + g
            with k.if_(lane < LK):
                for c, off_e in enumerate(offs):
                    for v4 in range(E // 4):
                        first = 1 + c * E + 4 * v4
                        k.st(sm_o[slot * d + off_e + 4 * v4],
                             tuple(vals[first + j] for j in range(4)))
                with k.if_(sub.eq(0)):
                    k.st(sm_m[slot], mw)
                    k.st(sm_l[slot], vals[0])
        _merge_warps(k, spec, (sm_m, sm_l, sm_o), part_o, part_ml, h, split, nsplit, tid)
        if fused:
            k.place(merge)
            _fused_merge(k, spec, part_o, part_ml, out, counter, h, nsplit, tid)


def _deal_keys(k, spec, kv_len_ptr, cap, split, nsplit, unit):
    """The current length ``L``, clamped to ``[0, capacity]`` (read with
    ``ld.global.cg`` under ``early_kv``: before the wait it must come from
    L2, not a line an earlier grid left in L1), and this split's keys.  The
    first ``ceil(L / min_keys)`` splits (at most all) work; the length's
    groups of ``unit`` keys are dealt out evenly among them: split ``s``
    takes groups ``[s g / n, (s + 1) g / n)``, the others see ``start >= L``.
    Returns ``(L, start, split_end)``; ``split_end()`` emits one past the
    split's last key, where the caller wants it."""
    raw = k.ld(kv_len_ptr[0], cache="cg") if spec.early_kv else k.ld(kv_len_ptr[0])
    L = k.min(k.max(raw, 0).bitcast(u32), cap)
    ng = (L + (unit - 1)) // unit
    nact = k.max(k.min(nsplit, (L + (spec.min_keys - 1)) // spec.min_keys), 1)
    start = (split * ng) // nact * unit

    def split_end():
        return k.min(((split + 1) * ng) // nact * unit, L)
    return L, start, split_end


def _split_params(k, spec, cty):
    """The parameters both split kernels take, the fused merge's label (None
    without it) and the warps' partials in shared memory ``(sm_m, sm_l,
    sm_o)``."""
    d, G, NW = spec.head_dim, spec.group, spec.warps
    params = (k.param_ptr("q", f32, align=16), k.param_ptr("k_cache", cty, align=16),
              k.param_ptr("v_cache", cty, align=16), k.param_ptr("kv_len_ptr", s32),
              k.param_ptr("part_o", f32, align=16), k.param_ptr("part_ml", f32, align=8),
              k.param_ptr("out", f32, align=16), k.param_ptr("counter", u32),
              k.param("capacity", u32), k.param("sm_scale", f32))
    merge = k.label("$L_merge") if spec.fused_combine else None
    sm_o = k.shared_array("sm_o", f32, NW * G * d, align=16)
    sm_m = k.shared_array("sm_m", f32, NW * G, align=16)
    sm_l = k.shared_array("sm_l", f32, NW * G, align=16)
    return params + (merge, (sm_m, sm_l, sm_o))


def _write_empty_split(k, spec, part_o, part_ml, h, split, nsplit, tid, merge):
    """A split with no rows: the neutral partial ``(m, l, o) = (-1e30, 0,
    0)`` for every head of the group, then exit (or, with the fused merge,
    on to ``merge``: the block still counts towards its head's merge)."""
    d, G = spec.head_dim, spec.group
    nthreads = 32 * spec.warps
    with k.if_(tid < G):
        pidx = (h * G + tid) * nsplit + split
        k.st(part_ml[pidx << 1], (k.mov(NEG, f32), k.mov(0.0, f32)))
    # and a zero o, so the combine may weigh every split's o (by 0)
    # without a select that would let ptxas predicate its load on l
    z = k.mov(0.0, f32)
    for col in k.strided(tid, d // 4, nthreads):      # 16-byte stores per row
        for g in range(G):
            k.st(part_o[((h * G + g) * nsplit + split) * d + 4 * col], (z, z, z, z))
    if merge is not None:
        k.bra(merge, uni=True)
    else:
        k.exit()


def _merge_warps(k, spec, shared, part_o, part_ml, h, split, nsplit, tid):
    """After a barrier, merge the warps' partials in shared memory (slot
    ``warp * G + g``: ``sm_m``, ``sm_l``, ``sm_o`` rows of ``head_dim``) and
    store the split's ``part_o``/``part_ml``: thread ``i`` takes items ``i,
    i + threads, ...`` of ``(head g, column j)``."""
    d, G, NW = spec.head_dim, spec.group, spec.warps
    sm_m, sm_l, sm_o = shared
    k.bar_sync(0)
    with k.for_range(tid, G * d, 32 * NW) as idx:
        g = idx // d
        j = idx - g * d
        mx, lsum, o = _merge_parts(k, [(sm_m[g + r * G], sm_l[g + r * G],
                                        sm_o[(g + r * G) * d + j]) for r in range(NW)])
        pidx = (h * G + g) * nsplit + split
        k.st(part_o[pidx * d + j], o)
        with k.if_(j.eq(0)):
            k.st(part_ml[pidx << 1], (mx, lsum))


LO_SCALE = 2048.0        # a split value's low f16 half is stored times 2^11
LO_WEIGHT = 1.0 / LO_SCALE


def _split_f16(k, x):
    """``x`` (f32) as ``hi + lo * 2^-11`` with ``hi = f16(x)`` and ``lo =
    f16((x - hi) * 2^11)``: 22 bits of ``x``'s significand in two halves
    (the scaled residual stays clear of f16's subnormals)."""
    hi = k.cvt(f16, x)
    lo = k.cvt(f16, k.mul(x - hi.to(f32), LO_SCALE, rnd="rn"))
    return hi, lo


def _a_halves(k, vals):
    """An ``A`` fragment of ``mma.m16n8k16`` from one lane's 4 f32 values of
    its row ``g`` (columns ``2 t, 2 t + 1, 2 t + 8, 2 t + 9``): registers 0
    and 2 (row ``g``) hold their high f16 halves, 1 and 3 (row ``g + 8``)
    their low halves (:func:`_split_f16`)."""
    hi, lo = zip(*(_split_f16(k, x) for x in vals))
    return (k.pack(b32, hi[0], hi[1]), k.pack(b32, lo[0], lo[1]),
            k.pack(b32, hi[2], hi[3]), k.pack(b32, lo[2], lo[3]))


def _build_split_mma(m, spec: FlashDecodeSpec):
    """The split kernel on tensor cores (``mma.sync.m16n8k16``, f16 in, f32
    accumulate); same parameters, partials and key dealing as the CUDA-core
    split.

    A warp takes 16 keys at a time (``unroll`` such chunks per loop trip);
    lane ``4 g + t`` is group ``g``, thread ``t`` of the fragments.

    * Scores ``S = Q K^T``: ``A`` is q, 16 rows: row ``g`` the f16 high part
      of query head ``g`` (prescaled by ``sm_scale * log2 e``; zero for
      ``g >= group``), row ``g + 8`` its low part times 2^11, so one mma
      gives both and ``s = hi + lo * 2^-11`` has q to 22 bits.  ``B`` is two
      n-tiles of 8 keys: lane ``(g, t)`` loads key ``8 j + g`` of the chunk,
      16-byte chunks ``t, t + 4, ...`` of its row, whose words are its ``B``
      registers for the k-tiles in turn (the dot product's dimension order
      is permuted, the same way in q's fragments).
    * Online softmax: lane ``(g, t)`` holds head ``g``'s scores of keys ``8 j
      + 2 t + e``; the head's maximum is taken over its 4 lanes (2
      shuffles); the output is rescaled only when some lane's maximum moved
      (a warp vote), so after the first chunks a trip skips it.
    * ``O += P V``: ``A`` is P, rows ``g`` / ``g + 8`` its high / low f16
      parts as for q, its key order the scores' (``S``'s accumulator
      fragment is ``A``'s layout).  ``B`` is V, 8 dimensions by the 16 keys:
      lane ``(g, t)`` loads keys ``2 t, 2 t + 1, 2 t + 8, 2 t + 9`` at
      dimensions ``64 c + 8 g .. + 8`` and pairs the halves of two keys with
      one ``prmt`` per register; n-tile ``(c, i)`` holds dimensions ``64 c +
      8 n + i`` (n its column), so lane ``(g, t)`` ends with head ``g``'s
      dimensions ``64 c + 16 t .. + 16``.
    * Loads: a trip's K and V words are issued at its top (the first trip's
      with ``early_kv`` before ``griddepcontrol.wait``, as in the CUDA-core
      split: q after the wait, and a lane whose row is ``kv_len - 1`` loads
      it again).  Issuing the next trip's loads before this trip's math
      needs more than 255 registers (measured on the H100, docs/kernels.md).

    The warps' partials meet in shared memory as in the CUDA-core split."""
    d, G, U, NW = spec.head_dim, spec.group, spec.unroll, spec.warps
    KT = d // 16            # k-tiles of q . k
    KC = d // 32            # 16-byte chunks of a K row per lane
    VC = d // 64            # 16-byte chunks of a V row per lane
    CH = 16                 # keys per chunk
    with m.kernel(spec.split_name, reqntid=32 * NW,
                  minnctapersm=spec.min_blocks or None) as k:
        pdl_prologue(k, spec, wait=not spec.early_kv)
        (q, kc, vc, kv_len_ptr, part_o, part_ml, out, counter, cap, sm_scale, merge,
         (sm_m, sm_l, sm_o)) = _split_params(k, spec, f16)
        fused = spec.fused_combine

        tid = k.tid.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        split = k.ctaid.x
        nsplit = k.nctaid.x
        h = k.ctaid.y

        def load_q():
            """q's A fragments per k-tile: head g's values at dimensions 8 (t +
            4 i) .., prescaled (by 0 for a row past the group), in halves."""
            c = k.mul(sm_scale, LOG2E, rnd="rn")
            cg = k.select(g < G, c, k.mov(0.0, f32))
            qrow = (h * G + k.min(g, G - 1)) * d + 8 * t
            qv = []
            for i in range(KC):
                vals = list(k.ld(q[qrow + 32 * i], vec=4, nc=True))
                vals += list(k.ld(q[qrow + 32 * i + 4], vec=4, nc=True))
                qv.append([k.mul(x, cg, rnd="rn") for x in vals])
            return [_a_halves(k, qv[kt // 2][4 * (kt % 2):4 * (kt % 2) + 4])
                    for kt in range(KT)]

        early = spec.early_kv
        # a lane reads a quarter (K) or half (V) of a row's 256 bytes per load
        l2 = "L2::256B" if spec.l2_prefetch else None
        l1 = "L1::no_allocate" if spec.l1_bypass else None
        qa = None if early else load_q()
        # this split's keys, dealt in chunks of 16
        L, start, split_end = _deal_keys(k, spec, kv_len_ptr, cap, split, nsplit, CH)
        first_key = start                        # the split's first key (empty: >= L)
        end, stride = split_end(), CH * U * NW
        if spec.interleave:
            # long enough: warp trips of CH * U keys dealt round robin, split s
            # taking trips s, s + n, ... of [0, L), its warps in turn (warp w:
            # s + w n, then NW n further each time); only the last is partial
            rnd = nsplit * (CH * U * NW)         # keys of one round
            il = L >= rnd * spec.interleave
            first_key = k.select(il, split * (CH * U), start)
            start = k.select(il, (warp * nsplit + split) * (CH * U), start)
            end = k.select(il, L, end)
            stride = k.select(il, rnd, k.mov(stride, u32))
        lastc = k.max(end, 1) - 1                # rows clamped to a valid one (0 when empty)
        row0 = h * cap
        wofs = warp * (CH * U)                   # the warp's first key in a trip
        if spec.interleave:
            wofs = k.select(il, k.mov(0, u32), wofs)

        def chunk_rows(kb):
            """The rows a lane loads for the chunk at ``kb``, clamped: K rows
            ``kb + 8 j + g`` (j = 0, 1), then V rows ``kb + 2 t + (0, 1, 8, 9)``."""
            return ([k.min(kb + (8 * j) + g, lastc) for j in range(2)]
                    + [k.min(kb + 2 * t + r, lastc) for r in (0, 1, 8, 9)])

        def row_words(n, row, cg=False, evict=None):
            """The lane's words of row ``row``: of K (``n < 2``: chunks ``t +
            4 i``) or of V (chunks ``8 g + 64 c``); ``evict`` the L1 hint of
            the ``.nc`` loads."""
            ptr, first, nchunk, stride = ((kc, 8 * t, KC, 32) if n < 2 else
                                          (vc, 8 * g, VC, 64))
            idx = (row0 + row) * d + first
            return [list(k.ld(ptr[idx + stride * c_], ty=b32, vec=4, nc=not cg,
                              cache="cg" if cg else None, prefetch=l2,
                              evict=None if cg else evict))
                    for c_ in range(nchunk)]

        def trip_loads(base, cg=False, evict=None):
            """Per chunk ``u``: the words of its 6 rows (K j = 0, 1, V r)."""
            return [[row_words(n, row, cg, evict) for n, row in
                     enumerate(chunk_rows(base + wofs + CH * u))] for u in range(U)]

        def as_vars(words):
            """The loaded words as variables (the pipeline's registers)."""
            if isinstance(words, (list, tuple)):
                return [as_vars(w) for w in words]
            return k.var(b32, words)

        if early:
            # the first trip in flight before the wait; then q, and the row
            # the grid before may have appended, loaded again
            first = as_vars(trip_loads(start, cg=True))
            pdl_wait(k, spec)
            qa = load_q()
            newest = L - 1
            # the rows again rather than kept from before the wait: holding
            # them across q's fragments costs registers (ptxas, sm_90: 255
            # instead of 251 at unroll 2)
            for u in range(U):
                for n, row in enumerate(chunk_rows(start + wofs + CH * u)):
                    with k.if_(row.eq(newest)):
                        for cw, nw in zip(_leaves(first[u][n]), _leaves(row_words(n, row, True))):
                            k.assign(cw, nw)
        with k.if_(first_key >= L):
            _write_empty_split(k, spec, part_o, part_ml, h, split, nsplit, tid, merge)

        m_run = k.var(f32, NEG)
        l_run = k.var(f32, 0.0)
        o_acc = [[k.var(f32, 0.0) for _ in range(4)] for _ in range(8 * VC)]
        zero = k.mov(0.0, f32)
        ninf = k.mov(float("-inf"), f32)

        def trip(base, words):
            """One trip: the scores of ``U`` chunks of 16 keys from ``base +
            wofs``, the online softmax, ``O += P V``."""
            # keys left from this lane's first score: key kb + 8 j + 2 t + e
            # is valid when 16 u + 8 j + e < end - (base + wofs + 2 t)
            left = (end - (base + wofs + 2 * t)).bitcast(s32)
            s = []
            for u in range(U):
                kw = words[u][:2]
                for j in range(2):
                    acc = (zero, zero, zero, zero)
                    for kt in range(KT):
                        i, e = divmod(kt, 2)
                        acc = k.mma_m16n8k16(qa[kt], (kw[j][i][2 * e], kw[j][i][2 * e + 1]),
                                             acc)
                    for e in range(2):
                        val = k.fma(acc[2 + e], LO_WEIGHT, acc[e])
                        s.append(k.select(left > CH * u + 8 * j + e, val, ninf))
            mt = s[0]
            for x in s[1:]:
                mt = k.max(mt, x)
            mt = k.max(mt, k.shfl_xor(mt, 1))
            mt = k.max(mt, k.shfl_xor(mt, 2))
            m_new = k.max(m_run, mt)
            with k.if_(k.vote_sync("any", m_new > m_run)):
                alpha = k.ex2(m_run - m_new)
                k.assign(l_run, k.mul(l_run, alpha, rnd="rn"))
                for acc in o_acc:
                    for r in acc:
                        k.assign(r, k.mul(r, alpha, rnd="rn"))
            k.assign(m_run, m_new)
            p = [k.ex2(x - m_new) for x in s]
            psum = p[0]
            for x in p[1:]:
                psum = psum + x
            k.assign(l_run, l_run + psum)
            for u in range(U):
                vw = words[u][2:]
                pa = _a_halves(k, p[4 * u:4 * u + 4])
                for ci in range(VC):
                    for n in range(8):
                        w, e = divmod(n, 2)
                        sel = 0x7632 if e else 0x5410
                        b = (k.prmt(vw[0][ci][w], vw[1][ci][w], sel),
                             k.prmt(vw[2][ci][w], vw[3][ci][w], sel))
                        acc = o_acc[8 * ci + n]
                        for r, x in zip(acc, k.mma_m16n8k16(pa, b, tuple(acc))):
                            k.assign(r, x)

        loop_from = start
        if early:
            # the first trip on the words loaded before the wait, the rest
            # loading theirs at the top of the trip, as without early_kv
            with k.if_(start < end):
                trip(start, first)
            loop_from = start + stride

        def loop(evict):
            with k.for_range(loop_from, end, stride) as base:
                trip(base, trip_loads(base, evict=evict))

        if spec.bypass_from:
            # two copies of the loop: the loads bypass L1 only from
            # bypass_from rounds of trips on
            with k.if_else(L >= nsplit * (CH * U * NW * spec.bypass_from)) as (by, plain):
                with by:
                    loop(l1)
                with plain:
                    loop(None)
        else:
            loop(l1)

        # the warp's partial: the head's sum over its 4 lanes; o = hi + lo 2^-11
        l_run = l_run + k.shfl_xor(l_run, 1)
        l_run = l_run + k.shfl_xor(l_run, 2)
        slot = warp * G + g
        with k.if_(g < G):
            for ci in range(VC):
                vals = [None] * 16
                for n in range(8):
                    acc = o_acc[8 * ci + n]
                    vals[n] = k.fma(acc[2], LO_WEIGHT, acc[0])
                    vals[8 + n] = k.fma(acc[3], LO_WEIGHT, acc[1])
                for v4 in range(4):
                    k.st(sm_o[slot * d + 64 * ci + 16 * t + 4 * v4],
                         tuple(vals[4 * v4:4 * v4 + 4]))
            with k.if_(t.eq(0)):
                k.st(sm_m[slot], m_run)
                k.st(sm_l[slot], l_run)
        _merge_warps(k, spec, (sm_m, sm_l, sm_o), part_o, part_ml, h, split, nsplit, tid)
        if fused:
            k.place(merge)
            _fused_merge(k, spec, part_o, part_ml, out, counter, h, nsplit, tid)


def _leaves(tree):
    """The registers of a nested list, in order."""
    if isinstance(tree, (list, tuple)):
        return [x for sub in tree for x in _leaves(sub)]
    return [tree]


def _ring_loop(k, spec, kc, vc, row0, start, end, rg, sub, tid, tile_math):
    """The split's tiles through a ring of ``spec.stages`` shared-memory
    stages filled with ``cp.async`` (16-byte copies that hold no registers):
    ``stages - 1`` tiles are in flight while one is computed.  A stage holds
    the tile's ``T`` K rows, then its ``T`` V rows, each row contiguous; the
    block's threads copy its chunks in turn (thread ``t`` chunks ``t, t +
    threads, ...`` of each matrix), rows past the split's last one clamped to
    it (masked in the math).  Each lane then reads its 16-byte slots of its
    rows from shared memory, the same words the register path loads."""
    d, S, T, C, LK, RG = (spec.head_dim, spec.stages, spec.tile, spec.chunks,
                          spec.lanes_per_key, spec.row_groups)
    nthreads = 32 * spec.warps
    rowb = spec.row_bytes
    esize = rowb // d
    cpr = rowb // 16                               # 16-byte chunks per row
    per_mat = T * cpr
    stage = spec.stage_bytes
    ring = k.dynamic_shared("ring", u8)
    ring_bytes = spec.ring_bytes
    lastc = k.max(end, 1) - 1                      # rows clamped here
    # this thread's chunks of a tile: row r_j (within the tile), byte col_j
    chunks = []
    for j in range(-(-per_mat // nthreads)):
        c = tid + j * nthreads if j else tid
        guard = (tid < per_mat - j * nthreads) if (j + 1) * nthreads > per_mat else None
        # (row in the tile, first element in the row, byte in the stage, guard)
        chunks.append((c >> (cpr.bit_length() - 1), (c & (cpr - 1)) * (16 // esize), c << 4,
                       guard))

    def issue(base, slot):
        """Copy the tile at row ``base`` into the stage at byte ``slot`` and
        commit (an empty group past the split's rows)."""
        with k.if_(base < end):
            for r, col, dst, guard in chunks:
                idx = (row0 + k.min(base + r, lastc)) * d + col
                for mi, cache in enumerate((kc, vc)):
                    k.cp_async(ring[slot + dst + mi * per_mat * 16], cache[idx], 16,
                               guard=guard)
        k.cp_async_commit()

    for j in range(S - 1):
        issue(start + j * T, k.mov(j * stage, u32))
    rd = k.var(u32, 0)                             # byte offset of this tile's stage
    # the lane's first slot of row rg + RG u: K at kofs[u], V per_mat * 16 on
    kofs = [(rg + RG * u) * rowb + sub * 16 for u in range(spec.unroll)]
    wty = u32 if spec.kv_dtype == "f16" else f32
    with k.for_range(start, end, T) as base:
        k.cp_async_wait(S - 2)
        k.bar_sync(0)
        # tile i + S - 1 goes to the stage tile i - 1 used
        wr = k.select(rd.eq(0), k.mov(ring_bytes - stage, u32), rd - stage)
        issue(base + (S - 1) * T, wr)
        kw, vw = [], []
        for ko in kofs:
            for words, moff in ((kw, 0), (vw, per_mat * 16)):
                row = []
                for c in range(C):
                    row += list(k.ld(ring[rd + (ko + moff + LK * 16 * c)], wty, vec=4))
                words.append(row)
        tile_math(base, kw, vw)
        nxt = rd + stage
        k.assign(rd, k.select(nxt.eq(ring_bytes), k.mov(0, u32), nxt))
    # no copy may be in flight when the block's shared memory is reused
    k.cp_async_wait(0)


def _fused_merge(k, spec, part_o, part_ml, out, counter, h, nsplit, tid):
    """The last block of KV head ``h`` to finish merges the partials of all
    splits for its ``group`` query heads into ``out`` (the argmax pattern:
    every thread's partial stores, ``bar.sync``, then thread 0's release
    fence and ``atom.add`` on ``counter[h]``; the last block acquires, reads
    the partials from L2 and resets the counter for the next launch)."""
    d, G, U = spec.head_dim, spec.group, spec.merge_unroll
    nthreads = 32 * spec.warps
    CG = d // 4                                 # 16-byte column groups of a row
    flag = k.shared_array("sm_last", u32, 4, align=16)
    k.bar_sync(0)                               # every partial of this block is stored
    with k.if_(tid.eq(0)):
        k.fence("acq_rel", "gpu")
        old = k.atom("add", counter[h], 1)
        k.st(flag[0], k.select((old + 1).eq(nsplit), k.mov(1, u32), k.mov(0, u32)))
    k.bar_sync(0)
    with k.if_(k.ld(flag[0]).eq(0)):
        k.exit()
    k.fence("acq_rel", "gpu")
    with k.if_(tid.eq(0)):
        k.st(counter[h], 0)                     # graph-replay safe: zero for the next launch
    lastsplit = nsplit - 1
    zero = k.mov(0.0, f32)
    # thread item (g, c): column group c of query head h * G + g, an online
    # merge over the splits (U splits' (m, l) and o loads in flight per round;
    # a dead split, l = 0, never wrote o: weight 0 and o dropped)
    with k.for_range(tid, G * CG, nthreads) as item:
        g = item // CG
        c = item - g * CG
        first = (h * G + g) * nsplit
        col = c << 2
        M = k.var(f32, NEG)
        Ls = k.var(f32, 0.0)
        O = [k.var(f32, 0.0) for _ in range(4)]
        with k.for_range(0, nsplit, U) as s0:
            mls, os_, oks = [], [], []
            for u in range(U):
                s = s0 + u
                sc = first + k.min(s, lastsplit)
                mls.append(k.ld(part_ml[sc << 1], vec=2, cache="cg"))
                os_.append(k.ld(part_o[sc * d + col], vec=4, cache="cg"))
            ms = []
            for u, (m_, l_) in enumerate(mls):
                ok = (s0 + u < nsplit) & (l_ > 0.0)
                oks.append(ok)
                ms.append(k.select(ok, m_, k.mov(NEG, f32)))
            mt = ms[0]
            for x in ms[1:]:
                mt = k.max(mt, x)
            m_new = k.max(M, mt)
            alpha = k.ex2(M - m_new)
            ws = [k.select(ok, k.ex2(x - m_new), zero) for ok, x in zip(oks, ms)]
            lsum = k.mul(Ls, alpha, rnd="rn")
            for w, (_m, l_) in zip(ws, mls):
                lsum = k.fma(w, l_, lsum)
            k.assign(Ls, lsum)
            for e in range(4):
                acc = k.mul(O[e], alpha, rnd="rn")
                for w, ok, o in zip(ws, oks, os_):
                    acc = k.fma(w, k.select(ok, o[e], zero), acc)
                k.assign(O[e], acc)
            k.assign(M, m_new)
        live = Ls > 0.0
        den = k.max(Ls, 1e-30)
        res = tuple(k.select(live, k.div(x, den), zero) for x in O)
        k.st(out[(h * G + g) * d + col], res)


def _merge_parts(k, parts):
    """Merge online-softmax partials ``(m, l, o)`` given as shared-memory
    addresses: ``(M, sum w l, sum w o)`` with ``M = max m``, ``w = 2^(m - M)``."""
    ms = [k.ld(pm) for pm, _, _ in parts]
    mx = ms[0]
    for x in ms[1:]:
        mx = k.max(mx, x)
    o = k.mov(0.0, f32)
    lsum = k.mov(0.0, f32)
    for m_, (_, pl, po) in zip(ms, parts):
        w = k.ex2(m_ - mx)
        o = k.fma(w, k.ld(po), o)
        lsum = k.fma(w, k.ld(pl), lsum)
    return mx, lsum, o


def _build_combine(m, spec: FlashDecodeSpec):
    d = spec.head_dim
    NWC = spec.combine_warps
    E = d // 32                     # columns per lane
    R = max(6, 16 // NWC)           # splits per warp per round of loads
    # minnctapersm 1: ptxas then keeps a round's loads in flight together
    # (aiming at more blocks per SM, it spreads them over two round trips)
    with m.kernel(spec.combine_name, reqntid=32 * NWC, minnctapersm=1) as k:
        pdl_prologue(k, spec)
        part_o = k.param_ptr("part_o", f32, align=16)
        part_ml = k.param_ptr("part_ml", f32, align=8)
        out = k.param_ptr("out", f32, align=16)
        nsplit = k.param("n_splits", u32)
        if NWC > 1:
            sm_m = k.shared_array("sm_m", f32, NWC, align=16)
            sm_l = k.shared_array("sm_l", f32, NWC, align=16)
            sm_o = k.shared_array("sm_o", f32, NWC * d, align=16)
        qh = k.ctaid.x
        tid = k.tid.x
        lane = tid & 31
        warp = tid >> 5
        first = qh * nsplit
        lastsplit = nsplit - 1
        zero = k.mov(0.0, f32)
        m_run = k.var(f32, NEG)
        l_run = k.var(f32, 0.0)
        o_run = [k.var(f32, 0.0) for _ in range(E)]

        def row(s):
            """This lane's E columns of split ``s``'s o (16/8-byte loads)."""
            base = (first + s) * d + lane * E
            if E == 2:
                return list(k.ld(part_o[base], vec=2))
            return [x for c in range(E // 4) for x in k.ld(part_o[base + 4 * c], vec=4)]

        def store_cols(dst, base, vals):
            """This lane's E columns ``vals`` to ``dst[base ...]`` (16/8-byte stores)."""
            for c in range(0, E, 4 if E >= 4 else 2):
                k.st(dst[base + c], tuple(vals[c:c + min(4, E)]))

        with k.for_range(warp, nsplit, NWC * R) as s0:
            ss = [s0 + u * NWC for u in range(R)]
            scs = [k.min(s, lastsplit) for s in ss]
            rows = [row(sc) for sc in scs]
            items = []
            for s, sc, v in zip(ss, scs, rows):
                mi, li = k.ld(part_ml[(first + sc) << 1], vec=2)
                items.append((s < nsplit, mi, li, v))
            # a split past the count (its index clamped) weighs 0; an empty
            # split has (m, l, o) = (-1e30, 0, 0), so its weight needs no test
            ms = [k.select(ok, mi, k.mov(NEG, f32)) for ok, mi, _, _ in items]
            mx = m_run
            for x in ms:
                mx = k.max(mx, x)
            alpha = k.ex2(m_run - mx)
            ws = [k.select(ok, k.ex2(x - mx), zero) for (ok, _, _, _), x in zip(items, ms)]
            lsum = k.mul(l_run, alpha, rnd="rn")
            for w, (_, _, li, _) in zip(ws, items):
                lsum = k.fma(w, li, lsum)
            k.assign(l_run, lsum)
            for e in range(E):
                acc = k.mul(o_run[e], alpha, rnd="rn")
                for w, (_, _, _, v) in zip(ws, items):
                    acc = k.fma(w, v[e], acc)
                k.assign(o_run[e], acc)
            k.assign(m_run, mx)
        if NWC == 1:
            # the warp holds the whole merge: divide and store its columns
            lpos = l_run > 0.0
            lden = k.max(l_run, 1e-30)
            res = [k.select(lpos, k.div(o, lden), zero) for o in o_run]
            store_cols(out, qh * d + lane * E, res)
            return
        with k.if_(lane.eq(0)):
            k.st(sm_m[warp], m_run)
            k.st(sm_l[warp], l_run)
        store_cols(sm_o, warp * d + lane * E, o_run)
        k.bar_sync(0)
        # thread t merges columns t, t + 32 NWC, ... (one column with 16 warps)
        for col in k.strided(tid, d, 32 * NWC):
            _, total, o = _merge_parts(k, [(sm_m[w], sm_l[w], sm_o[w * d + col])
                                           for w in range(NWC)])
            res = k.select(total > 0.0, k.div(o, k.max(total, 1e-30)), zero)
            k.st(out[qh * d + col], res)


def build(spec: FlashDecodeSpec) -> ptxgen.Module:
    """PTX with ``spec.split_name`` (and ``spec.combine_name`` unless
    ``spec.fused_combine``).

    split parameters: ``q, k_cache, v_cache, kv_len_ptr: s32*, part_o,
    part_ml, out, counter: u32*, capacity: u32, sm_scale: f32`` (``out`` and
    ``counter`` are unused, may be 0, without the fused combine; ``counter``
    holds ``n_kv_heads`` u32 that are 0 before the first launch and 0 again
    after every launch); combine parameters: ``part_o, part_ml, out,
    n_splits: u32``.
    """
    m = ptxgen.Module(spec.target)
    (_build_split_mma if spec.mma else _build_split)(m, spec)
    if not spec.fused_combine:
        _build_combine(m, spec)
    return m


def resident_blocks(spec: FlashDecodeSpec) -> int:
    """Split blocks one SM holds at once, estimated from the registers the
    CUDA 13 driver's JIT gave on an H100 (d = 128, group 4: 168 for unroll
    8, 138 unroll 4, 157 unroll 3 + prefetch, 184 unroll 4 + prefetch, 234
    unroll 8 + prefetch), and with a ring its shared memory; ``min_blocks``
    when set.  ``ops.flash_decode`` asks the driver instead."""
    if spec.min_blocks:
        return min(spec.min_blocks, spec.per_sm or spec.min_blocks)
    if spec.mma:
        # the H100 driver's JIT, d = 128, group 4: 167 / 228 registers at
        # unroll 1 / 2, 186 / 249 with early_kv (255 and spills from unroll 3)
        regs = min(256, 168 + 60 * (spec.unroll - 1) + (20 if spec.early_kv else 0))
        n = min(32 // spec.warps, 65536 // (regs * 32 * spec.warps))
        return max(1, min(n, spec.per_sm) if spec.per_sm else n)
    uc = spec.unroll * spec.chunks
    regs = 130 + 10 * uc if spec.prefetch and not spec.stages else 104 + 8 * uc
    regs = -(-regs // 8) * 8
    n = min(32 // spec.warps, 65536 // (regs * 32 * spec.warps))
    if spec.stages:
        # the ring's shared memory (1 KB more of the SM's reserved per block)
        n = min(n, TARGETS[spec.target].shared_per_sm
                // (spec.ring_bytes + spec.shared_bytes + CTA_RESERVED_SHARED))
    if spec.per_sm:
        n = min(n, spec.per_sm)
    return max(1, n)


MMA_KNOBS = {"mma": True, "warps": 8, "unroll": 1, "interleave": 2, "l2_prefetch": True,
             "l1_bypass": True, "bypass_from": 6}
"""The tensor-core split's knobs where no others are asked for (fastest of
those measured alone on the H100, docs/kernels.md): one chunk of 16 keys a
trip, dealt round robin from two rounds on.  Against the 2 chunks a trip of
before, contiguous (2 rounds of a chain of calls, µs at L = 1K / 4K / 8K /
16K / 32K): 6.03 / 7.46-7.49 / 10.77-10.79 / 29.16-29.67 / 51.16-51.36 ->
5.48 / 7.49-7.57 / 10.03-10.13 / 27.56-27.61 / 49.20-49.74.  The K/V loads'
``.L2::256B`` hint (``l2_prefetch``), 5 rounds over two calls: 16K
27.44-27.81 -> 27.05-27.44, 32K 49.30-49.79 -> 48.83-49.24, 4K and 8K
0.15-0.25 slower.  ``.L1::no_allocate`` from six rounds on (``l1_bypass``,
``bypass_from``; 12288 keys at 16 splits), 5 rounds: 16K 27.08-27.27 ->
26.79-27.07, the other lengths level (at every length it would cost 4K and
8K 2.6 and 5 µs)."""


def _mma_shape_misses(head_dim: int, group: int, kv_dtype: str) -> list:
    """What of this shape the tensor-core split does not take (empty: all)."""
    return [what for what, ok in (("an f16 cache", kv_dtype == "f16"),
                                  ("head_dim 64 or 128", head_dim in (64, 128)),
                                  ("group at most 8", 1 <= group <= 8)) if not ok]


def mma_fits(head_dim: int, group: int, kv_dtype: str) -> bool:
    """Whether the tensor-core split (``mma=True``) takes this shape (every
    ptxgen target, sm_80 and newer, has ``mma.sync.m16n8k16``)."""
    return not _mma_shape_misses(head_dim, group, kv_dtype)


def op_knobs(given: dict, head_dim: int, group: int, kv_dtype: str) -> dict:
    """The spec knobs ``ops.flash_decode`` builds with: :data:`MMA_KNOBS`
    under the knobs ``given`` where the shape takes the tensor-core split and
    no knob of the CUDA-core split's own (``chunks``, ``prefetch``,
    ``stages``, ``unroll`` past 4) nor ``mma`` was given; else ``given``.
    ``bypass_from`` comes with the default ``l1_bypass`` only."""
    if "mma" in given or {"chunks", "prefetch", "stages"} & given.keys() \
            or given.get("unroll", 1) > 4 or not mma_fits(head_dim, group, kv_dtype):
        return dict(given)
    knobs = {**MMA_KNOBS, **given}
    if not knobs.get("l1_bypass") and "bypass_from" not in given:
        del knobs["bypass_from"]
    return knobs


def choose_splits(spec: FlashDecodeSpec, sm_count: int, n_kv_heads: int, capacity: int,
                  blocks_per_sm: int | None = None) -> int:
    """Split count for a fixed grid: as many splits as fill ``blocks_per_sm``
    blocks on every SM in **one** wave (``floor``: a 401st block on 400
    slots would be a second wave; default :func:`resident_blocks`), never
    more than ``ceil(capacity / min_keys)``, nor more than ``MAX_SPLITS``."""
    if blocks_per_sm is None:
        blocks_per_sm = resident_blocks(spec)
    whole = sm_count * blocks_per_sm // n_kv_heads
    return max(1, min(whole, -(-capacity // spec.min_keys), MAX_SPLITS))


def launch_geometry(spec: FlashDecodeSpec, n_kv_heads: int, n_splits: int):
    """``((split grid, block), combine)``, no dynamic shared memory:
    ``combine`` is ``(grid, block)`` of the separate combine kernel, or
    ``None`` with ``spec.fused_combine`` (one launch)."""
    if not 1 <= n_splits <= MAX_SPLITS:
        raise ValueError(f"n_splits must be in 1..{MAX_SPLITS}, got {n_splits}")
    split = ((n_splits, n_kv_heads, 1), (32 * spec.warps, 1, 1))
    if spec.fused_combine:
        return split, None
    return split, ((n_kv_heads * spec.group, 1, 1), (32 * spec.combine_warps, 1, 1))


def reference(q, k_cache, v_cache, kv_len: int, sm_scale: float | None = None):
    """float64 attention of ``q [n_q, d]`` over the first ``kv_len`` rows of
    ``k_cache``/``v_cache [n_kv, cap, d]`` (values as stored)."""
    q = np.asarray(q, dtype=np.float64)
    n_q, d = q.shape
    n_kv = k_cache.shape[0]
    G = n_q // n_kv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros((n_q, d))
    if kv_len == 0:
        return out
    for qh in range(n_q):
        kk = np.asarray(k_cache[qh // G, :kv_len], dtype=np.float64)
        vv = np.asarray(v_cache[qh // G, :kv_len], dtype=np.float64)
        s = kk @ q[qh] * scale
        p = np.exp(s - s.max())
        out[qh] = p @ vv / p.sum()
    return out


CANONICAL = {
    "flash_decode": FlashDecodeSpec(),
    "flash_decode_d64_f32": FlashDecodeSpec(head_dim=64, group=3, kv_dtype="f32", warps=2,
                                            unroll=2, prefetch=True),
    "flash_decode_ring": FlashDecodeSpec(stages=3),
    "flash_decode_mma": FlashDecodeSpec(mma=True, warps=8, unroll=1, early_kv=True),
}

registry.register("flash_decode", FlashDecodeSpec, build, CANONICAL,
                  doc=__doc__.splitlines()[0])
