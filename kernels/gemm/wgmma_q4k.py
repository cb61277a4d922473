"""Q4_K GEMM on sm_90a warpgroups: ``wgmma.mma_async`` with A (the weights)
decoded into registers and B (the tokens) read from 128B-swizzled shared
memory through a matrix descriptor.

``Y[T, M] = X[T, K] . W[M, K]^T``, X f16.  In wgmma terms the weight rows
are A's 64 rows and the tokens B's N = ``bn`` columns, so D is a tile of
``Y^T``.  A CTA computes ``bm x bn`` (weight rows ``m0 ..``, tokens ``n0
..``) with ``bm / 64`` warpgroups; warpgroup ``wg`` owns rows ``64 wg ..``
and all ``bn`` tokens: ``bn / 2`` f32 accumulators a thread.  Each weight
is decoded once per CTA (the mma.sync kernel decodes it once per warp
column).

**Stages.**  K is walked 64 at a time (one group of a super-block).  A
stage holds X's ``bn x 64`` tile as f16 (token ``n`` in the 128-byte row
``n``, 16-byte chunks XOR-swizzled by ``n % 8``: the layout a 128B-swizzle
K-major descriptor reads, SBO 1024) and then, per weight row, 48 bytes: the
super-block's 16-byte header (copied only with a super-block's first
group) and the group's 32 bytes of nibbles.  Every thread copies with
``cp.async`` (16 bytes: 4 X chunks and 1 nibble chunk a thread for ``bm =
bn = 128``).  Rows past M and tokens past T are read clamped to the last
and never stored.  With ``S`` stages and ``D = S - 2`` in flight, stage
``i``::

    cp.async.wait_group D-1; fence.proxy.async; bar.sync
        stage i landed and is visible to the tensor cores; every warpgroup
        has retired the wgmma of stage i-2, so its buffer is free
    cp.async stage i+D into that buffer; commit
    decode the 64 x 64 weights of the warpgroup into A registers
        (two register sets: stage i-1's wgmma may still read the other)
    wgmma.fence; 4 x wgmma.m64nNk16; commit; wgmma.wait_group 1

so the tensor cores run stage ``i-1`` while stage ``i`` is decoded.

**The K order.**  Byte ``b`` (0..31) of a group's nibbles holds weights
``b`` (low nibble) and ``32 + b`` (high).  wgmma step ``s`` (0..3) takes
weights ``8s .. 8s+7`` as its K positions 0..7 and ``32+8s .. 32+8s+7`` as
8..15: thread ``t`` (lane % 4) of an A fragment holds positions ``2t,
2t+1`` and ``2t+8, 2t+9``, i.e. the low and the high nibbles of the two
bytes ``8s+2t, 8s+2t+1``: one ``ld.shared.b32`` (the word at ``8s +
4(t/2)``) and one ``prmt`` (selector 0x4140 or 0x4342 by ``t`` odd) give
both registers.  B follows by placing X's 16-byte chunk ``c`` of the group
at chunk position ``2(c % 4) + c / 4`` of the token's row; step ``s``'s
descriptor starts ``32 s`` bytes into the tile.  Per f16x2 register:
``lop3`` and ``sub`` (or ``fma``) leave the levels ``q`` exactly (``1024 +
q`` as f16, as in :mod:`.q4k`), one ``fma.f16x2`` applies ``(d sc, -dmin
m)``.  The scales come from the header, held in registers over a
super-block (the loop runs a super-block, its four groups unrolled, so the
sub-block of each is a constant): ``d sc`` and ``dmin m`` rounded to f16
once each (``mul.rn.f16x2``).

**Counts** (``bm = bn = 128``, 8 warps; per warp and stage): 8 nibble
words, 8 ``prmt``, 32 for the levels, 16 ``fma``, about 30 for the scales,
about 15 for copies, the barrier and the loop: about 110 instructions, 880
a CTA stage, 220 issue cycles of an SM's four schedulers, against 512
tensor-core cycles for the stage's 2.1 MFLOP at the dense f16 peak (4096
FLOP a cycle an SM): decoding fits under the MMA with room to spare, and
the register-A form leaves the shared memory to B.  Shared memory per
stage: wgmma reads B once per warpgroup (32 KB), ``cp.async`` writes 22
KB, the decode reads 8 KB: 62 KB in 512 cycles, about 120 of the 128
bytes a cycle an SM serves, so at ``bn = 128`` the kernel is close to
shared-memory bound; ``bn = 256`` (1024 cycles, 118 KB) is a little
lighter per FLOP and needs 128 accumulators a thread.  L2 to SM: 22 KB a
stage (43 bytes a cycle at peak), like cuBLAS's 128 x 256 tiles.

Accuracy: as :mod:`.q4k` (same roundings: X is f16 on input; ``d sc``,
``dmin m`` and the weight each rounded to f16 once) plus wgmma's f32
accumulation, ``2^-21`` of ``sum |x w|`` per 16-wide step.

Kernel parameters and launch as :mod:`.q4k`: ``w`` (u8*), ``x`` (f16*),
``r`` (f32*, residual only), ``y`` (f32*), ``m`` (u32), then ``t`` (u32) or
``t_ptr`` (u32*); grid ``(ceil(T_max / bn), ceil(M / bm))``, ``2 bm``
threads, :attr:`.GemmPlan.dynamic_shared` bytes of dynamic shared memory
(1024-aligned).
"""

