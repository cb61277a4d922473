"""Clients that go away: a streaming client that closes its connection, a
client that times out waiting for a whole reply, a request that leaves
while still queued; each has its engine request cancelled and its blocks
freed.  A load of 1,000 requests, a random share of them abandoned at a
random point, leaves no sequence running or waiting and no block held,
and the server keeps serving throughout."""

import asyncio
import json

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from live import phi3_tokenizer, serve, wait_until

NAME = "fake-tiny"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tok():
    return phi3_tokenizer()


def _idle(engine) -> bool:
    s = engine.stats()
    return s.running == 0 and s.waiting == 0 and s.blocks_used == 0


def _body(**kw):
    return {"model": NAME, "messages": MSG, "temperature": 0, **kw}


def test_closing_a_stream_cancels_its_sequence(tok):
    engine = FakeEngine(tok, n_ctx=512, max_seqs=4, step_s=0.01, eog_logit=-30)
    with serve(engine) as live:
        with httpx.stream("POST", live.url + CHAT, json=_body(max_tokens=400, stream=True),
                          timeout=30) as r:
            lines = r.iter_lines()
            events = [json.loads(next(ln for ln in lines if ln)[6:]) for _ in range(3)]
            assert engine.stats().running == 1 and engine.stats().blocks_used > 0
        rid = events[0]["id"] + "-0"
        assert wait_until(lambda: rid in engine.cancelled, timeout=5)
        assert wait_until(lambda: _idle(engine), timeout=5)
        # the openai client's close() does the same
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=400,
                                                stream=True)
        first = next(iter(stream))
        stream.close()
        assert wait_until(lambda: first.id + "-0" in engine.cancelled, timeout=5)
        assert wait_until(lambda: _idle(engine), timeout=5)


def test_a_client_that_stops_waiting_cancels_its_request(tok):
    """Non-streaming: the client times out; a queued request: its client
    leaves before it was admitted."""
    engine = FakeEngine(tok, n_ctx=512, max_seqs=1, step_s=0.01, eog_logit=-30)
    with serve(engine) as live:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + CHAT, json=_body(max_tokens=400), timeout=0.5)
        assert wait_until(lambda: len(engine.cancelled) == 1, timeout=5)
        assert wait_until(lambda: _idle(engine), timeout=5)

        async def queued():
            async with httpx.AsyncClient(timeout=60) as c:
                long = asyncio.create_task(c.post(live.url + CHAT, json=_body(max_tokens=300)))
                await asyncio.sleep(0.3)
                assert engine.stats().running == 1
                with pytest.raises(httpx.ReadTimeout):
                    await c.post(live.url + CHAT, json=_body(max_tokens=5), timeout=0.5)
                assert wait_until(lambda: engine.stats().waiting == 0, timeout=5)
                assert len(engine.cancelled) == 2
                r = await long
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 300

        asyncio.run(queued())
        assert _idle(engine)


def test_a_thousand_requests_with_random_disconnects(tok, rng):
    engine = FakeEngine(tok, n_ctx=256, max_seqs=32, max_queue=2000, step_s=0.001,
                        eog_logit=-30)
    n = 1000
    kinds = rng.choice(["stream", "stream_abandon", "whole", "whole_abandon"], size=n,
                       p=[0.3, 0.25, 0.3, 0.15])
    budgets = rng.integers(1, 41, size=n)
    lengths = rng.integers(1, 60, size=n)
    cut_after = rng.integers(1, 8, size=n)
    words = ["alpha", "beta", "gamma", "delta", "gpu", "kernel", "token"]
    prompts = [" ".join(rng.choice(words, size=int(k))) for k in lengths]
    results = {}

    async def one(c, i, url):
        body = _body(max_tokens=int(budgets[i]), messages=[{"role": "user",
                                                             "content": prompts[i]}])
        kind = kinds[i]
        if kind.startswith("stream"):
            body.update(stream=True, stream_options={"include_usage": True})
            async with c.stream("POST", url + CHAT, json=body) as r:
                assert r.status_code == 200
                got = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    obj = json.loads(line[6:])
                    if obj.get("usage"):
                        results[i] = obj["usage"]["completion_tokens"]
                    got += 1
                    if kind == "stream_abandon" and got >= cut_after[i]:
                        results[i] = "abandoned"
                        return
        elif kind == "whole":
            r = await c.post(url + CHAT, json=body)
            assert r.status_code == 200, r.text
            results[i] = r.json()["usage"]["completion_tokens"]
        else:
            try:
                r = await c.post(url + CHAT, json=body, timeout=float(rng.uniform(0.001, 0.05)))
                results[i] = r.json()["usage"]["completion_tokens"]
            except httpx.TimeoutException:
                results[i] = "abandoned"

    async def load(url):
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            sem = asyncio.Semaphore(64)

            async def bounded(i):
                async with sem:
                    await one(c, i, url)
            await asyncio.gather(*[bounded(i) for i in range(n)])
            # the server keeps serving: a request after the storm
            r = await c.post(url + CHAT, json=_body(max_tokens=3))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

    with serve(engine) as live:
        asyncio.run(load(live.url))
        assert wait_until(lambda: _idle(engine), timeout=10), engine.stats()
        assert httpx.get(live.url + "/health").status_code == 200
    assert len(results) == n
    for i, got in results.items():
        if got != "abandoned":
            assert got == budgets[i], (i, kinds[i], got, budgets[i])
    abandoned = sum(1 for v in results.values() if v == "abandoned")
    assert abandoned > 100 and len(engine.cancelled) > 50
    # a client gone before its request reached the engine never got there
    whole_abandoned = sum(1 for i, v in results.items()
                          if v == "abandoned" and kinds[i] == "whole_abandon")
    assert n + 1 - whole_abandoned <= len(engine.prompts) <= n + 1
