"""Test-side oracles for the warpgroup tensor-core tests.

Written from the PTX ISA text (section "Asynchronous Warpgroup Level Matrix
Shared Memory Layout": the canonical layouts as CuTe shape:stride pairs, the
Swizzle<B,4,3> functions, and the wgmma D fragment figure), independently of
ptxgen's own layout code.
"""

import numpy as np

SPAN = {"none": 16, "32B": 32, "64B": 64, "128B": 128}
_BBITS = {"none": 0, "32B": 1, "64B": 2, "128B": 3}


def swz(byte_addr, mode):
    """Swizzle<B,4,3> on a byte address: bits [4, 4+B) ^= bits [7, 7+B)."""
    b = _BBITS[mode]
    return byte_addr ^ (((byte_addr >> 7) & ((1 << b) - 1)) << 4)


def _eval(coord, shape, stride):
    """CuTe layout: split ``coord`` over ``shape`` (first mode fastest), dot ``stride``."""
    off = 0
    for s, d in zip(shape, stride):
        off += (coord % s) * d
        coord //= s
    return off


def canonical(mode, kmajor, esize, lbo, sbo, mn, kk):
    """Element offsets (mn x kk) of the PTX ISA's canonical layout, with LBO
    and SBO in bytes; m and k (the repeat counts) follow from the sizes."""
    t = 16 // esize
    lbo_e, sbo_e = lbo // esize, sbo // esize
    out = np.zeros((mn, kk), np.int64)
    if kmajor:
        row_stride = {"none": t, "32B": 2 * t, "64B": 4 * t, "128B": 8 * t}[mode]
        col = (1, lbo_e) if mode == "none" else (1, t)
        rshape, rstride = (8, mn // 8), (row_stride, sbo_e)
        cshape, cstride = (t, kk // t), col
    else:
        c = SPAN[mode] // 16
        if mode == "none":
            rshape, rstride = (t, 1, mn // t), (1, t, sbo_e)
            cshape, cstride = (8, kk // 8), (t, lbo_e)
        else:
            rshape, rstride = (t, c, mn // (t * c)), (1, t, lbo_e)
            cshape, cstride = (8, kk // 8), (c * t, sbo_e)
    for i in range(mn):
        for j in range(kk):
            out[i, j] = _eval(i, rshape, rstride) + _eval(j, cshape, cstride)
    return out


def place(image, start, mat, mode, kmajor, lbo, sbo):
    """Write ``mat`` (mn x kk, 1- or 2-byte elements) into the uint8 shared
    ``image`` at byte ``start`` in the canonical layout, swizzled."""
    esize = mat.dtype.itemsize
    off = canonical(mode, kmajor, esize, lbo, sbo, *mat.shape)
    raw = mat.view(np.uint8).reshape(mat.shape + (esize,))
    for i in range(mat.shape[0]):
        for j in range(mat.shape[1]):
            a = start + int(off[i, j]) * esize
            for b in range(esize):
                image[swz(a + b, mode)] = raw[i, j, b]


def d_fragment(tid, i):
    """(row, col) of accumulator register ``i`` of warpgroup thread ``tid``."""
    warp, lane = tid // 32, tid % 32
    return 16 * warp + lane // 4 + (8 if (i // 2) % 2 else 0), 8 * (i // 4) + 2 * (lane % 4) + i % 2


def a_fragment(tid, i):
    """(row, col) of f16 A element ``i`` (0..7) of warpgroup thread ``tid``."""
    warp, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    return (16 * warp + g + (8 if i in (2, 3, 6, 7) else 0),
            2 * t + (i % 2) + (8 if i >= 4 else 0))
