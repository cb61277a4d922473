"""Q4_K GEMV: column-stationary threads, x in registers, 16-byte weight loads.

Layout of a Q4_K super-block (144 bytes, 256 weights)::

    0   f16 d      2  f16 dmin     4..15  packed 6-bit scales/mins (8 sub-blocks)
    16..143  qs: group j (0..3) is qs[32j .. 32j+32): low nibbles are
             sub-block 2j, high nibbles sub-block 2j+1

A *piece* is 16 bytes of qs: piece ``c`` (0..7) of super-block ``sb`` holds
weights ``64j + 16h + (0..16)`` (low nibbles) and ``+32`` (high nibbles),
``j = c // 2``, ``h = c % 2``.  The K dimension has ``P = 8 K / 256``
pieces; thread ``t`` of a CTA owns pieces ``t, t + T, ...`` for the whole
kernel, so its 32 x values per piece are loaded once into registers.  The
CTA then walks its rows ``spec.rows`` at a time: every thread issues one
16-byte ``ld.global.nc.L1::no_allocate.v4`` for each row's piece and one for
the super-block header (the 8 threads of a super-block read the same header,
one transaction), all before the first use; lanes 0..31 read 4 consecutive
super-blocks' qs, so a warp load is 4 runs of 128 contiguous bytes.

Dequantisation without int->float conversions: a nibble ``q`` is placed in
the mantissa of ``1 + q/16`` with one ``prmt`` (bytes prepared four at a
time), so the dot product of a half piece is one fma per weight::

    S = sum x_i (1 + q_i/16)           (f32 fma chain)
    sum x_i w_i = 16 d sc (S - X) - dmin m X,     X = sum x_i (per thread, once)

The 6-bit scales/mins are decoded with shifts and masks chosen per lane
(``j < 2`` and ``j >= 2`` use different bits), no branches.  Partial sums
are reduced over the CTA by :func:`gemv_common.write_outputs`.
"""

from __future__ import annotations

import math

import ptxgen
from ptxgen.target import MAX_STATIC_SHARED
from ptxgen.types import f16, f32, s32, u32, u64

from .gemv_common import (PLANE_SIGNED, PLANE_W, XFULL, GemvSpec, declare_params, norm_scale,
                          plane_inverse, warp_sum, warp_threads, write_outputs, x_planes)
from .spec_fields import pdl_prologue, pdl_wait

__all__ = ["build_q4k", "q4k_layout"]

_SEL_BASE = 0x7044          # out = [0x00, 0x00, byte i of a, 0x3F]
_ONE_EXP = 0x3F000000


def q4k_layout(spec: GemvSpec) -> tuple[int, int, int]:
    """``(pieces_per_thread, threads, total_pieces)`` for a Q4_K spec."""
    total = spec.k // 256 * 8
    ppt = spec.pieces or max(1, math.ceil(total / 1024))
    thr = warp_threads(total, ppt)
    if thr > 1024:
        raise ValueError(f"Q4_K K={spec.k}: {ppt} pieces per thread need {thr} threads "
                         f"(> 1024); raise pieces")
    return ppt, thr, total


def _piece_offsets(k, tid, i, thr, total):
    """Per-piece byte offsets and lane masks (no loads)."""
    p = tid + i * thr
    valid = p < total
    pc = k.min(p, total - 1)
    sb = pc >> 3
    c = pc & 7
    j = c >> 1
    hoff = sb * 144
    qoff = hoff + (c << 4) + 16
    s = (j & 1) << 4
    hi = j >= 2
    m_a = k.select(hi, k.mov(0, u32), k.mov(0x3F3F, u32))
    m_a2 = k.select(hi, k.mov(0x3030, u32), k.mov(0, u32))
    m_c = k.select(hi, k.mov(0x0F0F, u32), k.mov(0, u32))
    xo = (sb << 8) + (j << 6) + ((c & 1) << 4)
    return dict(hoff=hoff.to(u64), qoff=qoff.to(u64), s=s, m_a=m_a, m_a2=m_a2,
                m_c=m_c, valid=valid, xo=xo, sb=sb, c=c)


