"""How the next token is chosen: sampling settings and the decode step's
two variants.

:class:`SamplingSettings` holds llama.cpp's sampler settings (temperature,
top-k, top-p, min-p, the repetition / frequency / presence penalties over
the last ``repeat_last_n`` tokens, and the seed).  Greedy decoding (a
temperature of 0 and no penalty) runs the decode step's ``"greedy"``
variant, whose last launches are the argmax and the state advance, exactly
as without a sampler; anything else runs the ``"sample"`` variant, where the
sampler kernel (``ptxgen.kernels.sampling``) writes the chosen token
instead, reading its settings from a device buffer the host rewrites before
a generation.  Each variant is its own captured CUDA graph.

The step loop that feeds tokens and hands back each chosen one is
:class:`~ptxgen.llm.session.Decoding`.
"""

from __future__ import annotations

import math
import os

import attrs
import numpy as np

from ptxgen.kernels import sampling as _smp

__all__ = ["SamplingSettings", "ContextOverflowError", "sampler_spec", "GREEDY", "SAMPLE"]

#: the decode step's variants (``ComputeGraph.variants``)
GREEDY, SAMPLE = "greedy", "sample"


class ContextOverflowError(RuntimeError):
    """Generation would run past the KV cache's capacity."""


def _finite(name, lo=None, hi=None, lo_open=False):
    def check(inst, attr, v):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a number, got {v!r}")
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"{name} must be finite, got {v!r}")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {v!r}")
        if hi is not None and v > hi:
            raise ValueError(f"{name} must be <= {hi}, got {v!r}")
    return check


def _integer(name, lo=None):
    def check(inst, attr, v):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {v!r}")
        if not -2**31 <= int(v) < 2**31:
            raise ValueError(f"{name} must fit in 32 bits, got {v!r}")
        if lo is not None and v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v!r}")
    return check


def _check_seed(inst, attr, v):
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < 1 << 64:
        raise ValueError(f"seed must be an int in 0 .. 2**64 - 1 or None, got {v!r}")


@attrs.frozen
class SamplingSettings:
    """How the next token is chosen; llama.cpp's sampler settings.

    The chain (in this order): the penalties over the last
    ``repeat_last_n`` tokens of the sequence (prompt included), top-k,
    top-p, min-p, temperature, then a draw keyed by ``seed`` and the
    token's position (Philox-4x32-10), so a seed reproduces a generation.
    ``temperature <= 0`` picks the largest (penalised) logit.  See
    ``docs/sampling.md`` for the exact semantics.

    Parameters
    ----------
    temperature : float
        ``--temp``; 0 (the default) is greedy decoding.
    top_k : int
        ``--top-k``; 0 keeps every token.
    top_p : float
        ``--top-p``, in [0, 1]; 1 keeps every token.
    min_p : float
        ``--min-p``, in [0, 1]; 0 keeps every token.
    repeat_penalty : float
        ``--repeat-penalty`` (> 0); 1 is off.
    repeat_last_n : int
        ``--repeat-last-n``: the penalty window; -1 the whole sequence, 0 off.
    presence_penalty, frequency_penalty : float
        ``--presence-penalty``, ``--frequency-penalty``; 0 is off.
    seed : int or None
        ``--seed`` (0 .. 2**64 - 1); None draws one per generation (the
        result reports it).
    """

    temperature: float = attrs.field(default=0.0, validator=_finite("temperature", lo=0.0))
    top_k: int = attrs.field(default=40, validator=_integer("top_k", lo=0))
    top_p: float = attrs.field(default=0.95, validator=_finite("top_p", lo=0.0, hi=1.0))
    min_p: float = attrs.field(default=0.05, validator=_finite("min_p", lo=0.0, hi=1.0))
    repeat_penalty: float = attrs.field(default=1.0,
                                        validator=_finite("repeat_penalty", lo=0.0, lo_open=True))
    repeat_last_n: int = attrs.field(default=64, validator=_integer("repeat_last_n", lo=-1))
    presence_penalty: float = attrs.field(default=0.0, validator=_finite("presence_penalty"))
    frequency_penalty: float = attrs.field(default=0.0, validator=_finite("frequency_penalty"))
    seed: int | None = attrs.field(default=None, validator=_check_seed)

    @property
    def penalties_on(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0
                                            or self.presence_penalty != 0.0
                                            or self.frequency_penalty != 0.0)

    @property
    def is_greedy(self) -> bool:
        """Plain argmax: no temperature and no penalty (the ``"greedy"`` step)."""
        return self.temperature <= 0.0 and not self.penalties_on

    @property
    def variant(self) -> str:
        """The decode step's variant these settings run."""
        return GREEDY if self.is_greedy else SAMPLE

    def resolved_seed(self) -> int:
        """``seed``, or a fresh one from the OS when it is None."""
        if self.seed is not None:
            return int(self.seed)
        return int.from_bytes(os.urandom(8), "little")

    def params(self, seed: int) -> np.ndarray:
        """The sampler kernel's parameter words (u32[12]) with ``seed``."""
        return _smp.pack_params(top_k=int(self.top_k), top_p=float(self.top_p),
                                min_p=float(self.min_p), temperature=float(self.temperature),
                                penalty_last_n=int(self.repeat_last_n),
                                penalty_repeat=float(self.repeat_penalty),
                                penalty_freq=float(self.frequency_penalty),
                                penalty_present=float(self.presence_penalty), seed=seed)


def sampler_spec(n_vocab: int, target: str) -> _smp.SamplingSpec:
    """The decode step's sampler: blocks of 512 threads (1024 logits each,
    64 keys to the merge), as ``ops.sample`` uses; a vocabulary of at most
    1024 tokens takes one block of the smallest power of two that holds it
    (at least 64 threads)."""
    if n_vocab > 2 * 512 * 512:
        block = 1024
    else:
        block = min(512, max(64, 1 << max(0, (-(-n_vocab // 2) - 1).bit_length())))
    return _smp.SamplingSpec(block=block, top=64, target=target)
