"""GGML's 256-weight "k-quant" block formats: Q2_K, Q3_K, Q4_K, Q5_K and Q6_K.

Byte maps (little-endian; see docs/quants.md):

- Q4_K, 144 bytes: ``d:f16 | dmin:f16 | scales:u8[12] | qs:u8[128]``; 8
  sub-blocks of 32 with 6-bit scale ``sc`` and min ``m``;
  ``w = (d*sc) * q - (dmin*m)``, q in 0..15.
- Q5_K, 176 bytes: ``d:f16 | dmin:f16 | scales:u8[12] | qh:u8[32] |
  qs:u8[128]``; as Q4_K with a fifth bit: bit ``s`` of ``qh[j]`` is the top
  bit of weight ``j`` of sub-block ``s``; q in 0..31.
- Q6_K, 210 bytes: ``ql:u8[128] | qh:u8[64] | scales:i8[16] | d:f16``; 16
  sub-blocks of 16; ``w = (d*sc) * (q - 32)``.
- Q2_K, 84 bytes: ``scales:u8[16] | qs:u8[64] | d:f16 | dmin:f16``; 16
  sub-blocks of 16, 4-bit scale (low nibble) and min (high nibble);
  ``w = (d*sc) * q - (dmin*m)``, q in 0..3. Decoding only.
- Q3_K, 110 bytes: ``hmask:u8[32] | qs:u8[64] | scales:u8[12] | d:f16``; 16
  sub-blocks of 16 with 6-bit scales biased by 32; ``w = (d*(sc-32)) * q``,
  q in -4..3. Decoding only.

The Q4_K, Q5_K and Q6_K quantizers follow the method of GGML's reference
quantizers (a per-sub-block scale/min search, then the scales themselves
quantized against a per-super-block f16 scale), vectorised over all blocks.
"""
from __future__ import annotations

import numpy as np

from .qtypes import (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, QType, f16_field, quantize_rows,
                     raw_blocks, to_f16)

__all__ = [
    "quantize_q4_k", "dequantize_q4_k", "quantize_q5_k", "dequantize_q5_k",
    "quantize_q6_k", "dequantize_q6_k", "dequantize_q2_k", "dequantize_q3_k",
]


# ---------------------------------------------------------------------------
# Q4_K and Q5_K: 8 sub-blocks of 32, 6-bit scales and mins

