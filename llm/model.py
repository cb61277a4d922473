"""A decoder from a GGUF file on a backend: its weights, its KV cache and
the graphs its definition lowers to.

:meth:`Model.from_gguf` validates the file (:mod:`.gguf.file`), finds the
definition of its architecture (:mod:`.models`), lowers it for one token
(:class:`~.lowering.decode.DecodeLowering`: the decode step, captured as
one CUDA graph per way of choosing the next token) and, when a prompt
first needs them, for prompt chunks (:class:`~.prefill.Prefill`); both
read the same weights and write the same KV cache.

The sequence in the cache belongs to a :class:`~.session.Session`;
``generate``, ``decode`` and the text methods (:mod:`.textgen`) run on a
session made for the call (or, with ``keep_cache``, on the sequence the
cache holds).  Nothing the model holds refers back to it, so ``del model``
frees its device memory at once.
"""

from __future__ import annotations

import sys
import time

import attrs

from ptxgen.driver.executor import DeviceMemory, Executor, Store
from ptxgen.kernels import flash_decode
from ptxgen.kernels.spec_fields import has_griddepcontrol

from .generation import GREEDY, ContextOverflowError, SamplingSettings
from .gguf.file import GGUFError, LlamaFile
from .lowering.common import Tuning
from .lowering.decode import NORM_KINDS, DecodeLowering, norm_kinds
from .models import architecture_of
from .parallel import SINGLE, ShardedFile, TensorParallel
from .persistent import decode_path
from .session import Decoding, GenerateResult, Session
from .textgen import TextGeneration

__all__ = ["Model", "GenerateResult", "ContextOverflowError", "SamplingSettings", "NORM_KINDS",
           "enable_pdl"]


