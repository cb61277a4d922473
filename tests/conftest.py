"""Test-wide fixtures: the ``backend`` fixture runs a test on the CPU
emulator always and on a GPU (through ptxgen.driver) when one is present;
the GPU case is skipped cleanly, never errors, where there is none."""

import pytest

from backends import Backend, cuda_available

_CUDA = None


def _have_cuda():
    global _CUDA
    if _CUDA is None:
        _CUDA = cuda_available()
    return _CUDA


@pytest.fixture(params=["emu", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    """A :class:`backends.Backend`: "emu", or "cuda" when a GPU is present."""
    if request.param == "cuda" and not _have_cuda():
        pytest.skip("no NVIDIA GPU / driver available for the cuda backend")
    return Backend(request.param)


@pytest.fixture
def emu_backend():
    """The emulator backend only (for tests of emulator diagnostics)."""
    return Backend("emu")
