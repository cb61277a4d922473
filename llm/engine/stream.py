"""A request's side of the engine: the :class:`Request` handle its caller
iterates (from a thread or from asyncio), and :class:`TextState`, which
turns its tokens into text as they come."""

from __future__ import annotations

import asyncio
import collections
import threading

from ptxgen.llm.textgen import _StopStrings

from .requests import RequestEvent, RequestOutput

__all__ = ["Request", "TextState", "wake"]


class TextState:
    """A request's text so far: whole UTF-8 characters, with text that may
    begin a stop string held back (:class:`~ptxgen.llm.textgen._StopStrings`).

    Parameters
    ----------
    tokenizer : Tokenizer or None
        None: no text (every piece is ``""``; stop strings are refused earlier).
    stop : tuple of str
    """

    def __init__(self, tokenizer, stop=()):
        self._utf8 = tokenizer.stream_decoder() if tokenizer is not None else None
        self._stops = _StopStrings(stop)
        self.stopped = False         # a stop string was found

    def feed(self, token: int) -> tuple:
        """Add a token; returns ``(text to release, whether a stop string
        was found)``.  After a match, later tokens add nothing."""
        if self._utf8 is None or self.stopped:
            return "", False
        out, hit = self._stops.push(self._utf8.feed(token))
        self.stopped = hit
        return out, hit

    def finish(self) -> tuple:
        """The text held back at the end; returns ``(text, whether a stop
        string was found in it)``."""
        if self._utf8 is None or self.stopped:
            return "", False
        out, hit = self._stops.push(self._utf8.flush())
        if hit:
            self.stopped = True
            return out, True
        return out + self._stops.finish(), False


class Request:
    """A request running on an :class:`~.engine.Engine` (from
    :meth:`~.engine.Engine.add_request`).

    Its :class:`~.requests.RequestEvent` s arrive in order, each once:
    iterate it in a thread (``for event in request``) or in asyncio
    (``async for event in request``); the last one has ``finish_reason``
    set.  Leaving either iteration before the last event (``break``, an
    exception, a cancelled task, a closed async generator) cancels the
    request, so a server whose client goes away frees its blocks within a
    step.  :meth:`result` waits for the :class:`~.requests.RequestOutput`
    (it does not consume events).
    """

    def __init__(self, request_id: str, prompt_tokens: int, cancel):
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self._cancel = cancel
        self._cond = threading.Condition()
        self._events: collections.deque = collections.deque()
        self._waiters: list = []           # (asyncio loop, asyncio.Event)
        self._done = threading.Event()
        self._output: RequestOutput | None = None

    def __repr__(self) -> str:
        state = self._output.finish_reason if self._output is not None else "running"
        return f"Request({self.id!r}, {state})"

    # ------------------------------------------------------------ the engine's side
    def _push(self, event: RequestEvent, output: RequestOutput | None = None) -> list:
        """Deliver ``event`` (and, with the last one, the output); called by
        the engine's loop thread.  Threads waiting are woken; the asyncio
        consumers waiting are returned, for :func:`wake` (one wake-up per
        event loop for all the requests of a step)."""
        with self._cond:
            if output is not None:
                self._output = output
            self._events.append(event)
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        if output is not None:
            self._done.set()
        return waiters

    # ------------------------------------------------------------ the caller's side
    @property
    def finished(self) -> bool:
        """Whether the request has ended (its output is ready)."""
        return self._done.is_set()

    def cancel(self) -> bool:
        """Cancel the request (see :meth:`~.engine.Engine.cancel`)."""
        return self._cancel()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the end (at most ``timeout`` seconds); returns whether it ended."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the end and return the :class:`~.requests.RequestOutput`.

        Raises
        ------
        TimeoutError
            Not finished within ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id!r} did not finish within {timeout} s")
        return self._output

    def __iter__(self):
        return self._iterate()

    def _iterate(self):
        done = False
        try:
            while not done:
                with self._cond:
                    while not self._events:
                        self._cond.wait()
                    ev = self._events.popleft()
                done = ev.finish_reason is not None
                yield ev
        finally:
            if not done:
                self._cancel()

    def __aiter__(self):
        return self._aiterate()

    async def _aiterate(self):
        lists = self.event_lists()
        try:
            async for events in lists:
                for ev in events:
                    yield ev
        finally:
            await lists.aclose()           # leaving early cancels the request now

    async def event_lists(self):
        """Iterate the events in asyncio as lists: each one all that has
        arrived since the last (a consumer that falls behind takes several
        at once); leaving early cancels the request, as ``async for`` does."""
        loop = asyncio.get_running_loop()
        done = False
        try:
            while not done:
                with self._cond:
                    evs = list(self._events)
                    self._events.clear()
                    if not evs:
                        flag = asyncio.Event()
                        self._waiters.append((loop, flag))
                if not evs:
                    await flag.wait()
                    continue
                done = evs[-1].finish_reason is not None
                yield evs
        finally:
            if not done:
                self._cancel()


def wake(waiters) -> None:
    """Set the asyncio flags of ``waiters`` (``(loop, asyncio.Event)``
    pairs, from :meth:`Request._push`) with one call per event loop."""
    by_loop: dict = {}
    for loop, flag in waiters:
        by_loop.setdefault(loop, []).append(flag)
    for loop, flags in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_all, flags)
        except RuntimeError:               # the consumer's loop is closed
            pass


def _set_all(flags) -> None:
    for flag in flags:
        flag.set()
