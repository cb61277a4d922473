"""F16 and BF16 weights of the sm_90a GEMM (:func:`.wgmma_q4k.build_wgmma`):
F16 has nothing to decode.  A stage row is the row's 64 halves (128 bytes; rows of ``2 K``
bytes are 16-byte aligned), 8 ``cp.async`` chunks, 144 bytes in shared
memory; an A register is one ``ld.shared.b32`` of the pair ``k0, k0 + 1``.
Accuracy: only X is rounded (to f16) and the wgmma chain's ``2^-21`` of
``sum |x w|`` per 16-wide step.

BF16 stages the same bytes; a fragment register's pair is widened to f32
(the bf16 bits moved to the high half: ``shl`` and ``and``) and rounded to
an f16 pair (``cvt.rn``).  That is exact for every bf16 of magnitude 2^-14
(f16's least normal) up to 65280 (bf16's largest under 65504): a bf16 has 8
significant bits and f16 11.  Smaller weights become f16 subnormals, off by
at most 2^-25; the prefill keeps a matrix with a larger weight on the GEMV
(llm/prefill.py), since those would be infinite."""

from __future__ import annotations

from ptxgen.types import b32, f16, f32, u8, u64
from ptxgen.values import Address

from .spec import WG_X_ROW

__all__ = ["F16Format", "BF16Format"]


class F16Format:
    """F16 weights for :func:`.wgmma_q4k.build_wgmma` (the module docstring);
    the 144-byte row pitch puts the 8 rows a warp reads on distinct banks."""

    def __init__(self, k, plan, tid, w, m0, mrows, rho, tq):
        self.k, self.plan = k, plan
        c = plan.config
        self.xoff = c.bn * WG_X_ROW
        # 8 chunks a row: thread pairs take a row, 4 chunks each
        r, c4 = tid >> 1, (tid & 1) << 2
        row = k.min(m0 + r, mrows - 1)
        self.src = k.var(u64, w[k.mad(row, plan.row_bytes, c4 * 16)].base)
        self.dst = r * plan.w_pitch + (self.xoff + c4 * 16)
        self.woff = [self.xoff + (rho + 8 * h) * plan.w_pitch + 4 * tq for h in range(2)]

    def copy(self, stage, ahead, j, guard):
        k = self.k
        off = ahead * 512 + 128 * j                   # 256 halves a super-block
        for i in range(4):
            k.cp_async(Address(stage + self.dst, 16 * i, "shared", u8),
                       Address(self.src, off + 16 * i, "global", u8), 16, guard=guard)

    def advance(self):
        self.src.set(self.src + 512)

    def fragments(self, stage, j):
        k = self.k
        frags = [[None] * 4 for _ in range(4)]
        for h in range(2):
            for st in range(4):
                for half in range(2):
                    frags[st][h + 2 * half] = k.ld(
                        Address(stage + self.woff[h], 32 * st + 16 * half, "shared", b32), b32)
        return [tuple(f) for f in frags]


class BF16Format(F16Format):
    """BF16 weights: :class:`F16Format`'s stages, each fragment register's
    bf16 pair rounded to an f16 pair (the module docstring)."""

    def fragments(self, stage, j):
        k = self.k
        out = []
        for regs in super().fragments(stage, j):
            pairs = []
            for v in regs:
                lo = (v << 16).bitcast(f32)
                hi = (v & 0xFFFF0000).bitcast(f32)
                pairs.append(k.pack(b32, k.cvt(f16, lo), k.cvt(f16, hi)))
            out.append(tuple(pairs))
        return out
