"""End to end: ``python -m ptxgen serve`` as a process on the real batched
engine, talked to with the openai client: on the CPU emulator with a tiny
model (one layer, phi-3's vocabulary cut to 300 tokens), and on the GPU
with an 8B file (``PTXGEN_SERVE_MODEL=path.gguf``).

Chat and completions, streaming and not, usage, stop strings,
log-probabilities, a client that leaves mid-stream (its sequence and
blocks are gone from /metrics), a request past the context (400).
Skipped until the engine (``ptxgen.llm.engine``) exists."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ptxgen.llm.engine", reason="the batched engine (ptxgen.llm.engine) is not "
                    "in this tree yet; these tests run once it lands")

import openai  # noqa: E402

from backends import cuda_available  # noqa: E402
from ptxgen.llm.gguf.synth import write_synthetic_llama  # noqa: E402
from ptxgen.llm.text.chat_template import encode_chat  # noqa: E402
from ptxgen.llm.text.tokenizer import Tokenizer  # noqa: E402

PHI3 = os.path.join(os.path.dirname(__file__), "..", "..", "data", "vocab",
                    "ggml-vocab-phi-3.gguf")
SMALL = dict(n_layers=1, hidden=128, ffn=256, n_heads=2, n_kv_heads=1, qtype="Q8_0",
             output_qtype="Q8_0", context_length=128)
MSG = [{"role": "user", "content": "Hello"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serve(model, *args, timeout=900):
    """``python -m ptxgen serve MODEL ARGS`` until /health is 200; yields its URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    p = subprocess.Popen([sys.executable, "-m", "ptxgen", "serve", model, "--port", str(port),
                          "--log-level", "warning", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert p.poll() is None, p.communicate()[1]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.2)
        yield url
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
    assert p.returncode == 0


def _metrics(url) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _idle(url) -> bool:
    m = _metrics(url)
    return m.get("ptxgen_sequences_running") == 0 and m.get("ptxgen_kv_blocks_used") == 0


def _exercise(url, tok, max_tokens):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    name = client.models.list().data[0].id
    r = client.chat.completions.create(model=name, messages=MSG, max_tokens=max_tokens,
                                       temperature=0)
    c = r.choices[0]
    assert r.usage.prompt_tokens == len(encode_chat(tok, MSG))
    assert 1 <= r.usage.completion_tokens <= max_tokens
    assert c.finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=name, messages=MSG,
                                                 max_tokens=max_tokens, temperature=0,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        c.message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # completions, with log-probabilities
    r = client.completions.create(model=name, prompt="Once upon a time", max_tokens=max_tokens,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(max(d.values()) >= v - 1e-4 for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=name, prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
        stream=True))
    assert streamed == r.choices[0].text
    # a stop string the greedy reply holds ends it before the string
    text = r.choices[0].text
    if len(text) >= 4:
        s = client.completions.create(model=name, prompt="Once upon a time",
                                      max_tokens=max_tokens, temperature=0, stop=[text[2:4]])
        assert s.choices[0].text == text[:text.index(text[2:4])]
        assert s.choices[0].finish_reason == "stop"
    # a client that leaves mid-stream: its sequence and blocks are freed
    stream = client.chat.completions.create(model=name, messages=MSG, max_tokens=50,
                                            temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 60
    while not _idle(url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _idle(url), _metrics(url)
    # past the context: refused before it runs
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=MSG, max_tokens=10 ** 6)
    assert e.value.code == "context_length_exceeded"
    m = _metrics(url)
    assert m['ptxgen_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 3
    assert m["ptxgen_time_to_first_token_seconds_count"] >= 1


def test_serve_on_the_emulator(tmp_path, seed):
    model = str(tmp_path / "small.gguf")
    write_synthetic_llama(model, seed=seed, vocab_from=PHI3, vocab_limit=300, **SMALL)
    with _serve(model, "--backend", "emu", "-c", "128", "--parallel", "4") as url:
        _exercise(url, Tokenizer.from_gguf(model), max_tokens=4)


@pytest.mark.gpu
def test_serve_on_the_gpu_with_a_small_file(tmp_path, seed):
    """The engine loop and the server's streams over real graph replays
    (the emulator runs no graphs), on a file small enough to take seconds."""
    if not cuda_available():
        pytest.skip("no NVIDIA GPU / driver available")
    model = str(tmp_path / "small.gguf")
    write_synthetic_llama(model, seed=seed, vocab_from=PHI3, vocab_limit=300, **SMALL)
    with _serve(model, "--backend", "cuda", "-c", "128", "--parallel", "4") as url:
        _exercise(url, Tokenizer.from_gguf(model), max_tokens=4)


@pytest.mark.gpu
def test_serve_on_the_gpu_with_an_8b_file():
    if not cuda_available():
        pytest.skip("no NVIDIA GPU / driver available")
    model = os.environ.get("PTXGEN_SERVE_MODEL")
    if not model or not os.path.exists(model):
        pytest.skip("set PTXGEN_SERVE_MODEL to an 8B GGUF file with a chat template (e.g. "
                    "python -m ptxgen.llm.gguf.synth --preset llama3-8b --vocab "
                    "tests/data/vocab/ggml-vocab-llama-bpe.gguf --chat-template FILE)")
    with _serve(model, "--backend", "cuda", "-c", "4096", "--parallel", "64") as url:
        _exercise(url, Tokenizer.from_gguf(model), max_tokens=32)
        assert re.match(r"\S+", openai.OpenAI(base_url=url + "/v1", api_key="x")
                        .models.list().data[0].id)
