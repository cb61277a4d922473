"""The text commands (`run -p`, `chat`, `demo`'s text part) on the emulator
with a tiny model carrying phi-3's cut-down vocabulary, and what a new user
hits: one `error:` line and exit code 2 for bad input, defaults in every
`--help`."""

import io
import os
import time
import types

import pytest

pytest.importorskip("gguf")

from backends import cuda_available
from ptxgen.cli import main
from ptxgen.llm.gguf.synth import main as synth_main
from ptxgen.llm.gguf.synth import write_synthetic_llama
from ptxgen.llm.text.tokenizer import Tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data", "vocab")
PHI3 = os.path.join(DATA, "ggml-vocab-phi-3.gguf")
SMALL = dict(n_layers=1, hidden=128, ffn=256, n_heads=2, n_kv_heads=1, qtype="Q8_0",
             output_qtype="Q8_0", context_length=64)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    write_synthetic_llama(p, seed=module_seed, vocab_from=PHI3, vocab_limit=700, **SMALL)
    return str(p)


def _one_error_line(err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err
    assert lines and lines[-1].startswith(("error:", "python -m ptxgen")), err
    return lines[-1]


def test_run_streams_text_and_prints_speeds(model_path, tmp_path, capsys):
    """`run -p` prints the prompt and the text; `--prompt-file` with
    `--no-display-prompt` prints the same text alone; the speeds and the
    stop reason go to stderr.  Without a GPU, `--backend auto` says it runs
    on the emulator."""
    args = ["-n", "2", "--temp", "0.8", "--seed", "3", "--capacity", "16"]
    assert main(["run", model_path, "-p", "Hi", "--backend", "auto"] + args) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hi") and out.endswith("\n")
    assert "tokens/s" in err and "seed 3" in err
    # two tokens, or fewer when the random model chose an end-of-generation token
    assert ("generation: 2 tokens" in err and "stop: max_new_tokens" in err) or \
        "stop: eog" in err
    if not cuda_available():
        assert "using the CPU emulator" in err
    f = tmp_path / "prompt.txt"
    f.write_text("Hi", encoding="utf-8")
    assert main(["run", model_path, "--prompt-file", str(f), "--no-display-prompt",
                 "--backend", "emu"] + args) == 0
    out2, _ = capsys.readouterr()
    assert "Hi" + out2 == out


def test_run_with_token_ids_prints_ids(model_path, capsys):
    assert main(["run", model_path, "--tokens", "1,2", "-n", "1", "--backend", "emu",
                 "--capacity", "8"]) == 0
    out, _ = capsys.readouterr()
    ids = out.splitlines()[0]
    assert ids.startswith("tokens: ") and len(ids.split(":")[1].split(",")) == 1


def test_chat_holds_three_turns_feeding_only_new_tokens(model_path, capsys, monkeypatch):
    """Three user lines (an empty one skipped, /exit ends): three replies;
    turns two and three feed the previous reply's last token, an end-of-turn
    token when it stopped without one, and what the template adds."""
    import re
    from ptxgen.llm.text.chat_template import encode_chat, incremental_chat_tokens
    questions = ["Hi", "How are you?", "Bye"]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n\nHow are you?\nBye\n/exit\nnot read\n"))
    assert main(["chat", model_path, "-n", "1", "--backend", "emu", "--capacity", "48",
                 "--stop", "\n"]) == 0
    out, err = capsys.readouterr()
    replies = out.split("\n")[:-1]
    stats = re.findall(r"prompt: (\d+) tokens.*stop: (\w+)", err)
    assert len(replies) == len(stats) == 3
    tok = Tokenizer.from_gguf(model_path)
    msgs = [{"role": "user", "content": questions[0]}]
    assert int(stats[0][0]) == len(encode_chat(tok, msgs))
    for i in (1, 2):
        before = msgs + [{"role": "assistant", "content": replies[i - 1]}]
        msgs = before + [{"role": "user", "content": questions[i]}]
        new = incremental_chat_tokens(tok, before, msgs)
        assert int(stats[i][0]) == 1 + (stats[i - 1][1] != "eog") + len(new)


@pytest.mark.parametrize("argv,needle", [
    (["run", "{dir}", "-p", "x", "--backend", "emu"], "is a directory"),
    (["run", "{dir}/missing.gguf", "-p", "x", "--backend", "emu"], "no such file"),
    (["run", "{model}", "-n", "0", "-p", "x"], "must be at least 1, got 0"),
    (["run", "{model}", "-n", "-3", "-p", "x"], "must be at least 1, got -3"),
    (["chat", "{model}", "-n", "0"], "must be at least 1"),
    (["run", "{model}", "-p", "x", "--temp", "-1", "--backend", "emu"],
     "temperature must be >= 0.0, got -1.0"),
    (["run", "{model}", "--prompt-file", "{dir}/none.txt", "--backend", "emu"],
     "No such file or directory"),
    (["run", "{model}", "-p", "x", "--tokens", "1"], "not allowed with argument"),
    (["dump", "argmax", "-o", "{dir}/no/such/dir/x.ptx"], "cannot write"),
    (["check", "{dir}/missing.ptx"], "missing.ptx: no such file"),
    (["dump", "rope", "--set", "layout=foo"],
     "layout must be one of neox, interleaved, got 'foo'"),
    (["dump", "embedding", "--set", "qtype=Q3_K"],
     "qtype must be one of Q4_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q5_K, F32, F16, BF16, "
     "got 'Q3_K'"),
])
def test_bad_input_is_one_error_line_and_exit_2(argv, needle, model_path, tmp_path, capsys):
    argv = [a.format(dir=tmp_path, model=model_path) for a in argv]
    try:
        rc = main(argv)
    except SystemExit as e:      # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2 and needle in _one_error_line(err) and "Attribute(" not in err


@pytest.mark.skipif(cuda_available(), reason="a GPU is present")
def test_backend_cuda_without_a_gpu_is_one_error_line(model_path, capsys):
    assert main(["run", model_path, "-p", "x", "--backend", "cuda"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: --backend cuda: no NVIDIA driver") and "--backend emu" in line


def test_models_without_tokenizer_or_template_are_refused_before_loading(tmp_path, capsys):
    p = tmp_path / "bare.gguf"
    write_synthetic_llama(p, vocab=64, seed=1, **SMALL)
    assert main(["run", str(p), "-p", "Hi", "--backend", "emu", "--capacity", "4"]) == 2
    out, err = capsys.readouterr()
    assert "has no tokenizer" in _one_error_line(err) and "loading" not in err
    spm = tmp_path / "spm.gguf"
    write_synthetic_llama(spm, seed=1, vocab_from=os.path.join(DATA, "ggml-vocab-llama-spm.gguf"),
                          vocab_limit=300, **SMALL)
    assert main(["chat", str(spm), "--backend", "emu"]) == 2
    assert "has no chat template" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("template,needle,loaded", [
    ("{% if 1 %}" * 120 + "{% endif %}" * 120, "nests too deeply to compile", False),
    ("{{ lipsum(n=10**7) }}", "lipsum() is not available", True),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
     "ran for more than", True),
    ("{{ 'a' * 10**9 }}", "would make a value of 1000000000 characters", True),
])
def test_chat_refuses_a_hostile_template_in_one_line(template, needle, loaded, model_path,
                                                     tmp_path, capsys, monkeypatch):
    """A --chat-template that breaks the sandbox's limits: one error line,
    before the model loads when it does not even compile."""
    f = tmp_path / "t.jinja"
    f.write_text(template, encoding="utf-8")
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    assert main(["chat", model_path, "--chat-template", str(f), "--backend", "emu",
                 "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert needle in _one_error_line(err) and ("loading" in err) == loaded


def test_run_refuses_a_10mb_prompt_file_quickly(model_path, tmp_path, capsys):
    f = tmp_path / "big.txt"
    f.write_text("All work and no play. " * 500_000, encoding="utf-8")
    t0 = time.perf_counter()
    assert main(["run", model_path, "--prompt-file", str(f), "--backend", "emu",
                 "--capacity", "64", "-n", "1"]) == 2
    err = capsys.readouterr().err
    line = _one_error_line(err)
    assert "does not fit the KV cache, which has room for 63 more tokens" in line
    assert time.perf_counter() - t0 < 10      # the model's loading included


def test_chat_falls_back_to_chatml_when_the_file_template_cannot_be_used(tmp_path, capsys,
                                                                        monkeypatch):
    p = tmp_path / "broken.gguf"
    write_synthetic_llama(p, seed=3, vocab_from=PHI3, vocab_limit=700, chat_template="{% for %}",
                          **SMALL)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    assert main(["chat", str(p), "--backend", "emu", "-n", "1", "--capacity", "48"]) == 0
    out, err = capsys.readouterr()
    assert "warning: the GGUF file's chat template cannot be used (chat template has a syntax " \
           "error at line 1" in err and "built-in ChatML" in err
    assert "generation: 1 token;" in err and out.endswith("\n")


@pytest.mark.parametrize("cmd", ["dump", "check", "run", "chat", "demo", "tune"])
def test_help_shows_defaults(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert "(default: " in capsys.readouterr().out


def test_synth_copies_a_vocabulary_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "v.gguf"
    assert synth_main([str(out), "--vocab", PHI3, "--vocab-limit", "300", "--layers", "1",
                       "--quiet", "--seed", "5"]) == 0
    tok = Tokenizer.from_gguf(out)
    assert 300 < tok.n_vocab < 500 and tok.chat_template
    with pytest.raises(SystemExit):
        synth_main([str(tmp_path / "w.gguf"), "--vocab-limit", "3"])
    assert "--vocab-limit needs --vocab" in capsys.readouterr().err


def test_demo_text_part_runs_on_the_emulator(tmp_path, capsys):
    from ptxgen.driver.backend import EmuBackend
    from ptxgen.testing.demo import _text
    _text(types.SimpleNamespace(max_new_tokens=1, vocab=PHI3), EmuBackend(), str(tmp_path))
    out = capsys.readouterr().out
    assert "ggml-vocab-phi-3.gguf's vocabulary" in out and "greedy: Once upon a time" in out
    assert out.count("stop: max_new_tokens") + out.count("stop: eog") == 3
    assert "chat: user: 'What is a GPU?'" in out


def test_prompt_and_stop_escapes():
    from ptxgen.llm.cli import _unescape
    assert _unescape(r"a\nb\tc\\n\"q\" \x") == 'a\nb\tc\\n"q" \\x'
    assert _unescape("plain") == "plain" and _unescape("end\\") == "end\\"
