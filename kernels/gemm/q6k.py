"""The Q6_K format of the GEMM (:mod:`.kernel`): super-blocks of 256
weights, 210 bytes each: ``ql[128]`` (low 4 bits), ``qh[64]`` (high 2
bits), ``scales[16]`` (int8, one per 16 weights), ``d`` (f16); weight
``d scales[j / 16] (q - 32)``.  In half ``h`` (weights ``128 h ..``),
weight ``128 h + 32 c + l`` (``c`` 0..3, ``l`` 0..31) has its low bits in
byte ``64 h + 32 (c & 1) + l`` of ``ql`` (low nibble for ``c < 2``, high
for ``c >= 2``) and its high bits at bits ``2c, 2c+1`` of byte ``32 h + l``
of ``qh`` (gguf's ``dequantize_blocks`` of Q6_K; docs/quants.md).

**Stage layout.**  Super-blocks are only 2-byte aligned in a row (210 is
2 mod 16), so a stage copies 16-byte aligned windows
(:class:`.kernel.WindowCopies`) and the data starts ``s = (row row_bytes +
210 sb) & 15`` bytes into each.  ``bk = 256``: one window of the whole
super-block (14 chunks; ``ql`` at ``s``, ``qh`` at ``s + 128``, the scales
at ``s + 192``, ``d`` at ``s + 208``).  ``bk = 128`` (half ``h``): three
windows, the half's 64 bytes of ``ql`` (5 chunks, at 0), its 32 of ``qh``
(3, at 80) and the scales with ``d`` (2, at 128).  Per stage the CTA
decodes ``d scales[j]`` (rounded to f16 once) per sub-block of 16 and row
into a shared table of f16x2 pairs ``(s, s)``.

**Fragments.**  Step ``8 h + 2 c + u`` of the stage covers weights ``128 h
+ 32 c + 16 u ..``, one sub-block of 16; thread ``t``'s weights ``4t ..
4t+3`` of it (the kernel's K permutation) are ``ql`` bytes ``64 h + 32 (c &
1) + 16 u + 4 t ..`` and ``qh`` bytes ``32 h + 16 u + 4 t ..``, read by
pairs with ``ld.shared.u16``.  Both are spread into the halves of a
register (``prmt(v, 0, 0x4140)``); steps ``c`` and ``c + 2`` (the low and
high nibbles of the same ``ql`` bytes, the ``qh`` bits shifted by the same
4 or 2) run one after the other and share them.  ``c < 2``: ``(ql &
0x000F000F) | (qh' & 0x00300030) | 0x64006400`` is the f16 pair ``1024 +
q`` and ``sub.f16x2`` of 1056 leaves ``q - 32`` exactly; ``c >= 2``: the
high nibble and the two bits land at bits 4..9, ``1024 + 16 q``, and
``fma.f16x2 (h, 1/16, -96)`` leaves ``q - 32`` exactly.  Then ``mul.f16x2``
by ``(s, s)`` rounds once.

Accuracy (against float64 products of the gguf-dequantized weights):
``x`` is rounded to f16 (``u = 2^-11``), ``d sc`` to f16 (``u``) and ``w``
once more (``u``), so a product is within ``3.01 u |x| |d sc (q - 32)|``
(plus ``2^-25 |x|`` where an f16 value is subnormal); the mma chain adds
``(K/16 + 1) 2^-21 sum |x w|``.
"""

from __future__ import annotations

import math

from ptxgen.types import b32, f16, f16x2, f32, s8, u16, u32
from ptxgen.values import Address

from .kernel import WindowCopies, nullctx, row_shift, sh

__all__ = ["FORMAT"]

_F16_1024 = 0x64006400


def _layout(plan, half):
    """``(ql, qh, scales, d)``: where the stage's data of ``half`` (0 or 1
    of a bk = 256 stage; the stage's own half, an int or a register, for bk
    = 128) start, relative to the row's data start in the stage."""
    if plan.config.bk == 256:
        return 64 * half, 128 + 32 * half, 192 + 8 * half, 208
    return 0, 80, 128 + 8 * half, 144


class _Copies:
    def __init__(self, k, plan, tid, w, m0, mrows):
        self.k, self.plan = k, plan
        spans = [(14, 0)] if plan.config.bk == 256 else [(5, 0), (3, 80), (2, 128)]
        self.win = WindowCopies(k, plan, tid, w, m0, mrows, spans)

    def issue_stage(self, base, kk):
        sb = (kk >> 8) * 210
        if self.plan.config.bk == 256:
            self.win.issue(base, [sb])
        else:
            h = (kk >> 7) & 1
            self.win.issue(base, [sb + h * 64, sb + (h * 32 + 128), sb + 192])


