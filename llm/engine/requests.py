"""The engine's request and output types: what a request asks for
(:class:`RequestSettings`), what it yields as it runs (:class:`RequestEvent`),
what it comes to (:class:`RequestOutput`), and the engine's counters
(:class:`EngineStats`)."""

from __future__ import annotations

import numbers

import attrs

from ptxgen.llm.generation import SamplingSettings

__all__ = ["RequestSettings", "RequestEvent", "RequestOutput", "EngineStats", "EngineOverloaded",
           "FINISH_STOP", "FINISH_LENGTH", "FINISH_CANCELLED", "FINISH_ERROR", "MAX_LOGPROBS"]

#: why a request ended: an end-of-generation token, a stop token or a stop
#: string; ``max_tokens`` or a full context; cancelled; an error in its processing
FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"

#: the most top log-probabilities a request may ask for per token
MAX_LOGPROBS = 20


class EngineOverloaded(RuntimeError):
    """The engine's queue of requests waiting to start is full."""


def _positive_int(inst, attr, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"{attr.name} must be a positive int, got {v!r}")


def _strings(v) -> tuple:
    if isinstance(v, str):
        return (v,)
    return tuple(v)


def _ints(v) -> tuple:
    if isinstance(v, numbers.Integral):
        return (v,)
    return tuple(v)


def _check_stop(inst, attr, v):
    for s in v:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, got {s!r} ({type(s).__name__})")


def _check_stop_ids(inst, attr, v):
    for t in v:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}")


def _check_sampling(inst, attr, v):
    if not isinstance(v, SamplingSettings):
        raise TypeError(f"sampling must be a SamplingSettings, got {type(v).__name__}")


def _check_logprobs(inst, attr, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) \
            or not 0 <= v <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be an int in 0 .. {MAX_LOGPROBS}, got {v!r}")


@attrs.frozen
class RequestSettings:
    """What one request asks for.

    Attributes
    ----------
    max_tokens : int
        The most tokens to generate.
    sampling : SamplingSettings
        How each token is chosen (greedy by default).
    stop : tuple of str
        Stop strings, matched on the decoded text (needs the file's
        tokenizer); the text ends before the first match.
    stop_token_ids : tuple of int
        Tokens that end the request, besides the vocabulary's
        end-of-generation tokens.
    ignore_eos : bool
        Keep generating past the vocabulary's end-of-generation tokens
        (``stop_token_ids`` still stop).
    logprobs : int
        0: no log-probabilities; n: the chosen token's and the top ``n``
        (at most :data:`MAX_LOGPROBS`) for each new token.
    """

    max_tokens: int = attrs.field(validator=_positive_int)
    sampling: SamplingSettings = attrs.field(factory=SamplingSettings,
                                             validator=_check_sampling)
    stop: tuple = attrs.field(default=(), converter=_strings, validator=_check_stop)
    stop_token_ids: tuple = attrs.field(default=(), converter=_ints,
                                        validator=_check_stop_ids)
    ignore_eos: bool = attrs.field(default=False, converter=bool)
    logprobs: int = attrs.field(default=0, validator=_check_logprobs)


@attrs.frozen
class RequestEvent:
    """What a request produced since its last event.

    Attributes
    ----------
    token_ids : tuple of int
        The new tokens (an end-of-generation or stop token included).
    text : str
        The new text: whole UTF-8 characters only, and none of a possible
        stop string's beginning until it is known not to be one.
    logprobs : tuple
        Per new token, ``(token_id, logprob, top)`` as
        :class:`~.rows.RowOutput` gives them (empty unless asked for).
    finish_reason : str or None
        Set on the request's last event: ``"stop"``, ``"length"``,
        ``"cancelled"`` or ``"error"``.
    error : str or None
        What went wrong, with ``"error"``.
    """

    token_ids: tuple
    text: str
    logprobs: tuple = ()
    finish_reason: str | None = None
    error: str | None = None


@attrs.frozen
class RequestOutput:
    """A finished request.

    Attributes
    ----------
    id : str
    prompt_tokens : int
    token_ids : tuple of int
        Every generated token (an end-of-generation or stop token included).
    text : str
        The generated text (without end-of-generation tokens and stop strings).
    finish_reason : str
        ``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"``.
    logprobs : tuple
        Per generated token, ``(token_id, logprob, top)`` (when asked for).
    ttft_s : float
        Seconds from :meth:`Engine.add_request` to the first token (NaN if none).
    total_s : float
        Seconds from :meth:`Engine.add_request` to the end.
    error : str or None
        What went wrong, with ``"error"``.
    """

    id: str
    prompt_tokens: int
    token_ids: tuple
    text: str
    finish_reason: str
    logprobs: tuple
    ttft_s: float
    total_s: float
    error: str | None = None


@attrs.frozen
class EngineStats:
    """A snapshot of the engine's state and its counters since it started.

    Attributes
    ----------
    running : int
        Requests holding KV blocks (prefilling or decoding).
    waiting : int
        Requests queued to start (preempted ones included).
    blocks_used, blocks_free, blocks_total : int
        KV blocks referenced by requests, available (free or cached but
        unreferenced), and in the pool.
    blocks_cached : int
        Blocks whose contents the prefix cache can hand out again.
    block_size : int
        Tokens per block.
    prompt_tokens : int
        Prompt tokens fed through prefill chunks (prefix-cache hits excluded).
    cached_tokens : int
        Prompt tokens found in the prefix cache instead.
    generated_tokens : int
    preemptions : int
        Requests sent back to wait (their blocks freed) to make room.
    finished : int
        Requests ended, for any reason.
    steps, prefill_steps, decode_steps : int
        Runner calls.
    prefill_seconds, decode_seconds : float
        Wall time inside the runner's prefill and decode calls (a decode
        step launched behind another counts from that one's tokens to its
        own, the host's work overlapped with it included).
    """

    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    blocks_cached: int = 0
    block_size: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
