"""Q4_0, Q4_1, Q5_0 and Q5_1 pieces for the staged and ring GEMV kernels.

The 32-weight blocks (byte maps in docs/quants.md)::

    Q4_0  d f16 | qs[16]                    (18 bytes)  w = d (q - 8)
    Q4_1  d f16 | m f16 | qs[16]            (20 bytes)  w = d q + m
    Q5_0  d f16 | qh u32 | qs[16]           (22 bytes)  w = d (q - 16)
    Q5_1  d f16 | m f16 | qh u32 | qs[16]   (24 bytes)  w = d q + m

The low four bits of weight ``j < 16`` are the low nibble of ``qs[j]``, those
of weight ``j + 16`` its high nibble; Q5's fifth bit of weight ``j`` is bit
``j`` of ``qh``.  A *piece* is 16 weights: piece ``c`` (0 or 1) of a block is
``qs[8c .. 8c + 8)`` as two words, weights ``8c + (0..8)`` in the low
nibbles and ``16 + 8c + (0..8)`` in the high ones, with ``qh``'s bytes ``c``
and ``2 + c``.  A block starts 2 (Q4_0, Q5_0), 4 (Q4_1) or 8 (Q5_1) bytes
aligned in a row, so the words come from shared memory as 16-bit halves,
32-bit or 64-bit loads accordingly.

Each word becomes four bytes holding ``q`` (the fifth bits spread to bit 4
of each byte by one multiply: the nibble of ``qh`` times ``0x02040810``
copies its bits to bits 4, 12, 20 and 28 with no carries), then:

- ``dot="fma"``: the bytes become the floats ``1 + q / 2^b`` (``b`` bits;
  one ``prmt`` each, as :mod:`.q4k` does) and ``F = sum x (1 + q/2^b)``, so
  ``sum x q = 2^b (F - X)`` (``X = sum x``) and ``sum x w = 2^b d (F - 1.5
  X)`` for Q4_0/Q5_0 (the offset ``2^(b-1)``), ``2^b d (F - X) + m X`` for
  Q4_1/Q5_1; the fma chain starts at ``-1.5 X`` or ``-X``.
- ``dot="dp4a"`` (through the ring): three ``dp4a`` a word against the byte
  planes of x (:func:`.common.x_planes`); ``sum q T`` over a piece is at
  most ``31 * (4e6 + 1) * 16 < 2^31``, exact in s32.  The offset is
  subtracted in integers for free: plane 2's chain starts at ``-2^(b-1)
  sum T`` (``sum T`` once per piece, by ``dp4a`` against ones).  One
  conversion and one or two float products a piece.
"""

from __future__ import annotations

import attrs

from ptxgen.types import f16, f32, u16, u32

from .common import PLANE_SIGNED, XFULL, plane_inverse, plane_sums, u32_at, x_planes

__all__ = ["LEGACY_FORMATS", "LegacyFormat"]

_ONE_EXP = 0x3F000000
_SEL_BASE = 0x7044          # out = [0x00, 0x00, byte i of a, 0x3F]


@attrs.frozen
class LegacyFormat:
    """One 32-weight format: its block bytes, bits per weight, the byte
    offsets of ``m``, ``qh`` and ``qs`` in a block (None where absent), and
    the offset ``zero`` subtracted from ``q`` (0 with ``m``)."""

    name: str
    block_bytes: int
    bits: int
    m_off: int | None
    qh_off: int | None
    qs_off: int
    zero: int

    @property
    def align(self) -> int:
        """The alignment of every block's start in a 16-byte aligned row."""
        return self.block_bytes & -self.block_bytes


FORMATS = {f.name: f for f in (
    LegacyFormat("Q4_0", 18, 4, None, None, 2, 8),
    LegacyFormat("Q4_1", 20, 4, 2, None, 4, 0),
    LegacyFormat("Q5_0", 22, 5, None, 2, 6, 16),
    LegacyFormat("Q5_1", 24, 5, 2, 4, 8, 0),
)}


def _piece(fmt):
    def piece(k, sm, x, tile_k0, tid, lay):
        """Piece ``tid`` of a tile: block ``tid // 2``, half ``c = tid % 2``;
        its 16 x values (the low-nibble weights, then the high ones) and their
        sum, and the byte offsets of its fields in a tile row."""
        b = tid >> 1
        c = tid & 1
        xa = x[tile_k0 + (b << 5) + (c << 3)]
        xv = []
        for off in (0, 16, 64, 80):         # x[8c + 0..8], x[16 + 8c + 0..8]
            xv += list(k.ld(xa + off if off else xa, f32, vec=4, nc=True))
        xs = xv[0]
        for v in xv[1:]:
            xs = xs + v
        boff = b * fmt.block_bytes
        pc = dict(x=xv, xs=xs, d=boff, qs=boff + fmt.qs_off + (c << 3))
        # the fma chain starts at -(1 + zero / 2^b) X
        pc["neg"] = xs * -(1.0 + fmt.zero / (1 << fmt.bits))
        if fmt.qh_off is not None:
            pc["qh"] = boff + fmt.qh_off
            pc["hsh"] = c << 3
        return pc
    return piece


