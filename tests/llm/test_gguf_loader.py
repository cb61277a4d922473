"""GGUF loading: hyperparameters, raw tensors, and refusals of bad files."""

import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ptxgen.llm.gguf.file import GGUFError, LlamaFile
from ptxgen.llm.gguf.synth import write_synthetic_llama

TINY = dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
            context_length=128)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_synthetic_llama(str(p), seed=module_seed, **TINY)
    return str(p)


def test_hparams_and_tensors(tiny):
    f = LlamaFile(tiny)
    hp = f.hparams
    assert (hp.n_layers, hp.hidden, hp.ffn, hp.n_heads, hp.n_kv_heads, hp.vocab) == (2, 256, 512, 4, 2, 512)
    assert hp.head_dim == 64 and hp.q_dim == 256 and hp.kv_dim == 128
    t = f.tensor("blk.0.attn_q.weight")
    assert t.qtype == "Q4_K" and t.shape == (256, 256) and t.data.shape == (256, 144)
    assert t.data.dtype == np.uint8
    n = f.tensor("blk.1.ffn_norm.weight")
    assert n.qtype == "F32" and n.data.shape == (256,)
    # raw bytes decode to what gguf decodes
    by_name = {t.name: t for t in gguf.GGUFReader(tiny).tensors}
    ref = gguf.quants.dequantize(by_name["blk.0.attn_q.weight"].data,
                                 gguf.GGMLQuantizationType.Q4_K)
    np.testing.assert_array_equal(f.dequantized("blk.0.attn_q.weight"), ref.reshape(256, 256))


def test_tensors_are_read_only_views_of_the_file(tiny):
    """Every tensor holds the bytes the gguf package's reader finds at its
    offset, as a read-only view of the one map (no copy)."""
    f = LlamaFile(tiny)
    theirs = {t.name: t for t in gguf.GGUFReader(tiny).tensors}
    assert sorted(f.names) == sorted(theirs)
    assert f.weight_bytes == sum(int(t.n_bytes) for t in theirs.values())
    for name in f.names:
        data = f.tensor(name).data
        assert not data.flags.writeable and not data.flags.owndata, name
        assert np.array_equal(data.view(np.uint8).reshape(-1),
                              np.asarray(theirs[name].data).view(np.uint8).reshape(-1)), name
        with pytest.raises(ValueError):
            data.reshape(-1)[:1] = 0


def test_read_once_without_the_gguf_reader(tmp_path, seed, monkeypatch):
    """LlamaFile and its tokenizer read the file once, with the project's
    reader: neither the gguf package's reader nor a second metadata read."""
    import ptxgen.llm.gguf.reader as reader
    import ptxgen.llm.text.tokenizer as tokenizer
    path = str(tmp_path / "tok.gguf")
    write_synthetic_llama(path, seed=seed, tokenizer="llama", **TINY)
    calls = []
    real = reader.read_gguf

    def once(path):
        calls.append(path)
        return real(path)

    def refuse(*a, **k):
        raise AssertionError("the file was read again")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(tokenizer, "read_gguf_metadata", refuse)
    monkeypatch.setattr("ptxgen.llm.gguf.file.read_gguf", once)
    f = LlamaFile(path)
    assert f.tokenizer().n_vocab == 512 and calls == [path]


def test_truncated_file(tiny, tmp_path):
    data = open(tiny, "rb").read()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(GGUFError, match="truncated"):
        LlamaFile(bad)


def test_not_gguf_and_missing(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + os.urandom(64))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        LlamaFile(p)
    with pytest.raises(GGUFError, match="no such file"):
        LlamaFile(tmp_path / "absent.gguf")


