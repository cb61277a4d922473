"""The command line as a llama.cpp user meets it (issue 55): one test per
friction found by trying it as a new user would.

The model is a one-layer synthetic one with phi-3's vocabulary cut to 300
tokens; it runs on the GPU when there is one, else on the CPU emulator
(about half a second a step).  Where the behaviour lives in the process
(stdin, a closed pipe, SIGINT, a terminal) the test runs ``python -m
ptxgen`` as a subprocess, on a pseudo-terminal where it matters.
"""

import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from ptxgen.cli import main
from ptxgen.llm.gguf.synth import write_synthetic_llama
from ptxgen.llm.named_templates import NAMED_TEMPLATES
from ptxgen.llm.text.chat_template import encode_chat
from ptxgen.llm.text.tokenizer import Tokenizer

PHI3 = os.path.join(os.path.dirname(__file__), "data", "vocab", "ggml-vocab-phi-3.gguf")
SMALL = dict(n_layers=1, hidden=128, ffn=256, n_heads=2, n_kv_heads=1, qtype="Q8_0",
             output_qtype="Q8_0", context_length=64)
STATS = re.compile(r"prompt: (\d+) tokens?[^;]*; generation: (\d+) tokens?([^;]*); "
                   r"stop: (\w+) \(\w+, backend \w+(?:, seed (\d+))?\)")


def _never_ending(path):
    """Zero the output rows of the end-of-generation tokens: their logit is 0
    among random ones, never the largest and never among the top 40, so the
    replies run to their token budget (or Ctrl-C) as these tests need."""
    from ptxgen.llm.gguf.reader import read_gguf
    g = read_gguf(path)
    t = g.tensors["output.weight"]
    row = t.nbytes // t.dims[1]
    start = g.data_offset + t.offset
    del g
    with open(path, "r+b") as f:
        for tid in Tokenizer.from_gguf(path).eog_ids:
            f.seek(start + tid * row)
            f.write(bytes(row))


