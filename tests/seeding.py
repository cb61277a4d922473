"""Reproducible random inputs for the tests.

One session seed (``pytest --seed N``, else a fresh one drawn from the
operating system) determines every test's generator: a test's generator is
``numpy.random.default_rng([session_seed, crc32(node id)])``, so rerunning
one test with the seed a failure printed draws the same inputs whatever else
runs beside it.  Module- and session-scoped fixtures derive theirs the same
way from their own node id (the module's path).
"""

from __future__ import annotations

import secrets
import zlib

import numpy as np

_SESSION_SEED: int | None = None


def configure(seed: int | None) -> int:
    """Set the session seed (a fresh 32-bit one when ``seed`` is None)."""
    global _SESSION_SEED
    _SESSION_SEED = secrets.randbits(32) if seed is None else int(seed)
    return _SESSION_SEED


def session_seed() -> int:
    """The session seed (configured by tests/conftest.py at start-up)."""
    if _SESSION_SEED is None:
        raise RuntimeError("the session seed is set by tests/conftest.py; run the tests with pytest")
    return _SESSION_SEED


def seed_for(key: str) -> int:
    """A 63-bit seed for ``key`` (a node id) derived from the session seed."""
    seq = np.random.SeedSequence([session_seed(), zlib.crc32(key.encode())])
    return int(seq.generate_state(1, np.uint64)[0]) >> 1


def rng_for(key: str) -> np.random.Generator:
    """The generator of ``key`` (a node id) for this session."""
    return np.random.default_rng(seed_for(key))
