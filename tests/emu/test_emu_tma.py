"""TMA (``cp.async.bulk.tensor``) with tensor maps: boxes of 1 to 5
dimensions, out-of-bounds fill, strided tensors and every swizzle, against a
numpy oracle (tests/emu/tc_oracle.py's swizzle); the tensor-map checks and
the launch-argument packing."""

import os
import zlib

import numpy as np
import pytest

import ptxgen
from backends import line_of
from ptxgen import types as T
from ptxgen.abi import ArgPacker, LaunchArgumentError, ParamInfo
from ptxgen.errors import TargetError
from ptxgen.tensor_map import TensorMap
from ptxgen.types import s32, u32, u64
from tc_oracle import swz

HERE = os.path.abspath(__file__)
SHARED = 16384


def _seed(request):
    return zlib.crc32(request.node.nodeid.encode())


def _kernel(rank, nbytes, copy=None):
    """Thread 0 loads one box (``nbytes``) of the map at the coordinates in
    ``coords`` into shared memory; after the mbarrier wait, all 64 threads
    copy ``copy`` bytes (a multiple of 256) of shared memory out."""
    copy = nbytes if copy is None else copy
    m = ptxgen.Module("sm_90")
    with m.kernel("tma", reqntid=64) as k:
        out = k.param_ptr("out", u32)
        cp = k.param_ptr("coords", s32)
        tm = k.tensor_map_param("tmap")
        sh = k.shared_array("sh", T.u32, SHARED // 4, align=1024)
        bar = k.shared_array("bar", u64, 1)
        t = k.tid.x
        first = t.eq(0)
        with k.if_(first):
            k.mbarrier_init(bar[0], 1)
            k.fence_mbarrier_init()
        k.bar_sync(0)
        with k.if_(first):
            k.mbarrier_arrive_expect_tx(bar[0], nbytes)
            k.tma_load(sh[0], tm, [k.ld(cp[i]) for i in range(rank)], bar[0])
        k.mbarrier_wait(bar[0], 0)
        with k.for_range(0, copy // 4 // 64) as j:
            w = j * 64 + t
            k.st(out[w], k.ld(sh[w]))
    return m


def _oracle(g, coords, box, fill_bytes, swizzle):
    """The box's shared bytes: numpy-order ``g``, coords/box innermost first."""
    nb = tuple(reversed(box))
    origin = tuple(reversed(coords))
    vals = np.zeros(nb + (g.itemsize,), np.uint8)
    raw = g.view(np.uint8).reshape(g.shape + (g.itemsize,))
    for idx in np.ndindex(*nb):
        src = tuple(o + i for o, i in zip(origin, idx))
        inside = all(0 <= s < d for s, d in zip(src, g.shape))
        vals[idx] = raw[src] if inside else fill_bytes
    dense = vals.reshape(-1)
    if swizzle == "none":
        return dense
    img = np.zeros_like(dense)
    img[swz(np.arange(dense.size), swizzle)] = dense
    return img


CASES = [   # numpy shape, dtype, box (innermost first), coords, swizzle, fill
    ((300,), np.float32, (64,), (-8,), "none", "zero"),
    ((37, 96), np.float16, (64, 16), (40, 30), "128B", "zero"),
    ((5, 9, 48), np.float16, (16, 4, 2), (40, -1, 4), "32B", "nan"),
    ((3, 4, 5, 64), np.uint8, (64, 2, 3, 2), (0, 4, 1, 2), "64B", "zero"),
    ((2, 3, 2, 3, 8), np.float32, (8, 2, 2, 2, 2), (0, 2, 1, 0, 1), "none", "nan"),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_tma_box_matches_numpy(backend, request, case):
    backend.require_sm(90)
    shape, dt, box, coords, swizzle, fill = CASES[case]
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    g = (rng.integers(0, 256, shape) if dt == np.uint8 else rng.standard_normal(shape)).astype(dt)
    dg = backend.array(g)
    tm = TensorMap.for_array(dg, tuple(reversed(box)), swizzle=swizzle, oob_fill=fill)
    nbytes = tm.box_bytes
    pad = -nbytes % 256
    mod = backend.load(_kernel(len(shape), nbytes, nbytes + pad))
    out = backend.poisoned((nbytes + pad) // 4, np.uint32)
    backend.launch_positional(mod["tma"], 1, 64, out, backend.array(np.array(coords, np.int32)),
                              backend.tensor_map(tm))
    got = out.to_numpy().view(np.uint8)[:nbytes]
    fill_bytes = (np.zeros(g.itemsize, np.uint8) if fill == "zero"
                  else np.full(g.itemsize, 0xFF, np.uint8))
    want = _oracle(g, coords, box, fill_bytes, swizzle)
    if fill == "nan":       # any NaN is a NaN: compare the values' NaN-ness there
        gv, wv = got.view(dt), want.view(dt)
        assert np.array_equal(np.isnan(gv), np.isnan(wv)), f"seed={seed}"
        np.testing.assert_array_equal(gv[~np.isnan(wv)], wv[~np.isnan(wv)], err_msg=f"seed={seed}")
    else:
        np.testing.assert_array_equal(got, want, err_msg=f"seed={seed}")


def test_tma_strided_rows_and_columns_past_the_map(backend, request):
    """A map narrower than the rows it walks: elements past its inner
    dimension are out of bounds even though memory holds them."""
    backend.require_sm(90)
    seed = _seed(request)
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((40, 80)).astype(np.float16)
    dg = backend.array(g)
    tm = TensorMap("f16", dg.ptr, (72, 40), (160,), (64, 8), "128B")
    mod = backend.load(_kernel(2, tm.box_bytes))
    out = backend.poisoned(tm.box_bytes // 4, np.uint32)
    backend.launch_positional(mod["tma"], 1, 64, out, backend.array(np.array([32, 35], np.int32)),
                              backend.tensor_map(tm))
    want = _oracle(np.ascontiguousarray(g[:, :72]), (32, 35), (64, 8), np.zeros(2, np.uint8),
                   "128B")
    np.testing.assert_array_equal(out.to_numpy().view(np.uint8), want, err_msg=f"seed={seed}")


# ------------------------------------------------------------ the map itself
def test_tensor_map_checks_what_the_driver_would_refuse():
    with pytest.raises(ValueError, match="16-byte aligned"):
        TensorMap("f16", 0x1008, (64,), (), (64,))
    with pytest.raises(ValueError, match="multiples of 16"):
        TensorMap("f16", 0x1000, (64, 4), (100,), (64, 4))
    with pytest.raises(ValueError, match="exactly 128 bytes"):
        TensorMap("f16", 0x1000, (64, 4), (128,), (32, 4), "128B")
    with pytest.raises(ValueError, match="'nan' for float"):
        TensorMap("u8", 0x1000, (64,), (), (64,), oob_fill="nan")
    with pytest.raises(ValueError, match="1 .. 256"):
        TensorMap("f32", 0x1000, (1024,), (), (512,))


def test_the_driver_gets_a_stride_array_for_every_rank():
    """cuTensorMapEncodeTiled refuses a null globalStrides even for a rank-1
    map (CUDA_ERROR_INVALID_VALUE): the encoder passes one stride there,
    a valid one (a multiple of 16 covering the row), and the map's own
    strides otherwise."""
    from ptxgen.driver.tensor_map import _stride_array
    assert _stride_array(TensorMap("f32", 0x1000, (300,), (), (64,))) == (1200,)
    assert _stride_array(TensorMap("f16", 0x1000, (100,), (), (64,))) == (208,)
    assert _stride_array(TensorMap("f16", 0x1000, (72, 40), (160,), (64, 8))) == (160,)


@pytest.mark.parametrize("dtype,n", [("u8", 100), ("f16", 300), ("f32", 300), ("f64", 37)])
def test_rank1_maps_encode_on_the_gpu(backend, dtype, n):
    """Every element size encodes as a rank-1 map (the driver's check)."""
    if backend.name == "emu":
        pytest.skip("encoding is the driver's; the emulator takes the description")
    backend.require_sm(90)
    size = {"u8": 1, "f16": 2, "f32": 4, "f64": 8}[dtype]
    arr = backend.array(np.zeros(n * size, np.uint8))
    enc = backend.tensor_map(TensorMap(dtype, arr.ptr, (n,), (), (256 // size if size < 8 else 32,)))
    assert len(enc.tobytes()) == 128


def test_an_emulator_map_given_to_the_driver_packer_says_what_to_do():
    p = ParamInfo("tmap", "b8", 128, align=64, count=128)
    packer = ArgPacker("k", [p])
    with pytest.raises(LaunchArgumentError, match="encode_tiled"):
        packer.pack((TensorMap("f32", 0x1000, (64,), (), (64,)),))


def test_tma_is_refused_before_sm90_at_the_users_line():
    m = ptxgen.Module("sm_80")
    with m.kernel("k") as k:
        sh = k.shared_array("sh", T.b8, 1024, align=128)
        bar = k.shared_array("bar", u64, 1)
        tm = k.tensor_map_param("tmap")
        with pytest.raises(TargetError, match=rf"{HERE}:{line_of(HERE, '# tma-80')}:.*sm_90"):
            k.tma_load(sh[0], tm, (0,), bar[0])  # tma-80


def test_tensor_map_param_is_declared_by_value():
    m = ptxgen.Module("sm_90")
    with m.kernel("k") as k:
        k.tensor_map_param("tmap")
    text = m.to_ptx()
    assert ".param .align 64 .b8 tmap[128]" in text
    assert "cvta.param.u64" in text


@pytest.mark.gpu
def test_driver_encodes_a_map(backend):
    """The driver's CUtensorMap is 128 opaque bytes (GPU only)."""
    if backend.name != "cuda":
        pytest.skip("the driver's encoder needs a GPU")
    backend.require_sm(90)
    arr = backend.array(np.zeros((16, 64), np.float16))
    enc = backend.tensor_map(TensorMap.for_array(arr, (8, 64), swizzle="128B"))
    assert len(enc.tobytes()) == 128
