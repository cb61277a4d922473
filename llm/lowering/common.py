"""What every lowering shares: the model's persistent buffers (weights as
stored in the file, the stacked Q/K/V weight (and its NeoX pair-ordered
copy for the decode step), the bias vector, the RoPE
table, the KV cache) and the way an op and its launches join a graph.

A lowering is the object a model definition's blocks are called on
(:mod:`ptxgen.llm.models`): each block method adds tensor ops, each lowered
to kernel launches, to one :class:`~ptxgen.driver.executor.ComputeGraph`.
The decode lowering (:mod:`.decode`) emits GEMVs and flash decode for one
token; the chunk lowering (:mod:`.chunk`) GEMMs and chunk attention for
the rows of a prompt chunk.  Both take their persistent buffers from one
:class:`~ptxgen.driver.executor.Store`, so the graphs of a model share its
weights and KV cache.
"""

from __future__ import annotations

import attrs
import numpy as np

from ptxgen.driver.executor import ComputeGraph, Launch
from ptxgen.driver.collective import Collective
from ptxgen.kernels import gemv, rope
from ptxgen.llm.parallel import SINGLE, TensorParallel

__all__ = ["Tuning", "Normed", "QKV", "TensorInfo", "Lowering"]

_QKV = ("attn_q", "attn_k", "attn_v")


@attrs.frozen
class Tuning:
    """How the model's GEMVs are configured, passed down explicitly:
    ``sm_count`` (a ring's CTAs are spread evenly over the SMs) and
    ``overrides``, GemvConfig fields for every Q4_K GEMV (a dict, or a
    function ``(m, k, epilogue) -> dict``).  An override a shape cannot take
    is refused with the shape named."""

    sm_count: int | None = None
    overrides: object = attrs.field(factory=dict)
    #: the device's name: configs ``python -m ptxgen tune`` stored for it win
    device: str | None = None


@attrs.frozen
class TensorInfo:
    """A weight's name, GGML type and logical shape ``[rows, cols]``."""

    name: str
    qtype: str
    shape: tuple


@attrs.frozen(eq=False)
class Normed:
    """The RMSNorm of ``x`` with the file's weight ``weight``, not yet
    launched: the block that reads it launches it, or folds it into its own
    first kernel (``kind`` names it for ``fuse_norm``: attn, ffn, output)."""

    x: object
    weight: str
    kind: str


@attrs.frozen
class QKV:
    """The tensors of a layer's attention input: the projections, their
    optional biases (None where the file has none) and the optional
    per-head RMSNorm weights of q and k (qwen3, gemma3); ``local``: RoPE at
    the sliding-window layers' base, unscaled (gemma3's local layers)."""

    layer: int
    q: str
    k: str
    v: str
    biases: tuple = (None, None, None)
    q_norm: str | None = None
    k_norm: str | None = None
    local: bool = False

    @classmethod
    def of_layer(cls, file, i: int, qk_norm: bool, local: bool = False) -> "QKV":
        p = f"blk.{i}."
        biases = tuple(p + n + ".bias" if file.has(p + n + ".bias") else None for n in _QKV)
        return cls(i, *(p + n + ".weight" for n in _QKV), biases=biases,
                   q_norm=p + "attn_q_norm.weight" if qk_norm else None,
                   k_norm=p + "attn_k_norm.weight" if qk_norm else None, local=local)

    @property
    def prefix(self) -> str:
        return f"blk.{self.layer}."

    @property
    def has_bias(self) -> bool:
        return any(b is not None for b in self.biases)


