"""F16 and BF16 pieces for the staged and ring GEMV kernels.

Rows are plain 2-byte values; the GEMV reads them 8 weights (16 bytes) at a
time, its block (:func:`.spec.read_unit`), so K is a multiple of 8 and every
row is 16-byte aligned: through the ring always.  A piece is one such
block: one ``ld.shared.v4`` a row, its 8 x values in registers, and one
conversion and one ``fma`` a weight (``cvt.f32.f16``; a BF16 value is the top
half of its f32, one shift or ``and``), f32 throughout.  At 2 bytes a weight
the arithmetic is far below what the loads take, so there is no ``dp4a``
form.
"""

from __future__ import annotations

from ptxgen.types import f16, f32, u32

__all__ = ["FLOAT_FORMATS"]


def _piece(k, sm, x, tile_k0, tid, lay):
    """Piece ``tid`` of a tile: weights ``8 tid + (0..8)``."""
    xa = x[tile_k0 + (tid << 3)]
    xv = list(k.ld(xa, f32, vec=4, nc=True)) + list(k.ld(xa + 16, f32, vec=4, nc=True))
    return dict(x=xv, off=tid << 4)


def _pairs_f16(k, w):
    lo, hi = k.unpack(w, f16, 2)
    return lo.to(f32), hi.to(f32)


def _pairs_bf16(k, w):
    return (w << 16).bitcast(f32), (w & 0xFFFF0000).bitcast(f32)


def _dot(pairs):
    def dot(k, spec, row, pc):
        """The piece's ``sum x w`` for one row of a tile or stage."""
        acc = None
        for i, w in enumerate(k.ld(row[pc["off"]], u32, vec=4)):
            for h, v in enumerate(pairs(k, w)):
                xi = pc["x"][2 * i + h]
                acc = xi * v if acc is None else k.fma(xi, v, acc)
        return acc
    return dot


#: qtype -> (piece_fn, dot_fn, planes_fn) for :data:`.staged.FORMATS`
FLOAT_FORMATS = {"F16": (_piece, _dot(_pairs_f16), None),
                 "BF16": (_piece, _dot(_pairs_bf16), None)}
