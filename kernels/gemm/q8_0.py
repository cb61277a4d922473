"""The Q8_0 format of the GEMM (:mod:`.kernel`): blocks of 32 weights,
34 bytes each (``d`` f16, then 32 int8 ``q``; weight ``d q``).

**Stage layout.**  ``bk`` (64, 128 or 256) weights a stage are ``bk / 32``
consecutive blocks of a row, ``34 bk / 32`` bytes starting at ``34 b0``
in the row: only 2-byte aligned, so the stage copies the 16-byte aligned
window that holds them (:class:`.kernel.WindowCopies`, ``plan.w_chunks``
chunks) and the data starts ``s = (row row_bytes + 34 b0) & 15`` bytes in.
No scale table: each thread reads its rows' ``d`` beside the quants.

**Fragments.**  Step ``2 i + u`` of the stage covers weights ``16 u ..`` of
block ``i``; thread ``t``'s weights ``4t .. 4t+3`` of it (the kernel's K
permutation) are the bytes ``2 + 16 u + 4 t ..`` of the block, read as two
``ld.shared.u16`` (the data is 2-byte aligned).  A register: ``prmt(v, 0,
0x4140)`` spreads the two bytes into the halves, ``^ 0x00800080 |
0x64006400`` makes the f16 pair ``1024 + (q + 128)``, ``sub.f16x2`` of 1152
leaves ``q`` exactly, and ``mul.f16x2`` by ``(d, d)`` rounds once.

Accuracy (against float64 products of the gguf-dequantized weights ``d
q``): ``x`` rounded to f16 (``u = 2^-11``) and ``w`` once (``u``), so a
product is within ``2.01 u |x| |d q|`` (plus ``2^-25 |x|`` where ``d q`` is
subnormal in f16); the mma chain adds ``(K/16 + 1) 2^-21 sum |x w|``.
"""

from __future__ import annotations

from ptxgen.types import f16x2, u16, u32
from ptxgen.values import Address

from .kernel import WindowCopies, row_shift

__all__ = ["FORMAT"]

_F16_1024 = 0x64006400


class _Copies:
    def __init__(self, k, plan, tid, w, m0, mrows):
        self.win = WindowCopies(k, plan, tid, w, m0, mrows, [(plan.w_chunks, 0)])

    def issue_stage(self, base, kk):
        self.win.issue(base, [(kk >> 5) * 34])


def _ld16(k, base, off):
    """A u16 of shared memory at ``base + off``, as a u32."""
    return k.cvt(u32, k.ld(Address(base, off, "shared", u16)))


def _fragments(k, plan, lanes, wbase, sbase, kk):
    """The stage's mma steps in order, each with the function giving a
    16-row tile's A fragment."""
    c = plan.config
    start = (kk >> 5) * 34
    rowbase = wbase + (lanes.wrow + lanes.g) * plan.w_pitch
    tq4 = lanes.tq * 4
    bases = {}

    def lane_base(mt, h):
        """The lane's row ``16 mt + 8 h`` data start in the stage, as a
        register (``rb``, for ``d``) and plus ``4 t`` (``lb``)."""
        key = (mt, h)
        if key not in bases:
            off = 16 * mt + 8 * h
            grow = k.min(lanes.m0 + lanes.wrow + lanes.g + off, lanes.mrows - 1)
            rb = rowbase + row_shift(k, plan, grow, start)
            bases[key] = (rb, rb + tq4)
        return bases[key]

    def steps():
        for i in range(c.bk // 32):
            dcache = {}
            for u in range(2):

                def a_of(mt, i=i, u=u, dcache=dcache):
                    out = {}
                    for h in range(2):
                        rb, lb = lane_base(mt, h)
                        roff = (16 * mt + 8 * h) * plan.w_pitch
                        d2 = dcache.get((mt, h))
                        if d2 is None:
                            d2 = dcache[(mt, h)] = k.prmt(_ld16(k, rb, roff + 34 * i), 0,
                                                          0x1010).bitcast(f16x2)
                        for p in range(2):
                            v = _ld16(k, lb, roff + 34 * i + 2 + 16 * u + 2 * p)
                            s = k.prmt(v, 0, 0x4140)
                            hq = ((s ^ 0x00800080) | _F16_1024).bitcast(f16x2)
                            q = hq - k.const(f16x2, 1152.0)
                            out[(p, h)] = q * d2
                    return [out[(p, h)] for p in range(2) for h in range(2)]
                yield 2 * i + u, a_of
    return steps()


class _Q80:
    """The Q8_0 format: windowed stage copies, no scale table, fragment
    decoder."""

    qtype = "Q8_0"

    copies = staticmethod(_Copies)

    @staticmethod
    def decode_scales(*a):
        raise AssertionError("Q8_0 has no scale table")

    fragments = staticmethod(_fragments)


FORMAT = _Q80()
