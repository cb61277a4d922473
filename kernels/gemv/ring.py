"""Quantized GEMV streamed through a ring of shared-memory stages with ``cp.async``.

``GemvConfig(stages=S)`` (S >= 2), Q4_K, and the other formats when one tile
covers the row and rows are 16-byte aligned.  The direct Q4_K kernel (:mod:`.q4k`) loads
weights into registers, so how many bytes are in flight is decided by the
JIT's register allocation (it interleaves the loads with the math to stay
under its register budget).  Here the CTA's weight bytes travel by
``cp.async`` (16 bytes a copy, no register holds them) into a ring of S
stages in dynamic shared memory, one row group (``rows`` rows of every
matrix) per stage, so S - 1 groups are in flight while one is computed.

A CTA's row groups are consecutive, or with ``interleave`` dealt round robin
(CTA ``c`` of ``n`` takes groups ``c, c + n, ...``); either way a row group is one contiguous run of
``rows * row_bytes`` bytes per matrix: thread ``t`` copies 16-byte chunks
``t, t + T, ...`` of it (coalesced, every byte fetched once, the super-block
headers too).  Each thread then reads its piece's 16 qs bytes and its
super-block's header from the stage (``ld.shared.v4``; the 8 lanes of a
super-block read the same header, a broadcast; a quarter warp's qs reads
cover 128 contiguous bytes, no bank conflicts) and computes exactly as the
direct kernel does, x in registers.  The other formats' threads decode their
piece of each row (``pieces`` of them, ``tid + i * threads``) from the stage
exactly as the staged kernel (:mod:`.staged`) decodes it from its tile,
with their x values loaded once (the tile is the whole row) and, with
``dot="dp4a"``, split into byte planes once (:data:`.staged.PLANES`).

Per row group ``g`` (iteration of the CTA's loop)::

    cp.async.wait_group S-2     this thread's copies of group g have landed
    bar.sync                    everyone's have; everyone is done with g-1
    copy group g+S-1 into g-1's stage; cp.async.commit_group
    compute group g from its stage; reduce (bar.sync) and store

With ``bulk`` (sm_90) thread 0 fills a stage with the bulk copy engine
instead: one ``cp.async.bulk`` per matrix of the group's contiguous rows
below M, completing on the stage's mbarrier (``full[s]``, one arrival plus
the bytes).  Per row group ``g``::

    bar.sync                    everyone is done with g-1's stage
    thread 0: copy group g+S-1 into g-1's stage (arrive.expect_tx, cp.async.bulk)
    mbarrier wait on full[g % S], parity (g / S) & 1
    compute group g from its stage; reduce (bar.sync) and store

The barrier at the top of the next iteration also protects the reduction
array, so :func:`write_outputs` skips its trailing barrier.  Groups past the
CTA's rows commit empty groups, so the count the wait relies on never
changes.  Copies are clamped to the matrix's last 16 bytes: rows past M are
read as garbage and never stored.
"""

from __future__ import annotations

import math

import ptxgen
from ptxgen.types import f32, u8, u32, u64
from ptxgen.values import Address

from ..spec_fields import pdl_prologue, pdl_wait
from .common import declare_params, write_outputs
from .layout import q4k_layout, staged_layout
from .q4k import (norm_sum, piece_dot, piece_nw, piece_offsets, piece_planes, piece_x,
                  store_normed)
from .staged import FORMATS, PLANES

__all__ = ["build_ring", "copy_rows"]


class _RowView:
    """``view[i]`` -> shared address ``base + i`` (``base`` a u32 register;
    :mod:`.staged`'s view adds a constant to a symbol instead)."""

    def __init__(self, base):
        self.base = base

    def __getitem__(self, i):
        return Address(self.base + i, 0, "shared", u8)


def copy_rows(k, dst, ws, src, last, chunks, thr, tid, mat_bytes):
    """Copy ``chunks`` 16-byte chunks of every matrix in ``ws`` into shared
    memory with ``cp.async``: thread ``tid`` of ``thr`` copies chunks ``tid,
    tid + thr, ...`` from byte ``src`` of its matrix (its first chunk's u64
    offset; reads clamped to ``last``, the matrix's last chunk) to ``dst``
    (its first chunk's shared address); matrix ``mi`` lands ``mi *
    mat_bytes`` further on.  No commit."""
    for j in range(math.ceil(chunks / thr)):
        off = k.min(src + 16 * thr * j if j else src, last)
        guard = (tid < chunks - thr * j) if (j + 1) * thr > chunks else None
        for mi, w in enumerate(ws):
            k.cp_async(dst + (mi * mat_bytes + 16 * thr * j), k.ptr_add(w, off)[0], 16,
                       guard=guard)


