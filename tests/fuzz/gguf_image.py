"""GGUF files byte by byte, for hostile-input tests: a structure-level writer
that will write anything (wrong counts, bad types, any byte order) and a
walker that splits a well-formed file (one the tests wrote) into the same
structure, recording where each length, count, type and offset field lies.

Written from the GGUF specification, apart from the reader under test.
"""

from __future__ import annotations

import struct

import attrs

# GGUF value type codes
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
FORMATS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?",
           U64: "Q", I64: "q", F64: "d"}


@attrs.define
class Kv:
    """One key-value pair: ``value`` is the encoded value (after the type word)."""

    key: bytes
    vtype: int
    value: bytes


@attrs.define
class Tensor:
    """One tensor info; ``n_dims`` None writes ``len(dims)``."""

    name: bytes
    dims: list
    ggml_type: int
    offset: int
    n_dims: int | None = None


@attrs.define
class Image:
    """A GGUF file as parts; ``n_kv`` / ``n_tensors`` None count the parts."""

    kvs: list = attrs.Factory(list)
    tensors: list = attrs.Factory(list)
    data: bytes = b""
    version: int = 3
    magic: bytes = b"GGUF"
    n_kv: int | None = None
    n_tensors: int | None = None
    alignment: int = 32
    order: str = "<"

    def kv(self, key: str) -> Kv:
        return next(k for k in self.kvs if k.key == key.encode())

    def set(self, key: str, vtype: int, value: bytes) -> "Image":
        """Replace (or add) a key's value."""
        for k in self.kvs:
            if k.key == key.encode():
                k.vtype, k.value = vtype, value
                return self
        self.kvs.append(Kv(key.encode(), vtype, value))
        return self

    def drop(self, key: str) -> "Image":
        self.kvs = [k for k in self.kvs if k.key != key.encode()]
        return self

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name.encode())

    def to_bytes(self) -> bytes:
        o = self.order
        out = bytearray(self.magic)
        out += struct.pack(o + "I", self.version)
        out += struct.pack(o + "QQ", len(self.tensors) if self.n_tensors is None
                           else self.n_tensors,
                           len(self.kvs) if self.n_kv is None else self.n_kv)
        for k in self.kvs:
            out += struct.pack(o + "Q", len(k.key)) + k.key + struct.pack(o + "I", k.vtype)
            out += k.value
        for t in self.tensors:
            out += struct.pack(o + "Q", len(t.name)) + t.name
            out += struct.pack(o + "I", len(t.dims) if t.n_dims is None else t.n_dims)
            out += b"".join(struct.pack(o + "Q", d) for d in t.dims)
            out += struct.pack(o + "IQ", t.ggml_type, t.offset)
        if self.tensors:
            out += bytes(-len(out) % self.alignment)
        return bytes(out + self.data)


# ---------------------------------------------------------------- values
def scalar(vtype: int, v, order: str = "<") -> bytes:
    return struct.pack(order + FORMATS[vtype], v)


def string(s, order: str = "<") -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(order + "Q", len(b)) + b


def array(etype: int, items, order: str = "<") -> bytes:
    """An array value; ``items`` are values of ``etype`` (encoded bytes for
    strings-as-bytes and nested arrays)."""
    out = struct.pack(order + "IQ", etype, len(items))
    for x in items:
        if etype == STR:
            out += string(x, order)
        elif etype == ARR:
            out += x
        else:
            out += scalar(etype, x, order)
    return out


# ---------------------------------------------------------------- walking
@attrs.frozen
class Field:
    """Where a number lies in a file: ``offset``, ``size`` bytes, ``kind``
    (``version``, ``count``, ``length``, ``type``, ``dims``, ``dim``,
    ``offset``, ``value`` (a scalar key's) or ``element`` (an array's))."""

    offset: int
    size: int
    kind: str


