"""``python -m ptxgen info``: every number it reports is checked against
the synthetic file it describes, computed here from what the writer was
asked for and GGML's block sizes."""

import os
import re
import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ptxgen.cli import main
from ptxgen.llm.gguf.synth import write_synthetic_llama

TINY = dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
            context_length=256)
VOCAB = os.path.join(os.path.dirname(__file__), "..", "data", "vocab")


def _bytes(qt, shape):
    # (weights, bytes) per block from the gguf package's table, not ours
    bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qt]]
    return int(np.prod(shape)) // bs * ts


def _run(capsys, *args):
    assert main(["info", *map(str, args)]) == 0
    return capsys.readouterr().out


def _num(text, pattern):
    m = re.search(pattern, text, re.M)
    assert m, f"{pattern!r} not in:\n{text}"
    return int(m.group(1).replace(",", ""))


def test_report_matches_the_file(tmp_path, capsys, seed):
    """Qwen3-shaped, Q4_K_M, with a token list: parameters, the bytes and
    parameters of each type, tokenizer, vocabulary, context, weights and
    the KV cache at the default and a given context."""
    path = tmp_path / "q3.gguf"
    info = write_synthetic_llama(path, seed=seed, arch="qwen3", head_dim=128, mix="Q4_K_M",
                                 tokenizer="llama", **TINY)
    out = _run(capsys, path)
    params = sum(int(np.prod(s)) for _, _, s in info.tensors)
    assert _num(out, r"^parameters: ([\d,]+)") == params
    by_type = {}
    for _, qt, shape in info.tensors:
        n, p, b = by_type.get(qt, (0, 0, 0))
        by_type[qt] = (n + 1, p + int(np.prod(shape)), b + _bytes(qt, shape))
    assert set(by_type) == {"Q4_K", "Q6_K", "F32"}
    for qt, (n, p, b) in by_type.items():
        row = re.search(rf"^  {qt}\s+(\d+) tensors\s+([\d,]+) parameters\s+([\d,]+) bytes\s+"
                        rf"([\d.]+) bits/weight", out, re.M)
        assert row, qt
        assert (int(row[1]), int(row[2].replace(",", "")), int(row[3].replace(",", ""))) == (n, p, b)
        assert float(row[4]) == pytest.approx(8 * b / p, abs=0.005)
    assert "tokenizer: llama (512 tokens in its list)" in out
    assert _num(out, r"^vocabulary: ([\d,]+)") == 512
    assert _num(out, r"^context length: ([\d,]+)") == 256
    assert "ptxgen decode: yes" in out
    weights = sum(b for _, _, b in by_type.values())
    assert weights == info.n_bytes
    assert _num(out, r"^weights: ([\d,]+) bytes") == weights
    kv = 2 * 2 * 2 * 256 * 128 * 2            # K and V, layers, KV heads, ctx, head, f16
    assert _num(out, r"^KV cache \(f16, 256 tokens\): ([\d,]+) bytes") == kv
    assert _num(out, r"^weights \+ KV cache: ([\d,]+) bytes") == weights + kv
    out = _run(capsys, path, "--ctx", 100)
    assert _num(out, r"^KV cache \(f16, 100 tokens\): ([\d,]+) bytes") == kv * 100 // 256


