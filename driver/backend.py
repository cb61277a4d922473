"""Where kernels run: the GPU (through :mod:`ptxgen.driver`) or the CPU
emulator (:mod:`ptxgen.emu`), behind one interface, :class:`Backend`.

The ops, the graph executor, the model and the tests talk to a backend and
never branch on which one it is: what differs is a capability
(``can_capture``), a property (``target``, ``sm_count``, ``device_name``,
``DeviceArray``) or a method both implement (module loading, launches,
copies, streams, graph capture and replay).  :func:`get_backend` gives the
process's one backend of each kind.

The emulator stands for one device, described in one place
(:class:`EmuBackend`'s ``target`` and ``sm_count``): the kernels the ops, the
model and the kernel tests build on it, and the launches they size, are the
ones that device would get.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import OrderedDict

import numpy as np

from ptxgen.target import TARGETS

from .launch import launch as _cuda_launch
from .launch import named_args

__all__ = ["Backend", "CudaBackend", "EmuBackend", "get_backend", "device_target", "recording",
           "BACKENDS"]


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
    """What ops, the graph executor, the model and the tests need of where
    kernels run.  :class:`CudaBackend` and :class:`EmuBackend` implement it.

    Attributes
    ----------
    name : {"cuda", "emu"}
    can_capture : bool
        Whether :meth:`capture` and :meth:`replay` (CUDA graphs) work; where
        not, callers run eagerly.
    DeviceArray : type
        This backend's arrays (``empty``, ``zeros``, ``from_numpy``, ``.ptr``).
    target : str
        The ptxgen target kernels are built for.
    sm_count : int
        Streaming multiprocessors launches are sized for.
    device_name : str or None
        The GPU's name (the key of the configs ``python -m ptxgen tune``
        stores); None on the emulator.

    Kernels come from :meth:`load` (a module), :meth:`module` and
    :meth:`function` (cached per build and spec); :meth:`launch` takes a
    family's :class:`~ptxgen.kernels.plan.LaunchGeometry` and the arguments
    by parameter name, :meth:`launch_positional` the arguments in
    declaration order.
    """

    name: str
    can_capture: bool
    DeviceArray: type
    target: str
    sm_count: int
    device_name: "str | None"

    def __init__(self):
        self._lock = threading.Lock()
        self._cache: dict = {}

    def __repr__(self):
        return f"<{type(self).__name__} {self.target}, {self.sm_count} SMs>"

    # ------------------------------------------------ what each backend does
    def load(self, module):
        """``module`` (PTX text or a ``ptxgen.Module``) loaded here: an
        object whose ``function(name)`` gives a kernel."""
        raise NotImplementedError

    def _launch(self, fn, grid, block, args, shared, stream, pdl):
        raise NotImplementedError

    def tensor_map(self, desc):
        """The launch argument for the :class:`ptxgen.tensor_map.TensorMap`
        ``desc``."""
        raise NotImplementedError

    def resident(self, fn, block, shared=0) -> "int | None":
        """Blocks of ``fn`` one SM holds at once with ``shared`` bytes of
        dynamic shared memory, or None where that is not known (the caller
        then uses its spec's estimate)."""
        raise NotImplementedError

    def to_numpy(self, arr, stream=None) -> np.ndarray:
        """``arr`` copied to the host once the work queued on ``stream`` is done."""
        raise NotImplementedError

    def copy_from_host(self, arr, data, stream=None):
        """Overwrite ``arr`` with the bytes of the host array ``data`` (ordered
        on ``stream``)."""
        raise NotImplementedError

    def fill_zero(self, arr):
        """Set every byte of ``arr`` to zero."""
        raise NotImplementedError

    def stream(self):
        """A new stream (None where the backend runs synchronously)."""
        raise NotImplementedError

    def synchronize(self, stream=None):
        """Wait for ``stream`` (None: everything) to finish."""
        raise NotImplementedError

    def capture(self, stream, issue):
        """Run ``issue()`` under stream capture on ``stream``; returns the
        instantiated graph (only where :attr:`can_capture`)."""
        raise RuntimeError(f"the {self.name} backend cannot capture graphs; run eagerly")

    def replay(self, graph, stream):
        """Launch a graph :meth:`capture` returned."""
        raise RuntimeError(f"the {self.name} backend cannot replay graphs; run eagerly")

    # ----------------------------------------------------- shared behaviour
    def empty(self, shape, dtype):
        return self.DeviceArray.empty(shape, dtype)

    def zeros(self, shape, dtype):
        return self.DeviceArray.zeros(shape, dtype)

    def from_numpy(self, a):
        return self.DeviceArray.from_numpy(np.ascontiguousarray(a))

    def ptr(self, arr) -> int:
        return arr.ptr

    def module(self, build, spec):
        """``build(spec)`` loaded here, once per (build, spec)."""
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

    def launch(self, fn, geometry, args, *, stream=None, pdl=False):
        """Launch ``fn`` with ``geometry`` (a
        :class:`~ptxgen.kernels.plan.LaunchGeometry`) and ``args``, a mapping
        of parameter name to value (the geometry adds its own; anything
        missing, unknown or of the wrong kind is refused naming the kernel
        and the parameter); its dynamic shared memory limit is raised to the
        geometry's first."""
        if geometry.shared:
            fn.require_dynamic_shared(geometry.shared)
        self.launch_positional(fn, geometry.grid, geometry.block, *named_args(fn, geometry, args),
                               shared=geometry.shared, stream=stream, pdl=pdl)

    def launch_positional(self, fn, grid, block, *args, shared=0, stream=None, pdl=False):
        """Launch ``fn`` with ``args`` in declaration order (the form the
        graph executor resolves to and :func:`recording` collects)."""
        rec = getattr(_recorder, "launches", None)
        if rec is not None:
            rec.append((fn, grid, block, args, shared, pdl))
            return
        self._launch(fn, grid, block, args, shared, stream, pdl)

    def workspace(self, key, shape, dtype, zero=False):
        """An array cached per ``key``, made on the first call (``zero``:
        filled with zero bytes, and the backend synchronized once, since
        its first user may be on another stream; so the first call for a
        key must come before a graph capture)."""
        with self._lock:
            ws = self._cache.get(("ws", key))
            if ws is None:
                ws = (self.zeros if zero else self.empty)(shape, dtype)
                if zero:
                    self.synchronize()
                self._cache[("ws", key)] = ws
            return ws

    def constant(self, key, make):
        """A device copy of the host array ``make()``, uploaded once per key."""
        with self._lock:
            a = self._cache.get(("const", key))
            if a is None:
                a = self._cache[("const", key)] = self.from_numpy(make())
            return a


class CudaBackend(Backend):
    """The GPU through :mod:`ptxgen.driver` (device 0 unless ``device``).

    Raises
    ------
    CUDAUnavailableError, CUDAError
        No usable driver or device (said when it is made, with what to do).
    """

    name = "cuda"
    can_capture = True

    def __init__(self, device=None):
        super().__init__()
        from .device import get_device
        self.device = get_device(device or 0)

    @functools.cached_property
    def DeviceArray(self):
        from .memory import DeviceArray
        return DeviceArray

    @functools.cached_property
    def target(self) -> str:
        return device_target(self.device)

    @functools.cached_property
    def sm_count(self) -> int:
        return int(self.device.sm_count)

    @functools.cached_property
    def device_name(self) -> str:
        return self.device.name

    def load(self, module):
        from .module import Module
        return Module.from_ptx(module, device=self.device)

    def empty(self, shape, dtype):
        return self.DeviceArray.empty(shape, dtype, device=self.device)

    def zeros(self, shape, dtype):
        return self.DeviceArray.zeros(shape, dtype, device=self.device)

    def from_numpy(self, a):
        return self.DeviceArray.from_numpy(np.ascontiguousarray(a), device=self.device)

    def _launch(self, fn, grid, block, args, shared, stream, pdl):
        _cuda_launch(fn, grid, block, *args, shared=shared, stream=stream, pdl=pdl)

    def tensor_map(self, desc):
        """The ``CUtensorMap`` of ``desc``, encoded once per description."""
        key = ("tmap", desc)
        with self._lock:
            enc = self._cache.get(key)
        if enc is None:
            from .tensor_map import encode_tiled
            enc = encode_tiled(desc)
            with self._lock:
                enc = self._cache.setdefault(key, enc)
        return enc

    def resident(self, fn, block, shared=0):
        """The driver's occupancy (None where the binding cannot say); the
        function's dynamic shared memory limit is raised to ``shared`` first,
        without which the driver counts no block past 48 KB."""
        if shared:
            fn.require_dynamic_shared(shared)
        try:
            return max(1, _occupancy(fn.handle, block, shared))
        except Exception:
            return None

    def to_numpy(self, arr, stream=None):
        return arr.to_numpy(stream=stream)

    def copy_from_host(self, arr, data, stream=None):
        arr.view(np.uint8, (data.nbytes,)).copy_from(data.view(np.uint8).reshape(-1),
                                                     stream=stream)

    def fill_zero(self, arr):
        arr.fill(0)

    def stream(self):
        from .stream import Stream
        return Stream()

    def synchronize(self, stream=None):
        if stream is not None:
            stream.synchronize()
        else:
            self.device.synchronize()

    def capture(self, stream, issue):
        from .graph import capture
        with capture(stream) as g:
            issue()
        return g.instantiate()

    def replay(self, graph, stream):
        graph.launch(stream)

class EmuBackend(Backend):
    """The CPU emulator (:mod:`ptxgen.emu`): synchronous, no graphs (callers
    run eagerly), no occupancy query.

    It stands for the device described here and nowhere else: an H100's
    target and SM count, so the ops, the model and the kernel tests build
    the kernels (the warpgroup GEMM and attention of sm_90a included) and
    choose the splits and grids an H100 gets.
    """

    name = "emu"
    can_capture = False
    #: the target kernels are built for on the emulator
    target = "sm_90"
    #: the SMs launches are sized for on the emulator
    sm_count = 132
    device_name = None

    #: parsed and compiled modules by PTX text and builder source lines, most
    #: recent last: parsing and compiling take far longer than emitting, and
    #: a model's kernels are the same each time a model of that shape loads
    _loaded: "OrderedDict[str, object]" = OrderedDict()
    MAX_LOADED = 256

    @functools.cached_property
    def DeviceArray(self):
        from ptxgen import emu
        return emu.DeviceArray

    def load(self, module):
        from ptxgen import emu
        if not hasattr(module, "to_ptx_and_sources"):       # text: parsed each time
            return emu.Module.from_ptx(module)
        text, sources = module.to_ptx_and_sources()
        key = text + "\0" + repr(sorted(sources.items()))
        loaded = EmuBackend._loaded
        with self._lock:
            mod = loaded.get(key)
            if mod is not None:
                loaded.move_to_end(key)
                return mod
        mod = emu.Module.from_ptx(text, sources=sources)
        with self._lock:
            loaded[key] = mod
            if len(loaded) > self.MAX_LOADED:
                loaded.popitem(last=False)
        return mod

    def _launch(self, fn, grid, block, args, shared, stream, pdl):
        from ptxgen import emu
        emu.launch(fn, grid, block, *args, shared=shared, pdl=pdl)

    def tensor_map(self, desc):
        """The emulator's encoding of the description (the 128 bytes its TMA
        reads back, as ``ptxgen.emu.launch`` passes a description)."""
        return desc.emu_bytes()

    def resident(self, fn, block, shared=0):
        return None

    def to_numpy(self, arr, stream=None):
        return arr.to_numpy()

    def copy_from_host(self, arr, data, stream=None):
        arr.copy_from(np.ascontiguousarray(data).view(arr.dtype).reshape(arr.shape))

    def fill_zero(self, arr):
        arr.copy_from(np.zeros(arr.shape, arr.dtype))

    def stream(self):
        return None

    def synchronize(self, stream=None):
        pass


_recorder = threading.local()


@contextlib.contextmanager
def recording():
    """Collect the launches issued inside (in this thread, by any backend)
    instead of running them.  Yields a list that receives ``(fn, grid,
    block, args, shared, pdl)`` per launch, ``args`` in declaration order;
    replaying them with :meth:`Backend.launch_positional` (e.g. into a CUDA
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


#: the backends by name
_KINDS = {"cuda": CudaBackend, "emu": EmuBackend}
BACKENDS = tuple(_KINDS)
_backends: dict = {}


def get_backend(name: str = "auto") -> Backend:
    """The process's :class:`Backend` named ``name``: ``"cuda"``, ``"emu"``,
    or ``"auto"`` (the GPU when one is usable, else the emulator)."""
    if name == "auto":
        from .errors import is_available
        name = "cuda" if is_available() else "emu"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; use {', '.join(BACKENDS)} or auto")
    b = _backends.get(name)
    if b is None:
        b = _backends.setdefault(name, _KINDS[name]())
    return b
