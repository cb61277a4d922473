"""Continuous batching: which sequences run, and what the runner does next.

Every :meth:`Scheduler.step` is one runner call: a **prefill step** (up
to ``runner.chunk`` prompt tokens: a chunk of consecutive tokens from each
of one or more prefilling sequences) or a **decode step** (one token of
every sequence whose prompt is in the cache but for its last token).

The policy
----------
* **Admission** (at the start of each step), first come first served: the
  oldest waiting sequence starts when fewer than ``runner.max_batch``
  sequences run and the pool has the blocks for all its tokens (less those
  the prefix cache holds) with ``watermark`` of the pool to spare (no spare
  needed when nothing runs).  A sequence that cannot start holds back the
  ones behind it.
* **Prefill or decode.**  A sequence with two or more tokens not yet in the
  cache is prefilling; with exactly one (its last prompt token or its last
  chosen token), decoding.  A prefill step runs when some sequence is
  prefilling and either none is decoding or fewer than ``prefill_budget``
  (default ``runner.chunk``) prompt tokens have run since the last decode
  step; otherwise a decode step runs.  A prefill step takes, oldest first,
  a chunk of each prefilling sequence (all its pending tokens but the last)
  until it holds ``runner.chunk`` tokens, or what is left of the budget
  while others decode; so many short prompts share one step's weight pass,
  and a decode step waits for at most a budget of prompt tokens.  A
  prompt's last token is fed by the next decode step, beside the other
  sequences, which chooses its first token.
* **Prefix cache.**  A starting sequence takes the cached blocks that
  match its first full blocks (:mod:`.blocks`); before each of its chunks
  that starts on a block boundary it looks again, so requests that arrive
  together with a common prefix share the blocks the first one computed
  (a sequence whose next block an earlier chunk of the same step is
  computing waits for the next step).
  At least its last token is always computed (it chooses the next one).
  Every block a prefill chunk or decode step fills is registered.
* **Preemption by recompute.**  When a decoding sequence needs a new block
  and none is available, the most recently arrived running sequence (it may
  be the one asking) gives back its blocks and waits again, first in line,
  with the tokens it generated appended to its prompt; restarted, it
  recomputes them (or finds them in the prefix cache) and goes on from
  where it stopped.  Sampling draws are keyed by the seed and the
  position, so it chooses the same tokens.
* **Finishing** (its blocks are freed at once): a stop token (the
  vocabulary's end-of-generation tokens unless ``ignore_eos``, and the
  request's ``stop_token_ids``) gives ``"stop"``; ``max_tokens`` new tokens
  or a full context (``n_ctx`` tokens) gives ``"length"``; :meth:`abort`
  gives ``"cancelled"``; an exception while running a sequence gives
  ``"error"`` to that sequence alone (a failed decode step is retried in
  halves to find the rows that fail).
* **Overlap** (runners with ``launch`` and ``collect``): in the steady
  decode state the next decode step goes to the device before the tokens of
  the one running are taken, its tokens fed on the device from that step's
  choice, so the host's work of a step runs while the device computes the
  next.  It does so only where the synchronous policy would run the same
  rows next: nothing waiting with room to start, every running sequence in
  the step, no penalties or log-probabilities, a free block for each row
  that crosses into a new one.  A row that finishes (a stop token, its
  length, a stop string, a cancel) is still computed in the steps that
  follow while it stays in its last block, its tokens dropped; when
  the rows left fall into a smaller graph bucket than the step in flight,
  the step is dropped and its rows run again synchronously (its K/V writes
  are to the same slots), so each sequence's tokens are those the
  synchronous engine chooses.
"""

from __future__ import annotations

import collections
import math
import time

import attrs

from .blocks import BlockManager, chain_hashes
from .requests import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, RequestSettings
from .rows import DecodeRow, PrefillChunk, RowOutput

__all__ = ["Scheduler", "Sequence", "StepOutput", "WAITING", "RUNNING", "FINISHED"]

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"

#: the share of the pool kept free when admitting beside running sequences
DEFAULT_WATERMARK = 0.01


