"""Reading the key-value metadata of a GGUF file, an untrusted input.

The layout follows the GGUF specification (versions 2 and 3, little-endian):
magic ``GGUF``, ``uint32`` version, ``uint64`` tensor count, ``uint64``
key-value count, then each key as a length-prefixed UTF-8 string, a ``uint32``
value type and the value.  String arrays become Python lists, numeric arrays
NumPy arrays (read in one piece), scalars Python values; a 128K-token
vocabulary reads in a fraction of a second.

Nothing in the file is trusted: every length and count is checked against
the bytes left in the file before anything is allocated or looped over (an
array of 2^62 strings in a 49-byte file is refused at once), arrays nest at
most :data:`MAX_ARRAY_DEPTH` deep, keys are unique, a big-endian file is
named as such, and the keys this project reads must hold the kind of value
:data:`KEY_KINDS` gives (``{arch}`` stands for ``general.architecture``):
an f32 infinity as ``embedding_length`` is refused naming the key and what
it must be.  Problems raise :class:`GGUFMetadataError`.
"""

from __future__ import annotations

import fnmatch
import mmap
import os
import struct

import numpy as np

from ptxgen.llm.gguf.errors import GGUFMetadataError

__all__ = ["GGUFMetadataError", "read_gguf_metadata", "KEY_KINDS", "MAX_ARRAY_DEPTH"]

#: arrays of arrays nest at most this deep (llama.cpp reads none)
MAX_ARRAY_DEPTH = 4

# GGUF value type codes
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(8, 13)
_TYPE_NAMES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool",
               "string", "array", "uint64", "int64", "float64")
# fixed-size types -> (struct format, NumPy dtype)
_SCALAR = {
    _UINT8: ("<B", np.uint8), _INT8: ("<b", np.int8), _UINT16: ("<H", np.uint16),
    _INT16: ("<h", np.int16), _UINT32: ("<I", np.uint32), _INT32: ("<i", np.int32),
    _FLOAT32: ("<f", np.float32), _BOOL: ("<?", np.bool_), _UINT64: ("<Q", np.uint64),
    _INT64: ("<q", np.int64), _FLOAT64: ("<d", np.float64),
}
_INTS = frozenset((_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _UINT64, _INT64))
_NUMBERS = _INTS | {_FLOAT32, _FLOAT64}
# the fewest bytes one entry can take: a key-value pair (empty key, a uint8),
# an array inside an array (element type and count, no elements)
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_ARRAY_BYTES = 4 + 8
#: the fewest bytes of one tensor info (empty name, one dimension)
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8

#: what the keys this project reads must hold; ``{arch}`` is the file's
#: ``general.architecture``, ``*`` any text
KEY_KINDS = {
    "general.architecture": "string",
    "general.name": "string",
    "general.alignment": "integer",
    "tokenizer.ggml.model": "string",
    "tokenizer.ggml.pre": "string",
    "tokenizer.ggml.tokens": "string array",
    "tokenizer.ggml.merges": "string array",
    "tokenizer.ggml.scores": "number array",
    "tokenizer.ggml.token_type": "integer array",
    "tokenizer.ggml.*_token_id": "integer",
    "tokenizer.ggml.add_bos_token": "boolean",
    "tokenizer.ggml.add_eos_token": "boolean",
    "tokenizer.ggml.add_space_prefix": "boolean",
    "tokenizer.ggml.remove_extra_whitespaces": "boolean",
    "tokenizer.chat_template": "string",
    "tokenizer.chat_template.*": "string",
    "{arch}.vocab_size": "integer",
    "{arch}.context_length": "integer",
    "{arch}.embedding_length": "integer",
    "{arch}.block_count": "integer",
    "{arch}.feed_forward_length": "per-layer integer",
    "{arch}.expert_count": "per-layer integer",
    "{arch}.expert_used_count": "per-layer integer",
    "{arch}.expert_feed_forward_length": "per-layer integer",
    "{arch}.expert_group_count": "integer",
    "{arch}.attention.head_count": "per-layer integer",
    "{arch}.attention.head_count_kv": "per-layer integer",
    "{arch}.attention.key_length": "integer",
    "{arch}.attention.value_length": "integer",
    "{arch}.attention.layer_norm_rms_epsilon": "number",
    "{arch}.attention.causal": "boolean",
    "{arch}.rope.dimension_count": "integer",
    "{arch}.rope.freq_base": "number",
    "{arch}.rope.scaling.type": "string",
    "{arch}.rope.scaling.factor": "number",
    "{arch}.rope.scale_linear": "number",
    "{arch}.rope.scaling.attn_factor": "number",
}
# kind -> (what a message calls it, accepts(value type, element type))
_KINDS = {
    "string": ("a string", lambda t, e: t == _STRING),
    "integer": ("an integer", lambda t, e: t in _INTS),
    "number": ("a number", lambda t, e: t in _NUMBERS),
    "boolean": ("a boolean", lambda t, e: t == _BOOL),
    "string array": ("an array of strings", lambda t, e: t == _ARRAY and e == _STRING),
    "integer array": ("an array of integers", lambda t, e: t == _ARRAY and e in _INTS),
    "number array": ("an array of numbers", lambda t, e: t == _ARRAY and e in _NUMBERS),
    "per-layer integer": ("an integer or an array of integers (one per layer)",
                          lambda t, e: t in _INTS or (t == _ARRAY and e in _INTS)),
}