class Model(TextGeneration):
    """A decoder model on a backend.

    Use :meth:`from_gguf`.  ``capacity`` is the KV-cache length (tokens).
    Token ids in, token ids out: :meth:`generate` and :meth:`decode`; text
    through the file's tokenizer: :meth:`generate_text`, :meth:`stream`,
    :meth:`chat` and :meth:`chat_session` (:mod:`.textgen`); a sequence of
    your own: :meth:`session`.

    ``pdl`` (default: on for sm_90 and newer) builds and launches every
    kernel with programmatic dependent launch: each kernel starts while the
    one before it drains, issues its first weight loads, and waits
    (``griddepcontrol.wait``) before it reads activations.  ``fuse_norm``
    names the RMSNorms folded into the Q4_K GEMVs that read their output
    instead of launched on their own: any of ``"attn"`` (into the stacked
    Q/K/V GEMV), ``"ffn"`` (gate/up) and ``"output"`` (the logits GEMV);
    ``True`` for all, ``False`` for none; the default, ``("attn",)``, is
    the fastest measured (docs/llm.md, "The decode step").  ``gemv_knobs`` replaces
    GemvConfig fields of the Q4_K GEMVs' tuned configs (e.g. ``{"rows":
    4}``), for tuning; a function ``(m, k, epilogue) -> dict`` gives them
    per GEMV shape; a field a shape cannot take is refused with the shape
    named.  ``flash_knobs`` replaces FlashDecodeConfig fields of the
    attention kernels' tuned config (e.g. ``{"warps": 4}``).
    ``fuse_rope`` (default True) gives RoPE and the KV-cache append to the
    stacked Q/K/V GEMV's epilogue where the architecture allows.

    ``tp`` (a :class:`~.parallel.TensorParallel` of several ranks) makes
    this object one rank of a tensor-parallel model: it holds the rank's
    shard of ``file`` (:class:`~.parallel.ShardedFile`) and its graphs
    meet the other ranks' through ``comm``, the rank's communicator
    (:mod:`ptxgen.driver.collective`).  Every rank runs the same calls in
    the same order (one process or thread each).
    """

    def __init__(self, file: LlamaFile, backend, *, capacity: int | None = None,
                 target: str | None = None, progress: bool = True, sm_count: int | None = None,
                 pdl: bool | None = None, fuse_norm=("attn",), gemv_knobs=None,
                 flash_knobs=None, fuse_rope: bool = True, tokenizer=None,
                 tp: TensorParallel = SINGLE, comm=None):
        if tp.world > 1:
            if comm is None or (comm.rank, comm.world) != (tp.rank, tp.world):
                raise ValueError(f"rank {tp.rank} of {tp.world} needs that rank's communicator, "
                                 f"got {comm!r}")
            file = file if isinstance(file, ShardedFile) else ShardedFile(file, tp)
        self.tp, self.comm = tp, comm
        self.file = file
        #: the text <-> token ids of the file's vocabulary (None if it has none)
        self.tokenizer = tokenizer
        self.hp = file.hparams
        self.arch = architecture_of(file)
        _check_attention_shape(file)
        self.backend = backend
        self.capacity = int(capacity or min(self.hp.context_length, 4096))
        if self.capacity < 2:
            raise ValueError(f"capacity must be at least 2 tokens, got {self.capacity}")
        self.target = target or backend.target
        self.sm_count = sm_count or backend.sm_count
        self.fuse_norm = norm_kinds(fuse_norm)
        self.tuning = Tuning(self.sm_count, gemv_knobs or {}, backend.device_name)
        self.store = Store()
        self.step_graph = DecodeLowering(
            file, self.store, target=self.target, sm_count=self.sm_count,
            capacity=self.capacity, rope_layout=self.arch.rope_layout, tuning=self.tuning,
            fuse_norm=self.fuse_norm, fuse_rope=fuse_rope, flash_knobs=flash_knobs, tp=tp)
        self.arch.forward(self.step_graph)
        # programmatic dependent launch: on by default where the target has it
        self.pdl = has_griddepcontrol(self.target) if pdl is None else bool(pdl)
        if self.pdl:
            enable_pdl(self.step_graph.g)
        self.memory = DeviceMemory(backend)
        bar = _ProgressBar(file.weight_bytes, enabled=progress)
        self.executor = Executor(self.step_graph.g, backend, progress=bar.update,
                                 memory=self.memory, comm=comm)
        bar.close()
        self.device_stream = backend.stream()
        self._prefills: dict = {}
        self._persistent = None
        #: how a greedy ``mode="graph"`` step runs: the tuning table's choice
        #: (``"graph"`` or ``"persistent"``, :func:`~.persistent.decode_path`)
        self.decode_path = decode_path(file, self.target) if tp.world == 1 else "graph"
        #: the session whose sequence the KV cache holds, and the position it reached
        self.cache_owner: int | None = None
        self.cache_position: int | None = None

    @classmethod
    def from_gguf(cls, path, *, backend="auto", capacity=None, progress=True,
                  tokenizer: bool = True, **kw):
        """Load a GGUF file onto ``backend`` (``"cuda"``, ``"emu"`` or ``"auto"``).

        With ``tokenizer`` (the default) the file's vocabulary, when it has
        one (``tokenizer.ggml.*``), becomes :attr:`tokenizer`; it must have
        as many tokens as the model has logits.
        """
        from ptxgen.driver.backend import get_backend
        f = LlamaFile(path)
        tok = f.tokenizer() if tokenizer else None
        be = get_backend(backend) if isinstance(backend, str) else backend
        return cls(f, be, capacity=capacity, progress=progress, tokenizer=tok, **kw)

    # ------------------------------------------------------------ the graphs
    @property
    def graph(self):
        """The decode step's :class:`~ptxgen.driver.executor.ComputeGraph`."""
        return self.step_graph.g

    @property
    def kv_caches(self) -> list:
        """Each layer's ``(k_cache, v_cache)`` buffers (f16 ``[n_kv_heads,
        capacity, head_dim]``; read them with ``model.executor.read``)."""
        b = self.store.buffers
        return [(b[f"blk.{i}.k_cache"], b[f"blk.{i}.v_cache"]) for i in range(self.hp.n_layers)]

    def step(self, mode: str = "graph", variant: str | None = None):
        """Run one decode step of ``variant`` (default ``"greedy"``): eager
        launches, one replay of the variant's CUDA graph, or (``mode=
        "persistent"``, greedy only) one launch of the persistent kernel;
        a greedy ``"graph"`` step takes the persistent kernel where
        :attr:`decode_path` says so."""
        v = self.graph.resolve_variant(variant)
        if mode == "graph" and self.decode_path == "persistent" and v == GREEDY:
            mode = "persistent"
        if mode == "persistent":
            self.persistent_step(v).step(self.device_stream)
            return
        if mode == "graph" and self.backend.can_capture:
            if not self.executor.is_captured(v):
                self.executor.capture(self.device_stream, v)
            self.executor.replay(self.device_stream, v)
        else:
            self.executor.run_eager(self.device_stream, variant=v)

    def persistent_step(self, variant=None, grid: int | None = None, timeline: bool = False):
        """The :class:`~.persistent.PersistentDecode` of the step (made on
        first use, for ``grid`` CTAs, default one an SM; the greedy variant
        only; ``timeline``: one that stamps its instructions' times)."""
        from .persistent import PersistentDecode
        if self.tp.world > 1:
            raise ValueError("the persistent decode kernel runs a whole model on one GPU; a "
                             "tensor-parallel rank decodes with its graph (mode='graph' or "
                             "'eager')")
        v = self.graph.resolve_variant(variant)
        if v != GREEDY:
            raise ValueError(f"the persistent decode kernel runs the greedy step, not {v!r}")
        if self._persistent is None or (timeline and self._persistent._stamps is None):
            self._persistent = PersistentDecode(self, grid, timeline=timeline)
        return self._persistent

    def prefill(self, chunk: int, buckets=None):
        """The :class:`~.prefill.Prefill` for chunks of up to ``chunk``
        tokens (at most the capacity; ``buckets``: see there; made on first use)."""
        from .prefill import Prefill
        chunk = min(int(chunk), self.capacity)
        key = (chunk, None if buckets is None else tuple(buckets))
        pre = self._prefills.get(key)
        if pre is None:
            pre = self._prefills[key] = Prefill(
                self.arch, self.store, self.memory, self.backend, self.device_stream,
                target=self.target, capacity=self.capacity, chunk=chunk,
                device=self.tuning.device, pdl=self.pdl, buckets=buckets, tp=self.tp,
                comm=self.comm)
        return pre

    def default_prefill_chunk(self) -> int:
        """The prompt chunk :meth:`generate` uses by default: 512 on the GPU
        when every layer weight's type has a GEMM there, 0 (token by token)
        otherwise and on the emulator."""
        from .prefill import DEFAULT_CHUNK, gemm_ready
        if not self.backend.can_capture or not gemm_ready(self.file, self.target):
            return 0
        return DEFAULT_CHUNK

    def summary(self) -> str:
        return self.graph.summary()

    # ------------------------------------------------------------ sequences
    def session(self) -> Session:
        """A new sequence on this model (it takes the KV cache when it runs)."""
        return Session(self)

    def _session(self, keep_cache: bool) -> Session:
        return Session(self, continue_cache=keep_cache)

    @property
    def position(self) -> int | None:
        """Where the sequence in the cache stands (see :attr:`Session.position`)."""
        return self.cache_position if self.cache_owner is not None else None

    def reset(self, prompt):
        """Start a new sequence in the cache that feeds ``prompt`` next."""
        self._session(False).reset(prompt)

    def decode(self, token_ids, *, keep_cache: bool = False, **kw) -> Decoding:
        """:meth:`Session.decode` on a new sequence, or with ``keep_cache``
        on the one in the cache."""
        return self._session(keep_cache).decode(token_ids, keep_cache=keep_cache, **kw)

    def generate(self, token_ids, max_new_tokens: int, *, keep_cache: bool = False, **kw):
        """:meth:`Session.generate` on a new sequence, or with ``keep_cache``
        on the one in the cache."""
        return self._session(keep_cache).generate(token_ids, max_new_tokens,
                                                  keep_cache=keep_cache, **kw)