class Lowering:
    """The graph, the file and the persistent buffers one lowering writes
    into; subclasses implement the blocks (``embed``, ``norm``, ``qkv``,
    ``attention``, ``linear``, ``gated_ffn``, ``output``).

    With ``tp`` of several ranks, ``file`` is the rank's
    :class:`~ptxgen.llm.parallel.ShardedFile` and the lowering adds the
    collectives that join the ranks' partial results
    (:meth:`all_reduce`, the logits' all-gather)."""

    def __init__(self, file, store, *, target: str, capacity: int, rope_layout: str,
                 tp: TensorParallel = SINGLE):
        if tp.world > 1 and getattr(file, "tp", None) != tp:
            raise ValueError(f"rank {tp.rank} of {tp.world} lowers its ShardedFile "
                             "(ptxgen.llm.parallel), not the whole file")
        self.tp = tp
        self.file = file
        self.hp = file.hparams
        self.store = store
        self.g = ComputeGraph(store)
        self.target = target
        self.capacity = capacity
        self.rope_layout = rope_layout

    # ------------------------------------------------------- persistent buffers
    def weight(self, name: str):
        """The file's tensor ``name`` as a weight buffer, and the tensor."""
        t = self.file.tensor(name)
        return self.g.buffer(name, t.data.shape, t.data.dtype, "weight", t.data), t

    def stacked_qkv(self, w: QKV, pair_order: bool = False, with_v: bool = True):
        """``[Wq; Wk; Wv]`` as one weight (the three share a type), and its
        :class:`TensorInfo`.  ``pair_order``: a buffer of its own with each q
        and k head's rows in NeoX rotation-pair order, as the GEMV's rope
        epilogue reads them (:func:`ptxgen.kernels.gemv.neox_pair_rows`).
        ``with_v=False``: ``[Wq; Wk]`` (``attn_qk``), for a layer whose v has
        another type."""
        f, hp = self.file, self.hp
        if pair_order and not with_v:
            raise ValueError("pair_order is for the stacked q, k and v of the rope epilogue")
        names = (w.q, w.k, w.v) if with_v else (w.q, w.k)
        rows = sum(f.shape(n)[0] for n in names)
        info = TensorInfo(w.prefix + ("attn_qkv.weight" if with_v else "attn_qk.weight"),
                          f.qtype(w.q), (rows, f.shape(w.q)[1]))
        first = f.tensor(w.q).data
        shape = (rows,) + first.shape[1:]

        def data():
            out = np.concatenate([f.tensor(n).data for n in names])
            if pair_order:
                out = out[gemv.neox_pair_rows(hp.head_dim, hp.n_heads, hp.n_kv_heads)]
            return out
        name = w.prefix + "attn_qkv.neox_pairs.weight" if pair_order else info.name
        buf = self.g.buffer(name, shape, first.dtype, "weight", data)
        return buf, info

    def qkv_bias(self, w: QKV):
        """One f32 buffer of the layer's q | k | v biases (zeros for a missing
        one: adding 0 is exact), or None when the layer has none."""
        if not w.has_bias:
            return None
        hp = self.hp
        parts = [self.file.tensor(n).data.astype(np.float32) if n is not None
                 else np.zeros(rows, np.float32)
                 for n, rows in zip(w.biases, (hp.q_dim, hp.kv_dim, hp.kv_dim))]
        data = np.concatenate(parts)
        return self.g.buffer(w.prefix + "attn_qkv.bias", data.shape, np.float32, "weight", data)

    def qk_norm_args(self, w: QKV):
        """The q/k norm weight buffers a layer's RoPE launch reads and its
        arguments ``q_norm, k_norm, eps`` (``RopeSpec.qk_norm``); none where
        the layer has no q/k norms."""
        if w.q_norm is None:
            return [], {}
        qn, _ = self.weight(w.q_norm)
        kn, _ = self.weight(w.k_norm)
        return [qn, kn], dict(q_norm=qn, k_norm=kn, eps=self.hp.eps)

    def rope_table(self, local: bool = False):
        """The RoPE frequencies as the kernels take them: the file's
        convention (rope_freqs factors and linear scaling included); with
        ``local``, the sliding-window layers' (their own base, unscaled)."""
        D = self.hp.head_dim
        return self.g.buffer("rope_freqs_swa" if local else "rope_freqs", (D // 2, 2), np.float32,
                             "weight", lambda: rope.table_of(self.file.rope_inv_freq(local)))

    def kv_cache(self, i: int):
        """Layer ``i``'s f16 K and V caches, ``[n_kv_heads, capacity, head_dim]``."""
        hp, p = self.hp, f"blk.{i}."
        shape = (hp.n_kv_heads, self.capacity, hp.head_dim)
        return (self.g.buffer(p + "k_cache", shape, np.float16, "state"),
                self.g.buffer(p + "v_cache", shape, np.float16, "state"))

    # ------------------------------------------------------------------ ops
    def all_reduce(self, y, name: str):
        """Sum ``y`` (a row-parallel projection's partial result) over the
        ranks, in place; nothing on one rank."""
        if self.tp.world > 1:
            self.g.add_collective("AllReduce", name + ".all_reduce",
                                  Collective("all_reduce_sum", y))
        return y

    def add(self, kind, name, ins, outs, launches, variant=None):
        return self.g.add(kind, name, ins, outs, launches, variant=variant)

    @staticmethod
    def launch(family, spec, geometry, **args) -> Launch:
        """One launch: the family's ``LaunchGeometry`` and the kernel's
        parameters by name (besides those the geometry decides)."""
        return Launch(family, spec, geometry, args)
