"""Quantized GEMM on sm_90a warpgroups: ``wgmma.mma_async`` with A (the
weights) decoded into registers and B (the tokens) brought by the tensor
copy engine (TMA) into 128B-swizzled shared memory and read through a
matrix descriptor.  :func:`build_wgmma` is the kernel (the ring, X's loads,
the wgmma, the store) for a weight format class: :class:`Q4KFormat`
(described below) or :class:`.wgmma_q6k.Q6KFormat`.

``Y[T, M] = X[T, K] . W[M, K]^T``, X f16.  In wgmma terms the weight rows
are A's 64 rows and the tokens B's N = ``bn`` columns, so D is a tile of
``Y^T``.  A CTA computes ``bm x bn`` (weight rows ``m0 ..``, tokens ``n0
..``) with ``bm / 64`` warpgroups; warpgroup ``wg`` owns rows ``64 wg ..``
and all ``bn`` tokens: ``bn / 2`` f32 accumulators a thread.  Each weight
is decoded once per CTA (the mma.sync kernel decodes it once per warp
column).

**Stages.**  K is walked 64 at a time (one group of a super-block).  A
stage holds X's ``bn x 64`` tile as f16 (token ``n`` in the 128-byte row
``n``, its 16-byte chunks XOR-swizzled by ``n % 8``: what a TMA load with
``CU_TENSOR_MAP_SWIZZLE_128B`` writes and a 128B-swizzle K-major descriptor
reads, SBO 1024) and then, per weight row, 48 bytes: the super-block's
16-byte header (copied only with a super-block's first group) and the
group's 32 bytes of nibbles.  One thread loads X's tile with
``cp.async.bulk.tensor`` (the map of :func:`x_tensor_map`, the kernel's
last parameter) completing on the stage's mbarrier; every thread copies
its 16 bytes of weights with ``cp.async`` (two chunks of nibbles a row;
headers from the first ``bm`` threads).  Rows past M are read clamped to
the last and tokens past T are read as the map's zeros or stale rows, and
neither is stored.  With ``S`` stages and ``D = S - 2`` in flight, stage
``i``::

    cp.async.wait_group D-1; bar.sync
        stage i's weights landed; every warpgroup has retired the wgmma of
        stage i-2, so its buffer is free
    thread 0: expect the tile's bytes on its mbarrier and load X's tile of
    stage i+D by TMA into that buffer; everyone: cp.async its weights
    wait on stage i's mbarrier (X landed)
    decode the 64 x 64 weights of the warpgroup into A registers
        (two register sets: stage i-1's wgmma may still read the other)
    wgmma.fence; 4 x wgmma.m64nNk16; commit; wgmma.wait_group 1

so the tensor cores run stage ``i-1`` while stage ``i`` is decoded.  No
proxy fence is needed: X is written and read by the async proxy (TMA,
wgmma), the weights by ordinary loads and ``cp.async``.

Why TMA for X: X is the operand every CTA of a token column re-reads (each
of the M / bm row blocks), about 4/5 of a stage's bytes.  Copied 16 bytes a
thread with ``cp.async``, X's arrival bounded the kernel far below the
tensor cores' rate; by TMA the same tiles run more than twice as fast
(docs/notes/gemm.md, "X by TMA").

**The K order.**  Natural: wgmma step ``s`` (0..3) takes X's K positions
``16 s .. 16 s + 15`` of the group, which a descriptor starting ``32 s``
bytes into the swizzled tile reads.  Byte ``b`` (0..31) of a group's
nibbles holds weights ``b`` (low nibble) and ``32 + b`` (high), so steps 0
and 1 are low nibbles of bytes ``0 .. 31`` and steps 2 and 3 the high
nibbles of the same bytes.  Thread ``t`` (lane % 4) of an A fragment holds
K positions ``2t, 2t+1`` (registers 0, 1: rows g, g+8) and ``2t+8, 2t+9``
(2, 3): one ``ld.shared.u16`` and one ``prmt`` per row and half give the
registers of step ``s'`` (low nibbles) and of step ``s' + 2`` (high).  Per
f16x2 register: ``lop3`` and ``sub`` (or ``fma``) leave the levels ``q``
exactly (``1024 + q`` as f16, as in :mod:`.q4k`), one ``fma.f16x2``
applies ``(d sc, -dmin m)`` of the step's sub-block.  The scales come from
the header, held in registers over a super-block (the loop body is one
super-block, its four groups unrolled, so the sub-block of each is a
constant): ``d sc`` and ``dmin m`` rounded to f16 once each
(``mul.rn.f16x2``).

**Counts** (``bm = bn = 128``, 8 warps; per warp and stage): 8 nibble
loads, 8 ``prmt``, 32 for the levels, 16 ``fma``, about 30 for the scales,
about 10 for copies, the barrier and the loop: about 105 instructions, 840
a CTA stage, 210 issue cycles of an SM's four schedulers, against 512
tensor-core cycles for the stage's 2.1 MFLOP at the dense f16 peak (4096
FLOP a cycle an SM).  Shared memory per stage: wgmma reads B once per
warpgroup (32 KB), the copies write 22 KB, the decode reads 8 KB.  L2 to
SM: 22 KB a stage.

Accuracy: as :mod:`.q4k` (same roundings: X is f16 on input; ``d sc``,
``dmin m`` and the weight each rounded to f16 once) plus wgmma's f32
accumulation, ``2^-21`` of ``sum |x w|`` per 16-wide step.

Kernel parameters: ``w`` (u8*), ``x`` (f16*, read only through the map),
``r`` (f32*, residual only), ``y`` (f32*), ``m`` (u32), ``t`` (u32) or
``t_ptr`` (u32*), then ``xmap`` (the by-value tensor map of X,
:func:`x_tensor_map`); grid ``(ceil(T_max / bn), ceil(M / bm))``, ``2 bm``
threads, :attr:`.GemmPlan.dynamic_shared` bytes of dynamic shared memory
(the ring, 1024-aligned, then one mbarrier a stage).
"""

