"""Shared parts of the quantized GEMV kernels: geometry, signature, reduction, epilogues.

``y = W @ x`` with ``W`` an ``[M, K]`` matrix stored as GGUF rows of
quantized blocks (``uint8 [M, row_bytes]``), ``x`` and ``y`` float32.  One
plan (:class:`.spec.GemvPlan`: a spec and its config) covers every format
and epilogue; the kernel bodies live in :mod:`.q4k` (Q4_K, direct 16-byte
loads), :mod:`.staged` (every other format, tile by tile through shared memory)
and :mod:`.ring` (every format through a ``cp.async`` ring).

Kernel parameters, in order::

    w      u8*   weights (gate weights for swiglu, geglu)
    wu     u8*   up weights                      (swiglu, geglu only)
    x      f32*  activations, K values
    r      f32*  residual, M values              (residual only)
    y      f32*  output, M values
    m      u32   rows
    rpc    u32   rows per CTA (a multiple of ``spec.rows``; see launch_geometry)

(``norm`` adds ``nw, eps[, h]`` after ``x``; ``rope`` replaces ``r`` with its
table, position and caches: :func:`declare_params`.)  Launch: ``grid =
ceil(M / rpc)`` CTAs of ``threads(spec)`` threads, with the ring's
dynamic shared memory (:func:`launch_geometry`).
"""

from __future__ import annotations

import attrs

from ptxgen.types import f16, f32, s32, u8, u16, u32

from ..reduce import warp_sum
from ..swiglu import gelu_exp

__all__ = ["declare_params", "RopeArgs", "warp_sum", "silu_times", "gelu_times", "write_outputs",
           "norm_scale", "XFULL",
           "PLANE_W", "PLANE_SIGNED", "plane_inverse", "x_planes", "u32_at", "plane_sums"]

LOG2E = 1.4426950408889634


def declare_params(k, spec, warps):
    """The GEMV kernel signature, shared by every weight format:
    ``w, [wu], x, [nw, eps], [r | [bias], freqs, pos_ptr, k_cache, v_cache,
    capacity], y, m, rpc`` (``wu`` with the SwiGLU epilogue, ``nw``/``eps``
    with ``norm``, ``r`` with the residual epilogue, the bias (``spec.bias``),
    the RoPE table, the device position and the f16 caches with the rope
    epilogue; with ``spec.paged``: ``freqs, pos_ptr, slots, k_pool, v_pool,
    n_slots``); the decode
    graph and ops pass arguments in this order), plus the ``red`` shared
    array :func:`write_outputs` reduces in.

    Returns ``(ws, x, r, y, m, rpc, red, norm)``; ``norm`` is ``(nw, eps)``
    (``(nw, eps, h)`` with ``norm_out``) or None; ``r`` is the residual pointer, the rope epilogue's
    :class:`RopeArgs`, or None.
    """
    ws = [k.param_ptr("w", u8, align=16)]
    if spec.n_mats == 2:
        ws.append(k.param_ptr("wu", u8, align=16))
    x = k.param_ptr("x", f32, align=16)
    norm = (k.param_ptr("nw", f32, align=16), k.param("eps", f32)) if spec.norm else None
    if spec.norm and spec.norm_out:
        norm += (k.param_ptr("h", f32, align=16),)
    r = None
    if spec.epilogue == "residual":
        r = k.param_ptr("r", f32)
    elif spec.epilogue == "rope":
        bias = k.param_ptr("bias", f32) if spec.bias else None
        paged = spec.paged
        freqs, pos = k.param_ptr("freqs", f32, align=8), k.param_ptr("pos_ptr", s32)
        slots = k.param_ptr("slots", s32) if paged else None
        r = RopeArgs(freqs, pos, k.param_ptr("k_pool" if paged else "k_cache", f16, align=2),
                     k.param_ptr("v_pool" if paged else "v_cache", f16, align=2),
                     k.param("n_slots" if paged else "capacity", u32), bias, slots)
    y = k.param_ptr("y", f32)
    mrows = k.param("m", u32)
    rpc = k.param("rpc", u32)
    red = k.shared_array("red", f32, warps * (spec.n_mats * spec.rows + spec.norm), align=16)
    return ws, x, r, y, mrows, rpc, red, norm


