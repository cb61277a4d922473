"""Philox-4x32-10, the counter-based generator of Salmon, Moraes, Dror and
Shaw ("Parallel random numbers: as easy as 1, 2, 3", SC 2011), in the DSL.

A 128-bit counter and a 64-bit key give four independent 32-bit words; the
same ``(counter, key)`` always gives the same words, so a draw keyed by
``(seed, position)`` is reproducible without state.  Every step is an
integer ``mul.lo``/``mul.hi``/``xor``/``add`` on u32, bit-exact on the CPU
emulator and the GPU.
"""

from __future__ import annotations

from ptxgen.types import u32

__all__ = ["philox4x32_10", "MULTIPLIERS", "WEYL"]

#: the round multipliers (Random123's PHILOX_M4x32_0 and _1)
MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
#: the key schedule's Weyl increments (golden ratio and sqrt(3) - 1, as u32)
WEYL = (0x9E3779B9, 0xBB67AE85)


def philox4x32_10(k, counter, key, rounds: int = 10):
    """Four u32 registers: Philox-4x32 of ``counter`` (4 u32 registers or
    ints) under ``key`` (2 u32 registers or ints) with ``rounds`` rounds.

    One round maps ``(c0, c1, c2, c3)`` to
    ``(hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0)``;
    the key is bumped by the Weyl constants before every round but the first.
    """
    c = [x if not isinstance(x, int) else k.mov(x, u32) for x in counter]
    k0, k1 = (x if not isinstance(x, int) else k.mov(x, u32) for x in key)
    for r in range(rounds):
        if r:
            k0 = k0 + WEYL[0]
            k1 = k1 + WEYL[1]
        hi0 = k.mul_hi(c[0], MULTIPLIERS[0])
        lo0 = c[0] * MULTIPLIERS[0]
        hi1 = k.mul_hi(c[2], MULTIPLIERS[1])
        lo1 = c[2] * MULTIPLIERS[1]
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return tuple(c)
