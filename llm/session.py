"""A sequence on a model: the tokens fed to its KV cache, where it stands,
and the step loop that feeds tokens and hands back each chosen one.

A :class:`~.model.Model` holds weights, graphs and one KV cache; the
sequence in that cache is a :class:`Session`'s.  The model only records
which session holds its cache and the position the sequence reached
(plain numbers: a session refers to its model, never the other way, so
dropping the last reference to a model frees it at once).  A session
whose cache another session has taken since starts anew on its next call.

:class:`Decoding` is the step loop: it feeds the given tokens (after the
sequence already in the cache when a session continues one), then yields
each token the model chooses, one step at a time, until the caller stops
or the KV cache is full.
"""

from __future__ import annotations

import itertools
import numbers
import time

import attrs
import numpy as np

from ptxgen.kernels import decode_state

from .generation import ContextOverflowError, SamplingSettings

__all__ = ["Session", "Decoding", "GenerateResult"]

_ids = itertools.count(1)


@attrs.frozen
class GenerateResult:
    tokens: list
    #: seconds per decode step (host-observed, after the first warm-up step)
    step_seconds: list
    launches_per_token: int
    mode: str
    #: seconds spent on the prompt (chunked prefill, or the decode steps
    #: over the prompt) and prompt tokens per second
    prompt_seconds: float = float("nan")
    prompt_tokens_per_second: float = float("nan")
    #: the sampler's seed (None for greedy decoding)
    seed: int | None = None

    @property
    def tokens_per_second(self) -> float:
        s = sorted(self.step_seconds)
        return 1.0 / s[len(s) // 2] if s else float("nan")


def check_tokens(tokens, vocab: int) -> list:
    """``tokens`` as a list of ints in ``0 .. vocab - 1``: a float, a string,
    a bool or bytes is refused, as is an id outside the vocabulary."""
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError(f"token ids must be a sequence of ints, got {type(tokens).__name__} "
                        "(give text to generate_text or stream)")
    out = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"token ids must be ints, got {t!r} ({type(t).__name__})")
        t = int(t)
        if not 0 <= t < vocab:
            raise ValueError(f"token id {t} is outside the vocabulary (0..{vocab - 1})")
        out.append(t)
    return out