def walk(data: bytes) -> tuple:
    """``(Image, [Field])`` of a well-formed little-endian file."""
    pos = 0
    fields = []

    def num(fmt, kind):
        nonlocal pos
        size = struct.calcsize("<" + fmt)
        (v,) = struct.unpack_from("<" + fmt, data, pos)
        fields.append(Field(pos, size, kind))
        pos += size
        return v

    def raw(n):
        nonlocal pos
        b = data[pos:pos + n]
        pos += n
        return b

    def value(vtype, kind="value"):
        start = pos
        if vtype in FORMATS:
            num(FORMATS[vtype], kind)
        elif vtype == STR:
            raw(num("Q", "length"))
        else:
            etype = num("I", "type")
            n = num("Q", "count")
            for _ in range(n):
                value(etype, "element")
        return data[start:pos]

    assert data[:4] == b"GGUF"
    pos = 4
    img = Image(version=num("I", "version"))
    n_tensors = num("Q", "count")
    n_kv = num("Q", "count")
    for _ in range(n_kv):
        key = raw(num("Q", "length"))
        vtype = num("I", "type")
        img.kvs.append(Kv(key, vtype, value(vtype)))
    for _ in range(n_tensors):
        name = raw(num("Q", "length"))
        dims = [num("Q", "dim") for _ in range(num("I", "dims"))]
        img.tensors.append(Tensor(name, dims, num("I", "type"), num("Q", "offset")))
    align = 32
    for k in img.kvs:
        if k.key == b"general.alignment":
            align = struct.unpack("<I", k.value)[0]
    img.alignment = align
    img.data = data[pos + (-pos % align):]
    return img, fields


# ---------------------------------------------------------------- models
#: GGML type ids and (weights per block, bytes per block) used below
GGML_F32, GGML_Q8_0 = 0, 8
BLOCKS = {GGML_F32: (1, 4), GGML_Q8_0: (32, 34)}


def model_image(*, n_layers, hidden, ffn, n_heads, n_kv_heads, vocab, context_length=64,
                eps=1e-5, theta=10000.0, tokens=None, seed_bytes=b"", alignment=32) -> Image:
    """A well-formed llama file: Q8_0 matrices, F32 vectors, every tensor
    packed at the next multiple of ``alignment``; ``tokens`` (a list of
    strings) adds a llama token list.  Tensor bytes repeat ``seed_bytes``."""
    head = hidden // n_heads
    kv = n_kv_heads * head
    img = Image(alignment=alignment)
    img.set("general.architecture", STR, string("llama"))
    if alignment != 32:
        img.set("general.alignment", U32, scalar(U32, alignment))
    for key, vtype, v in (("block_count", U32, n_layers), ("context_length", U32, context_length),
                          ("embedding_length", U32, hidden), ("feed_forward_length", U32, ffn),
                          ("attention.head_count", U32, n_heads),
                          ("attention.head_count_kv", U32, n_kv_heads),
                          ("attention.layer_norm_rms_epsilon", F32, eps),
                          ("rope.freq_base", F32, theta)):
        img.set(f"llama.{key}", vtype, scalar(vtype, v))
    if tokens is not None:
        img.set("tokenizer.ggml.model", STR, string("llama"))
        img.set("tokenizer.ggml.tokens", ARR, array(STR, tokens))
    shapes = [("token_embd.weight", (vocab, hidden)), ("output_norm.weight", (hidden,)),
              ("output.weight", (vocab, hidden))]
    for i in range(n_layers):
        shapes += [(f"blk.{i}.{n}.weight", s) for n, s in (
            ("attn_norm", (hidden,)), ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)),
            ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)), ("ffn_norm", (hidden,)),
            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn)))]
    data = bytearray()
    for name, shape in shapes:
        gt = GGML_F32 if len(shape) == 1 else GGML_Q8_0
        bs, ts = BLOCKS[gt]
        n = 1
        for d in shape:
            n *= d
        data += bytes(-len(data) % alignment)
        img.tensors.append(Tensor(name.encode(), list(reversed(shape)), gt, len(data)))
        nbytes = n // bs * ts
        fill = (seed_bytes or b"\0") * (nbytes // max(len(seed_bytes), 1) + 1)
        data += fill[:nbytes]
    img.data = bytes(data)
    return img