def _rewrite(rng, src, dst, *, arch=None, drop=None, retype=None, keys=None, add=None):
    """Copy a GGUF, changing the architecture, dropping or retyping a tensor,
    setting metadata ``keys`` (value, or (value, GGUFValueType); None
    deletes) and adding f32 tensors ``add`` (name -> array)."""
    r = gguf.GGUFReader(src)
    old = r.fields["general.architecture"].contents()
    a = arch or old
    w = gguf.GGUFWriter(dst, a)
    keys = dict(keys or {})
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = name.replace(f"{old}.", f"{a}.") if arch else name
        if key in keys:
            continue
        v = field.contents()
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(key, v)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_string(key, v)
        else:
            w.add_key_value(key, v, vt)
    for key, v in keys.items():
        if v is None:
            continue
        v, vt = v if isinstance(v, tuple) else (v, None)
        if vt is None:
            vt = (gguf.GGUFValueType.STRING if isinstance(v, str) else
                  gguf.GGUFValueType.FLOAT32 if isinstance(v, float) else
                  gguf.GGUFValueType.ARRAY if isinstance(v, list) else gguf.GGUFValueType.UINT32)
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(key, v)
        else:
            w.add_key_value(key, v, vt)
    for t in r.tensors:
        if t.name == drop:
            continue
        shape = [int(d) for d in reversed(t.shape)]
        if t.name == retype:   # re-store this weight as F32, a matrix type no GEMV reads
            vals = rng.standard_normal(shape).astype(np.float32)
            w.add_tensor(t.name, vals)
        else:
            raw_shape = shape if t.tensor_type.name in ("F32", "F16") else None
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=raw_shape, raw_dtype=t.tensor_type)
    for name, arr in (add or {}).items():
        w.add_tensor(name, np.asarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_wrong_architecture(tiny, tmp_path, rng):
    dst = str(tmp_path / "gpt2.gguf")
    _rewrite(rng, tiny, dst, arch="gpt2")
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        LlamaFile(dst)


def test_missing_tensor(tiny, tmp_path, rng):
    dst = str(tmp_path / "missing.gguf")
    _rewrite(rng, tiny, dst, drop="blk.1.ffn_up.weight")
    with pytest.raises(GGUFError, match="'blk.1.ffn_up.weight' is missing"):
        LlamaFile(dst)


def test_unsupported_tensor_type(tiny, tmp_path, rng):
    dst = str(tmp_path / "f32m.gguf")
    _rewrite(rng, tiny, dst, retype="blk.0.attn_v.weight")
    with pytest.raises(GGUFError, match=r"'blk.0.attn_v.weight' has type F32, which is not "
                                        r"supported for a matrix \(supported: Q4_K, Q6_K, Q8_0"):
        LlamaFile(dst)
    # without the kernel check (the reference, `info`) it reads
    assert LlamaFile(dst, check_kernels=False).qtype("blk.0.attn_v.weight") == "F32"



# ---------------------------------------------------------------------------
# llama.cpp's conventions

def test_defaults_and_head_size_keys(tiny, tmp_path, rng):
    """Without key_length / rope.dimension_count / head_count_kv / freq_base
    the loader takes llama.cpp's defaults; the required keys are refused by
    name when missing."""
    dst = str(tmp_path / "bare.gguf")
    _rewrite(rng, tiny, dst, keys={"llama.rope.dimension_count": None,
                                   "llama.attention.head_count_kv": None,
                                   "llama.rope.freq_base": None})
    # head_count_kv defaults to head_count: the K/V weights of 2 heads no longer fit
    with pytest.raises(GGUFError, match=r"'blk.0.attn_k.weight' has shape \(128, 256\), "
                                        r"expected \(256, 256\)"):
        LlamaFile(dst)
    dst2 = str(tmp_path / "bare2.gguf")
    _rewrite(rng, tiny, dst2, keys={"llama.rope.dimension_count": None,
                                    "llama.rope.freq_base": None})
    hp = LlamaFile(dst2).hparams
    assert (hp.head_dim, hp.rope_dim, hp.rope_theta, hp.rope_freq_scale) == (64, 64, 1e4, 1.0)
    assert hp.rope_layout == "interleaved" and not (hp.rope_freqs or hp.qkv_bias or hp.qk_norm)
    for key in ("llama.attention.layer_norm_rms_epsilon", "llama.context_length",
                "llama.embedding_length"):
        dst3 = str(tmp_path / "nokey.gguf")
        _rewrite(rng, tiny, dst3, keys={key: None})
        with pytest.raises(GGUFError, match=f"metadata key '{key}' is missing"):
            LlamaFile(dst3)


@pytest.mark.parametrize("keys, message", [
    ({"llama.rope.dimension_count": 32},
     r"'llama.rope.dimension_count' is 32 of head size 64: partial rotary"),
    ({"llama.attention.value_length": 32},
     r"'llama.attention.value_length' \(32\) differs from 'llama.attention.key_length' \(64\)"),
    ({"llama.rope.scaling.type": "yarn"},
     r"'llama.rope.scaling.type' is 'yarn': this RoPE scaling is not supported"),
    ({"llama.rope.scaling.type": "llama3"},
     r"'llama.rope.scaling.type' is 'llama3': not a type llama.cpp knows"),
    ({"llama.rope.scaling.attn_factor": 2.0},
     r"'llama.rope.scaling.attn_factor' is 2.0: scaled RoPE magnitudes"),
    ({"llama.expert_count": 8}, r"'llama.expert_count' > 0: mixtures of experts"),
    ({"llama.attention.head_count": ([4, 8], gguf.GGUFValueType.ARRAY)},
     r"'llama.attention.head_count' differs between layers"),
    ({"llama.vocab_size": 500},
     r"'token_embd.weight' has 512 rows but metadata key 'llama.vocab_size' gives a "
     r"vocabulary of 500"),
    ({"tokenizer.ggml.tokens": ([f"t{i}" for i in range(511)], gguf.GGUFValueType.ARRAY)},
     r"'token_embd.weight' has 512 rows but the tokenizer's token list \(tokenizer.ggml.tokens\) "
     r"gives a vocabulary of 511"),
])
def test_conventions_refused_by_key(tiny, tmp_path, rng, keys, message):
    dst = str(tmp_path / "bad.gguf")
    _rewrite(rng, tiny, dst, keys=keys)
    with pytest.raises(GGUFError, match=message):
        LlamaFile(dst)


def test_vocab_from_the_token_list(tiny, tmp_path, rng):
    """A token list of the embedding's length sets the vocabulary; its
    {arch}.vocab_size is then not read (llama.cpp reads it only to name the
    model's size)."""
    dst = str(tmp_path / "tok.gguf")
    _rewrite(rng, tiny, dst, keys={"llama.vocab_size": 7, "tokenizer.ggml.model": "llama",
                                   "tokenizer.ggml.tokens": (
                                       [f"t{i}" for i in range(512)], gguf.GGUFValueType.ARRAY)})
    f = LlamaFile(dst)
    assert f.hparams.vocab == 512 and f.tokenizer_model == "llama"


@pytest.mark.parametrize("arch, change, message", [
    ("qwen2", dict(add={"rope_freqs.weight": np.ones(32)}),
     r"'rope_freqs.weight' is not supported in a qwen2 model \(llama.cpp's qwen2 graph applies "
     r"no RoPE frequency factors\)"),
    ("llama", dict(add={"blk.0.attn_output.bias": np.zeros(256)}),
     r"'blk.0.attn_output.bias' is not supported in a llama model \(only attn_q, attn_k and "
     r"attn_v biases are\)"),
    ("llama", dict(add={"blk.1.attn_q_norm.weight": np.ones(64)}),
     r"'blk.1.attn_q_norm.weight' is not supported in a llama model \(per-head q/k norms belong "
     r"to qwen3, qwen3moe and gemma3\)"),
    ("qwen3", dict(drop="blk.1.attn_k_norm.weight"), r"'blk.1.attn_k_norm.weight' is missing"),
    ("llama", dict(add={"blk.0.attn_k.bias": np.zeros(64)}),
     r"'blk.0.attn_k.bias' has shape \(64,\), expected \(128,\)"),
    ("llama", dict(add={"rope_freqs.weight": np.ones(16)}),
     r"'rope_freqs.weight' has shape \(16,\), expected \(32,\)"),
])
def test_tensors_refused_by_name(tmp_path, rng, seed, arch, change, message):
    src = str(tmp_path / f"{arch}.gguf")
    write_synthetic_llama(src, seed=seed, arch=arch, **TINY)
    dst = str(tmp_path / "bad.gguf")
    _rewrite(rng, src, dst, **change)
    with pytest.raises(GGUFError, match=message):
        LlamaFile(dst)


def test_types_checked_per_role(tmp_path, seed):
    """A tied F32 embedding has a gather kernel but no GEMV for the logits;
    untied, F32 is a fine embedding (and a tied F16 one is fine both ways).
    Norm weights must be f32."""
    p = str(tmp_path / "f32.gguf")
    write_synthetic_llama(p, seed=seed, embd_qtype="F32", tie_embeddings=True, **TINY)
    with pytest.raises(GGUFError, match=r"'token_embd.weight' has type F32, which is not "
                                        r"supported for a matrix \(the tied output\)"):
        LlamaFile(p)
    assert LlamaFile(p, check_kernels=False).hparams.tied
    q = str(tmp_path / "f32u.gguf")
    write_synthetic_llama(q, seed=seed, embd_qtype="F32", **TINY)
    assert LlamaFile(q).qtype("token_embd.weight") == "F32"
    f = str(tmp_path / "f16t.gguf")
    write_synthetic_llama(f, seed=seed, embd_qtype="F16", tie_embeddings=True, **TINY)
    assert LlamaFile(f).hparams.tied and LlamaFile(f).qtype("token_embd.weight") == "F16"
    r = str(tmp_path / "normf16.gguf")
    write_synthetic_llama(r, seed=seed, type_overrides={"blk.0.ffn_norm.weight": "F16"}, **TINY)
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_norm.weight' has type F16, which is not "
                                        r"supported for a vector \(supported: F32\)"):
        LlamaFile(r)