from __future__ import annotations

import math

import ptxgen
from ptxgen.types import b32, b64, f16x2, u8, u32, u64
from ptxgen.values import Address

from .kernel import kernel_directives, kernel_interface
from .spec import WG_W_PITCH, WG_X_ROW

__all__ = ["build_wgmma_q4k"]

_F16_1024 = 0x64006400
#: wgmma descriptor bits above the start address: LBO 16 (unused by a
#: swizzled K-major operand), SBO 1024 (8 rows of 128 bytes), 128B swizzle
_DESC_HI = (16 >> 4) << 16 | (1024 >> 4) << 32 | 1 << 62


def _sh(addr, off=0, ty=b32):
    return Address(addr, off, "shared", ty)


def _gl(addr, off=0):
    return Address(addr, off, "global", u8)


class _Copies:
    """Per-thread copy plan: global byte addresses (u64 Vars advanced a
    super-block per loop iteration) and shared offsets within a stage."""

    def __init__(self, k, plan, tid, w, x, m0, mrows, n0, t):
        c = plan.config
        thr, bm, bn = plan.threads, c.bm, c.bn
        self.k, self.plan = k, plan
        xoff = bn * WG_X_ROW                        # the weight rows follow X's tile
        # nibbles: 2 chunks a row, one a thread (thr = 2 bm)
        r, ch16 = tid >> 1, (tid & 1) << 4
        row = k.min(m0 + r, mrows - 1)
        self.wq = k.var(u64, w[k.mad(row, plan.row_bytes, ch16 + 16)].base)
        self.wq_dst = (r * WG_W_PITCH + ch16) + (xoff + 16)
        # headers: one 16-byte chunk a row, threads 0 .. bm-1
        self.wh_ok = tid < bm
        hr = k.min(tid, bm - 1)
        self.wh = k.var(u64, w[k.mul(k.min(m0 + hr, mrows - 1), plan.row_bytes)].base)
        self.wh_dst = hr * WG_W_PITCH + xoff
        # X: bn tokens x 8 chunks; 8 consecutive threads copy one token's row
        cc = tid & 7
        pos = ((cc & 3) << 1) | (cc >> 2)
        per = thr // 8                                # tokens one round covers (a multiple of 8)
        n = tid >> 3
        dst = n * WG_X_ROW + ((pos ^ (n & 7)) << 4)   # the swizzle is the same every round
        self.x = []
        for i in range(math.ceil(bn / per)):
            guard = (n < bn - i * per) if (i + 1) * per > bn else None
            tok = k.min(n0 + (n + i * per), t - 1)
            src = k.var(u64, x[k.mad(tok, plan.k, cc << 3)].base)
            self.x.append((guard, src, dst + i * per * WG_X_ROW) if i else (guard, src, dst))

    def copy(self, stage, ahead, j, guard):
        """Copy group ``j`` (0..3) of the super-block ``ahead`` past the
        pointers' one into the stage at shared address ``stage``; only where
        ``guard`` (None: always)."""
        k = self.k
        sb = ahead * self.plan.block_bytes
        k.cp_async(_sh(stage + self.wq_dst, 0, u8), _gl(self.wq, sb + 32 * j), 16, guard=guard)
        if j == 0:
            hg = self.wh_ok if guard is None else k.pand(self.wh_ok, guard)
            k.cp_async(_sh(stage + self.wh_dst, 0, u8), _gl(self.wh, sb), 16, guard=hg)
        for xg, src, dst in self.x:
            g = xg if guard is None else (guard if xg is None else k.pand(xg, guard))
            k.cp_async(_sh(stage + dst, 0, u8), _gl(src, 512 * ahead + 128 * j), 16, guard=g)

    def advance(self):
        """Move the pointers one super-block on."""
        bb = self.plan.block_bytes
        self.wq.set(self.wq + bb)
        self.wh.set(self.wh + bb)
        for _, src, _ in self.x:
            src.set(src + 512)


