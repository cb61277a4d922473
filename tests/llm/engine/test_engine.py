"""The Engine API on the fake runner: offline batches, events from threads
and from asyncio, cancellation and disconnects, text and stop strings,
per-request errors, the queue limit, closing."""

import asyncio
import gc
import os
import threading

import pytest

from engine_fakes import FakeRunner
from ptxgen.llm.engine import Engine, EngineOverloaded, RequestSettings
from ptxgen.llm.generation import SamplingSettings
from ptxgen.llm.text.tokenizer import Tokenizer

VOCAB = os.path.join(os.path.dirname(__file__), "..", "..", "data", "vocab",
                     "ggml-vocab-phi-3.gguf")
GREEDY = SamplingSettings()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(VOCAB)


class GatedRunner:
    """A runner whose calls each wait for a permit (``release(n)``)."""

    def __init__(self, inner):
        self.inner = inner
        self.permits = threading.Semaphore(0)
        self.done = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def release(self, n=1):
        for _ in range(n):
            self.permits.release()

    def _gate(self, fn, arg):
        assert self.permits.acquire(timeout=30), "the test never released this step"
        try:
            return fn(arg)
        finally:
            self.done += 1

    def decode(self, rows):
        return self._gate(self.inner.decode, rows)

    def prefill(self, chunk):
        return self._gate(self.inner.prefill, chunk)


def prompt_of(rng, n, vocab=1000):
    return [int(t) for t in rng.integers(0, vocab, n)]


def reference(runner, engine, prompt, settings, seed):
    return runner.reference(prompt, settings.max_tokens, settings.sampling, seed,
                            set(settings.stop_token_ids), engine.n_ctx)


@pytest.fixture
def engine_and_runner():
    made = []

    def make(runner=None, **kw):
        runner = runner or FakeRunner(num_blocks=64, block_size=4, max_batch=8, chunk=8)
        eng = Engine(runner, **kw)
        made.append(eng)
        return eng, runner
    yield make
    for e in made:
        e.close()


def test_generate_returns_each_prompts_tokens_in_order(rng, engine_and_runner):
    eng, runner = engine_and_runner()
    prompts = [prompt_of(rng, int(rng.integers(1, 20))) for _ in range(12)]
    settings = [RequestSettings(max_tokens=int(rng.integers(1, 15)),
                                sampling=SamplingSettings(temperature=0.7, seed=i))
                for i in range(12)]
    outs = eng.generate(prompts, settings)
    assert len(outs) == 12
    for p, s, o in zip(prompts, settings, outs):
        assert list(o.token_ids) == reference(runner, eng, p, s, s.sampling.seed)
        assert o.prompt_tokens == len(p) and o.finish_reason == "length"
        assert o.text == "" and o.logprobs == () and o.error is None
        assert 0 <= o.ttft_s <= o.total_s
    st = eng.stats()
    assert st.running == st.waiting == st.blocks_used == 0
    assert st.blocks_free == st.blocks_total == 64
    assert st.finished == 12 and st.generated_tokens == sum(len(o.token_ids) for o in outs)
    assert st.prompt_tokens + st.cached_tokens <= sum(len(p) for p in prompts)
    assert st.decode_steps + st.prefill_steps == st.steps == len(runner.calls)


def test_generate_beyond_max_queue_waits_for_room(rng, engine_and_runner):
    eng, runner = engine_and_runner(max_queue=3)
    prompts = [prompt_of(rng, 5) for _ in range(20)]
    outs = eng.generate(prompts, RequestSettings(max_tokens=4))
    assert [len(o.token_ids) for o in outs] == [4] * 20


def test_a_generate_batch_starts_together(rng, engine_and_runner):
    gated = GatedRunner(FakeRunner(num_blocks=64, block_size=4, max_batch=8, chunk=8))
    eng, _ = engine_and_runner(gated)
    got = []
    t = threading.Thread(target=lambda: got.append(eng.generate(
        [prompt_of(rng, 3) for _ in range(8)], RequestSettings(max_tokens=2))))
    t.start()
    while eng.stats().running == 0:
        threading.Event().wait(0.01)
    assert eng.stats().running == 8
    gated.release(1000)
    t.join(10)
    assert [o.finish_reason for o in got[0]] == ["length"] * 8


