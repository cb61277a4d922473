"""Tests of llm/gguf/synth.py (synthetic Llama GGUF) and testing/reference.py (float64 reference)."""
from __future__ import annotations


import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ptxgen.llm.gguf import synth as gguf_synth  # noqa: E402
from ptxgen.llm.gguf.synth import PRESETS, write_synthetic_llama  # noqa: E402
from ptxgen.testing.reference import (LlamaReference, attention, load_llama_gguf,  # noqa: E402
                                     rms_norm, rope_norm, silu)

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    info = write_synthetic_llama(path, seed=module_seed, **TINY)
    return path, info


def field(reader, key):
    return reader.fields[key].contents()


def rewrite(src, dst, *, drop=(), retype=None, arch="llama"):
    """Copy a GGUF, leaving out tensors in ``drop`` and converting those in ``retype``."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        w.add_key_value(key, f.contents(), f.types[0])
    for t in r.tensors:
        if t.name in drop:
            continue
        data = np.array(t.data)
        if retype and t.name in retype:
            w.add_tensor(t.name, data.astype(retype[t.name]))
        elif t.tensor_type.name in ("F32", "F16"):
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------
# the synthetic writer

def test_synth_metadata_and_tensors(tiny):
    path, info = tiny
    r = gguf.GGUFReader(path)
    assert field(r, "general.architecture") == "llama"
    expect = {"llama.block_count": 2, "llama.embedding_length": 256, "llama.feed_forward_length": 512,
              "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
              "llama.context_length": 2048, "llama.rope.dimension_count": 64, "llama.vocab_size": 512}
    for k, v in expect.items():
        assert field(r, k) == v, k
    assert field(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert field(r, "llama.rope.freq_base") == 10000.0
    names = [t.name for t in r.tensors]
    assert names == [n for n, _, _ in info.tensors]
    assert len(names) == 1 + 9 * 2 + 2
    by = {t.name: t for t in r.tensors}
    # GGUF lists dims innermost first: a numpy [out, in] weight has ne = [in, out]
    for name, ne, typ in [("token_embd.weight", [256, 512], "Q4_K"),
                          ("blk.0.attn_q.weight", [256, 256], "Q4_K"),
                          ("blk.1.attn_k.weight", [256, 128], "Q4_K"),
                          ("blk.0.ffn_down.weight", [512, 256], "Q4_K"),
                          ("blk.0.ffn_gate.weight", [256, 512], "Q4_K"),
                          ("blk.0.attn_norm.weight", [256], "F32"),
                          ("output.weight", [256, 512], "Q6_K")]:
        t = by[name]
        assert [int(d) for d in t.shape] == ne and t.tensor_type.name == typ, name
    w = gguf.quants.dequantize(by["blk.0.ffn_down.weight"].data, by["blk.0.ffn_down.weight"].tensor_type)
    assert w.shape == (256, 512)
    assert abs(w.std() * np.sqrt(512) - 1) < 0.05        # N(0, 1/sqrt(fan_in))
    norm = np.array(by["blk.0.ffn_norm.weight"].data)
    assert abs(norm.mean() - 1) < 0.02 and 0 < norm.std() < 0.1


def test_synth_reproducible(tmp_path, seed):
    a = write_synthetic_llama(tmp_path / "a.gguf", seed=seed, **TINY)
    write_synthetic_llama(tmp_path / "b.gguf", seed=seed, **TINY)
    write_synthetic_llama(tmp_path / "c.gguf", seed=seed + 1, **TINY)
    assert a.seed == seed
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert (tmp_path / "a.gguf").read_bytes() != (tmp_path / "c.gguf").read_bytes()


def test_synth_pooled_blocks_and_types(tmp_path, seed):
    # a pool smaller than the tensors: they are assembled from quantized blocks
    p = tmp_path / "p.gguf"
    write_synthetic_llama(p, qtype="Q8_0", output_qtype="F16", tie_embeddings=False,
                          pool_weights=1 << 15, seed=seed, **TINY)
    hp, W = load_llama_gguf(p)
    by = {t.name: t for t in gguf.GGUFReader(p).tensors}
    assert by["blk.0.ffn_up.weight"].tensor_type.name == "Q8_0"
    assert by["output.weight"].tensor_type.name == "F16"
    assert abs(W["blk.0.ffn_up.weight"].std() * 16 - 1) < 0.05


def test_synth_cli(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert gguf_synth.main([str(out), "--preset", "tiny", "--seed", "3", "--quiet"]) == 0
    assert "seed 3" in capsys.readouterr().out
    assert field(gguf.GGUFReader(out), "llama.block_count") == 2
    assert gguf_synth.main([str(tmp_path / "x.gguf"), "--qtype", "Q7_K", "--quiet"]) == 2
    assert "unsupported quantization type 'Q7_K'" in capsys.readouterr().err


def test_synth_cli_conventions(tmp_path, capsys):
    """--arch, --head-dim, --mix, --tied, --vocab-size, --tokenizer and
    --rope-freqs reach the file."""
    from ptxgen.llm.gguf.file import LlamaFile
    q3 = tmp_path / "q3.gguf"
    assert gguf_synth.main([str(q3), "--arch", "qwen3", "--head-dim", "128", "--mix", "Q4_K_M",
                            "--tied", "--vocab-size", "1024", "--tokenizer", "llama",
                            "--seed", "1", "--quiet"]) == 0
    f = LlamaFile(q3)
    hp = f.hparams
    assert (hp.arch, hp.head_dim, hp.qk_norm, hp.tied, hp.vocab) == ("qwen3", 128, True, True, 1024)
    assert f.tokenizer_model == "llama" and f.qtype("token_embd.weight") == "Q6_K"
    assert field(gguf.GGUFReader(q3), "general.file_type") == 15
    l31 = tmp_path / "l31.gguf"
    assert gguf_synth.main([str(l31), "--rope-freqs", "--seed", "1", "--quiet"]) == 0
    f = LlamaFile(l31)
    assert f.hparams.rope_freqs
    want = gguf_synth.llama31_rope_factors(64, 10000.0)
    assert np.array_equal(f.tensor("rope_freqs.weight").data, want)
    # Llama 3.1's rule: factor 1 at short wavelengths, 8 at long ones, a blend between
    assert want[0] == 1.0 and want[-1] == 8.0 and np.all(np.diff(want) >= 0)
    capsys.readouterr()
    assert gguf_synth.main([str(tmp_path / "x.gguf"), "--arch", "qwen2", "--rope-freqs",
                            "--quiet"]) == 2
    assert "rope_freqs is a llama convention" in capsys.readouterr().err


def test_synth_refuses_bad_shapes(tmp_path):
    with pytest.raises(ValueError, match=r"token_embd.weight \(64, 192\) cannot be stored as Q4_K: .*K=192"):
        write_synthetic_llama(tmp_path / "x.gguf", n_layers=1, hidden=192, ffn=256, n_heads=3,
                              n_kv_heads=1, vocab=64)
    with pytest.raises(ValueError, match="n_heads=4 is not a multiple of n_kv_heads=3"):
        write_synthetic_llama(tmp_path / "x.gguf", n_layers=1, hidden=256, ffn=256, n_heads=4,
                              n_kv_heads=3, vocab=64)


# ---------------------------------------------------------------------------
# the reference forward pass

def test_reference_shapes_and_determinism(tiny):
    path, _ = tiny
    a, b = LlamaReference(path), LlamaReference(path)
    assert a.hparams.head_dim == 64 and a.hparams.vocab == 512
    toks = [1, 17, 300, 511, 0]
    la = [a.step(t) for t in toks]
    lb = [b.step(t) for t in toks]
    for x, y in zip(la, lb):
        assert x.shape == (512,) and x.dtype == np.float64 and np.isfinite(x).all()
        assert np.array_equal(x, y)
    assert 0.1 < la[-1].std() < 10                       # sensibly scaled logits
    a.reset()
    assert np.array_equal(a.step(toks[0]), la[0])
    assert not np.array_equal(la[0], la[1])
    assert len(b.generate([5, 6], 4)) == 4


def test_kv_dtype_option(tiny):
    path, _ = tiny
    f16, f64 = LlamaReference(path), LlamaReference(path, kv_dtype=None)
    for t in (3, 4, 5, 6):
        x, y = f16.step(t), f64.step(t)
    d = np.abs(x - y).max() / np.abs(y).max()
    assert 0 < d < 1e-2


def test_reference_against_independent_prefill(tiny):
    """The cached one-token-at-a-time pass equals a full-sequence causal pass written here
    another way (RoPE as complex rotations, attention as masked matrices)."""
    path, _ = tiny
    hp, W = load_llama_gguf(path)
    toks = [7, 100, 42, 7, 509, 256]
    ref = LlamaReference(path, kv_dtype=None)
    cached = np.stack([ref.step(t) for t in toks])

    n, H, KV, d = len(toks), hp.n_heads, hp.n_kv_heads, hp.head_dim
    freq = hp.rope_theta ** (-np.arange(d // 2) * 2.0 / d)
    rot = np.exp(1j * np.outer(np.arange(n), freq))          # (n, d/2)

    def rope(x):                                              # x: (n, heads, d)
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * rot[:, None, :]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out

    def norm(x, w):
        return x * w / np.sqrt((x ** 2).mean(-1, keepdims=True) + hp.eps)

    x = W["token_embd.weight"][toks]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(hp.n_layers):
        b = f"blk.{i}."
        h = norm(x, W[b + "attn_norm.weight"])
        q = rope((h @ W[b + "attn_q.weight"].T).reshape(n, H, d))
        k = rope((h @ W[b + "attn_k.weight"].T).reshape(n, KV, d))
        v = (h @ W[b + "attn_v.weight"].T).reshape(n, KV, d)
        heads = []
        for hh in range(H):
            kv = hh * KV // H
            s = q[:, hh] @ k[:, kv].T / np.sqrt(d) + mask
            p = np.exp(s - s.max(1, keepdims=True))
            heads.append((p / p.sum(1, keepdims=True)) @ v[:, kv])
        x = x + np.concatenate(heads, axis=1) @ W[b + "attn_output.weight"].T
        h = norm(x, W[b + "ffn_norm.weight"])
        g, u = h @ W[b + "ffn_gate.weight"].T, h @ W[b + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[b + "ffn_down.weight"].T
    full = norm(x, W["output_norm.weight"]) @ W["output.weight"].T
    assert np.allclose(cached, full, rtol=0, atol=1e-10 * np.abs(full).max())


def test_weights_are_gguf_decoded(tiny):
    path, _ = tiny
    _, W = load_llama_gguf(path)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.attn_v.weight")
    assert np.array_equal(W["blk.1.attn_v.weight"], gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64))


def test_tied_embeddings(tmp_path, seed):
    p = tmp_path / "tied.gguf"
    write_synthetic_llama(p, tie_embeddings=True, seed=seed, **TINY)
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(p).tensors}
    m = LlamaReference(p)
    assert m.weights["output.weight"] is m.weights["token_embd.weight"]
    assert m.step(1).shape == (512,)


# ---------------------------------------------------------------------------
# hand-sized maths

def test_rope_norm_by_hand():
    x = np.array([[1.0, 0.0, 0.0, 1.0, 5.0, 6.0]])
    y = rope_norm(x, pos=1, theta=100.0, n_rot=4)
    # pair 0 turns by 1 rad, pair 1 by 100^(-2/4) = 0.1 rad; dims 4, 5 are not rotated
    assert np.allclose(y, [[np.cos(1), np.sin(1), -np.sin(0.1), np.cos(0.1), 5.0, 6.0]])
    assert np.array_equal(rope_norm(x, pos=0, theta=100.0, n_rot=4), x)
    y3 = rope_norm(np.array([2.0, 0.0]), pos=3, theta=10000.0, n_rot=2)
    assert np.allclose(y3, [2 * np.cos(3), 2 * np.sin(3)])


def test_attention_by_hand():
    # 4 query heads share 2 KV heads (heads 0,1 -> kv 0; heads 2,3 -> kv 1); d = 2, two positions
    q = np.array([[1.0, 0.0], [0.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    k = np.array([[[1.0, 0.0], [-1.0, 0.0]], [[0.0, 1.0], [0.0, 0.0]]])
    v = np.array([[[1.0, 2.0], [3.0, 4.0]], [[10.0, 0.0], [0.0, 10.0]]])
    out = attention(q, k, v)
    s = 1 / np.sqrt(2)
    p0 = 1 / (1 + np.exp(-2 * s))                 # head 0: scores (s, -s)
    p2 = 1 / (1 + np.exp(-2 * s))                 # head 2: scores (2s, 0)
    p3 = 1 / (1 + np.exp(-s))                     # head 3: scores (s, 0)
    assert np.allclose(out[0], p0 * v[0, 0] + (1 - p0) * v[0, 1])
    assert np.allclose(out[1], (v[0, 0] + v[0, 1]) / 2)   # equal scores
    assert np.allclose(out[2], p2 * v[1, 0] + (1 - p2) * v[1, 1])
    assert np.allclose(out[3], p3 * v[1, 0] + (1 - p3) * v[1, 1])


def test_rms_norm_and_silu_by_hand():
    assert np.allclose(rms_norm(np.array([3.0, 4.0]), np.array([1.0, 2.0]), 0.0),
                       [3 / np.sqrt(12.5), 8 / np.sqrt(12.5)])
    assert np.allclose(silu(np.array([0.0, 1.0])), [0.0, 1 / (1 + np.exp(-1))])


# ---------------------------------------------------------------------------
# refusals

def test_refuses_wrong_architecture(tmp_path, tiny):
    p = tmp_path / "gpt2.gguf"
    rewrite(tiny[0], p, arch="gpt2")
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported "
                                         r"\(supported: llama, mistral, qwen2, qwen3, gemma3, qwen3moe\)"):
        LlamaReference(p)


def test_refuses_missing_tensor(tmp_path, tiny):
    p = tmp_path / "missing.gguf"
    rewrite(tiny[0], p, drop={"blk.1.ffn_up.weight"})
    with pytest.raises(ValueError, match=r"tensor 'blk.1.ffn_up.weight' is missing"):
        LlamaReference(p)


def test_refuses_unsupported_type(tmp_path, tiny):
    p = tmp_path / "f64.gguf"
    rewrite(tiny[0], p, retype={"blk.0.attn_norm.weight": np.float64})
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_norm.weight' has type F64, which is not supported"):
        LlamaReference(p)


def test_refuses_truncated_file(tmp_path, tiny):
    data = tiny[0].read_bytes()
    for cut, what in [(len(data) - 5000, "tensor data"), (200, "metadata")]:
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated") as e:
            LlamaReference(p)
        assert str(p) in str(e.value), what
    with pytest.raises(ValueError, match="nope.gguf: no such file"):
        LlamaReference(tmp_path / "nope.gguf")


def test_refuses_bad_tokens_and_context_overflow(tiny):
    m = LlamaReference(tiny[0], max_context=3)
    with pytest.raises(ValueError, match=r"token id 512 is outside the vocabulary \(0..511\)"):
        m.step(512)
    for t in (1, 2, 3):
        m.step(t)
    with pytest.raises(ValueError, match="context is full: 3 positions used"):
        m.step(4)