def _norm_sum(k, spec, pcs, norm, red, warps, tid, slice_=None):
    """Fused RMSNorm: the CTA's scale ``1/sqrt(mean(x^2) + eps)`` for
    :func:`write_outputs` (:func:`gemv_common.norm_scale` over the warps'
    sums of the pieces' ``"sq"``, from :func:`_piece_x` with ``nw``), or
    None without ``norm``."""
    if not norm:
        return None
    sq = pcs[0]["sq"]
    for pc in pcs[1:]:
        sq = sq + pc["sq"]
    return norm_scale(k, spec, red, warps, (warp_sum(k, sq), norm[1]), tid, slice_)


def _piece_nw(k, nw, pc):
    """Issue the loads of the piece's 32 fused-RMSNorm weights into
    ``pc["nwv"]`` (two halves of 16).  They are constants, so a kernel may
    issue them before its PDL wait; :func:`_piece_x` does it otherwise."""
    xo = pc["xo"]
    halves = []
    for half in (0, 32):
        na = nw[xo + half] if half else nw[xo]
        ws = []
        for v in range(4):
            ws += list(k.ld(na + 16 * v, f32, vec=4, nc=True))
        halves.append(ws)
    pc["nwv"] = halves


def _piece_x(k, x, pc, nw=None, shared=False, cache=None):
    """The piece's 32 x values (zero past K) and the sums of its two halves.
    With ``nw`` (fused RMSNorm) the values are ``x * nw`` and ``pc["sq"]``
    is the sum of the 32 ``x**2``.  ``shared``: ``x`` is the CTA's shared copy.
    ``cache`` (e.g. ``"cg"``): a coherent load with that cache operator
    instead of ``ld.global.nc`` (for an x written earlier in the same launch).

    Every load (both halves of x, and nw unless :func:`_piece_nw` issued it
    earlier) goes out before the first arithmetic on them, so they share one
    round trip to L2.  (Measured on an H100, this did not change the fused
    gate/up kernel's time alone; docs/gemv.md, twelfth pass.)"""
    xo, valid = pc["xo"], pc["valid"]
    if nw is not None and "nwv" not in pc:
        _piece_nw(k, nw, pc)
    raw = []
    for half in (0, 32):
        xa = x[xo + half] if half else x[xo]
        if not half:
            pc["xa"] = xa
        vals = []
        for v in range(4):
            vals += list(k.ld(xa + 16 * v, f32, vec=4, nc=not (shared or cache),
                              cache=cache))
        raw.append(vals)
    xv = []
    sq = None
    for h, vals in enumerate(raw):
        zero = k.mov(0.0, f32)
        vals = [k.select(valid, a, zero) for a in vals]
        if nw is not None:
            for a in vals:
                sq = a * a if sq is None else k.fma(a, a, sq)
            vals = [a * w for a, w in zip(vals, pc["nwv"][h])]
        xv.append(vals)
    pc["sq"] = sq
    sums = []
    for vals in xv:
        t = vals[0]
        for a in vals[1:]:
            t = t + a
        sums.append(t)
    pc["x"], pc["xs"] = xv, sums


