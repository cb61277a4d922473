"""GEMV of every format but Q4_K: weight tiles staged through shared memory.

The piece decoders of Q6_K and Q8_0 are here; those of Q4_0 ... Q5_1
(:mod:`.legacy`), Q5_K (:mod:`.q5k`), F16 and BF16 (:mod:`.floats`) are
registered in :data:`FORMATS` and :data:`PLANES` beside them.  The ring
(:mod:`.ring`) uses the same decoders.

Q6_K blocks (210 bytes) and Q8_0 blocks (34 bytes) are only 2-byte aligned
inside a row, so a thread cannot read "its" block with wide loads.  Instead a
CTA works on ``spec.rows`` consecutive rows at a time and walks K in tiles:

1. copy: the rows' tile bytes (contiguous per row) are read with coalesced
   ``ld.global.nc.L1::no_allocate`` loads, as wide (16, 8, 4 or 2 bytes)
   as the row and tile sizes allow, and stored to shared memory, all loads
   issued before the first store;
2. decode: each thread owns one *piece* of the tile (Q8_0: 8 weights of a
   block; Q6_K: 16 weights, four runs of 4) for every row; it loads its x
   values once per tile (lanes read consecutive 16 bytes) and reuses them
   across the rows; the quants come from shared memory with 16-bit loads.

Integer -> float without ``cvt``: Q6_K's 6-bit ``q`` goes into the mantissa
of ``1 + q/64`` with one ``prmt`` (``sum x (q - 32) = 64 S - 96 X``); Q8_0's
signed byte becomes ``2^23 + 128 + q`` by ``prmt`` and is made exact with
one subtraction.
"""

from __future__ import annotations

import math

import ptxgen
from ptxgen.types import f16, f32, s8, s32, u8, u16, u32

from ..spec_fields import pdl_prologue
from .common import (PLANE_SIGNED, PLANE_W, XFULL, declare_params, plane_inverse, u32_at,
                     write_outputs, x_planes)
from .floats import FLOAT_FORMATS
from .layout import pieces_per_row, staged_layout
from .legacy import LEGACY_FORMATS
from .q5k import Q5K_FORMAT

__all__ = ["build_staged", "staged_layout", "pieces_per_row", "q6_planes", "FORMATS", "PLANES"]

#: pieces of a block (Q6_K 16 and Q4_0 ... Q5_1 2 pieces of 16 weights; Q8_0
#: 4 of 8; F16 and BF16 one of 8, their GEMV block; Q5_K 8 of 32)
_u32_at = u32_at


def _q8_piece(k, sm, x, tile_k0, tid, lay):
    """Q8_0 piece ``tid``: block ``tid // 4``, weights ``8 (tid % 4) + (0..8)``."""
    b = tid >> 2
    qq = tid & 3
    xi = tile_k0 + (b << 5) + (qq << 3)
    xv = list(k.ld(x[xi], f32, vec=4, nc=True)) + list(k.ld(x[xi] + 16, f32, vec=4, nc=True))
    boff = b * 34
    return dict(x=xv, d_off=boff, q_off=boff + 2 + (qq << 3))


def _q8_dot(k, spec, sm_row, pc):
    d = k.ld(sm_row[pc["d_off"]], u16).bitcast(f16).to(f32)
    acc = None
    for w in range(2):
        word = _u32_at(k, sm_row[pc["q_off"]] + 4 * w) ^ 0x80808080
        for bi in range(4):
            f = k.prmt(word, 0x4B000000, 0x7440 | bi).bitcast(f32) - 8388736.0
            xi = pc["x"][4 * w + bi]
            acc = xi * f if acc is None else k.fma(xi, f, acc)
    return d * acc