def _decode_scales(k, plan, tid, wbase, sbase, kk, lanes):
    """Per (sub-block of 16, row) of the stage at ``wbase``: ``(d sc, d
    sc)`` as f16x2 into the table at ``sbase`` (``[bk/16][bm]`` entries of
    4 bytes)."""
    c = plan.config
    thr, n = plan.threads, (c.bk // 16) * c.bm
    start = (kk >> 8) * 210
    half = 0 if c.bk == 256 else (kk >> 7) & 1
    _, _, sc_off, d_off = _layout(plan, half)
    for i in range(math.ceil(n / thr)):
        e = tid + i * thr
        guard = (e < n) if (i + 1) * thr > n else None
        with k.guarded(guard) if guard is not None else nullctx():
            j, r = e // c.bm, e % c.bm
            grow = k.min(lanes.m0 + r, lanes.mrows - 1)
            hdr = wbase + r * plan.w_pitch + row_shift(k, plan, grow, start)
            d = k.ld(sh(hdr + d_off, f16))
            sc = k.ld(sh(hdr + sc_off + j, s8))
            s = k.cvt(f16, d.to(f32) * sc.to(f32), rnd="rn")
            k.st(sh(sbase + (j * c.bm + r) * 4), k.pack(b32, s, s))


def _ld16(k, base, off):
    """A u16 of shared memory at ``base + off``, as a u32."""
    return k.cvt(u32, k.ld(Address(base, off, "shared", u16)))


def _fragments(k, plan, lanes, wbase, sbase, kk):
    """The stage's mma steps (for each half and ``u``: ``c`` = 0, 2, 1, 3),
    each with the function giving a 16-row tile's A fragment."""
    c = plan.config
    start = (kk >> 8) * 210
    rowbase = wbase + (lanes.wrow + lanes.g) * plan.w_pitch + lanes.tq * 4
    sl = sbase + (lanes.wrow + lanes.g) * 4
    bases = {}

    def lane_base(mt, h):
        key = (mt, h)
        if key not in bases:
            grow = k.min(lanes.m0 + lanes.wrow + lanes.g + (16 * mt + 8 * h), lanes.mrows - 1)
            bases[key] = rowbase + row_shift(k, plan, grow, start)
        return bases[key]

    def steps():
        for hl in range(c.bk // 128):
            ql_off, qh_off, _, _ = _layout(plan, hl)
            for u in range(2):
                for c0 in range(2):
                    cache = {}
                    for cc in (c0, c0 + 2):
                        step = 8 * hl + 2 * cc + u

                        def a_of(mt, cc=cc, c0=c0, u=u, step=step, cache=cache,
                                 ql_off=ql_off, qh_off=qh_off):
                            out = {}
                            for h in range(2):
                                lb = lane_base(mt, h)
                                roff = (16 * mt + 8 * h) * plan.w_pitch
                                s2 = k.ld(Address(sl, ((16 * mt + 8 * h) + step * c.bm) * 4,
                                                  "shared", b32)).bitcast(f16x2)
                                for p in range(2):
                                    key = (mt, h, p)
                                    if key not in cache:
                                        lo = _ld16(k, lb, roff + ql_off + 32 * c0 + 16 * u + 2 * p)
                                        hi = _ld16(k, lb, roff + qh_off + 16 * u + 2 * p)
                                        cache[key] = (k.prmt(lo, 0, 0x4140),
                                                      k.prmt(hi, 0, 0x4140) << (4 if c0 == 0
                                                                                 else 2))
                                    pl, qs = cache[key]
                                    if cc < 2:
                                        v = ((pl & 0x000F000F) | (qs & 0x00300030)
                                             | _F16_1024).bitcast(f16x2)
                                        q = v - k.const(f16x2, 1056.0)
                                    else:
                                        v = ((pl & 0x00F000F0) | (qs & 0x03000300)
                                             | _F16_1024).bitcast(f16x2)
                                        q = k.fma(v, k.const(f16x2, 1.0 / 16),
                                                  k.const(f16x2, -96.0))
                                    out[(p, h)] = q * s2
                            return [out[(p, h)] for p in range(2) for h in range(2)]
                        yield step, a_of
    return steps()


class _Q6K:
    """The Q6_K format: windowed stage copies, scale table, fragment
    decoder."""

    qtype = "Q6_K"

    copies = staticmethod(_Copies)

    decode_scales = staticmethod(_decode_scales)
    fragments = staticmethod(_fragments)


FORMAT = _Q6K()