def enable_pdl(graph) -> int:
    """Rebuild every launch of ``graph`` whose spec has a ``pdl`` field with
    ``pdl=True`` (the kernels start while their predecessor drains and wait
    with ``griddepcontrol.wait``).  Returns the number of launches changed."""
    n = 0
    for op in graph.ops:
        launches = []
        for L in op.launches:
            s = L.spec
            if getattr(s, "pdl", None) is False:
                # a plan (spec + config) changes its spec's field through evolve
                s = s.evolve(pdl=True) if hasattr(s, "evolve") else attrs.evolve(s, pdl=True)
                L = attrs.evolve(L, spec=s)
                n += 1
            launches.append(L)
        op.launches = tuple(launches)
    return n


def _check_attention_shape(file):
    """Refuse, at load, head shapes no attention kernel takes."""
    hp = file.hparams
    try:
        flash_decode.FlashDecodeSpec(head_dim=hp.head_dim, group=hp.n_heads // hp.n_kv_heads,
                                     kv_dtype="f16")
    except ValueError as e:
        a = hp.arch
        raise GGUFError(f"{file.path}: {hp.n_heads} query heads on {hp.n_kv_heads} KV heads "
                        f"of size {hp.head_dim} (metadata keys '{a}.attention.key_length', "
                        f"'{a}.attention.head_count', '{a}.attention.head_count_kv') have no "
                        f"attention kernel: {e}") from None


class _ProgressBar:
    """A one-line progress bar on stderr while weights upload."""

    def __init__(self, total: int, enabled: bool = True):
        self.total = max(total, 1)
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def update(self, done, total, name):
        if not self.enabled:
            return
        frac = done / max(total, 1)
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\rloading weights [{bar:<30}] {done / 1e9:6.2f}/{total / 1e9:.2f} GB "
                         f"{name[:24]:<24}")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write(f"\rloaded in {time.perf_counter() - self.t0:.1f} s" + " " * 60 + "\n")
