"""The decode step as one persistent kernel (llm/persistent.py) on the
emulator: the tiny model's greedy step, every kernel of the step inlined
into the persistent kernel and ordered by the tape's counters, gives the
eager path's tokens and logits and the float64 reference's, with the
emulator's global race check watching the hand-offs between CTAs."""

import numpy as np
import pytest

pytest.importorskip("gguf")

from backends import cuda_available
from decode_check import check_logits
from ptxgen.llm.gguf.synth import write_synthetic_llama
from ptxgen.llm.model import Model

TINY = dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
            context_length=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_synthetic_llama(str(p), seed=module_seed, **TINY)
    return str(p)


def test_emulator_persistent_decode_matches_the_eager_step(tiny, rng):
    """Two steps (a prompt of two tokens, one new): the same token as the
    eager launches, logits equal to theirs within 1e-6 relative (the same
    kernels' arithmetic, CTA by CTA) and the reference's within the decode
    path's bound; every counter ends at its node's count times the steps.
    The kernel is the one with the timeline: every instruction's stamps
    written (the emulator's clock and SM read 0), the summary a row a node.
    24 CTAs (the most of 256 threads the emulator runs together) keep the
    emulator's rounds few."""
    from ptxgen.kernels import megakernel as mk
    from ptxgen.llm.persistent import timeline_summary
    prompt = [int(t) for t in rng.integers(0, 512, 2)]
    m = Model.from_gguf(tiny, backend="emu", capacity=8, progress=False, sm_count=24)
    want, want_logits = m.generate(prompt, 1, return_logits=True, mode="eager")
    p = m.persistent_step(grid=24, timeline=True)
    poison = np.full((len(p.tape.instructions), mk.STAMP_WORDS), 0xFFFF_FFFF_FFFF_FFFF, np.uint64)
    p.backend.copy_from_host(p._stamps, poison)
    got, logits = m.generate(prompt, 1, return_logits=True, mode="persistent")
    assert got.tokens == want.tokens
    assert (got.mode, got.launches_per_token) == ("persistent", 1)
    for a, b in zip(logits, want_logits):
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)
    check_logits(m, tiny, prompt, got, logits)
    counts = m.backend.to_numpy(p._counters)
    np.testing.assert_array_equal(counts, [p.epoch * n.count for n in p.tape.nodes])
    np.testing.assert_array_equal(p.timeline(), 0)
    rows = timeline_summary(p.tape, p.timeline())
    assert [r[0] for r in rows] == list(p.tape.nodes)
    assert sum(r[1] for r in rows) == len(p.tape.instructions)


#: a model whose FFN (K = 8448 for ffn_down) is past 256 threads of one
#: Q4_K piece each: the persistent kernel builds that body with more pieces
#: a thread (llm/tape.py, ``_body_spec``); everything else as small as fits
WIDE_FFN = dict(n_layers=1, hidden=256, ffn=8448, n_heads=2, n_kv_heads=1, vocab=256,
                context_length=64)


@pytest.mark.slow   # about 45 s of CPU, two thirds of it the emulator's shared-memory race checks
def test_emulator_persistent_decode_with_a_wide_ffn_down(tmp_path, seed, rng):
    """One step of a model whose ffn_down GEMV runs more threads than the
    persistent CTA keeps (:data:`~ptxgen.llm.tape.GEMV_THREADS`): its body
    takes 2 pieces a thread (160 threads, the launch's rows a CTA and grid
    unchanged), the persistent kernel stays 256 wide, and the step gives
    the eager launches' token and logits (1e-6 relative) and the float64
    reference's within the decode path's bound.  24 CTAs (the most of 256
    threads the emulator runs together) keep the emulator's rounds few."""
    p = tmp_path / "wide_ffn.gguf"
    write_synthetic_llama(str(p), seed=seed, **WIDE_FFN)
    prompt = [int(rng.integers(0, WIDE_FFN["vocab"]))]
    m = Model.from_gguf(str(p), backend="emu", capacity=4, progress=False, sm_count=24)
    want, want_logits = m.generate(prompt, 1, return_logits=True, mode="eager")
    ps = m.persistent_step(grid=24)
    down = [n for n in ps.tape.nodes if n.op == "blk.0.ffn_down"]
    assert len(down) == 1 and down[0].threads > ps.kernel.threads == 256
    body = [b for b in ps.kernel.bodies if b.entry.startswith("gemv_q4_k_k8448_")]
    assert len(body) == 1 and "_p2" in body[0].entry and body[0].threads == 160
    got, logits = m.generate(prompt, 1, return_logits=True, mode="persistent")
    assert got.tokens == want.tokens
    for a, b in zip(logits, want_logits):
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)
    check_logits(m, str(p), prompt, got, logits)


