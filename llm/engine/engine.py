"""The batched engine's public API: many requests at once on one model.

:class:`Engine` runs a :class:`~.scheduler.Scheduler` over a runner (the
device side, ``BatchRunner``) in a background thread: each loop iteration
takes the requests added and cancelled since the last one, runs one
scheduler step (a prefill chunk or a decode step), turns the new tokens
into text and delivers one :class:`~.requests.RequestEvent` per request
that moved to that request's :class:`~.stream.Request`.

>>> engine = Engine.from_gguf("model.gguf", max_seqs=64)            # doctest: +SKIP
>>> outs = engine.generate(["Hi", "The sky is"], RequestSettings(max_tokens=32))  # doctest: +SKIP
>>> req = engine.add_request(ids, RequestSettings(max_tokens=64))  # doctest: +SKIP
>>> for event in req: print(event.text, end="")                    # doctest: +SKIP

Thread safety: :meth:`Engine.add_request`, :meth:`Engine.cancel`,
:meth:`Engine.stats` and :meth:`Engine.generate` may be called from any
thread; only the loop thread touches the scheduler and the runner.
"""

from __future__ import annotations

import numbers
import os
import threading
import time
import uuid
import weakref

import attrs

from .requests import (FINISH_CANCELLED, FINISH_ERROR, FINISH_STOP, EngineOverloaded,
                       EngineStats, RequestEvent, RequestOutput, RequestSettings)
from .scheduler import FINISHED, Scheduler, Sequence
from .stream import Request, TextState, wake

__all__ = ["Engine", "DEFAULT_MAX_TOKENS"]

#: ``max_tokens`` of :meth:`Engine.generate` when no settings are given
DEFAULT_MAX_TOKENS = 256