def _planes(fmt):
    def planes(k, pc):
        """``dot="dp4a"``: the piece's x as byte planes, the factor from
        integer sums to sums of ``x q`` and, for an offset format, plane 2's
        start ``-zero * sum T``; drops the f32 values."""
        vals = pc.pop("x")
        pc.pop("neg")
        amax, inv = plane_inverse(k, vals)
        pc["xscale"] = amax * (1.0 / XFULL)
        pc["planes"] = x_planes(k, vals, inv)
        if fmt.zero:
            st = [None] * 3
            for w in range(4):
                for p in range(3):
                    st[p] = k.dp4a(pc["planes"][p][w], 0x01010101, 0 if st[p] is None else st[p],
                                   signed_a=PLANE_SIGNED[p])
            pc["start"] = (plane_sums(k, st) * -fmt.zero).bitcast(u32)
            pc.pop("xs")
    return planes


def _words(k, fmt, row, pc):
    """The piece's two qs words, and the qh word shifted so that bits 0..7
    and 16..23 are its fifth bits (Q5 formats; else None)."""
    a = fmt.align
    qa = row[pc["qs"]]
    if a >= 8:
        qs = list(k.ld(qa, u32, vec=2))
    elif a == 4:
        qs = [k.ld(qa, u32), k.ld(qa + 4, u32)]
    else:
        qs = [u32_at(k, qa), u32_at(k, qa + 4)]
    qh = None
    if fmt.qh_off is not None:
        ha = row[pc["qh"]]
        qh = k.ld(ha, u32) if a >= 4 and fmt.qh_off % 4 == 0 else u32_at(k, ha)
        qh = qh >> pc["hsh"]
    return qs, qh


def _q_bytes(k, fmt, qs, qh, shift):
    """Four words (the low nibbles of both qs words, then the high ones) of
    bytes ``q << shift`` (``shift + bits <= 7``)."""
    mask = 0x0F0F0F0F << shift
    out = []
    for high in (False, True):
        for i, w in enumerate(qs):
            if high:
                t = (w >> (4 - shift)) if shift < 4 else w
            else:
                t = (w << shift) if shift else w
            q = t & mask
            if qh is not None:
                nib = k.bfe(qh, (16 if high else 0) + 4 * i, 4)
                q = q | ((nib * (0x02040810 << shift)) & (0x10101010 << shift))
            out.append(q)
    return out


def _dot(fmt):
    def dot(k, spec, row, pc):
        """The piece's ``sum x w`` for one row of a tile or stage."""
        if fmt.m_off is None:
            d = k.ld(row[pc["d"]], u16).bitcast(f16).to(f32)
            m = None
        else:
            # d and m are one aligned word (blocks are 4-byte aligned)
            dh, mh = k.unpack(k.ld(row[pc["d"]], u32), f16, 2)
            d, m = dh.to(f32), mh.to(f32)
        qs, qh = _words(k, fmt, row, pc)
        if "planes" in pc:
            acc = [None, None, None]
            for w, q in enumerate(_q_bytes(k, fmt, qs, qh, 0)):
                for p in range(3):
                    start = acc[p]
                    if start is None:
                        start = pc["start"] if (p == 2 and "start" in pc) else 0
                    acc[p] = k.dp4a(q, pc["planes"][p][w], start, signed_b=PLANE_SIGNED[p])
            s = plane_sums(k, acc).to(f32)
            if m is None:
                return (d * pc["xscale"]) * s
            return k.fma(d * pc["xscale"], s, m * pc["xs"])
        shift = 7 - fmt.bits
        acc = pc["neg"]
        for w, q in enumerate(_q_bytes(k, fmt, qs, qh, shift)):
            pk = q | 0x80808080
            for b in range(4):
                f = k.prmt(pk, _ONE_EXP, _SEL_BASE | (b << 8)).bitcast(f32)
                acc = k.fma(pc["x"][4 * w + b], f, acc)
        d2 = d * float(1 << fmt.bits)
        if m is None:
            return d2 * acc
        return k.fma(d2, acc, m * pc["xs"])
    return dot


#: qtype -> (piece_fn, dot_fn, planes_fn) for :data:`.staged.FORMATS`
LEGACY_FORMATS = {name: (_piece(f), _dot(f), _planes(f)) for name, f in FORMATS.items()}