def _q6_piece(k, sm, x, tile_k0, tid, lay):
    """Q6_K piece ``tid``: block ``tid // 16``, half ``n``, l-group ``g``."""
    b = tid >> 4
    n = (tid >> 3) & 1
    g = tid & 7
    xi = tile_k0 + (b << 8) + (n << 7) + (g << 2)
    xv = [list(k.ld(x[xi] + 128 * s, f32, vec=4, nc=True)) for s in range(4)]
    xs = []
    for v in xv:
        xs.append((v[0] + v[1]) + (v[2] + v[3]))
    boff = b * 210
    return dict(x=xv, xs=xs,
                ql=boff + (n << 6) + (g << 2),
                qh=boff + 128 + (n << 5) + (g << 2),
                sc=boff + 192 + (n << 3) + (g >> 2),
                d=boff + 208)


def q6_planes(k, pc):
    """``dot="dp4a"``: the piece's 16 x values as three byte planes
    (``pc["planes"][p][s]``: plane ``p`` of run ``s``) and the factor that
    turns :func:`_q6_dot`'s combined sums into sums of ``x (q - 32)``;
    drops the f32 values."""
    vals = [v for run in pc.pop("x") for v in run]
    pc.pop("xs")
    amax, inv = plane_inverse(k, vals)
    # the dot's bytes are 4 (q - 32)
    pc["xscale"] = amax * (1.0 / (4 * XFULL))
    pc["planes"] = x_planes(k, vals, inv)


def _q6_dot(k, spec, sm_row, pc):
    d = k.ld(sm_row[pc["d"]], u16).bitcast(f16).to(f32)
    ql = [_u32_at(k, sm_row[pc["ql"]]), _u32_at(k, sm_row[pc["ql"]] + 32)]
    qh = _u32_at(k, sm_row[pc["qh"]])
    scb = sm_row[pc["sc"]]
    if "planes" in pc:
        return _q6_dot_planes(k, pc, d, ql, qh, scb)
    acc = None
    for s in range(4):
        sc = k.ld(scb + 2 * s, s8).to(f32)
        nib = ql[s & 1] >> 4 if s >= 2 else ql[s & 1]
        nib = nib & 0x0F0F0F0F
        hb = ((qh >> (2 * s)) & 0x03030303) << 4
        pk = ((nib | hb) << 1) | 0x80808080
        ssum = None
        for li in range(4):
            f = k.prmt(pk, 0x3F000000, 0x7044 | (li << 8)).bitcast(f32)
            xi = pc["x"][s][li]
            ssum = xi * f if ssum is None else k.fma(xi, f, ssum)
        t = k.fma(ssum, 64.0, pc["xs"][s] * -96.0)
        acc = sc * t if acc is None else k.fma(sc, t, acc)
    return d * acc


def _q6_dot_planes(k, pc, d, ql, qh, scb):
    """The ``dp4a`` form of :func:`_q6_dot`: each run's four 6-bit ``q``
    become the signed bytes ``4 (q - 32)`` (the low nibble at bits 2..5, the
    two high bits at 6..7 with bit 7 flipped: ``q ^ 32`` shifted left by
    two is ``4 (q - 32)`` as an int8), three ``dp4a`` against the
    planes, and the run's scale applied in s32 (``mad``): ``|sum| <= 4 runs *
    128 (scale) * 4 weights * 128 * 255 (plane byte) < 2^27``, exact.  The
    planes are combined once per piece in f32."""
    acc = [None, None, None]
    # the top bit of every 2-bit field flipped once, so each run's bit 7 comes flipped
    qh = qh ^ 0xAAAAAAAA
    for s in range(4):
        sc = k.ld(scb + 2 * s, s8).to(s32)
        w = ql[s & 1]
        nib = ((w << 2) if s < 2 else (w >> 2)) & 0x3C3C3C3C
        pk = nib | (((qh << (6 - 2 * s)) if s < 3 else qh) & 0xC0C0C0C0)
        for p in range(3):
            t = k.dp4a(pk, pc["planes"][p][s], 0, signed_a=True, signed_b=PLANE_SIGNED[p])
            acc[p] = t * sc if acc[p] is None else k.mad(t, sc, acc[p])
    f = k.fma(acc[0].to(f32), float(PLANE_W[0]),
              k.fma(acc[1].to(f32), float(PLANE_W[1]), acc[2].to(f32)))
    return (d * pc["xscale"]) * f


