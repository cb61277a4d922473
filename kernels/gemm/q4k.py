"""The Q4_K format of the GEMM (:mod:`.kernel`): raw Q4_K bytes through
the ``cp.async`` ring, nibbles turned into ``mma`` A fragments in registers.

**Stage layout.**  ``bk`` (64, 128 or 256) weights a stage: per weight row
the 16-byte header of the super-block and the ``bk / 2`` bytes of nibbles of
its ``bk / 64`` groups (``w_pitch = 16 + bk/2`` bytes: an odd multiple of
16).  Per stage the CTA decodes the sub-block scales once: per (sub-block,
row) the f16x2 pairs ``(d sc, d sc)`` and ``(-dmin m, -dmin m)`` into a
shared table.

**Fragments.**  Byte ``b`` (0..31) of group ``j``'s nibbles holds weight
``64 j + b`` (low nibble) and ``64 j + 32 + b`` (high).  The group is four
mma K steps of 16: step ``s`` covers weights ``64 j + 16 s ..`` and reads
the word at byte ``16 (s & 1) + 4 t`` (``t`` = lane % 4), low nibbles for
``s < 2``, high for ``s >= 2``: the four nibbles of that one word are the
step's weights ``4t .. 4t+3`` of the kernel's K permutation, so a fragment
register is two nibbles of one byte pair: ``prmt(word, 0, 0x4140)`` spreads
bytes 0 and 1 into the two halves, ``& 0x000F000F | 0x64006400`` makes the
f16 pair ``1024 + q``, and ``sub.f16x2`` of 1024 leaves ``q`` exactly (the
high nibbles: mask ``0x00F000F0``, then ``fma.f16x2 (h, 1/16, -64)``).  Then
``w = fma.f16x2(q, (s, s), (-m, -m))``, rounded once.  Steps run in the
order 0, 2, 1, 3, so the two steps that read one word (low, then high) are
adjacent and its spread bytes live only between them.

Accuracy (against float64 products of the gguf-dequantized weights):
``x`` is rounded to f16 (relative ``u = 2^-11``), ``d sc`` and ``dmin m``
to f16 (``u`` each) and ``w`` once more (``u``), so each product is within
``3.01 u |x| (|d sc q| + |dmin m|)``; the mma chain adds ``(K/16)
2^-21 sum |x w|``.  The tests assert that sum.
"""

from __future__ import annotations

import math

import ptxgen
from ptxgen.types import b32, f16, f16x2, f32, u8
from ptxgen.values import Address

from .kernel import build_gemm, nullctx, sh, thread_chunks

__all__ = ["FORMAT", "build_q4k"]

_F16_1024 = 0x64006400


class _Copies:
    """The per-thread copy plan of a stage's weights: for every 16-byte
    chunk the thread copies, one u32 offset fixed for the whole kernel (rows
    clamped to M - 1); each stage adds its K offset."""

    def __init__(self, k, plan, tid, w, m0, mrows):
        c = plan.config
        thr = plan.threads
        self.k, self.plan, self.wp = k, plan, w
        # weight chunks: per row the header (chunk 0) and bk/32 chunks of nibbles
        cw = 1 + c.bk // 32
        self.w = []
        for guard, r, ch in thread_chunks(tid, thr, c.bm, cw):
            row = k.min(m0 + r, mrows - 1)
            is_q = k.setp("ne", ch, 0)
            # chunk ch >= 1 sits at 16 ch in the stage row and at 16 + 32 j0 +
            # 16 (ch - 1) = 16 ch + 32 j0 in the super-block
            self.w.append((guard, is_q, k.mad(row, plan.row_bytes, ch * 16),
                           r * plan.w_pitch + ch * 16))

    def issue_stage(self, base, kk):
        """cp.async the weight chunks of the stage at K offset ``kk`` into
        the stage at shared address ``base``."""
        k = self.k
        hdr = (kk >> 8) * 144
        qoff = hdr + ((kk & 255) >> 1)          # group j0 = (kk & 255) / 64: 32 j0 bytes
        for guard, is_q, off, dst in self.w:
            src = self.wp[off + k.select(is_q, qoff, hdr)]
            k.cp_async(sh(base + dst, u8), src, 16, guard=guard)


