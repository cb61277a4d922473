"""Fixtures for the driver tests (PTX texts live in driver_ptx.py)."""

import pytest


@pytest.fixture(scope="session")
def gpu_device():
    """The first GPU, or a clean skip when there is no driver or device."""
    from ptxgen.driver import get_device, is_available

    if not is_available():
        pytest.skip("no NVIDIA driver / GPU available")
    return get_device(0)


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """A private on-disk cache directory and an empty in-process cache."""
    from ptxgen.driver import cache

    root = tmp_path / "ptxgen-cache"
    monkeypatch.setenv("PTXGEN_CACHE_DIR", str(root))
    monkeypatch.delenv("PTXGEN_NO_CACHE", raising=False)
    cache.memory_cache.clear()
    yield root
    cache.memory_cache.clear()