from __future__ import annotations

import ptxgen
from ptxgen.tensor_map import TensorMap
from ptxgen.types import b32, b64, f16x2, f32, u8, u16, u32, u64
from ptxgen.values import Address

from .kernel import kernel_directives, kernel_interface
from .spec import WG_X_ROW

__all__ = ["build_wgmma", "Q4KFormat", "Q5KFormat", "x_tensor_map"]

_F16_1024 = 0x64006400
#: wgmma descriptor bits above the start address: LBO 16 (unused by a
#: swizzled K-major operand), SBO 1024 (8 rows of 128 bytes), 128B swizzle
_DESC_HI = (16 >> 4) << 16 | (1024 >> 4) << 32 | 1 << 62


def x_tensor_map(plan, x_address: int, t_rows: int) -> TensorMap:
    """The tensor map the kernel of ``plan`` reads X through: f16 ``[t_rows,
    K]`` row-major at device address ``x_address``, boxes of 64 halves x
    ``bn`` tokens, 128-byte swizzle, zeros past the last row.  ``t_rows``
    is the rows of X's array (T, or the maximum T of a ``t_device``
    launch)."""
    return TensorMap("f16", x_address, (plan.k, t_rows), (2 * plan.k,),
                     (64, plan.config.bn), swizzle="128B", oob_fill="zero")


def _sh(addr, off=0, ty=b32):
    return Address(addr, off, "shared", ty)


def _gl(addr, off=0):
    return Address(addr, off, "global", u8)