@attrs.frozen
class RopeArgs:
    """The rope epilogue's kernel parameters: the ``[head_dim / 2, 2]`` (hi,
    lo) inverse-frequency table of :func:`kernels.rope.freq_table`, the
    device int32 position, the f16 caches ``[n_kv_heads, capacity,
    head_dim]`` (``spec.paged``: the pools ``[num_blocks, n_kv_heads,
    paged, head_dim]``), their capacity (the pools' slots), the f32 ``[M]``
    bias (``spec.bias``, else None) and the device int32 slot (``spec.paged``,
    else None)."""
    freqs: object
    pos_ptr: object
    k_cache: object
    v_cache: object
    capacity: object
    bias: object = None
    slots: object = None


#: ``dot="dp4a"``: x is held as the integer ``T = round(x / s)``, ``|T| <=
#: XFULL``, ``s = max|x| / XFULL``, in three byte planes ``T = x0 2^16 + x1
#: 2^8 + x2`` (``x0`` signed, ``x1`` and ``x2`` the unsigned bytes of ``T``)
XFULL = 4.0e6
#: the planes' weights (planes 0 and 1; plane 2 has 1) and signedness
PLANE_W = (65536, 256)
PLANE_SIGNED = (True, False, False)
_ROUND = 12582912.0         # 1.5 * 2^23: x + _ROUND - _ROUND rounds |x| < 2^22


def plane_inverse(k, vals):
    """``(max|x|, XFULL / max|x|)`` over ``vals`` for :func:`x_planes`; the
    inverse is 0 where every value is 0 (a piece past K), not inf."""
    amax = k.abs(vals[0])
    for v in vals[1:]:
        amax = k.max(amax, k.abs(v))
    some = amax > 0.0
    inv = k.select(some, k.div(XFULL, amax, approx=False), k.mov(0.0, f32))
    return amax, inv


