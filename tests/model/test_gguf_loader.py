"""GGUF loading: hyperparameters, raw tensors, and refusals of bad files."""

import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ptxgen.driver.model.gguf_loader import GGUFError, LlamaFile
from ptxgen.driver.model.gguf_synth import write_synthetic_llama

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
    ref = gguf.quants.dequantize(f.reader.tensors[[x.name for x in f.reader.tensors].index(
        "blk.0.attn_q.weight")].data, gguf.GGMLQuantizationType.Q4_K)
    np.testing.assert_array_equal(f.dequantized("blk.0.attn_q.weight"), ref.reshape(256, 256))


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


def _rewrite(rng, src, dst, *, arch=None, drop=None, retype=None):
    """Copy a GGUF, changing the architecture, dropping or retyping a tensor."""
    r = gguf.GGUFReader(src)
    a = arch or "llama"
    w = gguf.GGUFWriter(dst, a)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = name.replace("llama.", f"{a}.") if arch else name
        v = field.contents()
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(key, v)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_string(key, v)
        else:
            w.add_key_value(key, v, vt)
    for t in r.tensors:
        if t.name == drop:
            continue
        shape = [int(d) for d in reversed(t.shape)]
        if t.name == retype:   # re-store this weight as Q5_0, a type we do not decode
            vals = rng.standard_normal(shape).astype(np.float32)
            q5 = gguf.quants.quantize(vals, gguf.GGMLQuantizationType.Q5_0)
            w.add_tensor(t.name, np.asarray(q5), raw_dtype=gguf.GGMLQuantizationType.Q5_0)
        else:
            raw_shape = shape if t.tensor_type.name in ("F32", "F16") else None
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=raw_shape, raw_dtype=t.tensor_type)
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
    dst = str(tmp_path / "q5.gguf")
    _rewrite(rng, tiny, dst, retype="blk.0.attn_v.weight")
    with pytest.raises(GGUFError, match="'blk.0.attn_v.weight' has type Q5_0, which is not supported"):
        LlamaFile(dst)
