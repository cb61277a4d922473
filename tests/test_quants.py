"""Tests of kernels/quants.py against the gguf package's reference decoder.

Inputs are fresh random data every run from the ``rng`` fixture
(tests/conftest.py: a failing test's report names the seed that reruns it).
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from ptxgen.kernels import quants as Q  # noqa: E402

ALL = ["Q8_0", "Q4_K", "Q6_K"]
# relative RMS error bounds on N(0, 1) data, decoded by gguf (measured: GGML's own
# reference quantizers give 0.00535 / 0.0713 / 0.0177, ours the same; see docs/quants.md)
BOUND = {"Q8_0": 0.0058, "Q4_K": 0.074, "Q6_K": 0.0185}


def gtype(name):
    return gguf.GGMLQuantizationType[name]


def same_bits(a, b):
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def rel_rms(y, x):
    return float(np.sqrt(np.mean((y.astype(np.float64) - x) ** 2) / np.mean(x.astype(np.float64) ** 2)))


# ---------------------------------------------------------------------------
# descriptions

@pytest.mark.parametrize("name", ALL)
def test_qtype_matches_gguf(name):
    q = Q.QTYPES[name]
    assert q.name == name
    assert q.ggml_type == int(gtype(name))
    assert (q.block_size, q.type_size) == gguf.GGML_QUANT_SIZES[gtype(name)]
    assert Q.qtype_of(name.lower()) is q
    assert Q.qtype_of(gtype(name)) is q
    assert Q.qtype_of(q.ggml_type) is q
    assert Q.row_bytes(name, 4096) == 4096 // q.block_size * q.type_size
    assert str(q) == name


def test_bits_per_weight():
    assert Q.Q4_K.bits_per_weight == 4.5
    assert Q.Q6_K.bits_per_weight == 6.5625
    assert Q.Q8_0.bits_per_weight == 8.5


def test_unknown_qtype_refused():
    with pytest.raises(ValueError, match=r"unsupported quantization type 'Q5_K'.*Q8_0, Q4_K, Q6_K"):
        Q.qtype_of("Q5_K")
    with pytest.raises(ValueError, match=r"unsupported quantization type Q5_K \(GGML id 13\)"):
        Q.quantize(np.zeros((1, 256), np.float32), gtype("Q5_K"))
    with pytest.raises(TypeError, match="qtype must be"):
        Q.qtype_of(2.5)


# ---------------------------------------------------------------------------
# dequantizers equal gguf bit for bit

@pytest.mark.parametrize("name", ALL)
def test_dequantize_own_output_equals_gguf(name, rng):
    q = Q.QTYPES[name]
    x = (rng.standard_normal((13, 3 * q.block_size)) * rng.uniform(0.01, 10)).astype(np.float32)
    raw = Q.quantize(x, name)
    assert raw.dtype == np.uint8 and raw.shape == (13, Q.row_bytes(name, x.shape[1]))
    ours = Q.dequantize(raw, name, x.shape)
    ref = gguf_dequantize(raw, gtype(name))
    assert ours.dtype == np.float32
    assert same_bits(ours, ref)


def random_blocks(rng, q, n):
    """Random raw blocks whose f16 fields are finite (normals, subnormals, zeros, negatives)."""
    raw = rng.integers(0, 256, size=(n, q.type_size), dtype=np.uint8)
    offsets = {"Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [q.type_size - 2]}[q.name]
    for off in offsets:
        mag = 10.0 ** rng.uniform(-7, 2, size=n)            # spans f16 subnormals to ~100
        val = (mag * rng.choice([-1.0, 1.0], size=n)).astype(np.float16)
        val[rng.random(n) < 0.05] = 0
        raw[:, off:off + 2] = val.view(np.uint8).reshape(n, 2)
    return raw


@pytest.mark.parametrize("name", ALL)
def test_dequantize_random_bytes_equals_gguf(name, rng):
    q = Q.QTYPES[name]
    rows, nb = 37, 5
    raw = random_blocks(rng, q, rows * nb).reshape(rows, nb * q.type_size)
    ours = Q.dequantize(raw, name, (rows, nb * q.block_size))
    ref = gguf_dequantize(raw, gtype(name))
    assert np.isfinite(ours).all()
    assert same_bits(ours, ref)
    # the per-type function, on a flat buffer, too
    fn = getattr(Q, f"dequantize_{name.lower()}")
    assert same_bits(fn(raw.ravel(), (rows, nb * q.block_size)), ref)


# ---------------------------------------------------------------------------
# quantizers: error bounds (decoded by gguf) and exact cases

@pytest.mark.parametrize("name", ALL)
def test_quantize_error_on_gaussian(name, rng):
    x = rng.standard_normal((128, 4096)).astype(np.float32)
    raw = Q.quantize(x, name)
    err = rel_rms(gguf_dequantize(raw, gtype(name)), x)
    print(f"{name}: relative RMS error {err:.5f} on N(0,1)")
    assert err < BOUND[name], f"{name} error {err:.5f} >= {BOUND[name]}"
    # scale invariance: the relative error holds at other magnitudes too
    for s in (1 / 64, 300.0):      # much smaller scales meet f16's subnormal range
        xs = (x[:16] * np.float32(s)).astype(np.float32)
        e = rel_rms(gguf_dequantize(Q.quantize(xs, name), gtype(name)), xs)
        assert e < BOUND[name] * 1.05, f"{name} at scale {s}: {e:.5f}"


def test_q8_0_matches_ggml_reference_bytes(rng):
    # gguf's Q8_0 quantizer is bit-exact with GGML's reference one; so is ours
    x = (rng.standard_normal((9, 32 * 7)) * 3).astype(np.float32)
    x[0, :32] = np.arange(32) - 16.0       # ties at .5 after scaling exercise the rounding
    assert np.array_equal(Q.quantize_q8_0(x), gguf.quants.quantize(x, gtype("Q8_0")))


def test_q8_0_hand_block():
    x = (np.arange(32, dtype=np.float32) - 16) / 4           # amax = 4
    raw = Q.quantize_q8_0(x)
    d = raw[:2].view(np.float16)[0]
    assert d == np.float16(np.float32(4) / np.float32(127))
    qs = raw[2:].view(np.int8)
    assert qs[0] == -127 and qs[16] == 0 and qs[17] == 8     # 0.25 * 127/4 = 7.94 -> 8


def test_q4_k_layout_known_values():
    # weights exactly on a 4-bit grid with 6-bit sub-block scales ls/16 (d = 1/16) and no
    # min: the decode gives them back (up to a float-noise min), and the nibbles are where
    # GGML puts them
    lv = (np.arange(256) * 7) % 16                       # every sub-block holds 0..15
    ls = np.array([63, 40, 17, 5, 63, 33, 20, 9])
    x = (lv * np.repeat(ls, 32) / 16).astype(np.float32)[None, :]
    raw = Q.quantize_q4_k(x)
    assert raw[0, :2].view(np.float16)[0] == np.float16(1 / 16)
    assert np.allclose(gguf_dequantize(raw, gtype("Q4_K")), x, rtol=0, atol=1e-4)
    qs = raw[0, 16:].reshape(4, 32)                      # 32 bytes per 64 weights
    pairs = lv.reshape(4, 2, 32)
    assert np.array_equal(qs & 0xF, pairs[:, 0])         # low nibbles: first 32 weights
    assert np.array_equal(qs >> 4, pairs[:, 1])          # high nibbles: the next 32
    sc = raw[0, 4:16]
    assert np.array_equal(sc[0:4] & 0x3F, ls[:4]) and np.array_equal(sc[8:12] & 0xF, ls[4:] & 0xF)
    assert np.array_equal(sc[0:4] >> 6, ls[4:] >> 4)


@pytest.mark.parametrize("name", ALL)
def test_quantize_special_rows(name, rng):
    q = Q.QTYPES[name]
    k = 2 * q.block_size
    x = np.zeros((5, k), np.float32)
    x[1] = 0.75                                      # constant positive
    x[2] = -2.5                                      # constant negative
    x[3] = rng.standard_normal(k) * 0.01             # small
    x[4, 7] = 3.0                                    # one spike
    y = gguf_dequantize(Q.quantize(x, name), gtype(name))
    assert np.array_equal(y[0], np.zeros(k, np.float32))
    assert np.allclose(y[1], 0.75, rtol=2e-2) and np.allclose(y[2], -2.5, rtol=2e-2)
    assert rel_rms(y[3], x[3]) < BOUND[name] * 1.5
    assert abs(y[4, 7] - 3.0) < 0.03 and np.abs(np.delete(y[4], 7)).max() < 0.03


@pytest.mark.parametrize("name", ALL)
def test_shapes_and_dtypes(name, rng):
    q = Q.QTYPES[name]
    x = rng.standard_normal((2, 3, q.block_size)).astype(np.float64)     # float64 accepted
    raw = Q.quantize(x, name)
    assert raw.shape == (2, 3, q.type_size)
    assert np.array_equal(raw, Q.quantize(x.astype(np.float32), name))
    one = Q.quantize(x[0, 0], name)                 # a 1-D row
    assert one.shape == (q.type_size,)
    assert Q.dequantize(raw, name, x.shape).shape == x.shape


# ---------------------------------------------------------------------------
# refusals

@pytest.mark.parametrize("name", ALL)
def test_bad_k_refused(name):
    q = Q.QTYPES[name]
    k = q.block_size + 16
    msg = rf"{name}: row length K={k} is not a positive multiple of the {name} block size \({q.block_size} weights per block\)"
    with pytest.raises(ValueError, match=msg):
        Q.quantize(np.ones((2, k), np.float32), name)
    with pytest.raises(ValueError, match=msg):
        Q.row_bytes(name, k)
    with pytest.raises(ValueError, match=msg):
        Q.dequantize(np.zeros(1000, np.uint8), name, (2, k))


@pytest.mark.parametrize("name", ALL)
def test_bad_input_refused(name):
    q = Q.QTYPES[name]
    with pytest.raises(TypeError, match=rf"{name} quantize: expected a floating-point array .* got dtype int32"):
        Q.quantize(np.ones((1, q.block_size), np.int32), name)
    bad = np.ones((1, q.block_size), np.float32)
    bad[0, 3] = np.nan
    with pytest.raises(ValueError, match=rf"{name} quantize: input contains NaN or infinity"):
        Q.quantize(bad, name)
    with pytest.raises(ValueError, match="does not fit in float16"):
        Q.quantize(np.full((1, q.block_size), 1e9, np.float32), name)
    raw = np.zeros(2 * q.type_size, np.uint8)
    with pytest.raises(ValueError, match=rf"{name} dequantize: shape \(1, {3 * q.block_size}\) needs "
                                         rf"{3 * q.type_size} bytes \(3 blocks of {q.type_size}\), got {2 * q.type_size}"):
        Q.dequantize(raw, name, (1, 3 * q.block_size))
    with pytest.raises(TypeError, match=rf"{name} dequantize: expected raw bytes as uint8, got dtype int8"):
        Q.dequantize(raw.view(np.int8), name, (1, 2 * q.block_size))


def test_q4_k_nstep_refused():
    with pytest.raises(ValueError, match="nstep must be >= 0"):
        Q.quantize_q4_k(np.ones((1, 256), np.float32), nstep=-1)


def test_q4_k_more_search_is_not_worse(rng):
    x = rng.standard_normal((32, 1024)).astype(np.float32)
    e0 = rel_rms(Q.dequantize(Q.quantize_q4_k(x, nstep=0), "Q4_K", x.shape), x)
    e20 = rel_rms(Q.dequantize(Q.quantize_q4_k(x, nstep=20), "Q4_K", x.shape), x)
    assert e20 < e0
