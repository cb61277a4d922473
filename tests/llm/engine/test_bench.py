"""``python -m ptxgen bench``: the pp/tg table on the emulator, the batched
table's arithmetic and timing on the fake runner, both tables from the
command once the batched runner is there, and bad flags."""

import importlib.util
import re
import time

import pytest

pytest.importorskip("gguf")

from engine_fakes import FakeRunner
from ptxgen.cli import main
from ptxgen.llm.bench import BatchedResult, batched_bench, format_batched, read_batched
from ptxgen.llm.engine import Engine
from ptxgen.llm.gguf.synth import write_synthetic_llama

SMALL = dict(n_layers=1, hidden=128, ffn=256, n_heads=2, n_kv_heads=1, qtype="Q8_0",
             output_qtype="Q8_0", context_length=64, vocab=256)
HEAD = ("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |"
        "      T s |    S t/s |")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    write_synthetic_llama(p, seed=module_seed, **SMALL)
    return str(p)


class TimedRunner(FakeRunner):
    """The fake runner, each prefill call taking 2 ms and each decode step 1 ms at least."""

    def prefill(self, chunk):
        time.sleep(0.002)
        return super().prefill(chunk)

    def decode(self, rows):
        time.sleep(0.001)
        return super().decode(rows)


def test_the_batched_table_counts_and_times_the_engines_work(rng):
    runner = TimedRunner(num_blocks=256, block_size=4, max_batch=8, chunk=16)
    with Engine(runner) as eng:
        rows = batched_bench(eng, (8, 20), (3,), (1, 2, 8), warmup=False, rng=rng)
        assert len(runner.calls) > 0
    assert [(r.pp, r.tg, r.b) for r in rows] == [(8, 3, 1), (8, 3, 2), (8, 3, 8),
                                                 (20, 3, 1), (20, 3, 2), (20, 3, 8)]
    # replay the calls each row made: prompt tokens in prefill calls, rows in decode steps
    calls = list(runner.calls)
    for r in rows:
        n_pre = n_dec = pre_tok = dec_rows = 0
        while pre_tok + dec_rows < r.b * r.pp + r.b * r.tg:
            c = calls.pop(0)
            if c[0] == "prefill":
                n_pre, pre_tok = n_pre + 1, pre_tok + c[1]
            else:
                n_dec, dec_rows = n_dec + 1, dec_rows + c[1]
        assert pre_tok + dec_rows == r.b * (r.pp + r.tg)
        assert r.n_kv == r.b * (r.pp + r.tg)
        assert r.t_pp >= 0.002 * n_pre and r.t_tg >= 0.001 * n_dec
        assert r.t >= r.t_pp + r.t_tg
        assert r.s_pp == pytest.approx(r.b * r.pp / r.t_pp)
        assert r.s_tg == pytest.approx(r.b * r.tg / r.t_tg)
        assert r.s == pytest.approx(r.n_kv / r.t)
    assert not calls


def test_format_batched_has_llama_batched_benchs_columns():
    r = BatchedResult(pp=128, tg=64, b=4, t_pp=0.5, t_tg=2.0, t=2.75)
    text = format_batched([r], "engine: n_kv_max = 4096")
    lines = text.splitlines()
    assert lines[0] == "engine: n_kv_max = 4096" and lines[2] == HEAD
    assert set(lines[3]) == {"|", "-"} and len(lines[3]) == len(HEAD)
    assert lines[4] == ("|   128 |     64 |    4 |    768 |    0.500 |  1024.00 |    2.000 |"
                        "   128.00 |    2.750 |   279.27 |")


def test_read_batched_reads_both_tables_rates():
    """Our table read back, and llama-batched-bench's (a row of an H200 run),
    by B; the header, the rule and other lines are skipped."""
    rows = [BatchedResult(pp=128, tg=64, b=b, t_pp=0.5 * b, t_tg=2.0, t=2.75 * b) for b in (1, 8)]
    got = read_batched("log line\n" + format_batched(rows, "engine: n_kv_max = 4096"))
    assert sorted(got) == [1, 8]
    for r in rows:
        # the table prints rates to two decimals
        assert got[r.b] == {"s_pp": round(r.s_pp, 2), "s_tg": round(r.s_tg, 2), "s": round(r.s, 2)}
    peer = ("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |"
            "      T s |    S t/s |\n"
            "|   128 |    128 |   32 |   8192 |    0.407 | 10059.14 |    1.190 |  3440.97 |"
            "    1.598 |  5127.84 |\n")
    assert read_batched(peer) == {32: {"s_pp": 10059.14, "s_tg": 3440.97, "s": 5127.84}}