def _bytes_f16x2(k, v):
    """Bytes 0 and 1 of the u32 ``v`` (each at most 63) as an exact f16x2."""
    h = (k.prmt(v, 0, 0x4140) | _F16_1024).bitcast(f16x2)
    return h - k.const(f16x2, 1024.0)


def _dup(k, v, high):
    """The low (or high) half of the f16x2 ``v`` in both halves."""
    return k.prmt(v.bitcast(u32), 0, 0x3232 if high else 0x1010).bitcast(f16x2)


class _Header:
    """A weight row's super-block header, loaded from a stage's shared
    memory: the scale words and ``(d, d)``, ``(-dmin, -dmin)`` as f16x2."""

    def __init__(self, k, addr):
        w0, self.w1, self.w2, self.w3 = k.ld(addr, u32, vec=4)
        self.dd = k.prmt(w0, 0, 0x1010).bitcast(f16x2)
        self.nmin = (k.prmt(w0, 0, 0x3232) ^ 0x80008000).bitcast(f16x2)

    def scales(self, k, j):
        """Group ``j``'s ``(s, -m)`` of its low-nibble sub-block ``2j`` and
        high-nibble sub-block ``2j + 1``, each an f16x2 with the value in
        both halves: ``((s_lo, s_lo), (s_hi, s_hi), (-m_lo, -m_lo),
        (-m_hi, -m_hi))``."""
        if j < 2:
            sc = (self.w1 >> (16 * j) if j else self.w1) & 0x3F3F
            mn = (self.w2 >> (16 * j) if j else self.w2) & 0x3F3F
        else:
            sh = 16 * (j - 2)
            sc = ((self.w3 >> sh if sh else self.w3) & 0x0F0F) | ((self.w1 >> (sh + 2)) & 0x3030)
            mn = ((self.w3 >> (sh + 4)) & 0x0F0F) | ((self.w2 >> (sh + 2)) & 0x3030)
        s2 = k.mul(_bytes_f16x2(k, sc), self.dd, rnd="rn")
        nm2 = k.mul(_bytes_f16x2(k, mn), self.nmin, rnd="rn")
        return (_dup(k, s2, False), _dup(k, s2, True), _dup(k, nm2, False), _dup(k, nm2, True))


def _levels(k, p, high):
    """The two 4-bit levels of ``p`` (bytes in halves 0 and 2) as exact f16x2."""
    if high:
        h = ((p & 0x00F000F0) | _F16_1024).bitcast(f16x2)
        return k.fma(h, k.const(f16x2, 1.0 / 16), k.const(f16x2, -64.0))
    h = ((p & 0x000F000F) | _F16_1024).bitcast(f16x2)
    return h - k.const(f16x2, 1024.0)


def _a_fragments(k, stage, woff, sel, sc):
    """The warpgroup's A registers of one stage: per wgmma step s, the four
    b32 registers (rows g / g+8, K positions 2t.. / 2t+8..)."""
    frags = []
    for s in range(4):
        words = [k.ld(_sh(stage + woff, 8 * s + h * 8 * WG_W_PITCH), u32) for h in range(2)]
        ps = [k.prmt(wd, 0, sel) for wd in words]
        a = []
        for high in range(2):
            for h in range(2):
                q = _levels(k, ps[h], high)
                sl, sh_, nl, nh = sc[h]
                a.append(k.fma(q, sh_ if high else sl, nh if high else nl).bitcast(b32))
        frags.append(tuple(a))
    return frags


