"""The Q6_K weights of the sm_90a GEMM (:func:`.wgmma_q4k.build_wgmma`).

A Q6_K super-block (256 weights, 210 bytes: ``ql[128]``, ``qh[64]``,
``scales[16]`` int8, ``d`` f16; :mod:`.q6k`) is only 2-byte aligned in a
row, so a stage (64 weights, group ``j`` of the super-block: half ``n = j
/ 2``, quarter ``jj = j % 2`` of it) copies three 16-byte aligned windows
of each row (:class:`.kernel.WindowCopies`): the half's 64 bytes of ``ql``
(5 chunks, at 0), its 32 of ``qh`` (3, at 80) and the scales with ``d`` (2,
at 128), 176 bytes a row; the data starts ``s = (row row_bytes + 210 sb) &
15`` bytes into each window.

**The K order** is natural, as the Q4_K side's: wgmma step ``st`` takes
the group's weights ``16 st ..``.  Weight ``k`` (0..63) of group ``jj = 0``
is the low nibble of ``ql[k]`` and bits ``2 (k >= 32)`` of ``qh[k % 32]``;
of ``jj = 1`` the high nibble of ``ql[k]`` and bits ``4 + 2 (k >= 32)``;
its scale is ``scales[8 n + 4 jj + st]`` (one per step).  Thread ``t``'s
pair ``k0 = 16 st + 2t (+ 8)`` is one ``ld.shared.u16`` of ``ql`` and one of
``qh``, each spread into the halves of a register (``prmt 0x4140``); then
as :mod:`.q6k`: ``jj = 0``: ``(ql & 0x000F000F) | (qh' & 0x00300030) |
0x64006400`` is ``1024 + q`` and ``sub.f16x2`` 1056 leaves ``q - 32``
exactly; ``jj = 1``: the high nibble and the two bits at bits 4..9 give
``1024 + 16 q`` and ``fma (h, 1/16, -96)`` leaves ``q - 32``; ``mul.f16x2``
by ``(d sc, d sc)`` (``d sc`` rounded to f16 once) rounds once.  About 11
instructions a register against Q4_K's 3.5.

Accuracy: as :mod:`.q6k` (``x``, ``d sc`` and the weight each rounded to
f16 once: ``3.01 u |x| |d sc (q - 32)|`` a product) plus the wgmma chain's
``2^-21`` of ``sum |x w|`` per 16-wide step.
"""

from __future__ import annotations

from ptxgen.types import b32, f16, f16x2, f32, s8, u16, u32
from ptxgen.values import Address

from .kernel import WindowCopies, row_shift
from .spec import WG_X_ROW

__all__ = ["Q6KFormat"]

_SB = 210
#: window offsets in a stage row: ql, qh, the scales with d
_QL, _QH, _SC = 0, 80, 128


def _sh(addr, off=0, ty=b32):
    return Address(addr, off, "shared", ty)


class Q6KFormat:
    """Q6_K copies and A fragments for :func:`.wgmma_q4k.build_wgmma`."""

    def __init__(self, k, plan, tid, w, m0, mrows, rho, tq):
        self.k, self.plan = k, plan
        self.xoff = plan.config.bn * WG_X_ROW
        self.win = WindowCopies(k, plan, tid, w, m0, mrows, [(5, _QL), (3, _QH), (2, _SC)])
        self.sb = k.var(u32, 0)                  # the super-block being computed
        self.rows = [k.min(m0 + rho + 8 * h, mrows - 1) for h in range(2)]
        self.roff = [self.xoff + (rho + 8 * h) * plan.w_pitch + 2 * tq for h in range(2)]

    def copy(self, stage, ahead, j, guard):
        k = self.k
        n = j >> 1
        sb = (self.sb + ahead) * _SB if ahead else self.sb * _SB
        starts = [sb + 64 * n, sb + (128 + 32 * n), sb + 192]
        if guard is None:
            self.win.issue(stage + self.xoff, starts)
        else:
            with k.if_(guard):
                self.win.issue(stage + self.xoff, starts)

    def advance(self):
        self.sb.set(self.sb + 1)

    def fragments(self, stage, j):
        k, plan = self.k, self.plan
        n, jj = j >> 1, j & 1
        if j == 0:
            # the thread's two rows' data starts within the windows (the
            # thread's pair 2t folded in; the scales' offsets take it out)
            self.off = [self.roff[h] + row_shift(k, plan, self.rows[h], self.sb * _SB)
                        for h in range(2)]
        frags = [[None] * 4 for _ in range(4)]
        for h in range(2):
            rb = stage + self.off[h]
            t2 = 2 * (k.tid.x & 3)
            hdr = rb - t2
            d = k.ld(_sh(hdr, _SC + 16, f16), f16).to(f32)
            for st in range(4):
                sc = k.ld(_sh(hdr, _SC + 8 * n + 4 * jj + st, s8), s8).to(f32)
                s1 = k.cvt(f16, d * sc, rnd="rn")
                scale = k.pack(b32, s1, s1).bitcast(f16x2)
                sh = 2 * (st >= 2) + 4 * jj
                for half in range(2):
                    k0 = 16 * st + 8 * half
                    ql = k.cvt(u32, k.ld(_sh(rb, _QL + k0, u16), u16))
                    qh = k.cvt(u32, k.ld(_sh(rb, _QH + k0 % 32, u16), u16))
                    p = k.prmt(ql, 0, 0x4140)
                    ph = k.prmt(qh, 0, 0x4140)
                    if jj == 0:
                        hq = ph << (4 - sh) if sh < 4 else ph
                        v = ((p & 0x000F000F) | (hq & 0x00300030) | 0x64006400).bitcast(f16x2)
                        q = v - k.const(f16x2, 1056.0)
                    else:
                        v = ((p & 0x00F000F0) | ((ph << (8 - sh)) & 0x03000300)
                             | 0x64006400).bitcast(f16x2)
                        q = k.fma(v, k.const(f16x2, 1.0 / 16), k.const(f16x2, -96.0))
                    frags[st][h + 2 * half] = k.mul(q, scale, rnd="rn").bitcast(b32)
        return [tuple(f) for f in frags]
