"""The GGML tensor types a GGUF file may name: weights per block and bytes
per block.

The numbers are ggml's type traits as the ``gguf`` package tabulates them
(``GGML_QUANT_SIZES``): data, not its reader.  :func:`ggml_type` is the one
place the reader looks a type up.
"""

from __future__ import annotations

import attrs

__all__ = ["GGMLType", "ggml_type", "ggml_type_named"]


@attrs.frozen
class GGMLType:
    """One GGML tensor type: ``block_size`` weights in ``type_size`` bytes."""

    id: int
    name: str
    block_size: int
    type_size: int

    def row_bytes(self, n: int) -> int:
        """Bytes of ``n`` weights (a whole number of blocks)."""
        return n // self.block_size * self.type_size


def _table() -> dict:
    from gguf.constants import GGML_QUANT_SIZES
    return {int(t): GGMLType(int(t), t.name, bs, ts) for t, (bs, ts) in GGML_QUANT_SIZES.items()}


_BY_ID = _table()
_BY_NAME = {t.name: t for t in _BY_ID.values()}


def ggml_type(type_id: int) -> GGMLType | None:
    """The type with GGML id ``type_id``, or None for an id ggml does not know."""
    return _BY_ID.get(type_id)


def ggml_type_named(name: str) -> GGMLType:
    """The type called ``name`` ("Q4_K"); KeyError for an unknown name."""
    return _BY_NAME[name]
