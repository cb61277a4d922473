"""The flash-prefill kernel body (``mma.sync.m16n8k16``, ``ldmatrix``)."""

from __future__ import annotations

import math

from ptxgen import types as T
from ptxgen.types import b32, b64, f16, f32, s32, u8, u32
from ptxgen.values import Address

from ..spec_fields import has_bulk_copy, pdl_prologue
from .pool import PoolRows
from .spec import NEG

__all__ = ["build_prefill"]

LOG2E = 1.0 / math.log(2.0)
#: a row's running max moves only when a tile's max passes it by more than
#: this (log2 units): the probabilities are then at most 2^8 (f16 holds
#: them), and O and l, relative to the same max, are rescaled on few tiles
RESCALE_SLACK = 8.0


def _pack_f16(k, a, b):
    """Two f32 values as one ``f16x2`` register (``a`` in the low half)."""
    return k.pack(b32, k.cvt(f16, a), k.cvt(f16, b))


def build_prefill(m, plan):
    """Emit the kernel ``plan.kernel_name`` into module ``m``.

    Parameters: ``q: f32*, k_cache: f16*, v_cache: f16*, start_ptr: s32*,
    n_tokens_ptr: s32*, out: f32* (f16* with out_type f16), capacity: u32,
    sm_scale: f32, q_stride: u32`` (elements between consecutive query
    rows; ``n_q_heads * head_dim`` for a contiguous q, more where q sits in
    a wider QKV row), and on sm_90 ``k_map, v_map`` (the caches' tensor
    maps).  Paged (``plan.paged``): ``q, k_pool, v_pool, block_table: s32*,
    start_ptr, n_tokens_ptr, out, max_blocks: u32, sm_scale, q_stride,
    num_blocks: u32`` and on sm_90 the pools' maps.  Grid ``(ceil(T_max /
    R), n_q_heads / heads)``, ``32 * warps`` threads,
    :attr:`.FlashPrefillPlan.dynamic_shared` bytes of dynamic shared memory.

    **Work split.**  A warp takes 16 rows (one mma row tile); ``R =
    block_rows = 16 warps / heads`` rows in ``RG = warps / heads`` groups
    of 16.  Block ``(x, y)`` takes the query heads ``y
    heads ..`` + ``heads`` (one KV head ``h``); warp ``w`` head ``y heads + w
    % heads`` and row group ``w / heads`` of the block; lane ``4 g + t`` rows
    ``g`` and ``g + 8`` of its row tile.  Row ``i`` sits at position
    ``L + i`` and sees keys ``0 .. L + i``, so later groups have more work.
    With one group a block (``RG = 1``) block ``x`` takes group ``nctaid.x -
    1 - x``: the longest first.  With ``RG`` even the ``NG = ceil(T / 16)``
    groups are paired from both ends, pair ``p`` = groups ``p`` and ``NG - 1
    - p`` (the middle group of an odd ``NG`` alone), and block ``x`` takes
    pairs ``x RG/2 ..`` + ``RG/2``: every block walks about the same number
    of keys (at L = 0 half the longest walk is spent with the short groups'
    warps done, leaving the SM to the long ones).  Warps of groups past
    ``NG`` compute nothing and store nothing.

    **The ring.**  The block walks the keys its last row sees in tiles of
    ``block_keys``; ``stages`` K/V tile pairs live in shared memory.  Per
    tile ``i``::

        cp.async.wait_group stages-2; bar.sync   tile i landed; tile i-1's
                                                 buffer is free
        copy tile i + stages - 1 into that buffer; commit
        each warp whose rows see tile i: S = Q K^T, mask (only where the
        tile reaches past the warp's first row), online softmax, O += P V

    (rows past the block's last key are clamped to it, so no unwritten
    cache row enters).  Paged, a key row's address comes from the table
    (:class:`.pool.PoolRows`): with ``paged >= block_keys`` a tile lies in
    one pool block, one entry a tile; thread 0 reads the next TMA tile's
    entries when it issues a tile, so the table adds no load to a copy's
    path, and the prologue's entries are read beside L and T.  q is read
    once into registers in f16, prescaled by ``sm_scale log2 e``; K
    fragments come by ``ldmatrix``, V by ``ldmatrix.trans``; the running
    max and sum use ``ex2.approx.ftz``; a row's max moves only when a tile
    passes it by more than
    :data:`RESCALE_SLACK`, and O and the sum are rescaled only on tiles
    where some row's max moved (a warp-uniform branch: the factor is
    exactly 1 otherwise); P is rounded
    to f16 and O accumulated in f32.  At the end ``O / l`` is
    stored (f32, or rounded to f16) for rows below ``T``.

    **A sliding window** (``plan.window``, ``W``): row ``i`` sees the keys
    ``L + i - W + 1 .. L + i``.  The walk starts at the tile of the
    block's first row's first key; a warp computes the tiles that reach
    into some row's window, and masks both ends where a tile is not wholly
    inside every row's."""
    d, G, NW, BN = plan.head_dim, plan.group, plan.warps, plan.block_keys
    H, S = plan.heads, plan.stages
    R = plan.block_rows
    HB = BN * 128                # bytes of one 64-dim half of a K (or V) tile
    VOFF = BN * d * 2            # V's tile after K's in a stage
    KT = d // 16               # k-tiles of q . k
    NT = BN // 8               # n-tiles of the scores per key tile
    DT = d // 8                # n-tiles of the output
    CHUNKS = BN * d // 8       # 16-byte chunks of one K (or V) tile
    SB = plan.stage_bytes
    nthr = 32 * NW
    ot = f16 if plan.out_type == "f16" else f32
    wg = plan.config.kernel == "wgmma"
    BS = plan.paged              # pool block size (0: a contiguous cache)
    with m.kernel(plan.kernel_name, reqntid=nthr) as k:
        q = k.param_ptr("q", f32, align=16)
        if BS:
            kc = k.param_ptr("k_pool", f16, align=16)
            vc = k.param_ptr("v_pool", f16, align=16)
            table = k.param_ptr("block_table", s32)
        else:
            kc = k.param_ptr("k_cache", f16, align=16)
            vc = k.param_ptr("v_cache", f16, align=16)
        start_ptr = k.param_ptr("start_ptr", s32)
        ntok_ptr = k.param_ptr("n_tokens_ptr", s32)
        out = k.param_ptr("out", ot, align=16)
        if BS:
            max_blocks = k.param("max_blocks", u32)
        else:
            cap = k.param("capacity", u32)
        sm_scale = k.param("sm_scale", f32)
        q_stride = k.param("q_stride", u32)
        if BS:
            num_blocks = k.param("num_blocks", u32)
            cap = max_blocks << (BS.bit_length() - 1)    # the table row's keys
        tma = has_bulk_copy(plan.target)          # whole K/V tiles by TMA
        if tma:
            kmap, vmap = k.tensor_map_param("k_map"), k.tensor_map_param("v_map")
        # 128B-swizzled tiles start on 1024-byte boundaries
        smem = k.dynamic_shared("smem", u8, align=1024)
        pdl_prologue(k, plan)

        tid = k.tid.x
        lane, warp = tid & 31, tid >> 5
        g, t = lane >> 2, lane & 3
        qh0 = k.ctaid.y * H
        qh = qh0 + (warp % H) if H > 1 else qh0
        h = qh0 // G
        nq = k.nctaid.y * H
        # L and T from the device, clamped: L in [0, capacity], T in
        # [0, min(capacity - L, rows of the grid)]
        L = k.min(k.max(k.ld(start_ptr[0]), 0).bitcast(u32), cap)
        Tn = k.min(k.max(k.ld(ntok_ptr[0]), 0).bitcast(u32), cap - L)
        Tn = k.min(Tn, k.nctaid.x * R)
        # the walk keeps S - 1 tiles ahead (the wgmma walk S - 2: tile i - 1's
        # V is still read while tile i's scores are computed)
        lead = S - 2 if wg else S - 1
        if BS:
            # the pools' rows of KV head h (n_kv_heads from the grid)
            n_kv = k.nctaid.y if G == H else k.nctaid.y // (G // H)
            pool = PoolRows(k, BS, table, max_blocks, num_blocks, h, n_kv)
            if tma:
                # the pool blocks of the tiles TMA copies, read ahead: those
                # of the prologue's tiles here, beside L and T (they do not
                # depend on them), and in ``ahead_ents`` those of the next
                # tile to issue, which thread 0 reloads at each issue
                NE = max(1, BN // BS)            # a tile's blocks (its boxes a half)

                def tile_entries(kb, volatile=False):
                    return [pool.load((kb >> pool.lg) + i, clamp=True, volatile=volatile)
                            for i in range(NE)]
                # (volatile: issued here, beside L and T, not after the exit);
                # with a window the walk starts at a tile known only from L:
                # its entries are read at the prologue's issues
                if plan.window:
                    first = None
                    ahead_ents = [k.var(u32, 0) for _ in range(NE)]
                else:
                    first = [tile_entries(k.mov(s_ * BN, u32), True) for s_ in range(lead)]
                    ahead_ents = [k.var(u32, e)
                                  for e in tile_entries(k.mov(lead * BN, u32), True)]
        RG = NW // H                             # 16-row groups of a block
        if RG == 1:
            # one group a block, the longest first
            gw = k.nctaid.x - 1 - k.ctaid.x      # the warp's group
            with k.if_(16 * gw >= Tn):
                k.exit()
            gmax = gw                            # the block's last live group
            wlive = None
        else:
            # groups paired from both ends: block x takes pairs p = x RG/2 ..
            # + RG/2, each the groups p and NG - 1 - p (NG = ceil(T / 16); the
            # middle group of an odd NG once), so every block walks about the
            # same number of keys
            Hh = RG // 2
            NG = (Tn + 15) >> 4
            p0 = k.ctaid.x * Hh
            with k.if_(2 * p0 >= NG):
                k.exit()
            gmax = k.select(2 * p0 + 1 < NG, NG - 1 - p0, p0)
            j = warp // H
            pw = p0 + (j % Hh) if Hh > 1 else p0
            back = j >= Hh
            gw = k.select(back, NG - 1 - pw, pw)
            # a front group lives while 2 p + 1 <= NG, a back one while 2 p + 1 < NG
            wlive = 2 * pw + 1 < NG + k.select(back, k.mov(0, u32), k.mov(1, u32))
        nkeys = k.min(L + 16 * gmax + 16, L + Tn)    # keys the block's rows see
        lastk = nkeys - 1
        ntiles = (nkeys + (BN - 1)) // BN
        W = plan.window
        if W:
            # the tile of the block's first row's first key (the first
            # group: gw of a one-group block, the front pair's p0)
            g0 = gw if RG == 1 else p0
            t0 = k.max(L + 16 * g0, W - 1) - (W - 1)
            t0 = t0 // BN
        else:
            t0 = None
        wrow = 16 * gw                           # the warp's first row
        wpos_first = L + wrow                    # its first row's position
        wpos_last = wpos_first + 15              # its last row's position
        rows = [wrow + g, wrow + g + 8]

        def sees(key):
            """Whether the warp's rows see the tile at ``key`` (and it has rows
            at all): its first key is at most the last row's position and,
            with a window, its last reaches the first row's window."""
            seen = key <= wpos_last
            if W:
                seen = k.pand(seen, key + (BN + W - 1) > wpos_first)
            return seen if wlive is None else k.pand(seen, wlive)

        def unmasked(kb):
            """Whether every row of the warp sees every key of the tile at ``kb``."""
            whole = kb + (BN - 1) <= wpos_first
            return whole if not W else k.pand(whole, kb + (W - 1) >= wpos_last)
        pos = [(L + r).bitcast(s32) for r in rows]

        m_run = [k.var(f32, NEG), k.var(f32, NEG)]
        l_run = [k.var(f32, 0.0), k.var(f32, 0.0)]
        o_acc = [[k.var(f32, 0.0) for _ in range(4)] for _ in range(DT)]
        zero = k.mov(0.0, f32)
        ninf = k.mov(float("-inf"), f32)
        base = k.mov(smem, u32)
        mi, rr = lane >> 3, lane & 7
        # ldmatrix row addresses (bytes, stage 0).  A tile's key row r keeps
        # its 64-dim halves 128 bytes each in two 8 KB blocks (HB), its
        # 16-byte chunk c of a half at chunk c ^ (r % 8) (the 128B swizzle a
        # TMA box writes); the 8 rows one ldmatrix matrix reads have r % 8 =
        # rr, so a lane's swizzle is its own constant.  K (B of S, not
        # transposed): matrix mi is keys 16p + 8 (mi >> 1) + rr, dims 16 kt +
        # 8 (mi & 1) (chunk 2 (kt % 4) + (mi & 1) of half kt // 4); V (B of
        # O, transposed): keys 16p + 8 (mi & 1) + rr, dims 8 (n + (mi >> 1))
        # (chunk n % 8 + (mi >> 1) of half n // 8).  Per chunk pair j (0..3):
        if wg:
            # descriptor bits above the start address (smem_layout): 128B
            # swizzle, 8-key groups 1024 bytes apart (SBO); K's LBO unused
            # (K-major, a k-step inside the 128-byte row), V's the 64-dim halves
            k_hi = (16 >> 4) << 16 | (1024 >> 4) << 32 | 1 << 62
            v_hi = (HB >> 4) << 16 | (1024 >> 4) << 32 | 1 << 62
            s_acc = k.wgmma_acc(BN)

            def desc_of(stage):
                """The K and V descriptors of the tile in ``stage``."""
                kd = k.cvt(T.u64, (base + stage * SB) >> 4)
                return kd | k_hi, (kd + (VOFF >> 4)) | v_hi
        else:
            k_rows = base + (8 * (mi >> 1) + rr) * 128
            v_rows = base + (VOFF + (8 * (mi & 1) + rr) * 128)
            k_addr = [k_rows + (((mi & 1) + 2 * j) ^ rr) * 16 for j in range(4)]
            v_addr = [v_rows + (((mi >> 1) + 2 * j) ^ rr) * 16 for j in range(4)]

        # the thread's 16-byte chunks of a tile by cp.async (every tile
        # before sm_90, a block's last, partial tile on sm_90): (key row,
        # shared byte offset, cache element offset within the row)
        per = max(1, CHUNKS // nthr)
        chunks = []
        for j in range(per):
            cidx = tid + j * nthr
            r_, cc = cidx // (d // 8), cidx % (d // 8)
            guard = (cidx < CHUNKS) if CHUNKS < nthr else None
            dst = (cc >> 3) * HB + r_ * 128 + (((cc & 7) ^ (r_ & 7)) << 4)
            chunks.append((guard, r_, dst, 8 * cc))
        if not BS:
            hrow = h * cap

        def copy_rows(buf, kb):
            # rows past the block's last key are clamped to it, so no
            # unwritten cache row enters
            if BS >= BN:
                # the tile (and its clamped rows) lies in one pool block
                trow = pool.block_row(pool.entry(kb >> pool.lg))
            for guard, r_, dst, col in chunks:
                if not BS:
                    src = (hrow + k.min(kb + r_, lastk)) * d + col
                elif BS >= BN:
                    src = (trow + pool.offset(k.min(kb + r_, lastk))) * d + col
                else:
                    src = pool.row(k.min(kb + r_, lastk)) * d + col
                k.cp_async(Address(buf + dst, 0, "shared", u8), kc[src], 16, guard=guard)
                k.cp_async(Address(buf + dst, VOFF, "shared", u8), vc[src], 16, guard=guard)

        if tma:
            bar0 = base + S * SB                 # one mbarrier a stage after the ring
            with k.if_(tid.eq(0)):
                for s_ in range(S):
                    k.mbarrier_init(Address(bar0 + 8 * s_, 0, "shared", T.u64), 1)
                k.fence_mbarrier_init()
            k.bar_sync(0)

            def issue(buf, stage_idx, kb, ents=None):
                # a whole tile (its last key is the block's or before) by
                # TMA from thread 0, else by cp.async (clamped rows)
                with k.if_else(kb + (BN - 1) <= lastk) as (whole, part):
                    with whole:
                        mb = Address(bar0 + 8 * stage_idx, 0, "shared", T.u64)
                        with k.if_(tid.eq(0)):
                            k.mbarrier_arrive_expect_tx(mb, 2 * VOFF)
                            if BS:
                                _tma_paged(k, plan, pool, buf, kb,
                                           ahead_ents if ents is None else ents,
                                           (kmap, vmap), mb)
                                if ents is None:         # the next tile's blocks
                                    for r_, e in zip(ahead_ents, tile_entries(kb + BN)):
                                        k.assign(r_, e)
                            else:
                                for hf in range(d // 64):
                                    crd = (64 * hf, hrow + kb)
                                    k.tma_load(Address(buf + hf * HB, 0, "shared", u8), kmap,
                                               crd, mb)
                                    k.tma_load(Address(buf + (VOFF + hf * HB), 0, "shared", u8),
                                               vmap, crd, mb)
                    with part:
                        copy_rows(buf, kb)
                        k.cp_async_commit()
        else:
            def issue(buf, stage_idx, kb, ents=None):
                copy_rows(buf, kb)

        if BS and tma and t0 is not None:
            for r_, e in zip(ahead_ents, tile_entries((t0 + lead) * BN)):
                k.assign(r_, e)
        for s_ in range(lead):
            tile = s_ if t0 is None else t0 + s_
            with k.if_(ntiles > tile):
                ents = None
                if BS and tma:
                    ents = first[s_] if t0 is None else tile_entries(tile * BN)
                issue(base + s_ * SB, s_, k.mov(s_ * BN, u32) if t0 is None else tile * BN,
                      ents=ents)
            if not tma:
                k.cp_async_commit()              # an empty group where there is no tile
        # q's A fragments, loaded while the first tiles are in flight (rows g, g + 8; columns 2t, 2t + 1, 2t + 8, 2t + 9
        # of each k-tile), prescaled, in f16
        c = k.mul(sm_scale, LOG2E, rnd="rn")
        qbase = [k.min(r, Tn - 1) * q_stride + qh * d + 2 * t for r in rows]
        qa = []
        for kt in range(KT):
            regs = []
            for half in range(2):                # columns 2t.. then 2t + 8..
                for r in range(2):               # rows g, g + 8
                    x0, x1 = k.ld(q[qbase[r] + 16 * kt + 8 * half], vec=2, nc=True)
                    regs.append(_pack_f16(k, k.mul(x0, c, rnd="rn"), k.mul(x1, c, rnd="rn")))
            qa.append(tuple(regs))

        cb = k.var(u32, 0)                   # this tile's stage
        nb = k.var(u32, lead)                # ... and the one ``lead`` tiles ahead
        if tma:
            phase = k.var(u32, 0)            # parity of the mbarrier phase of cb
        if wg:
            pb = k.var(u32, 0)               # the stage of the tile before
            # P of the tile before (f16 pairs in the A layout), for its P V
            p_prev = [tuple(k.var(b32, 0) for _ in range(4)) for _ in range(NT // 2)]
        with k.for_range(0 if t0 is None else t0, ntiles) as it:
            # cp.async tiles: before sm_90 the ring's groups (one a tile); on
            # sm_90 only a block's last tile, whose group is waited for here
            k.cp_async_wait(0 if tma else S - 2)
            if wg:
                # the cp.async rows of a partial tile before wgmma reads them
                # (the async proxy); only the last tile can be one, issued
                # ``lead`` iterations ahead (a fence on every tile was
                # slower at long L)
                with k.if_(it + lead >= ntiles, uniform=True):
                    k.fence_proxy_async()
            k.bar_sync(0)
            ahead = it + lead
            with k.if_(ahead < ntiles):
                issue(base + nb * SB, nb, ahead * BN)
            if not tma:
                k.cp_async_commit()
            kb = it * BN
            if tma:
                with k.if_(kb + (BN - 1) <= lastk):
                    k.mbarrier_wait(Address(bar0 + 8 * cb, 0, "shared", T.u64), phase)
            live = sees(kb)
            if wg:
                # tile i's S = Q K^T, then tile i - 1's O += P V, which runs
                # while tile i's softmax is computed (the branches are
                # warp-uniform: bra.uni spares ptxas's reconvergence code)
                with k.if_else(live, uniform=True) as (on, off):
                    with on:
                        wgm = _WarpgroupMma(k, plan, desc_of(cb), s_acc, o_acc)
                        wgm.issue_scores(qa)
                        k.wgmma_commit()
                        # tiles are live from 0 on, so the tile before was
                        # too; at tile 0 P is still 0 (V: tile 0's, landed),
                        # as a conditional wgmma here would be serialized
                        _WarpgroupMma(k, plan, desc_of(pb), s_acc, o_acc).issue_pv(p_prev)
                        k.wgmma_commit()
                        k.wgmma_wait(1)                         # S is in; P V may run on
                        s_ = wgm.score_tiles()
                        with k.if_else(unmasked(kb), uniform=True) as (whole, part):
                            for br, ps in ((whole, None), (part, pos)):
                                with br:
                                    _softmax_deferred(k, plan, kb, list(s_), ps, m_run, l_run,
                                                      o_acc, p_prev, ninf)
                    with off:
                        # the tile before was the warpgroup's last: its P V
                        with k.if_(k.pand(it > (0 if t0 is None else t0), sees(kb - BN)),
                                   uniform=True):
                            _WarpgroupMma(k, plan, desc_of(pb), s_acc, o_acc).last_pv(p_prev)
                k.assign(pb, cb)
            else:
                with k.if_(live):
                    cur = cb * SB
                    mma = _SyncMma(k, plan, [a + cur for a in k_addr],
                                   [a + cur for a in v_addr], zero)
                    # a tile whose last key the warp's first row sees needs no mask
                    with k.if_else(unmasked(kb)) as (whole, part):
                        with whole:
                            _tile(k, plan, kb, qa, None, m_run, l_run, o_acc, mma, ninf)
                        with part:
                            _tile(k, plan, kb, qa, pos, m_run, l_run, o_acc, mma, ninf)
            last = cb.eq(S - 1)
            if tma:
                k.assign(phase, k.select(last, phase ^ 1, phase))
            k.assign(cb, k.select(last, k.mov(0, u32), cb + 1))
            k.assign(nb, k.select(nb.eq(S - 1), k.mov(0, u32), nb + 1))
        if wg:
            # the last tile's P V
            with k.if_(k.pand(ntiles > 0, sees((ntiles - 1) * BN)), uniform=True):
                _WarpgroupMma(k, plan, desc_of(pb), s_acc, o_acc).last_pv(p_prev)
        k.cp_async_wait(0)

        for r in range(2):
            lt = l_run[r] + k.shfl_xor(l_run[r], 1)
            lt = lt + k.shfl_xor(lt, 2)
            # rcp.approx (1 ulp), not an IEEE div/rcp: those are subroutine
            # calls, which ptxas takes for extern calls when the driver's
            # linker compiles the PTX as relocatable code (the disk cache's
            # path), and it then serializes every wgmma (C7509; the
            # warpgroup kernel was slower for it, docs/notes/flash_prefill.md)
            inv = k.rcp(lt, approx=True, ftz=True)
            ok = rows[r] < Tn
            row = [[k.mul(o_acc[n][2 * r + e], inv, rnd="rn") for e in range(2)]
                   for n in range(DT)]
            if ot is f16:
                # whole 32-byte sectors: a lane's f16 pairs of n-tiles n and
                # n + 1 (columns 2t.. and 8 + 2t..), swapped with lane t ^ 1
                # (the pair an even lane lacks is its neighbour's of tile n,
                # an odd lane's of tile n + 1), so each lane stores 8 bytes
                # and the row's 4 lanes one sector (two 16-byte halves by two
                # stores were slower at L = 0)
                odd = (t & 1).eq(1)
                stores = []
                for n in range(0, DT, 2):
                    pa, pb = (_pack_f16(k, *row[n + i]) for i in range(2))
                    got = k.shfl_xor(k.select(odd, pa, pb), 1)
                    stores.append((8 * n, (k.select(odd, got, pa), k.select(odd, pb, got))))
                col = 2 * t + k.select(odd, k.mov(6, u32), k.mov(0, u32))
            with k.if_(ok if wlive is None else k.pand(ok, wlive)):
                if ot is f16:
                    obase = (rows[r] * nq + qh) * d + col
                    for c0, pair in stores:
                        k.st(out[obase + c0], pair, b32)
                else:
                    obase = (rows[r] * nq + qh) * d + 2 * t
                    for n in range(DT):
                        k.st(out[obase + 8 * n], tuple(row[n]))


def _tma_paged(k, plan, pool, buf, kb, ents, maps, mb):
    """Thread 0's TMA boxes of the whole tile at key ``kb`` from the pools
    (``ents``: the tile's table entries as read): with blocks of at least a
    tile (``paged >= block_keys``) one box a 64-dim half at the tile's row
    in the block of ``ents[0]``; with smaller blocks ``block_keys / paged``
    boxes of ``paged`` rows a half, box ``i`` from the block of ``ents[i]``
    into the half's rows ``i * paged ..`` (a multiple of 1024 bytes, where
    the 128B swizzle pattern repeats, so the tile reads as one box's)."""
    d, BN, BS = plan.head_dim, plan.block_keys, plan.paged
    HB, VOFF = BN * 128, BN * d * 2
    rows = ([pool.block_row(pool.block(ents[0])) + pool.offset(kb)] if BS >= BN
            else [pool.block_row(pool.block(e)) for e in ents])
    for hf in range(d // 64):
        for i, row in enumerate(rows):
            crd = (64 * hf, row)
            off = hf * HB + i * BS * 128
            k.tma_load(Address(buf + off, 0, "shared", u8), maps[0], crd, mb)
            k.tma_load(Address(buf + (VOFF + off), 0, "shared", u8), maps[1], crd, mb)


class _SyncMma:
    """``mma.sync`` on ``ldmatrix`` fragments: each warp its own 16 rows."""

    def __init__(self, k, plan, k_addr, v_addr, zero):
        self.k, self.HB, self.zero = k, plan.block_keys * 128, zero
        self.k_addr, self.v_addr = k_addr, v_addr
        self.KT, self.NT, self.DT = plan.head_dim // 16, plan.block_keys // 8, plan.head_dim // 8

    def scores(self, qa):
        """S = Q K^T for the tile: NT n-tiles of 4 f32 (the mma C layout)."""
        k, z, HB = self.k, self.zero, self.HB
        s = []
        for p in range(self.NT // 2):                # 16 keys at a time
            acc = [(z, z, z, z), (z, z, z, z)]
            for kt in range(self.KT):
                b = k.ldmatrix(Address(self.k_addr[kt % 4], (kt // 4) * HB + 16 * p * 128,
                                       "shared", T.b16), 4)
                for e in range(2):
                    acc[e] = k.mma_m16n8k16(qa[kt], b[2 * e:2 * e + 2], acc[e])
            s.extend(acc)
        return s

    def accumulate(self, pack, o_acc):
        """O += P V; ``pack(p)``: P's A fragment of keys 16 p .. 16 p + 15."""
        k, HB = self.k, self.HB
        for p in range(self.NT // 2):
            a = pack(p)
            for n in range(0, self.DT, 2):
                b = k.ldmatrix(Address(self.v_addr[(n % 8) // 2], (n // 8) * HB + 16 * p * 128,
                                       "shared", T.b16), 4, trans=True)
                for e in range(2):
                    acc = o_acc[n + e]
                    for r_, x in zip(acc, k.mma_m16n8k16(a, b[2 * e:2 * e + 2], tuple(acc))):
                        k.assign(r_, x)


class _WarpgroupMma:
    """``wgmma.mma_async`` of the warpgroup's 64 rows (4 heads x 16 rows):
    A (q, then P) from registers in the ``mma.sync`` A layout, B from the
    stage through matrix descriptors (128B swizzle, 8-row groups 1024 bytes
    apart).  K is B K-major (a key's dims contiguous): k-step ``kt`` starts
    ``kt % 4`` 32-byte steps into half ``kt // 4``.  V is B MN-major (dims
    contiguous): k-step ``p`` (keys 16 p ..) starts ``2048 p`` bytes in, the
    second 64 dims ``HB`` further (LBO).  The accumulators' layout is
    ``mma.sync``'s C, n-tile ``j`` in registers ``4 j .. 4 j + 3``.  The
    caller commits and waits (the walk overlaps one tile's P V with the
    next one's scores and softmax)."""

    def __init__(self, k, plan, descs, s_acc, o_acc):
        self.k, (self.kdesc, self.vdesc), self.s_acc = k, descs, s_acc
        self.o_flat = tuple(r for acc in o_acc for r in acc)
        self.HB16 = plan.block_keys * 128 >> 4
        self.KT, self.NT = plan.head_dim // 16, plan.block_keys // 8

    def issue_scores(self, qa):
        """S = Q K^T into the score accumulators (not committed)."""
        k = self.k
        k.wgmma_fence()
        for kt in range(self.KT):
            step = (kt // 4) * self.HB16 + 2 * (kt % 4)
            d = self.kdesc + step if step else self.kdesc
            k.wgmma(self.s_acc, qa[kt], d.bitcast(b64), scale_d=kt > 0)

    def score_tiles(self):
        """The scores as ``mma.sync`` C n-tiles (after the wait)."""
        return [tuple(self.s_acc[4 * j:4 * j + 4]) for j in range(self.NT)]

    def issue_pv(self, pa):
        """O += P V, ``pa[p]``: P's A fragment of keys 16 p .. 16 p + 15 (not
        committed)."""
        k = self.k
        k.wgmma_fence()
        for p, a in enumerate(pa):
            d = self.vdesc + 128 * p if p else self.vdesc
            k.wgmma(self.o_flat, a, d.bitcast(b64), trans_b=True)

    def last_pv(self, pa):
        """O += P V for a warpgroup's last tile, committed and waited for."""
        self.issue_pv(pa)
        self.k.wgmma_commit()
        self.k.wgmma_wait(0)


def _tile(k, plan, kb, qa, pos, m_run, l_run, o_acc, mma, ninf):
    """One key tile of one warp: scores, mask (where ``pos`` is given: the
    rows' positions), online softmax, ``O += P V`` (``mma``: a
    :class:`_SyncMma`)."""
    t = (k.tid.x & 31) & 3
    s = _softmax(k, plan, kb, t, mma.scores(qa), pos, m_run, l_run, o_acc, ninf)
    mma.accumulate(lambda p: _p_fragment(k, s, p), o_acc)


def _p_fragment(k, s, p):
    """P's A fragment of keys 16 p .. 16 p + 15 in f16, from the n-tiles
    ``s`` (probabilities in the C layout)."""
    return (_pack_f16(k, s[2 * p][0], s[2 * p][1]), _pack_f16(k, s[2 * p][2], s[2 * p][3]),
            _pack_f16(k, s[2 * p + 1][0], s[2 * p + 1][1]),
            _pack_f16(k, s[2 * p + 1][2], s[2 * p + 1][3]))


def _softmax_deferred(k, plan, kb, s, pos, m_run, l_run, o_acc, p_prev, ninf):
    """The wgmma walk's softmax of one tile while the tile before's ``P V``
    may still run: P (into ``p_prev``, for the next iteration's ``P V``)
    and its sums first, then the wait, then O's rescale."""
    t = (k.tid.x & 31) & 3
    s = _softmax(k, plan, kb, t, s, pos, m_run, l_run, o_acc, ninf, wait=lambda: k.wgmma_wait(0))
    for p, regs in enumerate(p_prev):
        for r_, v in zip(regs, _p_fragment(k, s, p)):
            k.assign(r_, v)


def _softmax(k, plan, kb, t, s, pos, m_run, l_run, o_acc, ninf, wait=None):
    """Mask the tile's scores ``s`` (where ``pos`` is given; ``t``: the
    lane's column pair in an n-tile), move the rows'
    running max, rescale ``l`` and ``O``, add the tile's sums; returns
    ``s`` with the probabilities in place of the scores.  With ``wait``
    (the wgmma walk, O still being written) the probabilities and their
    sums come first, then ``wait()``, then the rescale."""
    NT, W = plan.block_keys // 8, plan.window
    # key kb + 8 j + 2 t + e is seen by row r when 8 j + e <= pos_r - kb - 2 t
    # (pos None: every key of the tile is seen by every row); with a window
    # also when pos_r - kb - 2 t - (8 j + e) < W, so the difference, as
    # unsigned, is below W
    lim = None if pos is None else [(pr - (kb + 2 * t).bitcast(s32)) for pr in pos]
    vals, m_new = [], []
    for r in range(2):
        v = []
        for j in range(NT):
            for e in range(2):
                x = s[j][2 * r + e]
                if lim is not None:
                    ok = (lim[r] >= 8 * j + e if not W
                          else (lim[r] - (8 * j + e)).bitcast(u32) < W)
                    x = k.select(ok, x, ninf)
                v.append(x)
        mx = v[0]
        for x in v[1:]:
            mx = k.max(mx, x)
        mx = k.max(mx, k.shfl_xor(mx, 1))
        mx = k.max(mx, k.shfl_xor(mx, 2))
        vals.append(v)
        # the max a row's probabilities are taken against moves only when
        # the tile's passes it by more than RESCALE_SLACK (softmax does not
        # depend on that choice; ex2 stays at most 2^RESCALE_SLACK)
        m_new.append(k.select(mx > m_run[r] + RESCALE_SLACK, mx, m_run[r]))
    # rescale O and l by 2^(m_run - m_new) only when some row's max moved
    # (else the factor is exactly 1): past a row's first tile few do
    grow = k.por(m_new[0] > m_run[0], m_new[1] > m_run[1])

    def rescale():
        # (the vote makes the branch warp-uniform; said so, bra.uni, on the
        # wgmma walk)
        with k.if_(k.vote_sync("any", grow), uniform=wait is not None):
            for r in range(2):
                alpha = k.ex2(m_run[r] - m_new[r], ftz=True)
                k.assign(l_run[r], k.mul(l_run[r], alpha, rnd="rn"))
                for acc in o_acc:
                    for e in range(2):
                        k.assign(acc[2 * r + e], k.mul(acc[2 * r + e], alpha, rnd="rn"))

    def probabilities(r):
        pr = [k.ex2(x - m_new[r], ftz=True) for x in vals[r]]
        psum = pr[0]
        for x in pr[1:]:
            psum = psum + x
        for j in range(NT):
            s[j] = tuple(s[j][:2 * r]) + (pr[2 * j], pr[2 * j + 1]) + tuple(s[j][2 * r + 2:])
        return psum

    if wait is None:
        rescale()
        for r in range(2):
            k.assign(m_run[r], m_new[r])
            k.assign(l_run[r], l_run[r] + probabilities(r))
        return s
    sums = [probabilities(r) for r in range(2)]
    wait()
    rescale()
    for r in range(2):
        k.assign(m_run[r], m_new[r])
        k.assign(l_run[r], l_run[r] + sums[r])
    return s
