"""Tests of kernels/quants.py against the gguf package's reference decoder.

Inputs are fresh random data every run from the suite's seeded ``rng`` fixture; a failing
test shows its seed (``pytest --seed N`` reruns it).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from ptxgen.kernels import quants as Q  # noqa: E402

BLOCKS = ["Q8_0", "Q4_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K"]
FLOATS = ["F32", "F16", "BF16"]
ALL = BLOCKS + FLOATS                       # the types quantize() writes
DECODE_ONLY = ["Q2_K", "Q3_K"]
# relative RMS error bounds on N(0, 1) data, decoded by gguf (measured, 128 x 4096: GGML's
# own reference quantizers give Q8_0 0.00535, Q4_K 0.0713, Q6_K 0.0177, Q5_K 0.0361; the
# legacy quantizers here give GGML's bytes; see docs/quants.md)
BOUND = {"Q8_0": 0.0058, "Q4_K": 0.074, "Q6_K": 0.0185,
         "Q4_0": 0.0875, "Q4_1": 0.0797, "Q5_0": 0.0435, "Q5_1": 0.0386, "Q5_K": 0.0368,
         "F32": 1e-12, "F16": 2.13e-4, "BF16": 1.7e-3}
# GGML's reference quantizers that gguf's Python ones reproduce byte for byte
SAME_BYTES_AS_GGUF = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16", "F32"]


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

@pytest.mark.parametrize("name", ALL + DECODE_ONLY)
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


def test_type_lists():
    assert sorted(Q.QTYPES) == sorted(ALL + DECODE_ONLY)
    assert sorted(Q.QUANTIZABLE) == sorted(ALL)


def test_bits_per_weight():
    assert Q.Q4_K.bits_per_weight == 4.5
    assert Q.Q5_K.bits_per_weight == 5.5
    assert Q.Q6_K.bits_per_weight == 6.5625
    assert Q.Q8_0.bits_per_weight == 8.5
    assert Q.Q4_0.bits_per_weight == 4.5 and Q.Q4_1.bits_per_weight == 5.0
    assert Q.Q5_0.bits_per_weight == 5.5 and Q.Q5_1.bits_per_weight == 6.0
    assert Q.Q2_K.bits_per_weight == 2.625 and Q.Q3_K.bits_per_weight == 3.4375
    assert Q.F16.bits_per_weight == Q.BF16.bits_per_weight == 16.0


def test_unknown_qtype_refused():
    with pytest.raises(ValueError, match=r"unsupported quantization type 'IQ2_XXS'.*Q4_K, Q6_K, Q8_0, Q4_0"):
        Q.qtype_of("IQ2_XXS")
    with pytest.raises(ValueError, match=r"unsupported quantization type Q8_1 \(GGML id 9\)"):
        Q.quantize(np.zeros((1, 256), np.float32), gtype("Q8_1"))
    with pytest.raises(TypeError, match="qtype must be"):
        Q.qtype_of(2.5)


@pytest.mark.parametrize("name", DECODE_ONLY)
def test_decode_only_types_refuse_quantize(name):
    with pytest.raises(NotImplementedError, match=rf"{name}: this package decodes {name} but has no quantizer"):
        Q.quantize(np.ones((1, 256), np.float32), name)


# ---------------------------------------------------------------------------
# dequantizers equal gguf bit for bit

@pytest.mark.parametrize("name", ALL)
def test_dequantize_own_output_equals_gguf(name, rng):
    q = Q.QTYPES[name]
    k = 3 * max(q.block_size, 32)
    x = (rng.standard_normal((13, k)) * rng.uniform(0.01, 10)).astype(np.float32)
    raw = Q.quantize(x, name)
    assert raw.dtype == np.uint8 and raw.shape == (13, Q.row_bytes(name, k))
    ours = Q.dequantize(raw, name, x.shape)
    ref = gguf_dequantize(raw, gtype(name))
    assert ours.dtype == np.float32
    assert same_bits(ours, ref)


# byte offsets of each block's f16 fields (scales, mins)
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
              "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
# f16 values at the edges: largest finite, smallest normal and subnormal, signed zeros
F16_EDGES = np.array([65504.0, -65504.0, 2.0 ** -14, -(2.0 ** -14), 2.0 ** -24, -(2.0 ** -24),
                      0.0, -0.0, 1.0, -1.0], dtype=np.float16)


def random_blocks(rng, q, n):
    """Random raw blocks whose f16 fields are finite: normals over f16's whole
    exponent range, subnormals, signed zeros and the extreme values."""
    raw = rng.integers(0, 256, size=(n, q.type_size), dtype=np.uint8)
    for off in F16_FIELDS[q.name]:
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF        # inf/NaN exponent -> a finite one
        val = bits.view(np.float16).copy()
        pick = rng.random(n)
        val[pick < 0.1] = rng.choice(F16_EDGES, size=int((pick < 0.1).sum()))
        val[0] = F16_EDGES[(off // 2) % 2]                # +-65504 in every run
        val[1 % n] = np.float16(-0.0)
        raw[:, off:off + 2] = val.view(np.uint8).reshape(n, 2)
    return raw


def random_floats(rng, name, n):
    """Raw F32/F16/BF16 bytes of random finite values over the whole exponent range."""
    if name == "F32":
        bits = rng.integers(0, 1 << 32, size=n, dtype=np.uint32)
        bits[(bits & 0x7F800000) == 0x7F800000] &= 0xBFFFFFFF
    else:
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
        exp = 0x7C00 if name == "F16" else 0x7F80
        bits[(bits & exp) == exp] &= ~np.uint16(0x4000)
        bits[:4] = [0x0000, 0x8000, 0x0001, 0x8001]      # signed zeros, smallest subnormals
    return bits.view(np.uint8)


@pytest.mark.parametrize("name", BLOCKS + DECODE_ONLY + FLOATS)
def test_dequantize_random_bytes_equals_gguf(name, rng):
    q = Q.QTYPES[name]
    rows, nb = 37, 5 * max(1, 32 // q.block_size)
    if name in FLOATS:
        raw = random_floats(rng, name, rows * nb).reshape(rows, nb * q.type_size)
    else:
        raw = random_blocks(rng, q, rows * nb).reshape(rows, nb * q.type_size)
    ours = Q.dequantize(raw, name, (rows, nb * q.block_size))
    ref = gguf_dequantize(raw, gtype(name))
    assert np.isfinite(ours).all()
    assert same_bits(ours, ref)
    # the per-type function, on a flat buffer, too
    fn = getattr(Q, f"dequantize_{name.lower()}")
    assert same_bits(fn(raw.ravel(), (rows, nb * q.block_size)), ref)


@pytest.mark.parametrize("name", BLOCKS + DECODE_ONLY)
def test_dequantize_signed_zero_scales(name, rng):
    # scales of -0 and +0 decode to zeros whose signs follow IEEE products, as in gguf
    q = Q.QTYPES[name]
    raw = random_blocks(rng, q, 8)
    for off in F16_FIELDS[name]:
        raw[:4, off:off + 2] = np.array([0x00, 0x80], np.uint8)     # -0
        raw[4:, off:off + 2] = 0                                      # +0
    ours = Q.dequantize(raw, name, (1, 8 * q.block_size))
    ref = gguf_dequantize(raw.reshape(1, -1), gtype(name))
    assert not ours.any()
    assert same_bits(ours, ref)


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


# per-element error of the 32-blocks: at most this fraction of the block's range
# (max|x| for the symmetric types, max - min for those with an offset), plus the f16
# rounding of the scale d and the offset m: q |d - d16| <= (q d) 2^-11 <= span 2^-11
# (the largest level times d is the block's range) and |m - m16| <= |m| 2^-11 <=
# max|x| 2^-11, so 2^-11 (span + max|x|) in all (for the symmetric types span =
# max|x|: 2^-10 max|x|)
ELEMENT_BOUND = {"Q4_0": 1 / 8, "Q5_0": 1 / 16, "Q8_0": 1 / 254, "Q4_1": 1 / 30, "Q5_1": 1 / 62}


@pytest.mark.parametrize("name", sorted(ELEMENT_BOUND))
def test_legacy_quantize_elementwise_error(name, rng):
    # the symmetric grids put max|x| at -8 (-16): a value +max|x| clips to 7 (15), off by a step
    x = (rng.standard_normal((64, 32 * 16)) * rng.uniform(0.1, 10)).astype(np.float64)
    y = gguf_dequantize(Q.quantize(x, name), gtype(name)).astype(np.float64)
    xb, yb = x.reshape(-1, 32), y.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    span = amax if name in ("Q4_0", "Q5_0", "Q8_0") else xb.max(1, keepdims=True) - xb.min(1, keepdims=True)
    limit = ELEMENT_BOUND[name] * span * (1 + 1e-6) + 2.0 ** -11 * (span + amax)
    worst = float((np.abs(yb - xb) / limit).max())
    assert worst <= 1, f"{name}: error {worst:.3f} x the bound"


@pytest.mark.parametrize("name", SAME_BYTES_AS_GGUF)
def test_quantize_bytes_equal_gguf(name, rng):
    # gguf's Python quantizers for these types reproduce GGML's reference ones
    x = (rng.standard_normal((9, 32 * 7)) * rng.uniform(0.01, 100)).astype(np.float32)
    x[0, :32] = np.arange(32) - 16.0                  # ties at .5 after scaling exercise the rounding
    x[1, :32] = np.linspace(-1, 1, 32)                # both ends at max|x|: the first one wins
    x[2, :32] = np.float32(0.75)
    ref = gguf.quants.quantize(x, gtype(name)).view(np.uint8).reshape(x.shape[0], -1)
    assert np.array_equal(Q.quantize(x, name), ref)


def test_q8_0_hand_block():
    x = (np.arange(32, dtype=np.float32) - 16) / 4           # amax = 4
    raw = Q.quantize_q8_0(x)
    d = raw[:2].view(np.float16)[0]
    assert d == np.float16(np.float32(4) / np.float32(127))
    qs = raw[2:].view(np.int8)
    assert qs[0] == -127 and qs[16] == 0 and qs[17] == 8     # 0.25 * 127/4 = 7.94 -> 8


def test_q4_0_hand_block():
    # max|x| = 4 at x[3] = -4 (negative): d = -4/-8 = 0.5, q = x/0.5 + 8
    x = np.zeros(32, np.float32)
    x[3], x[16], x[31], x[5] = -4.0, 3.0, 4.0, 0.26
    raw = Q.quantize_q4_0(x)
    assert raw[:2].view(np.float16)[0] == np.float16(0.5)
    qs = raw[2:]
    assert qs[3] & 0xF == 0                    # -4 -> 0
    assert qs[0] >> 4 == 14                    # weight 16: 3/0.5 + 8 = 14, high nibble of byte 0
    assert qs[15] >> 4 == 15                   # weight 31: 4/0.5 + 8 = 16 clips to 15
    assert qs[5] & 0xF == 9                    # 0.26/0.5 + 8.5 = 9.02 truncates to 9
    assert qs[1] & 0xF == 8 and qs[1] >> 4 == 8


def test_q5_0_high_bits_layout():
    # codes 0..31 in order: the fifth bit of weight j is bit j of qh, the low nibbles
    # of weights j and j+16 share byte j
    d = 0.25
    x = ((np.arange(32) - 16) * d).astype(np.float32)
    x[0] = -16 * d                             # the extreme, negative: d = x[0] / -16
    raw = Q.quantize_q5_0(x)
    assert raw[:2].view(np.float16)[0] == np.float16(d)
    qh = int.from_bytes(raw[2:6].tobytes(), "little")
    codes = np.arange(32)
    assert qh == sum(1 << j for j in range(32) if codes[j] & 16)
    assert np.array_equal(raw[6:] & 0xF, codes[:16] & 0xF)
    assert np.array_equal(raw[6:] >> 4, codes[16:] & 0xF)
    assert np.array_equal(Q.dequantize_q5_0(raw, (32,)), x)


def test_zero_block_matches_ggml_reference():
    # GGML starts max|x| from +0, so an all-zero block gets d = 0 / -8 = -0 (0x8000)
    for name, fn in (("Q4_0", Q.quantize_q4_0), ("Q5_0", Q.quantize_q5_0)):
        for z in (0.0, -0.0):
            raw = fn(np.full(32, z, np.float32))
            assert raw[:2].tobytes() == b"\x00\x80", name
            assert not Q.dequantize(raw, name, (32,)).any()


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


def test_q5_k_layout_known_values():
    # weights on a 5-bit grid (every sub-block holds 0..31) with scales ls/16: decoded back,
    # low nibbles as in Q4_K, bit s of qh[j] the fifth bit of weight j of sub-block s
    lv = (np.arange(256) * 11) % 32
    ls = np.array([63, 41, 17, 6, 63, 30, 21, 9])
    x = (lv * np.repeat(ls, 32) / 16).astype(np.float32)[None, :]
    raw = Q.quantize_q5_k(x)
    assert raw[0, :2].view(np.float16)[0] == np.float16(1 / 16)
    assert np.allclose(gguf_dequantize(raw, gtype("Q5_K")), x, rtol=0, atol=5e-4)   # max |x| 122
    qh, qs = raw[0, 16:48], raw[0, 48:].reshape(4, 32)
    sub = lv.reshape(8, 32)
    for s in range(8):
        assert np.array_equal((qh >> s) & 1, sub[s] >> 4)
    pairs = (lv & 0xF).reshape(4, 2, 32)
    assert np.array_equal(qs & 0xF, pairs[:, 0]) and np.array_equal(qs >> 4, pairs[:, 1])
    sc = raw[0, 4:16]
    assert np.array_equal(sc[0:4] & 0x3F, ls[:4]) and np.array_equal(sc[8:12] & 0xF, ls[4:] & 0xF)


def test_bf16_rounding():
    # ties to even on the 16 dropped bits; beyond the largest finite bf16, refused
    u = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x80000000], np.uint32)
    got = Q.quantize_bf16(u.view(np.float32)).view(np.uint16)
    assert list(got) == [0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x8000]
    with pytest.raises(ValueError, match=r"BF16 quantize: a value \(3\.4028.e\+38\) rounds past"):
        Q.quantize_bf16(np.array([1.0, np.finfo(np.float32).max], np.float32))


@pytest.mark.parametrize("name", ALL)
def test_quantize_special_rows(name, rng):
    q = Q.QTYPES[name]
    k = 2 * max(q.block_size, 32)
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

@pytest.mark.parametrize("name", BLOCKS + DECODE_ONLY + FLOATS)
def test_bad_k_refused(name):
    q = Q.QTYPES[name]
    for k in ((q.block_size + 16, 0) if q.block_size > 1 else (0,)):
        msg = (rf"{name}: row length K={k} is not a positive multiple of the {name} block size "
               rf"\({q.block_size} weights per block\)")
        if name in ALL:
            with pytest.raises(ValueError, match=msg):
                Q.quantize(np.ones((2, k), np.float32), name)
        with pytest.raises(ValueError, match=msg):
            Q.row_bytes(name, k)
        with pytest.raises(ValueError, match=msg):
            Q.dequantize(np.zeros(1000, np.uint8), name, (2, k))


@pytest.mark.parametrize("name", BLOCKS + DECODE_ONLY + FLOATS)
def test_bad_bytes_refused(name):
    q = Q.QTYPES[name]
    k = 3 * max(q.block_size, 32)
    n = k // q.block_size
    raw = np.zeros((n - 1) * q.type_size, np.uint8)
    with pytest.raises(ValueError, match=rf"{name} dequantize: shape \(1, {k}\) needs "
                                         rf"{n * q.type_size} bytes \({n} blocks of {q.type_size}\), "
                                         rf"got {(n - 1) * q.type_size}"):
        Q.dequantize(raw, name, (1, k))
    with pytest.raises(TypeError, match=rf"{name} dequantize: expected raw bytes as uint8, got dtype int8"):
        Q.dequantize(np.zeros(n * q.type_size, np.int8), name, (1, k))
    with pytest.raises(ValueError, match=rf"{name} dequantize: bad shape \(\)"):
        Q.dequantize(raw, name, ())


@pytest.mark.parametrize("name", ALL)
def test_bad_input_refused(name):
    q = Q.QTYPES[name]
    k = max(q.block_size, 32)
    with pytest.raises(TypeError, match=rf"{name} quantize: expected a floating-point array .* got dtype int32"):
        Q.quantize(np.ones((1, k), np.int32), name)
    with pytest.raises(ValueError, match=rf"{name} quantize: expected an array with a last dimension K"):
        Q.quantize(np.float32(1.0), name)
    bad = np.ones((1, k), np.float32)
    bad[0, 3] = np.nan
    with pytest.raises(ValueError, match=rf"{name} quantize: input contains NaN or infinity"):
        Q.quantize(bad, name)
    bad[0, 3] = -np.inf
    with pytest.raises(ValueError, match=rf"{name} quantize: input contains NaN or infinity"):
        Q.quantize(bad, name)
    if name not in ("F32", "BF16"):            # these hold float32's range
        with pytest.raises(ValueError, match="does not fit in float16"):
            Q.quantize(np.full((1, k), 1e9, np.float32), name)


def test_q4_1_offset_out_of_f16_range_refused():
    x = np.full((1, 32), -7e4, np.float32)
    x[0, 0] = -6.9e4
    with pytest.raises(ValueError, match=r"Q4_1 quantize: a block's minimum m \(70000\) does not fit in float16"):
        Q.quantize_q4_1(x)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_k_nstep_refused(name):
    fn = getattr(Q, f"quantize_{name.lower()}")
    with pytest.raises(ValueError, match=rf"{name} quantize: nstep must be >= 0"):
        fn(np.ones((1, 256), np.float32), nstep=-1)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_k_more_search_is_not_worse(name, rng):
    fn = getattr(Q, f"quantize_{name.lower()}")
    x = rng.standard_normal((32, 1024)).astype(np.float32)
    e0 = rel_rms(Q.dequantize(fn(x, nstep=0), name, x.shape), x)
    e_full = rel_rms(Q.dequantize(fn(x), name, x.shape), x)
    assert e_full < e0


def test_registry_says_which_kernels_read_a_type():
    """One registry: the specs take exactly the types it lists for them, by
    GGML's names, and a loader can ask it by name or GGML id."""
    from ptxgen.kernels import embedding, gemm, gemv
    assert Q.names_for("gemv") == gemv.GEMV_QTYPES
    assert Q.names_for("gemm") == gemm.GEMM_QTYPES
    assert Q.names_for("embedding") == embedding.EMBEDDING_QTYPES
    for q in Q.QTYPES.values():
        assert q.name == q.name.upper()
        assert Q.qtype_of(q.ggml_type) is q and Q.qtype_of(q.name.lower()) is q
        for kernel, make in (("gemv", lambda: gemv.GemvSpec(q.name, 256)),
                             ("gemm", lambda: gemm.GemmSpec(q.name, 256)),
                             ("embedding", lambda: embedding.EmbeddingSpec(qtype=q.name))):
            if q.read_by(kernel):
                assert make().qtype == q.name
                assert Q.qtype_of(q.name, kernel) is q
            else:
                with pytest.raises(ValueError):
                    make()
                with pytest.raises(ValueError, match=f"no {kernel} kernel reads {q.name}"):
                    Q.qtype_of(q.name, kernel)
    assert not Q.Q2_K.kernels and Q.F32.kernels == {"embedding"}
    assert Q.Q4_K.row_bytes(512) == 288
    with pytest.raises(ValueError, match="unknown reader 'gemmm'"):
        Q.Q4_K.read_by("gemmm")
