"""Reading the key-value metadata of a GGUF file, and nothing else.

The tokenizer needs only the metadata (vocabulary, merges, scores, token
types, flags), and a vocabulary holds hundreds of thousands of strings: the
``gguf`` package's reader builds a Python object per array element and takes
tens of seconds on a 128K-token vocabulary.  This reader maps the file and
decodes the metadata section directly: string arrays become Python lists,
numeric arrays NumPy arrays, scalars Python values.  Tensor data is never
touched, so a multi-gigabyte model file costs the same as a vocabulary file.

The layout follows the GGUF specification (versions 2 and 3, little-endian):
magic ``GGUF``, ``uint32`` version, ``uint64`` tensor count, ``uint64``
key-value count, then each key as a length-prefixed UTF-8 string, a ``uint32``
value type and the value.
"""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np

__all__ = ["GGUFMetadataError", "read_gguf_metadata"]


class GGUFMetadataError(ValueError):
    """A file whose GGUF metadata cannot be read, and why."""


# GGUF value type codes -> (struct format, NumPy dtype) for the fixed-size ones
_SCALAR = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING = 8
_ARRAY = 9


class _Cursor:
    """A read position in a buffer, with bounds checks that name the file."""

    def __init__(self, buf, path):
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise GGUFMetadataError(f"{self.path}: truncated GGUF metadata (wanted {n} bytes "
                                    f"at offset {self.pos}, file has {len(self.buf)})")
        out = self.buf[self.pos:end]
        self.pos = end
        return out

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.take(n)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            # llama.cpp keeps such strings as raw bytes; surrogateescape keeps
            # them lossless here too
            return bytes(raw).decode("utf-8", "surrogateescape")

    def value(self, vtype: int):
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.unpack("<I")
            count = self.unpack("<Q")
            if etype in _SCALAR:
                dtype = np.dtype(_SCALAR[etype][1]).newbyteorder("<")
                raw = self.take(count * dtype.itemsize)
                return np.frombuffer(raw, dtype=dtype).copy()
            if etype == _STRING:
                return self._string_array(count)
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            raise GGUFMetadataError(f"{self.path}: unknown GGUF array element type {etype}")
        raise GGUFMetadataError(f"{self.path}: unknown GGUF value type {vtype}")

    def _string_array(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        size = len(buf)
        unpack_len = struct.Struct("<Q").unpack_from
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.take(8)
            (n,) = unpack_len(buf, pos)
            pos += 8
            end = pos + n
            if end > size:
                self.pos = pos
                self.take(n)
            raw = buf[pos:end]
            try:
                append(str(raw, "utf-8"))
            except UnicodeDecodeError:
                append(bytes(raw).decode("utf-8", "surrogateescape"))
            pos = end
        self.pos = pos
        return out


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
        version, or its metadata is truncated or malformed.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise GGUFMetadataError(f"{path}: is a directory, not a GGUF file")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise GGUFMetadataError(f"{path}: cannot open: {e.strerror}") from None
    with f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise GGUFMetadataError(f"{path}: empty file, not a GGUF file") from None
    view = memoryview(mm)
    error = None
    try:
        meta = _parse(view, path)
    except GGUFMetadataError as e:
        # keep only the message: the traceback's frames hold views of the map
        error = str(e)
    if error is not None:
        meta = None
    view.release()
    mm.close()
    if error is not None:
        raise GGUFMetadataError(error)
    return meta


def _parse(view: memoryview, path: str) -> dict:
    cur = _Cursor(view, path)
    if len(view) < 4 or bytes(view[:4]) != b"GGUF":
        raise GGUFMetadataError(f"{path}: not a GGUF file (no 'GGUF' magic at the start)")
    cur.take(4)
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFMetadataError(f"{path}: GGUF version {version} is not supported "
                                "(versions 2 and 3, little-endian, are)")
    cur.unpack("<Q")  # tensor count
    n_kv = cur.unpack("<Q")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.unpack("<I")
        meta[key] = cur.value(vtype)
    return meta
