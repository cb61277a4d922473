"""The 32-weight block formats of the sm_90a GEMM
(:func:`.wgmma_q4k.build_wgmma`): Q8_0, Q4_0 and Q5_0.

Their blocks are only 2-byte aligned in a row (34, 18 and 22 bytes).  A
stage (64 weights: blocks ``2 s`` and ``2 s + 1`` of the row, ``2 bb``
bytes from byte ``2 bb s``) copies the 16-byte aligned window that holds
them (:class:`.kernel.WindowCopies`, ``plan.w_chunks`` chunks); the data
starts ``(row row_bytes + 2 bb s) & 15`` bytes in, a shift that changes
with every stage.  The K order is natural: wgmma step ``st`` takes weights
``16 st ..``, of block ``st / 2``; thread ``t`` holds the pairs ``k0 = 16
st + 2t`` and ``k0 + 8``, each one ``ld.shared.u16`` of the block's bytes
spread into the halves of a register (``prmt 0x4140``), decoded to the
exact level in f16 and multiplied by the block's ``(d, d)`` (rounded once):

- **Q8_0** (``d``, 32 int8 ``q``; :mod:`.q8_0`): the pair is bytes ``2 + k``
  of the block; ``^ 0x00800080 | 0x64006400`` is ``1024 + (q + 128)``,
  ``sub.f16x2`` 1152 leaves ``q``.  5 instructions a register.
- **Q4_0** (``d``, 16 bytes ``qs``; weight ``i`` the low nibble of
  ``qs[i]``, ``16 + i`` the high one, ``q - 8``): steps ``2b`` take low
  nibbles (``| 0x64006400`` is ``1024 + q``, ``sub`` 1032), steps ``2b + 1``
  high ones (``1024 + 16 q``, ``fma (h, 1/16, -72)``).  5 a register.
- **Q5_0** (``d``, the 32 fifth bits ``qh`` as a little-endian u32, then
  ``qs`` as Q4_0; ``q - 16``): as Q4_0 with bit ``k`` of ``qh`` put at bit 4
  of the half (low nibbles: ``1024 + q``, ``sub`` 1040) or at bit 8 (high:
  ``1024 + 16 q``, ``fma (h, 1/16, -80)``).  About 10 a register.

Accuracy: ``x`` and the weight (``d (q - z)``, ``q - z`` exact) each rounded
to f16 once: ``2.01 u |x| |w|`` a product, plus the wgmma chain's ``2^-21``
of ``sum |x w|`` per 16-wide step.
"""

from __future__ import annotations

from ptxgen.types import b32, f16, f16x2, u16, u32
from ptxgen.values import Address

from ..quants.qtypes import QTYPES
from .kernel import WindowCopies, row_shift
from .spec import WG_X_ROW

__all__ = ["Q80Format", "Q40Format", "Q50Format"]


def _sh(addr, off=0, ty=b32):
    return Address(addr, off, "shared", ty)


