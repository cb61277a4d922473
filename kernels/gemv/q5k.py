"""Q5_K pieces for the staged and ring GEMV kernels.

A Q5_K super-block (176 bytes, 256 weights) is Q4_K's with a plane of
fifth bits between the header and the nibbles (docs/quants.md)::

    0   f16 d    2  f16 dmin    4..15  6-bit scales/mins, packed as Q4_K's
    16..47   qh: bit s of qh[l] is the fifth bit of weight 32 s + l
    48..175  qs: placed as Q4_K's nibbles

``w = d sc q - dmin m`` with ``q`` in 0..31.  A piece is Q4_K's (32
weights, :mod:`.q4k`): piece ``c`` (0..7) of super-block ``sb`` is the 16
bytes ``qs[16c .. 16c + 16)``, weights ``64j + 16h + (0..16)`` in the low
nibbles (sub-block ``2j``) and ``+ 32`` in the high ones (sub-block ``2j +
1``), ``j = c // 2``, ``h = c % 2``; their fifth bits are bits ``2j`` and
``2j + 1`` of ``qh[16h .. 16h + 16)``.  Everything is 16-byte aligned (176 =
11 x 16), so a piece reads the header, its qh and its qs with three
``ld.shared.v4``.  The scales and mins are gathered with
:func:`.q4k.piece_scales`.

Each qh word is shifted right by ``2j`` once; the two fifth bits of a byte
are then its bits 0 and 1, moved into place with a shift and a mask.

- ``dot="fma"``: bytes ``0x80 | q << 2`` become ``1 + q/32`` (one ``prmt``),
  ``T = sum x (1 + q/32) - X`` per half (the chain starts at ``-X``), and
  ``sum x w = 32 d (sc_lo T_lo + sc_hi T_hi) - dmin (m_lo X_lo + m_hi X_hi)``.
- ``dot="dp4a"`` (through the ring): three ``dp4a`` a word against the byte
  planes of x; a half's ``sum q T`` is at most ``31 * (4e6 + 1) * 16 <
  2^31``, exact in s32, then converted and scaled in f32.
"""

from __future__ import annotations

from ptxgen.types import f16, f32, u32

from .common import PLANE_SIGNED, XFULL, plane_inverse, plane_sums, x_planes
from .q4k import piece_scales, scale_selectors

__all__ = ["Q5K_FORMAT"]

_ONE_EXP = 0x3F000000
_SEL_BASE = 0x7044          # out = [0x00, 0x00, byte i of a, 0x3F]


def _q5k_piece(k, sm, x, tile_k0, tid, lay):
    """Piece ``tid`` of a tile: super-block ``tid // 8``, piece ``c = tid %
    8``; its 32 x values (low half, high half), their sums, the offsets of
    its header, qh and qs in a tile row, and its lane's scale selectors."""
    sb = tid >> 3
    c = tid & 7
    j = c >> 1
    h = c & 1
    xa = x[tile_k0 + (sb << 8) + (j << 6) + (h << 4)]
    halves = []
    for half in (0, 128):                   # x[+0 .. 16), x[+32 .. 48)
        vals = []
        for v in range(4):
            off = half + 16 * v
            vals += list(k.ld(xa + off if off else xa, f32, vec=4, nc=True))
        halves.append(vals)
    sums = []
    for vals in halves:
        t = vals[0]
        for a in vals[1:]:
            t = t + a
        sums.append(t)
    hoff = sb * 176
    pc = dict(x=halves, xs=sums, hdr=hoff, qh=hoff + 16 + (h << 4), qs=hoff + 48 + (c << 4),
              hsh=j << 1)
    pc.update(scale_selectors(k, c))
    return pc


def _q5k_planes(k, pc):
    """``dot="dp4a"``: the piece's 32 x values as byte planes (per half) and
    the factor from integer sums to sums of ``x q``; drops the f32 values."""
    halves = pc.pop("x")
    amax, inv = plane_inverse(k, halves[0] + halves[1])
    pc["xscale"] = amax * (1.0 / XFULL)
    pc["planes"] = [x_planes(k, half, inv) for half in halves]


def _q5k_dot(k, spec, row, pc):
    """The piece's ``sum x w`` for one row of a tile or stage."""
    hdr = k.ld(row[pc["hdr"]], u32, vec=4)
    qh = k.ld(row[pc["qh"]], u32, vec=4)
    qs = k.ld(row[pc["qs"]], u32, vec=4)
    d_h, dmin_h = k.unpack(hdr[0], f16, 2)
    sw = piece_scales(k, hdr, pc)
    sc_lo, sc_hi, m_lo, m_hi = (k.bfe(sw, 8 * b, 8).to(f32) for b in range(4))
    hl = [w >> pc["hsh"] for w in qh]
    xs_lo, xs_hi = pc["xs"]
    msum = k.fma(m_hi, xs_hi, m_lo * xs_lo)
    ndmin = -dmin_h.to(f32)
    if "planes" in pc:
        sums = []
        for half in range(2):
            acc = [None, None, None]
            for i in range(4):
                if half:
                    q = ((qs[i] >> 4) & 0x0F0F0F0F) | ((hl[i] << 3) & 0x10101010)
                else:
                    q = (qs[i] & 0x0F0F0F0F) | ((hl[i] << 4) & 0x10101010)
                for p in range(3):
                    acc[p] = k.dp4a(q, pc["planes"][half][p][i], 0 if acc[p] is None else acc[p],
                                    signed_b=PLANE_SIGNED[p])
            sums.append(plane_sums(k, acc).to(f32))
        ssum = k.fma(sc_hi, sums[1], sc_lo * sums[0])
        return k.fma(d_h.to(f32) * pc["xscale"], ssum, ndmin * msum)
    ts = []
    for half in range(2):
        acc = -pc["xs"][half]
        for i in range(4):
            if half:
                pk = ((qs[i] >> 2) & 0x3C3C3C3C) | ((hl[i] << 5) & 0x40404040)
            else:
                pk = ((qs[i] << 2) & 0x3C3C3C3C) | ((hl[i] << 6) & 0x40404040)
            pk = pk | 0x80808080
            for b in range(4):
                f = k.prmt(pk, _ONE_EXP, _SEL_BASE | (b << 8)).bitcast(f32)
                acc = k.fma(pc["x"][half][4 * i + b], f, acc)
        ts.append(acc)
    ssum = k.fma(sc_hi, ts[1], sc_lo * ts[0])
    return k.fma(d_h.to(f32) * 32.0, ssum, ndmin * msum)


#: (piece_fn, dot_fn, planes_fn) for :data:`.staged.FORMATS`
Q5K_FORMAT = (_q5k_piece, _q5k_dot, _q5k_planes)
