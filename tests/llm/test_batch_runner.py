"""The batched engine's device side (llm/engine/runner.py) on the emulator:
sequences of different lengths prefilled in chunks into a paged pool, then
decoded together, each getting the greedy tokens the single-sequence model
gets for it alone; the pool blocks of one sequence are never written by
another's steps."""

import zlib
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("gguf")

from ptxgen.driver.backend import get_backend
from ptxgen.llm import Model
from ptxgen.llm.engine.runner import BatchRunner, DecodeRow, PrefillChunk
from ptxgen.llm.generation import SamplingSettings
from ptxgen.llm.gguf.file import LlamaFile
from ptxgen.llm.gguf.synth import PRESETS, write_synthetic_llama
from decode_check import tie_free_prompt
from test_prefill import same_continuation

TINY = dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
            context_length=256)
#: the files of other shapes than TINY's: qwen3moe the tiny-moe preset (8
#: experts, 2 used) in the Q4_K_M mix llama.cpp writes for MoE files; gemma3
#: with Gemma's heads of 256 (two, sharing one KV head), layers 0 and 1 local (a window of 3 keys, their
#: own RoPE base) and layer 2 global
FAMILIES = {"qwen3": dict(head_dim=64),
            "qwen3moe": {**PRESETS["tiny-moe"], "vocab": 512, "context_length": 256,
                         "mix": "Q4_K_M"},
            "gemma3": dict(n_layers=3, n_heads=2, n_kv_heads=1, head_dim=256,
                           sliding_window=3, swa_pattern=3,
                           rope_theta=1e6, rope_theta_swa=1e4, tie_embeddings=True,
                           qtype="Q4_K")}
BS = 16
GREEDY = SamplingSettings()


def _file(tmp_path_factory, seed, arch):
    p = tmp_path_factory.mktemp("model") / f"{arch}.gguf"
    write_synthetic_llama(str(p), seed=seed, **{**TINY, "arch": arch, **FAMILIES.get(arch, {})})
    return str(p)


@pytest.fixture(scope="module")
def files(tmp_path_factory, module_seed):
    return _file(tmp_path_factory, module_seed, "llama")


#: new tokens each sequence decodes
N_NEW = 3


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen3moe", "gemma3"])
def family(request, tmp_path_factory, module_seed):
    """A file of the family, three prompts (4, 9 and 18 tokens) and what the
    single-sequence model gives each alone, fed token by token: its greedy
    continuation of ``N_NEW`` tokens and the logits of every step (entry
    ``i`` after the token at position ``i``).  Built once per family for the
    tests of both buckets."""
    arch = request.param
    path = _file(tmp_path_factory, module_seed, arch)
    rng = np.random.default_rng([module_seed, zlib.crc32(arch.encode())])
    model = Model.from_gguf(path, backend="emu", capacity=48, progress=False)
    if arch == "qwen3moe":
        # prompts that route clear of near ties (decode_check.route_margin):
        # the chunks' and the batch's routers round otherwise than the
        # single sequence's and may choose other experts there
        prompts = [tie_free_prompt(rng, path, n, TINY["vocab"], N_NEW) for n in (4, 9, 18)]
    else:
        prompts = [[int(t) for t in rng.integers(0, TINY["vocab"], n)] for n in (4, 9, 18)]
    refs = [model.generate(p, N_NEW, prefill_chunk=0, return_logits=True) for p in prompts]
    return SimpleNamespace(path=path, prompts=prompts, refs=refs)


def _run(runner, prompts, tables, n_new, chunk, logits=None):
    """Prefill every prompt but its last token in packed steps (each takes a
    chunk of every sequence still prefilling, oldest first, until it holds
    ``chunk`` tokens), then decode all of them together ``n_new`` steps
    (the first feeds the prompts' last tokens); returns each sequence's new
    tokens (and each decode step's logits appended to ``logits``, rows in
    order, where given)."""
    done = [0] * len(prompts)
    while any(d < len(p) - 1 for d, p in zip(done, prompts)):
        room, step = chunk, []
        for i, (p, tab) in enumerate(zip(prompts, tables)):
            n = min(len(p) - 1 - done[i], room)
            if n > 0:
                step.append(PrefillChunk(tuple(p[done[i]:done[i] + n]), done[i], tab))
                done[i] += n
                room -= n
        runner.prefill(step, mode="eager")
    last = [(p[-1], len(p) - 1) for p in prompts]
    out = [[] for _ in prompts]
    for _ in range(n_new):
        res = runner.decode([DecodeRow(t, pos, tab, GREEDY, 0)
                             for (t, pos), tab in zip(last, tables)], mode="eager")
        if logits is not None:
            b = runner._bucket("decode", len(prompts))
            logits.append(runner._executor("decode", b).read(
                runner._graphs["decode", b].logits)[:len(prompts)].astype(np.float64))
        for i, r in enumerate(res):
            out[i].append(r.token)
            last[i] = (r.token, last[i][1] + 1)
    return out


