"""ptxgen.abi: PTX signature parsing and launch-argument packing (CPU only)."""

import struct

import numpy as np
import pytest

from ptxgen.abi import (
    ArgPacker,
    LaunchArgumentError,
    ParamInfo,
    PTXSignatureError,
    pack_args,
    param_layout,
    parse_entries,
    to_bytes,
)

from driver_ptx import BLOCK_SUM_PTX, EMPTY_PTX, VADD_PTX

MIXED_PTX = """
.version 8.0
.target sm_90
.address_size 64
// .entry commented_out(.param .u32 x)
/* .visible .entry also_commented(
   .param .u32 y) */
.func (.param .b32 r) helper(.param .b32 q) { ret; }
.visible .entry mixed(
    .param .align 8 .b8 blob[16],
    .param .f32 eps,   // trailing comment
    .param .s32 k,
    .param .b32 bits,
    .param .u8 small,
    .param .f16 h,
    .param .bf16 hb,
    .param .f64 d,
    .param .s64 off
) .maxntid 128, 1, 1
{
    ret;
}
.entry plain_entry(.param .u64 p)
{ ret; }
"""


class FakeBuffer:
    """Emulator-style buffer: exposes an integer .ptr and a freed flag."""

    def __init__(self, ptr, freed=False):
        self.ptr = ptr
        self.freed = freed


class FakeCuda:
    """Object with a __cuda_array_interface__ (like a torch/cupy array)."""

    def __init__(self, ptr, shape=(4,)):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": "<f4", "version": 3}


class FreedArray:
    """Mimics ptxgen.driver.DeviceArray after free(): freed flag set, .ptr raises."""

    freed = True

    @property
    def ptr(self):
        raise ValueError("DeviceArray was freed")


# ----------------------------------------------------------------------------- parsing


def test_parse_vadd_signature():
    (params,) = parse_entries(VADD_PTX).values()
    assert [p.name for p in params] == ["a", "b", "c", "n"]
    a, _, _, n = params
    assert (a.type, a.size, a.is_pointer, a.state_space, a.align, a.index) == ("u64", 8, True, "global", 4, 0)
    assert (n.type, n.size, n.is_pointer, n.index) == ("u32", 4, False, 3)


def test_parse_empty_and_block_sum():
    assert parse_entries(EMPTY_PTX) == {"empty": []}
    params = parse_entries(BLOCK_SUM_PTX)["block_sum"]
    assert [(p.name, p.type, p.is_pointer) for p in params] == [
        ("x", "u64", True), ("out", "u64", True), ("n", "u32", False)]


def test_parse_ignores_comments_and_funcs_and_reads_all_types():
    entries = parse_entries(MIXED_PTX)
    assert list(entries) == ["mixed", "plain_entry"]
    m = {p.name: p for p in entries["mixed"]}
    assert (m["blob"].type, m["blob"].count, m["blob"].size, m["blob"].align) == ("b8", 16, 16, 8)
    assert [(p.type, p.size) for p in entries["mixed"][1:]] == [
        ("f32", 4), ("s32", 4), ("b32", 4), ("u8", 1), ("f16", 2), ("bf16", 2), ("f64", 8), ("s64", 8)]
    p = entries["plain_entry"][0]
    assert p.type == "u64" and not p.is_pointer and p.accepts_address


@pytest.mark.parametrize("decl", [".param .u33 x", ".param .u32", ".reg .u32 x", ".param .u32 .weird x"])
def test_parse_rejects_bad_params(decl):
    with pytest.raises(PTXSignatureError, match="entry k"):
        parse_entries(f".visible .entry k({decl}) {{ ret; }}")


def test_param_layout_aligns_each_param():
    params = parse_entries(MIXED_PTX)["mixed"]
    offsets, size = param_layout(params)
    assert offsets == [0, 16, 20, 24, 28, 30, 32, 40, 48]
    assert size == 56


# ----------------------------------------------------------------------------- packing


def test_pack_vadd_bytes_little_endian():
    params = parse_entries(VADD_PTX)["vadd"]
    blob = ArgPacker("vadd", params).pack((0x1000, FakeBuffer(0x2000), FakeCuda(0x3000), 77))
    assert blob == struct.pack("<QQQI4x", 0x1000, 0x2000, 0x3000, 77)