def shown(text: str, limit: int = 60) -> str:
    """``repr`` of a name or value from a file, cut to about ``limit`` characters
    (a message stays one short line whatever the file holds)."""
    r = repr(text)
    return r if len(r) <= limit else r[:limit] + "...'"


class Cursor:
    """A read position in a mapped file; every read is checked against its size.

    Reads name what they read (``what``) in the error a short file raises.
    """

    __slots__ = ("buf", "pos", "size", "path")

    def __init__(self, buf, path: str, pos: int = 0):
        self.buf = buf
        self.pos = pos
        self.size = len(buf)
        self.path = path

    def error(self, msg: str) -> GGUFMetadataError:
        return GGUFMetadataError(f"{self.path}: {msg}")

    def need(self, n: int, what: str) -> None:
        """Refuse unless ``n`` bytes are left."""
        left = self.size - self.pos
        if n > left:
            raise self.error(f"truncated or corrupt GGUF file: {what} needs {n:,} bytes at "
                             f"offset {self.pos:,}, but only {left:,} are left")

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str, max_len: int | None = None) -> str:
        n = self.u64(f"the length of {what}")
        if max_len is not None and n > max_len:
            raise self.error(f"{what} is {n:,} bytes long, more than {max_len}")
        self.need(n, what)
        end = self.pos + n
        # llama.cpp keeps invalid UTF-8 as raw bytes; surrogateescape keeps it lossless
        s = self.buf[self.pos:end].decode("utf-8", "surrogateescape")
        self.pos = end
        return s

    def count(self, n: int, each: int, what: str) -> None:
        """Refuse ``n`` entries of at least ``each`` bytes that cannot fit in the rest."""
        left = self.size - self.pos
        if n > left // each:
            raise self.error(f"truncated or corrupt GGUF file: {what} declares {n:,} entries "
                             f"of at least {each} bytes, but only {left:,} bytes are left")