#: qtype -> (piece_fn, dot_fn): the piece decoders of the staged and ring kernels
FORMATS = {"Q6_K": (_q6_piece, _q6_dot), "Q8_0": (_q8_piece, _q8_dot)}
#: qtype -> the function that turns a piece's x into ``dot="dp4a"`` planes
PLANES = {"Q6_K": q6_planes}
for _q, (_piece, _dot, _planes) in {**LEGACY_FORMATS, **FLOAT_FORMATS, "Q5_K": Q5K_FORMAT}.items():
    FORMATS[_q] = (_piece, _dot)
    if _planes is not None:
        PLANES[_q] = _planes


def build_staged(spec, params=declare_params, finish=None) -> ptxgen.Module:
    """Build the tile-by-tile GEMV kernel (every format but Q4_K) of ``spec``;
    ``params`` declares the parameters (:func:`.common.declare_params`'s
    signature and result); ``finish`` ends the kernel
    (:func:`ptxgen.kernels.gemv.build`)."""
    lay = staged_layout(spec)
    piece_fn, dot_fn = FORMATS[spec.qtype]
    nm, R, rb = spec.n_mats, spec.rows, spec.row_bytes
    thr, lw, stride = lay["threads"], lay["lw"], lay["stride"]
    warps = thr // 32
    cpr = lay["tile_bytes"] // lw
    lty = {16: u32, 8: u32, 4: u32, 2: u16}[lw]
    vec = {16: 4, 8: 2, 4: 1, 2: 1}[lw]
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, reqntid=thr) as k:
        pdl_prologue(k, spec)
        ws, x, r, y, mrows, rpc, red, _ = params(k, spec, warps)
        sm = k.shared_array("tiles", u8, nm * R * stride, align=16)

        tid = k.tid.x
        active = tid < lay["pieces"]
        ptid = k.min(tid, lay["pieces"] - 1)
        row0 = k.ctaid.x * rpc
        row_end = k.min(mrows, row0 + rpc)
        last = row_end - 1
        zero = k.mov(0.0, f32)
        with k.for_range(row0, row_end, R) as rg:
            accs = [[k.var(f32, 0.0) for _ in range(R)] for _ in range(nm)]
            srcs = []
            for mi in range(nm):
                for i in range(R):
                    off = k.mul_wide(k.min(rg + i, last), rb)
                    srcs.append(k.ptr_add(ws[mi], off))
            with k.for_range(0, lay["tiles"]) as t:
                tb_off = k.mul_wide(t, lay["tile_bytes"])
                pending = []
                for si, src in enumerate(srcs):
                    base = k.ptr_add(src, tb_off)
                    for n in range(math.ceil(cpr / thr)):
                        ci = tid + n * thr
                        ok = ci < cpr
                        ga = base[k.mul_wide(ci, lw)]
                        v = k.ld(ga, lty, vec=vec, nc=True, evict="L1::no_allocate", guard=ok)
                        pending.append((ok, si * stride + n * thr * lw, v))
                for ok, soff, v in pending:
                    k.st(sm[tid * lw + soff] if lw > 1 else sm[tid + soff], v, lty, guard=ok)
                k.bar_sync(0)
                pc = piece_fn(k, sm, x, t * (lay["tile_blocks"] * spec.block_weights), ptid, lay)
                for mi in range(nm):
                    for i in range(R):
                        base_sym = _RowView(k, sm, (mi * R + i) * stride)
                        part = dot_fn(k, spec, base_sym, pc)
                        accs[mi][i] += k.select(active, part, zero)
                k.bar_sync(0)
            write_outputs(k, spec, accs, red, warps, rg, row_end, y, r, tid)
        if finish is not None:
            finish(k, (row0, row_end, R), tid)
    return m


class _RowView:
    """``view[i]`` -> shared address of byte ``base + i`` (``i`` a u32 register)."""

    def __init__(self, k, sym, base):
        self.k, self.sym, self.base = k, sym, base

    def __getitem__(self, i):
        return self.sym[i] + self.base
