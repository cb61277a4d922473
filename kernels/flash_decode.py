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
    Block ``(s, h)`` takes the ``s``-th chunk of ``[0, kv_len)``; the chunk
    length is ``ceil(kv_len / n_splits)`` rounded up to the block's tile, so
    the grid is fixed (graph-replay safe) while every length uses it; a
    block whose chunk is empty writes neutral partials (``m = -1e30``,
    ``l = 0``, ``o = 0``).  ``head_dim / 8`` lanes (f16; ``/ 4`` for f32)
    share one key row: each loads 16 bytes of K and of V with
    ``ld.global.nc.v4``, so a warp streams whole rows and the K/V bytes are
    read once for all ``group`` query heads.  Scores are prescaled by
    ``sm_scale * log2(e)`` (folded into q) and exponentiated with
    ``ex2.approx``; each lane group keeps a running max, sum and ``o`` and
    rescales once per tile of ``unroll`` keys.  The lane groups of a warp
    are merged with shuffles, the warps through shared memory.
    ``combine``: ``grid = n_q_heads``, ``block = head_dim * parts`` (512
    threads): thread ``s`` reads split ``s``'s ``(m, l)``, the block
    reduces ``M = max m_s`` and ``sum l_s 2^(m_s - M)``, the weights go to
    shared memory, and thread ``(p, j)`` sums column ``j`` of splits
    ``p, p + parts, ...`` with 8 loads in flight; the parts are added and
    divided (``div.rn``); ``kv_len = 0`` gives 0.  At most ``MAX_SPLITS``
    (512) splits.