def _value(cur: Cursor, vtype: int, what: str, depth: int = 0):
    """The value of type ``vtype`` at the cursor, and its array element type
    (None for a scalar)."""
    if vtype in _SCALAR:
        fmt, dtype = _SCALAR[vtype]
        return cur.unpack(fmt, np.dtype(dtype).itemsize, what), None
    if vtype == _STRING:
        return cur.string(what), None
    if vtype != _ARRAY:
        raise cur.error(f"{what} has unknown GGUF value type {vtype}")
    if depth >= MAX_ARRAY_DEPTH:
        raise cur.error(f"{what}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
    etype = cur.u32(f"the element type of {what}")
    n = cur.u64(f"the length of {what}")
    if etype in _SCALAR:
        dtype = np.dtype(_SCALAR[etype][1])
        cur.count(n, dtype.itemsize, what)
        if n == 0:
            return np.zeros(0, dtype), etype
        raw = np.frombuffer(cur.buf, np.uint8, n * dtype.itemsize, cur.pos)
        cur.pos += n * dtype.itemsize
        if etype == _BOOL:
            return raw != 0, etype
        return raw.view(dtype.newbyteorder("<")).astype(dtype), etype
    if etype == _STRING:
        cur.count(n, 8, what)
        return _strings(cur, n, what), etype
    if etype == _ARRAY:
        cur.count(n, _MIN_ARRAY_BYTES, what)
        return [_value(cur, _ARRAY, what, depth + 1)[0] for _ in range(n)], etype
    raise cur.error(f"{what} is an array of unknown GGUF value type {etype}")


def _strings(cur: Cursor, n: int, what: str) -> list:
    buf, pos, size = cur.buf, cur.pos, cur.size
    unpack_len = struct.Struct("<Q").unpack_from
    out = []
    append = out.append
    for i in range(n):
        if pos + 8 > size:
            cur.pos = pos
            cur.need(8, f"the length of string {i} of {what}")
        (k,) = unpack_len(buf, pos)
        pos += 8
        end = pos + k
        if end > size:
            cur.pos = pos
            cur.need(k, f"string {i} of {what}")
        append(buf[pos:end].decode("utf-8", "surrogateescape"))
        pos = end
    cur.pos = pos
    return out


def _describe(vtype: int, etype, value) -> str:
    """What a value is, for a message: "float32 inf", "an array of 3 elements
    of type uint32"."""
    if vtype == _ARRAY:
        inner = _TYPE_NAMES[etype] if etype is not None and etype < len(_TYPE_NAMES) else "?"
        return f"an array of {len(value):,} elements of type {inner}"
    if vtype == _STRING:
        return f"the string {shown(value)}"
    return f"{_TYPE_NAMES[vtype]} {value!r}"


def _kind_of(key: str, arch) -> str | None:
    kind = KEY_KINDS.get(key)
    if kind is None and isinstance(arch, str) and key.startswith(arch + "."):
        kind = KEY_KINDS.get("{arch}" + key[len(arch):])
    if kind is None and key.startswith("tokenizer."):
        for pattern, k in KEY_KINDS.items():
            if "*" in pattern and fnmatch.fnmatchcase(key, pattern):
                return k
    return kind


def read_header_and_metadata(cur: Cursor) -> tuple:
    """``(version, tensor count, metadata)`` from the start of a file: the
    header and the key-value section, leaving ``cur`` at the tensor infos."""
    if cur.size < 4 or bytes(cur.buf[:4]) != b"GGUF":
        raise cur.error(f"not a GGUF file (it starts {bytes(cur.buf[:4])!r}, not b'GGUF')")
    cur.pos = 4
    version = cur.u32("the GGUF version")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in (1, 2, 3):
            raise cur.error(f"a big-endian GGUF file (version {swapped}); only little-endian "
                            "files are supported")
        raise cur.error(f"GGUF version {version} is not supported (versions 2 and 3 are)")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata key count")
    left = cur.size - cur.pos
    if n_kv * _MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > left:
        raise cur.error(f"truncated or corrupt GGUF file: the header declares {n_kv:,} metadata "
                        f"keys and {n_tensors:,} tensors, more than the {left:,} bytes after it "
                        "can hold")
    meta, types = {}, {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in meta:
            raise cur.error(f"metadata key {shown(key)} appears twice")
        vtype = cur.u32(f"the value type of metadata key {shown(key)}")
        meta[key], etype = _value(cur, vtype, f"metadata key {shown(key)}")
        types[key] = (vtype, etype)
    arch = meta.get("general.architecture")
    for key, (vtype, etype) in types.items():
        kind = _kind_of(key, arch)
        if kind is None:
            continue
        name, accepts = _KINDS[kind]
        if not accepts(vtype, etype):
            raise cur.error(f"metadata key {shown(key)} must be {name}, got "
                            f"{_describe(vtype, etype, meta[key])}")
    return version, n_tensors, meta


def open_map(path):
    """``(path, mmap)`` of a GGUF file, read-only; GGUFMetadataError when it
    cannot be opened or is empty."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise GGUFMetadataError(f"{path}: is a directory, not a GGUF file")
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise GGUFMetadataError(f"{path}: no such file") from None
    except OSError as e:
        raise GGUFMetadataError(f"{path}: cannot open: {e.strerror}") from None
    with f:
        try:
            return path, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise GGUFMetadataError(f"{path}: empty file, not a GGUF file") from None
        except OSError as e:
            raise GGUFMetadataError(f"{path}: cannot map: {e.strerror}") from None


def read_gguf_metadata(path) -> dict:
    """Read the key-value metadata of a GGUF file.

    Parameters
    ----------
    path : str or os.PathLike
        The GGUF file.

    Returns
    -------
    dict
        Key -> value: ``str``, ``int``, ``float``, ``bool``, a ``list[str]``
        for string arrays and a 1-D ``numpy.ndarray`` for numeric arrays.

    Raises
    ------
    GGUFMetadataError
        If the file is missing, is not a GGUF file, has an unsupported
        version or byte order, its metadata is truncated or malformed, or a
        key in :data:`KEY_KINDS` holds another kind of value.
    """
    path, mm = open_map(path)
    try:
        return read_header_and_metadata(Cursor(mm, path))[2]
    finally:
        close_map(mm)


def close_map(mm) -> None:
    """Close a map unless arrays still view it (then it closes when they go)."""
    try:
        mm.close()
    except BufferError:
        pass