def test_fit_and_the_types_that_would(tmp_path, capsys, seed):
    """A Q8_0 Llama against a memory between its Q4_K and Q8_0 sizes: it does
    not fit; Q4_K (every matrix re-quantized) and Q4_K_M (the size of a file
    the writer's Q4_K_M mix actually produces) do, Q8_0 does not."""
    path = tmp_path / "q8.gguf"
    info = write_synthetic_llama(path, seed=seed, qtype="Q8_0", output_qtype="Q8_0", **TINY)
    m = write_synthetic_llama(tmp_path / "m.gguf", seed=seed, mix="Q4_K_M", **TINY)
    kv = 2 * 2 * 2 * 256 * 64 * 2
    want = {}
    for qt in ("Q4_K", "Q6_K", "Q8_0"):
        want[qt] = sum(_bytes(qt, s) if len(s) == 2 else _bytes(t, s) for _, t, s in info.tensors)
    want["Q4_K_M"] = m.n_bytes
    assert want["Q8_0"] == info.n_bytes
    gib = (want["Q4_K_M"] + kv + 100) / 2 ** 30
    out = _run(capsys, path, "--gpu-memory", repr(gib))
    avail = int(gib * 2 ** 30)
    assert _num(out, r"^GPU: assumed with ([\d,]+) bytes") == avail
    assert re.search(r"^GPU: .* free: does not fit$", out, re.M)
    for name, nb in want.items():
        row = re.search(rf"^  {name}\s+([\d,]+) bytes \(.*\): (fits|does not fit)$", out, re.M)
        assert row, name
        assert int(row[1].replace(",", "")) == nb + kv
        assert (row[2] == "fits") == (nb + kv <= avail), name
    assert [r for r in want if want[r] + kv <= avail] == ["Q4_K", "Q4_K_M"]
    out = _run(capsys, path, "--gpu-memory", 1)
    assert re.search(r"^GPU: assumed with 1,073,741,824 bytes .* free: fits$", out, re.M)
    assert "weight types with decode kernels" not in out


