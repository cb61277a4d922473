"""Optional tensors a file may or may not have, layer by layer: q/k/v biases
in some layers and of some projections only, ``output.weight`` left out
(tied embeddings), ``rope_freqs.weight``.

Synthetic files (tests/llm/test_conventions.py has the whole-file
conventions: every layer with all three biases, or none) are rewritten
with f32 biases added to chosen layers; the model decodes them on the
emulator against the float64 reference (:func:`decode_check.check_logits`),
and :meth:`LlamaFile.expected_tensors` names exactly the tensors present.
"""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from decode_check import check_logits
from ptxgen.llm.gguf.file import LlamaFile
from ptxgen.llm.gguf.synth import write_synthetic_llama
from ptxgen.llm import Model
from ptxgen.testing.reference import LlamaReference

TINY = dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
            context_length=256)
ROWS = {"attn_q": 256, "attn_k": 128, "attn_v": 128}      # q_dim, kv_dim, kv_dim


def with_tensors(src, dst, add=(), drop=()):
    """Copy GGUF ``src`` to ``dst`` with the f32 tensors ``add`` (name ->
    array) added and the tensors named in ``drop`` left out."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(name, field.contents())
        elif vt == gguf.GGUFValueType.STRING:
            w.add_string(name, field.contents())
        else:
            w.add_key_value(name, field.contents(), vt)
    for t in r.tensors:
        if t.name in drop:
            continue
        shape = [int(d) for d in reversed(t.shape)]
        raw_shape = shape if t.tensor_type.name in ("F32", "F16") else None
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=raw_shape, raw_dtype=t.tensor_type)
    for name, arr in dict(add).items():
        w.add_tensor(name, np.asarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def biases(rng, layout):
    """Random biases (of the order of the projections) for ``layout``:
    layer -> projection names."""
    return {f"blk.{i}.{n}.bias": (0.5 * rng.standard_normal(ROWS[n])).astype(np.float32)
            for i, names in layout.items() for n in names}


def _decode(path, rng):
    m = Model.from_gguf(path, backend="emu", capacity=4, progress=False)
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 2)]
    res, logits = m.generate(prompt, 1, return_logits=True)
    assert len(logits) == 2
    check_logits(m, path, prompt, res, logits)
    return m


def _biases_matter(path, names):
    """Zeroing the biases ``names`` moves the reference's logits by far
    more than the decode's bound: a decode that dropped them would fail."""
    ref = LlamaReference(path)
    want = ref.step(7)
    for n in names:
        ref.weights[n] = np.zeros_like(ref.weights[n])
    ref.reset()
    assert np.linalg.norm(ref.step(7) - want) / np.linalg.norm(want) > 1e-2


PARTIAL = {
    # layer 0 q only; layer 1 k and v only (no q: its bias slice is zeros)
    "llama-q0-kv1": ("llama", {0: ("attn_q",), 1: ("attn_k", "attn_v")}, False),
    # layer 0 none (the fused QKV + RoPE GEMV); layer 1 v only
    "llama-v1-tied": ("llama", {1: ("attn_v",)}, True),
    # qwen2 without biases in layer 0 (the synthetic qwen2 file has all six)
    "qwen2-none0-tied": ("qwen2", {}, True),
}


def partial_file(tmp_path, rng, seed, case):
    """The file of ``PARTIAL[case]`` and the names of its biases."""
    arch, layout, tied = PARTIAL[case]
    src = str(tmp_path / "src.gguf")
    write_synthetic_llama(src, seed=seed, arch=arch, tie_embeddings=tied, **TINY)
    path = str(tmp_path / "partial.gguf")
    drop = [f"blk.0.{n}.bias" for n in ROWS] if arch == "qwen2" else []
    add = biases(rng, layout)
    with_tensors(src, path, add=add, drop=drop)
    want = sorted(add) if arch == "llama" else [f"blk.1.{n}.bias" for n in sorted(ROWS)]
    return path, want


