"""Shared-memory tile layouts for the tensor-core instructions: swizzles,
wgmma matrix descriptors and the canonical K-major tile layout.

Pure Python and numpy (no builder): the DSL helpers
(:meth:`ptxgen.tensorcore.TensorCoreMixin.wgmma_desc`, ``swizzle``), the
emulator and host code that fills shared memory all use these.

Swizzles (PTX ISA, "Shared Memory Matrix Layout"; the same patterns as TMA's
``CU_TENSOR_MAP_SWIZZLE_*``) act on a shared-memory byte address: in a
``S``-byte swizzle (S = 32, 64, 128), the 16-byte chunk index (address bits
4 and up, ``log2(S / 16)`` of them) is XORed with the bits just above the
128-byte row (address bits 7 and up, as many).  The pattern repeats every
``8 * S`` bytes, so a swizzled tile starts on such a boundary (256, 512 or
1024 bytes); ptxgen's descriptors take matrix base offset 0 and assume it.

A wgmma matrix descriptor (64 bits): bits 0-13 the start address, 16-29 the
leading-dimension byte offset (LBO), 32-45 the stride-dimension byte offset
(SBO), each as ``(x & 0x3FFFF) >> 4``; 49-51 the matrix base offset; 62-63
the swizzle (0 none, 1 128B, 2 64B, 3 32B).
"""

from __future__ import annotations

import numpy as np

__all__ = ["SWIZZLES", "SWIZZLE_CODE", "swizzle", "matrix_descriptor", "decode_descriptor",
           "kmajor_offsets", "kmajor_image"]

#: swizzle mode -> bytes of one swizzled row ("none": one 16-byte chunk)
SWIZZLES = {"none": 16, "32B": 32, "64B": 64, "128B": 128}
#: swizzle mode -> its code in bits 62-63 of a wgmma descriptor
SWIZZLE_CODE = {"none": 0, "128B": 1, "64B": 2, "32B": 3}
_CODE_SWIZZLE = {v: k for k, v in SWIZZLE_CODE.items()}


def _check_mode(mode):
    if mode not in SWIZZLES:
        raise ValueError(f"unknown swizzle {mode!r}; one of {', '.join(SWIZZLES)}")


def swizzle(offset, mode: str):
    """The swizzled byte address of ``offset`` (an int or an integer array)."""
    _check_mode(mode)
    if mode == "none":
        return offset
    bits = {"32B": 1, "64B": 2, "128B": 3}[mode]
    mask = ((1 << bits) - 1) << 4
    return offset ^ ((offset >> 3) & mask)


def _enc(x, what):
    if x < 0 or x % 16 or x >= 1 << 18:
        raise ValueError(f"{what} {x} must be a multiple of 16 below 2**18")
    return x >> 4


def matrix_descriptor(start: int, *, lbo: int, sbo: int, swizzle: str = "none",
                      base_offset: int = 0) -> int:
    """The 64-bit wgmma descriptor of a matrix at shared byte address
    ``start`` with the given leading/stride byte offsets and swizzle."""
    _check_mode(swizzle)
    if not 0 <= base_offset < 8:
        raise ValueError(f"base_offset {base_offset} must be 0..7")
    return (_enc(start, "start address") | _enc(lbo, "leading byte offset") << 16
            | _enc(sbo, "stride byte offset") << 32 | base_offset << 49
            | SWIZZLE_CODE[swizzle] << 62)


def decode_descriptor(desc: int) -> dict:
    """The fields of a descriptor: start, lbo, sbo (bytes), base_offset, swizzle."""
    desc = int(desc)
    return {"start": (desc & 0x3FFF) << 4, "lbo": ((desc >> 16) & 0x3FFF) << 4,
            "sbo": ((desc >> 32) & 0x3FFF) << 4, "base_offset": (desc >> 49) & 7,
            "swizzle": _CODE_SWIZZLE[(desc >> 62) & 3]}


def kmajor_offsets(rows: int, cols: int, elem_bytes: int, mode: str):
    """Byte offsets (rows x cols, before the swizzle) of a K-major tile in
    ptxgen's canonical arrangement, and its descriptor's (lbo, sbo).

    ``"none"``: 8-row x 16-byte core matrices of 128 contiguous bytes, the
    K chunks of one 8-row group next to each other (LBO = 128, SBO =
    128 x chunks per row).  Swizzled (S bytes): rows of S bytes, 8-row
    groups 8S apart (SBO = 8S, LBO unused: 16); a row wider than S is split
    into columns of S bytes, each ``rows * S`` bytes after the previous.
    ``rows`` must be a multiple of 8 and a row a multiple of 16 bytes (of S
    when swizzled).  Add the tile's base and apply :func:`swizzle` to get
    shared addresses.
    """
    _check_mode(mode)
    row_bytes = cols * elem_bytes
    if rows % 8 or row_bytes % SWIZZLES[mode]:
        raise ValueError(f"a {rows}x{cols} tile of {elem_bytes}-byte elements does not fill "
                         f"8-row groups of {SWIZZLES[mode]}-byte rows")
    r = np.arange(rows)[:, None]
    b = (np.arange(cols) * elem_bytes)[None, :]
    if mode == "none":
        chunks = row_bytes // 16
        off = (r // 8) * (chunks * 128) + (b // 16) * 128 + (r % 8) * 16 + b % 16
        return off, 128, chunks * 128
    s = SWIZZLES[mode]
    off = (b // s) * (rows * s) + r * s + b % s
    return off, 16, 8 * s


def kmajor_image(tile: np.ndarray, mode: str):
    """Shared-memory bytes of a K-major ``tile`` (rows x K, 1- or 2-byte
    elements) laid out by :func:`kmajor_offsets` and swizzled, for a tile
    that starts on a swizzle-pattern boundary (``8 * S`` bytes).  Returns
    ``(uint8 image, lbo, sbo)``."""
    tile = np.ascontiguousarray(tile)
    rows, cols = tile.shape
    eb = tile.dtype.itemsize
    off, lbo, sbo = kmajor_offsets(rows, cols, eb, mode)
    addr = swizzle(off, mode)
    img = np.zeros(int(off.max()) + eb, np.uint8)
    src = tile.view(np.uint8).reshape(rows, cols, eb)
    for j in range(eb):
        img[addr + j] = src[:, :, j]
    return img, lbo, sbo
