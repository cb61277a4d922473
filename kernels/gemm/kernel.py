"""The GEMM kernel every weight format shares: the ``cp.async`` ring, the
stage loop, the ``mma.sync.m16n8k16`` tiles and the store with its
epilogues.  A format (:mod:`.q4k`, :mod:`.q6k`, :mod:`.q8_0`) adds only how
a stage of its bytes is copied, the scales it decodes per stage (if any) and
how its bytes become A fragments.

``Y[T, M] = X[T, K] . W[M, K]^T``.  In ``mma.sync.m16n8k16`` terms the
weight rows are A's 16 rows and the tokens B's 8 columns, so D is a tile of
``Y^T``.  One CTA computes a ``bm x bn`` tile (weight rows ``m0 ..``, tokens
``n0 ..``); warp ``(i, j)`` of its ``warps_m x warps_n`` grid owns rows
``i wm ..`` and tokens ``j wn ..`` (``wm = bm / warps_m``, ``wn = bn /
warps_n``) as ``wm/16 x wn/8`` mma tiles with f32 accumulators.

**Stages.**  K is walked ``bk`` at a time.  A stage holds, per weight row,
``plan.w_pitch`` bytes of the format's raw blocks, then X's ``bn x bk`` tile
as f16 (rows padded by 16 bytes: an odd multiple of 16, so the 8 rows a warp
reads at once hit distinct banks).  f16 X travels by ``cp.async``; f32 X is
loaded into registers, rounded to f16 (``cvt.rn``) and stored.  Rows past M
and tokens past T are read clamped to the last row and never stored.  Per
stage ``s``::

    cp.async.wait_group S-2; bar.sync     stage s landed; stage s-1 is free
    copy stage s+S-1 into s-1's buffer; commit
    [formats with a scale table: decode the stage's scales into it; bar.sync]
    mma over the stage

**The K permutation.**  An mma step covers 16 consecutive weights of the
stage (X's columns ``16 s ..``).  Thread ``t`` (lane % 4) of an A fragment
holds the mma's K positions ``2t, 2t+1, 2t+8, 2t+9``; every format lets
them stand for the step's weights ``4t .. 4t+3`` (registers 0 and 1: weights
``4t, 4t+1`` of rows ``g`` and ``g + 8``; registers 2 and 3: ``4t+2,
4t+3``), so B is the same permutation: token ``g``'s X values ``4t .. 4t+3``
of the step are 8 contiguous bytes, one ``ld.shared.v2.b32`` for both B
registers.  The dot product is a sum over K, so the order does not change
it.

Kernel parameters: ``w`` (u8*), ``x`` (f32* or f16*), ``r`` (f32*,
residual only), ``y`` (f32*), ``m`` (u32, rows of W), then ``t`` (u32) or
``t_ptr`` (u32*, ``t_device``).  Grid ``(ceil(T_max / bn), ceil(M / bm))``:
the CTAs that share a tile of W are launched next to each other, so W
(the large operand) comes from DRAM about once and X (``T K`` halves, a
few MB) is re-read from L2.  ``32 warps_m warps_n`` threads,
:attr:`.GemmPlan.dynamic_shared` bytes of dynamic shared memory; CTAs
whose tokens start at or past T exit at once.

The warp layout, the ring and the stage loop (:func:`mma_ring`) take X's
copies as an object (:class:`XCopies`), so the experts' GEMM
(:mod:`ptxgen.kernels.moe.expert_gemm`), which gathers X's rows, runs the
same loop.
"""

from __future__ import annotations

import math

import attrs

import ptxgen
from ptxgen.types import b32, f16, f32, u8, u16, u32
from ptxgen.values import Address

from ..plan import LaunchGeometry
from ..spec_fields import pdl_prologue

__all__ = ["build_gemm", "mma_ring", "Ring", "WarpTiles", "XCopies", "launch_geometry",
           "kernel_directives", "kernel_interface", "Lane", "WindowCopies", "sh", "nullctx"]


