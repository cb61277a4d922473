"""Shared helpers for tests that run kernels on a backend ("emu" or "cuda").

``Backend(name)`` is the library's backend of that name
(:func:`ptxgen.driver.backend.get_backend`) with the tests' helpers
beside it (``array``, ``poisoned``, ``require_sm``); ``map_kernel``/``run_map``
build and run a one-thread-per-element kernel from a small body function,
which is how the numerics tests exercise single instructions.  ``line_of``
finds a marked line in a test file (for asserting the file:line a builder
error names).
"""

from __future__ import annotations

import numpy as np

import ptxgen
from ptxgen.types import type_by_name, u32


def line_of(path: str, marker: str) -> int:
    """Line number of the line of ``path`` that contains ``marker`` (a line
    that also calls ``line_of`` does not count)."""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "line_of" not in line:
                return i
    raise AssertionError(f"{marker!r} not found in {path}")

__all__ = ["Backend", "cuda_available", "map_kernel", "run_map", "poison"]


def cuda_available() -> bool:
    """True when ptxgen.driver can use a GPU; never raises."""
    try:
        from ptxgen.driver import is_available
        return bool(is_available())
    except Exception:
        return False


class Backend:
    """The backend ``name`` (:class:`ptxgen.driver.backend.Backend`: its
    attributes and methods, ``load``, ``launch``, ``launch_positional``,
    ``tensor_map``, ``target`` ...) with the tests' helpers."""

    def __init__(self, name: str):
        from ptxgen.driver.backend import get_backend
        self.backend = get_backend(name)

    def __getattr__(self, attr):
        return getattr(self.backend, attr)

    def array(self, host):
        return self.backend.from_numpy(np.ascontiguousarray(host))

    def require_sm(self, sm):
        """Skip unless the backend's target is at least ``sm`` (e.g. 90)."""
        from ptxgen.target import TARGETS
        have = TARGETS[self.backend.target].sm
        if have < sm:
            import pytest
            pytest.skip(f"needs sm_{sm}, the {self.backend.name} backend is {self.backend.target}")

    def poisoned(self, shape, dtype):
        """A device array filled with NaN (floats) or 0xA5 bytes (others)."""
        return self.array(poison(shape, dtype))

    def __repr__(self):
        return f"Backend({self.name})"


def poison(shape, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.full(shape, np.nan, dtype)
    return np.frombuffer(b"\xa5" * (int(np.prod(shape)) * dtype.itemsize), dtype).reshape(shape).copy()


def map_kernel(body, in_types, out_type, target="sm_90", name="map"):
    """A kernel ``out[i] = body(k, x0[i], x1[i], ...)`` for ``i < n``.

    ``body`` gets the builder and the loaded registers and returns a
    register (or a tuple of registers, stored to ``out`` as consecutive
    elements ``out[len*i + j]``)."""
    m = ptxgen.Module(target)
    in_types = [type_by_name(t) for t in in_types]
    out_type = type_by_name(out_type)
    with m.kernel(name) as k:
        ptrs = [k.param_ptr(f"x{j}", t) for j, t in enumerate(in_types)]
        out = k.param_ptr("out", out_type)
        n = k.param("n", u32)
        i = k.global_id()
        with k.if_(i < n):
            vals = [k.ld(p[i]) for p in ptrs]
            r = body(k, *vals)
            if isinstance(r, tuple):
                base = i * len(r)
                for j, v in enumerate(r):
                    k.st(out[base + j], v)
            else:
                k.st(out[i], r)
    return m


_NP = {"bf16": np.uint16, "f16x2": np.uint32, "bf16x2": np.uint32}


def np_dtype(t):
    t = type_by_name(t)
    return np.dtype(_NP.get(t.name) or t.np_dtype)


def run_map(backend, body, inputs, in_types, out_type, *, outs_per_item=1, block=64,
            target="sm_90"):
    """Build, launch and return the output of :func:`map_kernel` on ``backend``."""
    m = map_kernel(body, in_types, out_type, target)
    mod = backend.load(m)
    n = len(inputs[0])
    args = [backend.array(np.asarray(x, dtype=np_dtype(t))) for x, t in zip(inputs, in_types)]
    out = backend.poisoned(n * outs_per_item, np_dtype(out_type))
    backend.launch_positional(mod["map"], (n + block - 1) // block, block, *args, out, n)
    return out.to_numpy()