def test_batch_equals_each_sequence_alone(family, rng):
    """Three sequences (4, 9 and 18 prompt tokens, prefilled in steps of 8
    tokens that hold chunks of two sequences, the last crossing a block
    boundary) in shuffled, interleaved blocks: each gets the tokens the
    single-sequence model gives it (Llama, Qwen2's biases, Qwen3's q/k
    norms, Qwen3-MoE's experts chosen per row on the device, Gemma 3's
    sliding-window layers over the paged cache): logits within 1e-2 of its at every step, tokens equal up to a
    near tie (``same_continuation``: the batch's GEMMs and the single
    sequence's GEMVs round differently, and a random model's logits are
    flat)."""
    runner = BatchRunner(LlamaFile(family.path), get_backend("emu"), num_blocks=12,
                         block_size=BS, max_batch=4, chunk=8, ctx_size=48)
    prompts = family.prompts
    blocks = [int(b) for b in rng.permutation(12)]
    tables = [tuple(blocks[0:2]), tuple(blocks[2:4]), tuple(blocks[4:7])]
    steps = []
    got = _run(runner, prompts, tables, N_NEW, 8, logits=steps)
    for i, (p, (ref, ref_logits)) in enumerate(zip(prompts, family.refs)):
        same_continuation(SimpleNamespace(tokens=got[i]), [st[i] for st in steps], ref,
                          ref_logits, len(p))
    # no step wrote into a block no sequence owns
    owned = {b for t in tables for b in t}
    k, v = runner.read_kv(0)
    for b in set(range(12)) - owned:
        assert not k[b].any() and not v[b].any(), f"block {b} was written"


def test_one_row_step_equals_the_sequence_alone(family, rng):
    """A sequence decoded alone (the bucket of one row, the decode step's
    fusions: the attention norm in the QKV GEMV's prologue, RoPE and the
    paged append in its epilogue where the layer has no q/k norms, gate/up
    and the activation in one GEMV) in two shuffled blocks: the first 13 to
    17 tokens of the family's 18-token prompt prefilled, then 3 decode
    steps fed the tokens that follow (the prompt's, then the model's
    continuation; some runs append into the second block while decoding).
    Each step's logits are within 1e-2 of the single-sequence model's at
    that position, its token that model's greedy choice up to a near tie
    (``same_continuation``'s bound), and no block it does not own is
    written."""
    prompt = family.prompts[2]
    ref, ref_logits = family.refs[2]
    seq = prompt + ref.tokens                   # ref_logits[i]: after seq[i]
    n = int(rng.integers(14, 19))               # the first decode step feeds seq[n - 1]
    runner = BatchRunner(LlamaFile(family.path), get_backend("emu"), num_blocks=6,
                         block_size=BS, max_batch=1, chunk=8, ctx_size=32)
    table = tuple(int(b) for b in rng.permutation(6)[:2])
    _run(runner, [seq[:n]], [table], 0, 8)      # prefill only
    lw, ex = runner._graphs["decode", 1], runner._executor("decode", 1)
    for pos in range(n - 1, n - 1 + N_NEW):
        tok = runner.decode([DecodeRow(seq[pos], pos, table, GREEDY, 0)], mode="eager")[0].token
        lg, lr = ex.read(lw.logits)[0].astype(np.float64), ref_logits[pos]
        err = float(np.linalg.norm(lg - lr) / np.linalg.norm(lr))
        assert err <= 1e-2, (pos, err)
        want = int(np.argmax(lr))
        gap, tie = float(lr[want] - lr[tok]), 2e-2 * float(np.sqrt(np.mean(lr * lr)))
        assert gap <= tie, f"position {pos}: chose {tok}, alone {want}, gap {gap} > {tie}"
    k, v = runner.read_kv(0)
    for b in set(range(6)) - set(table):
        assert not k[b].any() and not v[b].any(), f"block {b} was written"


def _ops(runner, rows, layer):
    p = f"blk.{layer}."
    return [(op.kind, op.name.removeprefix(p)) for op in runner.graph("decode", rows).ops
            if op.name.startswith(p)]


