"""Backends for the executor: the GPU (through ptxgen.driver) or the CPU
emulator (ptxgen.emu), behind one small interface.

Both load a ``ptxgen.Module``, allocate arrays, copy to and from the host
and launch with the same argument conventions; only the CUDA backend can
capture and replay graphs.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

__all__ = ["CudaBackend", "EmuBackend", "get_backend"]


class CudaBackend:
    """The GPU through ``ptxgen.driver``."""

    name = "cuda"
    can_capture = True

    def __init__(self, device=None):
        from ptxgen import driver
        self.d = driver
        self.device = driver.get_device(device or 0)

    def load(self, module):
        return self.d.Module.from_ptx(module, device=self.device)

    def empty(self, shape, dtype):
        return self.d.DeviceArray.empty(shape, dtype, device=self.device)

    def from_numpy(self, a):
        return self.d.DeviceArray.from_numpy(a, device=self.device)

    def to_numpy(self, arr):
        return arr.to_numpy()

    def fill_zero(self, arr):
        arr.fill(0)

    def copy_from_host(self, arr, data, stream=None):
        arr.view(np.uint8, (data.nbytes,)).copy_from(data.view(np.uint8), stream=stream)

    def ptr(self, arr) -> int:
        return arr.ptr

    def launch(self, fn, grid, block, *args, shared=0, stream=None, pdl=False):
        self.d.launch(fn, grid, block, *args, shared=shared, stream=stream, pdl=pdl)

    def stream(self):
        return self.d.Stream()

    def synchronize(self, stream=None):
        if stream is not None:
            stream.synchronize()
        else:
            self.device.synchronize()

    def capture(self, stream, issue):
        with self.d.capture(stream) as g:
            issue()
        return g.instantiate()

    def replay(self, graph_exec, stream):
        graph_exec.launch(stream)

    def tensor_map(self, desc):
        """The ``CUtensorMap`` launch argument of a :class:`ptxgen.tensor_map.TensorMap`."""
        from .tensor_map import encode_tiled
        return encode_tiled(desc)


class EmuBackend:
    """The CPU emulator (``ptxgen.emu``); no graphs, so replay runs eagerly."""

    name = "emu"
    can_capture = False

    #: parsed and compiled modules by PTX text and builder source lines, most
    #: recent last: parsing and compiling take far longer than emitting, and
    #: a model's kernels are the same each time a model of that shape loads
    _loaded: "OrderedDict[str, object]" = OrderedDict()
    MAX_LOADED = 256

    def __init__(self):
        from ptxgen import emu
        self.e = emu

    def load(self, module):
        if not hasattr(module, "to_ptx_and_sources"):       # text: parsed each time
            return self.e.Module.from_ptx(module)
        text, sources = module.to_ptx_and_sources()
        key = text + "\0" + repr(sorted(sources.items()))
        loaded = EmuBackend._loaded
        mod = loaded.get(key)
        if mod is None:
            mod = self.e.Module.from_ptx(text, sources=sources)
            loaded[key] = mod
            if len(loaded) > self.MAX_LOADED:
                loaded.popitem(last=False)
        else:
            loaded.move_to_end(key)
        return mod

    def empty(self, shape, dtype):
        return self.e.DeviceArray.empty(shape, dtype)

    def from_numpy(self, a):
        return self.e.DeviceArray.from_numpy(a)

    def to_numpy(self, arr):
        return arr.to_numpy()

    def fill_zero(self, arr):
        arr.copy_from(np.zeros(arr.shape, arr.dtype))

    def copy_from_host(self, arr, data, stream=None):
        arr.copy_from(data.view(arr.dtype).reshape(arr.shape))

    def ptr(self, arr) -> int:
        return arr.ptr

    def launch(self, fn, grid, block, *args, shared=0, stream=None, pdl=False):
        self.e.launch(fn, grid, block, *args, shared=shared, pdl=pdl)

    def stream(self):
        return None

    def synchronize(self, stream=None):
        pass

    def tensor_map(self, desc):
        """The emulator takes a tensor map's description as its argument."""
        return desc

    def capture(self, stream, issue):
        raise RuntimeError("the CPU emulator has no CUDA graphs; run eagerly")

    def replay(self, graph_exec, stream):
        raise RuntimeError("the CPU emulator has no CUDA graphs; run eagerly")


def get_backend(name: str = "auto"):
    """``"cuda"``, ``"emu"``, or ``"auto"`` (the GPU when one is usable)."""
    if name == "cuda":
        return CudaBackend()
    if name == "emu":
        return EmuBackend()
    if name != "auto":
        raise ValueError(f"unknown backend {name!r}; use cuda, emu or auto")
    from ptxgen import driver
    if driver.is_available():
        return CudaBackend()
    return EmuBackend()
