"""Numpy quantizers and dequantizers for GGML block formats (Q8_0, Q4_K, Q6_K).

The byte layouts are GGML's, byte for byte, so that a tensor quantized here and
written into a GGUF file is read back by ``gguf``/llama.cpp unchanged, and the
dequantizers give the same float32 values as ``gguf.quants.dequantize`` bit for
bit (same order of float32 operations). The quantizers follow the method of
GGML's reference quantizers (per-sub-block scale/min search, then the scales
themselves quantized against a per-super-block f16 scale); they are written
here from the format definitions and vectorised over all blocks at once.

Byte maps (little-endian; see docs/quants.md):

- Q8_0, 34 bytes per 32 weights: ``d:f16 | q:int8[32]``; ``w = q * d``.
- Q4_K, 144 bytes per 256 weights: ``d:f16 | dmin:f16 | scales:u8[12] |
  qs:u8[128]``; 8 sub-blocks of 32 with 6-bit scale ``sc`` and min ``m``;
  ``w = (d*sc) * q - (dmin*m)``.
- Q6_K, 210 bytes per 256 weights: ``ql:u8[128] | qh:u8[64] | scales:i8[16] |
  d:f16``; 16 sub-blocks of 16; ``w = (d*sc) * (q - 32)``.

This module imports numpy and attrs only (no gguf, no GPU).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Union

import attrs
import numpy as np

__all__ = [
    "QType", "Q8_0", "Q4_K", "Q6_K", "QTYPES", "qtype_of", "row_bytes",
    "quantize", "dequantize",
    "quantize_q8_0", "dequantize_q8_0",
    "quantize_q4_k", "dequantize_q4_k",
    "quantize_q6_k", "dequantize_q6_k",
]


@attrs.frozen
class QType:
    """A GGML block quantization format.

    Attributes
    ----------
    name : str
        GGML's name ("Q4_K").
    block_size : int
        Weights per block.
    type_size : int
        Bytes per block.
    ggml_type : int
        The GGML type id (equals ``gguf.GGMLQuantizationType[name]``).
    """

    name: str
    block_size: int
    type_size: int
    ggml_type: int

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def __str__(self) -> str:
        return self.name


Q8_0 = QType("Q8_0", 32, 34, 8)
Q4_K = QType("Q4_K", 256, 144, 12)
Q6_K = QType("Q6_K", 256, 210, 14)
QTYPES: dict[str, QType] = {q.name: q for q in (Q8_0, Q4_K, Q6_K)}
_BY_ID = {q.ggml_type: q for q in QTYPES.values()}

QTypeLike = Union[QType, str, int]

_F16_MAX = 65504.0
# Weights per chunk handed to one worker: small enough for the temporaries of
# the Q4_K search to stay in cache, large enough to amortise Python overhead.
_CHUNK_WEIGHTS = 1 << 16
_PARALLEL_MIN_WEIGHTS = 1 << 20


def qtype_of(qtype: QTypeLike) -> QType:
    """Resolve a QType, a name ("q4_k" too) or a GGML type id to a QType.

    Raises
    ------
    ValueError
        For a format this module does not implement.
    """
    if isinstance(qtype, QType):
        return qtype
    if isinstance(qtype, str):
        q = QTYPES.get(qtype.upper())
        if q is None:
            raise ValueError(f"unsupported quantization type {qtype!r}; "
                             f"supported: {', '.join(QTYPES)}")
        return q
    if isinstance(qtype, (int, np.integer)) and not isinstance(qtype, bool):
        q = _BY_ID.get(int(qtype))
        if q is None:
            name = getattr(qtype, "name", str(int(qtype)))
            raise ValueError(f"unsupported quantization type {name} (GGML id {int(qtype)}); "
                             f"supported: {', '.join(QTYPES)}")
        return q
    raise TypeError(f"qtype must be a QType, a name or a GGML type id, got {type(qtype).__name__}")


def row_bytes(qtype: QTypeLike, k: int) -> int:
    """Bytes of one row of ``k`` weights in format ``qtype``.

    Raises
    ------
    ValueError
        If ``k`` is not a positive multiple of the block size.
    """
    q = qtype_of(qtype)
    _check_k(q, int(k))
    return int(k) // q.block_size * q.type_size


def _check_k(q: QType, k: int) -> None:
    if k <= 0 or k % q.block_size:
        raise ValueError(f"{q.name}: row length K={k} is not a positive multiple of the "
                         f"{q.name} block size ({q.block_size} weights per block)")


# ---------------------------------------------------------------------------
# shared helpers

def _as_float_rows(x, q: QType) -> np.ndarray:
    """Validate a float array with last dimension K and return it as float32."""
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise TypeError(f"{q.name} quantize: expected a floating-point array "
                        f"(float32, float64 or float16), got dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{q.name} quantize: expected an array with a last dimension K, got a scalar")
    _check_k(q, x.shape[-1])
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError(f"{q.name} quantize: input contains NaN or infinity")
    return x


def _rint_half_away(v: np.ndarray) -> np.ndarray:
    """Round to nearest, ties away from zero (C ``roundf``), exact in float32."""
    t = np.trunc(v)
    r = np.rint(v)
    tie = np.abs(v - t) == 0.5
    if tie.any():
        r = np.where(tie, t + np.sign(v), r)
    return r


def _to_f16(v: np.ndarray, q: QType, what: str) -> np.ndarray:
    """Round per-block scales to float16, refusing ones out of f16 range."""
    with np.errstate(over="ignore"):
        h = v.astype(np.float16)
    if not np.isfinite(h).all():
        bad = float(np.max(np.abs(v)))
        raise ValueError(f"{q.name} quantize: a block's {what} ({bad:.6g}) does not fit in "
                         f"float16 (max {_F16_MAX}); the input values are too large for {q.name}")
    return h


def _run_blocks(fn: Callable[[np.ndarray], np.ndarray], blocks: np.ndarray,
                q: QType) -> np.ndarray:
    """Apply ``fn`` (float32 blocks -> uint8 blocks) over chunks, in threads."""
    nb = blocks.shape[0]
    out = np.empty((nb, q.type_size), dtype=np.uint8)
    per = max(1, _CHUNK_WEIGHTS // q.block_size)
    starts = range(0, nb, per)

    def work(s: int) -> None:
        out[s:s + per] = fn(blocks[s:s + per])

    workers = min(os.cpu_count() or 1, 8)
    if workers > 1 and blocks.size >= _PARALLEL_MIN_WEIGHTS:
        with ThreadPoolExecutor(max_workers=workers) as ex:
            for _ in ex.map(work, starts):
                pass
    else:
        for s in starts:
            work(s)
    return out


def _raw_blocks(raw, q: QType, shape) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate raw bytes against a logical float shape; return (blocks, shape)."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise TypeError(f"{q.name} dequantize: expected raw bytes as uint8, got dtype {raw.dtype}")
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        shape = (int(shape),)
    if not shape or any(s < 0 for s in shape):
        raise ValueError(f"{q.name} dequantize: bad shape {shape}")
    _check_k(q, shape[-1])
    n = int(np.prod(shape, dtype=np.int64))
    want = n // q.block_size * q.type_size
    if raw.size != want:
        raise ValueError(f"{q.name} dequantize: shape {shape} needs {want} bytes "
                         f"({n // q.block_size} blocks of {q.type_size}), got {raw.size}")
    return np.ascontiguousarray(raw).reshape(-1, q.type_size), shape


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block, as float32 (nb, 1)."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------
# Q8_0

def _q8_0_blocks(x: np.ndarray) -> np.ndarray:
    # GGML's reference: d = max|x| / 127, q = roundf(x / d) (ties away from zero).
    amax = np.abs(x).max(axis=1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    qv = _rint_half_away(x * inv)
    out = np.empty((x.shape[0], Q8_0.type_size), dtype=np.uint8)
    out[:, 0:2] = _to_f16(d, Q8_0, "scale d").view(np.uint8)
    out[:, 2:] = np.clip(qv, -127, 127).astype(np.int8).view(np.uint8)
    return out


def quantize_q8_0(x) -> np.ndarray:
    """Quantize floats (..., K), K a multiple of 32, to Q8_0 bytes (..., K/32*34)."""
    x = _as_float_rows(x, Q8_0)
    out = _run_blocks(_q8_0_blocks, x.reshape(-1, Q8_0.block_size), Q8_0)
    return out.reshape(*x.shape[:-1], row_bytes(Q8_0, x.shape[-1]))


def dequantize_q8_0(raw, shape) -> np.ndarray:
    """Decode Q8_0 bytes to float32 of ``shape`` (last dim K)."""
    b, shape = _raw_blocks(raw, Q8_0, shape)
    d = _f16_field(b, 0)
    qv = b[:, 2:].view(np.int8).astype(np.float32)
    return (qv * d).reshape(shape)


# ---------------------------------------------------------------------------
# Q4_K

def _q4_k_search(x: np.ndarray, nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-weight sub-block: scale s >= 0 and offset m <= 0 with x ~ s*L + m.

    ``x`` is (32, S): one sub-block per column (reductions over axis 0 are
    contiguous vector adds, several times faster than over a short last axis).
    As GGML's make_qkx2_quants: weights w = |x| + rms(x); start from the
    min/max grid, then try grids iscale = (14 + 0.1*i)/(max - origin), i in
    0..nstep, each fitted by weighted least squares (m clamped to <= 0); keep
    the fit with the smallest weighted squared error. Like GGML, each grid is
    anchored at the best offset found so far.
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
        np.clip(lv, f32(0), f32(15), out=lv)
        np.multiply(w, lv, out=tmp)
        sl = tmp.sum(axis=0).astype(f64)
        sxl = np.einsum("ij,ij->j", tmp, x).astype(f64)
        np.multiply(tmp, lv, out=tmp)
        sl2 = tmp.sum(axis=0).astype(f64)
        return sl, sl2, sxl

    # the plain min/max grid, with its own (not fitted) scale and offset
    span = np.where(flat, f32(1), xmax - xmin)
    best_s = (span / f32(15)).astype(f64)
    best_m = xmin.astype(f64)
    sl, sl2, sxl = grid_sums(xmin, (f32(15) / span).astype(f32))
    best_e = (best_s * best_s * sl2 + 2 * best_s * best_m * sl + best_m * best_m * sw
              - 2 * best_s * sxl - 2 * best_m * swx + swx2)
    origin = xmin.copy()
    for i in range(nstep + 1):
        width = xmax - origin
        width[width <= 0] = 1
        sl, sl2, sxl = grid_sums(origin, (f32(14 + 0.1 * i) / width).astype(f32))
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


def _q4_k_blocks(x: np.ndarray, nstep: int = 20) -> np.ndarray:
    f32 = np.float32
    nb = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(nb * 8, 32).T)
    scales, mins = _q4_k_search(sub, nstep)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    max_scale = scales.max(axis=1, keepdims=True)
    max_min = mins.max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv_s = np.where(max_scale > 0, f32(63) / max_scale, f32(0)).astype(f32)
        inv_m = np.where(max_min > 0, f32(63) / max_min, f32(0)).astype(f32)
    ls = np.clip(np.rint(inv_s * scales), 0, 63).astype(np.uint8)
    lm = np.clip(np.rint(inv_m * mins), 0, 63).astype(np.uint8)
    d16 = _to_f16(max_scale / f32(63), Q4_K, "super-block scale d")
    dm16 = _to_f16(max_min / f32(63), Q4_K, "super-block min scale dmin")

    # final 4-bit values against the scales as they will be decoded
    deff = (d16.astype(f32) * ls.astype(f32))[:, :, None]
    meff = (dm16.astype(f32) * lm.astype(f32))[:, :, None]
    xb = x.reshape(nb, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        lv = np.rint((xb + meff) / deff)
    lv = np.where(deff != 0, np.clip(lv, 0, 15), 0).astype(np.uint8)

    out = np.empty((nb, Q4_K.type_size), dtype=np.uint8)
    out[:, 0:2] = d16.view(np.uint8)
    out[:, 2:4] = dm16.view(np.uint8)
    # 12 scale bytes: [0:4] low 6 bits of sc0..3, top 2 bits = sc4..7 >> 4;
    # [4:8] the same for the mins; [8:12] low nibbles sc4..7 | m4..7 << 4.
    out[:, 4:8] = (ls[:, :4] & 0x3F) | ((ls[:, 4:] >> 4) << 6)
    out[:, 8:12] = (lm[:, :4] & 0x3F) | ((lm[:, 4:] >> 4) << 6)
    out[:, 12:16] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    # nibbles: per 64 weights (two sub-blocks), 32 bytes: low = first 32, high = next 32
    pairs = lv.reshape(nb, 4, 2, 32)
    out[:, 16:] = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(nb, 128)
    return out


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
    x = _as_float_rows(x, Q4_K)
    nstep = int(nstep)
    if nstep < 0:
        raise ValueError(f"Q4_K quantize: nstep must be >= 0, got {nstep}")
    out = _run_blocks(lambda b: _q4_k_blocks(b, nstep), x.reshape(-1, 256), Q4_K)
    return out.reshape(*x.shape[:-1], row_bytes(Q4_K, x.shape[-1]))


def _q4_k_scale_min(sb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12 scale bytes (nb, 12) to 6-bit scales and mins (nb, 8)."""
    a, b, c = sb[:, 0:4], sb[:, 4:8], sb[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def dequantize_q4_k(raw, shape) -> np.ndarray:
    """Decode Q4_K bytes to float32 of ``shape`` (last dim K)."""
    b, shape = _raw_blocks(raw, Q4_K, shape)
    nb = b.shape[0]
    d = _f16_field(b, 0)
    dmin = _f16_field(b, 2)
    sc, mn = _q4_k_scale_min(b[:, 4:16])
    dd = (d * sc.astype(np.float32))[:, :, None]
    mm = (dmin * mn.astype(np.float32))[:, :, None]
    qs = b[:, 16:].reshape(nb, 4, 1, 32)
    qv = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 8, 32).astype(np.float32)
    return (dd * qv - mm).reshape(shape)


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
    d16 = _to_f16(d, Q6_K, "super-block scale d")

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
    x = _as_float_rows(x, Q6_K)
    out = _run_blocks(_q6_k_blocks, x.reshape(-1, 256), Q6_K)
    return out.reshape(*x.shape[:-1], row_bytes(Q6_K, x.shape[-1]))