def _qkx2_search(x: np.ndarray, nmax: int, rmin: float, rdelta: float,
                 nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-weight sub-block: scale s >= 0 and offset m <= 0 with x ~ s*L + m, L in 0..nmax.

    ``x`` is (32, S): one sub-block per column (reductions over axis 0 are
    contiguous vector adds, several times faster than over a short last axis).
    As GGML's make_qkx2_quants: weights w = |x| + rms(x); start from the
    min/max grid, then try grids iscale = (nmax + rmin + rdelta*i)/(max - origin),
    i in 0..nstep, each fitted by weighted least squares (m clamped to <= 0);
    keep the fit with the smallest weighted squared error. Like GGML, each grid
    is anchored at the best offset found so far. Returns (s, -m).
    """
    f32, f64 = np.float32, np.float64
    w = np.sqrt(np.mean(x * x, axis=0)) + np.abs(x)
    xmin = np.minimum(x.min(axis=0), f32(0))
    xmax = x.max(axis=0)
    flat = xmax <= xmin
    wx = w * x
    sw = w.sum(axis=0).astype(f64)
    swx = wx.sum(axis=0).astype(f64)
    swx2 = (wx * x).sum(axis=0).astype(f64)
    lv = np.empty_like(x)
    tmp = np.empty_like(x)

    def grid_sums(origin, iscale):
        np.subtract(x, origin, out=lv)
        np.multiply(lv, iscale, out=lv)
        np.rint(lv, out=lv)
        np.clip(lv, f32(0), f32(nmax), out=lv)
        np.multiply(w, lv, out=tmp)
        sl = tmp.sum(axis=0).astype(f64)
        sxl = np.einsum("ij,ij->j", tmp, x).astype(f64)
        np.multiply(tmp, lv, out=tmp)
        sl2 = tmp.sum(axis=0).astype(f64)
        return sl, sl2, sxl

    # the plain min/max grid, with its own (not fitted) scale and offset
    span = np.where(flat, f32(1), xmax - xmin)
    best_s = (span / f32(nmax)).astype(f64)
    best_m = xmin.astype(f64)
    sl, sl2, sxl = grid_sums(xmin, (f32(nmax) / span).astype(f32))
    best_e = (best_s * best_s * sl2 + 2 * best_s * best_m * sl + best_m * best_m * sw
              - 2 * best_s * sxl - 2 * best_m * swx + swx2)
    origin = xmin.copy()
    for i in range(nstep + 1):
        width = xmax - origin
        width[width <= 0] = 1
        sl, sl2, sxl = grid_sums(origin, (f32(nmax + rmin + rdelta * i) / width).astype(f32))
        det = sw * sl2 - sl * sl
        ok = det > 0
        det[~ok] = 1
        s = (sw * sxl - swx * sl) / det
        m = (sl2 * swx - sl * sxl) / det
        pos = ok & (m > 0)
        if pos.any():
            m[pos] = 0
            s[pos] = sxl[pos] / sl2[pos]
        # at the least-squares fit the weighted error is swx2 - s*sxl - m*swx
        e = swx2 - s * sxl - m * swx
        better = ok & (e < best_e)
        np.copyto(best_e, e, where=better)
        np.copyto(best_s, s, where=better)
        np.copyto(best_m, m, where=better)
        np.copyto(origin, best_m, where=better, casting="same_kind")
    best_s = np.where(flat, 0.0, np.maximum(best_s, 0.0))
    best_m = np.where(flat, xmin, best_m)
    return best_s.astype(f32), (-best_m).astype(f32)


def _scale_min_blocks(x: np.ndarray, q: QType, nmax: int, rmin: float, rdelta: float,
                      nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K head (nb, 16 bytes: d, dmin, 12 scale bytes) and levels (nb, 8, 32) in 0..nmax."""
    f32 = np.float32
    nb = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(nb * 8, 32).T)
    scales, mins = _qkx2_search(sub, nmax, rmin, rdelta, nstep)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    max_scale = scales.max(axis=1, keepdims=True)
    max_min = mins.max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv_s = np.where(max_scale > 0, f32(63) / max_scale, f32(0)).astype(f32)
        inv_m = np.where(max_min > 0, f32(63) / max_min, f32(0)).astype(f32)
    ls = np.clip(np.rint(inv_s * scales), 0, 63).astype(np.uint8)
    lm = np.clip(np.rint(inv_m * mins), 0, 63).astype(np.uint8)
    d16 = to_f16(max_scale / f32(63), q, "super-block scale d")
    dm16 = to_f16(max_min / f32(63), q, "super-block min scale dmin")

    # final levels against the scales as they will be decoded
    deff = (d16.astype(f32) * ls.astype(f32))[:, :, None]
    meff = (dm16.astype(f32) * lm.astype(f32))[:, :, None]
    xb = x.reshape(nb, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        lv = np.rint((xb + meff) / deff)
    lv = np.where(deff != 0, np.clip(lv, 0, nmax), 0).astype(np.uint8)

    head = np.empty((nb, 16), dtype=np.uint8)
    head[:, 0:2] = d16.view(np.uint8)
    head[:, 2:4] = dm16.view(np.uint8)
    # 12 scale bytes: [0:4] low 6 bits of sc0..3, top 2 bits = sc4..7 >> 4;
    # [4:8] the same for the mins; [8:12] low nibbles sc4..7 | m4..7 << 4.
    head[:, 4:8] = (ls[:, :4] & 0x3F) | ((ls[:, 4:] >> 4) << 6)
    head[:, 8:12] = (lm[:, :4] & 0x3F) | ((lm[:, 4:] >> 4) << 6)
    head[:, 12:16] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    return head, lv


def _low_nibbles(lv: np.ndarray) -> np.ndarray:
    """(nb, 8, 32) levels -> 128 bytes: per 64 weights, low nibble = first 32, high = next 32."""
    pairs = (lv & 0x0F).reshape(lv.shape[0], 4, 2, 32)
    return (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(lv.shape[0], 128)


def _q4_k_blocks(x: np.ndarray, nstep: int = 20) -> np.ndarray:
    head, lv = _scale_min_blocks(x, Q4_K, 15, -1.0, 0.1, nstep)
    return np.concatenate([head, _low_nibbles(lv)], axis=1)


def _q5_k_blocks(x: np.ndarray, nstep: int = 15) -> np.ndarray:
    head, lv = _scale_min_blocks(x, Q5_K, 31, -0.5, 0.1, nstep)
    # qh[j]: bit s = bit 4 of weight j of sub-block s
    top = ((lv >> 4) & 1).astype(np.uint8)                          # (nb, 8, 32)
    qh = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for s in range(8):
        qh |= top[:, s, :] << s
    return np.concatenate([head, qh, _low_nibbles(lv)], axis=1)


def _check_nstep(q: QType, nstep) -> int:
    nstep = int(nstep)
    if nstep < 0:
        raise ValueError(f"{q.name} quantize: nstep must be >= 0, got {nstep}")
    return nstep


def quantize_q4_k(x, *, nstep: int = 20) -> np.ndarray:
    """Quantize floats (..., K), K a multiple of 256, to Q4_K bytes (..., K/256*144).

    Parameters
    ----------
    x : array_like of float
        Weights; the last axis is the row (K).
    nstep : int
        Candidate grids tried per sub-block beyond the min/max grid (GGML
        uses 20). Fewer is faster and slightly less accurate; 0 still refines once.
    """
    nstep = _check_nstep(Q4_K, nstep)
    return quantize_rows(lambda b: _q4_k_blocks(b, nstep), x, Q4_K)


def quantize_q5_k(x, *, nstep: int = 15) -> np.ndarray:
    """Quantize floats (..., K), K a multiple of 256, to Q5_K bytes (..., K/256*176).

    Parameters
    ----------
    x : array_like of float
        Weights; the last axis is the row (K).
    nstep : int
        Candidate grids tried per sub-block beyond the min/max grid (GGML uses 15).
    """
    nstep = _check_nstep(Q5_K, nstep)
    return quantize_rows(lambda b: _q5_k_blocks(b, nstep), x, Q5_K)


def _scale_min_6bit(sb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12 scale bytes (nb, 12) to 6-bit scales and mins (nb, 8)."""
    a, b, c = sb[:, 0:4], sb[:, 4:8], sb[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def _scale_min_decode(b: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """``(d*sc) * q - (dmin*m)`` for Q4_K/Q5_K blocks ``b`` and levels (nb, 8, 32) float32."""
    d = f16_field(b, 0)
    dmin = f16_field(b, 2)
    sc, mn = _scale_min_6bit(b[:, 4:16])
    dd = (d * sc.astype(np.float32))[:, :, None]
    mm = (dmin * mn.astype(np.float32))[:, :, None]
    return dd * levels - mm


def _nibble_levels(qs: np.ndarray) -> np.ndarray:
    """128 bytes (nb, 128) -> (nb, 8, 32) uint8 low 4 bits of each weight."""
    nb = qs.shape[0]
    qs = qs.reshape(nb, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 8, 32)


def dequantize_q4_k(raw, shape) -> np.ndarray:
    """Decode Q4_K bytes to float32 of ``shape`` (last dim K)."""
    b, shape = raw_blocks(raw, Q4_K, shape)
    qv = _nibble_levels(b[:, 16:]).astype(np.float32)
    return _scale_min_decode(b, qv).reshape(shape)


def dequantize_q5_k(raw, shape) -> np.ndarray:
    """Decode Q5_K bytes to float32 of ``shape`` (last dim K)."""
    b, shape = raw_blocks(raw, Q5_K, shape)
    qh = b[:, 16:48]
    top = np.stack([(qh >> s) & 1 for s in range(8)], axis=1)     # (nb, 8, 32)
    qv = (_nibble_levels(b[:, 48:]) | (top << 4)).astype(np.float32)
    return _scale_min_decode(b, qv).reshape(shape)


# ---------------------------------------------------------------------------
# Q6_K

def _q6_k_search(x: np.ndarray) -> np.ndarray:
    """Per 16-weight sub-block: signed scale s with x ~ s*L, L in -32..31.

    ``x`` is (16, S), one sub-block per column. As GGML's
    make_qx_quants(rmse_type=1): weights x^2, grids iscale = -(32 + 0.1*i)/vmax
    (vmax the largest-magnitude value, so it maps to about -32) for
    i = 0, -9..9, least-squares scale for each, keep the best fit.
    """
    f32, f64 = np.float32, np.float64
    idx = np.abs(x).argmax(axis=0)
    vmax = np.take_along_axis(x, idx[None, :], axis=0)[0]
    tiny = np.abs(vmax) < f32(1e-15)
    vmax[tiny] = 1
    w = x * x
    wx = w * x
    lv = np.empty_like(x)
    tmp = np.empty_like(x)
    best_s = np.zeros(x.shape[1], dtype=f64)
    best_g = np.full(x.shape[1], -1.0)
    for i in (0, *range(-9, 0), *range(1, 10)):
        np.multiply(x, (f32(-(32 + 0.1 * i)) / vmax).astype(f32), out=lv)
        np.rint(lv, out=lv)
        np.clip(lv, f32(-32), f32(31), out=lv)
        slx = np.einsum("ij,ij->j", wx, lv).astype(f64)
        np.multiply(w, lv, out=tmp)
        sl2 = np.einsum("ij,ij->j", tmp, lv).astype(f64)
        ok = sl2 > 0
        sl2[~ok] = 1
        gain = slx * slx / sl2          # the error reduction of the least-squares scale
        better = ok & (gain > best_g)
        np.copyto(best_g, gain, where=better)
        np.copyto(best_s, slx / sl2, where=better)
    best_s[tiny] = 0
    return best_s.astype(f32)


def _q6_k_blocks(x: np.ndarray) -> np.ndarray:
    f32 = np.float32
    nb = x.shape[0]
    scales = _q6_k_search(np.ascontiguousarray(x.reshape(nb * 16, 16).T)).reshape(nb, 16)
    idx = np.abs(scales).argmax(axis=1)
    smax = np.take_along_axis(scales, idx[:, None], axis=1)
    zero = np.abs(smax) < f32(1e-15)
    smax = np.where(zero, f32(1), smax)
    iscale = (f32(-128) / smax).astype(f32)
    sc = np.clip(np.rint(iscale * scales), -128, 127).astype(np.int8)
    d = np.where(zero, f32(0), f32(1) / iscale).astype(f32)
    sc = np.where(zero, np.int8(0), sc)
    d16 = to_f16(d, Q6_K, "super-block scale d")

    deff = (d16.astype(f32) * sc.astype(f32))[:, :, None]
    xb = x.reshape(nb, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        lv = np.rint(xb / deff)
    lv = (np.where(deff != 0, np.clip(lv, -32, 31), 0) + 32).astype(np.uint8)

    out = np.empty((nb, Q6_K.type_size), dtype=np.uint8)
    # each half of 128 weights: quarters q0..q3 of 32; ql holds the low
    # nibbles (q0 | q2<<4, then q1 | q3<<4), qh the top 2 bits of all four.
    qq = lv.reshape(nb, 2, 4, 32)
    lo = qq & 0x0F
    ql = np.stack([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    hi = qq >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    out[:, 0:128] = ql.reshape(nb, 128)
    out[:, 128:192] = qh.reshape(nb, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d16.view(np.uint8)
    return out


def quantize_q6_k(x) -> np.ndarray:
    """Quantize floats (..., K), K a multiple of 256, to Q6_K bytes (..., K/256*210)."""
    return quantize_rows(_q6_k_blocks, x, Q6_K)


def dequantize_q6_k(raw, shape) -> np.ndarray:
    """Decode Q6_K bytes to float32 of ``shape`` (last dim K)."""
    b, shape = raw_blocks(raw, Q6_K, shape)
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 1, 64)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = f16_field(b, 208)
    lo = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(nb, 2, 4, 32)
    hi = np.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], axis=2)
    qv = ((lo | (hi << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    dd = (d * sc)[:, :, None]
    return (dd * qv.reshape(nb, 16, 16)).reshape(shape)


# ---------------------------------------------------------------------------
# Q2_K and Q3_K (decoding only)

def _two_bit_levels(qs: np.ndarray) -> np.ndarray:
    """64 bytes (nb, 64) -> (nb, 16, 16): weight 128*h + 32*p + j is bits 2p..2p+1 of qs[32*h + j]."""
    nb = qs.shape[0]
    halves = qs.reshape(nb, 2, 1, 32)
    planes = np.concatenate([(halves >> s) & 3 for s in (0, 2, 4, 6)], axis=2)   # (nb, 2, 4, 32)
    return planes.reshape(nb, 16, 16)


def dequantize_q2_k(raw, shape) -> np.ndarray:
    """Decode Q2_K bytes to float32 of ``shape`` (last dim K)."""
    b, shape = raw_blocks(raw, Q2_K, shape)
    sc = b[:, 0:16]
    d = f16_field(b, 80)
    dmin = f16_field(b, 82)
    dd = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
    mm = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    qv = _two_bit_levels(b[:, 16:80]).astype(np.float32)
    return (dd * qv - mm).reshape(shape)


def _q3_k_scales(sb: np.ndarray) -> np.ndarray:
    """12 bytes (nb, 12) -> 16 signed scales (nb, 16): low nibbles in bytes 0..7, top bits in 8..11."""
    low = np.concatenate([sb[:, 0:8] & 0x0F, sb[:, 0:8] >> 4], axis=1)             # scale i: i < 8 low, else high nibble
    top = np.concatenate([(sb[:, 8:12] >> s) & 3 for s in (0, 2, 4, 6)], axis=1)    # scale i: bits 2*(i//4) of byte 8 + i%4
    return (low | (top << 4)).astype(np.int8) - np.int8(32)


def dequantize_q3_k(raw, shape) -> np.ndarray:
    """Decode Q3_K bytes to float32 of ``shape`` (last dim K)."""
    b, shape = raw_blocks(raw, Q3_K, shape)
    nb = b.shape[0]
    hmask = b[:, 0:32]
    d = f16_field(b, 108)
    dd = (d * _q3_k_scales(b[:, 96:108]).astype(np.float32))[:, :, None]
    # weight 32*k + j (k = 0..7) has its high bit at bit k of hmask[j]; a clear bit subtracts 4
    high = np.stack([(hmask >> k) & 1 for k in range(8)], axis=1).reshape(nb, 16, 16)
    qv = (_two_bit_levels(b[:, 32:96]).astype(np.int8)
          - ((high ^ 1) << 2).astype(np.int8)).astype(np.float32)
    return (dd * qv).reshape(shape)