def test_one_row_step_lowers_as_the_decode_step(files):
    """The bucket of one row takes the decode step's launches per layer (the
    QKV GEMV with the attention norm, RoPE and the paged append; the paged
    attention's two launches; the output GEMV adding the stream; the FFN norm;
    gate/up with SwiGLU; down adding the stream), every launch built for
    PDL where the target has it, the attention's first loads before its
    wait (``early_kv``); the bucket of two keeps a GEMV per row."""
    runner = BatchRunner(LlamaFile(files), get_backend("emu"), num_blocks=4, block_size=BS,
                         max_batch=2, chunk=4, ctx_size=32, target="sm_90a", sm_count=132,
                         gemv_rows=2)
    assert _ops(runner, 1, 1) == [
        ("MulMatRopeKv", "attn_qkv"), ("Attention", "attention"),
        ("MulMat", "attn_output.row0"), ("RmsNorm", "ffn_norm"),
        ("MulMatSwiGLU", "ffn_gate_up.row0"), ("MulMat", "ffn_down.row0")]
    qkv, att = (runner.graph("decode", 1).ops[i].launches[0].spec for i in (1, 2))
    assert (qkv.norm, qkv.epilogue, qkv.paged) == (True, "rope", BS)
    assert att.early_kv
    assert all(L.spec.pdl for op in runner.graph("decode", 1).ops for L in op.launches
               if hasattr(L.spec, "pdl"))
    # two rows: the norm still folded, each row's GEMVs, one paged RoPE launch
    assert [k for k, _ in _ops(runner, 2, 1)] == [
        "MulMat", "MulMat", "RopeKvAppend", "Attention", "MulMat", "MulMat", "RmsNorm",
        "MulMatSwiGLU", "MulMatSwiGLU", "MulMat", "MulMat"]


def test_one_row_variants_choose_as_the_sampler(files, rng):
    """The bucket of one row has the decode step's variants: a greedy row
    without log-probabilities replays the argmax, one that asks for them (or
    samples) the sampler; at the same step both choose the same token (the
    argmax is the sampler's greedy choice), and the sampler's log-probability
    and top ids come with it."""
    runner = BatchRunner(LlamaFile(files), get_backend("emu"), num_blocks=2, block_size=BS,
                         max_batch=1, chunk=4, ctx_size=32)
    assert runner.graph("decode", 1).variants == ("greedy", "sample")
    seen, run = [], runner._run
    runner._run = lambda kind, n, mode, variant=None: (seen.append(variant),
                                                       run(kind, n, mode, variant))[1]
    tok = int(rng.integers(0, TINY["vocab"]))
    table = (int(rng.integers(0, 2)),)
    greedy = runner.decode([DecodeRow(tok, 0, table, GREEDY, 0)], mode="eager")[0]
    assert np.isnan(greedy.logprob)
    logits = runner._executor("decode", 1).read(runner._graphs["decode", 1].logits)[0]
    assert greedy.token == int(np.argmax(logits))
    lp = runner.decode([DecodeRow(tok, 0, table, GREEDY, 0, logprobs=2)], mode="eager")[0]
    assert lp.token == greedy.token and np.isfinite(lp.logprob)
    assert len(lp.top) == 2 and lp.top[0][0] == greedy.token
    hot = SamplingSettings(temperature=0.8)
    drawn = runner.decode([DecodeRow(tok, 0, table, hot, 5)], mode="eager")[0]
    assert 0 <= drawn.token < TINY["vocab"]
    assert seen == ["greedy", None, None]           # None: the default, the sampler


def test_rows_past_the_batch_do_not_matter(files, rng):
    """Two sequences in the bucket of 2 and, with a third beside them, in the
    bucket of 4: the first two get the same tokens either way."""
    runner = BatchRunner(LlamaFile(files), get_backend("emu"), num_blocks=8, block_size=BS,
                         max_batch=4, chunk=8, ctx_size=32)
    prompts = [[int(t) for t in rng.integers(0, TINY["vocab"], n)] for n in (3, 6, 5)]
    a = _run(runner, prompts[:2], [(0,), (1,)], 2, 8)
    b = _run(runner, prompts, [(2,), (3,), (4,)], 2, 8)
    assert a == b[:2]


def test_bad_inputs_are_refused(files):
    runner = BatchRunner(LlamaFile(files), get_backend("emu"), num_blocks=4, block_size=BS,
                         max_batch=2, chunk=4, ctx_size=32)
    with pytest.raises(ValueError, match="past the block table"):
        runner.decode([DecodeRow(1, 16, (0,), GREEDY, 0)])
    with pytest.raises(ValueError, match="outside the pool"):
        runner.decode([DecodeRow(1, 0, (9,), GREEDY, 0)])
    with pytest.raises(ValueError, match="1..2 rows"):
        runner.decode([DecodeRow(1, 0, (0,), GREEDY, 0)] * 3)
    with pytest.raises(ValueError, match="1..4 tokens"):
        runner.prefill(PrefillChunk(tuple(range(5)), 0, (0,)))
    with pytest.raises(ValueError, match="1..4 tokens"):
        runner.prefill([PrefillChunk((1, 2, 3), 0, (0,)), PrefillChunk((1, 2), 0, (1,))])


def _kernels(runner, rows):
    return [L.spec.kernel_name for op in runner.graph("decode", rows).ops for L in op.launches
            if L.family in ("gemv", "gemm")]


