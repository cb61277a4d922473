"""The batched GEMV's pieces: where a thread's weights and x values lie, x
as ``dot="dp4a"`` byte planes, the weights decoded once per row, and the
dot of one decoded row with one row of x (:mod:`.batched`).

A piece is a run of K a thread owns for the whole kernel.  Its x values,
for each of the ``batch`` rows of x, are split once into the three byte
planes of :func:`.common.x_planes` (``x ~ s T``, ``|T| <= XFULL``, ``s =
max|x| / XFULL`` over the piece) and kept in shared memory; each row of
weights is decoded once into integer words ``dp4a`` takes, and dotted with
every row's planes.

- **Q4_K** (32 weights: :mod:`.q4k`'s piece, 16 bytes of nibbles, low
  nibbles weights ``xo .. xo + 16``, high ``xo + 32 ..``): the low nibbles
  masked (``q``), the high ones in place (``16 q``); ``sum x w = d (16
  sc_lo P_lo + sc_hi P_hi) s / 16 - dmin (m_lo X_lo + m_hi X_hi)`` with
  ``P`` the halves' plane sums and ``X`` the halves' sums of x (kept beside
  the planes).
- **Q6_K** (16 consecutive weights of one 16-weight scale group: piece
  ``p`` is weights ``16 p ..``): in block ``p // 16``, half ``n``, quarter
  ``q`` (the low or high nibbles of ``ql[32 (q & 1) ..]`` and bits ``2 q``
  of ``qh``) and 16-lane half ``l`` of the 32 a quarter spans; each weight
  becomes the signed byte ``4 (q - 32)`` (:func:`.staged._q6_dot_planes`'s
  trick), one scale a piece: ``sum x w = d sc s / 4 P``.
- **Q8_0** (16 weights, half a block): the quants are the signed bytes
  ``dp4a`` takes: ``sum x w = d s P``.

One row's plane sums are exact in s32 except where they are combined in
f32 (one rounding): ``dp4a`` sums of 16 weights against a plane stay below
2^24, their combination ``P = P0 2^16 + P1 2^8 + P2`` may not fit an s32.
"""

from __future__ import annotations

from ptxgen.types import f16, f32, s8, s32, u16, u32

from .common import PLANE_SIGNED, PLANE_W, XFULL, plane_inverse, u32_at, x_planes
from .q4k import byte_times16, piece_scales, scale_selectors

__all__ = ["BATCH_FORMATS", "plane_sums_f32"]


def _sum(k, vals):
    t = vals[0]
    for a in vals[1:]:
        t = t + a
    return t


