"""The combine kernel: one block per query head merges its splits' partials."""

from __future__ import annotations

from ptxgen.types import f16, f32, u32

from ..spec_fields import pdl_prologue
from .common import merge_parts
from .spec import NEG

__all__ = ["build_combine"]


def build_combine(m, spec):
    """The combine kernel of ``spec`` (its ``out`` f16 where the spec has
    ``out_type="f16"``, rounded to nearest; f32 otherwise)."""
    d = spec.head_dim
    half = getattr(spec, "out_type", "f32") == "f16"
    NWC = spec.combine_warps
    E = d // 32                     # columns per lane
    R = max(6, 16 // NWC)           # splits per warp per round of loads
    # minnctapersm 1: ptxas then keeps a round's loads in flight together
    # (aiming at more blocks per SM, it spreads them over two round trips)
    with m.kernel(spec.combine_name, reqntid=32 * NWC, minnctapersm=1) as k:
        pdl_prologue(k, spec)
        part_o = k.param_ptr("part_o", f32, align=16)
        part_ml = k.param_ptr("part_ml", f32, align=8)
        out = k.param_ptr("out", f16 if half else f32, align=16)
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
            if half:
                res = [k.cvt(f16, v, rnd="rn") for v in res]
            store_cols(out, qh * d + lane * E, res)
            return
        with k.if_(lane.eq(0)):
            k.st(sm_m[warp], m_run)
            k.st(sm_l[warp], l_run)
        store_cols(sm_o, warp * d + lane * E, o_run)
        k.bar_sync(0)
        # thread t merges columns t, t + 32 NWC, ... (one column with 16 warps)
        for col in k.strided(tid, d, 32 * NWC):
            _, total, o = merge_parts(k, [(sm_m[w], sm_l[w], sm_o[w * d + col])
                                           for w in range(NWC)])
            res = k.select(total > 0.0, k.div(o, k.max(total, 1e-30)), zero)
            k.st(out[qh * d + col], k.cvt(f16, res, rnd="rn") if half else res)
