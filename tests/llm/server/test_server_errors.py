"""Faults against a live server on the fake engine: every malformed or
out-of-range request gets a 400 with OpenAI's error object (and never
reaches the engine), the API key is enforced, a full queue answers 503, a
failure inside one request ends that request only, and the server answers
503 while the model loads."""

import asyncio
import threading

import httpx
import openai
import pytest

import fake_engine
from fake_engine import FakeEngine
from live import phi3_tokenizer, serve, wait_until

NAME = "fake-tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tok():
    return phi3_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    return FakeEngine(tok, n_ctx=64, max_seqs=4, eog_logit=-30.0, crash=tok.encode(
        "CRASH", add_special=False)[0], poison=tok.encode("POISON", add_special=False)[0])


@pytest.fixture(scope="module")
def live(engine):
    with serve(engine) as s:
        yield s


def _chat(**kw):
    return {"model": NAME, "messages": MSG, **kw}


def _completion(**kw):
    return {"model": NAME, "prompt": "Hi", **kw}


LONG = "word " * 200
BAD = [
    # (path, body (dict, or raw bytes), the error's param, words of its message)
    (CHAT, b"", None, "body is empty"),
    (CHAT, b"{not json", None, "not valid JSON"),
    (CHAT, b"[1, 2]", None, "must be a JSON object"),
    (CHAT, {"model": NAME}, "messages", "messages is required"),
    (CHAT, {"messages": MSG}, "model", "model is required"),
    (CHAT, _chat(messages=[]), "messages", "at least 1"),
    (CHAT, _chat(messages="Hi"), "messages", "valid array"),
    (CHAT, _chat(messages=[{"content": "Hi"}]), "messages.0.role", "required"),
    (CHAT, _chat(messages=[{"role": "robot", "content": "Hi"}]), "messages.0.role", "'system'"),
    (CHAT, _chat(messages=[{"role": "user", "content": 5}]), "messages.0.content", "valid"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                         "image_url": {"url": "x"}}]}]),
     "messages.0.content", "only text content parts"),
    (CHAT, _chat(model="gpt-4o"), "model", "'gpt-4o' is not served here"),
    (CHAT, _chat(model=3), "model", "valid string"),
    (CHAT, _chat(max_tokens=0), "max_tokens", "greater than or equal to 1"),
    (CHAT, _chat(max_tokens="5"), "max_tokens", "valid integer"),
    (CHAT, _chat(max_tokens=2.5), "max_tokens", "valid integer"),
    (CHAT, _chat(max_tokens=1000), "max_tokens", "maximum context length is 64 tokens"),
    (CHAT, _chat(max_completion_tokens=1000), "max_completion_tokens", "maximum context"),
    (CHAT, _chat(messages=[{"role": "user", "content": LONG}]), "messages",
     "maximum context length is 64 tokens"),
    (CHAT, _chat(temperature=-1), "temperature", "greater than or equal to 0"),
    (CHAT, _chat(temperature=3), "temperature", "less than or equal to 2"),
    (CHAT, _chat(temperature="hot"), "temperature", "valid number"),
    (CHAT, _chat(top_p=1.5), "top_p", "less than or equal to 1"),
    (CHAT, _chat(top_k=-2), "top_k", "greater than or equal to -1"),
    (CHAT, _chat(min_p=-0.1), "min_p", "greater than or equal to 0"),
    (CHAT, _chat(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
    (CHAT, _chat(frequency_penalty=-3), "frequency_penalty", "greater than or equal to -2"),
    (CHAT, _chat(repetition_penalty=0), "repetition_penalty", "greater than 0"),
    (CHAT, _chat(n=0), "n", "greater than or equal to 1"),
    (CHAT, _chat(n=True), "n", "valid integer"),
    (CHAT, _chat(seed="x"), "seed", "valid integer"),
    (CHAT, _chat(seed=1 << 70), "seed", "less than"),
    (CHAT, _chat(stream="yes"), "stream", "valid boolean"),
    (CHAT, _chat(stream_options={"include_usage": True}), "stream_options",
     "only allowed when stream is true"),
    (CHAT, _chat(stop=5), "stop", "valid"),
    (CHAT, _chat(stop=["s"] * 17), "stop", "at most 16"),
    (CHAT, _chat(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
    (CHAT, _chat(top_logprobs=2), "top_logprobs", "needs logprobs"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools",
     "not supported"),
    (CHAT, _chat(logit_bias={"5": 10}), "logit_bias", "not supported"),
    (CHAT, _chat(response_format={"type": "json_object"}), "response_format",
     "'json_object' is not supported"),
    (COMPLETIONS, {"model": NAME}, "prompt", "prompt is required"),
    (COMPLETIONS, _completion(prompt=[]), "prompt", "prompt is empty"),
    (COMPLETIONS, _completion(prompt=[1, 99999999]), "prompt", "outside the vocabulary"),
    (COMPLETIONS, _completion(prompt=[1, -3]), "prompt", "outside the vocabulary"),
    (COMPLETIONS, _completion(prompt={"a": 1}), "prompt", "valid"),
    (COMPLETIONS, _completion(prompt=LONG), "prompt", "maximum context length is 64"),
    (COMPLETIONS, _completion(max_tokens=63), "max_tokens", "maximum context length is 64"),
    (COMPLETIONS, _completion(logprobs=21), "logprobs", "less than or equal to 20"),
    (COMPLETIONS, _completion(suffix="x"), "suffix", "not supported"),
    (COMPLETIONS, _completion(best_of=3), "best_of", "not supported"),
    (COMPLETIONS, _completion(echo=True, logprobs=1), "echo", "not supported"),
    (COMPLETIONS, _completion(model="other"), "model", "not served here"),
]


@pytest.mark.parametrize("path,body,param,words", BAD,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_malformed_request_is_a_400_with_an_error_object(live, engine, path, body, param,
                                                         words):
    n_prompts = len(engine.prompts)
    if isinstance(body, bytes):
        r = httpx.post(live.url + path, content=body,
                       headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(live.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"], err["message"]
    assert len(engine.prompts) == n_prompts          # refused before the engine saw it


def test_the_openai_client_raises_bad_request(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MSG, temperature=5)
    assert e.value.status_code == 400 and "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MSG, max_tokens=100)
    assert e.value.code == "context_length_exceeded"


def test_unknown_routes_and_methods_are_error_objects(live):
    r = httpx.get(live.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(live.url + CHAT)
    assert r.status_code == 405 and "error" in r.json()


def test_api_key(tok):
    engine = FakeEngine(tok, n_ctx=64)
    with serve(engine, api_key="s3cret") as live:
        body = _chat(max_tokens=2)
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                        {"authorization": "Basic s3cret"}):
            r = httpx.post(live.url + CHAT, json=body, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(live.url + "/v1/models").status_code == 401
        assert httpx.get(live.url + "/health").status_code == 200      # open
        assert httpx.get(live.url + "/metrics").status_code == 200
        assert engine.prompts == []
        good = openai.OpenAI(base_url=live.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model=NAME, messages=MSG, max_tokens=2).choices
        bad = openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=NAME, messages=MSG, max_tokens=2)


def test_a_full_queue_answers_503_and_the_server_goes_on(tok):
    """With one sequence running and at most two waiting, a burst of 12:
    the ones past the queue get 503 with Retry-After at once, the others
    their replies."""
    engine = FakeEngine(tok, n_ctx=64, max_seqs=1, max_queue=2, step_s=0.02, eog_logit=-30)

    async def burst(url):
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*[c.post(url + CHAT, json=_chat(max_tokens=5))
                                          for _ in range(12)])

    with serve(engine) as live:
        rs = asyncio.run(burst(live.url))
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 2 and codes.count(503) >= 1 and set(codes) == {200, 503}
        for r in rs:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "overloaded"
        assert wait_until(lambda: engine.stats().waiting == 0 and engine.stats().running == 0)
        r = httpx.post(live.url + CHAT, json=_chat(max_tokens=2), timeout=30)
        assert r.status_code == 200


def test_a_failing_request_ends_alone(live, engine):
    """One request fails inside the engine's step (500, or an error event
    when streaming), another raises in add_request (500); a request running
    beside them completes, and the server serves on."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    results = {}

    def good():
        results["good"] = client.chat.completions.create(model=NAME, messages=MSG,
                                                         max_tokens=20, temperature=0)
    t = threading.Thread(target=good)
    t.start()
    poisoned = [{"role": "user", "content": "POISON"}]
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=NAME, messages=poisoned, max_tokens=5)
    assert "the fake model failed" in str(e.value)
    with pytest.raises(openai.APIError) as e:       # the stream's error event
        for _ in client.chat.completions.create(model=NAME, messages=poisoned, max_tokens=5,
                                                stream=True):
            pass
    assert "the fake model failed" in str(e.value)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user",
                                                              "content": "CRASH"}])
    assert "RuntimeError: the fake engine crashed" in str(e.value)
    t.join(timeout=60)
    assert results["good"].usage.completion_tokens == 20
    assert client.chat.completions.create(model=NAME, messages=MSG, max_tokens=2).choices
    assert httpx.get(live.url + "/health").status_code == 200


def test_503_while_loading_then_ready(tok):
    """The server listens while the model loads: /health and the API answer
    503 (loading), then 200; a load that fails leaves 503 with its error."""
    gate = threading.Event()
    engine = FakeEngine(tok, n_ctx=64)

    def load():
        gate.wait(30)
        return engine

    with serve(load=load) as live:
        r = httpx.get(live.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = httpx.post(live.url + CHAT, json=_chat(max_tokens=2))
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert r.headers["retry-after"] == "2"
        gate.set()
        assert wait_until(lambda: httpx.get(live.url + "/health").status_code == 200)
        assert httpx.post(live.url + CHAT, json=_chat(max_tokens=2)).status_code == 200
        assert httpx.get(live.url + "/v1/models").json()["data"][0]["id"] == engine.model_name

    errors = []

    def broken():
        raise FileNotFoundError("model.gguf: no such file")

    with serve(load=broken, on_load_error=errors.append) as live:
        assert wait_until(lambda: errors)
        r = httpx.get(live.url + "/health")
        assert r.status_code == 503 and "no such file" in r.json()["error"]
        r = httpx.post(live.url + CHAT, json=_chat(max_tokens=2))
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"


def test_fake_engine_module_is_the_api(live):
    """The app takes RequestSettings and EngineOverloaded from the module
    it is given (the real engine's, once it exists)."""
    assert live.server.config.app.app.state.server.api is fake_engine
