"""Reading a whole GGUF file, an untrusted input: header, metadata, tensor
infos, and the tensor data as read-only NumPy views of one map.

After the metadata (:mod:`.metadata`) come the tensor infos: per tensor a
length-prefixed name, a ``uint32`` dimension count, that many ``uint64``
dimensions (innermost first), a ``uint32`` GGML type and a ``uint64`` offset
into the data section, which starts at the next multiple of
``general.alignment`` (default 32).

Checked before anything is allocated or looped over, against the file's
size: the tensor count; every name (at most 63 bytes, ggml's limit, and
unique); dimensions (1 to 4 of them, each below 2^63, rows whole blocks of a
type ggml knows); and every tensor's extent, which must lie inside the data
section, start at a multiple of the alignment, and overlap no other tensor.
The file is mapped once and read once; problems raise
:class:`~.errors.GGUFMetadataError` naming the file and the tensor.
"""

from __future__ import annotations

import attrs
import numpy as np

from ptxgen.llm.gguf.errors import GGUFMetadataError
from ptxgen.llm.gguf.ggml_types import GGMLType, ggml_type
from ptxgen.llm.gguf.metadata import (Cursor, MIN_TENSOR_INFO_BYTES, close_map, open_map,
                                      read_header_and_metadata, shown)

__all__ = ["TensorInfo", "GGUFContents", "read_gguf", "MAX_DIMS", "MAX_NAME_BYTES"]

#: dimensions a tensor may have (ggml's GGML_MAX_DIMS)
MAX_DIMS = 4
#: bytes a tensor name may have (ggml's GGML_MAX_NAME, less its terminator)
MAX_NAME_BYTES = 63
_DEFAULT_ALIGNMENT = 32


@attrs.frozen
class TensorInfo:
    """One tensor's header: name, GGML type, dimensions as stored (innermost
    first), offset into the data section and size in bytes."""

    name: str
    type: GGMLType
    dims: tuple
    offset: int
    nbytes: int

    @property
    def qtype(self) -> str:
        return self.type.name

    @property
    def shape(self) -> tuple:
        """Logical shape, outermost first (``(rows, cols)`` of a matrix)."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


class GGUFContents:
    """A GGUF file read and checked (see the module docstring).

    Attributes
    ----------
    path : str
    version : int
    metadata : dict
        Key -> value, as :func:`~.metadata.read_gguf_metadata` gives.
    tensors : dict
        Name -> :class:`TensorInfo`, in file order.
    alignment : int
        ``general.alignment``.
    data_offset : int
        Where the data section starts in the file.
    size : int
        The file's size in bytes.
    """

    def __init__(self, path, version, metadata, tensors, alignment, data_offset, mm):
        self.path = path
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self.alignment = alignment
        self.data_offset = data_offset
        self.size = len(mm)
        self._map = mm

    def data(self, name: str) -> np.ndarray:
        """The tensor's bytes: a read-only ``uint8`` view of the map."""
        t = self.tensors[name]
        if t.nbytes == 0:
            return np.zeros(0, np.uint8)
        return np.frombuffer(self._map, np.uint8, t.nbytes, self.data_offset + t.offset)


def read_gguf(path) -> GGUFContents:
    """Read and check a GGUF file's header, metadata and tensor infos.

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    GGUFContents

    Raises
    ------
    GGUFMetadataError
        The file is missing, not a GGUF file, of an unsupported version or
        byte order, truncated, or holds a malformed, out-of-bounds or
        wrongly typed header, key or tensor info.
    """
    path, mm = open_map(path)
    try:
        return _read(Cursor(mm, path), mm)
    except GGUFMetadataError:
        close_map(mm)
        raise


def _read(cur: Cursor, mm) -> GGUFContents:
    version, n_tensors, meta = read_header_and_metadata(cur)
    align = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if align <= 0 or align & (align - 1):
        raise cur.error(f"metadata key 'general.alignment' must be a non-zero power of two, "
                        f"got {align}")
    cur.count(n_tensors, MIN_TENSOR_INFO_BYTES, "the tensor-info section")
    tensors = {}
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor #{i}", MAX_NAME_BYTES)
        if name in tensors:
            raise cur.error(f"tensor {shown(name)} appears twice")
        tensors[name] = _tensor_info(cur, name)
    data_offset = -(-cur.pos // align) * align
    _check_extents(cur, tensors, data_offset, align)
    return GGUFContents(cur.path, version, meta, tensors, align, data_offset, mm)


def _tensor_info(cur: Cursor, name: str) -> TensorInfo:
    what = f"tensor {shown(name)}"
    n_dims = cur.u32(f"the dimension count of {what}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.error(f"{what} has {n_dims} dimensions (1 to {MAX_DIMS} are allowed)")
    dims = tuple(cur.u64(f"the dimensions of {what}") for _ in range(n_dims))
    if any(d >= 1 << 63 for d in dims):
        raise cur.error(f"{what} has a dimension of 2^63 or more ({list(dims)})")
    type_id = cur.u32(f"the type of {what}")
    t = ggml_type(type_id)
    if t is None:
        raise cur.error(f"{what} has GGML type {type_id}, which ggml does not know")
    if dims[0] % t.block_size:
        raise cur.error(f"{what}: {t.name} rows of {dims[0]} weights are not whole "
                        f"{t.block_size}-weight blocks")
    offset = cur.u64(f"the data offset of {what}")
    n = 1
    for d in dims:
        n *= d
    return TensorInfo(name, t, dims, offset, n // t.block_size * t.type_size)


def _check_extents(cur: Cursor, tensors: dict, data_offset: int, align: int) -> None:
    """Every tensor lies inside the data section, aligned, overlapping no other."""
    room = cur.size - data_offset
    for t in tensors.values():
        if t.offset % align:
            raise cur.error(f"tensor {shown(t.name)} starts at data offset {t.offset}, not a "
                            f"multiple of general.alignment {align}")
        if t.nbytes and t.offset + t.nbytes > room:
            raise cur.error(f"truncated: tensor {shown(t.name)} ends at byte "
                            f"{data_offset + t.offset + t.nbytes:,} but the file has "
                            f"{cur.size:,}")
    placed = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, end, a), (start, _, b) in zip(placed, placed[1:]):
        if start < end:
            raise cur.error(f"tensors {shown(a)} and {shown(b)} overlap in the data section")