def _piece_planes(k, pc):
    """Split the piece's 32 x values into three byte planes (``dot="dp4a"``,
    :func:`gemv_common.x_planes`).  Sets ``pc["planes"]`` (per half, per
    plane, four words of four bytes) and ``pc["xscale"]`` (the factor that
    turns :func:`_piece_dot`'s combined sums, 16 times the sums of q x, into
    those sums); drops the f32 values."""
    halves = pc.pop("x")
    amax, inv = plane_inverse(k, halves[0] + halves[1])
    # 1/16: the high nibbles enter dp4a in place (16 q), _piece_dot scales the
    # low half's sums by 16 to match
    pc["xscale"] = amax * (1.0 / (16 * XFULL))
    pc["planes"] = [x_planes(k, half, inv) for half in halves]
    # for _piece_scales: the prmt selector that gathers bytes b, b+1 of two
    # words (b = 2 (j & 1)), and the masks of the lane's case (j < 2, j >= 2)
    j = pc["c"] >> 1
    hi = j >= 2
    pc["sel"] = ((j & 1) << 1) * 0x1111 + 0x5410
    pc["g_a"] = k.select(hi, k.mov(0, u32), k.mov(0x3F3F3F3F, u32))
    pc["g_b"] = k.select(hi, k.mov(0x30303030, u32), k.mov(0, u32))
    pc["g_c"] = k.select(hi, k.mov(0x0F0F0F0F, u32), k.mov(0, u32))


def _byte_times16(k, v, b):
    """16 times byte ``b`` of ``v`` as f32, exactly: the byte placed in the
    low mantissa bits of 2^27 (where one unit is 16) by a ``prmt``, then
    2^27 subtracted; two full-rate instructions."""
    return k.prmt(v, 0x4D000000, 0x7540 | b).bitcast(f32) - 134217728.0


def _half_planes_dot(k, words, planes, high):
    """The sum ``sum q T`` over one half piece as f32 (16 times it for the
    high nibbles; ``T``: x as :func:`gemv_common.x_planes` holds it): four
    words of nibbles against the three planes with ``dp4a``.  The low
    nibbles are masked (``q``, 0..15); the high ones stay in place (``16 q``,
    one ``and`` fewer), so their plane sums are combined in f32 (one
    rounding, 2^-24) where the low half's fit in an s32 exactly."""
    acc = [0, 0, 0]
    for w, word in enumerate(words):
        q = word & (0xF0F0F0F0 if high else 0x0F0F0F0F)
        for p in range(3):
            acc[p] = k.dp4a(q, planes[p][w], acc[p], signed_b=PLANE_SIGNED[p])
    w0, w1 = PLANE_W
    lo = k.mad(acc[1].bitcast(s32), w1, acc[2].bitcast(s32))
    if high:
        return k.fma(acc[0].to(f32), float(w0), lo.to(f32))
    return k.mad(acc[0].bitcast(s32), w0, lo).to(f32)


def _piece_scales(k, hdr, pc):
    """The 6-bit scales and mins of the piece's two sub-blocks (2j, 2j+1)
    as one word ``[sc_lo, sc_hi, m_lo, m_hi]``: two ``prmt`` gather bytes
    2(j&1), 2(j&1)+1 of the header's scale words (j < 2: their low 6 bits;
    j >= 2: 4 bits from the third word, 2 from the top of the first two);
    the per-lane masks pick the case without branches."""
    _, h1, h2, h3 = hdr
    p = k.prmt(h1, h2, pc["sel"])
    r = k.prmt(h3, h3 >> 4, pc["sel"])
    return (p & pc["g_a"]) | ((p >> 2) & pc["g_b"]) | (r & pc["g_c"])


def _park_x(k, pc, sx_base, slot, thr):
    """Write the piece's 8 x chunks to its thread's shared slots (chunk-major:
    lanes hit consecutive 16 bytes, no bank conflicts); drop the registers."""
    for h, vals in enumerate(pc.pop("x")):
        for w in range(4):
            k.st(sx_base + ((slot * 8 + 4 * h + w) * thr * 16), tuple(vals[4 * w:4 * w + 4]))


def _half_dot(k, words, xs, shift_left):
    """S = sum x_i (1 + q_i/16) over the 16 nibbles of one half piece."""
    acc = None
    for w, word in enumerate(words):
        t = (word << 3) if shift_left else (word >> 1)
        pk = (t & 0x78787878) | 0x80808080
        for b in range(4):
            f = k.prmt(pk, _ONE_EXP, _SEL_BASE | (b << 8)).bitcast(f32)
            xi = xs[4 * w + b]
            acc = xi * f if acc is None else k.fma(xi, f, acc)
    return acc


