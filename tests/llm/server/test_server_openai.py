"""The server's OpenAI API through the official ``openai`` client and raw
server-sent events over httpx, against a live uvicorn server on a fake
engine (fake_engine.py) whose replies the tests predict with its
reference: chat and completions, streaming and not, usage, stop strings,
seeds, ``n``, log-probabilities, the model list, health and metrics."""

import json
import math

import httpx
import openai
import pytest

from fake_engine import FakeEngine, RequestSettings
from live import phi3_tokenizer, serve
from ptxgen.llm.generation import SamplingSettings
from ptxgen.llm.text.chat_template import encode_chat

NAME = "fake-tiny"


@pytest.fixture(scope="module")
def tok():
    return phi3_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    # the end-of-generation token rarely wins, so replies run to max_tokens
    return FakeEngine(tok, n_ctx=256, max_seqs=8, eog_logit=-30.0)


@pytest.fixture(scope="module")
def live(engine):
    with serve(engine, aliases=("tiny.gguf",)) as s:
        yield s


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def _chat_ids(tok, messages):
    return encode_chat(tok, messages)


def _settings(max_tokens, temperature=1.0, seed=None, stop=(), logprobs=0):
    """What the server asks of the engine for an OpenAI request with these
    fields (OpenAI's defaults elsewhere: top-p 1, no top-k or min-p)."""
    return RequestSettings(max_tokens=max_tokens, stop=tuple(stop), logprobs=logprobs,
                           sampling=SamplingSettings(temperature=temperature, top_k=0, top_p=1.0,
                                                     min_p=0.0, seed=seed))


MESSAGES = [{"role": "user", "content": "Tell me about GPUs."}]


def test_chat_completion(client, engine, tok):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=7,
                                       temperature=0)
    ids = _chat_ids(tok, MESSAGES)
    want_ids, want_text, want_finish = engine.reference(ids, _settings(7, 0.0))
    c = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == NAME
    assert c.message.role == "assistant" and c.message.content == want_text
    assert c.finish_reason == want_finish == "length" and c.index == 0 and c.logprobs is None
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(want_ids) == 7
    assert r.usage.total_tokens == len(ids) + 7


def test_chat_streaming_with_usage(client, engine, tok):
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=9,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    ids = _chat_ids(tok, MESSAGES)
    _, want_text, _ = engine.reference(ids, _settings(9, 0.0))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want_text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert all(ch.usage is None for ch in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_completion_and_its_stream(client, engine, tok):
    ids = tok.encode("Once upon a time", add_special=True, parse_special=True)
    _, want, _ = engine.reference(ids, _settings(6, 0.0))
    r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=6,
                                  temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 6
    parts = [ch.choices[0].text for ch in
             client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=6,
                                       temperature=0, stream=True)]
    assert "".join(parts) == want
    # token ids in, the same reply; echo puts the prompt first
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0,
                                  echo=True)
    assert r.choices[0].text == tok.decode(ids) + want


def test_default_max_tokens_of_completions_is_16(client):
    r = client.completions.create(model=NAME, prompt="Hi", temperature=0)
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_chat_without_max_tokens_runs_to_the_context(client, engine, tok):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, temperature=0)
    assert r.usage.prompt_tokens + r.usage.completion_tokens == engine.n_ctx
    assert r.choices[0].finish_reason == "length"