def test_files_ptxgen_cannot_run_are_still_described(tmp_path, capsys, seed, rng):
    """An F32 matrix (no GEMV reads one) and an architecture ptxgen does not
    know: the metadata-only parts are reported, with the loader's reason."""
    path = tmp_path / "f32m.gguf"
    info = write_synthetic_llama(path, seed=seed, type_overrides={"blk.0.ffn_up.weight": "F32"},
                                 **TINY)
    out = _run(capsys, path)
    assert re.search(r"^ptxgen decode: no: tensor 'blk.0.ffn_up.weight' has type F32, which is "
                     r"not supported for a matrix", out, re.M)
    assert _num(out, r"^weights: ([\d,]+) bytes") == info.n_bytes
    assert "KV cache" in out                     # the shape is known: the cache can be sized
    r = gguf.GGUFReader(path)
    other = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(other, "gpt2")
    w.add_context_length(1024)
    t = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
    w.add_tensor("blk.0.attn_q.weight", np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = _run(capsys, other)
    assert "architecture: gpt2" in out and "context length: 1,024" in out
    assert "ptxgen decode: no: architecture 'gpt2' is not supported" in out
    assert _num(out, r"^parameters: ([\d,]+)") == 256 * 256
    assert "KV cache" not in out and "vocabulary: unknown" in out


def test_bad_input(tmp_path, capsys):
    assert main(["info", str(tmp_path / "none.gguf")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" * 20)
    assert main(["info", str(bad)]) == 2
    assert "not a GGUF file" in capsys.readouterr().err
    assert main(["info", str(bad), "--ctx", "0"]) == 2
    assert "--ctx must be a positive number" in capsys.readouterr().err


def test_reads_the_file_once(tmp_path, capsys, seed, monkeypatch):
    """One read with the project's reader (never the gguf package's), for
    the report and the loader's verdict alike."""
    import ptxgen.llm.gguf.reader as reader
    path = tmp_path / "t.gguf"
    write_synthetic_llama(path, seed=seed, tokenizer="llama", **TINY)
    calls = []
    real = reader.read_gguf

    def counted(p):
        calls.append(p)
        return real(p)

    def refuse(*a, **k):
        raise AssertionError("the gguf package's reader was used")

    monkeypatch.setattr(reader, "read_gguf", counted)
    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    out = _run(capsys, path)
    assert "ptxgen decode: yes" in out and "tokenizer: llama (512 tokens in its list)" in out
    assert len(calls) == 1


def test_a_large_vocabulary_file(capsys):
    """A 128K-token vocabulary (Llama 3's, no tensors) is described in well
    under the time the gguf package's reader needed (tens of seconds)."""
    path = os.path.join(VOCAB, "ggml-vocab-llama-bpe.gguf")
    t0 = time.perf_counter()
    out = _run(capsys, path)
    seconds = time.perf_counter() - t0
    assert "tokenizer: gpt2 (128,256 tokens in its list)" in out
    assert "parameters: 0 " in out
    assert "ptxgen decode: no: tensor 'token_embd.weight' is missing" in out
    assert seconds < 5, seconds


@pytest.mark.gpu
def test_present_gpu(tmp_path, capsys, seed):
    """With a GPU, the fit is against its free memory, named."""
    from backends import cuda_available
    if not cuda_available():
        pytest.skip("no NVIDIA GPU / driver available")
    from ptxgen.driver import get_device
    path = tmp_path / "t.gguf"
    write_synthetic_llama(path, seed=seed, **TINY)
    dev = get_device()
    free, total = dev.mem_info()
    out = _run(capsys, path)
    row = re.search(r"^GPU: (.*) with ([\d,]+) bytes \(.*\) free: fits$", out, re.M)
    assert row, out
    assert row[1] == dev.name
    assert abs(int(row[2].replace(",", "")) - free) <= 0.02 * total


def test_gemma3_lines(tmp_path, capsys, seed):
    """A Gemma-3-shaped file: its sliding-window and global layers (llama.cpp's
    pattern of 6: layers 5 and 11 of 12 global), their RoPE bases, the
    attention scale (1 / sqrt(head_dim)), its SentencePiece token list, and
    and the batched engine's KV pool."""
    path = tmp_path / "g3.gguf"
    write_synthetic_llama(path, seed=seed, arch="gemma3", head_dim=128, sliding_window=96,
                          tokenizer="gemma3", tie_embeddings=True, rope_theta=1e6,
                          **dict(TINY, n_layers=12, vocab=1024))
    out = _run(capsys, path, "--gpu-memory", 1)
    assert ("sliding-window layers: 10 of 12 (the last 96 keys, RoPE base 10,000); 2 global "
            "(RoPE base 1,000,000)") in out
    assert _num(out, r"^attention score scale: 0\.(\d+)$") == 883883   # 1/sqrt(128)
    assert "tokenizer: llama (1,024 tokens in its list)" in out
    assert "ptxgen decode: yes" in out
    assert re.search(r"^batched engine KV pool: [\d,]+ tokens", out, re.M)
    # a llama file has neither line
    other = tmp_path / "l.gguf"
    write_synthetic_llama(other, seed=seed, **TINY)
    out = _run(capsys, other)
    assert "sliding-window" not in out and "score scale" not in out


def test_mixture_of_experts_lines(tmp_path, capsys, seed):
    """qwen3moe: the experts line, and the weights a decoded token reads
    (every tensor but the embedding's other rows, and of the 3-D experts'
    tensors the share used), computed from the writer's tensors here."""
    from ptxgen.llm.gguf.synth import PRESETS
    p = tmp_path / "moe.gguf"
    kw = {**PRESETS["tiny-moe"], "vocab": 512, "context_length": 256}
    info = write_synthetic_llama(str(p), seed=seed, mix="Q4_K_M", **kw)
    out = _run(capsys, p)
    E, NU, F = kw["n_expert"], kw["n_expert_used"], kw["expert_ffn"]
    assert f"experts: {E} per layer, {NU} used per token (expert FFN {F})" in out
    sizes = {n: _bytes(t, s) for n, t, s in info.tensors}
    shapes = {n: s for n, _, s in info.tensors}
    experts = sum(b for n, b in sizes.items() if n.endswith("_exps.weight"))
    want = (sum(sizes.values()) - experts + experts * NU // E
            - sizes["token_embd.weight"] + sizes["token_embd.weight"] // kw["vocab"])
    assert "output.weight" in sizes and len(shapes["blk.0.ffn_up_exps.weight"]) == 3
    assert _num(out, r"^weights read per decoded token: ([\d,]+) bytes") == want