def test_events_add_up_to_the_output(rng, engine_and_runner):
    eng, runner = engine_and_runner()
    p = prompt_of(rng, 7)
    s = RequestSettings(max_tokens=9, logprobs=3)
    req = eng.add_request(p, s, request_id="abc")
    events = list(req)
    assert req.id == "abc" and req.finished
    assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + ["length"]
    toks = [t for e in events for t in e.token_ids]
    out = req.result()
    assert toks == list(out.token_ids) == reference(runner, eng, p, s, 0)
    lps = [lp for e in events for lp in e.logprobs]
    assert [lp[0] for lp in lps] == toks and lps == list(out.logprobs)
    assert all(len(lp[2]) == 3 for lp in lps)


def test_asyncio_consumers(rng, engine_and_runner):
    eng, runner = engine_and_runner()
    prompts = [prompt_of(rng, int(rng.integers(1, 15))) for _ in range(6)]
    s = RequestSettings(max_tokens=12)

    async def consume(p):
        toks, last = [], None
        async for ev in eng.add_request(p, s):
            toks += ev.token_ids
            last = ev
        return toks, last.finish_reason

    async def main():
        return await asyncio.gather(*(consume(p) for p in prompts))

    for p, (toks, reason) in zip(prompts, asyncio.run(main())):
        assert toks == reference(runner, eng, p, s, 0) and reason == "length"


def _first_event(req, gated):
    """Release runner calls one at a time until ``req`` has an event;
    returns it and the iterator."""
    import queue
    got = queue.Queue()
    it = iter(req)
    threading.Thread(target=lambda: got.put(next(it)), daemon=True).start()
    for _ in range(100):
        try:
            return got.get(timeout=0.05), it
        except queue.Empty:
            gated.release(1)
    raise AssertionError("no event")


def test_a_cancel_frees_blocks_within_one_step(rng, engine_and_runner):
    """After cancel(), at most the runner call under way completes before
    the request ends and its blocks are back."""
    gated = GatedRunner(FakeRunner(num_blocks=64, block_size=4, max_batch=8, chunk=8))
    eng, _ = engine_and_runner(gated)
    keep = eng.add_request(prompt_of(rng, 6), RequestSettings(max_tokens=50))
    gone = eng.add_request(prompt_of(rng, 14), RequestSettings(max_tokens=50))
    first, _ = _first_event(gone, gated)
    assert first.token_ids and first.finish_reason is None
    used = eng.stats().blocks_used
    assert used >= 2 + 4
    done = gated.done
    assert eng.cancel(gone.id)
    gated.release(1)                 # the call under way (or about to start) completes
    out = gone.result(timeout=10)
    assert out.finish_reason == "cancelled"
    assert gated.done <= done + 1
    st = eng.stats()                 # gone's 4 blocks are back; keep may have taken one more
    assert st.running == 1 and st.blocks_used <= used - 4 + 1
    assert not eng.cancel(gone.id)          # gone already
    gated.release(1000)
    assert keep.result(timeout=10).finish_reason == "length"


def test_leaving_the_iteration_early_cancels(rng, engine_and_runner):
    """A consumer that stops listening (a client gone) cancels its request."""
    gated = GatedRunner(FakeRunner(num_blocks=64, block_size=4, max_batch=8, chunk=8))
    eng, _ = engine_and_runner(gated)
    s = RequestSettings(max_tokens=200)
    req = eng.add_request(prompt_of(rng, 5), s)
    ev, it = _first_event(req, gated)
    it.close()                               # a `break` out of the for loop
    gated.release(2)
    assert req.result(timeout=10).finish_reason == "cancelled"

    async def disconnect():
        r = eng.add_request(prompt_of(rng, 5), s)
        agen = r.__aiter__()
        gated.release(2)
        await agen.__anext__()
        await agen.aclose()                  # what a server does when the client goes
        return r

    r = asyncio.run(disconnect())
    gated.release(2)
    assert r.result(timeout=10).finish_reason == "cancelled"

    async def task_cancelled():
        r = eng.add_request(prompt_of(rng, 5), s)
        started = asyncio.Event()

        async def consume():
            async for _ in r:
                started.set()
        t = asyncio.ensure_future(consume())
        gated.release(2)
        await started.wait()
        t.cancel()                           # the server's handler task is cancelled
        with pytest.raises(asyncio.CancelledError):
            await t
        return r

    r = asyncio.run(task_cancelled())
    gated.release(2)
    assert r.result(timeout=10).finish_reason == "cancelled"
    assert eng.stats().blocks_used == 0


