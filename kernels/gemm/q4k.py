"""Q4_K GEMM on tensor cores: raw Q4_K bytes through a ``cp.async`` ring,
nibbles turned into ``mma`` A fragments in registers.

``Y[T, M] = X[T, K] . W[M, K]^T``.  In ``mma.sync.m16n8k16`` terms the
weight rows are A's 16 rows and the tokens B's 8 columns, so D is a tile of
``Y^T``.  One CTA computes a ``bm x bn`` tile (weight rows ``m0 ..``, tokens
``n0 ..``); warp ``(i, j)`` of its ``warps_m x warps_n`` grid owns rows
``i wm ..`` and tokens ``j wn ..`` (``wm = bm / warps_m``, ``wn = bn /
warps_n``) as ``wm/16 x wn/8`` mma tiles with f32 accumulators.

**Stages.**  K is walked ``bk`` (64, 128 or 256) at a time.  A stage holds,
per weight row, the 16-byte header of the super-block and the ``bk / 2``
bytes of nibbles of its ``bk / 64`` groups (``w_pitch = 16 + bk/2`` bytes:
an odd multiple of 16, so the 8 rows a warp reads at once hit distinct
banks), then X's ``bn x bk`` tile as f16 (rows padded by 16 bytes, the same
reason).  f16 X travels by ``cp.async``; f32 X is loaded into registers,
rounded to f16 (``cvt.rn``) and stored.  Rows past M and tokens past T are
read clamped to the last row and never stored.  Per stage ``s``::

    cp.async.wait_group S-2; bar.sync     stage s landed; stage s-1 is free
    copy stage s+S-1 into s-1's buffer; commit
    decode the stage's scales: per (sub-block, row) the f16x2 pairs
        (d sc, d sc) and (-dmin m, -dmin m) into a shared table; bar.sync
    mma over the stage

**The K permutation.**  Byte ``b`` (0..31) of group ``j``'s nibbles holds
weight ``64 j + b`` (low nibble) and ``64 j + 32 + b`` (high).  The group
is four mma K steps of 16: step ``s`` covers weights ``64 j + 16 s ..`` and
reads the word at byte ``16 (s & 1) + 4 t`` (``t`` = lane % 4), low nibbles
for ``s < 2``, high for ``s >= 2``.  Thread ``t`` of an A fragment holds the
mma's K positions ``2t, 2t+1, 2t+8, 2t+9``; here they stand for the weights
``4t .. 4t+3`` of the step, the four nibbles of that one word, so a
fragment register is two nibbles of one byte pair:
``prmt(word, 0, 0x4140)`` spreads bytes 0 and 1 into the two halves,
``& 0x000F000F | 0x64006400`` makes the f16 pair ``1024 + q``, and
``sub.f16x2`` of 1024 leaves ``q`` exactly (the high nibbles: mask
``0x00F000F0``, then ``fma.f16x2 (h, 1/16, -64)``).  Then ``w = fma.f16x2(q,
(s, s), (-m, -m))``, rounded once.  B uses the same permutation: token
``g``'s X values ``4t .. 4t+3`` of the step are 8 contiguous bytes, one
``ld.shared.v2.b32`` giving both B registers.

Accuracy (against float64 products of the gguf-dequantized weights):
``x`` is rounded to f16 (relative ``u = 2^-11``), ``d sc`` and ``dmin m``
to f16 (``u`` each) and ``w`` once more (``u``), so each product is within
``3.01 u |x| (|d sc q| + |dmin m|)``; the mma chain adds ``(K/16)
2^-21 sum |x w|``.  The tests assert that sum.

Kernel parameters: ``w`` (u8*), ``x`` (f32* or f16*), ``r`` (f32*,
residual only), ``y`` (f32*), ``m`` (u32, rows of W), then ``t`` (u32) or
``t_ptr`` (u32*, ``t_device``).  Grid ``(ceil(T_max / bn), ceil(M / bm))``:
the CTAs that share a tile of W are launched next to each other, so W
(the large operand) comes from DRAM about once and X (``T K`` halves, a
few MB) is re-read from L2.  ``32 warps_m warps_n`` threads,
:attr:`.GemmPlan.dynamic_shared` bytes of dynamic shared memory; CTAs
whose tokens start at or past T exit at once.
"""

