"""Load, use, drop, load the next: models one after another on the GPU (issue 59).

A dropped model's device resources may be released by the cyclic collector
at any allocation, also inside the next model's graph capture; that must
neither break the capture nor leak. Only ``from_gguf`` and ``generate`` are
used, so the loop reads the same whatever the model class becomes.
(scripts/gpu_model_churn.py runs the long version.)
"""

import gc

import pytest

pytest.importorskip("gguf")

from backends import cuda_available
from ptxgen.llm.gguf.synth import PRESETS, write_synthetic_llama
from ptxgen.llm import Model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="no NVIDIA GPU / driver available")]

MIB = 1 << 20
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_synthetic_llama(str(p), seed=module_seed, **PRESETS["tiny"])   # 2 layers, hidden 256
    return str(p)


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def _settled_free() -> int:
    from ptxgen.driver import get_device
    gc.collect()
    dev = get_device()
    dev.synchronize()
    return dev.mem_info()[0]


def test_forty_models_in_a_row_capture_and_give_their_memory_back(tiny, collector_on):
    m = Model.from_gguf(tiny, backend="cuda", capacity=64, progress=False)
    want = m.generate(PROMPT, 8).tokens      # warm-up: kernels built, modules loaded and cached
    del m
    free0 = _settled_free()
    for i in range(40):                      # the collector runs when it will; no explicit collect
        m = Model.from_gguf(tiny, backend="cuda", capacity=64, progress=False)
        got = m.generate(PROMPT, 8).tokens
        assert got == want, f"model {i}: {got} != {want}"
        del m
    free1 = _settled_free()
    assert abs(free0 - free1) <= 4 * MIB, f"free device memory {free0 / MIB:.1f} -> {free1 / MIB:.1f} MiB"


def test_dropped_model_collected_inside_the_next_capture(tiny, collector_on, monkeypatch):
    """The issue's failure made certain: the collector runs right after each
    capture begins, so whatever a dropped model left in reference cycles is
    released inside the next model's capture."""
    from ptxgen.driver import graph

    enter = graph.capture.__enter__
    collected = []

    def enter_then_collect(self):
        g = enter(self)
        collected.append(gc.collect())
        return g

    monkeypatch.setattr(graph.capture, "__enter__", enter_then_collect)
    m = Model.from_gguf(tiny, backend="cuda", capacity=64, progress=False)
    want = m.generate(PROMPT, 8).tokens
    for i in range(4):
        del m
        m = Model.from_gguf(tiny, backend="cuda", capacity=64, progress=False)
        got = m.generate(PROMPT, 8).tokens
        assert got == want, f"model {i}: {got} != {want}"
    assert collected, "generate() made no capture: this test no longer tests anything"
