"""The split kernel on CUDA cores (the fallback for shapes the tensor-core
split does not take: an f32 cache, head_dim 256, groups past 8)."""

from __future__ import annotations

from ptxgen.types import f16, f32, u32

from ..spec_fields import pdl_prologue, pdl_wait
from .common import LOG2E, deal_keys, merge_warps, split_params, write_empty_split
from .spec import NEG

__all__ = ["build_split"]


def build_split(m, spec):
    """The split kernel on CUDA cores (lane groups of ``head_dim / 8`` lanes,
    ``/ 4`` for f32, share a key row; the next tile's K/V loads are in flight
    during this tile's math)."""
    d, G, U = spec.head_dim, spec.group, spec.unroll
    E, LK, RG = spec.elems_per_lane, spec.lanes_per_key, spec.row_groups
    KW = 32 // LK
    nthreads = 32 * spec.warps
    cty = f16 if spec.kv_dtype == "f16" else f32
    with m.kernel(spec.split_name, reqntid=nthreads, minnctapersm=None) as k:
        early = spec.early_kv
        pdl_prologue(k, spec, wait=not early)
        (q, kc, vc, kv_len_ptr, part_o, part_ml, cap, sm_scale,
         (sm_m, sm_l, sm_o)) = split_params(k, spec, cty)

        tid = k.tid.x
        lane = tid & 31
        sub = lane & (LK - 1)                       # first 16-byte slot within the row
        # element offset of this lane's 16-byte slot
        offs = [sub * E]
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

        L, start, split_end, _ = deal_keys(k, spec, kv_len_ptr, cap, split, nsplit, RG)

        if early:
            end = split_end()
            lastc = k.max(end, 1) - 1          # rows clamped to a valid one (0 when empty)
            row0 = h * cap

        def load_raw(ptr, idx, cg=False):
            """The lane's 16-byte chunks of one row: u32 words (f16) or f32
            (``ld.global.cg`` with ``cg``, else ``.nc``)."""
            return list(k.ld(ptr[idx], ty=u32 if cty is f16 else f32, vec=4,
                             nc=not cg, cache="cg" if cg else None))

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
            write_empty_split(k, spec, part_o, part_ml, h, split, nsplit, tid)
        if not early:
            end = split_end()

        m_run = [k.var(f32, NEG) for _ in range(G)]
        l_run = [k.var(f32, 0.0) for _ in range(G)]
        o_run = [[k.var(f32, 0.0) for _ in range(E)] for _ in range(G)]
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
                    for e in range(1, E):
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
                for e in range(E):
                    acc = k.mul(o_run[g][e], alpha, rnd="rn")
                    for u in range(U):
                        acc = k.fma(ps[u], vf[u][e], acc)
                    k.assign(o_run[g][e], acc)
                k.assign(m_run[g], m_new)

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
        merge_warps(k, spec, (sm_m, sm_l, sm_o), part_o, part_ml, h, split, nsplit, tid)
