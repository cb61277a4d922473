"""The shared-layout helpers: DSL descriptors and swizzles against the PTX
ISA's bit layout and Swizzle<B,4,3> (tests/emu/tc_oracle.py), and the host
tile layout against the canonical layouts."""

import zlib

import numpy as np
import pytest

import ptxgen
from ptxgen import types as T
from ptxgen.smem_layout import decode_descriptor, kmajor_image, matrix_descriptor
from tc_oracle import SPAN, place, swz

MODES = ["none", "32B", "64B", "128B"]
CODE = {"none": 0, "128B": 1, "64B": 2, "32B": 3}     # PTX ISA: bits 62-63


def _seed(request):
    return zlib.crc32(request.node.nodeid.encode())


@pytest.mark.parametrize("mode", MODES)
def test_dsl_descriptor_and_swizzle(backend, request, mode):
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    offs = (rng.integers(0, 1 << 14, 128) * 16).astype(np.uint32)
    lbo, sbo = 16 * int(rng.integers(1, 1 << 10)), 16 * int(rng.integers(1, 1 << 10))
    m = ptxgen.Module("sm_90")
    with m.kernel("d", reqntid=128) as k:
        src = k.param_ptr("offs", T.u32)
        dout, sout = k.param_ptr("desc", T.u64), k.param_ptr("swz", T.u32)
        t = k.tid.x
        a = k.ld(src[t])
        k.st(dout[t], k.bitcast(T.u64, k.wgmma_desc(a, lbo=lbo, sbo=sbo, swizzle=mode)))
        k.st(sout[t], k.swizzle(a + t, mode))
    mod = backend.load(m)
    d, s = backend.poisoned(128, np.uint64), backend.poisoned(128, np.uint32)
    backend.launch_positional(mod["d"], 1, 128, backend.array(offs), d, s)
    want = [(int(o) >> 4) | (lbo >> 4) << 16 | (sbo >> 4) << 32 | CODE[mode] << 62 for o in offs]
    assert [int(v) for v in d.to_numpy()] == want, f"seed={seed}"
    t = np.arange(128, dtype=np.uint32)
    assert [int(v) for v in s.to_numpy()] == [swz(int(o + i), mode) for o, i in zip(offs, t)]


def test_descriptor_round_trip_and_range():
    desc = matrix_descriptor(0x3FFF0, lbo=0x10, sbo=0x3FFF0, swizzle="64B")
    assert decode_descriptor(desc) == {"start": 0x3FFF0, "lbo": 16, "sbo": 0x3FFF0,
                                       "base_offset": 0, "swizzle": "64B"}
    with pytest.raises(ValueError, match="multiple of 16"):
        matrix_descriptor(8, lbo=16, sbo=16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("esize", [1, 2])
def test_kmajor_image_is_the_canonical_layout(request, mode, esize):
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    cols = (SPAN[mode] if mode != "none" else 64) // esize
    tile = rng.integers(0, 1 << (8 * esize), (24, cols)).astype(np.uint8 if esize == 1 else np.uint16)
    img, lbo, sbo = kmajor_image(tile, mode)
    want = np.zeros(img.size, np.uint8)
    place(want, 0, tile, mode, True, lbo, sbo)
    np.testing.assert_array_equal(img, want, err_msg=f"seed={seed}")