def x_planes(k, vals, inv):
    """Split f32 values into the three byte planes of ``dp4a`` (``XFULL``):
    ``x = (x0 2^16 + x1 2^8 + x2) / inv`` to half a unit, 2^-22.9 of
    ``max|x|`` (:func:`plane_inverse`).  Returns ``planes[p][w]``: plane
    ``p``'s bytes of values ``4w .. 4w + 3`` as one word.

    One ``fma`` a value: ``x inv + 1.5 2^23`` rounds ``x inv`` to the
    nearest integer ``T`` (ties to even) and holds ``0x4B400000 + T``, whose
    bytes 0 and 1 are those of ``T`` and byte 2 is ``(T >> 16) + 64`` (2..125
    for ``|T| <= 4e6 + 1``).  Seven ``prmt`` gather the three bytes of four
    values; plane 0 is byte 2 less 64 as an int8 (``v ^ 0x40``, with bit 6
    copied into bit 7)."""
    words = [[], [], []]
    for w in range(len(vals) // 4):
        b = [k.fma(v, inv, _ROUND).bitcast(u32) for v in vals[4 * w:4 * w + 4]]
        lo = k.prmt(b[0], b[1], 0x5140)         # [b0.0, b1.0, b0.1, b1.1]
        hi = k.prmt(b[2], b[3], 0x5140)
        words[2].append(k.prmt(lo, hi, 0x5410))
        words[1].append(k.prmt(lo, hi, 0x7632))
        top = k.prmt(k.prmt(b[0], b[1], 0x0062), k.prmt(b[2], b[3], 0x0062), 0x5410) ^ 0x40404040
        words[0].append(top + ((top & 0x40404040) << 1))
    return words


def u32_at(k, addr):
    """A 32-bit little-endian word from a 2-byte aligned shared address."""
    lo = k.ld(addr, u16)
    hi = k.ld(addr + 2, u16)
    return k.pack(u32, lo, hi)


def plane_sums(k, acc):
    """``acc[0] 2^16 + acc[1] 2^8 + acc[2]`` in s32 (``mad``): the sum of
    ``q T`` from the three planes' ``dp4a`` sums ``acc``, exact where the
    result fits an s32 (``mad.lo`` wraps, so the partial products may not)."""
    w0, w1 = PLANE_W
    return k.mad(acc[0].bitcast(s32), w0, k.mad(acc[1].bitcast(s32), w1, acc[2].bitcast(s32)))


def silu_times(k, g, u):
    """``silu(g) * u = g * u / (1 + 2^(-g log2 e))`` (ex2.approx, div.rn)."""
    e = k.ex2(g * (-LOG2E))
    return (g * u) / (e + 1.0)


def gelu_times(k, g, u):
    """``gelu(g) * u = g * u / (1 + exp(-2 z))``, GELU's tanh form
    (:func:`~ptxgen.kernels.swiglu.gelu_exp`; ex2.approx, div.rn)."""
    return (g * u) / (gelu_exp(k, g) + 1.0)


def write_outputs(k, spec, acc, red, warps, row0, row_end, y, r, tid, norm=None,
                  trailing_barrier=True):
    """Reduce per-thread partials ``acc[mat][row]`` over the CTA and store.

    Each warp folds its lanes with shuffles; lane 0 writes the warp's sums to
    the shared array ``red`` ([warps, mats*rows]); after a barrier thread
    ``i < rows`` adds the warps' values for row ``row0 + i``, applies the
    epilogue and stores it if the row is below ``row_end``.  A second
    barrier lets ``red`` be reused.

    ``norm`` (fused RMSNorm): the CTA's ``1/sqrt(mean(x^2) + eps)`` from
    :func:`norm_scale`, a register; the storing threads multiply the row
    sums by it.

    ``trailing_barrier=False`` leaves out the second barrier, for a caller
    whose loop passes another barrier before ``red`` is written again.
    """
    nm, R = spec.n_mats, spec.rows
    lane = tid & 31
    warp = tid >> 5
    sums = [[warp_sum(k, acc[mi][i]) for i in range(R)] for mi in range(nm)]
    def slot(i):
        return red[i]

    if spec.epilogue == "rope":
        # the angle's inputs first, so their latency overlaps the reduction
        ropein = _rope_inputs(k, spec, r, row0 + tid, tid, row_end)
    with k.if_(lane.eq(0)):
        base = warp * (nm * R)
        for mi in range(nm):
            for i in range(R):
                k.st(slot(base + (mi * R + i)), sums[mi][i])
    k.bar_sync(0)
    row = row0 + tid
    ok = k.setp("lt", tid, R, combine=("and", row < row_end))
    if spec.epilogue == "rope":
        _rope_kv_outputs(k, spec, slot, warps, tid, row, ok, y, r, norm, ropein)
        if trailing_barrier:
            k.bar_sync(0)
        return
    with k.if_(ok):
        tot = _row_totals(k, spec, slot, warps, tid, norm)
        if spec.epilogue == "swiglu":
            out = silu_times(k, tot[0], tot[1])
        elif spec.epilogue == "geglu":
            out = gelu_times(k, tot[0], tot[1])
        elif spec.epilogue == "residual":
            # plain ld, not .nc: y may alias r (x += W.a) within this launch
            out = tot[0] + k.ld(r[row])
        else:
            out = tot[0]
        k.st(y[row], out)
    if trailing_barrier:
        k.bar_sync(0)


def _row_totals(k, spec, slot, warps, tid, norm):
    """Thread ``tid``'s row sums, one per matrix, added over the warps'
    partials in ``red`` (through ``slot``) in a fixed order, and multiplied
    by ``norm`` (the fused RMSNorm's scale from :func:`norm_scale`) if given."""
    nm, R = spec.n_mats, spec.rows
    tot = []
    for mi in range(nm):
        t = k.ld(slot(tid + mi * R))
        for w in range(1, warps):
            t = t + k.ld(slot(tid + (w * nm * R + mi * R)))
        tot.append(t)
    if norm is not None:
        tot = [t * norm for t in tot]
    return tot


def norm_scale(k, spec, red, warps, norm, tid):
    """The fused RMSNorm's ``1/sqrt.rn(sum(x^2)/K + eps)``, computed once per
    CTA before the row loop, or None without ``norm``.

    ``norm = (sq, eps)``: ``sq`` is the warp's sum of x squares (every lane
    holds it).  Lane 0 of each warp stores it in the norm slots of ``red``
    (after the partials :func:`write_outputs` uses, so the loop never
    overwrites them); after one barrier every thread adds the warps' sums in
    a fixed order, so every CTA gets the same bits.  (Computing it inside
    every row group's reduction put two ``div.rn`` and a ``sqrt.rn`` on the
    storing threads' path once per group.)"""
    if norm is None:
        return None
    nm, R = spec.n_mats, spec.rows
    sq, eps = norm
    base = warps * nm * R
    with k.if_((tid & 31).eq(0)):
        k.st(red[base + (tid >> 5)], sq)
    k.bar_sync(0)
    tot = k.ld(red[base])
    for w in range(1, warps):
        tot = tot + k.ld(red[base + w])
    mean = k.div(tot, k.mov(float(spec.k), f32))
    return k.div(k.mov(1.0, f32), k.sqrt(mean + eps))


def _rope_inputs(k, spec, ra, row, tid, row_end):
    """Per storing thread (``tid < rows``): the head-row index ``j = row mod
    head_dim``, the (hi, lo) inverse frequency of its pair ``j / 2``, the
    position, where the row is stored (its natural row, None for ``row``
    itself in the interleaved layout, and head-row index; in the NeoX
    layout a q or k row ``2i + e`` of a head is its row ``i + e * head_dim /
    2``), and with ``spec.bias`` the natural row's bias (0 past
    ``row_end``), and where the k and v rows go: the position, or with
    ``spec.paged`` the slot (loads only; every thread of warp 0 issues them)."""
    d, nq, nkv = spec.rope
    j = k.rem(row, d)
    ok = k.setp("lt", tid, spec.rows)
    hi, lo = k.ld(ra.freqs[(j >> 1) << 1], vec=2, nc=True, guard=ok)
    # plain ld: the position is advanced by the previous decode step's last grid
    pos = k.ld(ra.pos_ptr[0], guard=ok)
    at = k.ld(ra.slots[0], guard=ok) if spec.paged else pos
    nrow, nj = None, j
    if spec.rope_layout == "neox":
        qk = k.setp("lt", row, (nq + nkv) * d)
        nj = k.select(qk, (j >> 1) + (j & 1) * (d // 2), j)
        nrow = row - j + nj
    b = None
    if spec.bias:
        b = k.var(f32, 0.0)
        inside = k.setp("lt", row, row_end, combine=("and", ok))
        k.ld(ra.bias[row if nrow is None else nrow], nc=True, out=b, guard=inside)
    return j, hi, lo, pos, b, nrow, nj, at


def _rope_kv_outputs(k, spec, slot, warps, tid, row, ok, y, ra, norm, ropein):
    """The rope epilogue's stores for one row group (warp 0).

    Thread ``tid < rows`` sums row ``row``; rows come in rotation pairs
    ``(2i, 2i + 1)`` of a head (the interleaved RoPE layout GGUF Llama
    weights use), so lanes ``tid`` and ``tid ^ 1`` hold a pair (rows is even
    and row groups start at multiples of it) and exchange their sums with
    one shuffle.  Query and key rows are rotated by ``pos * inv_freq[i]``
    (:func:`kernels.rope.angle_sincos`) and stored to ``y``; value rows are
    stored as they are; key and value rows are also written (``cvt.rn`` to
    f16) to ``cache[h, pos, j]`` when ``0 <= pos < capacity`` (``spec.paged``:
    to ``pool[slot // paged, h, slot % paged, j]`` when ``0 <= slot <
    n_slots``).  With
    ``spec.bias`` each row's bias is added to its sum first.  In the NeoX
    layout W's q and k rows come in pair order (:func:`.spec.neox_pair_rows`)
    and each row is stored at its natural place (:func:`_rope_inputs`).
    """
    from ..rope import angle_sincos, rotate_pair
    d, nq, nkv = spec.rope
    j, hi, lo, pos, bias, nrow, nj, at = ropein
    with k.if_(tid < 32):
        t = k.var(f32, 0.0)
        with k.if_(ok):
            tot = _row_totals(k, spec, slot, warps, tid, norm)[0]
            t.set(tot if bias is None else tot + bias)
        other = k.shfl_xor(t, 1)
        with k.if_(ok):
            odd = k.setp("ne", tid & 1, 0)
            a = k.select(odd, other, t)
            b = k.select(odd, t, other)
            s, c = angle_sincos(k, pos.to(f32), hi, lo)
            a2, b2 = rotate_pair(k, a, b, s, c)
            rot = k.select(odd, b2, a2)
            qk_rows = (nq + nkv) * d
            out = k.select(k.setp("lt", row, qk_rows), rot, t)
            k.st(y[row if nrow is None else nrow], out)
            # K and V rows of a position (slot) inside the cache: f16 into
            # [h, pos, j] ([slot // paged, h, slot % paged, j])
            kv = row - nq * d
            at_u = at.bitcast(u32)
            app = k.setp("ge", row, nq * d, combine=("and", at >= 0))
            app = k.setp("lt", at_u, ra.capacity, combine=("and", app))
            with k.if_(app):
                is_v = k.setp("ge", kv, nkv * d)
                kvr = k.select(is_v, kv - nkv * d, kv)
                head = kvr // d
                cache = k.ptr_reg(f16)
                k.select(is_v, ra.v_cache, ra.k_cache, out=cache)
                if spec.paged:
                    bs = spec.paged
                    blk, off = at_u >> (bs.bit_length() - 1), at_u & (bs - 1)
                    dst = k.mad(k.mad(k.mad(blk, nkv, head), bs, off), d, nj)
                else:
                    dst = k.mad(k.mad(head, ra.capacity, at_u), d, nj)
                k.st(cache[dst], k.cvt(f16, out, rnd="rn"))