def _script_runner(tok, script, n_prompt):
    def next_token(ctx, sampling, seed, n_vocab):
        return script[(len(ctx) - n_prompt) % len(script)]
    return FakeRunner(num_blocks=64, block_size=4, max_batch=8, chunk=8, n_vocab=tok.n_vocab,
                      next_token=next_token)


def _text(tok, toks):
    return b"".join(tok.token_to_piece(t) for t in toks).decode("utf-8", "replace")


def test_stop_strings_end_the_text_before_them(tok, engine_and_runner):
    script = tok.encode(" Hello world. The end. And more text after it.", add_special=False)
    prompt = tok.encode("Say:", add_special=False)
    eng, _ = engine_and_runner(_script_runner(tok, script, len(prompt)), tokenizer=tok)
    full = _text(tok, script)
    for stop in ("The end", "ld. T", "d.", "never there"):
        req = eng.add_request(prompt, RequestSettings(max_tokens=len(script), stop=(stop, "zzz")))
        events = list(req)
        out = req.result()
        assert "".join(e.text for e in events) == out.text
        if stop in full:
            assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]
            # the tokens stop with the one that completed the stop string
            n = next(i for i in range(1, len(script) + 1) if stop in _text(tok, script[:i]))
            assert list(out.token_ids) == script[:n]
        else:
            assert out.finish_reason == "length" and out.text == full
        assert all(stop not in e.text for e in events)


def test_end_of_generation_tokens(tok, engine_and_runner):
    eot = 32007
    assert tok.is_eog(eot)
    script = tok.encode(" Hi there", add_special=False) + [eot] + \
        tok.encode(" more", add_special=False)
    prompt = tok.encode("Hello", add_special=True)
    eng, _ = engine_and_runner(_script_runner(tok, script, len(prompt)), tokenizer=tok)
    n_hi = script.index(eot)
    out = eng.generate([prompt], RequestSettings(max_tokens=20))[0]
    assert out.finish_reason == "stop" and list(out.token_ids) == script[:n_hi + 1]
    assert out.text == _text(tok, script[:n_hi])
    out = eng.generate([prompt], RequestSettings(max_tokens=len(script), ignore_eos=True))[0]
    assert out.finish_reason == "length" and list(out.token_ids) == script
    stop_id = script[1]
    out = eng.generate([prompt], RequestSettings(max_tokens=20, stop_token_ids=(stop_id,)))[0]
    assert out.finish_reason == "stop" and list(out.token_ids) == script[:2]
    assert out.text == _text(tok, script[:1])


def test_text_prompts_are_encoded_with_the_tokenizer(tok, engine_and_runner):
    runner = FakeRunner(num_blocks=64, block_size=4, max_batch=8, chunk=8, n_vocab=tok.n_vocab)
    eng, _ = engine_and_runner(runner, tokenizer=tok)
    text = "The capital of France is"
    ids = tok.encode(text, add_special=True, parse_special=True)
    out = eng.generate([text, ids], RequestSettings(max_tokens=5, ignore_eos=True))
    assert out[0].prompt_tokens == len(ids)
    assert out[0].token_ids == out[1].token_ids
    assert out[0].text == _text(tok, out[0].token_ids)


def test_multi_byte_characters_arrive_whole(tok, engine_and_runner):
    """The byte tokens of "é" (0xC3 0xA9): no text until the character is whole."""
    c3, a9, bang = (next(t for t in range(tok.n_vocab) if tok.token_to_piece(t) == b)
                    for b in (b"\xc3", b"\xa9", b"!"))
    prompt = [1, 2]
    eng, _ = engine_and_runner(_script_runner(tok, [c3, a9, bang], len(prompt)), tokenizer=tok)
    events = list(eng.add_request(prompt, RequestSettings(max_tokens=3)))
    assert [e.text for e in events] == ["", "é", "!"]


