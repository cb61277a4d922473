"""The batched GEMV: ``y[b] = W x[b]`` for the ``B`` rows of x of a decode
step, each weight read from device memory once and decoded once for all of
them (``GemvSpec(batch=B)``, Q4_K, Q6_K and Q8_0).

At small B a decode step's weight pass is bound by the bytes of W, as at
one row; the tensor-core GEMM's tiles are sized for prompts and dequantize
every weight once per tile of rows.  Here the weights stream through a
``cp.async`` ring of row-group stages exactly as in :mod:`.ring` (one CTA
takes ``rpc`` rows, ``rows`` at a time; S - 1 groups in flight), and every
thread owns ``pieces`` runs of K (:data:`.layout.BATCH_PIECES`) for the
whole kernel.

x lives in shared memory after the ring: before the loop each thread loads
its pieces of every row of x, splits them into the three byte planes of
:func:`.common.x_planes` (with the piece's scale and, for Q4_K, its halves'
sums) and stores them in its own slots: the plane words four at a time
(16-byte accesses, a warp's 512 contiguous bytes), then the f32 extras one
word a bank.  Per row group a thread decodes its pieces of each row once
(:mod:`.batched_pieces`), then for each row of x reads that row's words
once and adds ``dp4a`` plane sums into ``rows x B`` accumulators.

Rows of x past the count at ``n_ptr`` (a device int32, so one captured
launch serves any number of rows up to B) are read as zeros and never
stored.  The partials are reduced over the CTA as in
:func:`.common.write_outputs`: every warp sums its lanes, lane 0 writes
``red[warp][mat][b][row]``, and after a barrier thread ``j < B rows``
adds the warps' values of output ``(b, row) = (j / rows, j % rows)``,
applies the epilogue and stores ``y[b ys + row]``.

Parameters, in order::

    w      u8*   weights (gate weights for swiglu)
    wu     u8*   up weights                       (swiglu only)
    x      f32*  activations [B, K]
    r      f32*  residual [B, ys]                 (residual; y may be r)
    bias   f32*  bias [M]                         (bias)
    y      f32*  output [B, ys]
    m      u32   rows of W
    rpc    u32   rows per CTA (:func:`.layout.launch_geometry`)
    n_ptr  s32*  rows of x in use (at most B)
    ys     u32   elements from one row of y (and r) to the next
"""

from __future__ import annotations

from contextlib import nullcontext

import ptxgen
from ptxgen.types import f32, s32, u8, u32

from ..spec_fields import pdl_prologue, pdl_wait
from .batched_pieces import BATCH_FORMATS
from .common import silu_times, warp_sum
from .layout import batch_layout
from .ring import copy_rows

__all__ = ["build_batched"]


def _params(k, spec):
    ws = [k.param_ptr("w", u8, align=16)]
    if spec.n_mats == 2:
        ws.append(k.param_ptr("wu", u8, align=16))
    x = k.param_ptr("x", f32, align=16)
    r = None
    if spec.epilogue == "residual":
        r = k.param_ptr("r", f32)
    elif spec.epilogue == "bias":
        r = k.param_ptr("bias", f32)
    y = k.param_ptr("y", f32)
    mrows = k.param("m", u32)
    rpc = k.param("rpc", u32)
    n_ptr = k.param_ptr("n_ptr", s32)
    ys = k.param("ys", u32)
    return ws, x, r, y, mrows, rpc, n_ptr, ys


