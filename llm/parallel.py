"""Tensor parallelism: one model split over ``world`` ranks (one GPU each),
every rank holding a shard of each layer's weights read from the one GGUF
file.

The split (Megatron's), per layer:

- Q/K/V column-parallel: rank ``r`` holds the rows of its ``n_heads /
  world`` query heads and ``n_kv_heads / world`` KV heads (and their
  biases), so its KV cache holds only its KV heads and its attention runs
  over them alone (the GQA groups never straddle ranks);
- ``attn_output`` row-parallel: the columns (K) of its query heads; its
  product is a partial sum of the projection;
- gate/up column-parallel (``ffn / world`` rows each), ``ffn_down``
  row-parallel (the matching ``ffn / world`` columns);
- after each row-parallel projection, the graph all-reduces the partial
  sums (:class:`~ptxgen.driver.collective.Collective`); the residual stream
  is added by rank 0 alone, so the sum holds it once;
- the output projection vocabulary-parallel (``vocab / world`` rows of the
  logits each), the shards all-gathered into the full logits before the
  next token's choice, which every rank then makes alike.

Embeddings, norms and the per-head q/k norms are whole on every rank.

A quantized row stores its K weights in blocks (256 for the K-quants), so
a column shard splits K at block boundaries: a shape that does not divide
(heads, KV heads, FFN rows, the vocabulary, K blocks) is refused, naming
it.  A shard's rows and columns are views of the file's map: a rank reads
only its own bytes from disk as they upload.
"""

from __future__ import annotations

import attrs
import numpy as np

from .gguf.file import RawTensor
from .gguf.ggml_types import ggml_type_named

__all__ = ["TensorParallel", "ShardedFile", "SINGLE"]


@attrs.frozen
class TensorParallel:
    """Rank ``rank`` of ``world`` tensor-parallel ranks."""

    rank: int = 0
    world: int = 1

    def __attrs_post_init__(self):
        if not (isinstance(self.world, int) and self.world >= 1):
            raise ValueError(f"tensor parallelism over {self.world!r} ranks: give a whole "
                             "number of at least 1")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world):
            raise ValueError(f"rank {self.rank!r} is not one of the {self.world} ranks "
                             f"0..{self.world - 1}")

    @property
    def adds_residual(self) -> bool:
        """Whether this rank adds the residual stream into a row-parallel
        projection's partial sum (rank 0: the all-reduce then holds it once)."""
        return self.rank == 0

    def part(self, n: int):
        """This rank's ``slice`` of ``n`` (which the world divides)."""
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)


#: one rank: no split
SINGLE = TensorParallel(0, 1)

#: per-layer tensors split by rows: suffix -> the hparams count their rows
#: are made of (heads, kv heads, ffn)
_ROWS = {"attn_q": "q", "attn_k": "kv", "attn_v": "kv", "ffn_gate": "ffn", "ffn_up": "ffn"}
#: per-layer tensors split by columns (K): row-parallel projections
_COLS = {"attn_output": "q", "ffn_down": "ffn"}


class ShardedFile:
    """Rank ``tp.rank``'s view of a :class:`~ptxgen.llm.gguf.file.LlamaFile`:
    its hyperparameters with the rank's heads, KV heads and FFN rows, and
    its shard of each split tensor (module docstring); ``output.weight``
    is the rank's rows of the output projection (of ``token_embd`` where
    the file ties them).  Everything else is the file's.

    Raises
    ------
    ValueError
        The file's shapes do not divide over ``tp.world`` ranks, or its
        architecture has no tensor-parallel split (a mixture of experts).
    """

    def __init__(self, file, tp: TensorParallel):
        self.file = file
        self.tp = tp
        hp = file.hparams
        w = tp.world
        self._check(file, w)
        self.hparams = attrs.evolve(hp, n_heads=hp.n_heads // w, n_kv_heads=hp.n_kv_heads // w,
                                    ffn=hp.ffn // w)
        self._out_source = "output.weight" if file.has("output.weight") else "token_embd.weight"

    @staticmethod
    def _check(file, w: int):
        hp = file.hparams
        where = f"{file.path}: tensor parallelism over {w} ranks"
        if hp.n_expert:
            raise ValueError(f"{where}: a mixture of experts ({hp.arch}) has no "
                             "tensor-parallel split yet")
        for what, n in (("query heads", hp.n_heads), ("KV heads", hp.n_kv_heads),
                        ("FFN rows", hp.ffn), ("vocabulary rows", hp.vocab)):
            if n % w:
                raise ValueError(f"{where}: {n} {what} do not divide into {w} equal parts")
        for i in range(hp.n_layers):
            for short, (k, what) in (("attn_output", (hp.q_dim, "query heads' columns")),
                                     ("ffn_down", (hp.ffn, "FFN columns"))):
                name = f"blk.{i}.{short}.weight"
                block = ggml_type_named(file.qtype(name)).block_size
                if (k // w) % block:
                    raise ValueError(
                        f"{where}: {name} ({file.qtype(name)}) would split its {k} {what} "
                        f"into parts of {k // w}, not a whole number of its {block}-weight "
                        "blocks")

    # ------------------------------------------------------------ the file
    def __getattr__(self, name):
        return getattr(self.file, name)

    def has(self, name: str) -> bool:
        return name == "output.weight" or self.file.has(name)

    def _source(self, name: str) -> str:
        return self._out_source if name == "output.weight" else name

    def qtype(self, name: str) -> str:
        return self.file.qtype(self._source(name))

    def _split(self, name: str):
        """``("rows" | "cols", count)`` for a split tensor, else None."""
        if name == "output.weight":
            return "rows", self.file.hparams.vocab
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk":
            return None
        hp = self.file.hparams
        counts = dict(q=hp.q_dim, kv=hp.kv_dim, ffn=hp.ffn)
        short, kind = parts[2], parts[3]
        if short in _ROWS and kind in ("weight", "bias"):
            return "rows", counts[_ROWS[short]]
        if short in _COLS and kind == "weight":
            return "cols", counts[_COLS[short]]
        return None

    def shape(self, name: str) -> tuple:
        shape = tuple(self.file.shape(self._source(name)))
        split = self._split(name)
        if split is None:
            return shape
        w = self.tp.world
        if split[0] == "rows":
            return (shape[0] // w,) + shape[1:]
        return shape[:-1] + (shape[-1] // w,)

    def tensor(self, name: str) -> RawTensor:
        """The rank's shard of the tensor (a view of the file's map)."""
        t = self.file.tensor(self._source(name))
        split = self._split(name)
        if split is None:
            return t
        shape = self.shape(name)
        if split[0] == "rows":
            return RawTensor(name, t.qtype, shape, t.data[self.tp.part(t.data.shape[0])])
        # columns: the rank's K blocks, as bytes of each stored row
        n_bytes = t.data.shape[-1]
        return RawTensor(name, t.qtype, shape, t.data[..., self.tp.part(n_bytes)])

    def in_f16_range(self, name: str) -> bool:
        return self.file.in_f16_range(self._source(name))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the tensors this rank holds (its shards, the rest whole)."""
        names = [n for n in self.file.names if n != "output.weight"] + ["output.weight"]
        return sum(int(np.prod(self.tensor(n).data.shape)) * self.tensor(n).data.itemsize
                   for n in names)