def test_head_size_without_an_attention_kernel(tmp_path, seed):
    """Heads of 96 load as a file but no attention kernel takes them: the
    model refuses at load, naming the keys."""
    from ptxgen.llm import Model
    p = str(tmp_path / "d96.gguf")
    write_synthetic_llama(p, seed=seed, n_layers=1, hidden=384, ffn=512, n_heads=4,
                          n_kv_heads=2, vocab=256, qtype="Q8_0", output_qtype="Q8_0")
    assert LlamaFile(p).hparams.head_dim == 96
    with pytest.raises(GGUFError, match=r"4 query heads on 2 KV heads of size 96 \(metadata keys "
                                        r"'llama.attention.key_length'.*have no attention kernel"):
        Model.from_gguf(p, backend="emu", capacity=4, progress=False)


def test_alignment(tmp_path, seed):
    """general.alignment 64 reads the same tensors as the default 32; a value
    that is not a power of two is refused by key."""
    a, b = str(tmp_path / "a32.gguf"), str(tmp_path / "a64.gguf")
    write_synthetic_llama(a, seed=seed, **TINY)
    write_synthetic_llama(b, seed=seed, alignment=64, **TINY)
    fa, fb = LlamaFile(a), LlamaFile(b)
    assert (fa.alignment, fb.alignment) == (32, 64)
    for name in fa.names:
        assert np.array_equal(fa.tensor(name).data, fb.tensor(name).data), name
    data = bytearray(open(b, "rb").read())
    key = b"general.alignment"
    at = data.index(key) + len(key) + 4          # the u32 value follows its type word
    assert int.from_bytes(data[at:at + 4], "little") == 64
    data[at:at + 4] = (48).to_bytes(4, "little")
    bad = tmp_path / "a48.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="'general.alignment' must be a non-zero power of two"):
        LlamaFile(bad)
    # a tensor whose data offset is not a multiple of the alignment
    data = bytearray(open(a, "rb").read())
    name = b"token_embd.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8 + 4     # n_dims, two dims, type, then offset
    assert int.from_bytes(data[at:at + 8], "little") == 0
    data[at:at + 8] = (4).to_bytes(8, "little")
    moved = tmp_path / "moved.gguf"
    moved.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="'token_embd.weight' starts at data offset 4, not a "
                                        "multiple of general.alignment 32"):
        LlamaFile(moved)


def test_rope_inv_freq(tmp_path, seed, rng):
    """The loader's frequencies: base^(-2i/d), divided by rope_freqs
    factors, times the linear scale; without factors and scale they are the
    RoPE kernel family's own table (so the Llama step is unchanged)."""
    from ptxgen.kernels import rope
    p = str(tmp_path / "r.gguf")
    write_synthetic_llama(p, seed=seed, rope_theta=500000.0, **TINY)
    f = LlamaFile(p)
    spec = rope.RopeSpec(head_dim=64, layout="interleaved", theta=500000.0)
    assert np.array_equal(rope.table_of(f.rope_inv_freq()), rope.freq_table(spec))
    fac = rng.uniform(1, 8, 32).astype(np.float32)
    q = str(tmp_path / "rf.gguf")
    write_synthetic_llama(q, seed=seed, rope_theta=500000.0, rope_freqs=fac, **TINY)
    want = 500000.0 ** (-np.arange(0, 64, 2) / 64) / fac.astype(np.float64)
    np.testing.assert_allclose(LlamaFile(q).rope_inv_freq(), want, rtol=1e-13)
