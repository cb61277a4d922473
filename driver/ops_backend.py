"""Where an op runs, and what its arguments become there.

Every op of :mod:`ptxgen.driver.ops` hands its array arguments to
:func:`op_args`, which picks the backend (a :class:`~.backend.Backend`)
and converts them:

* a ``ptxgen.driver.DeviceArray`` or any object with
  ``__cuda_array_interface__`` (torch, cupy) runs the op on the GPU, zero copy;
* a ``ptxgen.emu.DeviceArray`` runs it on the CPU emulator;
* numpy arrays are copied to whichever backend runs the op. With numpy
  arrays only, the op runs on the GPU when there is one and on the emulator
  otherwise (``backend="cuda"``/``"emu"`` or the ``PTXGEN_OPS_BACKEND``
  environment variable choose), and what it returns is numpy too.

Arrays of both backends in one call are refused, naming the arguments.
A numpy argument the op writes (``out=``, an in-place input) receives the
result when the op returns.
"""

from __future__ import annotations

import math
import os

import numpy as np

from .backend import BACKENDS, get_backend

__all__ = ["OpArgs", "op_args", "ENV_VAR"]

#: environment variable naming the backend of calls whose arrays are all numpy
ENV_VAR = "PTXGEN_OPS_BACKEND"
_auto = None


def _default_name() -> str:
    """The backend of an all-numpy call with no ``backend=``: the
    environment variable's, else the GPU when one is usable, else the emulator."""
    global _auto
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env and env != "auto":
        if env not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={env!r}: expected one of {', '.join(BACKENDS)} or auto")
        return env
    if _auto is None:
        from .errors import is_available
        _auto = "cuda" if is_available() else "emu"
    return _auto


def _kind(value):
    """"host", "int", "emu", "cuda" or None (not an array)."""
    if isinstance(value, np.ndarray):
        return "host"
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return "int"
    from ptxgen import emu
    if isinstance(value, emu.DeviceArray):
        return "emu"
    if hasattr(value, "__cuda_array_interface__"):
        return "cuda"
    return None


_WHAT = {"emu": "an emulator array (ptxgen.emu.DeviceArray)",
         "cuda": "a GPU array (ptxgen.driver.DeviceArray or a CUDA tensor)"}


