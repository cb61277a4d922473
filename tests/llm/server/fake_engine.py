"""A small deterministic engine with the interface of ``ptxgen.llm.engine``
(docs: the engine API note), for the server's tests: protocol, errors,
disconnects, overload, auth.

Its "model" chooses each next token among a fixed set of plain tokens of
a real vocabulary (plus the end-of-generation token) from logits drawn
from a hash of the last tokens and the position: greedy takes the largest,
sampling draws with the request's seed and the position.  The log-softmax
of those logits gives the log-probabilities.  :meth:`FakeEngine.reference`
runs the same model without the engine, so a test can predict a reply.

A step loop in its own thread runs every ``step_s`` seconds: waiting
requests are admitted while there is room (``max_seqs`` and KV blocks of
``block_size`` tokens), each running sequence gets one token, finished and
cancelled ones free their blocks.  A prompt holding ``poison`` fails inside
the step (that request ends with finish_reason "error"); one holding
``crash`` makes ``add_request`` itself raise.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import queue
import threading
import time

import attrs
import numpy as np

from ptxgen.llm.generation import SamplingSettings

__all__ = ["FakeEngine", "EngineOverloaded", "RequestSettings", "RequestEvent",
           "RequestOutput", "RowOutput", "EngineStats"]


class EngineOverloaded(RuntimeError):
    """The queue is full."""


@attrs.frozen
class RequestSettings:
    max_tokens: int
    sampling: SamplingSettings = SamplingSettings()
    stop: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: int = 0


@attrs.frozen
class RowOutput:
    token: int
    logprob: float
    top: tuple = ()


@attrs.frozen
class RequestEvent:
    token_ids: tuple
    text: str
    logprobs: tuple = ()
    finish_reason: str | None = None
    error: str | None = None


@attrs.frozen
class RequestOutput:
    id: str
    prompt_tokens: int
    token_ids: tuple
    text: str
    finish_reason: str
    logprobs: tuple
    ttft_s: float
    total_s: float


@attrs.frozen
class EngineStats:
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    tokens_generated: int


def plain_tokens(tok, n: int) -> list:
    """``n`` token ids whose text is a few ASCII letters (their text is
    their decoding, alone or after one another)."""
    out = []
    for t in range(tok.n_vocab):
        if tok.is_eog(t) or t == tok.bos_id:
            continue
        text = tok.token_text(t)
        piece = tok.token_to_piece(t)
        if 2 <= len(text) <= 6 and text.isascii() and text.isalpha() \
                and piece == text.encode():
            out.append(t)
            if len(out) == n:
                break
    return out


class FakeModel:
    """The next-token distribution of the fake engine."""

    def __init__(self, tok, n_candidates: int = 48, eog_logit: float = -4.0):
        self.tok = tok
        self.candidates = np.array(plain_tokens(tok, n_candidates), np.int64)
        self.eog = next(iter(sorted(tok.eog_ids)), None)
        self.eog_logit = eog_logit

    def logits(self, seq) -> tuple:
        """``(token ids, logits)`` after the sequence ``seq``."""
        h = hashlib.blake2b(repr((tuple(seq[-4:]), len(seq))).encode(), digest_size=8)
        rng = np.random.default_rng(int.from_bytes(h.digest(), "little"))
        z = rng.normal(0.0, 2.0, len(self.candidates))
        ids = self.candidates
        if self.eog is not None:
            ids = np.append(ids, self.eog)
            z = np.append(z, self.eog_logit + rng.normal())
        return ids, z

    def choose(self, seq, sampling: SamplingSettings, seed: int, n_top: int) -> RowOutput:
        ids, z = self.logits(seq)
        lse = np.logaddexp.reduce(z)
        logp = z - lse
        if sampling.is_greedy:
            k = int(np.argmax(z))
        else:
            t = max(sampling.temperature, 1e-3)
            p = np.exp((z - z.max()) / t)
            p /= p.sum()
            rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, len(seq)])
            k = int(rng.choice(len(ids), p=p))
        top = ()
        if n_top:
            order = np.argsort(-logp, kind="stable")[:n_top]
            top = tuple((int(ids[i]), float(logp[i])) for i in order)
        return RowOutput(int(ids[k]), float(logp[k]), top)


class _Stops:
    """Stop strings on text that arrives in pieces (the start of a match held back)."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, piece: str) -> tuple:
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if s.startswith(self.pending[-n:]):
                    keep = n
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