class Session:
    """A sequence in a model's KV cache.

    ``continue_cache=True`` makes a handle on the sequence the cache holds
    now (the one :meth:`Model.generate` ``keep_cache=True`` continues).
    """

    def __init__(self, model, *, continue_cache: bool = False):
        self.model = model
        owner = model.cache_owner
        self.id = owner if continue_cache and owner is not None else next(_ids)
        self._prompt_host = np.zeros(model.capacity, np.int32)

    # ----------------------------------------------------------- where it stands
    @property
    def holds_cache(self) -> bool:
        """Whether the model's KV cache holds this session's sequence."""
        return self.model.cache_owner == self.id

    @property
    def position(self) -> int | None:
        """The position of the sequence's last chosen token, the next one a
        step feeds (the cache holds the ones before it); None when there is
        no sequence to continue."""
        return self.model.cache_position if self.holds_cache else None

    def _set_position(self, pos):
        self.model.cache_owner, self.model.cache_position = self.id, pos

    # ------------------------------------------------------------ feeding
    def reset(self, prompt):
        """Start a new sequence: the cache is emptied and ``prompt`` (at
        least one token) is what the next steps feed."""
        m = self.model
        prompt = check_tokens(prompt, m.hp.vocab)
        if not prompt:
            raise ValueError("generate needs at least one prompt token")
        if len(prompt) > m.capacity:
            raise ContextOverflowError(f"prompt of {len(prompt)} tokens exceeds the KV cache "
                                       f"capacity of {m.capacity}")
        ex = m.executor
        ex.write(m.step_graph.state, decode_state.initial_state(prompt[0], len(prompt)))
        self._prompt_host[:] = 0
        self._prompt_host[:len(prompt)] = prompt
        ex.write(m.step_graph.prompt, self._prompt_host)
        hist = np.zeros(m.capacity, np.int32)
        hist[0] = prompt[0]
        ex.write(m.step_graph.history, hist)
        m.backend.synchronize()
        # set once the prompt is fed (an abandoned prompt leaves nothing to continue)
        self.id = next(_ids)
        self._set_position(None)

    def _append(self, tokens) -> tuple:
        """Queue ``tokens`` after the sequence in the cache: the next steps
        feed its last chosen token, then these.  Returns ``(start, n_fed)``."""
        m = self.model
        tokens = check_tokens(tokens, m.hp.vocab)
        p = self.position
        end = p + len(tokens)
        if end >= m.capacity:
            raise ContextOverflowError(
                f"the sequence holds {p + 1} tokens; {len(tokens)} more would need {end + 1} "
                f"of the KV cache's {m.capacity} positions (and one for the reply)")
        ex, sg = m.executor, m.step_graph
        m.backend.synchronize(m.device_stream)
        st = ex.read(sg.state)
        if int(st[decode_state.POS]) != p or st[decode_state.OVERFLOW]:
            raise RuntimeError(f"the decode state (position {int(st[decode_state.POS])}) does "
                               f"not continue the sequence at {p}")
        self._prompt_host[p + 1:end + 1] = tokens
        ex.write(sg.prompt, self._prompt_host)
        st[decode_state.PROMPT_LEN] = end + 1
        ex.write(sg.state, st)
        m.backend.synchronize()
        return p, len(tokens) + 1

    def _plan(self, token_ids, keep_cache) -> tuple:
        """``(start, n_fed)`` of feeding ``token_ids``."""
        if keep_cache and self.position is not None:
            return self.position, len(token_ids) + 1
        return 0, len(token_ids)

    def _prepare(self, token_ids, sampling, keep_cache):
        """Set the state for feeding ``token_ids`` and the sampler's
        parameters; returns ``(start, n_fed, variant, seed)``."""
        settings = SamplingSettings() if sampling is None else sampling
        if not isinstance(settings, SamplingSettings):
            raise TypeError(f"sampling must be a SamplingSettings, got {type(sampling).__name__}")
        if keep_cache and self.position is not None:
            start, n_fed = self._append(token_ids)
        else:
            self.reset(token_ids)
            start, n_fed = 0, len(token_ids)
        seed = None
        m = self.model
        if not settings.is_greedy:
            seed = settings.resolved_seed()
            m.executor.write(m.step_graph.sampling_params, settings.params(seed))
            m.backend.synchronize()
        return start, n_fed, settings.variant, seed

    def _run_prefill(self, token_ids, start, n_fed, mode, chunk) -> tuple:
        """Prefill a new sequence's prompt but its last token in chunks of
        ``chunk`` (None: the model's default; or a :class:`~.prefill.Prefill`
        of the model's); returns the tokens done and the seconds taken
        (``(0, 0.0)`` where it does not apply)."""
        m = self.model
        if chunk is None:
            chunk = m.default_prefill_chunk()
        if not chunk or start != 0 or n_fed < 2:
            return 0, 0.0
        pre = m.prefill(chunk) if isinstance(chunk, numbers.Integral) else chunk
        t0 = time.perf_counter()
        done = pre.run(list(token_ids), mode)
        n = done + 1
        state = decode_state.initial_state(token_ids[-1], n)
        state[decode_state.POS] = n - 1
        state[decode_state.KV_LEN] = n
        sg = m.step_graph
        m.executor.write(sg.state, state)
        hist = np.zeros(m.capacity, np.int32)
        hist[:n] = token_ids
        m.executor.write(sg.history, hist)
        m.backend.synchronize(m.device_stream)
        return done, time.perf_counter() - t0

    # ---------------------------------------------------------- generating
    def decode(self, token_ids, *, sampling: SamplingSettings | None = None,
               keep_cache: bool = False, mode: str = "graph", progress=None,
               prefill_chunk: int | None = None) -> "Decoding":
        """Feed ``token_ids`` and iterate over the tokens the model chooses.

        Parameters
        ----------
        token_ids : list of int
            With ``keep_cache`` these follow the sequence already in the
            cache (whose last chosen token is fed first); otherwise they
            start a new one (at least one token).
        sampling : SamplingSettings, optional
            Greedy when None.
        keep_cache : bool
            Continue this session's sequence (a new one if the cache does not hold it).
        mode : {"graph", "eager", "persistent"}
            ``"persistent"``: the greedy step as one persistent kernel
            (:mod:`.persistent`).
        progress : callable(done, total), optional
            Called after each feeding step (synchronizes each step).
        prefill_chunk : int or Prefill, optional
            A new sequence's prompt but its last token runs through the
            chunked prefill in chunks of this many tokens (0: through the
            decode step; None: the model's default; a ``model.prefill(...)``
            with buckets of your own).

        Returns
        -------
        Decoding
            An iterator of token ids; it ends when the KV cache is full.
        """
        token_ids = check_tokens(token_ids, self.model.hp.vocab)
        start, n_fed = self._plan(token_ids, keep_cache)
        if start + n_fed >= self.model.capacity:
            raise ContextOverflowError(
                f"{start + n_fed} tokens leave no room for a new one in the KV cache's "
                f"{self.model.capacity} positions")
        start, n_fed, variant, seed = self._prepare(token_ids, sampling, keep_cache)
        done, t_prefill = self._run_prefill(token_ids, start, n_fed, mode, prefill_chunk)
        return Decoding(self, n_fed - done, start + done, variant, mode, seed, progress,
                        prefill_seconds=t_prefill, prefilled=done)

    def generate(self, token_ids, max_new_tokens: int, *, mode: str = "graph",
                 return_logits: bool = False, sampling: SamplingSettings | None = None,
                 keep_cache: bool = False, prefill_chunk: int | None = None):
        """Feed ``token_ids``, then choose ``max_new_tokens`` more (greedy
        unless ``sampling`` says otherwise); no early stop.

        A new sequence's prompt but its last token runs through the chunked
        prefill in chunks of ``prefill_chunk`` tokens (0: every prompt token
        through the decode step; None, the default: the model's default, or
        0 with ``return_logits``).  Returns a :class:`GenerateResult`;
        ``return_logits`` also returns the logits of every step through the
        decode step (a host copy per step, slower)."""
        m = self.model
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        token_ids = check_tokens(token_ids, m.hp.vocab)
        start, n_fed = self._plan(token_ids, keep_cache)
        total = start + n_fed + max_new_tokens
        if total > m.capacity:
            raise ContextOverflowError(
                f"{start + n_fed} prompt + {max_new_tokens} new tokens need {total} positions; "
                f"the KV cache holds {m.capacity}")
        start, n_fed, variant, seed = self._prepare(token_ids, sampling, keep_cache)
        times, logits = [], []
        if prefill_chunk is None and return_logits:
            prefill_chunk = 0       # only the decode step gives every prompt step's logits
        done, t_prefill = self._run_prefill(token_ids, start, n_fed, mode, prefill_chunk)
        sg = m.step_graph
        for _ in range(n_fed - 1 - done + max_new_tokens):
            t0 = time.perf_counter()
            m.step(mode, variant)
            if return_logits:
                logits.append(m.executor.read(sg.logits).astype(np.float64))
            else:
                m.backend.synchronize(m.device_stream)
            times.append(time.perf_counter() - t0)
        state = m.executor.read(sg.state)
        if state[decode_state.OVERFLOW]:
            raise ContextOverflowError("the decode step reported a KV-cache overflow")
        self._set_position(int(state[decode_state.POS]))
        hist = m.executor.read(sg.history)[:total]
        n_steps = n_fed - 1 - done            # feeding steps left to the decode step
        prompt_s = t_prefill + sum(times[:n_steps])
        res = GenerateResult(tokens=[int(t) for t in hist[start + n_fed:]],
                             step_seconds=times[1:] if len(times) > 1 else times,
                             launches_per_token=1 if mode == "persistent"
                             else sg.g.launch_count_of(variant),
                             mode=mode if m.backend.can_capture or mode == "persistent"
                             else "eager",
                             prompt_seconds=prompt_s,
                             prompt_tokens_per_second=(n_fed - 1) / prompt_s
                             if prompt_s > 0 else float("nan"), seed=seed)
        return (res, logits) if return_logits else res


