"""Loaded modules and their kernels.

``Module.from_ptx(text_or_ptxgen_module)`` looks in the in-process cache, then
the on-disk cubin cache, and only then compiles: with ptxas where it is found
(the cubin then goes to the disk cache), else with the driver's JIT. Both
compile the module as a whole program (driver/jit.py says why not the
driver's linker). Kernels come out as
:class:`Function` objects that know their parameter list (parsed from the PTX
signature by :func:`ptxgen.abi.parse_entries`), their resource use, and how to
pack their arguments.
"""

from __future__ import annotations

import ctypes
import re
import threading
import weakref

from ptxgen.abi import ArgPacker, parse_entries
from ptxgen.ptxas import PtxasError

from . import cache as _cache
from .device import Device, call_in_context, driver_version, get_device
from .errors import CUDAError, check, cuda
from .jit import (compile_cubin, cubin_compiler, load_cubin, load_ptx, normalize_options,
                  ptx_text, ptxas_arch, refuse_compiler)
from .release import release

__all__ = ["Function", "Module", "function_for_handle"]

# CUfunction address -> Function, so graph nodes can be mapped back to our objects
functions_by_handle: "weakref.WeakValueDictionary[int, Function]" = weakref.WeakValueDictionary()


def function_for_handle(handle) -> "Function | None":
    """The live :class:`Function` whose ``CUfunction`` is ``handle``, if any."""
    return functions_by_handle.get(int(handle))


class Module:
    """A module loaded into a device's context. Create with :meth:`from_ptx`.

    Attributes
    ----------
    device : Device
    ptx : str
        The PTX text it was loaded from.
    options : dict
        JIT options used.
    entries : dict[str, list[ParamInfo]]
        Kernels of the module and their parameters.
    source : str
        ``"memory"``, ``"disk"`` or ``"jit"``: where this load came from.
    info_log : str
        The JIT info log (empty when loaded from a cached cubin).
    """

    __slots__ = ("device", "ptx", "options", "entries", "handle", "source", "info_log",
                 "_key", "_functions", "_finalizer", "__weakref__")

    def __init__(self, device: Device, handle, ptx: str, options: dict, source: str,
                 info_log: str = "", key=None, entries=None):
        self.device = device
        self.handle = handle
        self.ptx = ptx
        self.options = options
        self.entries = parse_entries(ptx) if entries is None else entries
        self.source = source
        self.info_log = info_log
        self._key = key
        self._functions: dict[str, Function] = {}
        self._finalizer = weakref.finalize(self, release, f"cuModuleUnload({handle})",
                                           call_in_context, device.context, "cuModuleUnload", handle)

    @classmethod
    def from_ptx(cls, ptx, *, device=None, options=None, cache: bool = True) -> "Module":
        """Load PTX (text, bytes, or an object with ``to_ptx()``) for ``device``.

        Parameters
        ----------
        ptx : str, bytes or object with ``to_ptx()``
            The module text.
        device : Device or int, optional
            Defaults to the current device (0 unless another was activated);
            the JIT targets that device's compute capability.
        options : dict, optional
            JIT options: ``max_registers``, ``opt_level``, ``line_info``, ``debug_info``.
        cache : bool
            Use the in-process and on-disk caches (also disabled by ``PTXGEN_NO_CACHE=1``).

        Returns
        -------
        Module

        Raises
        ------
        PTXJitError
            The JIT rejected the text; the message quotes the JIT log and the
            offending PTX line(s).
        """
        dev = get_device(device)
        text = ptx_text(ptx)
        opts = normalize_options(options)
        use_cache = cache and _cache.cache_enabled()
        if not use_cache:
            handle, info = load_ptx(text, opts)
            return cls(dev, handle, text, opts, "jit", info)

        mkey = (dev.ordinal, _cache.module_key(text, opts))
        mod = _cache.memory_cache.get(mkey)
        if mod is not None and mod.handle is not None:
            return mod

        entries = parse_entries(text)
        handle, source, info = None, "jit", ""
        tool = cubin_compiler()
        if tool is not None:
            exe, ptxas_release = tool
            disk = _cache.DiskCache()
            dkey = _cache.disk_key(text, dev.target, driver_version(), opts,
                                   compiler=ptxas_release)
            cubin = disk.get(dkey)
            if cubin is not None:
                try:
                    handle, source = load_cubin(cubin), "disk"
                except CUDAError:
                    disk.invalidate(dkey)  # valid file, but the driver refuses it: rebuild
                    disk.corrupt_count += 1
            if handle is None:
                try:
                    cubin, info = compile_cubin(text, opts, ptxas_arch(text, dev.target), exe)
                except PtxasError:
                    cubin = None      # the driver's JIT decides, and reports its own log
                if cubin is not None:
                    try:
                        handle = load_cubin(cubin)
                    except CUDAError:  # a ptxas newer than the driver: not again this process
                        refuse_compiler()
                    else:
                        disk.put(dkey, cubin, {
                            "ptx_sha256": _cache.ptx_hash(text),
                            "arch": dev.target,
                            "driver_version": driver_version(),
                            "compiler": ptxas_release,
                            "options": opts,
                            "kernels": sorted(entries),
                        })
        if handle is None:            # no ptxas, or it or the driver refused: the driver's JIT
            handle, info = load_ptx(text, opts)
        mod = cls(dev, handle, text, opts, source, info, key=mkey, entries=entries)
        return _cache.memory_cache.put(mkey, mod)

    # ------------------------------------------------------------------ kernels

    @property
    def names(self) -> list[str]:
        """Names of the kernels (``.entry``) in this module."""
        return list(self.entries)

    def function(self, name: str) -> "Function":
        """The kernel ``name`` (cached per module).

        Raises
        ------
        KeyError
            No ``.entry`` of that name; the message lists the ones there are.
        """
        f = self._functions.get(name)
        if f is None:
            if self.handle is None:
                raise CUDAError(f"module was unloaded; cannot get kernel {name!r}")
            if name not in self.entries:
                raise KeyError(f"no kernel {name!r} in this module; it has: {', '.join(self.entries) or '(none)'}")
            self.device.activate()
            h = check(cuda().cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})")
            f = Function(self, name, h, self.entries[name])
            self._functions[name] = f
        return f

    __getitem__ = function

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def unload(self) -> None:
        """Unload now (also drops it from the in-process cache); its functions become unusable."""
        if self.handle is None:
            return
        if self._key is not None:
            _cache.memory_cache.pop(self._key, self)
        self.device.activate()
        self._finalizer()
        self.handle = None
        for f in self._functions.values():
            f.handle = None
        self._functions.clear()

    def __repr__(self) -> str:
        state = "unloaded" if self.handle is None else self.source
        return f"<Module [{', '.join(self.entries)}] on {self.device.target} ({state})>"