class OpArgs:
    """The array arguments of one op call, converted for its backend.

    ``args[name]`` is the argument as a device array of :attr:`backend`
    (None when it was None; a Python int stays an int).

    Attributes
    ----------
    backend : Backend
    host : bool
        True when every array argument was numpy: what the op allocates is
        returned as numpy.
    """

    def __init__(self, backend, given, writes, stream):
        self.backend = backend
        self.host = not any(_kind(v) in BACKENDS for v in given.values())
        self._given = given
        self._writes = writes
        self._stream = stream
        self._dev = {}

    def __getitem__(self, name):
        d = self._dev.get(name)
        if d is None:
            v = self._given[name]
            k = _kind(v)
            if k is None or k == "int":
                return v
            if k == "host":
                d = self.backend.DeviceArray.from_numpy(np.ascontiguousarray(v))
            elif k == "cuda":
                from .memory import as_device_array
                try:
                    d = as_device_array(v)
                except ValueError as e:
                    raise TypeError(f"{name}: {e}") from None
            else:
                d = v
            self._dev[name] = d
        return d

    def array(self, name, dtype=None, size=None):
        """``args[name]``, checked to be an array of ``dtype`` with ``size``
        elements (when given)."""
        a = self[name]
        if not hasattr(a, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
        if dtype is not None and a.dtype != np.dtype(dtype):
            raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype.name}")
        if size is not None and a.size != size:
            raise ValueError(f"{name} has {a.size} elements, expected {size}")
        return a

    def out_dtype(self, name, allowed=(np.float32, np.float16)):
        """The dtype of the output ``name``: the argument's (one of
        ``allowed``, else a TypeError naming them), or the first of
        ``allowed`` when it was None."""
        if self._given.get(name) is None:
            return np.dtype(allowed[0])
        dt = np.dtype(self.array(name).dtype)
        if dt not in [np.dtype(a) for a in allowed]:
            raise TypeError(f"{name} must be {' or '.join(np.dtype(a).name for a in allowed)}, "
                            f"got {dt.name}")
        return dt

    def out(self, name, shape, dtype=np.float32):
        """The output ``name``: the argument (checked for dtype and size) or,
        when it was None, a new array of ``shape``."""
        if self._given.get(name) is None:
            return self.backend.DeviceArray.empty(shape, dtype)
        return self.array(name, dtype, math.prod(shape))

    def scalar_i32(self, name):
        """A device int32 scalar: the array argument, or a Python int copied
        into a fresh one (not graph-safe)."""
        v = self._given[name]
        if _kind(v) == "int":
            return self.backend.DeviceArray.from_numpy(np.array([v], dtype=np.int32))
        return self.array(name, np.int32)

    def launch(self, fn, geometry, args, pdl=False):
        """``fn`` launched on the op's stream with ``geometry`` and ``args``
        by parameter name."""
        self.backend.launch(fn, geometry, args, stream=self._stream, pdl=pdl)

    def result(self, value):
        """What the op returns for ``value`` (a device array, a tuple of them,
        or None), after copying every written numpy argument back: a
        converted numpy argument becomes that argument again; an array the
        op allocated becomes numpy in a host call."""
        be = self.backend
        for name in self._writes:
            v = self._given.get(name)
            if _kind(v) == "host" and name in self._dev:
                np.copyto(v, be.to_numpy(self._dev[name], self._stream).reshape(v.shape))
        back = {id(d): self._given[n] for n, d in self._dev.items()
                if _kind(self._given[n]) == "host"}

        def one(d):
            if id(d) in back:
                return back[id(d)]
            if self.host and isinstance(d, be.DeviceArray):
                return be.to_numpy(d, self._stream)
            return d

        if isinstance(value, tuple):
            return tuple(one(v) for v in value)
        return None if value is None else one(value)


def op_args(backend=None, *, writes=(), stream=None, **arrays) -> OpArgs:
    """Choose the backend of one op call and wrap its array arguments.

    Parameters
    ----------
    backend : {"cuda", "emu"} or None
        Where to run; None: where the device arrays are, else
        ``$PTXGEN_OPS_BACKEND``, else the GPU if usable, else the emulator.
    writes : tuple of str
        The arguments the op writes (outputs, in-place inputs): numpy ones
        receive the result.
    stream
        The op's stream (the GPU's; the emulator runs synchronously).
    **arrays
        The op's array arguments by name (None for those not given; Python
        ints for device scalars given as numbers).

    Raises
    ------
    ValueError
        Arrays of two backends, or ones of another backend than ``backend``.
    TypeError
        An argument that is no array of either kind, nor numpy.
    """
    where = {}
    for name, v in arrays.items():
        if v is None:
            continue
        k = _kind(v)
        if k is None:
            raise TypeError(f"{name}: expected a numpy array, a ptxgen.driver or ptxgen.emu "
                            f"DeviceArray, or a CUDA tensor (__cuda_array_interface__), got "
                            f"{type(v).__name__}")
        if k in BACKENDS:
            where.setdefault(k, name)
    if len(where) > 1:
        raise ValueError(f"arguments on two backends: {where['cuda']} is {_WHAT['cuda']}, "
                         f"{where['emu']} is {_WHAT['emu']}; give the op arrays of one backend "
                         f"(or numpy arrays)")
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
        for k, name in where.items():
            if k != backend:
                raise ValueError(f"backend={backend!r}, but {name} is {_WHAT[k]}")
        name = backend
    else:
        name = next(iter(where)) if where else _default_name()
    return OpArgs(get_backend(name), arrays, tuple(writes), stream)
