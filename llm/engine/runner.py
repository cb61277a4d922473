"""The batched engine's device side: a model's weights, a paged KV pool,
and the step graphs of its definition lowered for batches
(:class:`~ptxgen.llm.lowering.batch.BatchLowering`).

A step is either a **decode step** (one token of each of up to
``max_batch`` sequences; each row's next token chosen with its own
sampling settings) or a **prefill step** (up to ``chunk`` prompt tokens,
chunks of one or more sequences, their K and V rows written to the pool;
no logits: a prompt's last token is fed by a decode step).  Each kind has a graph per
bucket (the row counts ``1, 2, 4, ...`` up to its largest), captured on
first use on the GPU and replayed; a step runs the smallest bucket that
holds it.  The inputs of a step (token ids, positions, KV slots, block
tables, lengths, sampling parameters) go to the device in one copy.

A decode step may also go in two halves, :meth:`BatchRunner.launch` (the
step queued on the device; it returns at once) and
:meth:`BatchRunner.collect` (its tokens), so the host prepares the next
step while the device computes this one; a step launched to ``follow``
the one before it takes its tokens from that step's choice on the device.

The block manager (which blocks a sequence owns) is the scheduler's
(:mod:`.blocks`); the runner only reads the tables it is given.
"""

from __future__ import annotations

import attrs
import numpy as np

from ptxgen.driver.executor import Arena, DeviceMemory, Executor, Store, plan_activations
from ptxgen.kernels.sampling.params import LOGPROBS
from ptxgen.llm.generation import GREEDY
from ptxgen.llm.lowering.batch import BatchIO, BatchLowering
from ptxgen.llm.model import enable_pdl
from ptxgen.llm.models import architecture_of

from .blocks import DEFAULT_BLOCK_SIZE, kv_bytes_per_token, kv_pool_blocks
from .rows import DecodeRow, PrefillChunk, RowOutput

__all__ = ["BatchRunner", "DecodeRow", "PrefillChunk", "RowOutput"]

#: device memory kept free beside the pool (the CUDA context's and the
#: driver's own use, graphs), besides the weights and the activations
RESERVE_BYTES = 1 << 30


def _buckets(largest: int) -> tuple:
    out, b = [], 1
    while b < largest:
        out.append(b)
        b *= 2
    return tuple(out) + (largest,)