def test_batched_gemv_step_matches_a_gemv_per_row(tmp_path, module_seed, rng):
    """A decode step of 3 rows (the bucket of 4) with every weight through
    the batched GEMV (the output weight too: Q4_K here) gives the logits of
    the same step run as a GEMV per row (the single-sequence kernels) to
    1e-3 of their largest, and the same tokens.  The two sum the same dp4a
    products in different orders, in f32; over the steps before, a
    last-bit difference in a hidden state can move one of x's 8-bit levels
    (the dp4a GEMVs quantize x per block of 32), about 2^-8 of that block's
    largest."""
    path = tmp_path / "q4k_out.gguf"
    write_synthetic_llama(str(path), seed=module_seed, arch="llama", output_qtype="Q4_K", **TINY)
    kw = dict(num_blocks=8, block_size=BS, max_batch=4, chunk=8, ctx_size=32)
    batched = BatchRunner(LlamaFile(str(path)), get_backend("emu"), batch_gemv_rows=4, **kw)
    per_row = BatchRunner(LlamaFile(str(path)), get_backend("emu"), gemv_rows=4, **kw)
    names = _kernels(batched, 4)
    assert names and all("_b4_" in n for n in names), names
    assert not any("_b4_" in n or n.startswith("gemm") for n in _kernels(per_row, 4))
    prompts = [[int(t) for t in rng.integers(0, TINY["vocab"], n)] for n in (3, 6, 5)]
    tables = [(0,), (1,), (2,)]
    out = []
    for runner in (batched, per_row):
        toks = _run(runner, prompts, tables, 2, 8)
        lw = runner._graphs["decode", 4]
        out.append((toks, runner._executor("decode", 4).read(lw.logits)[:3]))
    (ta, la), (tb, lb) = out
    assert ta == tb
    err = np.max(np.abs(la.astype(np.float64) - lb)) / np.max(np.abs(lb))
    assert err <= 1e-3, err


def test_batched_gemv_off_and_above_the_crossover_uses_the_gemm(files):
    """``batch_gemv_rows=0`` and a bucket above ``batch_gemv_rows`` run the
    weights as GEMMs; at or below it, through the batched GEMV."""
    kw = dict(num_blocks=4, block_size=BS, max_batch=4, chunk=4, ctx_size=32)
    off = BatchRunner(LlamaFile(files), get_backend("emu"), batch_gemv_rows=0, **kw)
    assert all(n.startswith("gemm") for n in _kernels(off, 2) + _kernels(off, 4))
    two = BatchRunner(LlamaFile(files), get_backend("emu"), batch_gemv_rows=2, **kw)
    assert any("_b2_" in n for n in _kernels(two, 2))
    assert not any("_b4_" in n for n in _kernels(two, 4))
    assert all(n.startswith("gemm") for n in _kernels(two, 4))


def test_split_k_step_matches_the_unsplit_one(tmp_path, module_seed, rng, monkeypatch):
    """A decode step whose gate/up GEMM (2048 rows, K = 512) the table splits
    2 ways over K (GemmConfig.split_k: partial sums in a workspace, the
    tile's last CTA adds them) gives the logits of the same step with the
    GEMM unsplit to 1e-3 of their largest and the same tokens, step after
    step (the tile counters the graph's split launches share come back to
    zero each time).  Only the order of the f32 sums differs, but the
    down projection reads the FFN activation as f16, where a last-bit
    change can move an element by one f16 step (2^-11)."""
    import attrs

    from ptxgen.kernels import gemm as G
    path = tmp_path / "wide_ffn.gguf"
    write_synthetic_llama(str(path), seed=module_seed, arch="llama", n_layers=1, hidden=512,
                          ffn=2048, n_heads=4, n_kv_heads=2, vocab=512, context_length=64)
    kw = dict(num_blocks=8, block_size=BS, max_batch=4, chunk=8, ctx_size=32, batch_gemv_rows=0)
    split = BatchRunner(LlamaFile(str(path)), get_backend("emu"), **kw)
    assert any(n.endswith("_k2") for n in _kernels(split, 4)), _kernels(split, 4)
    table = G.select_config
    monkeypatch.setattr(G, "select_config",
                        lambda *a, **k: attrs.evolve(table(*a, **k), split_k=1))
    whole = BatchRunner(LlamaFile(str(path)), get_backend("emu"), **kw)
    assert not any(n.endswith("_k2") for n in _kernels(whole, 4))
    prompts = [[int(t) for t in rng.integers(0, 512, n)] for n in (3, 6, 5)]
    out = []
    for runner in (split, whole):
        logits = []
        out.append((_run(runner, prompts, [(0,), (1,), (2,)], 3, 8, logits=logits), logits))
    (ta, la), (tb, lb) = out
    assert ta == tb
    for a, b in zip(la, lb):
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err <= 1e-3, err