class Engine:
    """Continuous batching of many requests on one model.

    Use :meth:`from_gguf`; ``Engine(runner, ...)`` wraps a runner of your
    own (anything with ``BatchRunner``'s attributes and methods).

    Parameters
    ----------
    runner
        The device side (see :class:`~.scheduler.Scheduler`).
    tokenizer : Tokenizer, optional
        The model file's; without one, requests are token ids only (no
        text, no stop strings, no end-of-generation tokens).
    model_name : str
    max_queue : int
        The most requests waiting to start; one more is refused with
        :class:`~.requests.EngineOverloaded`.
    prefill_budget : int, optional
        Prompt tokens that may run between two decode steps (default: the
        runner's chunk).
    prefix_caching : bool
        Share the KV blocks of common prompt prefixes (default on).
    overlap : bool
        Prepare the next decode step while the device runs this one (default
        on; :class:`~.scheduler.Scheduler`).
    """

    def __init__(self, runner, *, tokenizer=None, model_name: str = "model",
                 max_queue: int = 256, prefill_budget: int | None = None,
                 prefix_caching: bool = True, overlap: bool = True):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be a positive int, got {max_queue!r}")
        self.runner = runner
        #: the model file's tokenizer (None if it has none)
        self.tokenizer = tokenizer
        #: the file's general.name (or its file name)
        self.model_name = model_name
        self.max_queue = max_queue
        sched = Scheduler(runner, prefill_budget=prefill_budget, prefix_caching=prefix_caching,
                          overlap=overlap)
        self._core = _Loop(sched)
        self._thread = threading.Thread(target=self._core.run, name="ptxgen-engine", daemon=True)
        self._thread.start()
        # stops the loop when the engine is dropped without close()
        self._stop = weakref.finalize(self, self._core.shut_down, self._thread)

    @classmethod
    def from_gguf(cls, path, *, backend="auto", max_seqs: int = 64, ctx_size: int | None = None,
                  chunk: int = 512, gpu_memory_utilization: float = 0.9,
                  block_size: int | None = None, max_queue: int = 256, progress: bool = True,
                  runner=None, tokenizer=None, **kw) -> "Engine":
        """An engine on the model in a GGUF file.

        Parameters
        ----------
        path : str or LlamaFile
            The file, or the file already opened (and so checked).
        backend : {"auto", "cuda", "emu"} or a backend
        max_seqs : int
            The most sequences running at once (the decode step's batch).
        ctx_size : int, optional
            The most tokens a sequence may hold (default: the runner's,
            bounded by the model's context length and the pool).
        chunk : int
            The most prompt tokens of one prefill chunk.
        gpu_memory_utilization : float
            The share of the free device memory, once the weights are
            loaded, that the KV pool takes.
        block_size : int, optional
            Tokens per KV block (default: the runner's).
        max_queue : int
        progress : bool
            A progress bar while the weights load.
        runner : optional
            A runner to use instead of loading the weights (tests).
        tokenizer : optional
            The file's tokenizer when the caller has built it already.
        **kw
            :class:`Engine` keywords (``prefill_budget``, ``prefix_caching``,
            ``overlap``).
        """
        from ptxgen.llm.gguf.file import LlamaFile
        f = path if isinstance(path, LlamaFile) else LlamaFile(path)
        if tokenizer is None:
            tokenizer = f.tokenizer()
        if runner is None:
            from ptxgen.driver.backend import get_backend
            be = get_backend(backend) if isinstance(backend, str) else backend
            runner = _runner_class()(f, be, max_batch=max_seqs, ctx_size=ctx_size, chunk=chunk,
                                 gpu_memory_utilization=gpu_memory_utilization,
                                 block_size=block_size, progress=progress)
        name = (f.metadata.get("general.name")
                or os.path.splitext(os.path.basename(str(f.path)))[0])
        return cls(runner, tokenizer=tokenizer, model_name=str(name), max_queue=max_queue,
                   **kw)

    # ------------------------------------------------------------ properties
    @property
    def n_ctx(self) -> int:
        """The most tokens a sequence may hold (prompt and generated)."""
        return self._core.sched.n_ctx

    @property
    def max_seqs(self) -> int:
        """The most sequences running at once (the decode step's batch)."""
        return self._core.sched.max_batch

    @property
    def block_size(self) -> int:
        return self._core.sched.block_size

    @property
    def num_blocks(self) -> int:
        return self._core.sched.blocks.num_blocks

    @property
    def closed(self) -> bool:
        return not self._stop.alive

    # ------------------------------------------------------------ requests
    def add_request(self, prompt, settings: RequestSettings,
                    request_id: str | None = None) -> Request:
        """Queue a request; it starts when the scheduler admits it.

        Parameters
        ----------
        prompt : list of int
            Token ids (at least one, at most ``n_ctx - 1``).
        settings : RequestSettings
        request_id : str, optional
            Unique among the requests not yet finished (default: a fresh one).

        Returns
        -------
        Request
            Iterate it for its events, or wait for its :meth:`~.stream.Request.result`.

        Raises
        ------
        ValueError
            A bad prompt (empty, an id outside the vocabulary, longer than
            ``n_ctx - 1``), stop strings without a tokenizer, or a
            request id in use.
        TypeError
            ``settings`` is not a RequestSettings.
        EngineOverloaded
            ``max_queue`` requests are waiting to start.
        RuntimeError
            The engine is closed.
        """
        entry = self._entry(self._check_request(prompt, settings), settings, request_id)
        if self._core.submit([entry], self.max_queue) == 0:
            raise self._core.overloaded(self.max_queue)
        return entry.req

    def _entry(self, ids, settings, request_id=None) -> "_Entry":
        rid = str(request_id) if request_id is not None else uuid.uuid4().hex
        tok = self.tokenizer
        stop_ids = set(settings.stop_token_ids)
        if tok is not None and not settings.ignore_eos:
            stop_ids |= set(tok.eog_ids)
        seq = Sequence(rid, ids, settings, settings.sampling.resolved_seed(), stop_ids)
        core = self._core
        req = Request(rid, len(ids), lambda: core.cancel(rid))
        return _Entry(req, seq, TextState(tok, settings.stop))

    def _check_request(self, prompt, settings) -> list:
        from ptxgen.llm.session import check_tokens
        if not isinstance(settings, RequestSettings):
            raise TypeError(f"settings must be a RequestSettings, got {type(settings).__name__}")
        ids = check_tokens(prompt, self.runner.n_vocab)
        if not ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        if len(ids) > self.n_ctx - 1:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx} "
                             f"per sequence, so a prompt may have at most {self.n_ctx - 1}")
        if settings.stop and self.tokenizer is None:
            raise ValueError("stop strings need the model file's tokenizer; this engine has none "
                             "(use stop_token_ids)")
        return ids

    def cancel(self, request_id: str) -> bool:
        """Cancel a request: it ends with ``"cancelled"`` and its blocks are
        freed before the next step.  Returns False when no such request
        is running or waiting."""
        return self._core.cancel(str(request_id))

    def generate(self, prompts, settings=None) -> list:
        """Run a batch of prompts to the end (an offline batch).

        Parameters
        ----------
        prompts : list of (str or list of int)
            Text (encoded with the file's tokenizer, BOS as the vocabulary
            asks, special-token texts parsed) or token ids.
        settings : RequestSettings or list of RequestSettings, optional
            One for all prompts or one each (default: greedy,
            ``max_tokens`` :data:`DEFAULT_MAX_TOKENS`).

        Returns
        -------
        list of RequestOutput
            In the order of ``prompts``.  Requests beyond ``max_queue``
            wait for room; an interrupt cancels those not finished.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, numbers.Integral) for p in prompts):
            raise TypeError("generate takes a list of prompts; put a prompt of token ids "
                            "in a list of its own")
        if settings is None:
            settings = RequestSettings(max_tokens=DEFAULT_MAX_TOKENS)
        per = list(settings) if isinstance(settings, (list, tuple)) else [settings] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(per)} settings for {len(prompts)} prompts")
        entries = [self._entry(self._check_request(self._encode(p), s), s)
                   for p, s in zip(prompts, per)]
        reqs = [e.req for e in entries]
        done = 0
        try:
            # as many as the queue takes at once (they start together), the rest as room frees
            while done < len(entries):
                n = self._core.submit(entries[done:], self.max_queue)
                done += n
                if n == 0:
                    busy = next((r for r in reqs[:done] if not r.finished), None)
                    if busy is not None:
                        busy.wait(0.05)
                    else:
                        time.sleep(0.01)
            return [r.result() for r in reqs]
        except BaseException:
            for r in reqs[:done]:
                if not r.finished:
                    r.cancel()
            raise

    def _encode(self, prompt) -> list:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need the model file's tokenizer; this engine has "
                                 "none (give token ids)")
            return self.tokenizer.encode(prompt, add_special=True, parse_special=True)
        return prompt

    def warm_up(self) -> int:
        """Capture the runner's step graphs now, before the first request,
        so that no request waits for one (a server does it while loading);
        returns how many were captured (0 on the emulator)."""
        st = self._core.snapshot()
        if st.running or st.waiting:
            raise RuntimeError("warm_up() is for an idle engine, before its first request")
        fn = getattr(self.runner, "warm_up", None)
        return fn() if fn is not None else 0

    # ------------------------------------------------------------ state
    def stats(self) -> EngineStats:
        """Counts of running and waiting requests, KV blocks, tokens and
        runner time (a snapshot taken after the loop's last step)."""
        return self._core.snapshot()

    def close(self) -> None:
        """Stop the loop; requests not finished end with ``"cancelled"``."""
        self._stop()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Engine({self.model_name!r}, {self.num_blocks} blocks of {self.block_size} "
                f"tokens, n_ctx={self.n_ctx}, max_seqs={self.max_seqs})")


def _runner_class():
    """``BatchRunner``, the device side (imported when a model is loaded, so
    the engine's own modules never need the driver)."""
    import importlib
    return importlib.import_module(".runner", __package__).BatchRunner


@attrs.define
class _Entry:
    """A request on the loop's side: its handle, its sequence, its text,
    and what its next event carries."""

    req: Request
    seq: Sequence
    text: TextState
    t0: float = attrs.Factory(time.perf_counter)
    t_first: float | None = None
    token_ids: list = attrs.Factory(list)
    logprobs: list = attrs.Factory(list)
    parts: list = attrs.Factory(list)
    # what the next event carries
    new_tokens: list = attrs.Factory(list)
    new_text: list = attrs.Factory(list)
    new_logprobs: list = attrs.Factory(list)


class _Loop:
    """The engine's loop thread and the state it shares with callers."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.cv = threading.Condition()
        self.inbox: list = []
        self.cancels: set = set()
        self.live: dict = {}               # request id -> _Entry, until its last event
        self.closing = False
        self._wakes: list = []             # asyncio consumers of events delivered, to wake
        sched.on_launch = self.wake
        self._stats = EngineStats(blocks_total=sched.blocks.num_blocks,
                                  blocks_free=sched.blocks.num_blocks,
                                  block_size=sched.block_size)

    # ------------------------------------------------------------ callers' side
    def submit(self, entries, max_queue: int) -> int:
        """Queue the first of ``entries`` that the queue has room for, in
        one go; returns how many."""
        with self.cv:
            if self.closing:
                raise RuntimeError("the engine is closed")
            room = max_queue - len(self.inbox) - len(self.sched.waiting)
            entries = entries[:max(0, room)]
            for e in entries:
                if e.req.id in self.live:
                    raise ValueError(f"request id {e.req.id!r} is in use by a request not yet "
                                     "finished")
            for e in entries:
                self.live[e.req.id] = e
                self.inbox.append(e)
            self.cv.notify()
            return len(entries)

    def overloaded(self, max_queue: int) -> EngineOverloaded:
        queued = len(self.inbox) + len(self.sched.waiting)
        return EngineOverloaded(f"{queued} requests are waiting to start (max_queue "
                                f"{max_queue}); try again later")

    def cancel(self, rid: str) -> bool:
        with self.cv:
            if rid not in self.live or self.closing:
                return False
            self.cancels.add(rid)
            self.cv.notify()
            return True

    def snapshot(self) -> EngineStats:
        with self.cv:
            return attrs.evolve(self._stats, waiting=self._stats.waiting + len(self.inbox))

    def shut_down(self, thread: threading.Thread) -> None:
        with self.cv:
            self.closing = True
            self.cv.notify()
        if thread is not threading.current_thread():
            thread.join()

    # ------------------------------------------------------------ the loop
    def wake(self) -> None:
        """Wake the asyncio consumers of the events delivered since the
        last call: the scheduler calls it as a step goes to the device, so
        that they run while the device works instead of beside the
        engine's own Python."""
        if self._wakes:
            waiters, self._wakes = self._wakes, []
            wake(waiters)

    def run(self) -> None:
        while True:
            self.wake()
            with self.cv:
                while not (self.closing or self.inbox or self.cancels or self.sched.has_work):
                    self.cv.wait()
                if self.closing:
                    break
                inbox, self.inbox = self.inbox, []
                cancels, self.cancels = self.cancels, set()
            try:
                self._iteration(inbox, cancels)
            except Exception as ex:            # a fault of the engine itself
                touched: dict = {}
                self._fail_all(f"the engine's step failed: {type(ex).__name__}: {ex}", touched)
                self._deliver(touched)
        self._close_all()

    def _iteration(self, inbox: list, cancels: set) -> None:
        """Take the new requests and the cancellations, then one step."""
        sched = self.sched
        touched: dict = {}
        for e in inbox:
            try:
                sched.add(e.seq)
            except Exception as ex:
                e.seq.status, e.seq.finish_reason = FINISHED, FINISH_ERROR
                e.seq.error = f"{type(ex).__name__}: {ex}"
                touched[e.req.id] = e
        for rid in cancels:
            e = self.live.get(rid)
            if e is not None and e.seq.status != FINISHED:
                sched.abort(e.seq, FINISH_CANCELLED)
                touched[rid] = e
        if touched:                            # cancellations are told before the step
            self._deliver(touched)
            touched = {}
        if sched.has_work:
            sched.admit()
            with self.cv:
                self._stats = self._make_stats()
            self._take(sched.step(), touched)
            if not sched.has_work:
                sched.drain()                  # a step on the device for sequences now ended
        self._deliver(touched)

    def _take(self, out, touched: dict) -> None:
        """The step's tokens into their requests' next events (text, stop strings)."""
        now = time.perf_counter()
        for seq, res in out.tokens:
            e = self.live[seq.id]
            touched[seq.id] = e
            if e.t_first is None:
                e.t_first = now
            e.new_tokens.append(res.token)
            if seq.settings.logprobs:
                e.new_logprobs.append((res.token, res.logprob, res.top))
            if seq.finish_reason == FINISH_STOP and res.token in seq.stop_ids:
                continue                       # an end token has no text
            try:
                piece, hit = e.text.feed(res.token)
            except Exception as ex:
                self._fail(e, f"{type(ex).__name__}: {ex}")
                continue
            if piece:
                e.new_text.append(piece)
            if hit:
                if seq.status != FINISHED:
                    self.sched.finish(seq, FINISH_STOP)
                seq.finish_reason = FINISH_STOP
        for seq in out.finished:
            touched[seq.id] = self.live[seq.id]

    def _fail(self, e: _Entry, error: str) -> None:
        if e.seq.status != FINISHED:
            self.sched.abort(e.seq, FINISH_ERROR, error)
        e.seq.finish_reason, e.seq.error = FINISH_ERROR, error

    def _fail_all(self, error: str, touched: dict) -> None:
        """End every request the scheduler holds with ``error`` (those
        still in the inbox start later as if nothing happened)."""
        with self.cv:
            queued = {id(e) for e in self.inbox}
            entries = [(rid, e) for rid, e in self.live.items() if id(e) not in queued]
        for rid, e in entries:
            if e.seq.status != FINISHED:
                try:
                    self.sched.abort(e.seq, FINISH_ERROR, error)
                except Exception:
                    e.seq.status = FINISHED
            e.seq.finish_reason, e.seq.error = FINISH_ERROR, error
            touched[rid] = e

    def _deliver(self, touched: dict) -> None:
        """Each touched request's event; the stats snapshot is taken before
        any is delivered, so a caller woken by its last event sees its blocks freed."""
        events = []
        for rid, e in touched.items():
            seq = e.seq
            final = seq.status == FINISHED
            output = None
            if final:
                try:
                    piece, hit = e.text.finish()
                except Exception as ex:
                    piece, hit = "", False
                    seq.finish_reason, seq.error = FINISH_ERROR, f"{type(ex).__name__}: {ex}"
                if piece:
                    e.new_text.append(piece)
                if hit:
                    seq.finish_reason = FINISH_STOP
            ev = RequestEvent(token_ids=tuple(e.new_tokens), text="".join(e.new_text),
                              logprobs=tuple(e.new_logprobs),
                              finish_reason=seq.finish_reason if final else None,
                              error=seq.error if final else None)
            e.token_ids += e.new_tokens
            e.logprobs += e.new_logprobs
            e.parts.append(ev.text)
            e.new_tokens, e.new_text, e.new_logprobs = [], [], []
            if final:
                now = time.perf_counter()
                output = RequestOutput(
                    id=rid, prompt_tokens=e.req.prompt_tokens, token_ids=tuple(e.token_ids),
                    text="".join(e.parts), finish_reason=seq.finish_reason,
                    logprobs=tuple(e.logprobs),
                    ttft_s=(e.t_first - e.t0) if e.t_first is not None else float("nan"),
                    total_s=now - e.t0, error=seq.error)
            events.append((e, ev, output))
        with self.cv:
            for e, ev, output in events:
                if output is not None:
                    self.live.pop(e.req.id, None)
            self._stats = self._make_stats()
        for e, ev, output in events:
            self._wakes += e.req._push(ev, output)

    def _make_stats(self) -> EngineStats:
        s, c, b = self.sched, self.sched.counters, self.sched.blocks
        return EngineStats(
            running=len(s.running), waiting=len(s.waiting), blocks_used=b.num_used,
            blocks_free=b.num_free, blocks_total=b.num_blocks, blocks_cached=b.num_cached,
            block_size=b.block_size, prompt_tokens=c["prompt_tokens"],
            cached_tokens=c["cached_tokens"], generated_tokens=c["generated_tokens"],
            preemptions=c["preemptions"], finished=c["finished"],
            steps=c["prefill_steps"] + c["decode_steps"], prefill_steps=c["prefill_steps"],
            decode_steps=c["decode_steps"], prefill_seconds=float(c["prefill_seconds"]),
            decode_seconds=float(c["decode_seconds"]))

    def _close_all(self) -> None:
        """At close: every request not finished ends with ``"cancelled"``."""
        with self.cv:
            pending = self.inbox
            self.inbox = []
        touched = {}
        self.sched.drain()
        for e in pending:
            e.seq.status, e.seq.finish_reason = FINISHED, FINISH_CANCELLED
            touched[e.req.id] = e
        for rid, e in list(self.live.items()):
            if e.seq.status != FINISHED:
                self.sched.abort(e.seq, FINISH_CANCELLED)
            touched[rid] = e
        self._deliver(touched)
        self.wake()
