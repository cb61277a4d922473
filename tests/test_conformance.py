"""Tests of scripts/conformance.py: its emulation of llama.cpp's activation
rounding, its pass/fail rules, and (when a llama.cpp build is present) a run
against llama.cpp on a tiny synthetic model.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("conformance", ROOT / "scripts" / "conformance.py")
conf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conf)


@pytest.fixture
def seed(request):
    s = int.from_bytes(os.urandom(8), "little")
    print(f"{request.node.name}: seed={s}")
    return s


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)


def test_q8_k_rounding(rng, seed):
    # blocks of 256: the signed extreme lands on -127 steps, every value on a step
    # d = max/-127 (float32), and no value moves by more than half a step
    x = (rng.standard_normal((3, 512)) * rng.uniform(0.01, 100)).astype(np.float32)
    x[0, 256:] = 0                                              # an all-zero block stays zero
    y = conf._round_q8_k(x).astype(np.float64)
    assert not y[0, 256:].any()
    for b in (x[0, :256], x[1, :256], x[1, 256:], x[2, :256], x[2, 256:]):
        mx = float(b[np.abs(b).argmax()])
        d = float(np.float32(1) / (np.float32(-127) / np.float32(mx)))
        yb = conf._round_q8_k(b[None, :]).astype(np.float64)[0]
        steps = yb / d
        assert np.allclose(steps, np.round(steps), atol=1e-4), f"seed={seed}"
        assert np.round(steps).min() >= -127 and np.round(steps).max() <= 127
        assert np.abs(yb - b).max() <= abs(d) * 0.5 * (1 + 1e-5), f"seed={seed}"
        assert yb[np.abs(b).argmax()] == pytest.approx(mx, rel=1e-6)
    assert np.array_equal(y[1:, :256], np.stack([conf._round_q8_k(x[i, None, :256])[0]
                                                 for i in (1, 2)]))


# the spacing of the rounding grid, relative to max|x| of a block (Q8_0) or to |x| (floats;
# f16's normal range starts at 2^-14, below it the spacing is absolute)
@pytest.mark.parametrize("kind,step", [("Q8_0", 1 / 127), ("F16", 2.0 ** -10), ("BF16", 2.0 ** -7)])
def test_activation_rounding_error(kind, step, rng, seed):
    x = rng.standard_normal((4, 256))
    y = conf.activation_rounding(kind)(x).astype(np.float64)
    scale = (np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) if kind == "Q8_0"
             else np.maximum(np.abs(x), 2.0 ** -14).reshape(-1, 32))
    rel = np.abs(y - x).reshape(-1, 32) / scale
    assert 0 < rel.max() <= step * 0.5 * 1.01 + (2.0 ** -11 if kind == "Q8_0" else 0), f"seed={seed}"


def _logits(rng, n=3, v=200):
    return rng.standard_normal((n, v)) * 3


def test_compare_passes_small_noise_and_fails_a_flip(rng, seed):
    ours = _logits(rng)
    ours[:, 7] = ours.max(axis=1) + 2.0                         # a clear winner at every position
    emulated = ours + rng.standard_normal(ours.shape) * 1e-3
    theirs = ours + rng.standard_normal(ours.shape) * 1e-3
    res = conf.compare(ours, theirs, emulated)
    assert res["ok"] and res["top1_agree"] == 3 and res["decided"] == 3, f"seed={seed}"
    flipped = theirs.copy()
    flipped[1, 9] = flipped[1, 7] + 1.0                         # llama.cpp prefers another token, clearly
    res = conf.compare(ours, flipped, emulated)
    assert not res["ok"] and [p["ok"] for p in res["positions"]] == [True, False, True]


def test_compare_undecided_flip_passes_low_cosine_fails(rng, seed):
    ours = _logits(rng)
    ours[:, 7] = ours.max(axis=1) + 2.0
    ours[0, 9] = ours[0, 7] - 1e-4                              # a near tie at position 0
    emulated = ours + rng.standard_normal(ours.shape) * 1e-2
    theirs = ours.copy()
    theirs[0, 9] = theirs[0, 7] + 1e-4                          # llama.cpp breaks it the other way
    res = conf.compare(ours, theirs, emulated)
    assert res["positions"][0]["ok"] and not res["positions"][0]["decided"], f"seed={seed}"
    far = ours + rng.standard_normal(ours.shape) * 1.0          # cosine far below the bound
    res = conf.compare(ours, far, emulated)
    assert not res["ok"]


def test_compare_analytic_bound(rng, seed):
    ours = _logits(rng)
    ours[:, 7] = ours.max(axis=1) + 2.0
    eps = 0.02
    theirs = ours + rng.standard_normal(ours.shape) * eps * np.sqrt(np.mean(ours ** 2))
    res = conf.compare(ours, theirs, analytic_eps=eps)
    assert res["ok"], f"seed={seed}"
    assert res["positions"][0]["cos_min"] == pytest.approx(1 - 4 * eps ** 2 / 2 - 1e-6)
    res = conf.compare(ours, ours + (theirs - ours) * 3, analytic_eps=eps)   # 9x the deficit
    assert not res["ok"], f"seed={seed}"
    with pytest.raises(ValueError, match="needs emulated logits or analytic_eps"):
        conf.compare(ours, theirs)


def test_analytic_error_counts_each_rounded_input(tmp_path):
    from ptxgen.llm.gguf.synth import PRESETS, write_synthetic_llama
    p = tmp_path / "m.gguf"
    write_synthetic_llama(p, **PRESETS["tiny"], qtype="Q4_K", output_qtype="Q8_0", seed=1)
    per_layer = 3 * 7.0e-3 ** 2 + 1.54e-2 ** 2                 # Q8_K inputs, the SwiGLU one larger
    assert conf.analytic_error(p) == pytest.approx(np.sqrt(2 * per_layer + 5.4e-3 ** 2))
    write_synthetic_llama(p, **PRESETS["tiny"], qtype="F32", output_qtype="F32", seed=1)
    assert conf.analytic_error(p) == 0


def test_near_ties_counts_and_refuses(rng, seed):
    """A forced expert choice counts where it differs from the reference's
    own, and passes only as a near tie of it (router-logit shortfall in rms
    units within the bound)."""
    z = rng.standard_normal(8)
    order = np.argsort(-z, kind="stable")
    own = [[(order[:2], z)]]
    near = z.copy()
    near[order[2]] = z[order[1]] - 1e-4            # the third within 1e-4 of the second
    swapped = np.array([order[0], order[2]])
    assert conf.near_ties([[(order[:2], near)]], [[(swapped, near)]], tol=1e-2)[0] == 1
    assert conf.near_ties(own, [[(order[:2], z)]], tol=0.0) == (0, 0.0)
    far = np.array([order[0], order[-1]])
    gap = (z[order[1]] - z[order[-1]]) / np.sqrt(np.mean(z * z))
    with pytest.raises(AssertionError, match="no near tie"):
        conf.near_ties(own, [[(far, z)]], tol=0.5 * gap)


def _oracle():
    env = os.environ.get("PTXGEN_LLAMACPP_LOGITS")
    if env:
        return Path(env)
    cache = Path(os.environ.get("PTXGEN_CACHE_DIR", Path.home() / ".cache" / "ptxgen"))
    found = sorted(cache.glob("llama.cpp-*/build/ptxgen-logits"))
    return found[-1] if found else None


#: ptxgen's side of a comparison: the float64 reference, the decode step on
#: the emulator, the decode step on the GPU
SIDE_PARAMS = ["ref", "emu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _need_side(side):
    """The GPU side is skipped, not failed, where there is no GPU."""
    if side == "cuda":
        from backends import cuda_available
        if not cuda_available():
            pytest.skip("no NVIDIA GPU / driver available")


@pytest.mark.slow
@pytest.mark.parametrize("side", SIDE_PARAMS)
@pytest.mark.parametrize("qtype,out_qtype", [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("F16", "F16"),
                                           ("F32", "F32")])
def test_tiny_model_matches_llamacpp(qtype, out_qtype, side, tmp_path, seed):
    if qtype == "F32" and side != "ref":
        pytest.skip("the decode step has no F32 matrix kernel (the loader refuses F32 "
                    "matrices); an F32 file is compared on the reference side")
    _need_side(side)
    oracle = _oracle()
    if oracle is None or not oracle.is_file():
        pytest.skip("no llama.cpp build (make llamacpp)")
    model = tmp_path / "tiny.gguf"
    from ptxgen.llm.gguf.synth import PRESETS, write_synthetic_llama
    write_synthetic_llama(model, **PRESETS["tiny"], qtype=qtype, output_qtype=out_qtype,
                          seed=seed % 2**32)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "conformance.py"), str(model),
                          "--oracle", str(oracle), "--seed", str(seed % 2**32), "--n-tokens", "6",
                          "--side", side],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(res.stdout)
    assert res.returncode == 0, f"seed={seed}\n{res.stdout}"


CONVENTIONS = {
    "llama31_q4km": dict(rope_freqs=True, mix="Q4_K_M"),
    "llama31_q4km_tied": dict(rope_freqs=True, mix="Q4_K_M", tie_embeddings=True),
    "mistral_nemo": dict(arch="mistral", head_dim=128),
    "qwen25_tied": dict(arch="qwen2", tie_embeddings=True, mix="Q4_K_M"),
    "qwen3": dict(arch="qwen3", head_dim=128, tokenizer="llama"),
    # Gemma 3: a window of 4 keys on layer 0 (pattern 2), so the 8 positions
    # reach past it; its SentencePiece vocabulary and tied output, in the
    # Q4_K_M mix (Q4_K, Q6_K) and in Q8_0
    "gemma3_q4km": dict(arch="gemma3", head_dim=128, vocab=1024, sliding_window=4,
                        swa_pattern=2, rope_theta=1e6, tie_embeddings=True, tokenizer="gemma3",
                        mix="Q4_K_M"),
    "gemma3_q8_0": dict(arch="gemma3", head_dim=64, vocab=1024, sliding_window=4,
                        swa_pattern=2, rope_theta=1e6, tie_embeddings=True, tokenizer="gemma3",
                        qtype="Q8_0", output_qtype="Q8_0"),
    # a mixture of experts in llama.cpp's Q4_K_M mix for MoE files: every expert used (no
    # selection near ties, so every side), and 2 of 8 (the reference side, which runs the
    # experts llama.cpp's rounding chose where a near tie went the other way)
    "qwen3moe_q4km_all": dict(arch="qwen3moe", head_dim=64, n_expert=4, n_expert_used=4,
                              expert_ffn=256, mix="Q4_K_M"),
    "qwen3moe_q4km": dict(arch="qwen3moe", head_dim=64, n_expert=8, n_expert_used=2,
                          expert_ffn=256, mix="Q4_K_M", sides=("ref",)),
}


@pytest.mark.slow
@pytest.mark.parametrize("side", SIDE_PARAMS)
@pytest.mark.parametrize("name", sorted(CONVENTIONS))
def test_conventions_match_llamacpp(name, side, tmp_path, seed):
    """Files in each architecture's conventions (gguf_synth): llama.cpp's
    logits against ptxgen's (the float64 reference, the decode step on the
    emulator and on the GPU)."""
    conv = dict(CONVENTIONS[name])
    if side not in conv.pop("sides", (side,)):
        pytest.skip(f"{name} is compared on the reference side only: its router's near ties "
                    "go either way with llama.cpp's rounding")
    _need_side(side)
    oracle = _oracle()
    if oracle is None or not oracle.is_file():
        pytest.skip("no llama.cpp build (make llamacpp)")
    model = tmp_path / f"{name}.gguf"
    from ptxgen.llm.gguf.synth import PRESETS, write_synthetic_llama
    write_synthetic_llama(model, **{**PRESETS["tiny"], **conv}, seed=seed % 2**32)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "conformance.py"), str(model),
                          "--oracle", str(oracle), "--seed", str(seed % 2**32), "--n-tokens", "8",
                          "--side", side],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(res.stdout)
    assert res.returncode == 0, f"seed={seed}\n{res.stdout}"
