"""Helpers for the decode-kernel tests: run a family's PTX on the emulator,
on a GPU, or on both compared (the ``run`` fixture), launched as the ops
launch them: a :class:`~ptxgen.kernels.plan.LaunchGeometry` and the
arguments by parameter name."""

from __future__ import annotations

import json
import os

import attrs
import numpy as np
import pytest


class Runner:
    """Build, load and launch kernels of a spec on one backend ("emu" or
    "cuda": :func:`ptxgen.driver.backend.get_backend`), for the backend's
    target."""

    def __init__(self, name):
        from ptxgen.driver.backend import get_backend
        self.backend = get_backend(name)
        self._mods = {}

    def target(self):
        return self.backend.target

    def function(self, build, spec, name=None):
        from ptxgen.kernels.spec_fields import has_griddepcontrol
        tgt = self.target()
        # a spec built for PDL runs on a target without griddepcontrol as the
        # same kernel without it
        pdl = getattr(spec, "pdl", False) and has_griddepcontrol(tgt)
        change = dict(target=tgt, **({"pdl": pdl} if hasattr(spec, "pdl") else {}))
        # a plan (spec + config) changes its fields through its own evolve
        spec = spec.evolve(**change) if hasattr(spec, "evolve") else attrs.evolve(spec, **change)
        key = (build, spec)
        if key not in self._mods:
            self._mods[key] = self.backend.load(build(spec))
        return self._mods[key].function(name or spec.kernel_name)

    def launch(self, fn, geometry, args):
        """``fn`` launched with ``geometry`` and ``args`` by parameter name."""
        self.backend.launch(fn, geometry, args)

    def array(self, host):
        return self.backend.DeviceArray.from_numpy(np.ascontiguousarray(host))

    def poisoned(self, shape, dtype=np.float32):
        """A device array filled with NaN (or 0x7F bytes for integers)."""
        dt = np.dtype(dtype)
        host = (np.full(shape, np.nan, dtype=dt) if dt.kind == "f"
                else np.full(shape, -0x7F7F7F7F if dt.kind == "i" else 0x7F7F7F7F, dtype=dt))
        return self.array(host)

    def get(self, arr):
        return arr.to_numpy()


class DualRunner:
    """Runs every launch on the emulator and on the GPU with the same inputs;
    ``get`` compares the two results and returns the GPU's.

    Integer results and exactly rounded float results must be bit-identical;
    kernels that use ``.approx`` functions may differ by a few ulps, so the
    comparison allows a relative difference of 1e-5 (of the largest value),
    or for float16 results one f16 ulp of the element (an f32 value a few
    ulps apart may round to the neighbouring f16), over the finite values
    (NaNs and infinities must be the same on both), and records how many
    elements were bit-identical.
    """

    def __init__(self):
        self.emu = Runner("emu")
        self.gpu = Runner("cuda")

    def target(self):
        return self.gpu.target()

    def function(self, build, spec, name=None):
        return (self.emu.function(build, spec, name), self.gpu.function(build, spec, name))

    def launch(self, fn, geometry, args):
        self.emu.launch(fn[0], geometry,
                        {n: a.emu if isinstance(a, _Pair) else a for n, a in args.items()})
        self.gpu.launch(fn[1], geometry,
                        {n: a.gpu if isinstance(a, _Pair) else a for n, a in args.items()})

    def array(self, host):
        return _Pair(self.emu.array(host), self.gpu.array(host))

    def poisoned(self, shape, dtype=np.float32):
        return _Pair(self.emu.poisoned(shape, dtype), self.gpu.poisoned(shape, dtype))

    def get(self, arr):
        e, g = arr.emu.to_numpy(), arr.gpu.to_numpy()
        same = (e.view(np.uint8) == g.view(np.uint8)).reshape(e.shape[:1] + (-1,)).all(axis=-1) \
            if e.ndim else np.array([e.tobytes() == g.tobytes()])
        exact = float(np.mean(same))
        if e.dtype.kind == "f":
            assert np.array_equal(np.isnan(e), np.isnan(g)), "emulator and GPU differ in NaNs"
            inf = np.isinf(g)
            assert np.array_equal(np.isinf(e), inf) and np.array_equal(e[inf], g[inf]), \
                "emulator and GPU differ in infinities"
            finite = np.isfinite(g)
            ef, gf = e[finite].astype(np.float64), g[finite].astype(np.float64)
            scale = max(float(np.max(np.abs(gf))) if gf.size else 0.0, 1e-30)
            rel = float(np.max(np.abs(ef - gf)) / scale) if gf.size else 0.0
            if e.dtype == np.float16 and rel > 1e-5:
                ulp = np.spacing(np.abs(g[finite])).astype(np.float64)
                far = np.abs(ef - gf) > np.maximum(1e-5 * scale, ulp)
                assert not far.any(), (f"emulator and GPU differ by more than one f16 ulp: max "
                                       f"relative difference {rel:.3g}")
            else:
                assert rel <= 1e-5, f"emulator and GPU differ: max relative difference {rel:.3g}"
        else:
            rel = 0.0
            assert exact == 1.0, "emulator and GPU integer results differ"
        _COMPARISONS.append({"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0],
                             "dtype": str(e.dtype), "elements": int(e.size),
                             "bit_identical_fraction": exact, "max_rel_diff": rel})
        return g


class _Pair:
    """The same array on the emulator and on the GPU."""

    def __init__(self, emu, gpu):
        self.emu, self.gpu = emu, gpu

    def view(self, *a, **kw):
        return _Pair(self.emu.view(*a, **kw), self.gpu.view(*a, **kw))

    def __getattr__(self, name):       # shape, dtype, size ... (same on both)
        return getattr(self.gpu, name)


_COMPARISONS: list = []


def pytest_sessionfinish(session, exitstatus):
    """Write the emulator-against-GPU comparisons to $PTXGEN_EMU_GPU_REPORT
    (under pytest-xdist each worker writes its own, ``<file>.gw0`` ...)."""
    out = os.environ.get("PTXGEN_EMU_GPU_REPORT")
    if out and _COMPARISONS:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        out = f"{out}.{worker}" if worker else out
        with open(out, "w") as f:
            json.dump(_COMPARISONS, f, indent=1)


@pytest.fixture(params=["emu", pytest.param("cuda", marks=pytest.mark.gpu),
                        pytest.param("emu_vs_cuda", marks=pytest.mark.gpu)])
def run(request):
    """A Runner on the emulator, on the GPU, or on both with their outputs
    compared (the GPU cases skip cleanly where there is no GPU)."""
    if request.param != "emu":
        from backends import cuda_available
        if not cuda_available():
            pytest.skip("no NVIDIA GPU / driver available")
    if request.param == "emu_vs_cuda":
        return DualRunner()
    return Runner(request.param)


@pytest.fixture
def gpu_run():
    """A Runner on the GPU, or a skip when there is none."""
    from ptxgen.driver import is_available
    if not is_available():
        pytest.skip("no NVIDIA driver / GPU available")
    return Runner("cuda")