def _rows_dot(k, items, pc, get_x):
    """Contributions of one piece for several rows (``items``: ``(hdr, qs)`` per
    row): each 4-value x chunk is fetched once (``get_x(half, w)``) and used for
    every row.  Same fma order per row as :func:`_half_dot`."""
    S = [[None, None] for _ in items]
    for h, shift_left in ((0, True), (1, False)):
        for w in range(4):
            xv = get_x(h, w)
            for n, (_, qs) in enumerate(items):
                word = qs[w]
                t = (word << 3) if shift_left else (word >> 1)
                pk = (t & 0x78787878) | 0x80808080
                for b in range(4):
                    f = k.prmt(pk, _ONE_EXP, _SEL_BASE | (b << 8)).bitcast(f32)
                    acc = S[n][h]
                    S[n][h] = xv[b] * f if acc is None else k.fma(xv[b], f, acc)
    return [_piece_dot(k, hdr, None, pc, sums=S[n]) for n, (hdr, _) in enumerate(items)]


def _piece_dot(k, hdr, qs, pc, sums=None):
    """Contribution of one piece of one row: sum over its 32 weights of x w
    (``sums``: the two half sums S already computed)."""
    h0, h1, h2, h3 = hdr
    d_h, dmin_h = k.unpack(h0, f16, 2)
    xs_lo, xs_hi = pc["xs"]
    if "planes" in pc:
        # sum x w = d s (16 sc_lo P_lo + sc_hi P_hi) / 16 - dmin (m_lo X_lo + m_hi X_hi)
        # (P: the combined plane sums, P_hi already 16 times; s / 16 = xscale)
        w = _piece_scales(k, hdr, pc)
        # 16 sc_lo by prmt and a subtraction; the others by ``bfe`` and
        # ``cvt``, which ptxas fuses into one I2F.U8 with a byte selector (on
        # the conversion unit, which has time to spare here)
        sc_lo = _byte_times16(k, w, 0)
        sc_hi, m_lo, m_hi = (k.bfe(w, 8 * b, 8).to(f32) for b in (1, 2, 3))
        p_lo = _half_planes_dot(k, qs, pc["planes"][0], False)
        p_hi = _half_planes_dot(k, qs, pc["planes"][1], True)
        ssum = k.fma(sc_hi, p_hi, sc_lo * p_lo)
        msum = k.fma(m_hi, xs_hi, m_lo * xs_lo)
        return k.fma(d_h.to(f32) * pc["xscale"], ssum, -dmin_h.to(f32) * msum)
    d16 = d_h.to(f32) * 16.0
    ndmin = -dmin_h.to(f32)
    a = h1 >> pc["s"]
    b = h2 >> pc["s"]
    cc = h3 >> pc["s"]
    sc = (a & pc["m_a"]) | ((a >> 2) & pc["m_a2"]) | (cc & pc["m_c"])
    mn = (b & pc["m_a"]) | ((b >> 2) & pc["m_a2"]) | ((cc >> 4) & pc["m_c"])
    sc_lo = (sc & 0xFF).to(f32)
    sc_hi = (sc >> 8).to(f32)
    m_lo = (mn & 0xFF).to(f32)
    m_hi = (mn >> 8).to(f32)
    if sums is None:
        x_lo, x_hi = pc["x"]
        s_lo = _half_dot(k, qs, x_lo, True)
        s_hi = _half_dot(k, qs, x_hi, False)
    else:
        s_lo, s_hi = sums
    part = (d16 * sc_lo) * (s_lo - xs_lo)
    part = k.fma(d16 * sc_hi, s_hi - xs_hi, part)
    mx = k.fma(m_lo, xs_lo, m_hi * xs_hi)
    out = k.fma(ndmin, mx, part)
    if sums is not None and pc.get("mask_out"):
        out = k.select(pc["valid"], out, k.mov(0.0, f32))
    return out


