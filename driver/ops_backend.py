"""Where an op runs, and what its arguments become there.

Every op of :mod:`ptxgen.driver.ops` hands its array arguments to
:func:`op_args`, which picks the backend and converts them:

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

import contextlib
import functools
import math
import os
import threading

import numpy as np

from ptxgen.target import TARGETS

from .launch import named_args

__all__ = ["Backend", "OpArgs", "op_args", "get_backend", "device_target", "recording",
           "BACKENDS", "ENV_VAR", "EMU_TARGET", "EMU_SM_COUNT"]

#: names a backend can be chosen by
BACKENDS = ("cuda", "emu")
#: environment variable naming the backend of calls whose arrays are all numpy
ENV_VAR = "PTXGEN_OPS_BACKEND"
#: the device the emulator stands for when an op sizes its launch (an H100:
#: the kernels and split counts an H100 would get)
EMU_TARGET = "sm_90"
EMU_SM_COUNT = 132


def device_target(device=None) -> str:
    """The newest ptxgen target the GPU can run (``"sm_90"`` on H100/H200)."""
    from .device import get_device
    major, minor = get_device(device).compute_capability
    sm = major * 10 + minor
    ok = [t for t in TARGETS if t.startswith("sm_") and t[3:].isdigit() and int(t[3:]) <= sm]
    if not ok:
        raise RuntimeError(f"ptxgen has no target for compute capability {major}.{minor}")
    return max(ok, key=lambda t: int(t[3:]))


class Backend:
    """What an op needs of one backend: arrays, modules, launches, the
    device's target and size, and cached workspaces.

    Attributes
    ----------
    name : {"cuda", "emu"}
    DeviceArray : type
    """

    def __init__(self, name: str):
        self.name = name
        if name == "cuda":
            from .launch import launch
            from .memory import DeviceArray
            self.DeviceArray = DeviceArray
            self._launch = launch
        else:
            from ptxgen import emu
            self.DeviceArray = emu.DeviceArray
            self._launch = emu.launch
        self._lock = threading.Lock()
        self._cache: dict = {}

    def __repr__(self):
        return f"<ops backend {self.name}>"

    @functools.cached_property
    def target(self) -> str:
        """The ptxgen target kernels are built for."""
        return device_target() if self.name == "cuda" else EMU_TARGET

    @functools.cached_property
    def device_name(self) -> str | None:
        """The GPU's name (the key of configs ``python -m ptxgen tune``
        stored), None on the emulator."""
        if self.name == "emu":
            return None
        from .device import get_device
        return get_device().name

    @functools.cached_property
    def sm_count(self) -> int:
        if self.name == "emu":
            return EMU_SM_COUNT
        from .device import get_device
        return get_device().sm_count

    def load(self, module):
        """``module`` (PTX text or a ``ptxgen.Module``) loaded on this backend."""
        if self.name == "cuda":
            from .module import Module
            return Module.from_ptx(module)
        from ptxgen import emu
        return emu.Module.from_ptx(module)     # keeps the builder's file:line per instruction

    def module(self, build, spec):
        """``build(spec)`` loaded on this backend, once per (build, spec)."""
        key = ("module", build, spec)
        with self._lock:
            mod = self._cache.get(key)
        if mod is None:
            mod = self.load(build(spec))
            with self._lock:
                mod = self._cache.setdefault(key, mod)
        return mod

    def function(self, build, spec, name=None, dynamic_shared=0):
        """Kernel ``name`` (default ``spec.kernel_name``) of :meth:`module`,
        allowed ``dynamic_shared`` bytes of dynamic shared memory."""
        fn = self.module(build, spec).function(name or spec.kernel_name)
        if dynamic_shared:
            fn.require_dynamic_shared(dynamic_shared)
        return fn

    def tensor_map(self, desc):
        """The launch argument for the :class:`ptxgen.tensor_map.TensorMap`
        ``desc``: on the GPU its ``CUtensorMap``, encoded once per
        description; on the emulator the description itself."""
        if self.name != "cuda":
            return desc
        key = ("tmap", desc)
        with self._lock:
            enc = self._cache.get(key)
        if enc is None:
            from .tensor_map import encode_tiled
            enc = encode_tiled(desc)
            with self._lock:
                enc = self._cache.setdefault(key, enc)
        return enc

    def launch(self, fn, geometry, args, *, stream=None, pdl=False):
        """Launch ``fn`` with ``geometry`` (a
        :class:`~ptxgen.kernels.plan.LaunchGeometry`) and ``args``, a mapping
        of parameter name to value (the geometry adds its own); its dynamic
        shared memory limit is raised to the geometry's first."""
        if geometry.shared:
            fn.require_dynamic_shared(geometry.shared)
        self.launch_positional(fn, geometry.grid, geometry.block, *named_args(fn, geometry, args),
                               shared=geometry.shared, stream=stream, pdl=pdl)

    def launch_positional(self, fn, grid, block, *args, shared=0, stream=None, pdl=False):
        """Launch ``fn`` with ``args`` in declaration order (the form
        :func:`recording` collects)."""
        rec = getattr(_recorder, "launches", None)
        if rec is not None:
            rec.append((fn, grid, block, args, shared, pdl))
            return
        self._launch(fn, grid, block, *args, shared=shared, stream=stream, pdl=pdl)

    def resident(self, fn, block, shared=0):
        """Blocks of ``fn`` one SM holds at once (the driver's occupancy), or
        None where it is not known (the emulator, an old driver binding):
        the caller then uses its spec's estimate."""
        if self.name == "emu":
            return None
        if shared:
            fn.require_dynamic_shared(shared)
        try:
            return max(1, _occupancy(fn.handle, block, shared))
        except Exception:
            return None

    def workspace(self, key, shape, dtype, zero=False):
        """An array cached per ``key``, made on the first call (``zero``:
        filled with zero bytes; on the GPU the device is synchronized once,
        since the memset runs on the legacy stream and the array's first user
        may be on another, so the first call for a key must come before a
        graph capture)."""
        with self._lock:
            ws = self._cache.get(("ws", key))
            if ws is None:
                ws = (self.DeviceArray.zeros if zero else self.DeviceArray.empty)(shape, dtype)
                if zero and self.name == "cuda":
                    from .device import get_device
                    get_device().synchronize()
                self._cache[("ws", key)] = ws
            return ws

    def constant(self, key, make):
        """A device copy of the host array ``make()``, uploaded once per key."""
        with self._lock:
            a = self._cache.get(("const", key))
            if a is None:
                a = self._cache[("const", key)] = self.DeviceArray.from_numpy(make())
            return a

    def to_numpy(self, a, stream=None):
        """``a`` copied to the host once the work queued on ``stream`` is done."""
        if self.name == "cuda":
            return a.to_numpy(stream=stream)
        return a.to_numpy()


_recorder = threading.local()


@contextlib.contextmanager
def recording():
    """Collect the launches of the ops called inside instead of running them
    (in this thread).  Yields a list that receives ``(fn, grid, block, args,
    shared, pdl)`` per launch, in order; replaying them (e.g. into a CUDA
    graph) runs the ops.  Device arrays an op allocates stay alive through
    ``args``; an op that copies results to the host must not be recorded."""
    outer = getattr(_recorder, "launches", None)
    _recorder.launches = launches = []
    try:
        yield launches
    finally:
        _recorder.launches = outer


@functools.lru_cache(maxsize=None)
def _occupancy(handle, block, shared):
    from .errors import check, cuda
    return int(check(cuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(handle, block, shared),
                     "cuOccupancyMaxActiveBlocksPerMultiprocessor"))


_backends: dict = {}
_auto = None


def get_backend(name: str) -> Backend:
    """The :class:`Backend` named ``name`` ("cuda" or "emu")."""
    if name not in BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; choose one of {', '.join(BACKENDS)}")
    b = _backends.get(name)
    if b is None:
        b = _backends.setdefault(name, Backend(name))
    return b


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
