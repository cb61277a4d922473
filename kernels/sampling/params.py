"""The sampler's parameter words and small pieces of the chain shared by
the kernel's phases."""

from __future__ import annotations

import math

import numpy as np

from ptxgen.types import f32, s32, u32, u64

__all__ = ["pack_params", "ex2_weight", "no_filter", "PARAM_WORDS", "INFO_WORDS",
           "FIXED_BITS", "FLAG_TRUNCATED", "FLAG_WHOLE", "FLAG_GREEDY", "MAX_LOGPROBS",
           "MAX_ROWS"]

(TOP_K, TOP_P, MIN_P, TEMP, LAST_N, REPEAT, FREQ, PRESENT, SEED_LO, SEED_HI, LOGPROBS) = range(11)
PARAM_WORDS = 12
#: the most top log-probabilities a row reports (OpenAI's ``top_logprobs`` limit)
MAX_LOGPROBS = 20
#: the most rows of a batched launch (``grid.y``)
MAX_ROWS = 65535
INFO_WORDS = 4
FIXED_BITS = 40
FLAG_TRUNCATED, FLAG_WHOLE, FLAG_GREEDY = 1, 2, 4
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def pack_params(*, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0, penalty_last_n=0,
                penalty_repeat=1.0, penalty_freq=0.0, penalty_present=0.0,
                seed=0, logprobs=False) -> np.ndarray:
    """The ``params`` words (u32[12]) of the sampler; llama.cpp's names:
    ``--top-k``, ``--top-p``, ``--min-p``, ``--temp``, ``--repeat-last-n``,
    ``--repeat-penalty``, ``--frequency-penalty``, ``--presence-penalty``,
    ``--seed`` (0 .. 2^64 - 1); ``logprobs``: this row's log-probabilities
    are wanted (read by a kernel built with ``SamplingSpec.logprobs``)."""
    if not isinstance(logprobs, (bool, np.bool_)):
        raise ValueError(f"logprobs must be a bool, got {logprobs!r}")
    seed = int(seed)
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in 0 .. 2**64 - 1, got {seed}")
    for name, v in (("top_k", top_k), ("penalty_last_n", penalty_last_n)):
        if not isinstance(v, (int, np.integer)) or not -2**31 <= v < 2**31:
            raise ValueError(f"{name} must be an int32, got {v!r}")
    if penalty_last_n < -1:
        raise ValueError(f"penalty_last_n must be -1 (all), 0 (off) or positive, got {penalty_last_n}")
    w = np.zeros(PARAM_WORDS, np.uint32)
    w[TOP_K] = np.int32(top_k).view(np.uint32)
    w[LAST_N] = np.int32(penalty_last_n).view(np.uint32)
    for i, v in ((TOP_P, top_p), (MIN_P, min_p), (TEMP, temperature), (REPEAT, penalty_repeat),
                 (FREQ, penalty_freq), (PRESENT, penalty_present)):
        if not math.isfinite(float(v)):
            raise ValueError(f"sampling parameters must be finite, got {v!r}")
        w[i] = np.float32(v).view(np.uint32)
    w[SEED_LO], w[SEED_HI] = seed & 0xFFFFFFFF, seed >> 32
    w[LOGPROBS] = 1 if logprobs else 0
    return w


def ex2_weight(k, y, m, scale):
    """``round(2^40 * 2^((y - m) * scale))`` as u64 (0 for -inf / NaN)."""
    e = k.ex2((y - m) * scale)
    return (e * float(1 << FIXED_BITS)).to(u64, rnd="rni")


def no_filter(k, prm, n, temp):
    """True when no filter is on (top-k 0 or >= V, top-p >= 1, min-p <= 0)
    and the temperature is positive."""
    kk = k.ld(prm[TOP_K], s32)
    no_k = k.setp("le", kk, 0)
    no_k = k.setp("ge", kk.bitcast(u32), n, combine=("or", no_k))
    p = k.setp("ge", k.ld(prm[TOP_P], f32), 1.0, combine=("and", no_k))
    p = k.setp("le", k.ld(prm[MIN_P], f32), 0.0, combine=("and", p))
    return k.setp("gt", temp, 0.0, combine=("and", p))