def build_wgmma_q4k(plan) -> ptxgen.Module:
    """The sm_90a Q4_K GEMM kernel of ``plan`` (a :class:`.GemmPlan` with
    ``kernel="wgmma"``)."""
    c = plan.config
    S, D = c.stages, c.stages - 2
    nk, nsb = plan.k // 64, plan.k // 256
    sbytes = plan.dynamic_shared // S
    m = ptxgen.Module(plan.target)
    with m.kernel(plan.kernel_name, **kernel_directives(plan)) as k:
        # a 128B-swizzled X tile starts on a 1024-byte boundary
        w, x, r, y, mrows, t, smem, n0 = kernel_interface(k, plan, smem_align=1024)
        m0 = k.ctaid.y * c.bm
        tid = k.tid.x
        base = k.mov(smem, u32)
        cp = _Copies(k, plan, tid, w, x, m0, mrows, n0, t)
        for i in range(D):
            if i < nk:
                cp.copy(base + i * sbytes, i // 4, i % 4, None)
            k.cp_async_commit()
        # thread (warpgroup wg, warp wq of it, lane g*4+tq): weight rows
        # 64 wg + 16 wq + g (and + 8) of the CTA
        lane = tid & 31
        g, tq = lane >> 2, lane & 3
        rho = ((tid >> 7) << 6) + (((tid >> 5) & 3) << 4) + g
        hoff = rho * WG_W_PITCH + c.bn * WG_X_ROW
        woff = hoff + ((tq >> 1) << 2) + 16
        sel = k.mov(0x4140, u32) + (tq & 1) * 0x0202
        acc = k.wgmma_acc(c.bn)
        cur = k.var(u32, 0)                      # byte offset of the stage being computed
        pre = k.var(u32, D * sbytes)             # ... of the stage being filled
        ring = S * sbytes
        with k.for_range(0, nsb) as sbi:
            for j in range(4):
                k.cp_async_wait(D - 1)
                k.fence_proxy_async()
                k.bar_sync()
                lim = (nk - j - D + 3) // 4      # stage 4 sbi + j + D exists iff sbi < lim
                if lim > 0:
                    guard = None if lim >= nsb else sbi < lim
                    cp.copy(base + pre, (j + D) // 4, (j + D) % 4, guard)
                k.cp_async_commit()
                stage = base + cur
                if j == 0:
                    hdr = [_Header(k, _sh(stage + hoff, h * 8 * WG_W_PITCH)) for h in range(2)]
                sc = [hd.scales(k, j) for hd in hdr]
                frags = _a_fragments(k, stage, woff, sel, sc)
                desc = k.cvt(u64, stage >> 4) | _DESC_HI
                k.wgmma_fence()
                for s in range(4):
                    d = (desc + 2 * s) if s else desc
                    k.wgmma(acc, frags[s], d.bitcast(b64))
                k.wgmma_commit()
                k.wgmma_wait(1)
                for v in (cur, pre):
                    v.set(v + sbytes)
                    v.set(k.select(v.eq(ring), k.mov(0, u32), v))
            cp.advance()
        k.wgmma_wait(0)
        _store(k, acc, y, r, m0 + rho, n0 + 2 * tq, mrows, t, plan.spec.y_stride or mrows)
    return m


def _store(k, acc, y, r, row0, tok0, mrows, t, ldy):
    """Accumulator ``i``: weight row ``row0 + 8 ((i >> 1) & 1)``, token
    ``tok0 + 8 (i >> 2) + (i & 1)``; stored at ``y[token * ldy + row]``
    (``ldy``: the spec's ``y_stride``, or M) when both are in range."""
    rok = [row0 < mrows, (row0 + 8) < mrows]
    for i, v in enumerate(acc):
        h, tt = (i >> 1) & 1, 8 * (i >> 2) + (i & 1)
        tok = tok0 + tt if tt else tok0
        row = row0 + 8 if h else row0
        ok = k.pand(rok[h], tok < t)
        idx = k.mad(tok, ldy, row)
        if r is not None:
            # plain ld, not .nc: y may be r
            v = k.add(v, k.ld(r[idx], guard=ok), guard=ok)
        k.st(y[idx], v, guard=ok)
