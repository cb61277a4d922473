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
are reduced over the CTA by :func:`.common.write_outputs`.
"""

from __future__ import annotations

import ptxgen
from ptxgen.types import f16, f32, s32, u32, u64

from ..spec_fields import pdl_prologue
from .common import (PLANE_SIGNED, PLANE_W, XFULL, declare_params, norm_scale, plane_inverse,
                     warp_sum, write_outputs, x_planes)
from .layout import q4k_layout

__all__ = ["build_q4k", "q4k_layout", "piece_offsets", "piece_x", "piece_nw", "piece_planes",
           "piece_dot", "piece_scales", "scale_selectors", "norm_sum"]

_SEL_BASE = 0x7044          # out = [0x00, 0x00, byte i of a, 0x3F]
_ONE_EXP = 0x3F000000


def piece_offsets(k, tid, i, thr, total):
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


def norm_sum(k, spec, pcs, norm, red, warps, tid):
    """Fused RMSNorm: the CTA's scale ``1/sqrt(mean(x^2) + eps)`` for
    :func:`write_outputs` (:func:`.common.norm_scale` over the warps'
    sums of the pieces' ``"sq"``, from :func:`piece_x` with ``nw``), or
    None without ``norm``."""
    if not norm:
        return None
    sq = pcs[0]["sq"]
    for pc in pcs[1:]:
        sq = sq + pc["sq"]
    return norm_scale(k, spec, red, warps, (warp_sum(k, sq), norm[1]), tid)


def store_normed(k, spec, pcs, norm, scale):
    """``norm_out``: CTA 0 stores its pieces' ``x * nw`` (:func:`piece_x`)
    times the CTA's ``scale`` (:func:`norm_sum`) to ``h = norm[2]``, the
    whole normed row (the CTA's pieces cover K); nothing without it."""
    if not (norm and spec.norm_out):
        return
    h = norm[2]
    for pc in pcs:
        ok = k.setp("eq", k.ctaid.x, 0, combine=("and", pc["valid"]))
        for half, vals in zip((0, 32), pc["xn"]):
            ha = h[pc["xo"] + half] if half else h[pc["xo"]]
            for v in range(4):
                k.st(ha + 16 * v, tuple(a * scale for a in vals[4 * v:4 * v + 4]), f32,
                     guard=ok)


def piece_nw(k, nw, pc):
    """Issue the loads of the piece's 32 fused-RMSNorm weights into
    ``pc["nwv"]`` (two halves of 16).  They are constants, so a kernel may
    issue them before its PDL wait; :func:`piece_x` does it otherwise."""
    xo = pc["xo"]
    halves = []
    for half in (0, 32):
        na = nw[xo + half] if half else nw[xo]
        ws = []
        for v in range(4):
            ws += list(k.ld(na + 16 * v, f32, vec=4, nc=True))
        halves.append(ws)
    pc["nwv"] = halves


def piece_x(k, x, pc, nw=None):
    """The piece's 32 x values (zero past K) and the sums of its two halves.
    With ``nw`` (fused RMSNorm) the values are ``x * nw`` and ``pc["sq"]``
    is the sum of the 32 ``x**2``.

    Every load (both halves of x, and nw unless :func:`piece_nw` issued it
    earlier) goes out before the first arithmetic on them, so they share one
    round trip to L2.  (It did not change the fused gate/up kernel's time
    alone on an H100: docs/notes/gemv.md, "The fused RMSNorm".)"""
    xo, valid = pc["xo"], pc["valid"]
    if nw is not None and "nwv" not in pc:
        piece_nw(k, nw, pc)
    raw = []
    for half in (0, 32):
        xa = x[xo + half] if half else x[xo]
        if not half:
            pc["xa"] = xa
        vals = []
        for v in range(4):
            vals += list(k.ld(xa + 16 * v, f32, vec=4, nc=True, cache=None))
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
    if nw is not None:
        pc["xn"] = xv                       # x * nw, for store_normed
    sums = []
    for vals in xv:
        t = vals[0]
        for a in vals[1:]:
            t = t + a
        sums.append(t)
    pc["x"], pc["xs"] = xv, sums


def piece_planes(k, pc):
    """Split the piece's 32 x values into three byte planes (``dot="dp4a"``,
    :func:`.common.x_planes`).  Sets ``pc["planes"]`` (per half, per
    plane, four words of four bytes) and ``pc["xscale"]`` (the factor that
    turns :func:`piece_dot`'s combined sums, 16 times the sums of q x, into
    those sums); drops the f32 values."""
    halves = pc.pop("x")
    amax, inv = plane_inverse(k, halves[0] + halves[1])
    # 1/16: the high nibbles enter dp4a in place (16 q), piece_dot scales the
    # low half's sums by 16 to match
    pc["xscale"] = amax * (1.0 / (16 * XFULL))
    pc["planes"] = [x_planes(k, half, inv) for half in halves]
    pc.update(scale_selectors(k, pc["c"]))


def scale_selectors(k, c):
    """For :func:`piece_scales`, per lane of piece ``c`` (0..7, a register)
    of a super-block: the prmt selector that gathers bytes b, b+1 of two
    words (b = 2 (j & 1), j = c // 2), and the masks of the lane's case (j <
    2, j >= 2), as ``sel``, ``g_a``, ``g_b``, ``g_c``."""
    j = c >> 1
    hi = j >= 2
    return dict(sel=((j & 1) << 1) * 0x1111 + 0x5410,
                g_a=k.select(hi, k.mov(0, u32), k.mov(0x3F3F3F3F, u32)),
                g_b=k.select(hi, k.mov(0x30303030, u32), k.mov(0, u32)),
                g_c=k.select(hi, k.mov(0x0F0F0F0F, u32), k.mov(0, u32)))


def byte_times16(k, v, b):
    """16 times byte ``b`` of ``v`` as f32, exactly: the byte placed in the
    low mantissa bits of 2^27 (where one unit is 16) by a ``prmt``, then
    2^27 subtracted; two full-rate instructions."""
    return k.prmt(v, 0x4D000000, 0x7540 | b).bitcast(f32) - 134217728.0


def half_planes_dot(k, words, planes, high):
    """The sum ``sum q T`` over one half piece as f32 (16 times it for the
    high nibbles; ``T``: x as :func:`.common.x_planes` holds it): four
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


def piece_scales(k, hdr, pc):
    """The 6-bit scales and mins of the piece's two sub-blocks (2j, 2j+1)
    as one word ``[sc_lo, sc_hi, m_lo, m_hi]``: two ``prmt`` gather bytes
    2(j&1), 2(j&1)+1 of the header's scale words (j < 2: their low 6 bits;
    j >= 2: 4 bits from the third word, 2 from the top of the first two);
    the per-lane masks pick the case without branches."""
    _, h1, h2, h3 = hdr
    p = k.prmt(h1, h2, pc["sel"])
    r = k.prmt(h3, h3 >> 4, pc["sel"])
    return (p & pc["g_a"]) | ((p >> 2) & pc["g_b"]) | (r & pc["g_c"])


def half_dot(k, words, xs, shift_left):
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


def piece_dot(k, hdr, qs, pc):
    """Contribution of one piece of one row: sum over its 32 weights of x w."""
    h0, h1, h2, h3 = hdr
    d_h, dmin_h = k.unpack(h0, f16, 2)
    xs_lo, xs_hi = pc["xs"]
    if "planes" in pc:
        # sum x w = d s (16 sc_lo P_lo + sc_hi P_hi) / 16 - dmin (m_lo X_lo + m_hi X_hi)
        # (P: the combined plane sums, P_hi already 16 times; s / 16 = xscale)
        w = piece_scales(k, hdr, pc)
        # 16 sc_lo by prmt and a subtraction; the others by ``bfe`` and
        # ``cvt``, which ptxas fuses into one I2F.U8 with a byte selector (on
        # the conversion unit, which has time to spare here)
        sc_lo = byte_times16(k, w, 0)
        sc_hi, m_lo, m_hi = (k.bfe(w, 8 * b, 8).to(f32) for b in (1, 2, 3))
        p_lo = half_planes_dot(k, qs, pc["planes"][0], False)
        p_hi = half_planes_dot(k, qs, pc["planes"][1], True)
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
    x_lo, x_hi = pc["x"]
    s_lo = half_dot(k, qs, x_lo, True)
    s_hi = half_dot(k, qs, x_hi, False)
    part = (d16 * sc_lo) * (s_lo - xs_lo)
    part = k.fma(d16 * sc_hi, s_hi - xs_hi, part)
    mx = k.fma(m_lo, xs_lo, m_hi * xs_hi)
    return k.fma(ndmin, mx, part)


def build_q4k(spec, params=declare_params, finish=None) -> ptxgen.Module:
    """Build the direct Q4_K GEMV kernel of the plan ``spec``: every thread
    holds its pieces' x in registers and loads each row group's weights
    straight into registers (16-byte ``ld.global.nc``), one group at a time.
    ``params`` declares the parameters (:func:`.common.declare_params`'s
    signature and result); ``finish`` ends the kernel
    (:func:`ptxgen.kernels.gemv.build`)."""
    ppt, thr, total = q4k_layout(spec)
    nm, R, rb = spec.n_mats, spec.rows, spec.row_bytes
    warps = thr // 32
    m = ptxgen.Module(spec.target)
    kdir = dict(reqntid=thr)
    if spec.min_ctas:
        kdir["minnctapersm"] = spec.min_ctas
    with m.kernel(spec.kernel_name, **kdir) as k:
        ws, x, r, y, mrows, rpc, red, norm = params(k, spec, warps)
        pdl_prologue(k, spec)
        tid = k.tid.x
        pcs = [piece_offsets(k, tid, i, thr, total) for i in range(ppt)]
        bases = [[(k.ptr_add(w, pc["hoff"]), k.ptr_add(w, pc["qoff"])) for pc in pcs]
                 for w in ws]
        row0 = k.ctaid.x * rpc
        row_end = k.min(mrows, row0 + rpc)
        last = row_end - 1

        def issue(rg):
            """All loads of the row group at ``rg`` (rows clamped to the CTA's last)."""
            out = []
            for i in range(R):
                off = k.mul_wide(k.min(rg + i, last), rb)
                out.append([[(k.ld(hb[off], u32, vec=4, nc=True, evict="L1::no_allocate"),
                              k.ld(qb[off], u32, vec=4, nc=True, evict="L1::no_allocate"))
                             for hb, qb in bases[mi]] for mi in range(nm)])
            return out

        for pc in pcs:
            piece_x(k, x, pc, norm[0] if norm else None)
            if spec.dot == "dp4a":
                piece_planes(k, pc)
        nsum = norm_sum(k, spec, pcs, norm, red, warps, tid)
        store_normed(k, spec, pcs, norm, nsum)
        with k.for_range(row0, row_end, R) as rg:
            loads = issue(rg)
            acc = [[None] * R for _ in range(nm)]
            for i in range(R):
                for mi in range(nm):
                    for (hdr, qs), pc in zip(loads[i][mi], pcs):
                        d = piece_dot(k, hdr, qs, pc)
                        acc[mi][i] = d if acc[mi][i] is None else acc[mi][i] + d
            write_outputs(k, spec, acc, red, warps, rg, row_end, y, r, tid, norm=nsum)
        if finish is not None:
            finish(k, (row0, row_end, R), tid)
    return m