def test_bad_requests_are_refused_before_they_run(rng, engine_and_runner, tok):
    runner = FakeRunner(num_blocks=64, block_size=4, max_batch=8, chunk=8, max_blocks_per_seq=4)
    eng, _ = engine_and_runner(runner)
    s = RequestSettings(max_tokens=4)
    assert eng.n_ctx == 16
    with pytest.raises(ValueError, match="the prompt has 16 tokens; the context holds 16 per "
                                         "sequence, so a prompt may have at most 15"):
        eng.add_request(prompt_of(rng, 16), s)
    with pytest.raises(ValueError, match="the prompt is empty"):
        eng.add_request([], s)
    with pytest.raises(ValueError, match=r"token id 1000 is outside the vocabulary \(0..999\)"):
        eng.add_request([1, 1000], s)
    with pytest.raises(TypeError, match="settings must be a RequestSettings, got dict"):
        eng.add_request([1], {"max_tokens": 3})
    with pytest.raises(ValueError, match="stop strings need the model file's tokenizer"):
        eng.add_request([1], RequestSettings(max_tokens=3, stop=("x",)))
    with pytest.raises(ValueError, match="text prompts need the model file's tokenizer"):
        eng.generate(["hello"], s)
    with pytest.raises(TypeError, match="generate takes a list of prompts"):
        eng.generate([1, 2, 3], s)
    with pytest.raises(ValueError, match="2 settings for 1 prompts"):
        eng.generate([[1]], [s, s])
    assert eng.stats().finished == 0


@pytest.mark.parametrize("kw, msg", [
    (dict(max_tokens=0), "max_tokens must be a positive int, got 0"),
    (dict(max_tokens=2, logprobs=21), r"logprobs must be an int in 0 .. 20, got 21"),
    (dict(max_tokens=2, stop=(3,)), r"stop strings must be str, got 3 \(int\)"),
    (dict(max_tokens=2, stop_token_ids=(-1,)), "stop_token_ids must be non-negative ints"),
    (dict(max_tokens=2, sampling={"temperature": 1}), "sampling must be a SamplingSettings"),
])
def test_request_settings_are_validated(kw, msg):
    with pytest.raises((TypeError, ValueError), match=msg):
        RequestSettings(**kw)


def test_a_single_stop_string_or_id_is_a_tuple_of_one():
    assert RequestSettings(max_tokens=1, stop="\n\n").stop == ("\n\n",)
    assert RequestSettings(max_tokens=1, stop_token_ids=7).stop_token_ids == (7,)


def test_a_request_id_in_use_is_refused(rng, engine_and_runner):
    gated = GatedRunner(FakeRunner(num_blocks=64, block_size=4, max_batch=8, chunk=8))
    eng, _ = engine_and_runner(gated)
    r = eng.add_request([1, 2], RequestSettings(max_tokens=3), request_id="x")
    with pytest.raises(ValueError, match="request id 'x' is in use"):
        eng.add_request([1, 2], RequestSettings(max_tokens=3), request_id="x")
    gated.release(100)
    r.result(timeout=10)
    eng.add_request([1, 2], RequestSettings(max_tokens=3), request_id="x").result(timeout=10)


def test_the_queue_limit_raises_engine_overloaded(rng, engine_and_runner):
    gated = GatedRunner(FakeRunner(num_blocks=64, block_size=4, max_batch=1, chunk=8))
    eng, _ = engine_and_runner(gated, max_queue=2)
    s = RequestSettings(max_tokens=3)
    reqs = [eng.add_request([1, 2, 3], s)]
    while eng.stats().running < 1:        # the first one is admitted (max_batch 1)
        threading.Event().wait(0.01)
    reqs += [eng.add_request([1, 2, 3], s) for _ in range(2)]
    with pytest.raises(EngineOverloaded, match=r"2 requests are waiting to start \(max_queue 2\)"):
        eng.add_request([1, 2, 3], s)
    gated.release(1000)
    assert all(r.result(timeout=10).finish_reason == "length" for r in reqs)


