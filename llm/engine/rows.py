"""What the scheduler hands the runner and what it hands back: one decode
row per sequence of a decode step, one prompt chunk per sequence of a
prefill step, one output per chosen token.

These are the runner's interface (``docs/engine.md``): the scheduler builds
them without importing the runner, and ``BatchRunner`` (``runner.py``, the
device side) and the tests' fake runner take them alike.
"""

from __future__ import annotations

import attrs

from ptxgen.llm.generation import SamplingSettings

__all__ = ["DecodeRow", "PrefillChunk", "RowOutput"]


@attrs.frozen
class DecodeRow:
    """One sequence's token of a decode step.

    Attributes
    ----------
    token : int
        The token to feed: the sequence's last chosen one.
    position : int
        Its position (0-based); its K/V go to slot ``position % block_size``
        of block ``block_table[position // block_size]``.
    block_table : tuple of int
        The sequence's blocks, in order (covering ``position``).
    sampling : SamplingSettings
        How to choose the next token (greedy when ``is_greedy``).
    seed : int
        The sampler's seed (the request's resolved seed).
    history : tuple of int
        The sequence's last ``repeat_last_n`` tokens up to and including
        ``token`` (all of them for -1), for the penalties; empty when the
        settings have none.
    logprobs : int
        Top-N log-probabilities wanted (0: none; the chosen token's is
        always given).
    """

    token: int
    position: int
    block_table: tuple
    sampling: SamplingSettings
    seed: int
    history: tuple = ()
    logprobs: int = 0


@attrs.frozen
class PrefillChunk:
    """Consecutive prompt tokens of one sequence, whose K and V rows a
    prefill step writes to the cache (it chooses no token: a prompt's last
    token is fed by a decode step, beside the other sequences').

    Attributes
    ----------
    tokens : tuple of int
        The chunk's token ids.
    start : int
        The position of ``tokens[0]``; positions before it are in the cache.
    block_table : tuple of int
        The sequence's blocks, covering ``start + len(tokens) - 1``.
    """

    tokens: tuple
    start: int
    block_table: tuple


@attrs.frozen
class RowOutput:
    """The token a decode row chose.

    Attributes
    ----------
    token : int
    logprob : float
        Of the chosen token: the log-softmax of the raw logits.
    top : tuple
        ``((token_id, logprob), ...)``, most likely first, when asked.
    """

    token: int
    logprob: float
    top: tuple = ()