def _load_x(k, x, xo, valid, n):
    """``n`` x values from element ``xo`` of the row ``x`` (16-byte loads,
    all issued before the first use), zero where the piece is past K."""
    xa = x[xo]
    raw = []
    for v in range(n // 4):
        raw += list(k.ld(xa + 16 * v, f32, vec=4, nc=True))
    zero = k.mov(0.0, f32)
    return [k.select(valid, a, zero) for a in raw]


def plane_sums_f32(k, words, planes, *, signed_a, exact):
    """``sum q T`` over 4 words of weight bytes ``q`` against three planes
    (``planes[4 p + w]``: plane ``p``'s word ``w``), as f32: planes 1 and 2
    combined in s32 (``mad``), plane 0 added in s32 where ``exact`` (the sum
    fits) or in f32 (one rounding)."""
    acc = [0, 0, 0]
    for w, q in enumerate(words):
        for p in range(3):
            acc[p] = k.dp4a(q, planes[4 * p + w], acc[p], signed_a=signed_a,
                            signed_b=PLANE_SIGNED[p])
    w0, w1 = PLANE_W
    lo = k.mad(acc[1].bitcast(s32), w1, acc[2].bitcast(s32))
    if exact:
        return k.mad(acc[0].bitcast(s32), w0, lo).to(f32)
    return k.fma(acc[0].to(f32), float(w0), lo.to(f32))


# ------------------------------------------------------------------ Q4_K
def _q4k_offsets(k, p, total):
    valid = p < total
    pc = k.min(p, total - 1)
    sb = pc >> 3
    c = pc & 7
    j = c >> 1
    h32 = sb * 144
    out = dict(valid=valid, xo=(sb << 8) + (j << 6) + ((c & 1) << 4),
               h32=h32, q32=h32 + (c << 4) + 16)
    out.update(scale_selectors(k, c))
    return out


def _q4k_x(k, x, pc):
    """The piece's x for one row: both halves' planes (24 words) and
    ``(s / 16, X_lo, X_hi)``."""
    vals = _load_x(k, x, pc["xo"], pc["valid"], 16)
    vals += _load_x(k, x, pc["xo"] + 32, pc["valid"], 16)
    lo, hi = vals[:16], vals[16:]
    amax, inv = plane_inverse(k, vals)
    planes = [w for half in (lo, hi) for plane in x_planes(k, half, inv) for w in plane]
    return planes, [amax * (1.0 / (16 * XFULL)), _sum(k, lo), _sum(k, hi)]


def _q4k_decode(k, at, pc):
    """One row's piece: the nibble words (low masked, high in place) and the
    sub-blocks' ``d sc`` (``16 d sc`` for the low half) and ``-dmin m``."""
    hdr = k.ld(at("h32"), u32, vec=4)
    qs = k.ld(at("q32"), u32, vec=4)
    w = piece_scales(k, hdr, pc)
    sc_lo16 = byte_times16(k, w, 0)
    sc_hi, m_lo, m_hi = (k.bfe(w, 8 * b, 8).to(f32) for b in (1, 2, 3))
    d_h, dmin_h = k.unpack(hdr[0], f16, 2)
    d = d_h.to(f32)
    ndmin = -dmin_h.to(f32)
    return dict(lo=[q & 0x0F0F0F0F for q in qs], hi=[q & 0xF0F0F0F0 for q in qs],
                dl=d * sc_lo16, dh=d * sc_hi, ml=ndmin * m_lo, mh=ndmin * m_hi)


def _q4k_dot(k, dec, planes, extras, acc):
    xscale, xs_lo, xs_hi = extras
    p_lo = plane_sums_f32(k, dec["lo"], planes[:12], signed_a=False, exact=True)
    p_hi = plane_sums_f32(k, dec["hi"], planes[12:], signed_a=False, exact=False)
    t = k.fma(dec["dh"], p_hi, dec["dl"] * p_lo)
    acc = k.fma(t, xscale, acc)
    acc = k.fma(dec["ml"], xs_lo, acc)
    return k.fma(dec["mh"], xs_hi, acc)


# --------------------------------------------------------- Q6_K and Q8_0
def _run_x(factor):
    def x_words(k, x, pc):
        """The piece's 16 x values as planes (12 words) and ``s * factor``."""
        vals = _load_x(k, x, pc["xo"], pc["valid"], 16)
        amax, inv = plane_inverse(k, vals)
        planes = [w for plane in x_planes(k, vals, inv) for w in plane]
        return planes, [amax * (factor / XFULL)]
    return x_words


def _q6k_offsets(k, p, total):
    valid = p < total
    pc = k.min(p, total - 1)
    blk = pc >> 4
    u = pc & 15
    n = u >> 3
    q = (u >> 1) & 3
    lam = u & 1
    boff = blk * 210
    return dict(valid=valid, xo=pc << 4,
                ql=boff + (n << 6) + ((q & 1) << 5) + (lam << 4),
                qh=boff + 128 + (n << 5) + (lam << 4),
                sc=boff + 192 + (n << 3) + (q << 1) + lam,
                d=boff + 208,
                # the quarter's nibble (low for q < 2) and 2-bit field of qh
                nsh=(q >> 1) << 2, tsh=k.mov(6, u32) - (q << 1))


def _q6k_decode(k, at, pc):
    """One row's piece as 4 words of the signed bytes ``4 (q - 32)``: the
    nibble at bits 2..5, the two high bits at 6..7 with bit 7 flipped (the
    top bit of every 2-bit field of qh flipped first), and ``d sc``."""
    pk = []
    for w in range(4):
        lo = u32_at(k, at("ql", 4 * w))
        hi = u32_at(k, at("qh", 4 * w)) ^ 0xAAAAAAAA
        pk.append((((lo >> pc["nsh"]) << 2) & 0x3C3C3C3C) | ((hi << pc["tsh"]) & 0xC0C0C0C0))
    sc = k.ld(at("sc"), s8).to(f32)
    d = k.ld(at("d"), u16).bitcast(f16).to(f32)
    return dict(q=pk, ds=d * sc)


def _q8_offsets(k, p, total):
    valid = p < total
    pc = k.min(p, total - 1)
    boff = (pc >> 1) * 34
    return dict(valid=valid, xo=pc << 4, q=boff + 2 + ((pc & 1) << 4), d=boff)


def _q8_decode(k, at, pc):
    """One row's piece: its 16 signed quants as 4 words, and ``d``."""
    return dict(q=[u32_at(k, at("q", 4 * w)) for w in range(4)],
                ds=k.ld(at("d"), u16).bitcast(f16).to(f32))


def _signed_dot(k, dec, planes, extras, acc):
    p = plane_sums_f32(k, dec["q"], planes, signed_a=True, exact=False)
    return k.fma(p, dec["ds"] * extras[0], acc)


#: qtype -> (offsets(k, piece, total), x_words(k, x_row, pc),
#: decode(k, at, pc), dot(k, decoded, planes, extras, acc), the offsets
#: ``at`` reads); the sizes are :data:`.layout.BATCH_PIECES`'
BATCH_FORMATS = {
    "Q4_K": (_q4k_offsets, _q4k_x, _q4k_decode, _q4k_dot, ("h32", "q32")),
    "Q6_K": (_q6k_offsets, _run_x(0.25), _q6k_decode, _signed_dot, ("ql", "qh", "sc", "d")),
    "Q8_0": (_q8_offsets, _run_x(1.0), _q8_decode, _signed_dot, ("q", "d")),
}