class _WCopies:
    """Per-thread copies of a stage's weight bytes: global byte addresses
    (u64 Vars advanced a super-block per loop iteration) and shared offsets
    within a stage (after X's tile).  ``qh``: the super-block's 32 bytes of
    fifth bits after its header (Q5_K), copied with every stage after the
    header, the nibbles after them."""

    def __init__(self, k, plan, tid, w, m0, mrows, qh=False):
        bm = plan.config.bm
        self.k, self.plan, self.qh = k, plan, qh
        xoff = plan.config.bn * WG_X_ROW
        qs = 48 if qh else 16                     # the nibbles' offset in block and row
        # nibbles (and qh): 2 chunks a row each, one a thread (threads = 2 bm)
        r, ch16 = tid >> 1, (tid & 1) << 4
        row = k.min(m0 + r, mrows - 1)
        self.wq = k.var(u64, w[k.mad(row, plan.row_bytes, ch16 + qs)].base)
        self.wq_dst = (r * plan.w_pitch + ch16) + (xoff + qs)
        # headers: one 16-byte chunk a row, threads 0 .. bm-1
        self.wh_ok = tid < bm
        hr = k.min(tid, bm - 1)
        self.wh = k.var(u64, w[k.mul(k.min(m0 + hr, mrows - 1), plan.row_bytes)].base)
        self.wh_dst = hr * plan.w_pitch + xoff

    def copy(self, stage, ahead, j, guard):
        """Copy group ``j`` (0..3) of the super-block ``ahead`` past the
        pointers' one into the stage at shared address ``stage``; only where
        ``guard`` (None: always)."""
        k = self.k
        sb = ahead * self.plan.block_bytes
        k.cp_async(_sh(stage + self.wq_dst, 0, u8), _gl(self.wq, sb + 32 * j), 16, guard=guard)
        if self.qh:                               # qh sits 32 bytes before the nibbles
            k.cp_async(_sh(stage + self.wq_dst, -32, u8), _gl(self.wq, sb - 32), 16, guard=guard)
        if j == 0:
            hg = self.wh_ok if guard is None else k.pand(self.wh_ok, guard)
            k.cp_async(_sh(stage + self.wh_dst, 0, u8), _gl(self.wh, sb), 16, guard=hg)

    def advance(self):
        """Move the pointers one super-block on."""
        bb = self.plan.block_bytes
        self.wq.set(self.wq + bb)
        self.wh.set(self.wh + bb)


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


def _levels(k, p, high, fifth=None):
    """The two 4-bit levels of ``p`` (bytes in halves 0 and 2) as exact f16x2;
    with ``fifth`` (Q5_K: the levels' fifth bits, at bit 0 of each half) the
    5-bit levels."""
    if high:
        v = p & 0x00F000F0
        if fifth is not None:
            v = v | (fifth << 8)
        h = (v | _F16_1024).bitcast(f16x2)
        return k.fma(h, k.const(f16x2, 1.0 / 16), k.const(f16x2, -64.0))
    v = p & 0x000F000F
    if fifth is not None:
        v = v | (fifth << 4)
    h = (v | _F16_1024).bitcast(f16x2)
    return h - k.const(f16x2, 1024.0)


def _a_fragments(k, stage, woff, sc, pitch, qh_j=None):
    """The warpgroup's A registers of one stage: per wgmma step s, the four
    b32 registers (rows g / g+8, K positions 2t.. / 2t+8..).  The two bytes
    at ``16 s' + 8 half + 2t`` of a row (``s'`` 0 or 1) give register
    ``row + 2 half`` of step ``s'`` (low nibbles) and of step ``s' + 2``
    (high nibbles).  ``qh_j`` (Q5_K): the group, whose fifth bits are bits
    ``2j`` (low nibbles) and ``2j + 1`` (high) of the ``qh`` bytes at the
    same offsets 32 bytes before the nibbles."""
    frags = [[None] * 4 for _ in range(4)]
    for sp in range(2):
        for h in range(2):                       # row g, g + 8
            for half in range(2):                # K positions 2t.. / 2t+8..
                off = 16 * sp + 8 * half + h * 8 * pitch
                v = k.ld(_sh(stage + woff, off, u16), u16)
                p = k.prmt(k.cvt(u32, v), 0, 0x4140)
                if qh_j is not None:
                    b = k.prmt(k.cvt(u32, k.ld(_sh(stage + woff, off - 32, u16), u16)), 0,
                               0x4140)
                for high in range(2):
                    sl, sh_, nl, nh = sc[h]
                    fifth = None
                    if qh_j is not None:
                        sh5 = 2 * qh_j + high
                        fifth = (b >> sh5 if sh5 else b) & 0x00010001
                    a = k.fma(_levels(k, p, high, fifth), sh_ if high else sl,
                              nh if high else nl)
                    frags[sp + 2 * high][h + 2 * half] = a.bitcast(b32)
    return [tuple(f) for f in frags]


