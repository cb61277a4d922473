"""Hostile GGUF files: the cases of issue 53 and their relatives, each made
from a valid small file (or from nothing) byte by byte.

:func:`corpus` maps a case name to ``(bytes, stage, message)``: ``stage`` is
where the file must be refused (``"file"``: by the reader of the file's
structure, so ``info`` refuses it too; ``"model"``: by the model file's
checks, so ``info`` describes it and says why it cannot run) and
``message`` a piece of the one-line error.
"""

from __future__ import annotations

import struct

from gguf_image import (ARR, F32, I32, Image, Kv, STR, U32, U64, U8, array, scalar,
                        string, walk)

INF, NAN = float("inf"), float("nan")


def _header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def corpus(llama: bytes, gpt2: bytes) -> dict:
    """Case name -> ``(bytes, stage, message)``; ``llama`` and ``gpt2`` are
    valid tiny llama files with an SPM and a byte-level BPE vocabulary."""
    cases = {}

    def base(which=llama) -> Image:
        return walk(which)[0]

    def case(name, img, stage, message):
        cases[name] = (img if isinstance(img, bytes) else img.to_bytes(), stage, message)

    def key(name, vtype, value, stage, message, which=llama):
        case(name, base(which).set(name.split(":")[0], vtype, value), stage, message)

    # ------------------------------------------------ issue 53, as listed
    case("string-array-2^62",
         _header(0, 1) + string("a") + struct.pack("<IIQ", ARR, STR, 1 << 62),
         "file", "declares 4,611,686,018,427,387,904 entries")
    nested = b"".join(struct.pack("<IQ", ARR, 1) for _ in range(5000))
    case("arrays-nested-5000", _header(0, 1) + string("a") + struct.pack("<I", ARR) + nested
         + struct.pack("<IQ", U8, 0), "file", "nested more than 4 deep")
    key("llama.block_count:1e9", U32, scalar(U32, 10 ** 9), "model",
        "'llama.block_count' is 1,000,000,000; it must be 1 to 1,024")
    key("llama.block_count:1e7", U32, scalar(U32, 10 ** 7), "model",
        "'llama.block_count' is 10,000,000")
    key("llama.embedding_length:f32-inf", F32, scalar(F32, INF), "file",
        "'llama.embedding_length' must be an integer, got float32 inf")
    key("tokenizer.ggml.bos_token_id:f32-inf", F32, scalar(F32, INF), "file",
        "'tokenizer.ggml.bos_token_id' must be an integer, got float32 inf")
    key("tokenizer.ggml.model:empty-array", ARR, array(STR, []), "file",
        "'tokenizer.ggml.model' must be a string, got an array of 0 elements of type string")
    key("tokenizer.ggml.tokens:integers", ARR, array(U32, range(260)), "file",
        "'tokenizer.ggml.tokens' must be an array of strings, got an array of 260 elements "
        "of type uint32")
    key("tokenizer.ggml.merges:integers", ARR, array(U32, range(10)), "file",
        "'tokenizer.ggml.merges' must be an array of strings", which=gpt2)
    key("llama.context_length:0", U32, scalar(U32, 0), "model",
        "'llama.context_length' is 0; it must be 2 to")
    key("llama.attention.layer_norm_rms_epsilon:-1", F32, scalar(F32, -1.0), "model",
        "'llama.attention.layer_norm_rms_epsilon' is -1.0; it must be a finite positive number")
    key("llama.attention.layer_norm_rms_epsilon:nan", F32, scalar(F32, NAN), "model",
        "'llama.attention.layer_norm_rms_epsilon' is nan")
    key("llama.attention.layer_norm_rms_epsilon:inf", F32, scalar(F32, INF), "model",
        "'llama.attention.layer_norm_rms_epsilon' is inf")
    img = base()
    img.tensor("token_embd.weight").offset = (1 << 64) - 32
    case("tensor-offset-wraps-2^64", img, "file",
         "truncated: tensor 'token_embd.weight' ends at byte")
    be = Image(order=">")
    be.set("general.architecture", STR, string("llama", ">"))
    be.set("llama.block_count", U32, scalar(U32, 1, ">"))
    case("big-endian", be, "file", "a big-endian GGUF file (version 3)")
    key("llama.context_length:1", U32, scalar(U32, 1), "model", "'llama.context_length' is 1;")
    key("llama.context_length:-5", I32, scalar(I32, -5), "model", "'llama.context_length' is -5;")

    # ------------------------------------------------ the header
    case("empty", b"", "file", "empty file")
    case("not-gguf", b"GGML" + bytes(60), "file", "not a GGUF file")
    case("header-cut", b"GGUF\x03\x00", "file", "truncated or corrupt GGUF file: the GGUF version")
    img = base()
    img.version = 1
    case("version-1", img, "file", "GGUF version 1 is not supported")
    img = base()
    img.n_kv = (1 << 64) - 1
    case("key-count-2^64", img, "file", "declares 18,446,744,073,709,551,615 metadata keys")
    img = base()
    img.n_tensors = 1 << 40
    case("tensor-count-2^40", img, "file", "1,099,511,627,776 tensors")
    case("key-length-2^63", _header(0, 1) + struct.pack("<Q", 1 << 63) + bytes(32), "file",
         "metadata key #0 needs 9,223,372,036,854,775,808 bytes")

    # ------------------------------------------------ metadata values
    img = base()
    img.kvs.append(Kv(b"general.architecture", STR, string("llama")))
    case("duplicate-key", img, "file", "'general.architecture' appears twice")
    img = base()
    img.kvs.insert(0, Kv(b"x", 13, b""))
    case("unknown-value-type", img, "file", "'x' has unknown GGUF value type 13")
    img = base()
    img.kvs.insert(0, Kv(b"x", ARR, struct.pack("<IQ", 99, 1)))
    case("unknown-element-type", img, "file", "is an array of unknown GGUF value type 99")
    case("string-element-cut", _header(0, 1) + string("a") + struct.pack("<IIQ", ARR, STR, 2)
         + string("abc") + struct.pack("<Q", 100) + b"xy", "file",
         "string 1 of metadata key 'a' needs 100 bytes")
    key("general.architecture:u32", U32, scalar(U32, 7), "file",
        "'general.architecture' must be a string, got uint32 7")
    key("tokenizer.ggml.scores:strings", ARR, array(STR, ["a"] * 260), "file",
        "'tokenizer.ggml.scores' must be an array of numbers")
    key("tokenizer.ggml.token_type:floats", ARR, array(F32, [1.0] * 260), "file",
        "'tokenizer.ggml.token_type' must be an array of integers")
    key("tokenizer.ggml.add_bos_token:string", STR, string("yes"), "file",
        "'tokenizer.ggml.add_bos_token' must be a boolean")
    key("general.alignment:0", U32, scalar(U32, 0), "file",
        "'general.alignment' must be a non-zero power of two, got 0")
    key("general.alignment:48", U32, scalar(U32, 48), "file",
        "'general.alignment' must be a non-zero power of two, got 48")

    # ------------------------------------------------ hyperparameters
    key("llama.embedding_length:1e12", U64, scalar(U64, 10 ** 12), "model",
        "'llama.embedding_length' is 1,000,000,000,000; it must be 1 to 1,048,576")
    key("llama.attention.head_count:0", U32, scalar(U32, 0), "model",
        "'llama.attention.head_count' is 0")
    key("llama.attention.head_count_kv:3", U32, scalar(U32, 3), "model",
        "'llama.attention.head_count_kv' is 3; it must be 1 to 2")
    key("llama.attention.head_count:per-layer-3", ARR, array(U32, [2, 2, 2]), "model",
        "'llama.attention.head_count' has 3 values for 1 layers")
    key("llama.rope.freq_base:inf", F32, scalar(F32, INF), "model", "'llama.rope.freq_base' is inf")
    key("llama.rope.scaling.factor:nan", F32, scalar(F32, NAN), "model",
        "'llama.rope.scaling.factor' is nan; it must be a finite non-negative number")
    key("llama.feed_forward_length:2^31", U32, scalar(U32, 1 << 31), "model",
        "'llama.feed_forward_length' is 2,147,483,648")

    # ------------------------------------------------ tensor infos and data
    img = base()
    img.tensors[0].name = b"t" * 100
    case("tensor-name-100-bytes", img, "file", "is 100 bytes long, more than 63")
    img = base()
    img.tensors[0].n_dims = (1 << 32) - 1
    case("dims-2^32", img, "file", "has 4294967295 dimensions")
    img = base()
    img.tensors[0].n_dims = 0
    img.tensors[0].dims = []
    case("dims-0", img, "file", "has 0 dimensions")
    img = base()
    img.tensor("output_norm.weight").dims = [1 << 63]
    case("dim-2^63", img, "file", "has a dimension of 2^63 or more")
    img = base()
    img.tensor("output_norm.weight").dims = [1 << 32, 1 << 31]
    case("dims-product-2^63", img, "file", "truncated: tensor 'output_norm.weight' ends at byte")
    img = base()
    img.tensor("output_norm.weight").ggml_type = 1000
    case("ggml-type-1000", img, "file", "has GGML type 1000, which ggml does not know")
    img = base()
    t = img.tensor("token_embd.weight")
    t.dims = [33, t.dims[1]]
    case("rows-not-whole-blocks", img, "file", "Q8_0 rows of 33 weights are not whole 32-weight")
    img = base()
    img.tensor("blk.0.attn_q.weight").offset = img.tensor("token_embd.weight").offset
    case("tensors-overlap", img, "file", "overlap in the data section")
    img = base()
    img.tensor("output.weight").offset += 4
    case("offset-unaligned", img, "file",
         "'output.weight' starts at data offset")
    img = base()
    img.tensors[1].name = img.tensors[0].name
    case("duplicate-tensor", img, "file", "appears twice")
    case("data-cut", llama[:-100], "file", "truncated: tensor")
    img = base()
    t = img.tensor("output.weight")
    t.dims = [t.dims[0], t.dims[1] - 32]
    case("output-rows-not-vocab", img, "model",
         "'output.weight' has shape (228, 32), expected (260, 32)")
    img = base()
    img.tensors = [t for t in img.tensors if t.name != b"blk.0.ffn_up.weight"]
    case("tensor-missing", img, "model", "'blk.0.ffn_up.weight' is missing")
    return cases