def build_q4k(spec: GemvSpec) -> ptxgen.Module:
    """Build the Q4_K GEMV kernel described by ``spec``."""
    ppt, thr, total = q4k_layout(spec)
    nm, R, rb = spec.n_mats, spec.rows, spec.row_bytes
    warps = thr // 32
    S = spec.slices
    m = ptxgen.Module(spec.target)
    kdir = dict(reqntid=thr * S)
    if spec.min_ctas:
        kdir["minnctapersm"] = spec.min_ctas
    if spec.xmode == "shared" and ppt * thr * 128 > MAX_STATIC_SHARED:
        raise ValueError(f"Q4_K xmode='shared' K={spec.k}: {ppt * thr * 128} bytes of x "
                         f"exceed {MAX_STATIC_SHARED // 1024} KB of static shared memory")
    with m.kernel(spec.kernel_name, **kdir) as k:
        ws, x, r, y, mrows, rpc, red, norm = declare_params(k, spec, warps)
        early = spec.early or spec.prefetch
        # PDL: the first group's weight loads (read-only data) may go out
        # before the wait; x, r and y only after it
        pdl_prologue(k, spec, wait=not early)

        tid = k.tid.x
        sl = None
        if S > 1:
            tid_cta = tid
            sl = tid_cta // thr                 # the thread's slice
            tid = tid_cta - sl * thr            # its index within the slice
        pcs = [_piece_offsets(k, tid, i, thr, total) for i in range(ppt)]
        bases = [[(k.ptr_add(w, pc["hoff"]), k.ptr_add(w, pc["qoff"])) for pc in pcs]
                 for w in ws]
        row0 = k.ctaid.x * rpc
        row_end = k.min(mrows, row0 + rpc)
        last = row_end - 1
        # slice j takes row groups j, j + S, ... of the CTA's rows
        first_row = row0 if S == 1 else row0 + sl * R
        step = R * S
        # every slice runs rpc / step groups (the CTA's barriers need the same
        # count); rows past M are clamped for loading and never stored
        loop_end = row_end if S == 1 else row0 + rpc
        l2 = "L2::256B" if spec.l2_prefetch else None

        def issue(rg):
            """All loads of the row group at ``rg`` (rows clamped to the CTA's last)."""
            out = []
            for i in range(R):
                off = k.mul_wide(k.min(rg + i, last), rb)
                out.append([[(k.ld(hb[off], u32, vec=4, nc=True, evict="L1::no_allocate",
                                   prefetch=l2),
                              k.ld(qb[off], u32, vec=4, nc=True, evict="L1::no_allocate",
                                   prefetch=l2))
                             for hb, qb in bases[mi]] for mi in range(nm)])
            return out

        def regs_of(loads):
            return [w for per_mat in loads for per_piece in per_mat for pair in per_piece
                    for v in pair for w in v]

        if spec.stage:
            if ppt != 1:
                raise ValueError(f"Q4_K stage=True needs one piece per thread (K <= 32768), "
                                 f"got {ppt}")
            if spec.prefetch:
                raise ValueError("Q4_K: prefetch and stage are exclusive")
            nsb = math.ceil(total / 8)
            sq = k.shared_array("sq", u32, R * nm * thr * 4, align=16)
            sh = k.shared_array("sh", u32, R * nm * nsb * 4, align=16)
            pc0 = pcs[0]
            is_hdr = k.setp("eq", pc0["c"], 0, combine=("and", pc0["valid"]))

        def stage_out(rg):
            """Issue the group's loads and park them in shared memory (own qs slot;
            headers once per super-block): no register holds them while in flight."""
            loads = issue(rg)
            for i in range(R):
                for mi in range(nm):
                    (hdr, qs), = loads[i][mi]
                    slot = i * nm + mi
                    k.st(sq[(tid + slot * thr) * 4], qs)
                    k.st(sh[(pc0["sb"] + slot * nsb) * 4], hdr, guard=is_hdr)

        def stage_in():
            out = []
            for i in range(R):
                per = []
                for mi in range(nm):
                    slot = i * nm + mi
                    qs = k.ld(sq[(tid + slot * thr) * 4], u32, vec=4)
                    hdr = k.ld(sh[(pc0["sb"] + slot * nsb) * 4], u32, vec=4)
                    per.append([(hdr, qs)])
                out.append(per)
            return out

        def body(loads, rg):
            if spec.stage:
                k.bar_sync(0)
                loads = stage_in()
            acc = [[None] * R for _ in range(nm)]
            if spec.xmode == "reg":
                for i in range(R):
                    for mi in range(nm):
                        for (hdr, qs), pc in zip(loads[i][mi], pcs):
                            d = _piece_dot(k, hdr, qs, pc)
                            acc[mi][i] = d if acc[mi][i] is None else acc[mi][i] + d
            else:
                for p, pc in enumerate(pcs):
                    slots = [(i, mi) for i in range(R) for mi in range(nm)]
                    items = [loads[i][mi][p] for i, mi in slots]
                    if spec.xmode == "shared":
                        def get_x(h, w, p=p):
                            return k.ld(sx_base + ((p * 8 + 4 * h + w) * thr * 16), f32, vec=4)
                    else:
                        def get_x(h, w, pc=pc):
                            return k.ld(pc["xa"] + (128 * h + 16 * w), f32, vec=4, nc=True)
                    for (i, mi), d in zip(slots, _rows_dot(k, items, pc, get_x)):
                        acc[mi][i] = d if acc[mi][i] is None else acc[mi][i] + d
            write_outputs(k, spec, acc, red, warps, rg, row_end, y, r, tid, norm=nsum, slice_=sl)

        issue_ = stage_out if spec.stage else issue
        # early: the first group's weight loads go out before x's (latencies overlap)
        first = issue_(first_row) if early else None
        if early:
            pdl_wait(k, spec)
        xsrc = x
        if S > 1:
            # x read once per CTA: coalesced 16-byte loads into shared memory
            sx = k.shared_array("sx", f32, spec.k, align=16)
            n4 = spec.k // 4
            for ci in k.strided(tid_cta, n4, thr * S):
                k.st(sx[ci << 2], k.ld(x[ci << 2], f32, vec=4, nc=True))
            k.bar_sync(0)
            xsrc = sx
        if spec.xmode == "shared":
            sx = k.shared_array("sx", f32, ppt * 8 * thr * 4, align=16)
            sx_base = sx[tid * 4]
        for p, pc in enumerate(pcs):
            _piece_x(k, xsrc, pc, norm[0] if norm else None, shared=S > 1)
            if spec.dot == "dp4a":
                _piece_planes(k, pc)
            if spec.xmode == "shared":
                _park_x(k, pc, sx_base, p, thr)
            elif spec.xmode == "global":
                pc.pop("x")
                pc["mask_out"] = True
        nsum = _norm_sum(k, spec, pcs, norm, red, warps, tid, sl)
        if spec.prefetch:
            cur = [k.var(u32, w) for w in regs_of(first)]
            with k.for_range(row0, row_end, R) as rg:
                nxt = issue(rg + R)
                it = iter(cur)
                loads = [[[(tuple(next(it) for _ in range(4)), tuple(next(it) for _ in range(4)))
                           for _ in bases[mi]] for mi in range(nm)] for _ in range(R)]
                body(loads, rg)
                for v, w in zip(cur, regs_of(nxt)):
                    k.assign(v, w)
        elif spec.early:
            # peeled first group (every CTA has at least one row; a slice past
            # the CTA's rows works on clamped rows and stores nothing), then the rest
            body(first, first_row)
            with k.for_range(first_row + step, loop_end, step) as rg:
                body(issue_(rg), rg)
        else:
            with k.for_range(first_row, loop_end, step) as rg:
                body(issue_(rg), rg)
    return m