def test_pack_args_pairs_and_to_bytes():
    params = parse_entries(MIXED_PTX)["mixed"]
    args = (bytes(range(16)), 1.5, -3, -1, 255, 0.5, 1.0, 2.25, -(2**40))
    pairs = pack_args(params, args, "mixed")
    values = [v for _, v in pairs]
    assert values[2] == -3
    assert values[3] == 0xFFFFFFFF  # untyped .b32 accepts -1 as all ones
    assert values[6] == 0x3F80  # bf16 of 1.0
    raw = b"".join(to_bytes(p, v) for p, v in pairs)
    assert raw[:16] == bytes(range(16))
    assert to_bytes(pairs[1][0], 1.5) == struct.pack("<f", 1.5)
    assert to_bytes(pairs[5][0], 0.5) == struct.pack("<e", 0.5)
    blob = ArgPacker("mixed", params).pack(args)
    assert len(blob) == 56 and blob[16:20] == struct.pack("<f", 1.5) and blob[48:56] == struct.pack("<q", -(2**40))


def test_numpy_scalars_accepted():
    params = parse_entries(MIXED_PTX)["mixed"]
    args = (np.arange(4, dtype=np.int32), np.float32(2.0), np.int64(-5), np.uint32(7), np.uint8(3),
            np.float16(1.0), np.float32(1.0), np.float64(3.0), np.int64(9))
    values = ArgPacker("mixed", params).values(args)
    assert values[0] == np.arange(4, dtype=np.int32).tobytes()
    assert values[1:5] == (2.0, -5, 7, 3)
    assert ArgPacker("p", parse_entries(MIXED_PTX)["plain_entry"]).values((np.uint64(64),)) == (64,)


def test_pointer_forms():
    params = parse_entries(VADD_PTX)["vadd"]
    vals = ArgPacker("vadd", params).values((FakeCuda(16), FakeBuffer(32), 0, 1))
    assert vals == (16, 32, 0, 1)


def test_u64_without_ptr_takes_arrays_too():
    params = parse_entries(MIXED_PTX)["plain_entry"]
    assert ArgPacker("plain_entry", params).values((FakeCuda(4096),)) == (4096,)


# ----------------------------------------------------------------------------- refusals


def _refusal(params, args, name="vadd"):
    with pytest.raises(LaunchArgumentError) as ei:
        ArgPacker(name, params).values(args)
    return str(ei.value)


VADD = parse_entries(VADD_PTX)["vadd"]


def test_refuses_wrong_count():
    msg = _refusal(VADD, (1, 2, 3))
    assert "vadd() takes 4 arguments" in msg and "but 3 were given" in msg and ".u32 n" in msg
    assert "takes 0 arguments" in _refusal([], (1,), "empty")


def test_refuses_array_for_scalar():
    msg = _refusal(VADD, (1, 2, 3, FakeCuda(8)))
    assert "parameter 'n' (position 3 of 4" in msg and "scalar integer" in msg and "FakeCuda" in msg
    msg = _refusal(VADD, (1, 2, 3, np.zeros(3)))
    assert "scalar integer" in msg and "shape (3,)" in msg


def test_refuses_scalar_float_for_pointer_and_host_array():
    msg = _refusal(VADD, (1.0, 2, 3, 4))
    assert "parameter 'a' (position 0 of 4" in msg and "device pointer" in msg and "got float 1.0" in msg
    msg = _refusal(VADD, (np.zeros(4, np.float32), 2, 3, 4))
    assert "host memory" in msg and "from_numpy" in msg
    assert "bool" in _refusal(VADD, (True, 2, 3, 4))
    assert "None" in _refusal(VADD, (None, 2, 3, 4)) or "NoneType" in _refusal(VADD, (None, 2, 3, 4))


def test_refuses_float_for_int():
    msg = _refusal(VADD, (1, 2, 3, 2.0))
    assert "no implicit float truncation" in msg and "float 2.0" in msg
    assert "no implicit float truncation" in _refusal(VADD, (1, 2, 3, np.float32(2.0)))