class Q4KFormat:
    """The Q4_K side of :func:`build_wgmma`: a stage row is the super-block's
    16-byte header (copied with its first group) and the group's 32 bytes of
    nibbles; the header's scales are held in registers over a super-block.
    ``QH``: the super-block also holds 32 bytes of fifth bits after its
    header (Q5_K, :class:`Q5KFormat`)."""

    QH = False

    def __init__(self, k, plan, tid, w, m0, mrows, rho, tq):
        self.k, self.plan = k, plan
        self.cp = _WCopies(k, plan, tid, w, m0, mrows, qh=self.QH)
        self.hoff = rho * plan.w_pitch + plan.config.bn * WG_X_ROW
        self.woff = self.hoff + (48 if self.QH else 16) + 2 * tq

    def copy(self, stage, ahead, j, guard):
        self.cp.copy(stage, ahead, j, guard)

    def advance(self):
        self.cp.advance()

    def fragments(self, stage, j):
        k, pitch = self.k, self.plan.w_pitch
        if j == 0:
            self.hdr = [_Header(k, _sh(stage + self.hoff, h * 8 * pitch)) for h in range(2)]
        sc = [hd.scales(k, j) for hd in self.hdr]
        return _a_fragments(k, stage, self.woff, sc, pitch, qh_j=j if self.QH else None)


class Q5KFormat(Q4KFormat):
    """Q5_K (176-byte super-blocks: the Q4_K header, ``qh[32]`` with the
    fifth bit of weight ``64 j + l`` at bit ``2j`` of ``qh[l]`` and of ``64 j
    + 32 + l`` at bit ``2j + 1``, then the nibbles as Q4_K): a stage row is
    the header, the super-block's ``qh`` (copied with every stage) and the
    group's nibbles, 80 bytes; the levels take the fifth bit (``lop3``,
    shift and ``or``, about 6 instructions a register)."""

    QH = True


