"""Helpers for the decode-kernel tests: run a family's PTX on the ``backend``
fixture (``"emu"`` or ``"cuda"``, from tests/conftest.py) or on a GPU."""

from __future__ import annotations

import attrs
import numpy as np
import pytest


def _api(backend):
    """The module with ``Module``, ``launch`` and ``DeviceArray`` for ``backend``."""
    if all(hasattr(backend, a) for a in ("Module", "launch", "DeviceArray")):
        return backend
    name = getattr(backend, "name", backend)
    if name == "emu":
        import ptxgen.emu as api
    elif name in ("cuda", "gpu"):
        import ptxgen.driver as api
    else:
        raise ValueError(f"unknown backend {backend!r}")
    return api


class Runner:
    """Build, load and launch kernels of a spec on one backend."""

    def __init__(self, backend):
        self.api = _api(backend)
        self.is_gpu = self.api.__name__.endswith("driver")
        self._mods = {}

    def target(self):
        if self.is_gpu:
            from ptxgen.driver.ops_decode import device_target
            return device_target()
        return "sm_80"

    def function(self, build, spec, name=None):
        spec = attrs.evolve(spec, target=self.target())
        key = (build, spec)
        if key not in self._mods:
            self._mods[key] = self.api.Module.from_ptx(build(spec).to_ptx())
        return self._mods[key].function(name or spec.kernel_name)

    def launch(self, fn, grid, block, *args):
        self.api.launch(fn, grid, block, *args)

    def array(self, host):
        return self.api.DeviceArray.from_numpy(np.ascontiguousarray(host))

    def poisoned(self, shape, dtype=np.float32):
        """A device array filled with NaN (or 0x7F bytes for integers)."""
        dt = np.dtype(dtype)
        host = (np.full(shape, np.nan, dtype=dt) if dt.kind == "f"
                else np.full(shape, -0x7F7F7F7F if dt.kind == "i" else 0x7F7F7F7F, dtype=dt))
        return self.array(host)

    def get(self, arr):
        return arr.to_numpy()


@pytest.fixture
def run(backend):
    return Runner(backend)


@pytest.fixture
def gpu_run():
    """A Runner on the GPU, or a skip when there is none."""
    from ptxgen.driver import is_available
    if not is_available():
        pytest.skip("no NVIDIA driver / GPU available")
    return Runner("cuda")