def test_several_prompts_and_n(client, engine, tok):
    r = client.completions.create(model=NAME, prompt=["Hello", "Good night"], max_tokens=4,
                                  n=2, temperature=0.9, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        p = ["Hello", "Good night"][c.index // 2]
        ids = tok.encode(p, add_special=True, parse_special=True)
        _, want, _ = engine.reference(ids, _settings(4, 0.9, seed=11 + c.index % 2))
        assert c.text == want
    assert r.usage.completion_tokens == 16


def test_stop_strings(client, engine, tok):
    ids = _chat_ids(tok, MESSAGES)
    _, full, _ = engine.reference(ids, _settings(20, 0.0))
    stop = full[5:8]                           # a string the reply holds
    cut = full[:full.index(stop)]
    for stream in (False, True):
        r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20,
                                           temperature=0, stop=[stop, "zzzzzz"], stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text == cut and finish == "stop"


def test_seed_reproduces_a_sampled_reply(client):
    def ask(seed):
        return client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                              temperature=1.0, seed=seed).choices[0]
    a, b, c = ask(5), ask(5), ask(6)
    assert a.message.content == b.message.content
    assert a.message.content != c.message.content


def test_chat_logprobs(client, engine, tok):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    entries = c.logprobs.content
    assert len(entries) == 5 and "".join(e.token for e in entries) == c.message.content
    ids = _chat_ids(tok, MESSAGES)
    seq = list(ids)
    for e in entries:
        assert e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token        # greedy: the most likely
        assert math.isclose(e.logprob, tops[0], rel_tol=1e-6)
        # against the fake model's own distribution
        cand, z = engine.model.logits(seq)
        lse = math.log(sum(math.exp(v) for v in z))
        best = max(range(len(z)), key=lambda i: z[i])
        assert abs(e.logprob - (z[best] - lse)) < 1e-6
        seq.append(int(cand[best]))
    # logprobs without top_logprobs: the chosen tokens only
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=3,
                                       temperature=0, logprobs=True)
    assert [len(e.top_logprobs) for e in r.choices[0].logprobs.content] == [0, 0, 0]


def test_completion_logprobs_streamed_and_not(client):
    r = client.completions.create(model=NAME, prompt="Hi there", max_tokens=5, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(d) <= 2 for d in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    chunks = list(client.completions.create(model=NAME, prompt="Hi there", max_tokens=5,
                                            temperature=0, logprobs=2, stream=True))
    streamed = [v for ch in chunks if ch.choices[0].logprobs
                for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_raw_server_sent_events(live):
    """The wire format: `data: {json}` events, blank-line separated, ending
    with `data: [DONE]`."""
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 4, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    objs = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert len({o["id"] for o in objs}) == 1
    assert objs[-1]["choices"][0]["finish_reason"] == "length"


def test_models_health_and_metrics(client, live, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert client.models.retrieve("tiny.gguf").id == "tiny.gguf"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    # an alias works as the request's model too
    client.chat.completions.create(model="tiny.gguf", messages=MESSAGES, max_tokens=1)
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    text = httpx.get(live.url + "/metrics").text
    metrics = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            metrics[key] = float(value)
    assert metrics['ptxgen_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert metrics["ptxgen_generation_tokens_total"] >= 1
    assert metrics["ptxgen_prompt_tokens_total"] >= 1
    assert metrics["ptxgen_time_to_first_token_seconds_count"] >= 1
    assert metrics["ptxgen_inter_token_latency_seconds_count"] >= 1
    assert metrics["ptxgen_kv_blocks_total"] == engine.num_blocks
    assert metrics["ptxgen_kv_blocks_used"] == 0 and metrics["ptxgen_sequences_running"] == 0
    assert "ptxgen_kv_cache_usage_ratio" in metrics


def test_chat_history_prompts_extend_the_previous_ones(client, engine, tok):
    """A conversation's next request starts with the tokens of the previous
    one (prompt and reply): the engine's prefix cache finds them."""
    msgs = [{"role": "user", "content": "Hi"}]
    before = len(engine.prompts)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0)
    reply = r.choices[0].message.content
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "More"}]
    client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, temperature=0)
    first, second = engine.prompts[before:before + 2]
    assert second[:len(first)] == first
    assert len(second) > len(first) + 6


def test_streamed_chunks_with_an_odd_model_name(tok):
    """The chunk template survives a name with quotes and % signs."""
    name = 'my "model" 100%s'
    with serve(FakeEngine(tok, n_ctx=64, eog_logit=-30), model_name=name) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        chunks = list(client.completions.create(model=name, prompt="Hi", max_tokens=4,
                                                stream=True))
    assert {ch.model for ch in chunks} == {name} and len(chunks) >= 1
    assert sum(len(ch.choices[0].text) > 0 for ch in chunks) >= 1