from __future__ import annotations

import math

import ptxgen
from ptxgen.types import b32, f16, f16x2, f32, u8, u32
from ptxgen.values import Address

from ..spec_fields import pdl_prologue

__all__ = ["build_q4k", "launch_geometry"]

_F16_1024 = 0x64006400


def launch_geometry(plan, m: int, t_max: int):
    """``(grid, block, shared_bytes)`` for ``m`` weight rows and at most
    ``t_max`` tokens."""
    for what, v in (("M", m), ("T", t_max)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{what} must be a positive int, got {v!r}")
    c = plan.config
    return ((math.ceil(t_max / c.bn), math.ceil(m / c.bm), 1), (plan.threads, 1, 1),
            plan.dynamic_shared)


def _sh(addr, ty=b32):
    return Address(addr, 0, "shared", ty)


class _Copies:
    """The per-thread copy plan of a stage: for every 16-byte chunk the
    thread copies, one u32 offset fixed for the whole kernel (rows clamped
    to M - 1 and T - 1); each stage adds its K offset."""

    #: f32 X: chunks loaded into registers before they are stored (bounds
    #: the registers the conversion holds)
    X_BATCH = 4

    def __init__(self, k, plan, tid, w, x, m0, mrows, n0, t):
        c = plan.config
        thr = plan.threads
        self.k, self.plan, self.wp, self.xp = k, plan, w, x
        # weight chunks: per row the header (chunk 0) and bk/32 chunks of nibbles
        cw = 1 + c.bk // 32
        self.w = []
        for i in range(math.ceil(c.bm * cw / thr)):
            idx = tid + i * thr
            guard = (idx < c.bm * cw) if (i + 1) * thr > c.bm * cw else None
            r, ch = idx // cw, idx % cw
            row = k.min(m0 + r, mrows - 1)
            is_q = k.setp("ne", ch, 0)
            # chunk ch >= 1 sits at 16 ch in the stage row and at 16 + 32 j0 +
            # 16 (ch - 1) = 16 ch + 32 j0 in the super-block
            self.w.append((guard, is_q, k.mad(row, plan.row_bytes, ch * 16),
                           r * plan.w_pitch + ch * 16))
        # X chunks of 16 bytes (f16: 8 values, cp.async; f32: 4 values, registers)
        per = 16 // plan.x_bytes
        cx = c.bk // per
        self.x = []
        for i in range(math.ceil(c.bn * cx / thr)):
            idx = tid + i * thr
            guard = (idx < c.bn * cx) if (i + 1) * thr > c.bn * cx else None
            n, ch = idx // cx, idx % cx
            tok = k.min(n0 + n, t - 1)
            dst = n * plan.x_pitch + (plan.w_stage_bytes + ch * (2 * per))
            self.x.append((guard, k.mad(tok, plan.k, ch * per), dst))

    def weights(self, base, kk):
        """cp.async the weight chunks of the stage at K offset ``kk`` into
        the stage at shared address ``base``."""
        k = self.k
        hdr = (kk >> 8) * 144
        qoff = hdr + ((kk & 255) >> 1)          # group j0 = (kk & 255) / 64: 32 j0 bytes
        for guard, is_q, off, dst in self.w:
            src = self.wp[off + k.select(is_q, qoff, hdr)]
            k.cp_async(_sh(base + dst, u8), src, 16, guard=guard)

    def x_f16(self, base, kk):
        k = self.k
        for guard, off, dst in self.x:
            k.cp_async(_sh(base + dst, u8), self.xp[off + kk], 16, guard=guard)

    def x_f32(self, base, kk):
        """f32 X: load the stage's chunks (4 floats each) a batch at a
        time, round them to f16 and store them."""
        k = self.k
        for b0 in range(0, len(self.x), self.X_BATCH):
            batch = [(guard, dst, k.ld(self.xp[off + kk], f32, vec=4, nc=True, guard=guard))
                     for guard, off, dst in self.x[b0:b0 + self.X_BATCH]]
            for guard, dst, vals in batch:
                h = [k.cvt(f16, v, rnd="rn") for v in vals]
                words = (k.pack(b32, h[0], h[1]), k.pack(b32, h[2], h[3]))
                k.st(_sh(base + dst), words, guard=guard)


def _decode_scales(k, plan, tid, wbase, sbase, kk):
    """Per (sub-block, row) of the stage at ``wbase``: ``(d sc, d sc)`` and
    ``(-dmin m, -dmin m)`` as f16x2 into the table at ``sbase``
    (``[bk/32][bm]`` entries of 8 bytes)."""
    c = plan.config
    thr, n = plan.threads, (c.bk // 32) * c.bm
    j0 = (kk & 255) >> 5                       # the stage's first sub-block, 0..7
    for i in range(math.ceil(n / thr)):
        e = tid + i * thr
        guard = (e < n) if (i + 1) * thr > n else None
        with k.guarded(guard) if guard is not None else _nullctx():
            sbl, r = e // c.bm, e % c.bm
            j = j0 + sbl
            hdr = wbase + r * plan.w_pitch
            dm = k.ld(_sh(hdr), b32)
            jj = j & 3
            a = k.ld(_sh(hdr + 4 + jj, u8))
            b = k.ld(_sh(hdr + 8 + jj, u8))
            cc = k.ld(_sh(hdr + 12 + jj, u8))
            lo = j < 4
            sc = k.select(lo, a & 63, (cc & 15) | ((a >> 6) << 4))
            mn = k.select(lo, b & 63, (cc >> 4) | ((b >> 6) << 4))
            d, dmin = k.unpack(dm, f16, 2)
            s = k.cvt(f16, d.to(f32) * sc.to(f32), rnd="rn")
            nm = k.cvt(f16, -(dmin.to(f32) * mn.to(f32)), rnd="rn")
            k.st(_sh(sbase + (sbl * c.bm + r) * 8),
                 (k.pack(b32, s, s), k.pack(b32, nm, nm)))


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


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


def _compute(k, plan, wbase, sbase, wrow, wcol, g, tq, acc):
    """The warp's mma over one stage.  Steps run in the order 0, 2, 1, 3, so
    the two steps that read one word of nibbles (low, then high) are
    adjacent and its spread bytes live only between them."""
    c = plan.config
    mt_n, nt_n = c.bm // c.warps_m // 16, c.bn // c.warps_n // 8
    # one register per lane and operand; the rest are constant offsets
    wl = wbase + (wrow + g) * plan.w_pitch + 4 * tq
    sl = sbase + (wrow + g) * 8
    xl = wbase + (wcol + g) * plan.x_pitch + (plan.w_stage_bytes + 8 * tq)

    def row_off(mt, h):
        return 16 * mt + 8 * h

    for jj in range(c.bk // 64):
        for w in range(2):
            words = [[k.ld(Address(wl, row_off(mt, h) * plan.w_pitch + 16 + 32 * jj + 16 * w,
                                   "shared", b32))
                      for h in range(2)] for mt in range(mt_n)]
            cache = {}
            for hi in range(2):
                step = 2 * hi + w
                bfr = [k.ld(Address(xl, 8 * nt * plan.x_pitch + 2 * (64 * jj + 16 * step),
                                    "shared", b32), vec=2)
                       for nt in range(nt_n)]
                for mt in range(mt_n):
                    sc = [k.ld(Address(sl, (row_off(mt, h) + (2 * jj + hi) * c.bm) * 8,
                                       "shared", b32), vec=2) for h in range(2)]
                    a = [_dequant(k, cache, words[mt][h], pair, hi, sc[h])
                         for pair in range(2) for h in range(2)]
                    for nt in range(nt_n):
                        d = k.mma(tuple(a), bfr[nt], tuple(acc[mt][nt]))
                        for e in range(4):
                            acc[mt][nt][e].set(d[e])


def build_q4k(plan) -> ptxgen.Module:
    """The Q4_K GEMM kernel of ``plan`` (a :class:`.GemmPlan`)."""
    c = plan.config
    S = c.stages
    nk = plan.k // c.bk
    xt = f32 if plan.x_type == "f32" else f16
    m = ptxgen.Module(plan.target)
    kdir = dict(reqntid=plan.threads)
    if c.min_ctas:
        kdir["minnctapersm"] = c.min_ctas
    with m.kernel(plan.kernel_name, **kdir) as k:
        w = k.param_ptr("w", u8, align=16)
        x = k.param_ptr("x", xt, align=16)
        r = k.param_ptr("r", f32) if plan.epilogue == "residual" else None
        y = k.param_ptr("y", f32)
        mrows = k.param("m", u32)
        if plan.t_device:
            t_ptr = k.param_ptr("t_ptr", u32)
        else:
            t_param = k.param("t", u32)
        smem = k.dynamic_shared("smem", u8)
        pdl_prologue(k, plan.spec)
        t = k.ld(t_ptr[0]) if plan.t_device else t_param
        n0 = k.ctaid.x * c.bn
        k.exit(guard=n0 >= t)
        m0 = k.ctaid.y * c.bm
        tid = k.tid.x
        warp, lane = tid >> 5, tid & 31
        g, tq = lane >> 2, lane & 3
        wrow = (warp & (c.warps_m - 1)) * (c.bm // c.warps_m)
        wcol = (warp >> int(math.log2(c.warps_m))) * (c.bn // c.warps_n)
        base = k.mov(smem, u32)
        sbase = base + S * plan.stage_bytes
        cp = _Copies(k, plan, tid, w, x, m0, mrows, n0, t)

        def stage_base(i):
            return base + i * plan.stage_bytes

        def issue(buf_base, kk):
            cp.weights(buf_base, kk)
            if plan.x_type == "f16":
                cp.x_f16(buf_base, kk)
            else:
                cp.x_f32(buf_base, kk)

        for s in range(S - 1):
            if s < nk:
                issue(stage_base(s), k.mov(s * c.bk, u32))
            k.cp_async_commit()
        mt_n, nt_n = c.bm // c.warps_m // 16, c.bn // c.warps_n // 8
        acc = [[[k.var(f32, 0.0) for _ in range(4)] for _ in range(nt_n)] for _ in range(mt_n)]
        cur = k.var(u32, 0)                 # buffer of this step
        nxt = k.var(u32, S - 1)             # buffer the step S - 1 ahead goes to
        with k.for_range(0, nk) as step:
            k.cp_async_wait(S - 2)
            k.bar_sync()
            ahead = step + (S - 1)
            nbase = base + nxt * plan.stage_bytes
            with k.if_(ahead < nk):
                issue(nbase, ahead * c.bk)
            k.cp_async_commit()
            wb = base + cur * plan.stage_bytes
            _decode_scales(k, plan, tid, wb, sbase, step * c.bk)
            k.bar_sync()
            _compute(k, plan, wb, sbase, wrow, wcol, g, tq, acc)
            cur.set(k.select(cur.eq(S - 1), k.mov(0, u32), cur + 1))
            nxt.set(k.select(nxt.eq(S - 1), k.mov(0, u32), nxt + 1))
        _store(k, plan, acc, y, r, m0 + wrow, n0 + wcol, g, tq, mrows, t)
    return m


def _store(k, plan, acc, y, r, row0, tok0, g, tq, mrows, t):
    """D element ``e`` of tile ``(mt, nt)``: weight row ``row0 + 16 mt + g +
    8 (e >= 2)``, token ``tok0 + 8 nt + 2 tq + (e & 1)``; stored at
    ``y[token * M + row]`` when both are in range."""
    rows = [row0 + (16 * mt + 8 * h) + g for mt in range(len(acc)) for h in range(2)]
    toks = [tok0 + (8 * nt + e) + 2 * tq for nt in range(len(acc[0])) for e in range(2)]
    rok = [rr < mrows for rr in rows]
    tok_ok = [tt < t for tt in toks]
    for mt in range(len(acc)):
        for nt in range(len(acc[0])):
            for e in range(4):
                ri, ti = 2 * mt + (e >> 1), 2 * nt + (e & 1)
                ok = k.pand(rok[ri], tok_ok[ti])
                idx = k.mad(toks[ti], mrows, rows[ri])
                v = acc[mt][nt][e]
                if r is not None:
                    # plain ld, not .nc: y may be r
                    v = k.add(v, k.ld(r[idx], guard=ok), guard=ok)
                k.st(y[idx], v, guard=ok)