class _Blocks32:
    """Copies and A fragments of a 32-weight block format; subclasses give
    ``_register(k, rb, b, st, half)``: the A register of the lane's pair
    (step ``st``, ``half``) of block ``b`` whose data starts at ``rb``
    (the lane's ``2t`` folded in)."""

    QTYPE = ""

    def __init__(self, k, plan, tid, w, m0, mrows, rho, tq):
        self.k, self.plan = k, plan
        self.bb = QTYPES[self.QTYPE].type_size
        self.xoff = plan.config.bn * WG_X_ROW
        self.win = WindowCopies(k, plan, tid, w, m0, mrows, [(plan.w_chunks, 0)])
        self.sb = k.var(u32, 0)                  # the super-block being computed
        self.rows = [k.min(m0 + rho + 8 * h, mrows - 1) for h in range(2)]
        self.roff = [self.xoff + (rho + 8 * h) * plan.w_pitch for h in range(2)]
        self.t2 = 2 * tq

    def _start(self, sb, j):
        return (8 * self.bb) * sb + 2 * self.bb * j

    def copy(self, stage, ahead, j, guard):
        k = self.k
        start = self._start(self.sb + ahead if ahead else self.sb, j)
        if guard is None:
            self.win.issue(stage + self.xoff, [start])
        else:
            with k.if_(guard):
                self.win.issue(stage + self.xoff, [start])

    def advance(self):
        self.sb.set(self.sb + 1)

    def fragments(self, stage, j):
        k = self.k
        start = self._start(self.sb, j)
        frags = [[None] * 4 for _ in range(4)]
        for h in range(2):
            rb = stage + (self.roff[h] + row_shift(k, self.plan, self.rows[h], start))
            for b in range(2):
                d = k.ld(_sh(rb, self.bb * b, f16), f16)
                dd = k.pack(b32, d, d).bitcast(f16x2)
                self._block(rb, b)
                for st in (2 * b, 2 * b + 1):
                    for half in range(2):
                        q = self._register(k, rb + self.t2, b, st, half)
                        frags[st][h + 2 * half] = k.mul(q, dd, rnd="rn").bitcast(b32)
        return [tuple(f) for f in frags]

    def _block(self, rb, b):
        """Per-block state the registers share (Q5_0: the high bits)."""

    def _pair(self, k, base, off):
        """The two bytes at ``base + off`` spread into the halves."""
        v = k.cvt(u32, k.ld(_sh(base, off, u16), u16))
        return k.prmt(v, 0, 0x4140)


class Q80Format(_Blocks32):
    """Q8_0 for :func:`.wgmma_q4k.build_wgmma`."""

    QTYPE = "Q8_0"

    def _register(self, k, qb, b, st, half):
        p = self._pair(k, qb, self.bb * b + 2 + 16 * (st - 2 * b) + 8 * half)
        f = ((p ^ 0x00800080) | 0x64006400).bitcast(f16x2)
        return f - k.const(f16x2, 1152.0)


class Q40Format(_Blocks32):
    """Q4_0 for :func:`.wgmma_q4k.build_wgmma`."""

    QTYPE = "Q4_0"
    ZERO = 8

    def _nibbles(self, k, qb, b, half):
        return self._pair(k, qb, self.bb * b + self.bb - 16 + 8 * half)

    def _register(self, k, qb, b, st, half):
        p = self._nibbles(k, qb, b, half)
        if st == 2 * b:                          # weights 0..15: low nibbles
            f = ((p & 0x000F000F) | self._high(k, b, half, 4) | 0x64006400).bitcast(f16x2)
            return f - k.const(f16x2, 1024.0 + self.ZERO)
        f = ((p & 0x00F000F0) | self._high(k, b, half + 2, 8) | 0x64006400).bitcast(f16x2)
        return k.fma(f, k.const(f16x2, 1.0 / 16), k.const(f16x2, -(64.0 + self.ZERO)))

    def _high(self, k, b, quarter, bit):
        return 0


class Q50Format(Q40Format):
    """Q5_0 for :func:`.wgmma_q4k.build_wgmma`: Q4_0's nibbles and a fifth
    bit from the block's ``qh``."""

    QTYPE = "Q5_0"
    ZERO = 16

    def _block(self, rb, b):
        k = self.k
        lo = k.cvt(u32, k.ld(_sh(rb, self.bb * b + 2, u16), u16))
        hi = k.cvt(u32, k.ld(_sh(rb, self.bb * b + 4, u16), u16))
        # the lane's bits: weights 2t + 8 q' and + 1 for q' = 0..3 (low
        # nibbles 0..15, high nibbles 16..31) at bits 0, 1 of each byte
        self.qh = (lo | (hi << 16)) >> self.t2

    def _high(self, k, b, quarter, bit):
        """Bits ``8 quarter`` and ``+ 1`` of the lane's shifted ``qh`` at bit
        ``bit`` of the two halves."""
        v = self.qh >> (8 * quarter) if quarter else self.qh
        lo = (v & 1) << bit
        hi = (v & 2) << (bit + 15)
        return lo | hi