def test_emulator_race_check_sees_the_decode_steps_hand_offs(tiny, monkeypatch):
    """The same step with every wait dropped from the tape: a CTA reads the
    embedding another CTA stored with no release/acquire between them, and
    the emulator's global race check names both instructions."""
    from ptxgen import emu
    from ptxgen.kernels import megakernel as mk
    encode = mk.encode_fused
    monkeypatch.setattr(mk, "encode_fused",
                        lambda ins: encode([(*i[:4], (), *i[5:]) for i in ins]))
    m = Model.from_gguf(tiny, backend="emu", capacity=8, progress=False, sm_count=8)
    m.persistent_step(grid=8)
    with pytest.raises(emu.RaceError, match="global-memory race .* no release/acquire"):
        m.generate([1, 2], 1, mode="persistent")


def test_persistent_decode_takes_only_the_greedy_step(tiny):
    m = Model.from_gguf(tiny, backend="emu", capacity=8, progress=False, sm_count=8)
    with pytest.raises(ValueError, match="runs the greedy step, not 'sample'"):
        m.persistent_step("sample")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no GPU")
def test_gpu_persistent_decode_matches_the_graph(tiny, rng):
    """32 steps on the GPU: the persistent kernel's tokens and logits are
    the CUDA graph's."""
    prompt = [int(t) for t in rng.integers(0, 512, 4)]
    m = Model.from_gguf(tiny, backend="cuda", capacity=64, progress=False)
    want, want_logits = m.generate(prompt, 28, return_logits=True, mode="graph")
    got, logits = m.generate(prompt, 28, return_logits=True, mode="persistent")
    assert got.tokens == want.tokens
    for a, b in zip(logits, want_logits):
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)


def test_the_tuning_table_chooses_the_path(tiny, monkeypatch):
    """The shipped table keeps the graph; a rule for the device and shape
    turns the persistent kernel on there only; a path the model does not
    know is refused, naming the call."""
    from ptxgen.kernels import tuning
    from ptxgen.llm.gguf.file import LlamaFile
    from ptxgen.llm.persistent import decode_path
    f = LlamaFile(tiny)
    assert decode_path(f, "sm_90") == "graph"
    shipped = tuning.load_table

    def table(rules):
        return lambda fam: shipped(fam) + rules if fam == "decode_path" else shipped(fam)
    monkeypatch.setattr(tuning, "load_table",
                        table((({"sm": 90, "n_layers_max": 2}, {"path": "persistent"}),)))
    assert decode_path(f, "sm_90") == "persistent"
    assert decode_path(f, "sm_80") == "graph"
    monkeypatch.setattr(tuning, "load_table", table((({}, {"path": "fast"}),)))
    with pytest.raises(ValueError, match="gives path 'fast' for .*'n_layers': 2"):
        decode_path(f, "sm_90")


def test_ptxas_takes_the_fused_decode_kernel(tiny, ptxas):
    """The persistent kernel over the tiny model's step assembles for sm_90
    (the shape the GPU loads; its bodies are the step's kernels)."""
    from ptxgen.llm.tape import decode_graph, fused_kernel
    from ptxgen.ptxas import assemble
    g = decode_graph(tiny, sm_count=8, capacity=64)
    fk, index = fused_kernel(g, "sm_90")
    kernels = {L.kernel for op in g.ops_of("greedy") for L in op.launches}
    assert set(index) == kernels and len(fk.bodies) == len(kernels)
    assert fk.threads == max(b.threads for b in fk.bodies) == 256   # the argmax's 1024 capped
    assemble(fk.ptx, "sm_90")


def test_ptxas_the_8b_shaped_persistent_kernel_does_not_spill(tmp_path, ptxas):
    """The persistent kernel of an 8B-shaped step (one layer of Llama 3 8B,
    its full vocabulary: the step's own kernels) is 256 threads wide, its
    ffn_down body (K = 14336, 448 threads as a launch) built with 2 pieces a
    thread, and ptxas gives it registers to spare: no spill, no stack."""
    from ptxgen.llm.gguf.synth import PRESETS
    from ptxgen.llm.tape import decode_graph, fused_kernel
    from ptxgen.ptxas import assemble
    p = tmp_path / "llama8b_1layer.gguf"
    write_synthetic_llama(str(p), seed=7, **{**PRESETS["llama3-8b"], "n_layers": 1})
    g = decode_graph(str(p), sm_count=132, capacity=4096)
    fk, _ = fused_kernel(g, "sm_90")
    down = [L for op in g.ops_of("greedy") if op.name == "blk.0.ffn_down" for L in op.launches]
    assert [L.geometry.threads for L in down] == [448]
    assert [b.threads for b in fk.bodies if b.entry.startswith("gemv_q4_k_k14336_")] == [224]
    assert fk.threads == 256
    (rep,) = assemble(fk.ptx, "sm_90", exe=ptxas)[1]
    assert rep.spill_stores == rep.spill_loads == rep.stack_bytes == rep.local_bytes == 0, rep