class FakeRequest:
    """One request's events, for threads (``__iter__``) and asyncio (``__aiter__``)."""

    def __init__(self, rid: str, prompt, settings, seed):
        self.id = rid
        self.prompt = list(prompt)
        self.settings = settings
        self.seed = seed
        self.generated: list = []
        self.logprobs: list = []
        self.text: list = []
        self.finish: str | None = None
        self.t0 = time.perf_counter()
        self.ttft = None
        self._lock = threading.Lock()
        self._sync: queue.Queue = queue.Queue()
        self._buffer: list = []
        self._loop = None
        self._async = None

    def push(self, ev: RequestEvent):
        with self._lock:
            self._sync.put(ev)
            if self._async is not None:
                self._loop.call_soon_threadsafe(self._async.put_nowait, ev)
            else:
                self._buffer.append(ev)

    def __iter__(self):
        while True:
            ev = self._sync.get()
            yield ev
            if ev.finish_reason is not None:
                return

    def __aiter__(self):
        return self._events()

    async def _events(self):
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._async = asyncio.Queue()
            for ev in self._buffer:
                self._async.put_nowait(ev)
            self._buffer = []
        while True:
            ev = await self._async.get()
            yield ev
            if ev.finish_reason is not None:
                return

    async def event_lists(self):
        async for ev in self._events():
            yield [ev]

    def result(self) -> RequestOutput:
        for _ in self:
            pass
        return RequestOutput(self.id, len(self.prompt), tuple(self.generated),
                             "".join(self.text), self.finish, tuple(self.logprobs),
                             self.ttft or 0.0, time.perf_counter() - self.t0)


