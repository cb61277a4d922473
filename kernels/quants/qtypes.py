"""The GGML weight types: the one registry every part of ptxgen reads them from,
and helpers the block codecs share.

A :class:`QType` names one GGML tensor type by GGML's own name (``"Q4_K"``,
``"F16"``, ``"BF16"``): how many weights one block holds, how many bytes it
takes, its GGML type id, and which kernel families read it (:data:`READERS`:
the GEMV, the GEMM, the embedding gather). The float types (F32, F16, BF16)
are blocks of one weight. The kernel specs, the ops, the quantizers and the
GGUF loader all ask here::

    q = qtype_of("q4_k")               # by name in any case, or by GGML id (12)
    q.block_size, q.type_size, q.ggml_type, q.row_bytes(4096)
    q.read_by("gemm")                  # is there a GEMM kernel for it?
    qtypes_for("embedding")            # the types the embedding gather reads
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Union

import attrs
import numpy as np

__all__ = [
    "QType", "QTypeLike", "QTYPES", "READERS", "qtypes_for", "names_for",
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "qtype_of", "row_bytes",
]


#: the kernel families that read weights in a GGML type (:attr:`QType.kernels`)
READERS = ("gemv", "gemm", "embedding")


def _readers(inst, attr, v):
    bad = sorted(set(v) - set(READERS))
    if bad:
        raise ValueError(f"{inst.name}: unknown reader(s) {', '.join(bad)}; "
                         f"readers: {', '.join(READERS)}")


@attrs.frozen
class QType:
    """A GGML tensor type: a block of ``block_size`` weights in ``type_size`` bytes.

    Attributes
    ----------
    name : str
        GGML's name ("Q4_K", "F16"), upper case.
    block_size : int
        Weights per block (1 for the float types).
    type_size : int
        Bytes per block.
    ggml_type : int
        The GGML type id (equals ``gguf.GGMLQuantizationType[name]``).
    kernels : frozenset of str
        The kernel families (:data:`READERS`) that read weights of this type.
    """

    name: str
    block_size: int
    type_size: int
    ggml_type: int
    kernels: frozenset = attrs.field(default=frozenset(), converter=frozenset,
                                     validator=_readers)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def read_by(self, kernel: str) -> bool:
        """Whether the kernel family ``kernel`` (one of :data:`READERS`)
        reads weights of this type."""
        if kernel not in READERS:
            raise ValueError(f"unknown reader {kernel!r}; readers: {', '.join(READERS)}")
        return kernel in self.kernels

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of ``k`` weights (ValueError unless ``k`` is a
        positive multiple of the block)."""
        return row_bytes(self, k)

    def __str__(self) -> str:
        return self.name


F32 = QType("F32", 1, 4, 0, ("embedding",))
F16 = QType("F16", 1, 2, 1, READERS)
BF16 = QType("BF16", 1, 2, 30, READERS)
Q4_0 = QType("Q4_0", 32, 18, 2, READERS)
Q4_1 = QType("Q4_1", 32, 20, 3, ("gemv", "embedding"))
Q5_0 = QType("Q5_0", 32, 22, 6, READERS)
Q5_1 = QType("Q5_1", 32, 24, 7, ("gemv", "embedding"))
Q8_0 = QType("Q8_0", 32, 34, 8, READERS)
Q2_K = QType("Q2_K", 256, 84, 10)
Q3_K = QType("Q3_K", 256, 110, 11)
Q4_K = QType("Q4_K", 256, 144, 12, READERS)
Q5_K = QType("Q5_K", 256, 176, 13, READERS)
Q6_K = QType("Q6_K", 256, 210, 14, READERS)

#: every type by name: the weight-type registry
QTYPES: dict[str, QType] = {q.name: q for q in (
    Q4_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q5_K, Q2_K, Q3_K, F32, F16, BF16)}
_BY_ID = {q.ggml_type: q for q in QTYPES.values()}

QTypeLike = Union[QType, str, int]


def qtypes_for(kernel: str) -> tuple[QType, ...]:
    """The types the kernel family ``kernel`` (one of :data:`READERS`)
    reads, in :data:`QTYPES` order."""
    return tuple(q for q in QTYPES.values() if q.read_by(kernel))


def names_for(kernel: str) -> tuple[str, ...]:
    """The names of :func:`qtypes_for` ``(kernel)``."""
    return tuple(q.name for q in qtypes_for(kernel))

F16_MAX = 65504.0
# Weights per chunk handed to one worker: small enough for the temporaries of
# the k-quant searches to stay in cache, large enough to amortise Python overhead.
_CHUNK_WEIGHTS = 1 << 16
_PARALLEL_MIN_WEIGHTS = 1 << 20


def qtype_of(qtype: QTypeLike, kernel: str | None = None) -> QType:
    """Resolve a QType, a name ("q4_k" too) or a GGML type id to a QType;
    with ``kernel`` (one of :data:`READERS`), one that kernel family reads.

    Raises
    ------
    ValueError
        For a type this package does not implement, or one ``kernel`` does
        not read (naming the ones it does).
    TypeError
        For anything that is not a QType, a str or an int.
    """
    q = _resolve(qtype)
    if kernel is not None and not q.read_by(kernel):
        raise ValueError(f"no {kernel} kernel reads {q.name} weights; the {kernel} kernels "
                         f"read {', '.join(names_for(kernel))}")
    return q