@pytest.mark.parametrize("value, fragment", [
    (-1, "[0, 4294967295]"),
    (2**32, "4294967296 (out of range)"),
])
def test_refuses_out_of_range_u32(value, fragment):
    msg = _refusal(VADD, (1, 2, 3, value))
    assert fragment in msg and ".u32" in msg


def test_refuses_out_of_range_other_widths():
    params = parse_entries(MIXED_PTX)["mixed"]
    good = [bytes(16), 1.0, 0, 0, 0, 0.0, 0.0, 0.0, 0]

    def refuse(i, v):
        args = list(good)
        args[i] = v
        return _refusal(params, tuple(args), "mixed")

    assert "[-2147483648, 2147483647]" in refuse(2, 2**31)
    assert "[-128, 255]" in refuse(4, 256) or "[0, 255]" in refuse(4, 256)
    assert "[-2147483648, 4294967295]" in refuse(3, 2**32)
    assert "f32 range" in refuse(1, 1e39)
    assert "f16 range" in refuse(5, 1e5)
    assert "16 bytes" in refuse(0, bytes(15))
    assert "address" in _refusal(VADD, (-8, 2, 3, 4)) or "2**64" in _refusal(VADD, (-8, 2, 3, 4))


def test_refuses_freed_arrays():
    msg = _refusal(VADD, (1, FreedArray(), 3, 4))
    assert "parameter 'b' (position 1 of 4" in msg and "freed" in msg
    msg = _refusal(VADD, (1, 2, FakeBuffer(64, freed=True), 4))
    assert "parameter 'c'" in msg and "freed" in msg


def test_refuses_non_integer_ptr_attribute():
    class Weird:
        ptr = "0x1000"

    assert "integer address" in _refusal(VADD, (Weird(), 2, 3, 4))


def test_error_is_value_error():
    assert issubclass(LaunchArgumentError, ValueError)
    assert ParamInfo("x", "u32", 4).describe() == ".param .u32 x"


def test_registered_pointer_type_fast_path_and_refusal():
    from ptxgen.abi import register_pointer_type

    class EmuBuffer:
        def __init__(self, addr):
            self.addr = addr

    register_pointer_type(EmuBuffer, lambda b: b.addr)
    packer = ArgPacker("vadd", VADD)
    assert packer.values((EmuBuffer(64), EmuBuffer(128), 0, 3)) == (64, 128, 0, 3)
    # a getter answering 0 sends the object down the checked path, which explains the refusal
    msg = _refusal(VADD, (EmuBuffer(0), 1, 2, 3))
    assert "parameter 'a'" in msg and "EmuBuffer" in msg


def test_generated_pack_into_matches_pack():
    params = parse_entries(MIXED_PTX)["mixed"]
    packer = ArgPacker("mixed", params)
    args = (bytes(range(16)), 1.5, -3, -1, 255, 0.5, 1.0, 2.25, -(2**40))
    buf = bytearray(packer.size)
    packer.pack_into(buf, args)
    assert bytes(buf) == packer.pack(args)
    assert "def values(args):" in packer.source and "def pack_into(buffer, args):" in packer.source
    with pytest.raises(LaunchArgumentError, match="parameter 'eps'"):
        packer.pack_into(bytearray(packer.size), (bytes(16), "x", 0, 0, 0, 0.0, 0.0, 0.0, 0))


def test_bf16_arguments_round_to_nearest_even(rng):
    """A .bf16 argument is the f32 value rounded to nearest, ties to even:
    the oracle keeps the top 16 bits and rounds up when the dropped 16 bits
    exceed half, or equal half with an odd kept part.  Half the values are
    exact ties."""
    params = parse_entries(MIXED_PTX)["mixed"]
    hb = params[6]
    assert hb.type == "bf16"
    bits = rng.integers(0, 0x7F000000, 200, dtype=np.int64).astype(np.uint32)
    bits[::2] = (bits[::2] & 0xFFFF0000) | 0x8000                   # exact ties
    for b in bits.tolist():
        x = float(np.uint32(b).view(np.float32))
        kept, dropped = b >> 16, b & 0xFFFF
        want = kept + (dropped > 0x8000 or (dropped == 0x8000 and kept & 1))
        (_, got), = pack_args([hb], (x,), "mixed")
        assert got == want, (hex(b), hex(got), hex(want))