def test_bench_prints_the_pp_tg_table_on_the_emulator(model_path, capsys):
    assert main(["bench", model_path, "--backend", "emu", "-p", "3", "-n", "2", "-r", "2",
                 "-npl", "0", "--no-warmup", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("| model") and lines[0].rstrip().endswith("t/s |")
    rows = [ln for ln in lines if re.search(r"\| +(pp3|tg2) \|", ln)]
    assert len(rows) == 2 and all(" emu " in ln for ln in rows)
    for ln in rows:
        mean, std = re.search(r"\| +([0-9.]+) ± ([0-9.]+) \|$", ln).groups()
        assert float(mean) > 0
    assert "PP" not in out                  # -npl 0: no batched table


@pytest.mark.skipif(importlib.util.find_spec("ptxgen.llm.engine.runner") is None,
                    reason="the batched runner (ptxgen/llm/engine/runner.py) is not there yet")
def test_bench_prints_both_tables_on_the_emulator(model_path, capsys):
    assert main(["bench", model_path, "--backend", "emu", "-p", "3", "-n", "2", "-r", "1",
                 "-npp", "3", "-ntg", "2", "-npl", "1,2", "--seed", "1"]) == 0
    out, _ = capsys.readouterr()
    assert re.search(r"\| +pp3 \|", out) and re.search(r"\| +tg2 \|", out)
    assert HEAD in out
    rows = [ln for ln in out.splitlines() if re.match(r"\|\s+3 \|\s+2 \|", ln)]
    assert [int(ln.split("|")[3]) for ln in rows] == [1, 2]
    assert [int(ln.split("|")[4]) for ln in rows] == [5, 10]
    assert "read floor" not in out          # no copy bandwidth on the emulator


def test_bench_no_overlap_prints_the_same_batched_counts(model_path, capsys):
    """``--no-overlap`` (every decode step synchronous) runs the same work."""
    assert main(["bench", model_path, "--backend", "emu", "-p", "0", "-n", "0", "-r", "1",
                 "-npp", "3", "-ntg", "2", "-npl", "2", "--seed", "1", "--no-warmup",
                 "--no-overlap"]) == 0
    out, _ = capsys.readouterr()
    rows = [ln for ln in out.splitlines() if re.match(r"\|\s+3 \|\s+2 \|", ln)]
    assert [int(ln.split("|")[4]) for ln in rows] == [10]


@pytest.mark.parametrize("args, msg", [
    (["-p", "x"], "expected comma-separated integers, got 'x'"),
    (["-npl", "-1"], "expected comma-separated integers >= 0"),
    (["--gpu-memory-utilization", "1.5"], r"--gpu-memory-utilization must be in \(0, 1\]"),
    (["-npp", "0"], "-npp needs at least one prompt length above 0"),
])
def test_bad_flags_are_one_error_line(model_path, capsys, args, msg):
    try:
        rc = main(["bench", model_path, "--backend", "emu", "-p", "0", "-n", "0"] + args)
    except SystemExit as e:                 # argparse's own errors
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert re.search(msg, err) and "Traceback" not in err


def test_a_missing_file_is_one_error_line(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "nope.gguf"), "-npl", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "nope.gguf" in err


# -- the decode read floor ---------------------------------------------------

def _independent_bytes(path, contexts, n_layers, n_kv_heads, head_dim, windows=None):
    """The step's bytes counted with the gguf package's own reader: every
    tensor's bytes (the embedding's rows of the batch where an output matrix
    exists), plus K and V (f16) per layer up to each context or window."""
    import gguf
    r = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    rows = {t.name: int(t.shape[-1]) for t in r.tensors}      # GGUF: innermost first
    total = sum(n for name, n in sizes.items() if name != "token_embd.weight")
    if "output.weight" in sizes:
        total += sizes["token_embd.weight"] // rows["token_embd.weight"] * len(contexts)
    else:
        total += sizes["token_embd.weight"]
    for layer in range(n_layers):
        w = windows[layer] if windows else 0
        total += sum(2 * n_kv_heads * head_dim * 2 * (min(c, w) if w else c) for c in contexts)
    return total


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_step_read_bytes_counts_weights_once_and_each_sequences_kv(tmp_path, module_seed, rng,
                                                                     family):
    from ptxgen.llm.bench import step_read_bytes
    from ptxgen.llm.gguf.file import LlamaFile
    kw = dict(n_layers=3, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=300,
              context_length=256, qtype="Q4_K", seed=module_seed)
    windows = None
    if family == "gemma3":          # tied output; layers 0 and 1 a window of 5 keys
        kw.update(arch="gemma3", head_dim=64, sliding_window=5, swa_pattern=3,
                  rope_theta_swa=1e4, tie_embeddings=True)
        windows = (5, 5, 0)
    path = str(tmp_path / f"{family}.gguf")
    write_synthetic_llama(path, **kw)
    f = LlamaFile(path)
    contexts = [int(c) for c in rng.integers(1, 40, int(rng.integers(1, 9)))]
    want = _independent_bytes(path, contexts, 3, 2, 64, windows)
    assert step_read_bytes(f, contexts) == want, contexts
    # more keys, more bytes: one more key in one sequence adds its K and V rows
    # in every layer whose window does not stop it
    grown = [contexts[0] + 1] + contexts[1:]
    per_layer = 2 * 2 * 64 * 2
    n_open = sum(1 for w in (windows or (0, 0, 0)) if not w or contexts[0] < w)
    assert step_read_bytes(f, grown) - want == per_layer * n_open


def test_step_read_bytes_refuses_experts_and_empty_batches(tmp_path, module_seed):
    from ptxgen.llm.bench import step_read_bytes
    from ptxgen.llm.gguf.file import LlamaFile
    from ptxgen.llm.gguf.synth import PRESETS
    path = str(tmp_path / "moe.gguf")
    write_synthetic_llama(path, seed=module_seed, **{**PRESETS["tiny-moe"], "vocab": 300})
    with pytest.raises(ValueError, match="mixture of experts"):
        step_read_bytes(LlamaFile(path), [4])
    path = str(tmp_path / "dense.gguf")
    write_synthetic_llama(path, seed=module_seed, **SMALL)
    with pytest.raises(ValueError, match="positive"):
        step_read_bytes(LlamaFile(path), [])
    with pytest.raises(ValueError, match="positive"):
        step_read_bytes(LlamaFile(path), [3, 0])


def test_read_floor_of_a_row(model_path):
    """Two decode steps of three sequences after 4-token prompts: the
    steps attend over 5 and 6 keys; the floor is their tokens over the
    bytes' time, the share S_TG over it."""
    from ptxgen.llm.bench import format_floor, read_floor, step_read_bytes
    from ptxgen.llm.gguf.file import LlamaFile
    f = LlamaFile(model_path)
    row = BatchedResult(pp=4, tg=2, b=3, t_pp=0.1, t_tg=0.25, t=0.4)
    bw = 3.2e12
    seconds = (step_read_bytes(f, [5, 5, 5]) + step_read_bytes(f, [6, 6, 6])) / bw
    floor, share = read_floor(row, f, bw)
    assert floor == pytest.approx(6 / seconds, rel=1e-12)
    assert share == pytest.approx((6 / 0.25) / floor, rel=1e-12)
    text = format_floor([row], f, bw)
    assert "copy bandwidth of this run (3.20 TB/s read + written)" in text
    line = text.splitlines()[-1]
    assert re.fullmatch(rf"\|     4 \|      2 \|    3 \| +{floor:.2f} \| +24\.00 \| +"
                        rf"{100 * share:.1f}% \|", line), line
