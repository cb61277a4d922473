"""A dropped model is freed at once: nothing it owns sits in a reference
cycle, so its device memory does not wait for Python's collector (which
could otherwise run in the middle of the next model's graph capture).

On the emulator: with the collector off, a model used through every path
(decode, a continued sequence, chunked prefill, a session, a text stream
and a chat) is gone as soon as the last reference is dropped, and a
collection then finds none of its objects.  On the GPU: the device memory
comes back too."""

import gc
import weakref

import numpy as np
import pytest

pytest.importorskip("gguf")

from ptxgen.llm import Model
from ptxgen.llm.gguf.synth import write_synthetic_llama

#: classes whose instances belong to a loaded model
OWNED = {"Model", "Session", "Executor", "DeviceMemory", "Arena", "Store", "ComputeGraph",
         "Buffer", "DecodeLowering", "ChunkLowering", "Prefill", "DeviceArray", "Decoding",
         "TextStream", "ChatSession", "Launch", "Op"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_synthetic_llama(str(p), seed=module_seed, n_layers=1, hidden=256, ffn=512,
                          n_heads=4, n_kv_heads=2, vocab=512, context_length=256,
                          tokenizer="llama",
                          chat_template="{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>")
    return str(p)


def _use(m):
    """Every path that keeps objects of its own: a sequence, its
    continuation, chunked prefill, a session, a text stream, a chat."""
    m.generate([1, 2, 3], 2)
    m.generate([4], 1, keep_cache=True)
    m.generate([1, 2, 3, 4, 5], 1, prefill_chunk=4, mode="eager")
    s = m.session()
    s.generate([7, 8], 1)
    if m.tokenizer is not None:
        m.generate_text("hello", max_new_tokens=2)
        chat = m.chat_session(system="be brief")
        chat.send("hi", max_new_tokens=2)
    return [weakref.ref(o) for o in (m, s, m.executor, m.store, m.memory, m.step_graph,
                                     m.prefill(4))]


def test_dropped_model_is_freed_without_the_collector(tiny):
    gc.collect()
    # model objects from earlier tests, still alive: a cache that lets one go
    # while this model is built (its cycle then collected below) is not this
    # model's leak
    earlier = {id(o) for o in gc.get_objects() if type(o).__name__ in OWNED}
    gc.disable()
    try:
        m = Model.from_gguf(tiny, backend="emu", capacity=16, progress=False)
        refs = _use(m)
        del m
        alive = [r() for r in refs if r() is not None]
        assert not alive, f"still alive without a collection: {alive}"
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = sorted({type(o).__name__ for o in gc.garbage if id(o) not in earlier} & OWNED)
        assert not found, f"a collection found model objects in cycles: {found}"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.gpu
def test_dropped_model_returns_its_device_memory(tiny):
    """On the GPU: ``del model`` gives the device memory back at once (no
    collection), to within the driver's allocation granularity."""
    from ptxgen import driver
    if not driver.is_available():
        pytest.skip("no GPU")
    from cuda.bindings import driver as cu
    driver.init()

    def free_bytes():
        driver.get_device(0).synchronize()
        return driver.check(cu.cuMemGetInfo())[0]

    warm = Model.from_gguf(tiny, backend="cuda", capacity=64, progress=False)
    want = warm.generate([1, 2, 3], 8).tokens
    del warm
    gc.collect()
    start = free_bytes()
    gc.disable()
    try:
        m = Model.from_gguf(tiny, backend="cuda", capacity=64, progress=False)
        assert m.generate([1, 2, 3], 8).tokens == want
        used = start - free_bytes()
        assert used > 0
        del m
        back = start - free_bytes()
        assert back <= 2 << 20, f"{back / 2**20:.1f} MiB still held after del (of {used / 2**20:.1f})"
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = sorted({type(o).__name__ for o in gc.garbage} & OWNED)
        assert not found, found
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert np.isfinite(start)