def _resolve(qtype: QTypeLike) -> QType:
    if isinstance(qtype, QType):
        return qtype
    if isinstance(qtype, str):
        q = QTYPES.get(qtype.upper())
        if q is None:
            raise ValueError(f"unsupported quantization type {qtype!r}; "
                             f"supported: {', '.join(QTYPES)}")
        return q
    if isinstance(qtype, (int, np.integer)) and not isinstance(qtype, bool):
        q = _BY_ID.get(int(qtype))
        if q is None:
            name = getattr(qtype, "name", str(int(qtype)))
            raise ValueError(f"unsupported quantization type {name} (GGML id {int(qtype)}); "
                             f"supported: {', '.join(QTYPES)}")
        return q
    raise TypeError(f"qtype must be a QType, a name or a GGML type id, got {type(qtype).__name__}")


def row_bytes(qtype: QTypeLike, k: int) -> int:
    """Bytes of one row of ``k`` weights in format ``qtype``.

    Raises
    ------
    ValueError
        If ``k`` is not a positive multiple of the block size.
    """
    q = qtype_of(qtype)
    check_k(q, int(k))
    return int(k) // q.block_size * q.type_size


def check_k(q: QType, k: int) -> None:
    """Refuse a row length that is not a positive multiple of the block size."""
    if k <= 0 or k % q.block_size:
        raise ValueError(f"{q.name}: row length K={k} is not a positive multiple of the "
                         f"{q.name} block size ({q.block_size} weights per block)")


# ---------------------------------------------------------------------------
# helpers shared by the codecs

def as_float_rows(x, q: QType) -> np.ndarray:
    """Validate a float array with last dimension K and return it as float32."""
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise TypeError(f"{q.name} quantize: expected a floating-point array "
                        f"(float32, float64 or float16), got dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{q.name} quantize: expected an array with a last dimension K, got a scalar")
    check_k(q, x.shape[-1])
    if x.dtype != np.float32:
        with np.errstate(over="ignore"):
            x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError(f"{q.name} quantize: input contains NaN or infinity"
                         + (" (or values beyond float32's range)" if x.dtype != np.float32 else ""))
    return x


def rint_half_away(v: np.ndarray) -> np.ndarray:
    """Round to nearest, ties away from zero (C ``roundf``), exact in float32."""
    t = np.trunc(v)
    r = np.rint(v)
    tie = np.abs(v - t) == 0.5
    if tie.any():
        r = np.where(tie, t + np.sign(v), r)
    return r


def to_f16(v: np.ndarray, q: QType, what: str) -> np.ndarray:
    """Round per-block scales to float16, refusing ones out of f16 range."""
    with np.errstate(over="ignore"):
        h = v.astype(np.float16)
    if not np.isfinite(h).all():
        bad = float(np.max(np.abs(v)))
        raise ValueError(f"{q.name} quantize: a block's {what} ({bad:.6g}) does not fit in "
                         f"float16 (max {F16_MAX}); the input values are too large for {q.name}")
    return h


def run_blocks(fn: Callable[[np.ndarray], np.ndarray], blocks: np.ndarray,
               q: QType) -> np.ndarray:
    """Apply ``fn`` (float32 blocks -> uint8 blocks) over chunks, in threads."""
    nb = blocks.shape[0]
    out = np.empty((nb, q.type_size), dtype=np.uint8)
    per = max(1, _CHUNK_WEIGHTS // q.block_size)
    starts = range(0, nb, per)

    def work(s: int) -> None:
        out[s:s + per] = fn(blocks[s:s + per])

    workers = min(os.cpu_count() or 1, 8)
    if workers > 1 and blocks.size >= _PARALLEL_MIN_WEIGHTS:
        with ThreadPoolExecutor(max_workers=workers) as ex:
            for _ in ex.map(work, starts):
                pass
    else:
        for s in starts:
            work(s)
    return out


def quantize_rows(fn: Callable[[np.ndarray], np.ndarray], x, q: QType) -> np.ndarray:
    """Validate ``x`` (..., K), encode it block by block with ``fn``, shape the bytes (..., row_bytes)."""
    x = as_float_rows(x, q)
    out = run_blocks(fn, x.reshape(-1, q.block_size), q)
    return out.reshape(*x.shape[:-1], row_bytes(q, x.shape[-1]))


def raw_blocks(raw, q: QType, shape) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate raw bytes against a logical float shape; return (blocks, shape)."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise TypeError(f"{q.name} dequantize: expected raw bytes as uint8, got dtype {raw.dtype}")
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        shape = (int(shape),)
    if not shape or any(s < 0 for s in shape):
        raise ValueError(f"{q.name} dequantize: bad shape {shape}")
    check_k(q, shape[-1])
    n = int(np.prod(shape, dtype=np.int64))
    want = n // q.block_size * q.type_size
    if raw.size != want:
        raise ValueError(f"{q.name} dequantize: shape {shape} needs {want} bytes "
                         f"({n // q.block_size} blocks of {q.type_size}), got {raw.size}")
    return np.ascontiguousarray(raw).reshape(-1, q.type_size), shape


def f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block, as float32 (nb, 1)."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)