_ATTRS = {
    "num_regs": "NUM_REGS",
    "local_size_bytes": "LOCAL_SIZE_BYTES",
    "shared_size_bytes": "SHARED_SIZE_BYTES",
    "const_size_bytes": "CONST_SIZE_BYTES",
    "max_threads_per_block": "MAX_THREADS_PER_BLOCK",
    "max_dynamic_shared": "MAX_DYNAMIC_SHARED_SIZE_BYTES",
    "ptx_version": "PTX_VERSION",
    "binary_version": "BINARY_VERSION",
}


def _entry_waits(ptx: str, name: str) -> bool:
    """Whether the body of entry ``name`` in ``ptx`` has ``griddepcontrol.wait``."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(", ptx)
    if m is None:
        return False
    end = ptx.find(".entry", m.end())
    return "griddepcontrol.wait" in ptx[m.end(): end if end >= 0 else len(ptx)]


def _entry_cluster(ptx: str, name: str):
    """Entry ``name``'s ``.reqnctapercluster`` as ``(x, y, z)``, or None."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\([^)]*\)([^{]*)\{", ptx)
    if m is None:
        return None
    c = re.search(r"\.reqnctapercluster\s+([\d,\s]+)", m.group(1))
    if c is None:
        return None
    dims = [int(v) for v in c.group(1).replace(",", " ").split()]
    return tuple(dims + [1] * (3 - len(dims)))


