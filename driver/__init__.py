"""cuda-python driver layer: devices, modules, launches, arrays, streams, graphs.

Importing this package needs no GPU and no driver library; the first call
that needs the driver loads it and raises :class:`CUDAUnavailableError` with
what to install when it is missing.

>>> from ptxgen.driver import Module, DeviceArray, launch      # doctest: +SKIP
>>> mod = Module.from_ptx(ptx_text)                             # doctest: +SKIP
>>> launch(mod["vadd"], blocks, 256, a, b, c, n)                # doctest: +SKIP
"""

from ptxgen.abi import LaunchArgumentError, ParamInfo

from .cache import DiskCache, cache_dir, cache_enabled
from .device import Device, device_count, driver_version, get_device
from .errors import (
    CUDAError,
    CUDAUnavailableError,
    GraphCaptureError,
    LaunchConfigError,
    PTXJitError,
    check,
    init,
    is_available,
)
from .graph import Graph, GraphExec, KernelNode, capture
from .launch import launch
from .memory import DeviceArray, as_device_array, pinned_empty, pinned_zeros
from .module import Function, Module
from .release import hold_releases
from .stream import Event, Stream, elapsed_ms

__all__ = [
    "CUDAError",
    "CUDAUnavailableError",
    "Device",
    "DeviceArray",
    "DiskCache",
    "Event",
    "Function",
    "Graph",
    "GraphCaptureError",
    "GraphExec",
    "KernelNode",
    "LaunchArgumentError",
    "LaunchConfigError",
    "Module",
    "PTXJitError",
    "ParamInfo",
    "Stream",
    "as_device_array",
    "cache_dir",
    "cache_enabled",
    "capture",
    "check",
    "device_count",
    "driver_version",
    "elapsed_ms",
    "get_device",
    "hold_releases",
    "init",
    "is_available",
    "launch",
    "pinned_empty",
    "pinned_zeros",
]