class Sequence:
    """One request inside the scheduler: its tokens, its blocks, its state.

    Parameters
    ----------
    request_id : str
    prompt : list of int
    settings : RequestSettings
    seed : int
        The sampler's seed (resolved once, so a recomputed sequence draws alike).
    stop_ids : frozenset of int
        Tokens that finish it with ``"stop"``.
    """

    def __init__(self, request_id: str, prompt, settings: RequestSettings, seed: int,
                 stop_ids=frozenset()):
        self.id = request_id
        self.tokens = list(prompt)
        self.n_prompt = len(self.tokens)
        self.settings = settings
        self.seed = int(seed)
        self.stop_ids = frozenset(stop_ids)
        self.arrival = -1              # set by Scheduler.add
        self.status = WAITING
        self.blocks: list = []         # the block table
        self.hashes: list = []         # chain hashes of its full blocks (as far as computed)
        self.computed = 0              # tokens whose K/V are in the cache
        self.registered = 0            # leading blocks registered with the prefix cache
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.preemptions = 0

    @property
    def output(self) -> list:
        """The tokens generated so far."""
        return self.tokens[self.n_prompt:]

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache (1: decoding; more: prefilling)."""
        return len(self.tokens) - self.computed

    def history(self, end: int) -> tuple:
        """The penalty window ending with ``tokens[end - 1]`` (empty when
        the settings have no penalty)."""
        s = self.settings.sampling
        if not s.penalties_on:
            return ()
        n = s.repeat_last_n
        return tuple(self.tokens[max(0, end - n) if n > 0 else 0:end])

    def __repr__(self) -> str:
        return (f"Sequence({self.id!r}, {self.status}, tokens={len(self.tokens)}, "
                f"computed={self.computed}, blocks={len(self.blocks)})")


@attrs.define
class StepOutput:
    """What one :meth:`Scheduler.step` did.

    Attributes
    ----------
    kind : str or None
        ``"prefill"``, ``"decode"``, or None when there was nothing to run.
    tokens : list
        ``(sequence, RowOutput)`` for each token chosen, in row order.
    finished : list
        Sequences that ended during the step (``finish_reason`` set).
    rows : int
        Decode rows or prefill tokens run.
    seconds : float
        Wall time of the runner call(s); of a decode step launched behind
        another (overlap), from that one's tokens to its own.
    """

    kind: str | None = None
    tokens: list = attrs.Factory(list)
    finished: list = attrs.Factory(list)
    rows: int = 0
    seconds: float = 0.0


class Scheduler:
    """Continuous batching over a runner (see the module docstring for the policy).

    Parameters
    ----------
    runner
        A ``BatchRunner`` or anything with its attributes (``block_size``,
        ``num_blocks``, ``max_batch``, ``chunk``, ``max_blocks_per_seq``,
        ``n_vocab``) and its ``decode(rows)`` and ``prefill(chunk)``.
    prefill_budget : int, optional
        Prompt tokens that may run between two decode steps (default
        ``runner.chunk``).
    watermark : float
        The share of the pool that admission keeps free beside running
        sequences.
    prefix_caching : bool
    overlap : bool
        Keep the next decode step on the device while the last one's tokens
        are taken (runners with ``launch`` and ``collect``; see the module
        docstring); False runs every step synchronously.
    """

    def __init__(self, runner, *, prefill_budget: int | None = None,
                 watermark: float = DEFAULT_WATERMARK, prefix_caching: bool = True,
                 overlap: bool = True):
        self.runner = runner
        for name in ("block_size", "num_blocks", "max_batch", "chunk", "max_blocks_per_seq",
                     "n_vocab"):
            v = getattr(runner, name, None)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"runner.{name} must be a positive int, got {v!r}")
        self.blocks = BlockManager(runner.num_blocks, runner.block_size,
                                   prefix_caching=prefix_caching)
        self.block_size = runner.block_size
        self.max_batch = runner.max_batch
        self.chunk = runner.chunk
        #: most tokens a sequence may hold (prompt and generated)
        self.n_ctx = min(runner.max_blocks_per_seq, runner.num_blocks) * runner.block_size
        self.prefill_budget = int(prefill_budget or runner.chunk)
        if self.prefill_budget < 1:
            raise ValueError(f"prefill_budget must be positive, got {prefill_budget!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.watermark_blocks = math.ceil(watermark * runner.num_blocks)
        self.waiting: collections.deque = collections.deque()
        self.running: list = []          # by arrival
        self._arrivals = 0
        self._since_decode = 0           # prompt tokens run since the last decode step
        self.counters = collections.Counter()
        #: called just before each step's runner call (the engine hands the
        #: last step's events to their consumers there, while the device works)
        self.on_launch = None
        self.overlap = bool(overlap) and callable(getattr(runner, "launch", None)) \
            and callable(getattr(runner, "collect", None))
        buckets = getattr(runner, "buckets", None)
        self._buckets = tuple(buckets("decode")) if callable(buckets) else ()
        self._flight: _Flight | None = None  # a decode step launched, its tokens not yet taken

    # ------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (at the end of the waiting line)."""
        if not seq.tokens:
            raise ValueError("a sequence needs at least one prompt token")
        if len(seq.tokens) >= self.n_ctx:
            raise ValueError(f"a prompt of {len(seq.tokens)} tokens leaves no room to generate "
                             f"in a context of {self.n_ctx} tokens (at most {self.n_ctx - 1})")
        seq.arrival = self._arrivals
        self._arrivals += 1
        seq.status = WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence, reason: str = FINISH_CANCELLED, error: str | None = None):
        """End ``seq`` now with ``reason`` (its blocks are freed at once)."""
        if seq.status == FINISHED:
            return
        if seq.status == WAITING:
            self.waiting.remove(seq)
            seq.status = FINISHED
            seq.finish_reason, seq.error = reason, error
            self.counters["finished"] += 1
        else:
            self._finish(seq, reason, error)

    def finish(self, seq: Sequence, reason: str = FINISH_STOP) -> None:
        """End a sequence the caller decided is done (a stop string)."""
        self.abort(seq, reason)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def in_flight(self) -> bool:
        """A decode step is on the device, its tokens not yet taken."""
        return self._flight is not None

    # ------------------------------------------------------------ one step
    def step(self) -> StepOutput:
        """Admit what fits, then run one prefill step or one decode step
        (or take the tokens of the decode step in flight)."""
        if self._flight is not None:
            out = self._land()
            if out is not None:
                return out
        self.admit()
        pre = any(s.pending > 1 for s in self.running)
        dec = any(s.pending == 1 for s in self.running)
        if pre and (not dec or self._since_decode < self.prefill_budget):
            room = self.chunk if not dec else min(self.chunk,
                                                  self.prefill_budget - self._since_decode)
            out = self._prefill(room)
            if out.kind is not None:
                return out
            dec = any(s.pending == 1 for s in self.running)
        if dec:
            return self._decode()
        return StepOutput()

    # ------------------------------------------------------------ admission
    def admit(self) -> None:
        """Start the waiting sequences that fit (:meth:`step` does it first)."""
        bs = self.block_size
        mgr = self.blocks
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            n = len(seq.tokens)
            chain_hashes(seq.hashes, seq.tokens, bs, n - 1)
            hit = mgr.lookup(seq.hashes[:(n - 1) // bs])
            new = -(-n // bs) - len(hit)
            spare = self.watermark_blocks if self.running else 0
            if new + mgr.cost_of_taking(hit) > mgr.num_free - spare:
                break
            self.waiting.popleft()
            mgr.take(hit)
            seq.blocks = hit + mgr.allocate(new)
            seq.computed = len(hit) * bs
            seq.registered = len(hit)
            seq.status = RUNNING
            self.counters["cached_tokens"] += len(hit) * bs
            self.running.append(seq)
        self.running.sort(key=lambda s: s.arrival)

    def _reuse_cached(self, seq: Sequence) -> None:
        """Swap the sequence's next blocks, not yet computed, for cached ones
        holding the same tokens (computed since it started)."""
        bs = self.block_size
        if seq.computed % bs:
            return
        i = seq.computed // bs
        n_full = (len(seq.tokens) - 1) // bs
        if i >= n_full:
            return
        chain_hashes(seq.hashes, seq.tokens, bs, n_full * bs)
        hit = self.blocks.lookup(seq.hashes[i:n_full])
        if not hit:
            return
        old = seq.blocks[i:i + len(hit)]
        self.blocks.take(hit)
        self.blocks.free(old)
        seq.blocks[i:i + len(hit)] = hit
        seq.computed += len(hit) * bs
        seq.registered = i + len(hit)
        self.counters["cached_tokens"] += len(hit) * bs

    def _register_full(self, seq: Sequence) -> None:
        bs = self.block_size
        n = seq.computed // bs
        if seq.registered >= n:
            return
        chain_hashes(seq.hashes, seq.tokens, bs, n * bs)
        for i in range(seq.registered, n):
            self.blocks.register(seq.blocks[i], seq.hashes[i])
        seq.registered = n

    # ------------------------------------------------------------ prefill
    def _prefill(self, room: int) -> StepOutput:
        """One prefill step of at most ``room`` tokens (StepOutput() when
        the prefix cache left no prefilling sequence anything to compute)."""
        bs = self.block_size
        work, coming = [], set()          # (sequence, chunk); hashes of blocks being computed
        for seq in self.running:
            if room == 0:
                break
            if seq.pending <= 1:
                continue
            self._reuse_cached(seq)
            if seq.pending <= 1:
                continue                  # the cache held all but its last token
            start = seq.computed
            if start % bs == 0 and start // bs < len(seq.hashes) \
                    and seq.hashes[start // bs] in coming:
                continue                  # an earlier chunk of this step computes its next block
            n = min(seq.pending - 1, room)
            end = start + n
            work.append((seq, PrefillChunk(tokens=tuple(seq.tokens[start:end]), start=start,
                                           block_table=tuple(
                                               seq.blocks[:(end - 1) // bs + 1]))))
            coming.update(seq.hashes[start // bs:end // bs])
            room -= n
        if not work:
            return StepOutput()
        out = StepOutput(kind="prefill")
        if self.on_launch is not None:
            self.on_launch()
        t0 = time.perf_counter()
        for seq, err in self._run_chunks(work):
            if err is not None:
                self._finish(seq, FINISH_ERROR, _describe(err))
                out.finished.append(seq)
        out.seconds = time.perf_counter() - t0
        n = sum(len(c.tokens) for _, c in work)
        out.rows = n
        self._since_decode += n
        self.counters["prefill_steps"] += 1
        self.counters["prompt_tokens"] += n
        self.counters["prefill_seconds"] += out.seconds
        for seq, c in work:
            if seq.status == RUNNING:
                seq.computed = c.start + len(c.tokens)
                self._register_full(seq)
        return out

    def _run_chunks(self, work) -> list:
        """``(sequence, exception or None)`` for ``work``: the chunks in one
        runner call; where it fails, each chunk alone, so only the sequences
        whose chunk fails by itself get the error."""
        try:
            self.runner.prefill([c for _, c in work])
            return [(seq, None) for seq, _ in work]
        except Exception as e:
            if len(work) == 1:
                return [(work[0][0], e)]
            out = []
            for seq, c in work:
                try:
                    self.runner.prefill([c])
                    out.append((seq, None))
                except Exception as e1:
                    out.append((seq, e1))
            return out

    # ------------------------------------------------------------ decode
    def _decode(self) -> StepOutput:
        out = StepOutput(kind="decode")
        bs = self.block_size
        batch = []
        for seq in [s for s in self.running if s.pending == 1]:
            if seq.status != RUNNING:
                continue                              # preempted for an earlier one
            if len(seq.blocks) <= seq.computed // bs:
                while self.blocks.num_free == 0:
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq.status != RUNNING:
                    continue
                seq.blocks += self.blocks.allocate(1)
            batch.append(seq)
        batch = [s for s in batch if s.status == RUNNING]
        self._since_decode = 0
        if not batch:
            return out
        if self.overlap and all(self._simple(s) for s in batch):
            t0 = time.perf_counter()
            rows = [self._row(s) for s in batch]
            try:
                handle = self.runner.launch(rows)
            except Exception:
                handle = None
            if handle is not None:
                return self._take(_Flight(handle, batch, t0, rows))
        if self.on_launch is not None:
            self.on_launch()
        t0 = time.perf_counter()
        results = self._run_rows(batch)
        return self._took(batch, results, time.perf_counter() - t0)

    def _took(self, batch, results, seconds: float) -> StepOutput:
        """A decode step's outputs into its sequences (those still running)."""
        out = StepOutput(kind="decode", rows=len(batch), seconds=seconds)
        self.counters["decode_steps"] += 1
        self.counters["decode_seconds"] += seconds
        for seq, res in zip(batch, results):
            if seq.status != RUNNING:
                continue                  # ended while its step was on the device
            if isinstance(res, Exception):
                self._finish(seq, FINISH_ERROR, _describe(res))
                out.finished.append(seq)
                continue
            seq.computed += 1
            self._register_full(seq)
            self._append(seq, res, out)
        return out

    # ------------------------------------------------------------ overlap
    @staticmethod
    def _simple(seq: Sequence) -> bool:
        """Its rows need nothing of the host's between two steps."""
        return not seq.settings.logprobs and not seq.settings.sampling.penalties_on

    def _bucket(self, n: int) -> int:
        return next((b for b in self._buckets if n <= b), n)

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Its next token (not yet taken) is its last by ``max_tokens`` or the context."""
        n = len(seq.tokens) + 1
        return n - seq.n_prompt >= seq.settings.max_tokens or n >= self.n_ctx

    def _take(self, flight: "_Flight") -> StepOutput:
        """Launch the step after ``flight`` where the synchronous policy would
        run the same rows next, then take ``flight``'s tokens."""
        nxt = self._follow(flight)
        if self.on_launch is not None:
            self.on_launch()
        batch = flight.batch
        try:
            results = [self._check_output(r) for r in self.runner.collect(flight.handle)]
            if len(results) != len(batch):
                raise RuntimeError(f"the runner returned {len(results)} outputs for "
                                   f"{len(batch)} rows")
        except Exception:
            if nxt is not None:
                self._drop(nxt)
                nxt = None
            # again, synchronously: a row that fails alone gets its exception
            batch = [s for s in batch if s.status == RUNNING]
            results = self._run_rows(batch) if batch else []
        t1 = time.perf_counter()
        out = self._took(batch, results, t1 - flight.start)
        if nxt is not None:
            nxt.start = t1                # the device runs it from here on
        self._flight = nxt
        return out

    def _follow(self, flight: "_Flight"):
        """The step after ``flight`` on the device (a :class:`_Flight`), or None.

        A row whose sequence ended since ``flight`` was launched runs on,
        its token dropped, while it stays in its last block (its blocks
        are free, but a block handed out now only gets its first slot
        written in this step, and the steps after it are ordered behind)."""
        batch = flight.batch
        alive = [s.status == RUNNING for s in batch]
        if (self.waiting and len(self.running) < self.max_batch) \
                or len(self.running) != sum(alive) \
                or any(s.status not in (RUNNING, FINISHED) for s in batch):
            return None                   # the synchronous step would admit or prefill
        going = sum(a and not self._ends_by_length(s) for s, a in zip(batch, alive))
        if not going or self._bucket(going) != self._bucket(len(batch)):
            return None                   # it would be dropped
        bs = self.block_size
        if any(not a and (r.position + 1) % bs == 0 for r, a in zip(flight.rows, alive)):
            return None                   # an ended row would need a new block
        short = [s for s, a in zip(batch, alive) if a and len(s.blocks) <= (s.computed + 1) // bs]
        if len(short) > self.blocks.num_free:
            return None                   # the synchronous step decides who is preempted
        for s in short:
            s.blocks += self.blocks.allocate(1)
        rows = []
        for s, a, r in zip(batch, alive, flight.rows):
            if a:
                p = s.computed + 1
                table = tuple(s.blocks[:p // bs + 1])
            else:
                p, table = r.position + 1, r.block_table
            rows.append(DecodeRow(token=-1, position=p, block_table=table,
                                  sampling=s.settings.sampling, seed=s.seed))
        try:
            handle = self.runner.launch(rows, follow=flight.handle)
        except Exception:
            return None
        return _Flight(handle, batch, rows=rows)

    def _land(self) -> StepOutput | None:
        """Take the tokens of the step in flight, or drop it (None) when its
        rows left would run in a smaller bucket (or none is left)."""
        flight, self._flight = self._flight, None
        alive = sum(s.status == RUNNING for s in flight.batch)
        if not alive or self._bucket(alive) != self._bucket(len(flight.batch)):
            self._drop(flight)
            return None
        return self._take(flight)

    def _drop(self, flight: "_Flight") -> None:
        """Wait for a step launched and discard its tokens."""
        try:
            self.runner.collect(flight.handle)
        except Exception:
            pass

    def drain(self) -> None:
        """Drop the step in flight, if any (at close)."""
        if self._flight is not None:
            flight, self._flight = self._flight, None
            self._drop(flight)

    def _row(self, seq: Sequence) -> DecodeRow:
        p = seq.computed
        return DecodeRow(token=seq.tokens[p], position=p,
                         block_table=tuple(seq.blocks[:p // self.block_size + 1]),
                         sampling=seq.settings.sampling, seed=seq.seed,
                         history=seq.history(p + 1), logprobs=seq.settings.logprobs)

    def _run_rows(self, batch) -> list:
        """The runner's outputs for ``batch``; where a call fails, it is
        retried in halves, and a row that fails alone gets its exception."""
        try:
            res = self.runner.decode([self._row(s) for s in batch])
            if len(res) != len(batch):
                raise RuntimeError(f"the runner returned {len(res)} outputs for "
                                   f"{len(batch)} rows")
            return [self._check_output(r) for r in res]
        except Exception as e:
            if len(batch) == 1:
                return [e]
            half = len(batch) // 2
            return self._run_rows(batch[:half]) + self._run_rows(batch[half:])

    def _check_output(self, res) -> RowOutput:
        if not isinstance(res, RowOutput):
            raise TypeError(f"the runner returned {type(res).__name__}, not a RowOutput")
        if not 0 <= res.token < self.runner.n_vocab:
            raise ValueError(f"the runner chose token {res.token}, outside the vocabulary "
                             f"(0..{self.runner.n_vocab - 1})")
        return res

    # ------------------------------------------------------------ endings
    def _append(self, seq: Sequence, res: RowOutput, out: StepOutput) -> None:
        seq.tokens.append(res.token)
        self.counters["generated_tokens"] += 1
        out.tokens.append((seq, res))
        if res.token in seq.stop_ids:
            reason = FINISH_STOP
        elif len(seq.tokens) - seq.n_prompt >= seq.settings.max_tokens \
                or len(seq.tokens) >= self.n_ctx:
            reason = FINISH_LENGTH
        else:
            return
        self._finish(seq, reason)
        out.finished.append(seq)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.blocks)
        seq.blocks = []
        seq.status = FINISHED
        seq.finish_reason, seq.error = reason, error
        self.counters["finished"] += 1

    def _preempt(self, seq: Sequence) -> None:
        """Send ``seq`` back to wait, first in line; it keeps its tokens."""
        self.running.remove(seq)
        self.blocks.free(seq.blocks)
        seq.blocks = []
        seq.computed = seq.registered = 0
        seq.status = WAITING
        seq.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------ checks
    def check(self) -> None:
        """Assert the blocks' bookkeeping matches the running sequences' tables."""
        self.blocks.check([s.blocks for s in self.running])
        for s in self.waiting:
            assert s.status == WAITING and not s.blocks, f"{s} waits holding blocks"
        for s in self.running:
            assert s.status == RUNNING, f"{s} is listed as running"
            assert len(s.blocks) * self.block_size >= s.computed, f"{s}: blocks short of its tokens"


@attrs.define
class _Flight:
    """A decode step on the device: the runner's handle, its sequences and
    rows in row order, and when it started (its launch, or for a step
    launched behind another, when that one's tokens were in; its tokens'
    time is the wall time from there, host work overlapped included)."""

    handle: object
    batch: list
    start: float = 0.0
    rows: list = attrs.Factory(list)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
