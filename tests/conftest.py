"""Test-wide fixtures: the ``backend`` fixture runs a test on the CPU
emulator always and on a GPU (through ptxgen.driver) when one is present;
the GPU case is skipped cleanly, never errors, where there is none."""

import os

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


@pytest.fixture(scope="session")
def ptxas():
    """The ptxas executable; a clean skip without one, except under CI
    (CI=true), where a missing ptxas fails."""
    from ptxgen.ptxas import PtxasNotFound, find_ptxas
    try:
        return find_ptxas()
    except PtxasNotFound as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"ptxas is required under CI: {e}")
        pytest.skip(str(e))