def launch_geometry(plan, m: int, t_max: int):
    """The launch for ``m`` weight rows and at most ``t_max`` tokens."""
    for what, v in (("M", m), ("T", t_max)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{what} must be a positive int, got {v!r}")
    c = plan.config
    return LaunchGeometry(plan.kernel_name,
                          (math.ceil(t_max / c.bn), math.ceil(m / c.bm), c.split_k),
                          plan.threads, plan.dynamic_shared)


def split_scratch(plan, m: int, t_max: int) -> tuple[int, int]:
    """What a launch of ``plan`` for ``m`` rows and at most ``t_max`` tokens
    with ``split_k > 1`` needs beside its arguments: ``(ws, tiles)``, the
    f32 elements of its workspace (``ws``) and the u32 counters, one a
    tile (``counters``: zero before the first launch; each launch leaves
    them zero).  ``(0, 0)`` without a split."""
    c = plan.config
    if c.split_k == 1:
        return 0, 0
    tiles = math.ceil(t_max / c.bn) * math.ceil(m / c.bm)
    return tiles * c.split_k * plan.split_workspace, tiles


def sh(addr, ty=b32):
    """A shared-memory operand at the u32 address ``addr``."""
    return Address(addr, 0, "shared", ty)


class nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@attrs.frozen
class Lane:
    """What a format's fragment decoder knows of its thread: the warp's
    first row in the CTA tile (``wrow``), the lane's row ``g`` (lane / 4)
    and quad index ``tq`` (lane % 4), the CTA's first weight row ``m0``,
    the rows of W (``mrows``) and the warp's 16-row tiles (``mt_n``)."""

    wrow: object
    g: object
    tq: object
    m0: object
    mrows: object
    mt_n: int


def thread_chunks(tid, threads, rows, per_row):
    """``(guard, row, chunk)`` for each of the ``rows x per_row`` chunks of a
    stage tile that thread ``tid`` copies, dealt round robin over
    ``threads`` threads; ``guard`` (``index < rows per_row``) only on the
    last round where some threads have none."""
    total = rows * per_row
    for i in range(math.ceil(total / threads)):
        idx = tid + i * threads
        guard = (idx < total) if (i + 1) * threads > total else None
        yield guard, idx // per_row, idx % per_row


class XCopies:
    """The per-thread copy plan of a stage's X tile: for every 16-byte chunk
    the thread copies, one u32 offset fixed for the whole kernel; each stage
    adds its K offset.  ``row(n)``: the row of X that column ``n`` of the
    CTA's tile reads (in range: :func:`build_gemm` clamps its tokens to T -
    1).

    The ring (:func:`mma_ring`) copies a stage by :meth:`issue` and each step
    the stage ``stages - 1`` ahead by :meth:`issue_ahead`."""

    #: f32 X: chunks loaded into registers before they are stored (bounds
    #: the registers the conversion holds)
    X_BATCH = 4

    def __init__(self, k, plan, tid, x, row):
        c = plan.config
        self.k, self.xp, self.f16x = k, x, plan.x_type == "f16"
        per = 16 // plan.x_bytes          # f16: 8 values, cp.async; f32: 4 values, registers
        self.x = []
        for guard, n, ch in thread_chunks(tid, plan.threads, c.bn, c.bk // per):
            r = row(n)
            dst = n * plan.x_pitch + (plan.w_stage_bytes + ch * (2 * per))
            self.x.append((guard, k.mad(r, plan.k, ch * per), dst))

    def issue(self, base, kk):
        """Copy the stage at K offset ``kk`` into the stage at shared
        address ``base``."""
        if self.f16x:
            self.f16(base, kk)
        else:
            self.f32(base, kk)

    def issue_ahead(self, ring, buf, ahead):
        """The step's copy of stage ``ahead`` (W and X, where there is one)
        into buffer ``buf`` of ``ring`` (a :class:`Ring`); returns what to
        run after the step's MMAs, or None."""
        nb = ring.stage(buf)
        with self.k.if_(ahead < ring.nk):
            ring.issue(nb, ahead * ring.bk)
        return None

    def f16(self, base, kk):
        k = self.k
        for guard, off, dst in self.x:
            k.cp_async(sh(base + dst, u8), self.xp[off + kk], 16, guard=guard)

    def f32(self, base, kk):
        """f32 X: load the stage's chunks (4 floats each) a batch at a
        time, round them to f16 and store them."""
        k = self.k
        for b0 in range(0, len(self.x), self.X_BATCH):
            batch = [(guard, dst, k.ld(self.xp[off + kk], f32, vec=4, nc=True, guard=guard))
                     for guard, off, dst in self.x[b0:b0 + self.X_BATCH]]
            for guard, dst, vals in batch:
                h = [k.cvt(f16, v, rnd="rn") for v in vals]
                words = (k.pack(b32, h[0], h[1]), k.pack(b32, h[2], h[3]))
                k.st(sh(base + dst), words, guard=guard)


class WindowCopies:
    """The copy plan of a format whose blocks are only 2-byte aligned
    (Q6_K's 210 bytes, Q8_0's 34): per weight row and stage, ``spans``
    windows of 16-byte aligned chunks, span ``i`` holding the
    ``spans[i] = (chunks, dst)`` chunks that start at the 16-byte boundary
    at or below the span's first byte and landing at ``dst`` in the stage
    row.  The data then starts ``row_shift`` (0..14, even) bytes into each
    window, the same for every span of a row when the spans' offsets differ
    by multiples of 16.

    A chunk that would read past the end of W (the last row's last bytes,
    when ``M row_bytes`` is not a multiple of 16) copies only the bytes
    before the end (:meth:`issue`); the bytes past it are left as they are
    (never read as data)."""

    def __init__(self, k, plan, tid, w, m0, mrows, spans):
        c = plan.config
        thr = plan.threads
        self.k, self.wp, self.spans = k, w, []
        self.total = mrows * plan.row_bytes
        for n, dst0 in spans:
            chunks = []
            for guard, r, ch in thread_chunks(tid, thr, c.bm, n):
                row = k.min(m0 + r, mrows - 1)
                chunks.append((guard, k.mad(row, plan.row_bytes, ch * 16),
                               r * plan.w_pitch + (dst0 + ch * 16)))
            self.spans.append(chunks)

    def issue(self, base, starts):
        """cp.async the stage into the stage at shared address ``base``;
        ``starts[i]``: the byte offset within a row of span ``i``'s first
        byte.  A chunk that would run past the end of W (``L`` < 16 bytes
        left, even) copies only those: 8 bytes if ``L >= 8``, 4 at +8 if ``L
        >= 12``, 4 at 0 if ``4 <= L < 8``, and the last 2 by ``ld``/``st``
        when ``L`` is 2 mod 4 (no access past the end, which
        compute-sanitizer would report even for ``cp.async``'s src-size
        form); a chunk wholly past it copies nothing."""
        k = self.k
        for chunks, so in zip(self.spans, starts):
            for guard, off, dst in chunks:
                src = (off + so) & ~15
                left = self.total - src
                inb = (src + 16) <= self.total
                k.cp_async(sh(base + dst, u8), self.wp[src], 16,
                           guard=inb if guard is None else k.pand(guard, inb))
                tail = k.pand(~inb, src < self.total)
                if guard is not None:
                    tail = k.pand(guard, tail)
                with k.if_(tail):
                    k.cp_async(sh(base + dst, u8), self.wp[src], 8, guard=left >= 8)
                    k.cp_async(sh(base + dst + 8, u8), self.wp[src + 8], 4, guard=left >= 12)
                    k.cp_async(sh(base + dst, u8), self.wp[src], 4,
                               guard=k.pand(left >= 4, left < 8))
                    odd = (left & 2).ne(0)
                    v = k.ld(self.wp[src + left - 2], u16, guard=odd)
                    k.st(sh(base + dst + left - 2, u16), v, guard=odd)


def row_shift(k, plan, row, start):
    """The shift (0..14) of a row's data in its windows: ``(row row_bytes +
    start) & 15``."""
    return k.mad(row, plan.row_bytes, start) & 15


def _compute(k, plan, fmt, lanes, wbase, sbase, kk, wcol, g, tq, acc):
    """The warp's mma over one stage: per step of the format's order, the B
    fragments of the step, then per 16-row tile its A fragment and the mmas
    with every token tile."""
    c = plan.config
    nt_n = c.bn // c.warps_n // 8
    steps = fmt.fragments(k, plan, lanes, wbase, sbase, kk)
    xl = wbase + (wcol + g) * plan.x_pitch + (plan.w_stage_bytes + 8 * tq)
    for step, a_of in steps:
        bfr = [k.ld(Address(xl, 8 * nt * plan.x_pitch + 32 * step, "shared", b32), vec=2)
               for nt in range(nt_n)]
        for mt in range(len(acc)):
            a = a_of(mt)
            for nt in range(nt_n):
                d = k.mma(tuple(a), bfr[nt], tuple(acc[mt][nt]))
                for e in range(4):
                    acc[mt][nt][e].set(d[e])


def kernel_directives(plan) -> dict:
    """``.reqntid`` (and ``.minnctapersm`` where the config asks) of a GEMM
    kernel."""
    kdir = dict(reqntid=plan.threads)
    if plan.config.min_ctas:
        kdir["minnctapersm"] = plan.config.min_ctas
    return kdir


def kernel_interface(k, plan, smem_align=None):
    """Declare the parameters every GEMM kernel takes (``w, x[, r], y, m,
    t | t_ptr``) and its dynamic shared memory (at ``smem_align`` bytes, the
    builder's default when None), run the PDL prologue, read T and exit the
    CTAs whose first token is past it.  Returns ``(w, x, r, y, mrows, t,
    smem, n0)`` (``r``: the residual ``[T, M]`` or the bias ``[M]``; None
    without either epilogue)."""
    xt = f32 if plan.x_type == "f32" else f16
    w = k.param_ptr("w", u8, align=16)
    x = k.param_ptr("x", xt, align=16)
    r = k.param_ptr("r", f32) if plan.epilogue != "none" else None
    y = k.param_ptr("y", f32)
    mrows = k.param("m", u32)
    if plan.t_device:
        t_ptr = k.param_ptr("t_ptr", u32)
    else:
        t_param = k.param("t", u32)
    smem = (k.dynamic_shared("smem", u8) if smem_align is None
            else k.dynamic_shared("smem", u8, align=smem_align))
    pdl_prologue(k, plan.spec)
    t = k.ld(t_ptr[0]) if plan.t_device else t_param
    n0 = k.ctaid.x * plan.config.bn
    k.exit(guard=n0 >= t)
    return w, x, r, y, mrows, t, smem, n0


@attrs.frozen
class Ring:
    """The ``cp.async`` ring of a CTA's stages at shared address ``base``:
    ``nk`` stages of ``bk`` weights, W copied by ``wcp`` (the format's
    copies) and X by ``xcp`` (an :class:`XCopies`)."""

    k: object
    plan: object
    base: object
    nk: int
    wcp: object
    xcp: object

    @property
    def bk(self) -> int:
        return self.plan.config.bk

    def stage(self, buf):
        """The shared address of buffer ``buf``."""
        return self.base + buf * self.plan.stage_bytes

    def issue(self, base, kk):
        """Copy W's and X's stage at K offset ``kk`` into the buffer at
        ``base``."""
        self.wcp.issue_stage(base, kk)
        self.xcp.issue(base, kk)


@attrs.frozen
class WarpTiles:
    """The warp's accumulators ``acc[mt][nt][e]`` (f32, D element ``e`` of
    mma tile ``(mt, nt)``) and where they sit: the warp's first row
    (``wrow``) and token (``wcol``) in the CTA tile, the lane's row ``g``
    (lane / 4) and quad index ``tq`` (lane % 4)."""

    acc: list
    wrow: object
    wcol: object
    g: object
    tq: object


def mma_ring(k, plan, fmt, smem, w, m0, mrows, x_copies) -> WarpTiles:
    """The CTA's product over K of weight rows ``m0 ..`` of ``w`` (``mrows``
    of them) in the format ``fmt`` and its X tile: the warp layout, the
    ``cp.async`` ring in the dynamic shared memory ``smem`` and the stage
    loop.  ``x_copies(tid)`` makes the thread's X copies (an
    :class:`XCopies`); it is called once the weight copies are planned."""
    c = plan.config
    S = c.stages
    nk = plan.k // c.bk
    tid = k.tid.x
    warp, lane = tid >> 5, tid & 31
    g, tq = lane >> 2, lane & 3
    wrow = (warp & (c.warps_m - 1)) * (c.bm // c.warps_m)
    wcol = (warp >> int(math.log2(c.warps_m))) * (c.bn // c.warps_n)
    base = k.mov(smem, u32)
    sbase = base + S * plan.stage_bytes
    wcp = fmt.copies(k, plan, tid, w, m0, mrows)
    ring = Ring(k, plan, base, nk, wcp, x_copies(tid))
    mt_n, nt_n = c.bm // c.warps_m // 16, c.bn // c.warps_n // 8
    lanes = Lane(wrow, g, tq, m0, mrows, mt_n)

    for s in range(S - 1):
        if s < nk:
            ring.issue(ring.stage(s), k.mov(s * c.bk, u32))
        k.cp_async_commit()
    acc = [[[k.var(f32, 0.0) for _ in range(4)] for _ in range(nt_n)] for _ in range(mt_n)]
    cur = k.var(u32, 0)                 # buffer of this step
    nxt = k.var(u32, S - 1)             # buffer the step S - 1 ahead goes to
    with k.for_range(0, nk) as step:
        k.cp_async_wait(S - 2)
        k.bar_sync()
        after = ring.xcp.issue_ahead(ring, nxt, step + (S - 1))
        k.cp_async_commit()
        wb = ring.stage(cur)
        kk = step * c.bk
        if plan.scale_bytes:
            fmt.decode_scales(k, plan, tid, wb, sbase, kk, lanes)
            k.bar_sync()
        _compute(k, plan, fmt, lanes, wb, sbase, kk, wcol, g, tq, acc)
        if after is not None:
            after()
        cur.set(k.select(cur.eq(S - 1), k.mov(0, u32), cur + 1))
        nxt.set(k.select(nxt.eq(S - 1), k.mov(0, u32), nxt + 1))
    return WarpTiles(acc, wrow, wcol, g, tq)


def build_gemm(plan, fmt) -> ptxgen.Module:
    """The GEMM kernel of ``plan`` (a :class:`.GemmPlan`) for the weight
    format ``fmt``."""
    m = ptxgen.Module(plan.target)
    with m.kernel(plan.kernel_name, **kernel_directives(plan)) as k:
        w, x, r, y, mrows, t, smem, n0 = kernel_interface(k, plan)
        m0 = k.ctaid.y * plan.config.bm
        wt = mma_ring(k, plan, fmt, smem, w, m0, mrows,
                      lambda tid: XCopies(k, plan, tid, x, lambda n: k.min(n0 + n, t - 1)))
        _store(k, plan, wt.acc, y, r, m0 + wt.wrow, n0 + wt.wcol, wt.g, wt.tq, mrows, t)
    return m


def _store(k, plan, acc, y, r, row0, tok0, g, tq, mrows, t):
    """D element ``e`` of tile ``(mt, nt)``: weight row ``row0 + 16 mt + g +
    8 (e >= 2)``, token ``tok0 + 8 nt + 2 tq + (e & 1)``; stored at
    ``y[token * ldy + row]`` (``ldy``: the spec's ``y_stride``, or M) when
    both are in range."""
    rows = [row0 + (16 * mt + 8 * h) + g for mt in range(len(acc)) for h in range(2)]
    toks = [tok0 + (8 * nt + e) + 2 * tq for nt in range(len(acc[0])) for e in range(2)]
    rok = [rr < mrows for rr in rows]
    tok_ok = [tt < t for tt in toks]
    ldy = plan.spec.y_stride or mrows
    for mt in range(len(acc)):
        for nt in range(len(acc[0])):
            for e in range(4):
                ri, ti = 2 * mt + (e >> 1), 2 * nt + (e & 1)
                ok = k.pand(rok[ri], tok_ok[ti])
                idx = k.mad(toks[ti], ldy, rows[ri])
                v = acc[mt][nt][e]
                if r is not None:
                    # plain ld, not .nc: y may be r; a bias is one value per row
                    ridx = rows[ri] if plan.epilogue == "bias" else idx
                    v = k.add(v, k.ld(r[ridx], guard=ok), guard=ok)
                k.st(y[idx], v, guard=ok)