def test_an_error_in_one_requests_processing_ends_only_that_request(rng, tok, engine_and_runner):
    """A tokenizer that fails on one token: that request ends with "error",
    the others (and later ones) are untouched."""
    class Brittle:
        def __init__(self, tok):
            self.tok = tok
            self.n_vocab = tok.n_vocab
            self.eog_ids = tok.eog_ids

        def stream_decoder(self):
            dec = self.tok.stream_decoder()

            class D:
                def feed(_, t):
                    if t == 666:
                        raise UnicodeError("cannot show token 666")
                    return dec.feed(t)

                def flush(_):
                    return dec.flush()
            return D()

    def next_token(ctx, sampling, seed, n_vocab):
        return 666 if ctx[0] == 5 else 1000 + len(ctx)
    runner = FakeRunner(num_blocks=64, block_size=4, max_batch=8, chunk=8, n_vocab=tok.n_vocab,
                        next_token=next_token)
    eng, _ = engine_and_runner(runner, tokenizer=Brittle(tok))
    s = RequestSettings(max_tokens=6)
    bad = eng.add_request([5, 1, 2], s)
    good = [eng.add_request([7, 1, 2, i], s) for i in range(3)]
    out = bad.result(timeout=10)
    assert out.finish_reason == "error" and "UnicodeError: cannot show token 666" in out.error
    for g in good:
        o = g.result(timeout=10)
        assert o.finish_reason == "length" and len(o.token_ids) == 6
    assert eng.generate([[7, 7]], s)[0].finish_reason == "length"
    assert eng.stats().blocks_used == 0


def test_a_fault_of_the_step_ends_the_requests_but_not_the_loop(rng, engine_and_runner):
    gated = GatedRunner(FakeRunner(num_blocks=64, block_size=4, max_batch=8, chunk=8))
    eng, runner = engine_and_runner(gated)
    sched = eng._core.sched
    real = sched.step
    failed = []

    def broken():                     # fails once, after a decode step
        if not failed and sched.counters["decode_steps"] >= 1:
            failed.append(1)
            raise KeyError("boom")
        return real()
    sched.step = broken
    s = RequestSettings(max_tokens=20)
    reqs = [eng.add_request(prompt_of(rng, 3), s) for _ in range(2)]
    gated.release(1000)
    out = [r.result(timeout=10) for r in reqs]
    assert {o.finish_reason for o in out} == {"error"}
    assert "the engine's step failed: KeyError: 'boom'" in out[0].error
    ok = eng.generate([prompt_of(rng, 3)], RequestSettings(max_tokens=5))[0]
    assert ok.finish_reason == "length"
    assert eng.stats().blocks_used == 0


def test_close_cancels_what_runs_and_refuses_more(rng, engine_and_runner):
    gated = GatedRunner(FakeRunner(num_blocks=64, block_size=4, max_batch=8, chunk=8))
    eng, _ = engine_and_runner(gated)
    reqs = [eng.add_request(prompt_of(rng, 4), RequestSettings(max_tokens=100)) for _ in range(3)]
    # a step at a time until every request has a token (how the three
    # arrive decides how many prefill steps that takes)
    for _ in range(1000):
        if eng.stats().generated_tokens >= 3:
            break
        gated.release(1)
        threading.Event().wait(0.01)
    assert eng.stats().generated_tokens >= 3
    closer = threading.Thread(target=eng.close)
    closer.start()
    # a step at a time until the close lands (all at once, a loaded machine
    # could run the requests to max_tokens before the loop saw the close)
    for _ in range(1000):
        if not closer.is_alive():
            break
        gated.release(1)
        closer.join(0.01)
    assert eng.closed
    for r in reqs:
        out = r.result(timeout=10)
        assert out.finish_reason == "cancelled" and len(out.token_ids) >= 1
    with pytest.raises(RuntimeError, match="the engine is closed"):
        eng.add_request([1], RequestSettings(max_tokens=1))
    assert not eng.cancel(reqs[0].id)
    assert eng._core.sched.blocks.num_used == 0