@pytest.fixture(scope="module")
def model(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("frictions") / "small.gguf"
    write_synthetic_llama(p, seed=module_seed, vocab_from=PHI3, vocab_limit=300, **SMALL)
    _never_ending(str(p))
    return str(p)


@pytest.fixture(scope="module")
def tok(model):
    return Tokenizer.from_gguf(model)


def _stats(err):
    m = STATS.findall(err)
    assert m, err
    return m


def _ptxgen(*args, **kw):
    """``python -m ptxgen ARGS`` as a child with SIGINT at its default (so
    Python installs its own handler even under a runner that ignores it)."""
    return subprocess.Popen([sys.executable, "-m", "ptxgen", *args],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            **kw)


def _rc(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------- llama.cpp's flags

def test_ngl_is_accepted_and_ignored_with_a_note(model, capsys):
    """`run M -p hi -ngl 99` failed with "argument -n/--max-new-tokens:
    expected a positive integer, got 'gl'"."""
    rc, out, err = _rc(["run", model, "-p", "hi", "-ngl", "99", "-n", "1"], capsys)
    assert rc == 0, err
    assert "note: -ngl 99 is ignored: ptxgen runs every layer on the GPU" in err
    assert out.startswith("hi") and _stats(err)[0][1] == "1"


def test_model_option_file_seed_and_system_prompt(model, tok, tmp_path, capsys):
    """-m, -f, -s and -sys were unknown: -m names the model, -f the prompt
    file (its last newline dropped, as llama.cpp does), -s the seed, and
    -sys sends the prompt through the chat template after the system
    message."""
    f = tmp_path / "prompt.txt"
    f.write_text("Tell me a story\n", encoding="utf-8")
    rc, out, err = _rc(["run", "-m", model, "-f", str(f), "-s", "7", "--temp", "0.8", "-n", "2"],
                       capsys)
    assert rc == 0, err
    (n_prompt, n_gen, _, stop, seed), = _stats(err)
    assert out.startswith("Tell me a story") and not out.startswith("Tell me a story\n")
    assert int(n_prompt) == len(tok.encode("Tell me a story", parse_special=True))
    assert seed == "7" and n_gen == "2"

    rc, out, err = _rc(["run", "-m", model, "-p", "Hi", "-sys", "Be brief.", "-n", "1"], capsys)
    assert rc == 0, err
    want = encode_chat(tok, [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}])
    assert int(_stats(err)[0][0]) == len(want)


def test_ctx_size_sets_the_context(model, capsys):
    """-c/--ctx-size was unknown: it is the KV cache length (a prompt
    longer than it is refused, naming it)."""
    rc, out, err = _rc(["run", model, "-c", "4", "-p", "one two three four five six"], capsys)
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "does not fit the KV cache" in last and "room for 3 more tokens" in last
    rc, out, err = _rc(["run", model, "--ctx-size", "40", "-p", "one two three four five six",
                        "-n", "1"], capsys)
    assert rc == 0, err


def test_two_model_files_or_none_is_an_error(model, capsys):
    rc, _, err = _rc(["run", model, "-m", model + "x", "-p", "x"], capsys)
    assert rc == 2 and "two model files" in err
    rc, _, err = _rc(["run", "-p", "x"], capsys)
    assert rc == 2 and "no model file" in err


def test_chat_template_takes_a_builtin_name(model, tok, monkeypatch, capsys):
    """`--chat-template chatml` looked for a file named chatml: it is the
    built-in template of that name (a file path still works; an unknown
    name lists the built-in ones)."""
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    rc, out, err = _rc(["chat", model, "--chat-template", "chatml", "-n", "1"], capsys)
    assert rc == 0, err
    want = encode_chat(tok, [{"role": "user", "content": "Hi"}],
                       template=NAMED_TEMPLATES["chatml"])
    assert int(_stats(err)[0][0]) == len(want)
    rc, _, err = _rc(["chat", model, "--chat-template", "chatm"], capsys)
    assert rc == 2 and "neither a built-in template (chatml, llama2" in err


# ---------------------------------------------------------------- prompt from stdin

def test_prompt_piped_on_stdin(model, tok):
    """`echo Hello | ptxgen run M` ignored stdin."""
    p = _ptxgen("run", model, "-n", "1", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
    out, err = p.communicate(b"Hello\n", timeout=300)
    assert p.returncode == 0, err.decode()
    assert out.startswith(b"Hello")
    assert int(_stats(err.decode())[0][0]) == len(tok.encode("Hello", parse_special=True))


def test_prompt_file_dash_reads_stdin(model, tok, monkeypatch, capsys):
    """`--prompt-file -` failed (no file named -)."""
    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon\n"))
    rc, out, err = _rc(["run", model, "--prompt-file", "-", "-n", "1"], capsys)
    assert rc == 0, err
    assert out.startswith("Once upon")
    assert int(_stats(err)[0][0]) == len(tok.encode("Once upon", parse_special=True))


def test_no_prompt_on_a_terminal_is_an_error(model, monkeypatch, capsys):
    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr("sys.stdin", Tty(""))
    rc, _, err = _rc(["run", model], capsys)
    assert rc == 2 and err.startswith("error: no prompt: give -p TEXT, -f FILE, pipe")


# ---------------------------------------------------------------- Ctrl-C and pipes

def _read_until(stream, n=1, timeout=300):
    """Block until ``n`` bytes came (or the timeout); returns them."""
    got = b""
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        r, _, _ = select.select([stream], [], [], 1.0)
        if r:
            d = os.read(stream.fileno(), n - len(got))
            if not d:
                break
            got += d
    return got


def test_ctrl_c_stops_run_and_prints_what_was_generated(model):
    """Ctrl-C during `run` stops the generation after the current token,
    prints the stats of what was generated and exits 130."""
    p = _ptxgen("run", model, "-p", "Hi", "-n", "-1", "--no-display-prompt",
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert _read_until(p.stdout, 1)          # the first piece of the reply came
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    err = err.decode()
    assert p.returncode == 130, err
    (_, n_gen, _, stop, _), = _stats(err)
    assert stop == "interrupted" and 1 <= int(n_gen) < 60 and "Traceback" not in err


def test_ctrl_c_in_chat_ends_only_the_reply(model):
    """Ctrl-C in chat ended the whole session: it ends the reply (what it
    said stays in the conversation); the next message gets a reply; Ctrl-C
    at the prompt ends the chat."""
    p = _ptxgen("chat", model, "-n", "-1", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
    p.stdin.write(b"Hi\n")
    p.stdin.flush()
    assert _read_until(p.stdout, 1)
    p.send_signal(signal.SIGINT)
    p.stdin.write(b"Bye\n")
    p.stdin.flush()
    # the second reply runs until the context is full, then the chat waits for a line
    deadline = time.monotonic() + 300
    err = b""
    while err.count(b"stop: ") < 2 and time.monotonic() < deadline:
        r, _, _ = select.select([p.stderr], [], [], 1.0)
        if r:
            err += os.read(p.stderr.fileno(), 4096)
    p.send_signal(signal.SIGINT)
    out, rest = p.communicate(timeout=60)
    err = (err + rest).decode()
    assert p.returncode == 0, err
    (first, second) = _stats(err)
    assert first[3] == "interrupted" and second[3] == "kv_capacity"
    # the second turn is encoded whole: the first reply (as far as it got) included
    assert int(second[0]) > int(first[0])
    assert "Traceback" not in err


def test_closed_pipe_ends_quietly(model):
    """`run ... | head -c 3` ended with "error: Broken pipe"."""
    p = _ptxgen("run", model, "-p", "Hi", "-n", "40", stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(_read_until(p.stdout, 3)) == 3
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0
    assert "error" not in err.lower() and "Exception" not in err and "stop:" not in err


# ---------------------------------------------------------------- on a terminal

def _screen(raw: str) -> list:
    """The lines a terminal shows after ``raw`` (\\r, \\n and erase-line only)."""
    lines, row, col = [""], 0, 0
    i = 0
    while i < len(raw):
        if raw.startswith("\x1b[K", i):
            lines[row] = lines[row][:col]
            i += 3
            continue
        c = raw[i]
        if c == "\r":
            col = 0
        elif c == "\n":
            row += 1
            col = 0
            if row == len(lines):
                lines.append("")
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + c + line[col + 1:]
            col += 1
        i += 1
    return lines


def test_on_a_terminal_status_lines_overwrite_nothing(model):
    """On a terminal the prompt's progress line overwrote the echoed prompt,
    and a large file printed nothing for seconds while loading: the first
    thing written is the loading line, the progress lines are gone when the
    reply comes, and the prompt and the reply share their line."""
    primary, secondary = pty.openpty()
    p = _ptxgen("run", model, "-p", "Hello world", "-n", "2", "--backend", "emu",
                stdin=secondary, stdout=secondary, stderr=secondary, close_fds=True)
    os.close(secondary)
    raw = b""
    while True:
        r, _, _ = select.select([primary], [], [], 1.0)
        if r:
            try:
                d = os.read(primary, 4096)
            except OSError:          # the child closed its end
                break
            if not d:
                break
            raw += d
        elif p.poll() is not None:
            break
    os.close(primary)
    assert p.wait(timeout=60) == 0
    text = raw.decode("utf-8", "replace")
    assert text.startswith("\r\x1b[Kloading small.gguf: starting")
    assert "prompt: 1/" in text                      # the progress was shown ...
    lines = [ln for ln in _screen(text) if ln.strip()]
    assert not any(re.search(r"prompt: \d+/\d+", ln) for ln in lines), lines   # ... and cleared
    assert not any(ln.startswith("loading small.gguf") for ln in lines), lines
    echoed = [ln for ln in lines if ln.startswith("Hello world")]
    assert len(echoed) == 1, lines
    assert lines[-1].startswith("prompt: ") and "generation: 2 tokens" in lines[-1]


# ---------------------------------------------------------------- stats, help, errors

def test_one_new_token_has_no_rate(model, capsys):
    """-n 1 printed "nan tokens/s"."""
    rc, out, err = _rc(["run", model, "-p", "Hi", "-n", "1"], capsys)
    assert rc == 0 and "nan" not in err
    (_, n_gen, rate, _, _), = _stats(err)
    assert n_gen == "1" and rate == ""
    rc, out, err = _rc(["run", model, "--tokens", "1", "-n", "1"], capsys)
    assert rc == 0 and "nan" not in out + err
    assert "prompt: 0 tokens\n" in out and "1 token (" in out


def test_top_level_help_describes_each_command(capsys):
    """The top-level help described run/chat/info/tune as "(from
    ptxgen.llm.cli)"."""
    rc, out, _ = _rc(["--help"], capsys)
    assert rc == 0 and "(from " not in out
    for cmd, words in [("run", "Generate text"), ("chat", "Chat with"),
                       ("serve", "OpenAI"), ("info", "Describe a GGUF"),
                       ("tune", "Time kernel configs"), ("list", "kernel families")]:
        line = next((ln for ln in out.splitlines() if ln.strip().startswith(cmd + " ")), "")
        assert words in line, (cmd, out)
    assert "examples:" in out


def test_version():
    """There was no --version."""
    p = subprocess.run([sys.executable, "-m", "ptxgen", "--version"], capture_output=True,
                       text=True)
    from ptxgen.version import __version__
    assert p.returncode == 0 and p.stdout.strip() == f"ptxgen {__version__}"


@pytest.mark.parametrize("argv,needle", [
    (["run", "m.gguf", "-n", "x"], "argument -n/--n-predict/--max-new-tokens: expected a "
                                   "positive integer, got 'x'"),
    (["chat", "m.gguf", "--temp"], "argument --temp: expected one argument"),
    (["run", "m.gguf", "--bogus"], "unrecognized arguments: --bogus"),
    (["info"], "the following arguments are required: model"),
    (["dump"], "the following arguments are required: kernel"),
    (["nosuch"], "argument COMMAND: invalid choice: 'nosuch'"),
])
def test_argument_errors_are_one_line(argv, needle):
    """An argument error printed 12 lines of usage before its error: line."""
    p = subprocess.run([sys.executable, "-m", "ptxgen", *argv], capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("error: ") and needle in lines[0] and "--help" in lines[0]
