"""The flash-prefill kernel body (``mma.sync.m16n8k16``, ``ldmatrix``)."""

from __future__ import annotations

import math

from ptxgen import types as T
from ptxgen.types import b32, f16, f32, s32, u32
from ptxgen.values import Address

from ..spec_fields import pdl_prologue
from .spec import NEG

__all__ = ["build_prefill"]

LOG2E = 1.0 / math.log(2.0)


def _pack_f16(k, a, b):
    """Two f32 values as one ``f16x2`` register (``a`` in the low half)."""
    return k.pack(b32, k.cvt(f16, a), k.cvt(f16, b))


def build_prefill(m, plan):
    """Emit the kernel ``plan.kernel_name`` into module ``m``.

    Parameters: ``q: f32*, k_cache: f16*, v_cache: f16*, start_ptr: s32*,
    n_tokens_ptr: s32*, out: f32*, capacity: u32, sm_scale: f32, q_stride:
    u32`` (elements between consecutive query rows; ``n_q_heads *
    head_dim`` for a contiguous q, more where q sits in a wider QKV row).
    Grid ``(ceil(T_max / block_rows), n_q_heads)``, ``32 * warps`` threads.

    Block ``(x, qh)`` takes chunk rows ``[x R, (x + 1) R)`` of query head
    ``qh`` (``R = block_rows``); warp ``w`` rows ``x R + 16 w ..`` + 16, lane
    ``4 g + t`` rows ``g`` and ``g + 8`` of the mma fragments.  Row ``i`` sits
    at position ``L + i`` and sees keys ``0 .. L + i``.  The block walks the
    keys its last row sees in tiles of ``block_keys``: the tile's K and V
    rows are copied to shared memory (``cp.async``; rows past the block's
    last key are clamped to it, so no unwritten cache row enters), then
    each warp whose rows see the tile computes ``S = Q K^T`` (q in f16,
    prescaled by ``sm_scale log2 e``; K fragments by ``ldmatrix``), masks
    keys past each row's position, updates its rows' running max and sum
    (``ex2.approx``) and accumulates ``O += P V`` (P rounded to f16, V
    fragments by ``ldmatrix.trans``) in f32.  At the end ``O / l`` is stored
    for rows below ``T``."""
    d, G, NW, BN = plan.head_dim, plan.group, plan.warps, plan.block_keys
    R, P = plan.block_rows, plan.pitch
    KT = d // 16               # k-tiles of q . k
    NT = BN // 8               # n-tiles of the scores per key tile
    DT = d // 8                # n-tiles of the output
    CHUNKS = BN * d // 8       # 16-byte chunks of one K (or V) tile
    nthr = 32 * NW
    with m.kernel(plan.kernel_name, reqntid=nthr) as k:
        q = k.param_ptr("q", f32, align=16)
        kc = k.param_ptr("k_cache", f16, align=16)
        vc = k.param_ptr("v_cache", f16, align=16)
        start_ptr = k.param_ptr("start_ptr", s32)
        ntok_ptr = k.param_ptr("n_tokens_ptr", s32)
        out = k.param_ptr("out", f32, align=16)
        cap = k.param("capacity", u32)
        sm_scale = k.param("sm_scale", f32)
        q_stride = k.param("q_stride", u32)
        ks = k.shared_array("ks", f16, BN * P, align=16)
        vs = k.shared_array("vs", f16, BN * P, align=16)
        pdl_prologue(k, plan)

        tid = k.tid.x
        lane, warp = tid & 31, tid >> 5
        g, t = lane >> 2, lane & 3
        qh = k.ctaid.y
        h = qh // G
        nq = k.nctaid.y
        # L and T from the device, clamped: L in [0, capacity], T in
        # [0, min(capacity - L, rows of the grid)]
        L = k.min(k.max(k.ld(start_ptr[0]), 0).bitcast(u32), cap)
        Tn = k.min(k.max(k.ld(ntok_ptr[0]), 0).bitcast(u32), cap - L)
        Tn = k.min(Tn, k.nctaid.x * R)
        row0 = k.ctaid.x * R
        with k.if_(row0 >= Tn):
            k.exit()
        nkeys = k.min(L + row0 + R, L + Tn)      # keys the block's rows see
        lastk = nkeys - 1
        wrow = row0 + 16 * warp                  # the warp's first chunk row
        wpos_last = L + wrow + 15                # its last row's position
        rows = [wrow + g, wrow + g + 8]
        pos = [(L + r).bitcast(s32) for r in rows]

        # q's A fragments (rows g, g + 8; columns 2t, 2t + 1, 2t + 8, 2t + 9
        # of each k-tile), prescaled, in f16
        c = k.mul(sm_scale, LOG2E, rnd="rn")
        qbase = [k.min(r, Tn - 1) * q_stride + qh * d + 2 * t for r in rows]
        qa = []
        for kt in range(KT):
            regs = []
            for half in range(2):                # columns 2t.. then 2t + 8..
                for r in range(2):               # rows g, g + 8
                    x0, x1 = k.ld(q[qbase[r] + 16 * kt + 8 * half], vec=2, nc=True)
                    regs.append(_pack_f16(k, k.mul(x0, c, rnd="rn"), k.mul(x1, c, rnd="rn")))
            qa.append(tuple(regs))

        m_run = [k.var(f32, NEG), k.var(f32, NEG)]
        l_run = [k.var(f32, 0.0), k.var(f32, 0.0)]
        o_acc = [[k.var(f32, 0.0) for _ in range(4)] for _ in range(DT)]
        zero = k.mov(0.0, f32)
        ninf = k.mov(float("-inf"), f32)
        kbase, vbase = k.mov(ks, u32), k.mov(vs, u32)
        mi, rr = lane >> 3, lane & 7
        # ldmatrix row addresses (bytes): K (B of S, not transposed): matrix
        # mi is keys 16p + 8 (mi >> 1) + rr, columns 16 kt + 8 (mi & 1);
        # V (B of O, transposed): keys 16p + 8 (mi & 1) + rr, dims 8 (n + (mi >> 1))
        k_addr = kbase + ((8 * (mi >> 1) + rr) * P + 8 * (mi & 1)) * 2
        v_addr = vbase + ((8 * (mi & 1) + rr) * P + 8 * (mi >> 1)) * 2

        with k.for_range(0, nkeys, BN) as kb:
            for j in range(CHUNKS // nthr if CHUNKS >= nthr else 1):
                cidx = tid + j * nthr
                r_, cc = cidx // (d // 8), cidx % (d // 8)
                src = (h * cap + k.min(kb + r_, lastk)) * d + 8 * cc
                guard = None if CHUNKS >= nthr else cidx < CHUNKS
                if guard is None:
                    k.cp_async(ks[r_ * P + 8 * cc], kc[src])
                    k.cp_async(vs[r_ * P + 8 * cc], vc[src])
                else:
                    with k.if_(guard):
                        k.cp_async(ks[r_ * P + 8 * cc], kc[src])
                        k.cp_async(vs[r_ * P + 8 * cc], vc[src])
            k.cp_async_commit()
            k.cp_async_wait(0)
            k.bar_sync(0)
            with k.if_(kb <= wpos_last):
                _tile(k, plan, kb, qa, pos, m_run, l_run, o_acc, k_addr, v_addr,
                      zero, ninf, KT, NT, DT)
            k.bar_sync(0)

        for r in range(2):
            lt = l_run[r] + k.shfl_xor(l_run[r], 1)
            lt = lt + k.shfl_xor(lt, 2)
            inv = k.div(1.0, lt, rnd="rn")
            with k.if_(rows[r] < Tn):
                obase = (rows[r] * nq + qh) * d + 2 * t
                for n in range(DT):
                    k.st(out[obase + 8 * n], (k.mul(o_acc[n][2 * r], inv, rnd="rn"),
                                              k.mul(o_acc[n][2 * r + 1], inv, rnd="rn")))


def _tile(k, plan, kb, qa, pos, m_run, l_run, o_acc, k_addr, v_addr, zero, ninf, KT, NT, DT):
    """One key tile of one warp: scores, mask, online softmax, ``O += P V``."""
    P = plan.pitch
    t = (k.tid.x & 31) & 3
    s = []
    for p in range(NT // 2):                     # 16 keys at a time
        acc = [(zero, zero, zero, zero), (zero, zero, zero, zero)]
        for kt in range(KT):
            b = k.ldmatrix(Address(k_addr + (16 * p * P + 16 * kt) * 2, 0, "shared", T.b16), 4)
            for e in range(2):
                acc[e] = k.mma_m16n8k16(qa[kt], b[2 * e:2 * e + 2], acc[e])
        s.extend(acc)
    # key kb + 8 j + 2 t + e is seen by row r when 8 j + e <= pos_r - kb - 2 t
    lim = [(pr - (kb + 2 * t).bitcast(s32)) for pr in pos]
    for r in range(2):
        vals = []
        for j in range(NT):
            for e in range(2):
                vals.append(k.select(lim[r] >= 8 * j + e, s[j][2 * r + e], ninf))
        mt = vals[0]
        for x in vals[1:]:
            mt = k.max(mt, x)
        mt = k.max(mt, k.shfl_xor(mt, 1))
        mt = k.max(mt, k.shfl_xor(mt, 2))
        m_new = k.max(m_run[r], mt)
        alpha = k.ex2(m_run[r] - m_new)
        k.assign(l_run[r], k.mul(l_run[r], alpha, rnd="rn"))
        for acc in o_acc:
            for e in range(2):
                k.assign(acc[2 * r + e], k.mul(acc[2 * r + e], alpha, rnd="rn"))
        k.assign(m_run[r], m_new)
        pr = [k.ex2(x - m_new) for x in vals]
        psum = pr[0]
        for x in pr[1:]:
            psum = psum + x
        k.assign(l_run[r], l_run[r] + psum)
        for j in range(NT):
            s[j] = tuple(s[j][:2 * r]) + (pr[2 * j], pr[2 * j + 1]) + tuple(s[j][2 * r + 2:])
    for p in range(NT // 2):
        pa = (_pack_f16(k, s[2 * p][0], s[2 * p][1]), _pack_f16(k, s[2 * p][2], s[2 * p][3]),
              _pack_f16(k, s[2 * p + 1][0], s[2 * p + 1][1]),
              _pack_f16(k, s[2 * p + 1][2], s[2 * p + 1][3]))
        for n in range(0, DT, 2):
            b = k.ldmatrix(Address(v_addr + (16 * p * P + 8 * n) * 2, 0, "shared", T.b16), 4,
                           trans=True)
            for e in range(2):
                acc = o_acc[n + e]
                for r_, x in zip(acc, k.mma_m16n8k16(pa, b[2 * e:2 * e + 2], tuple(acc))):
                    k.assign(r_, x)