class FakeEngine:
    """The engine interface over :class:`FakeModel`, with a step loop thread."""

    def __init__(self, tokenizer, *, n_ctx: int = 256, max_seqs: int = 8, max_queue: int = 64,
                 block_size: int = 16, num_blocks: int | None = None, step_s: float = 0.002,
                 model_name: str = "fake-tiny", poison: int | None = None,
                 crash: int | None = None, eog_logit: float = -4.0):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.n_ctx = n_ctx
        self.n_vocab = tokenizer.n_vocab
        self.model = FakeModel(tokenizer, eog_logit=eog_logit)
        self.max_seqs = max_seqs
        self.max_queue = max_queue
        self.block_size = block_size
        self.num_blocks = num_blocks or max_seqs * math.ceil(n_ctx / block_size)
        self.step_s = step_s
        self.poison = poison
        self.crash = crash
        self.prompts: list = []          # every prompt added, in order
        self.cancelled: list = []        # ids cancelled while unfinished
        self.tokens_generated = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waiting: list = []
        self._running: list = []
        self._blocks: dict = {}
        self._cancel: set = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the API
    def add_request(self, prompt, settings: RequestSettings, request_id=None) -> FakeRequest:
        prompt = list(prompt)
        if self.crash is not None and self.crash in prompt:
            raise RuntimeError("the fake engine crashed in add_request")
        if len(prompt) > self.n_ctx - 1:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context holds "
                             f"{self.n_ctx} (at most {self.n_ctx - 1} for a prompt)")
        rid = request_id or f"req-{next(self._ids)}"
        r = FakeRequest(rid, prompt, settings, settings.sampling.resolved_seed())
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                raise EngineOverloaded(f"{len(self._waiting)} requests wait already "
                                       f"(max_queue {self.max_queue})")
            self.prompts.append(prompt)
            self._waiting.append(r)
        return r

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            live = any(r.id == request_id for r in self._waiting + self._running)
            if live:
                self._cancel.add(request_id)
                self.cancelled.append(request_id)
        return live

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(len(self._running), len(self._waiting),
                               sum(self._blocks.values()), self.num_blocks,
                               self.tokens_generated)

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for r in self._waiting + self._running:
                self._finish(r, "cancelled")
            self._waiting, self._running = [], []

    def generate(self, prompts, settings=None) -> list:
        settings = settings or RequestSettings(max_tokens=16)
        return [self.add_request(p, settings).result() for p in prompts]

    # ------------------------------------------------------------ the reference
    def reference(self, prompt, settings: RequestSettings, seed: int | None = None) -> tuple:
        """``(token ids, text, finish_reason)`` the engine gives ``prompt``."""
        r = FakeRequest("ref", prompt, settings,
                        settings.sampling.resolved_seed() if seed is None else seed)
        stops = _Stops(settings.stop)
        dec = self.tokenizer.stream_decoder()
        while r.finish is None:
            self._advance(r, stops, dec)
        return tuple(r.generated), "".join(r.text), r.finish

    # ------------------------------------------------------------ the loop
    def _need(self, r) -> int:
        return math.ceil((len(r.prompt) + len(r.generated) + 1) / self.block_size)

    def _finish(self, r, reason, error=None):
        if r.finish is None:
            r.finish = reason
            r.push(RequestEvent((), "", (), reason, error))
        self._blocks.pop(r.id, None)

    def _loop(self):
        state = {}
        while not self._stop.is_set():
            time.sleep(self.step_s)
            with self._lock:
                for r in [r for r in self._waiting + self._running if r.id in self._cancel]:
                    self._finish(r, "cancelled")
                self._waiting = [r for r in self._waiting if r.finish is None]
                self._running = [r for r in self._running if r.finish is None]
                self._cancel.clear()
                while self._waiting and len(self._running) < self.max_seqs:
                    r = self._waiting[0]
                    if sum(self._blocks.values()) + self._need(r) > self.num_blocks:
                        break
                    self._waiting.pop(0)
                    self._blocks[r.id] = self._need(r)
                    self._running.append(r)
                    state[r.id] = (_Stops(r.settings.stop), self.tokenizer.stream_decoder())
                for r in list(self._running):
                    try:
                        if self.poison is not None and self.poison in r.prompt:
                            raise RuntimeError("the fake model failed on this sequence")
                        self._advance(r, *state[r.id])
                        self._blocks[r.id] = self._need(r)
                    except Exception as e:  # one request's failure ends that request only
                        self._finish(r, "error", f"{type(e).__name__}: {e}")
                    if r.finish is not None:
                        self._blocks.pop(r.id, None)
                        state.pop(r.id, None)
                self._running = [r for r in self._running if r.finish is None]

    def _advance(self, r: FakeRequest, stops: _Stops, dec):
        """One token of ``r``: push its event (the last one with its finish)."""
        s = r.settings
        out = self.model.choose(r.prompt + r.generated, s.sampling, r.seed, s.logprobs)
        if r.ttft is None:
            r.ttft = time.perf_counter() - r.t0
        r.generated.append(out.token)
        r.logprobs.append(out)
        self.tokens_generated += 1
        finish = None
        text = ""
        if out.token in s.stop_token_ids or (self.tokenizer.is_eog(out.token)
                                             and not s.ignore_eos):
            finish = "stop"
        else:
            text, hit = stops.push(dec.feed(out.token))
            if hit:
                finish = "stop"
        if finish is None and (len(r.generated) >= s.max_tokens
                               or len(r.prompt) + len(r.generated) >= self.n_ctx):
            finish = "length"
        if finish == "length":
            text += stops.pending
        r.text.append(text)
        r.finish = finish
        r.push(RequestEvent((out.token,), text, (out,), finish))
