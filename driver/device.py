"""Devices and their primary contexts.

``get_device(0)`` retains the device's primary context (the one the CUDA
runtime, torch and cupy also use) and makes it current in the calling thread.
The attributes a kernel author needs are read once and cached.
"""

from __future__ import annotations

import threading

from .errors import check, cuda, init

__all__ = ["Device", "call_in_context", "device_count", "driver_version", "get_device"]

_devices: dict[int, "Device"] = {}
_devices_lock = threading.Lock()
_tls = threading.local()


class Device:
    """One GPU and its primary context. Get it with :func:`get_device`.

    Attributes
    ----------
    ordinal : int
        Device index as the driver numbers them.
    handle : CUdevice
        Driver handle.
    context : CUcontext
        The retained primary context.
    """

    __slots__ = ("ordinal", "handle", "context", "_attrs", "_name", "__weakref__")

    def __init__(self, ordinal: int = 0):
        init()
        d = cuda()
        n = check(d.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= ordinal < n:
            raise ValueError(f"device ordinal {ordinal} out of range: {n} device(s) present")
        self.ordinal = ordinal
        self.handle = check(d.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = check(d.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self._attrs: dict[str, int] = {}
        self._name = None
        # the primary context is released by the driver at process exit; releasing it
        # earlier would invalidate modules and arrays that torch/cupy may still share.

    def __repr__(self) -> str:
        return f"<Device {self.ordinal}: {self.name} ({self.target})>"

    # ------------------------------------------------------------------ context

    def activate(self, force: bool = False) -> "Device":
        """Make this device's primary context current in the calling thread.

        Skips the driver call when this thread already activated it, unless ``force``.
        """
        if force or getattr(_tls, "ordinal", None) != self.ordinal:
            check(cuda().cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
            _tls.ordinal = self.ordinal
        return self

    def synchronize(self) -> None:
        """Wait for all work on this device's context (``cuCtxSynchronize``)."""
        self.activate()
        check(cuda().cuCtxSynchronize(), "cuCtxSynchronize")

    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` device memory in bytes (``cuMemGetInfo``)."""
        self.activate()
        free, total = check(cuda().cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    # ------------------------------------------------------------------ attributes

    def attribute(self, name: str) -> int:
        """A ``CU_DEVICE_ATTRIBUTE_<NAME>`` value, e.g. ``attribute("MULTIPROCESSOR_COUNT")``."""
        v = self._attrs.get(name)
        if v is None:
            d = cuda()
            enum = getattr(d.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name)
            v = int(check(d.cuDeviceGetAttribute(enum, self.handle), f"cuDeviceGetAttribute({name})"))
            self._attrs[name] = v
        return v

    @property
    def name(self) -> str:
        """Marketing name, e.g. ``"NVIDIA H100 80GB HBM3"``."""
        if self._name is None:
            raw = check(cuda().cuDeviceGetName(256, self.handle), "cuDeviceGetName")
            self._name = raw.split(b"\0", 1)[0].decode(errors="replace").strip()
        return self._name

    @property
    def compute_capability(self) -> tuple[int, int]:
        """``(major, minor)``."""
        return (self.attribute("COMPUTE_CAPABILITY_MAJOR"), self.attribute("COMPUTE_CAPABILITY_MINOR"))

    @property
    def target(self) -> str:
        """The ptxgen target name for this device, e.g. ``"sm_90"``."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @property
    def sm_count(self) -> int:
        """Number of streaming multiprocessors."""
        return self.attribute("MULTIPROCESSOR_COUNT")

    @property
    def l2_bytes(self) -> int:
        """L2 cache size in bytes."""
        return self.attribute("L2_CACHE_SIZE")

    @property
    def shared_per_block(self) -> int:
        """Shared memory a block gets without opting in (usually 48 KiB)."""
        return self.attribute("MAX_SHARED_MEMORY_PER_BLOCK")

    @property
    def shared_per_block_optin(self) -> int:
        """Largest shared memory per block after ``Function.set_max_dynamic_shared``."""
        return self.attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")

    @property
    def shared_per_sm(self) -> int:
        """Shared memory per multiprocessor in bytes."""
        return self.attribute("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR")

    @property
    def max_threads_per_block(self) -> int:
        """Device limit on threads per block (a function's own limit may be lower)."""
        return self.attribute("MAX_THREADS_PER_BLOCK")

    @property
    def max_block_dims(self) -> tuple[int, int, int]:
        """Largest block extent in x, y, z."""
        return tuple(self.attribute(f"MAX_BLOCK_DIM_{a}") for a in "XYZ")

    @property
    def max_grid_dims(self) -> tuple[int, int, int]:
        """Largest grid extent in x, y, z."""
        return tuple(self.attribute(f"MAX_GRID_DIM_{a}") for a in "XYZ")

    @property
    def warp_size(self) -> int:
        """Threads per warp (32)."""
        return self.attribute("WARP_SIZE")

    @property
    def memory_clock_khz(self) -> int | None:
        """Peak memory clock in kHz, or None where the driver no longer reports it."""
        try:
            return self.attribute("MEMORY_CLOCK_RATE") or None
        except Exception:
            return None

    @property
    def bus_width_bits(self) -> int:
        """Global memory bus width in bits."""
        return self.attribute("GLOBAL_MEMORY_BUS_WIDTH")

    @property
    def bandwidth_gbps(self) -> float | None:
        """Theoretical DRAM bandwidth in GB/s: 2 (double data rate) x clock x bus width / 8."""
        clk = self.memory_clock_khz
        if not clk:
            return None
        return 2.0 * clk * 1e3 * self.bus_width_bits / 8 / 1e9

    @property
    def total_memory(self) -> int:
        """Device memory in bytes."""
        return int(check(cuda().cuDeviceTotalMem(self.handle), "cuDeviceTotalMem"))

    def summary(self) -> dict:
        """All of the above as a plain dict (for reports and benchmark JSON)."""
        return {
            "name": self.name,
            "ordinal": self.ordinal,
            "target": self.target,
            "compute_capability": self.compute_capability,
            "sm_count": self.sm_count,
            "l2_bytes": self.l2_bytes,
            "shared_per_block": self.shared_per_block,
            "shared_per_block_optin": self.shared_per_block_optin,
            "shared_per_sm": self.shared_per_sm,
            "max_threads_per_block": self.max_threads_per_block,
            "memory_clock_khz": self.memory_clock_khz,
            "bus_width_bits": self.bus_width_bits,
            "bandwidth_gbps": self.bandwidth_gbps,
            "total_memory": self.total_memory,
            "driver_version": driver_version(),
        }


def device_count() -> int:
    """Number of CUDA devices (raises :class:`CUDAUnavailableError` without a driver)."""
    init()
    return int(check(cuda().cuDeviceGetCount(), "cuDeviceGetCount"))


_driver_version: int | None = None


def driver_version() -> int:
    """``cuDriverGetVersion``, e.g. 12080 for CUDA 12.8."""
    global _driver_version
    if _driver_version is None:
        init()
        _driver_version = int(check(cuda().cuDriverGetVersion(), "cuDriverGetVersion"))
    return _driver_version


def call_in_context(context, call: str, *args) -> None:
    """Call the driver function named ``call`` with ``context`` current on this thread.

    The context is pushed and popped again, so the thread's own current
    context is left as it was. This is how resources are released
    (:mod:`ptxgen.driver.release`): on whichever thread drops the last
    reference or ends a capture, which need not be one that uses ``context``.

    Raises
    ------
    CUDAError
        The push or the call failed.
    """
    d = cuda()
    check(d.cuCtxPushCurrent(context), "cuCtxPushCurrent")
    try:
        ret = getattr(d, call)(*args)
        if ret[0]:
            check(ret, f"{call}({', '.join(map(str, args))})")
    finally:
        d.cuCtxPopCurrent()


def get_device(ordinal: int | "Device" | None = None) -> Device:
    """The :class:`Device` for ``ordinal`` (default 0), current in the calling thread.

    Raises
    ------
    CUDAUnavailableError
        No driver library or no GPU.
    """
    if isinstance(ordinal, Device):
        return ordinal.activate()
    if ordinal is None:
        ordinal = getattr(_tls, "ordinal", None)
        if ordinal is None:
            ordinal = 0
    dev = _devices.get(ordinal)
    if dev is None:
        with _devices_lock:
            dev = _devices.get(ordinal)
            if dev is None:
                dev = Device(ordinal)
                _devices[ordinal] = dev
    return dev.activate()