def test_a_dropped_engine_stops_its_thread():
    eng = Engine(FakeRunner())
    thread = eng._thread
    assert thread.is_alive()
    del eng
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_from_gguf_reads_the_tokenizer_and_name(tmp_path, tok):
    pytest.importorskip("gguf")
    from ptxgen.llm.gguf.synth import write_synthetic_llama
    path = tmp_path / "tiny-vocab.gguf"
    write_synthetic_llama(path, n_layers=1, hidden=128, ffn=256, n_heads=2, n_kv_heads=1,
                          qtype="Q8_0", output_qtype="Q8_0", context_length=256, seed=1,
                          vocab_from=VOCAB, vocab_limit=700)
    runner = FakeRunner(n_vocab=700)
    with Engine.from_gguf(str(path), runner=runner) as eng:
        assert eng.tokenizer is not None and eng.tokenizer.n_vocab >= 700
        assert eng.model_name == "synthetic-llama (Phi3 vocabulary)"
        assert "blocks of 4 tokens" in repr(eng)


def test_random_requests_and_cancels_from_threads_leave_the_pool_empty(rng, engine_and_runner):
    """300 requests from three threads, a third of them cancelled at random
    moments from another: each output is its reference (or a prefix of it,
    when cancelled), and the pool ends as it started."""
    runner = FakeRunner(num_blocks=40, block_size=4, max_batch=12, chunk=8,
                        max_blocks_per_seq=10)
    eng, _ = engine_and_runner(runner, max_queue=1000)
    jobs = [(prompt_of(rng, int(rng.integers(1, 30))),
             RequestSettings(max_tokens=int(rng.integers(1, 20)),
                             sampling=SamplingSettings(temperature=float(rng.integers(0, 2)),
                                                       seed=i)))
            for i in range(300)]
    reqs = [None] * len(jobs)

    def submit(part):
        for i in part:
            reqs[i] = eng.add_request(*jobs[i])

    threads = [threading.Thread(target=submit, args=(range(k, 300, 3),)) for k in range(3)]
    for t in threads:
        t.start()
    for i in rng.permutation(300)[:100]:
        while reqs[i] is None:
            threading.Event().wait(0.001)
        eng.cancel(reqs[i].id)
    for t in threads:
        t.join()
    n_cancelled = 0
    for (p, s), r in zip(jobs, reqs):
        out = r.result(timeout=30)
        want = reference(runner, eng, p, s, s.sampling.seed)
        if out.finish_reason == "cancelled":
            n_cancelled += 1
            assert list(out.token_ids) == want[:len(out.token_ids)]
        else:
            assert out.finish_reason == "length" and list(out.token_ids) == want
    assert n_cancelled > 0
    st = eng.stats()
    assert st.blocks_used == 0 and st.running == st.waiting == 0 and st.finished == 300
    eng._core.sched.check()


def test_event_lists_take_what_has_arrived_at_once(rng, engine_and_runner):
    """``event_lists`` hands a consumer that fell behind all the waiting
    events in one list, and leaving it early cancels, as ``async for`` does."""
    eng, runner = engine_and_runner()
    s = RequestSettings(max_tokens=int(rng.integers(3, 9)))
    p = prompt_of(rng, int(rng.integers(2, 9)))
    req = eng.add_request(p, s)
    out = req.result(timeout=10)             # every event is waiting

    async def take_all(r):
        return [evs async for evs in r.event_lists()]

    lists = asyncio.run(take_all(req))
    assert len(lists) == 1 and lists[0][-1].finish_reason == "length"
    assert [t for ev in lists[0] for t in ev.token_ids] == list(out.token_ids)
    assert list(out.token_ids) == reference(runner, eng, p, s, 0)  # greedy

    gated = GatedRunner(FakeRunner(num_blocks=64, block_size=4, max_batch=8, chunk=8))
    eng2, _ = engine_and_runner(gated)

    async def leave_early():
        r = eng2.add_request(prompt_of(rng, 5), RequestSettings(max_tokens=200))
        lists = r.event_lists()
        gated.release(2)
        await lists.__anext__()
        await lists.aclose()
        return r

    r = asyncio.run(leave_early())
    gated.release(2)
    assert r.result(timeout=10).finish_reason == "cancelled"
