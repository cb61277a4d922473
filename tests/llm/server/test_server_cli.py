"""``python -m ptxgen serve``: its arguments, and the server's life as a
process (listening at once, 503 while loading, serving, a clean stop on
SIGINT, exit code 1 when the model fails to load), on the fake engine."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import openai
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _serve(*args):
    return subprocess.run([sys.executable, "-m", "ptxgen", "serve", *args],
                          capture_output=True, text=True, timeout=120)


def test_help_names_the_endpoints_and_flags():
    p = _serve("--help")
    assert p.returncode == 0
    for words in ("/v1/chat/completions", "--host", "--port", "--parallel", "--max-queue",
                  "--api-key", "--chat-template", "-c N, --ctx-size N", "-ngl N",
                  "(default: 8080)"):
        assert words in p.stdout, words


@pytest.mark.parametrize("args,needle", [
    ([], "no model file: give MODEL.gguf"),
    (["{tmp}/missing.gguf"], "missing.gguf: no such file"),
    (["{tmp}"], "is a directory"),
    (["m.gguf", "--port", "70000"], "a port is 0 .. 65535, got 70000"),
    (["m.gguf", "--parallel", "0"], "must be at least 1"),
    (["m.gguf", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
    (["{model}", "--chat-template", "nope"], "neither a built-in template"),
    (["{model}"], "m.gguf: "),                                  # 4 bytes: not a GGUF file
    (["{novocab}"], "has no tokenizer (tokenizer.ggml.*): the server takes"),
])
def test_bad_arguments_are_one_error_line(args, needle, tmp_path):
    """Refused before the server listens: one error line, exit code 2."""
    from ptxgen.llm.gguf.synth import write_synthetic_llama
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    novocab = tmp_path / "novocab.gguf"
    write_synthetic_llama(novocab, seed=0, n_layers=1, hidden=256, ffn=256, n_heads=2,
                          n_kv_heads=1, vocab=64, qtype="Q8_0", output_qtype="Q8_0")
    p = _serve(*[a.format(tmp=tmp_path, model=model, novocab=novocab)
                 for a in args])
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], p.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SCRIPT = """
import sys, time
sys.path.insert(0, {here!r})
import fake_engine
from live import phi3_tokenizer
from ptxgen.llm.server.cli import run_server

def load():
    time.sleep(1.0)
    if {fail!r}:
        raise FileNotFoundError("model.gguf: no such file")
    return fake_engine.FakeEngine(phi3_tokenizer(), n_ctx=128, step_s=0.01, eog_logit=-30)

sys.exit(run_server(load, host="127.0.0.1", port={port}, api=fake_engine, log_level="warning",
                    what="the fake model"))
"""


def _start(port, fail=False):
    code = textwrap.dedent(SCRIPT.format(here=HERE, port=port, fail=fail))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _get(url):
    try:
        return httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None


def test_the_server_process_loads_serves_and_stops_on_sigint():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    p = _start(port)
    try:
        saw_loading = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = _get(url + "/health")
            if r is not None and r.status_code == 503:
                saw_loading = r.json() == {"status": "loading"}
            if r is not None and r.status_code == 200:
                break
            time.sleep(0.05)
        assert saw_loading and r.status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="fake-tiny", max_tokens=3,
                                               messages=[{"role": "user", "content": "Hi"}])
        assert reply.usage.completion_tokens == 3
        # a stream in flight when the server stops
        stream = client.chat.completions.create(model="fake-tiny", max_tokens=100, stream=True,
                                                messages=[{"role": "user", "content": "Hi"}])
        next(iter(stream))
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert "loading the fake model; listening on " + url in err
    assert "loaded the fake model: serving 'fake-tiny' with a context of 128 tokens" in err
    assert "Traceback" not in err


def test_a_model_that_fails_to_load_stops_the_server():
    p = _start(_free_port(), fail=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1
    assert err.strip().splitlines()[-1] == ("error: loading the fake model failed: "
                                            "model.gguf: no such file")