def _decode_scales(k, plan, tid, wbase, sbase, kk, lanes=None):
    """Per (sub-block, row) of the stage at ``wbase``: ``(d sc, d sc)`` and
    ``(-dmin m, -dmin m)`` as f16x2 into the table at ``sbase``
    (``[bk/32][bm]`` entries of 8 bytes)."""
    c = plan.config
    thr, n = plan.threads, (c.bk // 32) * c.bm
    j0 = (kk & 255) >> 5                       # the stage's first sub-block, 0..7
    for i in range(math.ceil(n / thr)):
        e = tid + i * thr
        guard = (e < n) if (i + 1) * thr > n else None
        with k.guarded(guard) if guard is not None else nullctx():
            sbl, r = e // c.bm, e % c.bm
            j = j0 + sbl
            hdr = wbase + r * plan.w_pitch
            dm = k.ld(sh(hdr), b32)
            jj = j & 3
            a = k.ld(sh(hdr + 4 + jj, u8))
            b = k.ld(sh(hdr + 8 + jj, u8))
            cc = k.ld(sh(hdr + 12 + jj, u8))
            lo = j < 4
            sc = k.select(lo, a & 63, (cc & 15) | ((a >> 6) << 4))
            mn = k.select(lo, b & 63, (cc >> 4) | ((b >> 6) << 4))
            d, dmin = k.unpack(dm, f16, 2)
            s = k.cvt(f16, d.to(f32) * sc.to(f32), rnd="rn")
            nm = k.cvt(f16, -(dmin.to(f32) * mn.to(f32)), rnd="rn")
            k.st(sh(sbase + (sbl * c.bm + r) * 8),
                 (k.pack(b32, s, s), k.pack(b32, nm, nm)))


def _dequant(k, cache, word, pair, high, scale):
    """One A-fragment register: two weights (bytes ``2 pair``, ``2 pair + 1``
    of ``word``, low or high nibbles) as f16x2 ``q s - m``."""
    key = (word.name, pair)
    p = cache.get(key)
    if p is None:
        p = cache[key] = k.prmt(word, 0, 0x4342 if pair else 0x4140)
    if high:
        h = ((p & 0x00F000F0) | _F16_1024).bitcast(f16x2)
        q = k.fma(h, k.const(f16x2, 1.0 / 16), k.const(f16x2, -64.0))
    else:
        h = ((p & 0x000F000F) | _F16_1024).bitcast(f16x2)
        q = h - k.const(f16x2, 1024.0)
    s2, nm2 = scale
    return k.fma(q, s2.bitcast(f16x2), nm2.bitcast(f16x2))


def _fragments(k, plan, lanes, wbase, sbase, kk):
    """The stage's mma steps in the order 0, 2, 1, 3 of each group, each
    with the function giving a 16-row tile's A fragment."""
    c = plan.config
    # one register per lane and operand; the rest are constant offsets
    wl = wbase + (lanes.wrow + lanes.g) * plan.w_pitch + 4 * lanes.tq
    sl = sbase + (lanes.wrow + lanes.g) * 8

    def row_off(mt, h):
        return 16 * mt + 8 * h

    def steps():
        for jj in range(c.bk // 64):
            for w in range(2):
                words = [[k.ld(Address(wl, row_off(mt, h) * plan.w_pitch + 16 + 32 * jj + 16 * w,
                                       "shared", b32))
                          for h in range(2)] for mt in range(lanes.mt_n)]
                cache = {}
                for hi in range(2):

                    def a_of(mt, hi=hi, words=words, cache=cache):
                        sc = [k.ld(Address(sl, (row_off(mt, h) + (2 * jj + hi) * c.bm) * 8,
                                           "shared", b32), vec=2) for h in range(2)]
                        return [_dequant(k, cache, words[mt][h], pair, hi, sc[h])
                                for pair in range(2) for h in range(2)]
                    yield 4 * jj + 2 * hi + w, a_of
    return steps()


class _Q4K:
    """The Q4_K format: stage copies, scale table, fragment decoder."""

    qtype = "Q4_K"

    copies = staticmethod(_Copies)

    decode_scales = staticmethod(_decode_scales)
    fragments = staticmethod(_fragments)


FORMAT = _Q4K()


def build_q4k(plan) -> ptxgen.Module:
    """The Q4_K GEMM kernel of ``plan`` (a :class:`.GemmPlan`)."""
    return build_gemm(plan, FORMAT)