@pytest.mark.parametrize("case", sorted(PARTIAL))
def test_biases_in_some_layers(tmp_path, rng, seed, case):
    arch, _, tied = PARTIAL[case]
    path, want = partial_file(tmp_path, rng, seed, case)
    f = LlamaFile(path)
    present = sorted(n for n in f.names if n.endswith(".bias"))
    assert present == want
    assert f.hparams.qkv_bias and f.hparams.tied == tied
    assert set(f.expected_tensors()) == set(f.names)
    assert all(f.has(n) == (n in want) for n in
               [f"blk.{i}.{p}.bias" for i in range(TINY["n_layers"]) for p in ROWS])
    _biases_matter(path, want)
    m = _decode(path, rng)
    # every layer takes the fused QKV + RoPE GEMV, adding the biases where
    # the layer has some (a missing one's slice is zeros)
    for i in range(TINY["n_layers"]):
        ops = [op for op in m.graph.ops if op.name.startswith(f"blk.{i}.")]
        assert ops[0].kind == "MulMatRopeKv", (i, [op.kind for op in ops])
        spec = ops[0].launches[0].spec
        assert spec.bias == any(n.startswith(f"blk.{i}.") for n in want), i
        assert spec.rope_layout == m.hp.rope_layout
    # the chunked prefill adds the same biases (the GEMM's bias epilogue):
    # the first new token's logits as when the prompt runs token by token
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 3)]
    _, chunked = m.generate(prompt, 1, prefill_chunk=2, return_logits=True)
    _, stepped = m.generate(prompt, 1, prefill_chunk=0, return_logits=True)
    a, b = chunked[0], stepped[-1]
    assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(PARTIAL))
def test_gpu_biases_in_some_layers(tmp_path, rng, seed, case):
    """The same files on the GPU: 3 prompt + 13 generated tokens in graph
    mode, every step against the reference."""
    from backends import cuda_available
    if not cuda_available():
        pytest.skip("no NVIDIA GPU / driver available")
    path, _ = partial_file(tmp_path, rng, seed, case)
    m = Model.from_gguf(path, backend="cuda", capacity=32, progress=False)
    prompt = [int(t) for t in rng.integers(0, TINY["vocab"], 3)]
    res, logits = m.generate(prompt, 13, mode="graph", return_logits=True)
    assert len(logits) == 15
    check_logits(m, path, prompt, res, logits)


@pytest.mark.parametrize("tied", [False, True], ids=["output", "tied"])
@pytest.mark.parametrize("rope_freqs", [False, True], ids=["plain", "rope_freqs"])
@pytest.mark.parametrize("bias_layer", [None, 0, 1], ids=["nobias", "bias0", "bias1"])
def test_expected_tensors_name_what_is_present(tmp_path, rng, seed, tied, rope_freqs,
                                               bias_layer):
    """Every mix of the optional tensors: expected_tensors is the file's set
    of tensors, has() answers for each optional one, and the flags follow."""
    src = str(tmp_path / "src.gguf")
    d = TINY["hidden"] // TINY["n_heads"]
    factors = rng.uniform(0.5, 4.0, d // 2).astype(np.float32) if rope_freqs else None
    write_synthetic_llama(src, seed=seed, tie_embeddings=tied, rope_freqs=factors, **TINY)
    path = str(tmp_path / "f.gguf")
    layout = {} if bias_layer is None else {bias_layer: tuple(rng.permutation(list(ROWS))[:2])}
    add = biases(rng, layout)
    with_tensors(src, path, add=add)
    f = LlamaFile(path)
    hp = f.hparams
    assert set(f.expected_tensors()) == set(f.names)
    assert f.has("output.weight") != tied and hp.tied == tied
    assert f.has("rope_freqs.weight") == rope_freqs == hp.rope_freqs
    assert hp.qkv_bias == (bias_layer is not None)
    for i in range(TINY["n_layers"]):
        for p, rows in ROWS.items():
            n = f"blk.{i}.{p}.bias"
            assert f.has(n) == (n in add)
            assert (n in f.expected_tensors()) == (n in add)
            if n in add:
                assert f.expected_tensors()[n] == (rows,)
