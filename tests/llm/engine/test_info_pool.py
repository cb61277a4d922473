"""``python -m ptxgen info`` says how many tokens the batched engine's KV
pool holds at ``--gpu-memory``, computed here from the file's shape."""

import re

import pytest

pytest.importorskip("gguf")

from ptxgen.cli import main
from ptxgen.llm.engine.blocks import DEFAULT_BLOCK_SIZE
from ptxgen.llm.gguf.synth import write_synthetic_llama

GIB = 1 << 30


@pytest.fixture(scope="module")
def path(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("info") / "tiny.gguf"
    write_synthetic_llama(p, seed=module_seed, n_layers=3, hidden=256, ffn=512, n_heads=4,
                          n_kv_heads=2, vocab=512, context_length=256)
    return p


def _weights(out):
    return int(re.search(r"^weights: ([\d,]+) bytes", out, re.M)[1].replace(",", ""))


@pytest.mark.parametrize("gib, util", [(0.5, None), (2.0, 0.5), (0.001, 1.0)])
def test_the_pool_line_counts_tokens_and_sequences(path, capsys, gib, util):
    args = ["info", str(path), "--gpu-memory", str(gib), "--ctx", "200"]
    if util is not None:
        args += ["--gpu-memory-utilization", str(util)]
    assert main(args) == 0
    out = capsys.readouterr().out
    per_token = 3 * 2 * 2 * 64 * 2                 # layers * (K, V) * kv heads * head_dim * f16
    left = max(0, int(gib * GIB) - _weights(out))
    blocks = int(left * (util or 0.9)) // (per_token * DEFAULT_BLOCK_SIZE)
    m = re.search(r"^batched engine KV pool: ([\d,]+) tokens \(([\d,]+) blocks of (\d+), "
                  r"([\d,]+) sequences of 200 tokens\) in (\d+)% of the ([\d,]+) bytes", out, re.M)
    assert m, out
    n = [int(g.replace(",", "")) for g in m.groups()]
    assert n == [blocks * DEFAULT_BLOCK_SIZE, blocks, DEFAULT_BLOCK_SIZE,
                 blocks * DEFAULT_BLOCK_SIZE // 200, round(100 * (util or 0.9)), left]


def test_a_bad_utilization_is_one_error_line(path, capsys):
    assert main(["info", str(path), "--gpu-memory", "1", "--gpu-memory-utilization", "0"]) == 2
    assert "error: --gpu-memory-utilization must be in (0, 1], got 0.0" in capsys.readouterr().err