class BatchRunner:
    """Steps of a model over a paged KV pool.

    Parameters
    ----------
    file : LlamaFile
    backend : the executor backend (``ptxgen.driver.backend``)
    max_batch : int
        The most sequences of a decode step.
    ctx_size : int, optional
        The most tokens one sequence holds (default: the model's context
        length, at most 4096).
    chunk : int
        The most tokens of a prefill chunk.
    num_blocks : int, optional
        The pool's blocks (per layer); default: what fits in
        ``gpu_memory_utilization`` of the device memory left once the
        weights, the step's activations and a reserve are counted; on the
        emulator, room for two sequences at full context.
    block_size : int, optional
        Tokens per block (default :data:`~.blocks.DEFAULT_BLOCK_SIZE`).
    target, sm_count, device : the GPU's (defaults from the backend)
    pdl : bool
    gemv_rows : int
        Decode steps of at most this many rows run their weights as GEMVs.
    batch_gemv_rows : int, optional
        Decode steps of at most this many rows run the weights the batched
        GEMV reads through it (None: the tuning table's crossover; 0: never;
        :class:`~ptxgen.llm.lowering.batch.BatchLowering`).
    """

    def __init__(self, file, backend, *, max_batch: int = 64, ctx_size: int | None = None,
                 chunk: int = 512, num_blocks: int | None = None, block_size: int | None = None,
                 gpu_memory_utilization: float = 0.9, progress: bool = False, target=None,
                 sm_count=None, device=None, pdl=None, gemv_rows: int = 1,
                 batch_gemv_rows: int | None = None):
        from ptxgen.kernels.spec_fields import has_griddepcontrol
        self.file, self.hp = file, file.hparams
        self.arch = architecture_of(file)
        self.backend = backend
        self.block_size = int(block_size or DEFAULT_BLOCK_SIZE)
        self.max_batch, self.chunk = int(max_batch), int(chunk)
        self.n_ctx = int(ctx_size or min(self.hp.context_length, 4096))
        self.max_blocks_per_seq = -(-self.n_ctx // self.block_size)
        self.n_vocab = self.hp.vocab
        if num_blocks is None:
            num_blocks = self._pool_blocks(gpu_memory_utilization)
        self.num_blocks = int(num_blocks)
        if self.num_blocks < 1:
            raise ValueError("the KV pool needs at least one block: no device memory is left "
                             "for it (lower ctx_size or max_batch, or raise "
                             "gpu_memory_utilization)")
        self.target = target or backend.target
        self.sm_count = sm_count or backend.sm_count
        self.device = device if device is not None else backend.device_name
        self.pdl = has_griddepcontrol(self.target) if pdl is None else bool(pdl)
        self.io = BatchIO(max(self.max_batch, self.chunk), self.max_blocks_per_seq)
        self.store, self.memory, self.arena = Store(), DeviceMemory(backend), Arena(backend)
        self._graphs = {}
        for kind, largest in (("decode", self.max_batch), ("prefill", self.chunk)):
            for b in _buckets(largest):
                lw = BatchLowering(file, self.store, target=self.target,
                                   rope_layout=self.arch.rope_layout, kind=kind, rows=b,
                                   io=self.io, num_blocks=self.num_blocks,
                                   block_size=self.block_size, n_ctx=self.n_ctx,
                                   sm_count=self.sm_count, device=self.device, pdl=self.pdl,
                                   gemv_rows=gemv_rows if kind == "decode" else 0,
                                   batch_gemv_rows=batch_gemv_rows)
                self.arch.forward(lw)
                if self.pdl and lw.row_gemvs:
                    # every launch, as the single-sequence decode step's
                    enable_pdl(lw.g)
                self._graphs[kind, b] = lw
                self.arena.reserve(plan_activations(lw.g))
        self._executors: dict = {}
        self.stream = backend.stream()
        self._host = np.zeros(self.io.words, np.int32)
        # launch(): two host images and two token read-backs, taken in turn
        # (pinned on the GPU, so the copies queue behind the step in flight)
        self._slots = [_Slot(self._pinned(self.io.words), self._pinned(self.io.rows),
                             self._event()) for _ in range(2)]
        self._turn = 0
        self._history = np.zeros((self.io.rows, min(self.n_ctx, 1024)), np.int32)

    def _pool_blocks(self, utilization: float) -> int:
        hp, bs = self.hp, self.block_size
        per_token = kv_bytes_per_token(hp.n_layers, hp.n_kv_heads, hp.head_dim)
        mem = getattr(getattr(self.backend, "device", None), "mem_info", None)
        if mem is None:                  # the emulator: two sequences at full context
            return 2 * self.max_blocks_per_seq
        free, _ = mem()
        acts = (self.max_batch + self.chunk) * (4 * hp.ffn + 2 * hp.vocab) * 4
        left = free - self.file.weight_bytes - acts - RESERVE_BYTES
        return kv_pool_blocks(max(left, 0), utilization, per_token, bs)

    def _pinned(self, n: int) -> np.ndarray:
        if self.backend.name == "cuda":
            from ptxgen.driver.memory import pinned_zeros
            return pinned_zeros((n,), np.int32)
        return np.zeros(n, np.int32)

    def _event(self):
        if self.backend.name == "cuda":
            from ptxgen.driver.stream import Event
            return Event(timing=False)
        return None

    # ------------------------------------------------------------ graphs
    def buckets(self, kind: str) -> tuple:
        return tuple(b for k, b in self._graphs if k == kind)

    def graph(self, kind: str, rows: int):
        """The :class:`~ptxgen.driver.executor.ComputeGraph` of a bucket."""
        return self._graphs[kind, rows].g

    def _bucket(self, kind: str, n: int) -> int:
        for b in self.buckets(kind):
            if n <= b:
                return b
        raise ValueError(f"a {kind} step of {n} rows exceeds the largest bucket "
                         f"({self.buckets(kind)[-1]})")

    def _executor(self, kind, bucket) -> Executor:
        ex = self._executors.get((kind, bucket))
        if ex is None:
            ex = self._executors[kind, bucket] = Executor(
                self._graphs[kind, bucket].g, self.backend, memory=self.memory, arena=self.arena)
        return ex

    def _run(self, kind, n, mode, variant=None):
        b = self._bucket(kind, n)
        ex = self._executor(kind, b)
        lw = self._graphs[kind, b]
        ex.write(lw.io, self._host, stream=self.stream)
        if mode == "graph" and self.backend.can_capture:
            if not ex.is_captured(variant):
                ex.capture(self.stream, variant)
            ex.replay(self.stream, variant)
        else:
            ex.run_eager(self.stream, variant=variant)
        return ex, lw

    # -------------------------------------------------------------- inputs
    def _slot(self, table, position) -> int:
        i, off = divmod(position, self.block_size)
        if i >= len(table):
            raise ValueError(f"position {position} is past the block table's "
                             f"{len(table)} blocks of {self.block_size}")
        blk = int(table[i])
        if not 0 <= blk < self.num_blocks:
            raise ValueError(f"block {blk} is outside the pool of {self.num_blocks}")
        return blk * self.block_size + off

    def _fill(self, rows, h=None):
        """Write ``rows`` (``(token, position, table)`` each) into the host
        image (``h``, default the runner's)."""
        io = self.io
        h = self._host if h is None else h
        h[:] = 0
        tok, pos, slot, lens = (io.view(h, n) for n in ("tokens", "positions", "slots", "lens"))
        tables = io.view(h, "tables")
        for r, (t, p, table) in enumerate(rows):
            if len(table) > io.max_blocks:
                raise ValueError(f"a block table of {len(table)} blocks is wider than "
                                 f"{io.max_blocks}")
            tok[r], pos[r], slot[r], lens[r] = t, p, self._slot(table, p), p + 1
            tables[r, :len(table)] = table
        io.view(h, "info")[:] = (0, len(rows))

    # --------------------------------------------------------------- steps
    def decode(self, rows, mode: str = "graph") -> list:
        """One decode step: the next token of each row's sequence."""
        n = len(rows)
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"a decode step takes 1..{self.max_batch} rows, got {n}")
        self._fill([(r.token, r.position, r.block_table) for r in rows])
        params = self.io.view(self._host, "params")
        penalties = False
        for i, r in enumerate(rows):
            params[i] = r.sampling.params(r.seed)
            params[i, LOGPROBS] = 1 if r.logprobs > 0 else 0
            penalties |= r.sampling.penalties_on
        b = self._bucket("decode", n)
        lw = self._graphs["decode", b]
        ex = self._executor("decode", b)
        if penalties:
            # each row's recent tokens in its ring: token p at p % window
            W = lw.window
            self._history[:] = 0
            for i, r in enumerate(rows):
                hist = r.history[-W:]
                first = r.position + 1 - len(hist)
                self._history[i, [(first + k) % W for k in range(len(hist))]] = hist
            ex.write(lw.history, self._history[:, :W], stream=self.stream)
        # the argmax where the bucket has it and no row needs the sampler
        variant = None
        if GREEDY in lw.g.variants and all(r.sampling.is_greedy and r.logprobs <= 0
                                           for r in rows):
            variant = GREEDY
        ex, lw = self._run("decode", n, mode, variant)
        self.backend.synchronize(self.stream)
        toks = ex.read(lw.next_tokens)[:n]
        if not any(r.logprobs > 0 for r in rows):
            return [RowOutput(int(t), float("nan")) for t in toks]
        lp, ids, lps = (ex.read(b)[:n] for b in (lw.logprob, lw.top_ids, lw.top_logprobs))
        out = []
        for i, r in enumerate(rows):
            if r.logprobs <= 0:
                out.append(RowOutput(int(toks[i]), float("nan")))
                continue
            k = min(r.logprobs, ids.shape[1])
            out.append(RowOutput(int(toks[i]), float(lp[i]),
                                 tuple((int(ids[i, j]), float(lps[i, j])) for j in range(k))))
        return out

    def launch(self, rows, follow=None, mode: str = "graph") -> "Launched":
        """Queue a decode step on the device and return at once; its tokens
        are :meth:`collect`'s.

        Parameters
        ----------
        rows : list of DecodeRow
            Without penalties or log-probabilities (:meth:`decode` takes those).
        follow : Launched, optional
            The step launched just before, of as many rows: row ``i``'s token
            is the one that step chose for its row ``i`` (taken on the device;
            the rows' own ``token`` is not read).

        At most two steps may be launched and not yet collected; collect
        them in the order they were launched.
        """
        n = len(rows)
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"a decode step takes 1..{self.max_batch} rows, got {n}")
        if follow is not None and follow.n != n:
            raise ValueError(f"a step of {n} rows cannot follow one of {follow.n}")
        if any(r.logprobs > 0 or r.sampling.penalties_on for r in rows):
            raise ValueError("rows with penalties or log-probabilities need the host between "
                             "steps: run them with decode()")
        slot = self._slots[self._turn]
        if slot.busy:
            raise RuntimeError("two steps are launched and not collected; collect one first")
        h = slot.host
        self._fill([(max(r.token, 0), r.position, r.block_table) for r in rows], h)
        params = self.io.view(h, "params")
        for i, r in enumerate(rows):
            params[i] = r.sampling.params(r.seed)
            params[i, LOGPROBS] = 0
        b = self._bucket("decode", n)
        ex, lw = self._executor("decode", b), self._graphs["decode", b]
        graph = mode == "graph" and self.backend.can_capture
        if graph and not ex.is_captured():
            self.backend.synchronize(self.stream)
            ex.capture(self.stream)
        kw = {} if self.stream is None else {"stream": self.stream}
        ex.write(lw.io, h, stream=self.stream)
        nxt = ex.arrays[id(lw.next_tokens)].view(np.int32, (n,))
        if follow is not None:
            tok = ex.arrays[id(lw.io)].view(np.int32, (n,), 4 * self.io.fields["tokens"][0])
            tok.copy_from(nxt, **kw)
        if graph:
            ex.replay(self.stream)
        else:
            ex.run_eager(self.stream)
        if slot.event is None:                 # the emulator: the step has run
            nxt.to_numpy(slot.tokens[:n])
        else:
            from ptxgen.driver.errors import check, cuda
            from ptxgen.driver.stream import stream_handle
            check(cuda().cuMemcpyDtoHAsync(slot.tokens.ctypes.data, nxt.ptr, 4 * n,
                                           stream_handle(self.stream)), "cuMemcpyDtoHAsync")
            slot.event.record(self.stream)
        slot.busy = True
        self._turn ^= 1
        return Launched(slot, n)

    def collect(self, handle: "Launched") -> list:
        """Wait for a step :meth:`launch` queued; its rows' tokens."""
        slot = handle.slot
        if not slot.busy or slot.owner is not handle:
            raise RuntimeError("this step was collected already")
        if slot.event is not None:
            slot.event.synchronize()
        slot.busy, slot.owner = False, None
        return [RowOutput(int(t), float("nan")) for t in slot.tokens[:handle.n]]

    def prefill(self, chunks, mode: str = "graph") -> None:
        """One prefill step: write the K and V rows of ``chunks`` (a
        :class:`PrefillChunk` or a sequence of them, at most ``chunk``
        tokens together, each of its own sequence) to the pool.  Each row
        attends over its own sequence through its own table, so chunks of
        several sequences share the step's weight pass."""
        if isinstance(chunks, PrefillChunk):
            chunks = (chunks,)
        rows = [(t, c.start + i, c.block_table) for c in chunks for i, t in enumerate(c.tokens)]
        if not 1 <= len(rows) <= self.chunk:
            raise ValueError(f"a prefill step takes 1..{self.chunk} tokens, got {len(rows)}")
        self._fill(rows)
        self._run("prefill", len(rows), mode)
        self.backend.synchronize(self.stream)

    def warm_up(self) -> int:
        """Capture every bucket's graph (each of its variants) now (on the
        GPU; a no-op on the emulator), so no request waits for a capture;
        returns how many buckets were captured.  Capturing records the
        launches without running them: the pool is untouched."""
        if not self.backend.can_capture:
            return 0
        n = 0
        for kind, b in self._graphs:
            ex = self._executor(kind, b)
            fresh = False
            for v in self._graphs[kind, b].g.variants or (None,):
                if not ex.is_captured(v):
                    ex.capture(self.stream, v)
                    fresh = True
            n += fresh
        self.backend.synchronize(self.stream)
        return n

    # ------------------------------------------------------------ reading
    def read_kv(self, layer: int):
        """Layer ``layer``'s K and V pools, as host arrays (for tests)."""
        ex = next(iter(self._executors.values()), None) or self._executor("decode", 1)
        p = f"blk.{layer}."
        b = self.store.buffers
        return ex.read(b[p + "k_pool"]), ex.read(b[p + "v_pool"])


@attrs.define(eq=False)
class _Slot:
    """A host image, a token read-back and its event, for one launched step."""

    host: np.ndarray
    tokens: np.ndarray
    event: object
    busy: bool = False
    owner: object = None


@attrs.define(eq=False)
class Launched:
    """A decode step :meth:`BatchRunner.launch` queued (for :meth:`~BatchRunner.collect`)."""

    slot: _Slot
    n: int

    def __attrs_post_init__(self):
        self.slot.owner = self
