"""The Q8_0 weights of the sm_90a GEMM (:func:`.wgmma_q4k.build_wgmma`).

A Q8_0 block is 32 weights in 34 bytes (``d`` f16, 32 int8 ``q``;
:mod:`.q8_0`), only 2-byte aligned in a row.  A stage (64 weights: blocks
``2 s`` and ``2 s + 1`` of the row, 68 bytes from byte ``68 s``) copies the
16-byte aligned window that holds them (:class:`.kernel.WindowCopies`, 6
chunks, 112 bytes a row); the data starts ``(row row_bytes + 68 s) & 15``
bytes in, a shift that changes with every stage.

**The K order** is natural: wgmma step ``st`` takes weights ``16 st ..``,
of block ``st / 2``.  Thread ``t``'s pair ``k0 = 16 st + 2t (+ 8)`` is one
``ld.shared.u16`` (bytes ``2 + 34 (st / 2) + k0 % 32`` of the data) spread
into the halves of a register (``prmt 0x4140``); ``^ 0x00800080 |
0x64006400`` is the f16 pair ``1024 + (q + 128)``, ``sub.f16x2`` 1152
leaves ``q`` exactly and ``mul.f16x2`` by the block's ``(d, d)`` rounds
once (the mma.sync Q8_0 decoder's arithmetic): 5 instructions a register.

Accuracy: as :mod:`.q8_0` (``x`` and the weight each rounded to f16 once:
``2.01 u |x| |d q|`` a product) plus the wgmma chain's ``2^-21`` of ``sum
|x w|`` per 16-wide step.
"""

from __future__ import annotations

from ptxgen.types import b32, f16, f16x2, u16, u32
from ptxgen.values import Address

from .kernel import WindowCopies, row_shift
from .spec import WG_X_ROW

__all__ = ["Q80Format"]

_BLOCK = 34


def _sh(addr, off=0, ty=b32):
    return Address(addr, off, "shared", ty)


class Q80Format:
    """Q8_0 copies and A fragments for :func:`.wgmma_q4k.build_wgmma`."""

    def __init__(self, k, plan, tid, w, m0, mrows, rho, tq):
        self.k, self.plan = k, plan
        self.xoff = plan.config.bn * WG_X_ROW
        self.win = WindowCopies(k, plan, tid, w, m0, mrows, [(plan.w_chunks, 0)])
        self.sb = k.var(u32, 0)                  # the super-block being computed
        self.rows = [k.min(m0 + rho + 8 * h, mrows - 1) for h in range(2)]
        self.roff = [self.xoff + (rho + 8 * h) * plan.w_pitch for h in range(2)]
        self.t2 = 2 * tq

    def copy(self, stage, ahead, j, guard):
        k = self.k
        sb = self.sb + ahead if ahead else self.sb
        start = (4 * 2 * _BLOCK) * sb + 2 * _BLOCK * j
        if guard is None:
            self.win.issue(stage + self.xoff, [start])
        else:
            with k.if_(guard):
                self.win.issue(stage + self.xoff, [start])

    def advance(self):
        self.sb.set(self.sb + 1)

    def fragments(self, stage, j):
        k = self.k
        start = (4 * 2 * _BLOCK) * self.sb + 2 * _BLOCK * j
        frags = [[None] * 4 for _ in range(4)]
        for h in range(2):
            rb = stage + (self.roff[h] + row_shift(k, self.plan, self.rows[h], start))
            for b in range(2):
                d = k.ld(_sh(rb, _BLOCK * b, f16), f16)
                dd = k.pack(b32, d, d).bitcast(f16x2)
                qb = rb + self.t2
                for st in (2 * b, 2 * b + 1):
                    for half in range(2):
                        off = _BLOCK * b + 2 + 16 * (st - 2 * b) + 8 * half
                        v = k.cvt(u32, k.ld(_sh(qb, off, u16), u16))
                        p = k.prmt(v, 0, 0x4140)
                        f = ((p ^ 0x00800080) | 0x64006400).bitcast(f16x2)
                        q = f - k.const(f16x2, 1152.0)
                        frags[st][h + 2 * half] = k.mul(q, dd, rnd="rn").bitcast(b32)
        return [tuple(f) for f in frags]