Accuracy: within 1e-4 (relative to the largest output) of float64
attention over the same f16 K/V (``ex2.approx``: 2^-22 relative).
"""

from __future__ import annotations

import math

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.target import TARGETS
from ptxgen.types import f16, f32, s32, u32

LOG2E = 1.0 / math.log(2.0)
NEG = -1.0e30           # finite "minus infinity" for running maxima
SMEM_LIMIT = 48 * 1024
MAX_SPLITS = 512        # one combine thread per split (512 threads)


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
    target : str
    """

    head_dim: int = attrs.field(default=128, validator=attrs.validators.in_((64, 128, 256)))
    group: int = attrs.field(default=4)
    kv_dtype: str = attrs.field(default="f16", validator=attrs.validators.in_(("f16", "f32")))
    warps: int = attrs.field(default=4)
    unroll: int = attrs.field(default=8)
    chunks: int = attrs.field(default=1, validator=attrs.validators.in_((1, 2)))
    prefetch: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    target: str = attrs.field(default="sm_80", validator=attrs.validators.in_(tuple(TARGETS)))

    @group.validator
    def _check_group(self, _, v):
        if not (isinstance(v, int) and 1 <= v <= 16):
            raise ValueError(f"group must be in 1..16, got {v!r}")

    @warps.validator
    def _check_warps(self, _, v):
        if not (isinstance(v, int) and 1 <= v <= 8):
            raise ValueError(f"warps must be in 1..8, got {v!r}")

    @unroll.validator
    def _check_unroll(self, _, v):
        if not (isinstance(v, int) and 1 <= v <= 8):
            raise ValueError(f"unroll must be in 1..8, got {v!r}")

    def __attrs_post_init__(self):
        if self.lanes_per_key > 32:
            raise ValueError(f"head_dim {self.head_dim} with a {self.kv_dtype} cache needs "
                             f"{self.lanes_per_key} lanes per key row (at most 32)")
        if self.shared_bytes > SMEM_LIMIT:
            raise ValueError(f"group {self.group} x head_dim {self.head_dim} x {self.warps} "
                             f"warps needs {self.shared_bytes} bytes of shared memory "
                             f"(limit {SMEM_LIMIT}); use fewer warps")

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
        """Keys per block per loop iteration; chunks are multiples of it."""
        return self.row_groups * self.unroll

    @property
    def shared_bytes(self) -> int:
        return 4 * self.warps * self.group * (self.head_dim + 2)

    @property
    def combine_parts(self) -> int:
        """Split partitions of the combine block (``head_dim * parts`` threads)."""
        return max(1, 512 // self.head_dim)

    @property
    def kernel_name(self) -> str:
        return (f"flash_decode_d{self.head_dim}_g{self.group}_{self.kv_dtype}"
                f"_w{self.warps}u{self.unroll}" + (f"c{self.chunks}" if self.chunks > 1 else "")
                + ("p" if self.prefetch else ""))

    @property
    def split_name(self) -> str:
        return self.kernel_name + "_split"

    @property
    def combine_name(self) -> str:
        return self.kernel_name + "_combine"


def _build_split(m, spec: FlashDecodeSpec):
    d, G, U = spec.head_dim, spec.group, spec.unroll
    E, LK, RG, C = spec.elems_per_lane, spec.lanes_per_key, spec.row_groups, spec.chunks
    KW = 32 // LK
    nthreads = 32 * spec.warps
    cty = f16 if spec.kv_dtype == "f16" else f32
    with m.kernel(spec.split_name, reqntid=nthreads) as k:
        q = k.param_ptr("q", f32, align=16)
        kc = k.param_ptr("k_cache", cty, align=16)
        vc = k.param_ptr("v_cache", cty, align=16)
        kv_len_ptr = k.param_ptr("kv_len_ptr", s32)
        part_o = k.param_ptr("part_o", f32, align=16)
        part_ml = k.param_ptr("part_ml", f32, align=8)
        cap = k.param("capacity", u32)
        sm_scale = k.param("sm_scale", f32)
        NW = spec.warps
        sm_o = k.shared_array("sm_o", f32, NW * G * d, align=16)
        sm_m = k.shared_array("sm_m", f32, NW * G, align=16)
        sm_l = k.shared_array("sm_l", f32, NW * G, align=16)

        tid = k.tid.x
        lane = tid & 31
        sub = lane & (LK - 1)                       # first 16-byte slot within the row
        # element offsets of this lane's chunks: slots sub, sub + LK, ...
        offs = [sub * E + LK * E * c for c in range(C)]
        rg = (tid >> 5) * KW + (lane >> (LK.bit_length() - 1))
        split = k.ctaid.x
        nsplit = k.nctaid.x
        h = k.ctaid.y

        # current length, clamped to [0, capacity]
        raw = k.ld(kv_len_ptr[0])
        L = k.min(k.max(raw, 0).bitcast(u32), cap)
        per = (L + nsplit - 1) // nsplit
        chunk = (per + (spec.tile - 1)) // spec.tile * spec.tile
        start = split * chunk
        end = k.min(start + chunk, L)
        last = end - 1

        # this lane's slice of q for every head of the group, prescaled
        c = k.mul(sm_scale, LOG2E, rnd="rn")
        qs = []
        for g in range(G):
            qrow = (h * G + g) * d
            vals = []
            for off in offs:
                for v4 in range(E // 4):
                    vals += list(k.ld(q[qrow + off + 4 * v4], vec=4, nc=True))
            qs.append([k.mul(x, c, rnd="rn") for x in vals])

        m_run = [k.var(f32, NEG) for _ in range(G)]
        l_run = [k.var(f32, 0.0) for _ in range(G)]
        o_run = [[k.var(f32, 0.0) for _ in range(E * C)] for _ in range(G)]
        row0 = h * cap

        def load_raw(ptr, idx):
            """The lane's 16-byte chunks of one row: u32 words (f16) or f32."""
            out = []
            for c in range(C):
                a = ptr[idx] + LK * 16 * c            # the next 16-byte slot of the row
                out += list(k.ld(a, ty=u32 if cty is f16 else f32, vec=4, nc=True))
            return out

        def to_f32(words):
            if cty is f32:
                return words
            out = []
            for w in words:
                lo, hi = k.unpack(w, f16, 2)
                out += [lo.to(f32), hi.to(f32)]
            return out

        def tile_loads(base, lastrow):
            """K and V words of the tile at ``base`` (rows clamped to ``lastrow``)."""
            idxs = [(row0 + k.min(base + rg + RG * u, lastrow)) * d + sub * E
                    for u in range(U)]
            return [load_raw(kc, i) for i in idxs], [load_raw(vc, i) for i in idxs]

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

        if not spec.prefetch:
            with k.for_range(start, end, spec.tile) as base:
                tile_math(base, *tile_loads(base, last))
        else:
            # software pipeline: the next tile's loads are issued before this
            # tile's math; rows are clamped to a valid one (row 0 when empty)
            lastc = k.max(end, 1) - 1
            kw0, vw0 = tile_loads(start, lastc)
            wty = u32 if cty is f16 else f32
            cur_k = [[k.var(wty, x) for x in row] for row in kw0]
            cur_v = [[k.var(wty, x) for x in row] for row in vw0]
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
        k.bar_sync(0)
        with k.for_range(tid, G * d, nthreads) as idx:
            g = idx // d
            j = idx - g * d
            ms = [k.ld(sm_m[g + r * G]) for r in range(NW)]
            mx = ms[0]
            for x in ms[1:]:
                mx = k.max(mx, x)
            o = k.mov(0.0, f32)
            lsum = k.mov(0.0, f32)
            for r in range(NW):
                w = k.ex2(ms[r] - mx)
                o = k.fma(w, k.ld(sm_o[(g + r * G) * d + j]), o)
                lsum = k.fma(w, k.ld(sm_l[g + r * G]), lsum)
            pidx = (h * G + g) * nsplit + split
            k.st(part_o[pidx * d + j], o)
            with k.if_(j.eq(0)):
                k.st(part_ml[pidx << 1], (mx, lsum))


def _block_reduce(k, v, op, scratch, nwarps):
    """``op`` (k.max or add) of ``v`` over the block; every thread gets it."""
    lane = k.tid.x & 31
    for off in (16, 8, 4, 2, 1):
        v = op(v, k.shfl_xor(v, off))
    with k.if_(lane.eq(0)):
        k.st(scratch[k.tid.x >> 5], v)
    k.bar_sync(0)
    r = k.ld(scratch[0])
    for w in range(1, nwarps):
        r = op(r, k.ld(scratch[w]))
    k.bar_sync(0)
    return r


def _build_combine(m, spec: FlashDecodeSpec):
    d, P = spec.head_dim, spec.combine_parts
    nthreads = d * P
    nwarps = nthreads // 32
    U = 8
    with m.kernel(spec.combine_name, reqntid=nthreads) as k:
        part_o = k.param_ptr("part_o", f32, align=16)
        part_ml = k.param_ptr("part_ml", f32, align=8)
        out = k.param_ptr("out", f32, align=16)
        nsplit = k.param("n_splits", u32)
        sm_w = k.shared_array("sm_w", f32, nthreads, align=16)
        sm_acc = k.shared_array("sm_acc", f32, nthreads, align=16)
        scratch = k.shared_array("sm_red", f32, max(nwarps, 4), align=16)
        qh = k.ctaid.x
        tid = k.tid.x
        first = qh * nsplit
        lastsplit = nsplit - 1
        # thread s < n_splits holds split s: M = max m_s, w_s = 2^(m_s - M)
        has = tid < nsplit
        mi, li = k.ld(part_ml[(first + k.min(tid, lastsplit)) << 1], vec=2)
        mi = k.select(has, mi, k.mov(NEG, f32))
        big = _block_reduce(k, mi, k.max, scratch, nwarps)
        w = k.select(has, k.ex2(mi - big), k.mov(0.0, f32))
        k.st(sm_w[tid], w)
        total = _block_reduce(k, k.mul(w, li, rnd="rn"), lambda a, b: a + b, scratch, nwarps)
        # thread (p, j) sums column j of splits p, p + P, ...: U loads in flight
        p = tid // d
        j = tid - p * d
        acc = k.var(f32, 0.0)
        with k.for_range(p, nsplit, P * U) as s0:
            vals = []
            for u in range(U):
                s = s0 + u * P
                sc = k.min(s, lastsplit)
                wu = k.select(s < nsplit, k.ld(sm_w[sc]), k.mov(0.0, f32))
                vals.append((wu, k.ld(part_o[(first + sc) * d + j])))
            for wu, o in vals:
                k.fma(wu, o, acc, out=acc)
        k.st(sm_acc[tid], acc)
        k.bar_sync(0)
        with k.if_(tid < d):
            o = k.ld(sm_acc[tid])
            for q in range(1, P):
                o = o + k.ld(sm_acc[tid + q * d])
            res = k.select(total > 0.0, k.div(o, k.max(total, 1e-30)), k.mov(0.0, f32))
            k.st(out[qh * d + tid], res)


def build(spec: FlashDecodeSpec) -> ptxgen.Module:
    """PTX with two kernels, ``spec.split_name`` and ``spec.combine_name``.

    split parameters: ``q, k_cache, v_cache, kv_len_ptr: s32*, part_o,
    part_ml, capacity: u32, sm_scale: f32``; combine parameters:
    ``part_o, part_ml, out, n_splits: u32``.
    """
    m = ptxgen.Module(spec.target)
    _build_split(m, spec)
    _build_combine(m, spec)
    return m


def choose_splits(spec: FlashDecodeSpec, sm_count: int, n_kv_heads: int, capacity: int,
                  blocks_per_sm: int | None = None) -> int:
    """Split count for a fixed grid: ``blocks_per_sm`` blocks per SM over the
    KV heads (default ``12 // warps``: 3 blocks of 4 warps, the resident
    count of the default spec at 168 registers, best of the H100 sweep in
    docs/kernels.md), never more splits than tiles in the cache's capacity,
    nor more than ``MAX_SPLITS``."""
    if blocks_per_sm is None:
        blocks_per_sm = max(1, 12 // spec.warps)
    target = -(-sm_count * blocks_per_sm // n_kv_heads)
    return max(1, min(target, -(-capacity // spec.tile), MAX_SPLITS))


def launch_geometry(spec: FlashDecodeSpec, n_kv_heads: int, n_splits: int):
    """``((split grid, block), (combine grid, block))``, no dynamic shared memory."""
    if not 1 <= n_splits <= MAX_SPLITS:
        raise ValueError(f"n_splits must be in 1..{MAX_SPLITS}, got {n_splits}")
    return (((n_splits, n_kv_heads, 1), (32 * spec.warps, 1, 1)),
            ((n_kv_heads * spec.group, 1, 1), (spec.head_dim * spec.combine_parts, 1, 1)))


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
}

registry.register("flash_decode", FlashDecodeSpec, build, CANONICAL,
                  doc=__doc__.splitlines()[0])