def build_ring(spec, params=declare_params, finish=None) -> ptxgen.Module:
    """The ring kernel of the plan ``spec``; ``params`` declares the
    parameters (:func:`.common.declare_params`'s signature and result);
    ``finish`` ends the kernel (:func:`ptxgen.kernels.gemv.build`)."""
    q4k = spec.qtype == "Q4_K"
    if q4k:
        ppt, thr, total = q4k_layout(spec)
    else:
        lay = staged_layout(spec)
        thr = lay["threads"]
        piece_fn, dot_fn = FORMATS[spec.qtype]
    nm, R, rb, S = spec.n_mats, spec.rows, spec.row_bytes, spec.stages
    warps = thr // 32
    group_bytes = R * rb                    # one matrix's share of a stage
    chunks = group_bytes // 16              # rb is a multiple of 144 = 9 * 16
    stage_bytes = nm * group_bytes
    m = ptxgen.Module(spec.target)
    kdir = dict(reqntid=thr)
    if spec.min_ctas:
        kdir["minnctapersm"] = spec.min_ctas
    with m.kernel(spec.kernel_name, **kdir) as k:
        ws, x, r, y, mrows, rpc, red, norm = params(k, spec, warps)
        # weights are read-only: the prologue's copies may go out before the
        # PDL wait; x, r and y are read after it
        pdl_prologue(k, spec, wait=False)
        # on a line after the static reduction array (the builder's default
        # alignment, target.SHARED_LINE)
        ring = k.dynamic_shared("ring", u8)
        tid = k.tid.x
        pcs = [piece_offsets(k, tid, i, thr, total) for i in range(ppt)] if q4k else []
        if spec.interleave:
            # groups c, c + n, ...: consecutive groups of a CTA are ``gstep`` rows apart
            row0 = k.ctaid.x * R
            row_end = mrows
            gstep = k.nctaid.x * R
        else:
            row0 = k.ctaid.x * rpc
            row_end = k.min(mrows, row0 + rpc)
            gstep = R
        if not spec.bulk:
            # the last 16-byte chunk of each matrix: copies past it are clamped
            last_chunk = k.mul_wide(mrows, rb) - 16
            my_chunk = k.mul_wide(tid, 16)          # u64 byte offset of chunk t
            dst_off = tid * 16
        else:
            # one mbarrier per stage, completed by the bytes of its bulk copies
            full = k.shared_array("full", u64, S)
            with k.if_(tid.eq(0)):
                for s_ in range(S):
                    k.mbarrier_init(full[s_], 1)
                k.fence_mbarrier_init()

        def issue(rg, slot, stage=None):
            """Copy the row group starting at row ``rg`` (every matrix) into the
            stage at byte ``slot`` of the ring (``stage``: its index), then
            commit (an empty group past the CTA's rows).  With ``bulk``:
            thread 0 copies the group's rows below M, one bulk copy per
            matrix, onto the stage's mbarrier; nothing past the CTA's rows."""
            if spec.bulk:
                with k.if_(k.setp("lt", rg, row_end, combine=("and", tid.eq(0)))):
                    nbytes = k.min(mrows - rg, R) * rb
                    bar = full[stage]
                    k.mbarrier_arrive_expect_tx(bar, nbytes * nm if nm > 1 else nbytes)
                    off = k.mul_wide(rg, rb)
                    for mi, w in enumerate(ws):
                        k.cp_async_bulk(ring[slot + mi * group_bytes] if mi else ring[slot],
                                        k.ptr_add(w, off)[0], nbytes, bar)
                return
            with k.if_(rg < row_end):
                src = k.mul_wide(rg, rb) + my_chunk
                copy_rows(k, ring[slot + dst_off], ws, src, last_chunk, chunks, thr, tid,
                          group_bytes)
            k.cp_async_commit()

        def first_row(s_):
            """The first row of the CTA's ``s_``-th row group."""
            if not spec.interleave:
                return row0 + s_ * R
            return row0 + s_ * gstep if s_ else row0

        # prologue: the first S - 1 groups in flight, ``ahead`` of them (all
        # by default) before anything else, the others once x is loaded
        pre = spec.ahead or S - 1
        for s_ in range(pre):
            issue(first_row(s_), k.mov(s_ * stage_bytes, u32), s_)
        if norm:
            # the fused RMSNorm's weights are constants too
            for pc in pcs:
                piece_nw(k, norm[0], pc)
        pdl_wait(k, spec)
        for pc in pcs:
            piece_x(k, x, pc, norm[0] if norm else None)
            if spec.dot == "dp4a":
                piece_planes(k, pc)
            # the piece's header and qs offsets inside one row of a stage
            pc["h32"] = pc["sb"] * 144
            pc["q32"] = pc["h32"] + (pc["c"] << 4) + 16
        # fused RMSNorm: the pieces hold x * nw; the CTA's 1/sqrt(mean + eps)
        # is computed once here, and write_outputs scales every row by it
        nsum = norm_sum(k, spec, pcs, norm, red, warps, tid)
        store_normed(k, spec, pcs, norm, nsum)
        if not q4k:
            # piece p = tid + i * thr of the row, for each of the thread's ppt
            spcs = []
            for i in range(lay["ppt"]):
                p = tid + i * thr if i else tid
                active = p < lay["pieces"]
                spc = piece_fn(k, None, x, 0, k.min(p, lay["pieces"] - 1), lay)
                if spec.dot == "dp4a":
                    PLANES[spec.qtype](k, spc)
                spcs.append((active, spc))
            ring_base = k.mov(ring)
        for s_ in range(pre, S - 1):
            issue(first_row(s_), k.mov(s_ * stage_bytes, u32), s_)
        rd = k.var(u32, 0)                         # byte offset of group g's stage
        if spec.bulk:
            si = k.var(u32, 0)                     # its index
            parity = k.var(u32, 0)                 # the phase group g completes
        ring_bytes = S * stage_bytes
        with k.for_range(row0, row_end, gstep) as rg:
            if spec.bulk:
                # everyone is done with group g - 1's stage (and with red)
                k.bar_sync(0)
                wi = k.select(si.eq(0), k.mov(S - 1, u32), si - 1)
            else:
                k.cp_async_wait(S - 2)
                k.bar_sync(0)
            # group g + S - 1 goes to the stage group g - 1 used
            wr = k.select(rd.eq(0), k.mov(ring_bytes - stage_bytes, u32), rd - stage_bytes)
            if spec.bulk:
                issue(rg + (S - 1) * gstep, wr, wi)
                k.mbarrier_wait(full[si], parity)
            else:
                issue(rg + (S - 1) * gstep, wr)
            acc = [[None] * R for _ in range(nm)]
            if not q4k:
                base = ring_base + rd
                zero = k.mov(0.0, f32)
                for i in range(R):
                    for mi in range(nm):
                        row = _RowView(base + (mi * group_bytes + i * rb))
                        for active, spc in spcs:
                            d = k.select(active, dot_fn(k, spec, row, spc), zero)
                            acc[mi][i] = d if acc[mi][i] is None else acc[mi][i] + d
            for pc in pcs:
                hb = ring[rd + pc["h32"]]
                qb = ring[rd + pc["q32"]]
                for i in range(R):
                    for mi in range(nm):
                        o = mi * group_bytes + i * rb
                        hdr = k.ld(hb + o, u32, vec=4)
                        qs = k.ld(qb + o, u32, vec=4)
                        d = piece_dot(k, hdr, qs, pc)
                        acc[mi][i] = d if acc[mi][i] is None else acc[mi][i] + d
            write_outputs(k, spec, acc, red, warps, rg, row_end, y, r, tid, norm=nsum,
                          trailing_barrier=False)
            nxt = rd + stage_bytes
            k.assign(rd, k.select(nxt.eq(ring_bytes), k.mov(0, u32), nxt))
            if spec.bulk:
                wrap = si.eq(S - 1)
                k.assign(parity, k.select(wrap, parity ^ 1, parity))
                k.assign(si, k.select(wrap, k.mov(0, u32), si + 1))
        if finish is not None:
            finish(k, (row0, row_end, gstep), tid)
    return m
