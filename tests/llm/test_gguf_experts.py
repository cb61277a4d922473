"""Mixture-of-experts files (qwen3moe): the expert hyperparameters, the 3-D
expert tensors checked against them, one expert's slice, and the refusals."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ptxgen.llm.gguf.file import GGUFError, LlamaFile
from ptxgen.llm.gguf.synth import PRESETS, write_synthetic_llama

from test_gguf_loader import _rewrite

MOE = PRESETS["tiny-moe"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("gguf") / "moe.gguf"
    write_synthetic_llama(str(p), seed=module_seed, **MOE)
    return str(p)


def test_expert_hparams_and_shapes(moe):
    f = LlamaFile(moe)
    hp = f.hparams
    assert (hp.arch, hp.n_expert, hp.n_expert_used, hp.expert_ffn) == ("qwen3moe", 8, 2, 256)
    assert hp.qk_norm and hp.rope_layout == "neox" and hp.head_dim == 64
    assert f.shape("blk.1.ffn_gate_inp.weight") == (8, 256)
    assert f.qtype("blk.1.ffn_gate_inp.weight") == "F32"
    assert f.shape("blk.0.ffn_gate_exps.weight") == (8, 256, 256)
    assert f.shape("blk.0.ffn_down_exps.weight") == (8, 256, 256)
    assert not f.has("blk.0.ffn_gate.weight")


def test_expert_slice_is_the_experts_matrix(moe, rng):
    """Expert e of a 3-D tensor decodes to the e-th matrix gguf decodes, and
    is a read-only view of the file."""
    from ptxgen.kernels import quants
    f = LlamaFile(moe)
    by_name = {t.name: t for t in gguf.GGUFReader(moe).tensors}
    for name in ("blk.0.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight"):
        t = by_name[name]
        full = gguf.quants.dequantize(t.data, t.tensor_type).reshape(8, 256, 256)
        for e in rng.choice(8, size=3, replace=False):
            x = f.expert(name, int(e))
            assert x.shape == (256, 256) and not x.data.flags.writeable
            ours = quants.dequantize(np.ascontiguousarray(x.data), x.qtype, x.shape)
            np.testing.assert_array_equal(ours, full[e])
    with pytest.raises(IndexError, match="expert 8 of a tensor of 8 experts"):
        f.expert("blk.0.ffn_up_exps.weight", 8)
    with pytest.raises(ValueError, match="holds no experts"):
        f.expert("blk.0.attn_q.weight", 0)


def test_expert_ffn_defaults_to_the_dense_size_per_expert_used(moe, tmp_path, rng):
    """Without expert_feed_forward_length llama.cpp takes feed_forward_length
    / expert_used_count (512 / 2 here)."""
    dst = str(tmp_path / "noexpffn.gguf")
    _rewrite(rng, moe, dst, keys={"qwen3moe.expert_feed_forward_length": None})
    assert LlamaFile(dst).hparams.expert_ffn == 256
    dst2 = str(tmp_path / "neither.gguf")
    _rewrite(rng, moe, dst2, keys={"qwen3moe.expert_feed_forward_length": None,
                                   "qwen3moe.feed_forward_length": None})
    with pytest.raises(GGUFError, match=r"'qwen3moe.expert_feed_forward_length' is missing"):
        LlamaFile(dst2)


@pytest.mark.parametrize("keys, message", [
    ({"qwen3moe.expert_count": None}, r"metadata key 'qwen3moe.expert_count' is missing"),
    ({"qwen3moe.expert_count": 0}, r"'qwen3moe.expert_count' is 0; it must be 1 to 1,024"),
    ({"qwen3moe.expert_used_count": 9},
     r"'qwen3moe.expert_used_count' is 9; it must be 1 to 8 \(at least one of the 8 experts"),
    ({"qwen3moe.expert_used_count": None}, r"'qwen3moe.expert_used_count' is missing"),
    ({"qwen3moe.expert_group_count": 4},
     r"'qwen3moe.expert_group_count' is 4: grouped expert selection is not supported"),
    ({"qwen3moe.expert_used_count": ([2, 4], gguf.GGUFValueType.ARRAY)},
     r"'qwen3moe.expert_used_count' differs between layers"),
    ({"qwen3moe.expert_feed_forward_length": 512},
     r"'blk.0.ffn_gate_exps.weight' has shape \(8, 256, 256\), expected \(8, 512, 256\) "
     r"\(experts x expert FFN x embedding: 8 from 'qwen3moe.expert_count', 512 from "
     r"'qwen3moe.expert_feed_forward_length'"),
    ({"qwen3moe.expert_count": 4}, r"'blk.0.ffn_gate_inp.weight' has shape \(8, 256\), "
                                   r"expected \(4, 256\) \(experts x embedding"),
])
def test_expert_keys_refused(moe, tmp_path, rng, keys, message):
    dst = str(tmp_path / "bad.gguf")
    _rewrite(rng, moe, dst, keys=keys)
    with pytest.raises(GGUFError, match=message):
        LlamaFile(dst)


def test_expert_tensors_refused_by_name(moe, tmp_path, rng, seed):
    dst = str(tmp_path / "dense_ffn.gguf")
    _rewrite(rng, moe, dst, add={"blk.0.ffn_gate.weight": np.zeros((512, 256))})
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_gate.weight' is not supported in a qwen3moe "
                                        r"model \(a qwen3moe FFN is its experts"):
        LlamaFile(dst)
    dst = str(tmp_path / "no_router.gguf")
    _rewrite(rng, moe, dst, drop="blk.1.ffn_gate_inp.weight")
    with pytest.raises(GGUFError, match=r"'blk.1.ffn_gate_inp.weight' is missing"):
        LlamaFile(dst)
    dense = str(tmp_path / "qwen3.gguf")
    write_synthetic_llama(dense, seed=seed, arch="qwen3", n_layers=1, hidden=256, ffn=512,
                          n_heads=4, n_kv_heads=2, vocab=512)
    dst = str(tmp_path / "qwen3_exps.gguf")
    _rewrite(rng, dense, dst, add={"blk.0.ffn_up_exps.weight": np.zeros((2, 512, 256))})
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_up_exps.weight' is not supported in a "
                                        r"qwen3 model \(a mixture of experts' router and experts "
                                        r"belong to qwen3moe"):
        LlamaFile(dst)
    dst = str(tmp_path / "qwen3_count.gguf")
    _rewrite(rng, dense, dst, keys={"qwen3.expert_count": 8})
    with pytest.raises(GGUFError, match=r"'qwen3.expert_count' > 0: mixtures of experts are not "
                                        r"supported in a qwen3 model \(supported: qwen3moe\)"):
        LlamaFile(dst)


def test_router_must_be_f32(tmp_path, seed):
    p = str(tmp_path / "router16.gguf")
    write_synthetic_llama(p, seed=seed, type_overrides={"blk.1.ffn_gate_inp.weight": "F16"},
                          **MOE)
    with pytest.raises(GGUFError, match=r"'blk.1.ffn_gate_inp.weight' has type F16, which is "
                                        r"not supported for a mixture of experts' router "
                                        r"\(supported: F32\)"):
        LlamaFile(p)
    assert LlamaFile(p, check_kernels=False).qtype("blk.1.ffn_gate_inp.weight") == "F16"


def test_q4_k_m_mix_of_a_moe_file(tmp_path, seed):
    """llama.cpp's Q4_K_M on experts: the router stays F32, ffn_down_exps of
    the layers that get more bits Q6_K, the other experts Q4_K."""
    p = str(tmp_path / "mix.gguf")
    info = write_synthetic_llama(p, seed=seed, mix="Q4_K_M", **{**MOE, "n_layers": 8})
    types = {n: t for n, t, _ in info.tensors}
    assert types["blk.3.ffn_gate_inp.weight"] == "F32"
    assert types["blk.0.ffn_down_exps.weight"] == "Q6_K"       # the first eighth
    assert types["blk.3.ffn_down_exps.weight"] == "Q6_K"       # (3 - 1) % 3 == 2
    assert types["blk.2.ffn_down_exps.weight"] == "Q4_K"
    assert types["blk.2.ffn_gate_exps.weight"] == types["blk.2.ffn_up_exps.weight"] == "Q4_K"
    f = LlamaFile(p)
    assert f.qtype("blk.7.ffn_down_exps.weight") == "Q6_K" and f.hparams.n_expert == 8