class Decoding:
    """Feeds tokens to a session's model, then yields each token it chooses.

    Made by :meth:`Session.decode`.  Iterating runs the decode steps: the
    first ``next()`` runs one step per fed token (the last of them chooses
    the first new token), every later one runs one step.  The iteration
    ends when the KV cache is full (:attr:`capacity_reached`); otherwise
    the caller stops it.  Tokens are chosen on the device; each is read
    back after its step.

    Attributes
    ----------
    n_fed : int
        Tokens the decode step feeds: the given tokens (but those the
        chunked prefill ran), plus the sequence's last chosen token (not yet
        in the cache) when continuing one.
    prefilled : int
        Prompt tokens the chunked prefill ran before the decode step.
    start : int
        The position of the first token the decode step feeds.
    prompt_seconds : float
        Wall time of the prompt: the chunked prefill (``prefill_seconds``,
        when it ran) and the feeding steps, up to the first new token.
    step_seconds : list of float
        Wall time of each later step.
    seed : int or None
        The seed the sampler used (None for greedy decoding).
    capacity_reached : bool
    """

    def __init__(self, session: Session, n_fed: int, start: int, variant: str, mode: str, seed,
                 progress=None, prefill_seconds: float = 0.0, prefilled: int = 0):
        self.session = session
        self.n_fed = n_fed
        self.prefilled = prefilled
        self.start = start
        self.variant = variant
        self.mode = (mode if session.model.backend.can_capture or mode == "persistent"
                     else "eager")
        self.seed = seed
        self.prompt_seconds = self.prefill_seconds = float(prefill_seconds)
        self.step_seconds: list = []
        self.capacity_reached = False
        self.tokens: list = []
        self._progress = progress
        self._pos = None

    def __iter__(self):
        return self

    def _read_state(self):
        m = self.session.model
        st = m.executor.read(m.step_graph.state)
        if st[decode_state.OVERFLOW]:
            raise ContextOverflowError("the decode step reported a KV-cache overflow")
        return st

    def __next__(self) -> int:
        s = self.session
        m = s.model
        if self._pos is None:
            t0 = time.perf_counter()
            for i in range(self.n_fed):
                m.step(self.mode, self.variant)
                if self._progress is not None:
                    m.backend.synchronize(m.device_stream)
                    self._progress(i + 1, self.n_fed)
            m.backend.synchronize(m.device_stream)
            st = self._read_state()
            self.prompt_seconds = self.prefill_seconds + time.perf_counter() - t0
        else:
            if self._pos >= m.capacity - 1:
                self.capacity_reached = True
                raise StopIteration
            if not s.holds_cache:
                raise RuntimeError("another session has taken the model's KV cache since "
                                   "this generation started")
            t0 = time.perf_counter()
            m.step(self.mode, self.variant)
            m.backend.synchronize(m.device_stream)
            st = self._read_state()
            self.step_seconds.append(time.perf_counter() - t0)
        pos = int(st[decode_state.POS])
        want = self.start + self.n_fed + len(self.tokens)
        if pos != want:
            raise RuntimeError(f"the decode state is at position {pos}, expected {want}")
        self._pos = pos
        s._set_position(pos)
        tok = int(st[decode_state.TOKEN])
        self.tokens.append(tok)
        return tok

    @property
    def decode_seconds(self) -> float:
        """Wall time of the steps after the first new token."""
        return float(sum(self.step_seconds))