class Function:
    """One kernel of a loaded :class:`Module`.

    Attributes
    ----------
    name : str
    params : tuple[ParamInfo, ...]
        Declared parameters, from the PTX signature.
    num_regs, local_size_bytes, shared_size_bytes, const_size_bytes : int
        Resource use reported by the driver (``cuFuncGetAttribute``).
    max_threads_per_block : int
        Largest block this kernel can be launched with (registers included).
    max_dynamic_shared : int
        Dynamic shared memory a launch may request now; raise it with
        :meth:`set_max_dynamic_shared`.
    ptx_version, binary_version : int
        e.g. 80 and 90.
    cluster : tuple of int or None
        The kernel's ``.reqnctapercluster`` (x, y, z): it runs in
        thread-block clusters of that shape, and a launch's grid must be a
        multiple of it (checked before the driver is called).
    """

    __slots__ = ("module", "name", "handle", "params", "packer", "num_regs", "local_size_bytes",
                 "shared_size_bytes", "const_size_bytes", "max_threads_per_block",
                 "max_dynamic_shared", "ptx_version", "binary_version",
                 "waits_for_grids", "cluster", "_pdl_config",
                 "_buf", "_ptrs", "_kp", "_owner", "__weakref__")

    def __init__(self, module: Module, name: str, handle, params):
        self.module = module
        self.name = name
        self.handle = handle
        self.params = tuple(params)
        self.packer = ArgPacker(name, self.params)
        d = cuda()
        A = d.CUfunction_attribute
        for attr, enum in _ATTRS.items():
            v = check(d.cuFuncGetAttribute(getattr(A, "CU_FUNC_ATTRIBUTE_" + enum), handle),
                      f"cuFuncGetAttribute({enum})")
            setattr(self, attr, int(v))
        self._init_param_buffer()
        self.waits_for_grids = _entry_waits(module.ptx, name)
        self.cluster = _entry_cluster(module.ptx, name)
        self._pdl_config = None
        functions_by_handle[int(handle)] = self

    def pdl_config(self):
        """The ``CUlaunchConfig`` (programmatic stream serialization allowed)
        that ``launch(..., pdl=True)`` fills in; made once per kernel."""
        if self._pdl_config is None:
            d = cuda()
            attr = d.CUlaunchAttribute()
            attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg = d.CUlaunchConfig()
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            self._pdl_config = cfg
        return self._pdl_config

    def _init_param_buffer(self) -> None:
        # A persistent param buffer and its void* array: launch() packs into it and the
        # driver copies it during cuLaunchKernel. Only the thread that made the Function
        # uses it (cuLaunchKernel releases the GIL); other threads get a fresh pair.
        self._buf, self._ptrs, self._kp = self.param_buffer()
        self._owner = threading.get_ident()

    def param_buffer(self):
        """A new ``(buffer, void* array, kernelParams address)`` for this kernel's parameters."""
        buf = ctypes.create_string_buffer(max(self.packer.size, 8))
        base = ctypes.addressof(buf)
        n = len(self.params)
        ptrs = (ctypes.c_void_p * max(n, 1))(*[base + off for off in self.packer.offsets])
        return buf, ptrs, (ctypes.addressof(ptrs) if n else 0)

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Allow launches with up to ``nbytes`` of dynamic shared memory.

        Raises
        ------
        ValueError
            ``nbytes`` plus the static shared memory exceeds the device's opt-in maximum.
        """
        dev = self.module.device
        limit = dev.shared_per_block_optin - self.shared_size_bytes
        if not isinstance(nbytes, int) or not 0 <= nbytes <= limit:
            raise ValueError(
                f"{self.name}: dynamic shared memory must be in [0, {limit}] bytes on {dev.name} "
                f"(opt-in max {dev.shared_per_block_optin} minus {self.shared_size_bytes} static), "
                f"got {nbytes!r}"
            )
        d = cuda()
        dev.activate()
        check(d.cuFuncSetAttribute(self.handle,
                                   d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                   nbytes), "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        self.max_dynamic_shared = nbytes

    def require_dynamic_shared(self, nbytes: int) -> None:
        """Raise the dynamic shared memory limit to ``nbytes`` if it is lower
        (:meth:`set_max_dynamic_shared`; launches past 48 KB need the opt-in)."""
        if nbytes > self.max_dynamic_shared:
            self.set_max_dynamic_shared(nbytes)

    def attributes(self) -> dict:
        """The resource attributes as a dict."""
        return {k: getattr(self, k) for k in _ATTRS}

    def __call__(self, grid, block, *args, shared: int = 0, stream=None) -> None:
        """Same as ``launch(self, grid, block, *args, shared=shared, stream=stream)``."""
        from .launch import launch

        launch(self, grid, block, *args, shared=shared, stream=stream)

    def __repr__(self) -> str:
        return (f"<Function {self.packer.signature()} regs={self.num_regs} "
                f"shared={self.shared_size_bytes} local={self.local_size_bytes}>")