def dequantize_q6_k(raw, shape) -> np.ndarray:
    """Decode Q6_K bytes to float32 of ``shape`` (last dim K)."""
    b, shape = _raw_blocks(raw, Q6_K, shape)
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 1, 64)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16_field(b, 208)
    lo = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(nb, 2, 4, 32)
    hi = np.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], axis=2)
    qv = ((lo | (hi << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    dd = (d * sc)[:, :, None]
    return (dd * qv.reshape(nb, 16, 16)).reshape(shape)


# ---------------------------------------------------------------------------
# dispatch

_QUANTIZE = {"Q8_0": quantize_q8_0, "Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}
_DEQUANTIZE = {"Q8_0": dequantize_q8_0, "Q4_K": dequantize_q4_k, "Q6_K": dequantize_q6_k}


def quantize(x, qtype: QTypeLike) -> np.ndarray:
    """Quantize floats of shape (..., K) to GGML blocks, uint8 (..., row_bytes).

    A 2-D [rows, K] matrix gives [rows, row_bytes(qtype, K)], the byte shape
    GGUF stores for a quantized tensor.

    Raises
    ------
    ValueError
        K not a multiple of the block size, NaN/inf input, scales out of f16 range,
        unsupported qtype.
    TypeError
        A non-floating input dtype.
    """
    return _QUANTIZE[qtype_of(qtype).name](x)


def dequantize(raw, qtype: QTypeLike, shape) -> np.ndarray:
    """Decode GGML blocks (uint8, any shape with the right byte count) to float32 ``shape``.

    Raises
    ------
    ValueError
        K not a multiple of the block size, or a byte count that does not match ``shape``.
    TypeError
        Raw data that is not uint8.
    """
    return _DEQUANTIZE[qtype_of(qtype).name](raw, shape)