def build_wgmma(plan, fmt=Q4KFormat, tiles=None) -> ptxgen.Module:
    """The sm_90a GEMM kernel of ``plan`` (a :class:`.GemmPlan` with
    ``kernel="wgmma"``) for the weight format ``fmt`` (:class:`Q4KFormat`,
    :class:`.wgmma_q6k.Q6KFormat`): its copies of a stage's weight rows and
    its A fragments of a stage; the ring, X's TMA loads, the wgmma and the
    store are this function's.

    ``tiles`` (None: the dense GEMM) places a CTA's tile elsewhere, as the
    experts' grouped GEMM (:mod:`ptxgen.kernels.moe.expert_wgmma`) does:
    its ``kernel_name``; ``interface(k)``, which declares the kernel's
    parameters but the tensor map (declared after them) and returns ``(w,
    mrows, smem, xrow, store)``: the weights of the CTA's matrix, its rows,
    the dynamic shared memory (1024-aligned), X's first row for the TMA
    loads and ``store(acc, row0, tok0)``, the epilogue of the accumulators
    (as :func:`_store` lays them out: row ``row0 + 8 ((i >> 1) & 1)``,
    column ``tok0 + 8 (i >> 2) + (i & 1)`` of the tile).  Without split K."""
    c = plan.config
    S, D = c.stages, c.stages - 2
    nsplit = c.split_k
    nsb = plan.k // 256 // nsplit               # super-blocks of this CTA's part of K
    nk = 4 * nsb
    sbytes = plan.wgmma_stage_bytes
    xbytes = c.bn * WG_X_ROW
    m = ptxgen.Module(plan.target)
    if tiles is not None and nsplit > 1:
        raise ValueError(f"a GEMM of placed tiles does not split K (split_k={nsplit})")
    name = plan.kernel_name if tiles is None else tiles.kernel_name
    with m.kernel(name, **kernel_directives(plan)) as k:
        if tiles is None:
            # a 128B-swizzled X tile starts on a 1024-byte boundary
            w, x, r, y, mrows, t, smem, n0 = kernel_interface(k, plan, smem_align=1024)
            xrow = n0
            if nsplit > 1:
                ws = k.param_ptr("ws", f32)
                counters = k.param_ptr("counters", u32)
        else:
            w, mrows, smem, xrow, store = tiles.interface(k)
        xmap = k.tensor_map_param("xmap")
        k0 = 0
        if nsplit > 1:
            # part z of K: the rows' bytes from z / nsplit on, X's columns likewise
            z = k.ctaid.z
            w = k.ptr_add(w, k.mul(k.cvt(u64, z), plan.row_bytes // nsplit))
            k0 = z * (256 * nsb)
        m0 = k.ctaid.y * c.bm
        tid = k.tid.x
        first = tid.eq(0)
        base = k.mov(smem, u32)
        bar0 = base + S * sbytes                 # one mbarrier a stage after the ring
        with k.if_(first):
            for i in range(S):
                k.mbarrier_init(_sh(bar0 + 8 * i, 0, u64), 1)
            k.fence_mbarrier_init()
        k.bar_sync()
        # thread (warpgroup wg, warp wq of it, lane g*4+tq): weight rows
        # 64 wg + 16 wq + g (and + 8) of the CTA
        lane = tid & 31
        g, tq = lane >> 2, lane & 3
        rho = ((tid >> 7) << 6) + (((tid >> 5) & 3) << 4) + g
        wf = fmt(k, plan, tid, w, m0, mrows, rho, tq)

        def load_x(buf, bar, kel, guard):
            """Thread 0: X's tile at K element ``kel`` into ``buf`` by TMA,
            completing on the mbarrier ``bar``."""
            with k.if_(first if guard is None else k.pand(first, guard)):
                k.mbarrier_arrive_expect_tx(_sh(bar, 0, u64), xbytes)
                k.tma_load(_sh(buf, 0, u8), xmap, (kel, xrow), _sh(bar, 0, u64))

        for i in range(D):
            if i < nk:
                wf.copy(base + i * sbytes, i // 4, i % 4, None)
                load_x(base + i * sbytes, bar0 + 8 * i, k0 + 64 * i, None)
            k.cp_async_commit()
        acc = k.wgmma_acc(c.bn)
        cur = k.var(u32, 0)                      # stage being computed: buffer index
        pre = k.var(u32, D)                      # ... being filled
        phase = k.var(u32, 0)                    # parity of cur's mbarrier phase
        kel = k.var(u32, k0)                     # K of the pointers' super-block
        with k.for_range(0, nsb) as sbi:
            for j in range(4):
                k.cp_async_wait(D - 1)
                k.bar_sync()
                lim = (nk - j - D + 3) // 4      # stage 4 sbi + j + D exists iff sbi < lim
                if lim > 0:
                    guard = None if lim >= nsb else sbi < lim
                    pbuf = base + pre * sbytes
                    wf.copy(pbuf, (j + D) // 4, (j + D) % 4, guard)
                    load_x(pbuf, bar0 + pre * 8, kel + (256 * ((j + D) // 4) + 64 * ((j + D) % 4)),
                           guard)
                k.cp_async_commit()
                stage = base + cur * sbytes
                k.mbarrier_wait(_sh(bar0 + cur * 8, 0, u64), phase)
                frags = wf.fragments(stage, j)
                desc = k.cvt(u64, stage >> 4) | _DESC_HI
                k.wgmma_fence()
                for s in range(4):
                    d = (desc + 2 * s) if s else desc
                    k.wgmma(acc, frags[s], d.bitcast(b64))
                k.wgmma_commit()
                k.wgmma_wait(1)
                wrap = (cur + 1).eq(S)
                phase.set(k.select(wrap, phase ^ 1, phase))
                cur.set(k.select(wrap, k.mov(0, u32), cur + 1))
                pre.set(k.select((pre + 1).eq(S), k.mov(0, u32), pre + 1))
            wf.advance()
            kel.set(kel + 256)
        k.wgmma_wait(0)
        if tiles is not None:
            store(acc, m0 + rho, 2 * tq)
        else:
            if nsplit > 1:
                acc = _split_sum(k, plan, acc, ws, counters, tid, base)
            _store(k, acc, y, r, m0 + rho, n0 + 2 * tq, mrows, t, plan.spec.y_stride or mrows,
                   plan.epilogue == "bias")
    return m


def _split_sum(k, plan, acc, ws, counters, tid, flag):
    """Split K: every CTA of the tile writes its accumulators to its part
    of the tile's workspace, then counts itself in on the tile's counter;
    the last to arrive (its count ``split_k - 1``) resets the counter,
    reads all the parts and returns their sums in part order, so the sums
    are the same whichever CTA finishes last; the others exit.  ``flag``:
    a shared word (the ring's first, idle by now) that carries the count
    from thread 0 to the CTA."""
    nsplit, n, nt = plan.config.split_k, len(acc), plan.threads
    tile = k.mad(k.ctaid.y, k.nctaid.x, k.ctaid.x)
    region = tile * (nsplit * n * nt) + tid
    z = k.ctaid.z
    for i, v in enumerate(acc):
        k.st(ws[region + (z * n + i) * nt], v)
    k.fence("acq_rel", "gpu")
    k.bar_sync()
    with k.if_(tid.eq(0)):
        # release this CTA's parts (ordered before by the barrier), acquire the others'
        old = k.atom("add", counters[tile], 1, sem="acq_rel", scope="gpu")
        k.st(_sh(flag, 0, u32), old)
        with k.if_(old.eq(nsplit - 1)):
            k.st(counters[tile], k.mov(0, u32))
    k.bar_sync()
    k.exit(guard=k.ld(_sh(flag, 0, u32), u32).ne(nsplit - 1))
    out = []
    for i in range(n):
        s = k.ld(ws[region + i * nt])
        for p in range(1, nsplit):
            s = k.add(s, k.ld(ws[region + (p * n + i) * nt]))
        out.append(s)
    return out


def _store(k, acc, y, r, row0, tok0, mrows, t, ldy, bias=False):
    """Accumulator ``i``: weight row ``row0 + 8 ((i >> 1) & 1)``, token
    ``tok0 + 8 (i >> 2) + (i & 1)``; stored at ``y[token * ldy + row]``
    (``ldy``: the spec's ``y_stride``, or M) when both are in range, with
    ``r[token * ldy + row]`` added (a residual) or ``r[row]`` (``bias``)."""
    rok = [row0 < mrows, (row0 + 8) < mrows]
    for i, v in enumerate(acc):
        h, tt = (i >> 1) & 1, 8 * (i >> 2) + (i & 1)
        tok = tok0 + tt if tt else tok0
        row = row0 + 8 if h else row0
        ok = k.pand(rok[h], tok < t)
        idx = k.mad(tok, ldy, row)
        if r is not None:
            # plain ld, not .nc: y may be r
            v = k.add(v, k.ld(r[row if bias else idx], guard=ok), guard=ok)
        k.st(y[idx], v, guard=ok)