def _copy_slice(k, dst, ws, rg, srb, rb, off0, rows, last, thr, tid, mat_bytes):
    """Copy ``rows`` rows' slices of ``srb`` bytes (from byte ``off0`` of
    each row of ``rb`` bytes, rows from ``rg``) of every matrix in ``ws`` into
    shared memory with ``cp.async``, one after the other from ``dst`` (this
    thread's first chunk's address, ``16 tid`` in); thread ``tid`` of
    ``thr`` copies chunks ``tid, tid + thr, ...``.  Reads clamped to ``last``
    (a matrix's last chunk).  No commit."""
    cpr = srb // 16
    chunks = rows * cpr
    for j in range(-(-chunks // thr)):
        c = tid + thr * j if j else tid
        row = c // cpr if rows > 1 else None
        inrow = c - row * cpr if rows > 1 else c
        src = k.mul_wide(rg + row, rb) if rows > 1 else k.mul_wide(rg, rb)
        src = k.min(src + k.mul_wide(inrow, 16) + off0, last)
        guard = (c < chunks) if (j + 1) * thr > chunks else None
        for mi, w in enumerate(ws):
            k.cp_async(dst + (mi * mat_bytes + 16 * thr * j), k.ptr_add(w, src)[0], 16,
                       guard=guard)


def build_batched(spec) -> ptxgen.Module:
    """The batched GEMV kernel of the plan ``spec`` (``spec.batch >= 2``)."""
    lay = batch_layout(spec)
    offsets_fn, x_fn, decode_fn, dot_fn, names = BATCH_FORMATS[spec.qtype]
    B, nm, R, rb, S = spec.batch, spec.n_mats, spec.rows, spec.row_bytes, spec.stages
    n_sl = spec.kslices
    srb = rb // n_sl                        # bytes of one row's K slice
    thr, ppt, ps, tt = lay["threads"], lay["ppt"], lay["pieces"], lay["team"]
    nt = spec.teams
    Rt = R // nt                            # rows of a group a team takes
    warps = thr // 32
    group_bytes = R * srb
    stage_bytes = nm * group_bytes
    ring_bytes = S * stage_bytes
    slots = spec.batch_slots
    m = ptxgen.Module(spec.target)
    kdir = dict(reqntid=thr)
    if spec.min_ctas:
        kdir["minnctapersm"] = spec.min_ctas
    with m.kernel(spec.kernel_name, **kdir) as k:
        ws, x, r, y, mrows, rpc, n_ptr, ys = _params(k, spec)
        red = k.shared_array("red", f32, warps * slots, align=16)
        pdl_prologue(k, spec, wait=False)
        ring = k.dynamic_shared("ring", u8)
        tid = k.tid.x
        if spec.interleave:
            row0 = k.ctaid.x * R
            row_end = mrows
            gstep = k.nctaid.x * R
        else:
            row0 = k.ctaid.x * rpc
            row_end = k.min(mrows, row0 + rpc)
            gstep = R
        # team ``team`` of threads tp = 0 .. tt - 1 takes rows team Rt .. of a group
        team = tid // tt if nt > 1 else None
        tp = tid - team * tt if nt > 1 else tid
        team_off = team * (Rt * srb) if nt > 1 else 0
        last_chunk = k.mul_wide(mrows, rb) - 16
        my_chunk = k.mul_wide(tid, 16)
        dst_off = tid * 16

        def issue(rg, slot, sl):
            """Copy slice ``sl`` of the row group at ``rg`` into the stage at
            byte ``slot``; commit (an empty group past the CTA's rows)."""
            with k.if_(rg < row_end):
                if n_sl == 1:
                    src = k.mul_wide(rg, rb) + my_chunk
                    copy_rows(k, ring[slot + dst_off], ws, src, last_chunk, group_bytes // 16,
                              thr, tid, group_bytes)
                else:
                    off0 = k.mul_wide(sl, srb) if not isinstance(sl, int) else sl * srb
                    _copy_slice(k, ring[slot + dst_off], ws, rg, srb, rb, off0, R,
                                last_chunk, thr, tid, group_bytes)
            k.cp_async_commit()

        def first_row(s_):
            if not spec.interleave:
                return row0 + s_ * R
            return row0 + s_ * gstep if s_ else row0

        # this thread's x slots (piece i, row b): plane words 4g .. 4g + 3 at
        # xplanes + 16 T ((i B + b) P4 + g), extra e at xextras + 4 T ((i B + b) E + e)
        P4, E = lay["planes"] // 4, lay["extras"]
        xplanes = ring[tp * 16 + ring_bytes]
        xextras = ring[tp * 4 + (ring_bytes + 16 * tt * ppt * B * P4)]

        def plane_at(i, b, g):
            return xplanes + 16 * tt * ((i * B + b) * P4 + g)

        def extra_at(i, b, e):
            return xextras + 4 * tt * ((i * B + b) * E + e)

        rd = k.var(u32, 0)
        # the weights are constants: slice 0's first groups go out before the PDL wait
        for s_ in range(S - 1):
            issue(first_row(s_), k.mov(s_ * stage_bytes, u32), 0)
        pdl_wait(k, spec)
        n_rows = k.ld(n_ptr[0])
        # K slices one after the other (a loop of the CTA, uniform)
        with k.for_range(0, n_sl) if n_sl > 1 else nullcontext(0) as sl:
            if n_sl > 1:
                with k.if_(sl > 0):
                    # everyone is done with the last slice's stages (and x slots)
                    k.bar_sync(0)
                    k.assign(rd, k.mov(0, u32))
                    for s_ in range(S - 1):
                        issue(first_row(s_), k.mov(s_ * stage_bytes, u32), sl)
            # the slice's pieces: p = tp + i T of its ps, their offsets in the slice's bytes
            pcs = []
            for i in range(ppt):
                p = tp + sl * ps + i * tt if n_sl > 1 else (tp + i * tt if i else tp)
                pc = offsets_fn(k, p, (sl + 1) * ps if n_sl > 1 else ps)
                if n_sl > 1:
                    slice_off = sl * srb
                    pc.update({nme: pc[nme] - slice_off for nme in names})
                pcs.append(pc)
            # x row b is split by team b % teams (the loop's first barrier
            # comes before any team reads it)
            for i, pc in enumerate(pcs):
                for b in range(B):
                    with k.if_(team.eq(b % nt)) if nt > 1 else nullcontext():
                        ok = k.setp("gt", n_rows, b, combine=("and", pc["valid"]))
                        planes, extras = x_fn(k, x, dict(pc, valid=ok,
                                                         xo=pc["xo"] + b * spec.k))
                        for g in range(P4):
                            k.st(plane_at(i, b, g), tuple(planes[4 * g:4 * g + 4]), u32)
                        for e, v in enumerate(extras):
                            k.st(extra_at(i, b, e), v, f32)
            with k.for_range(row0, row_end, gstep) as rg:
                k.cp_async_wait(S - 2)
                k.bar_sync(0)
                wr = k.select(rd.eq(0), k.mov(ring_bytes - stage_bytes, u32), rd - stage_bytes)
                issue(rg + (S - 1) * gstep, wr, sl)
                acc = [[[None] * Rt for _ in range(B)] for _ in range(nm)]
                for i, pc in enumerate(pcs):
                    fields = {nme: ring[rd + pc[nme] + team_off if nt > 1 else rd + pc[nme]]
                              for nme in names}
                    decs = [[decode_fn(k, lambda nme, extra=0, o=mi * group_bytes + j * srb:
                                       fields[nme] + (o + extra), pc)
                             for j in range(Rt)] for mi in range(nm)]
                    for b in range(B):
                        words = [w for g in range(P4)
                                 for w in k.ld(plane_at(i, b, g), u32, vec=4)]
                        extras = [k.ld(extra_at(i, b, e), f32) for e in range(E)]
                        for mi in range(nm):
                            for j in range(Rt):
                                a = acc[mi][b][j]
                                acc[mi][b][j] = dot_fn(k, decs[mi][j], words, extras,
                                                       k.mov(0.0, f32) if a is None else a)
                _store(k, spec, acc, red, slots, warps, tid, rg, row_end, n_rows, y, r, ys,
                       add_y=sl > 0 if n_sl > 1 else None)
                nxt = rd + stage_bytes
                k.assign(rd, k.select(nxt.eq(ring_bytes), k.mov(0, u32), nxt))
    return m


def _store(k, spec, acc, red, slots, warps, tid, rg, row_end, n_rows, y, r, ys, add_y=None):
    """Reduce ``acc[mat][b][row]`` (a team's rows) over each team's warps
    and store the outputs of the group at row ``rg`` (no trailing barrier:
    the ring loop's next barrier comes before ``red`` is written again);
    ``add_y`` (a predicate, with K slices): a later slice's sums, added to
    what the slices before stored (the same thread stored them) instead of
    the epilogue's term."""
    B, nm, R, nt = spec.batch, spec.n_mats, spec.rows, spec.teams
    Rt = R // nt
    thr = warps * 32
    wpt = warps // nt                       # warps of a team
    sums = [[[warp_sum(k, acc[mi][b][j]) for j in range(Rt)] for b in range(B)]
            for mi in range(nm)]
    with k.if_((tid & 31).eq(0)):
        base = (tid >> 5) * slots
        for mi in range(nm):
            for b in range(B):
                for j in range(Rt):
                    k.st(red[base + ((mi * B + b) * Rt + j)], sums[mi][b][j])
    k.bar_sync(0)
    log_r, log_rt = R.bit_length() - 1, Rt.bit_length() - 1
    for t0 in range(0, B * R, thr):
        o = tid + t0 if t0 else tid
        # output (b, row jj of the group): team jj / Rt's row jj % Rt
        b = o >> log_r
        jj = o & (R - 1)
        row = rg + jj
        ok = k.setp("lt", o, B * R, combine=("and", row < row_end))
        ok = k.setp("lt", b, n_rows.bitcast(u32), combine=("and", ok))
        with k.if_(ok):
            if nt > 1:
                tm = jj >> log_rt
                at0 = tm * (wpt * slots) + (b << log_rt) + (jj & (Rt - 1))
            else:
                at0 = o
            tot = []
            for mi in range(nm):
                t = k.ld(red[at0 + mi * B * Rt])
                for w in range(1, wpt):
                    t = t + k.ld(red[at0 + (w * slots + mi * B * Rt)])
                tot.append(t)
            at = k.mad(b, ys, row)
            if spec.epilogue == "swiglu":
                out = silu_times(k, tot[0], tot[1])
            elif spec.epilogue == "none" and add_y is None:
                out = tot[0]
            else:
                if spec.epilogue == "residual":
                    # plain ld, not .nc: y may alias r
                    addend = k.ld(r[at])
                elif spec.epilogue == "bias":
                    addend = k.ld(r[row], nc=True)
                else:
                    addend = k.mov(0.0, f32)
                if add_y is not None:
                    # a later slice: what the slices before stored instead
                    add = k.var(f32, 0.0)
                    k.assign(add, addend)
                    with k.if_(add_y):
                        k.assign(add, k.ld(y[at]))
                    addend = add
                out = tot[0] + addend
            k.st(y[at], out)

