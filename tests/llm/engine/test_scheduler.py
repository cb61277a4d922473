"""Continuous batching on the fake runner: every request gets the tokens
it gets alone, whatever joins, leaves, is preempted or shares its prefix;
the pool ends as it started."""

import pytest

from engine_fakes import FakeRunner
from ptxgen.llm.engine.requests import RequestSettings
from ptxgen.llm.engine.scheduler import FINISHED, RUNNING, WAITING, Scheduler, Sequence
from ptxgen.llm.generation import SamplingSettings

GREEDY = SamplingSettings()


def make(**kw):
    sched_kw = {k: kw.pop(k) for k in ("prefill_budget", "prefix_caching") if k in kw}
    runner = FakeRunner(**kw)
    sched = Scheduler(runner, **sched_kw)
    runner.blocks = sched.blocks
    return runner, sched


def new_seq(rng, i, *, n_prompt=None, max_tokens=None, sampling=GREEDY, stop_ids=(), vocab=1000,
            prompt=None):
    if prompt is None:
        n = n_prompt if n_prompt is not None else int(rng.integers(1, 30))
        prompt = [int(t) for t in rng.integers(0, vocab, n)]
    mt = max_tokens if max_tokens is not None else int(rng.integers(1, 20))
    return Sequence(f"r{i}", prompt, RequestSettings(max_tokens=mt, sampling=sampling),
                    seed=int(rng.integers(0, 2**63)), stop_ids=stop_ids)


def expected(runner, sched, seq):
    return runner.reference(seq.tokens[:seq.n_prompt], seq.settings.max_tokens,
                            seq.settings.sampling, seq.seed, seq.stop_ids, sched.n_ctx)


def run_all(sched, max_steps=100_000):
    outs = []
    for _ in range(max_steps):
        if not sched.has_work:
            return outs
        outs.append(sched.step())
        sched.check()
    raise AssertionError("the scheduler did not finish")


def assert_pool_as_started(sched):
    sched.check()
    assert not sched.running and not sched.waiting
    b = sched.blocks
    assert b.num_free == b.num_blocks and b.num_used == 0
    assert all(b.ref_count(i) == 0 for i in range(b.num_blocks))


def test_a_batch_gets_the_tokens_each_gets_alone(rng):
    runner, sched = make(num_blocks=64, block_size=4, max_batch=8, chunk=8)
    seqs = [new_seq(rng, i) for i in range(8)]
    for s in seqs:
        sched.add(s)
    run_all(sched)
    for s in seqs:
        assert s.status == FINISHED
        assert s.output == expected(runner, sched, s), s
    assert max(c[1] for c in runner.calls if c[0] == "decode") > 1     # really batched
    assert_pool_as_started(sched)


def test_requests_join_mid_run(rng):
    """Requests added while others decode join the next steps; everyone
    gets its own tokens, and a decode step carries old and new together."""
    runner, sched = make(num_blocks=64, block_size=4, max_batch=8, chunk=8)
    first = [new_seq(rng, i, max_tokens=30) for i in range(3)]
    for s in first:
        sched.add(s)
    for _ in range(8):
        sched.step()
    assert any(len(s.output) > 1 for s in first)
    late = [new_seq(rng, 10 + i, max_tokens=10) for i in range(3)]
    for s in late:
        sched.add(s)
    mixed = False
    while sched.has_work:
        out = sched.step()
        ids = {s.id for s, _ in out.tokens}
        mixed |= out.kind == "decode" and bool(ids & {s.id for s in first}) \
            and bool(ids & {s.id for s in late})
        sched.check()
    assert mixed
    for s in first + late:
        assert s.output == expected(runner, sched, s)
    assert_pool_as_started(sched)


def test_a_cancelled_request_frees_its_blocks_at_once(rng):
    runner, sched = make(num_blocks=64, block_size=4, max_batch=8, chunk=8)
    keep = new_seq(rng, 0, n_prompt=9, max_tokens=20)
    gone = new_seq(rng, 1, n_prompt=17, max_tokens=20)
    sched.add(keep)
    sched.add(gone)
    while len(gone.output) < 3:
        sched.step()
    held = len(gone.blocks)
    assert held >= 5
    used = sched.blocks.num_used
    sched.abort(gone)
    assert gone.status == FINISHED and gone.finish_reason == "cancelled" and not gone.blocks
    assert sched.blocks.num_used == used - held
    sched.check()
    run_all(sched)
    assert keep.output == expected(runner, sched, keep)
    assert_pool_as_started(sched)


def test_cancelling_a_waiting_request(rng):
    runner, sched = make(num_blocks=64, block_size=4, max_batch=1, chunk=8)
    a, b = new_seq(rng, 0), new_seq(rng, 1)
    sched.add(a)
    sched.add(b)
    sched.step()
    assert b.status == WAITING
    sched.abort(b)
    assert b.status == FINISHED and b not in sched.waiting
    run_all(sched)
    assert_pool_as_started(sched)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingSettings(temperature=0.8, seed=None),
                                      SamplingSettings(repeat_penalty=1.1, repeat_last_n=5)],
                         ids=["greedy", "sampled", "penalties"])
def test_preemption_under_a_small_pool_finishes_every_request_alike(rng, sampling):
    """A pool too small for the batch: sequences are preempted (their
    blocks freed, recomputed later) and still produce their own tokens."""
    runner, sched = make(num_blocks=12, block_size=4, max_batch=6, chunk=8,
                         max_blocks_per_seq=10)
    seqs = [new_seq(rng, i, n_prompt=int(rng.integers(4, 12)), max_tokens=int(rng.integers(10, 24)),
                    sampling=sampling) for i in range(6)]
    for s in seqs:
        sched.add(s)
    run_all(sched)
    assert sched.counters["preemptions"] > 0
    assert sum(s.preemptions for s in seqs) == sched.counters["preemptions"]
    for s in seqs:
        assert s.finish_reason == "length"
        assert s.output == expected(runner, sched, s)
    assert_pool_as_started(sched)


def test_prefix_sharing_saves_the_shared_blocks(rng):
    """Four requests that share a 3-block prefix, added at once: once all
    are decoding, they hold the prefix's blocks in common, and the pool
    holds 3 blocks for them where it would hold 12; without prefix caching
    nothing is shared."""
    bs, n_shared, n = 4, 3, 4
    shared = [int(t) for t in rng.integers(0, 1000, n_shared * bs)]
    prompts = [shared + [int(t) for t in rng.integers(0, 1000, 1 + 2 * i)] for i in range(n)]

    def blocks_while_decoding(prefix_caching):
        runner, sched = make(num_blocks=64, block_size=bs, max_batch=8, chunk=8,
                             prefix_caching=prefix_caching)
        seqs = [new_seq(rng, i, prompt=p, max_tokens=30) for i, p in enumerate(prompts)]
        for s in seqs:
            sched.add(s)
        while any(s.pending > 1 or s.status == WAITING for s in seqs):
            sched.step()
        assert all(s.status == RUNNING for s in seqs)
        used = sched.blocks.num_used
        held = sum(len(s.blocks) for s in seqs)
        common = {tuple(s.blocks[:n_shared]) for s in seqs}
        run_all(sched)
        for s in seqs:
            assert s.output == expected(runner, sched, s)
        assert_pool_as_started(sched)
        return used, held, common, sched.counters["cached_tokens"]

    used, held, common, cached = blocks_while_decoding(True)
    assert len(common) == 1 and used == held - (n - 1) * n_shared
    assert cached == (n - 1) * n_shared * bs
    used, held, common, cached = blocks_while_decoding(False)
    assert len(common) == n and used == held and cached == 0


def test_a_later_request_reuses_a_finished_ones_blocks(rng):
    """The prefix cache keeps a finished sequence's full blocks; the same
    prompt again computes only its last token (a decode step)."""
    runner, sched = make(num_blocks=32, block_size=4, max_batch=4, chunk=8)
    prompt = [int(t) for t in rng.integers(0, 1000, 13)]
    a = new_seq(rng, 0, prompt=prompt, max_tokens=3)
    sched.add(a)
    run_all(sched)
    n_calls = len(runner.calls)
    b = new_seq(rng, 1, prompt=prompt, max_tokens=3)
    sched.add(b)
    run_all(sched)
    assert sched.counters["cached_tokens"] == 12
    assert all(c[0] == "decode" for c in runner.calls[n_calls:])
    assert b.output == a.output == expected(runner, sched, b)
    assert_pool_as_started(sched)


def test_a_thousand_random_requests_with_cancellations_leave_the_pool_as_it_started(rng):
    runner, sched = make(num_blocks=48, block_size=4, max_batch=16, chunk=16,
                         max_blocks_per_seq=12)
    samplings = [GREEDY, SamplingSettings(temperature=1.0),
                 SamplingSettings(temperature=0.5, repeat_penalty=1.2, repeat_last_n=8)]
    # a few shared prefixes, so prefix caching and eviction take part
    prefixes = [[int(t) for t in rng.integers(0, 1000, 8)] for _ in range(5)]
    pending = []
    for i in range(1000):
        p = [int(t) for t in rng.integers(0, 1000, int(rng.integers(1, 24)))]
        if rng.random() < 0.5:
            p = prefixes[int(rng.integers(0, 5))] + p
        pending.append(new_seq(rng, i, prompt=p, max_tokens=int(rng.integers(1, 24)),
                               sampling=samplings[int(rng.integers(0, 3))],
                               stop_ids={int(rng.integers(0, 1000))}))
    seqs, cancelled = [], set()
    while pending or sched.has_work:
        for _ in range(int(rng.integers(0, 4))):
            if pending:
                sched.add(pending.pop(0))
                seqs.append(sched.waiting[-1])
        live = [s for s in seqs if s.status != FINISHED]
        if live and rng.random() < 0.08:
            victim = live[int(rng.integers(0, len(live)))]
            held = len(victim.blocks) if victim.status == RUNNING else 0
            refs = sum(sched.blocks.ref_count(b) == 1 for b in victim.blocks)
            used = sched.blocks.num_used
            sched.abort(victim)
            cancelled.add(victim.id)
            assert sched.blocks.num_used == used - refs and held >= refs
        sched.step()
        sched.check()
    assert len(seqs) == 1000 and all(s.status == FINISHED for s in seqs)
    assert sched.counters["preemptions"] > 0 and sched.counters["cached_tokens"] > 0
    assert sched.blocks.evictions > 0
    for s in seqs:
        want = expected(runner, sched, s)
        if s.id in cancelled:
            assert s.finish_reason == "cancelled" and s.output == want[:len(s.output)]
        else:
            assert s.output == want
            assert s.finish_reason == ("stop" if want[-1] in s.stop_ids else "length")
    assert_pool_as_started(sched)


def test_a_long_prompt_does_not_stall_the_decoding_ones(rng):
    """Between two decode steps run at most prefill_budget prompt tokens
    (one whole chunk when a chunk is larger)."""
    runner, sched = make(num_blocks=128, block_size=4, max_batch=8, chunk=16)
    short = [new_seq(rng, i, n_prompt=3, max_tokens=60) for i in range(2)]
    for s in short:
        sched.add(s)
    for _ in range(4):
        sched.step()
    long = new_seq(rng, 9, n_prompt=200, max_tokens=2)
    sched.add(long)
    start = len(runner.calls)
    while long.pending > 1 or long.status == WAITING:
        sched.step()
    calls = runner.calls[start:]
    run = 0
    for c in calls:
        if c[0] == "prefill":
            run += c[1]
            assert run <= 16
        else:
            run = 0
    # all the prompt but its last token, which the next decode step feeds
    assert sum(c[1] for c in calls if c[0] == "prefill") == 199
    assert sum(c[0] == "decode" for c in calls) >= 199 // 16 - 1
    run_all(sched)
    for s in short + [long]:
        assert s.output == expected(runner, sched, s)


def test_short_prompts_share_the_budget_between_decode_steps(rng):
    """Prompts that arrive together share prefill steps (chunks of several
    sequences in one runner call, up to ``chunk`` tokens), and between two
    decode steps run at most ``prefill_budget`` prompt tokens."""
    runner, sched = make(num_blocks=128, block_size=4, max_batch=16, chunk=8,
                         prefill_budget=12)
    first = new_seq(rng, 0, n_prompt=3, max_tokens=40)
    sched.add(first)
    sched.step()
    sched.step()
    late = [new_seq(rng, 1 + i, n_prompt=3, max_tokens=2) for i in range(8)]
    for s in late:
        sched.add(s)
    start = len(runner.calls)
    run_all(sched)
    calls = runner.calls[start:]
    pre = [c for c in calls if c[0] == "prefill"]
    # each 3-token prompt computes 2 tokens in prefill steps: 8 then 4 before the first
    # decode step (the budget of 12), then the last 4
    assert [(c[1], c[3]) for c in pre] == [(8, 4), (4, 2), (4, 2)]
    kinds = "".join("p" if c[0] == "prefill" else "d" for c in calls)
    assert kinds.startswith("ppdp")
    for s in [first] + late:
        assert s.output == expected(runner, sched, s)


def test_nothing_waits_for_prefill_when_nothing_decodes(rng):
    runner, sched = make(num_blocks=128, block_size=4, max_batch=8, chunk=4)
    s = new_seq(rng, 0, n_prompt=20, max_tokens=2)
    sched.add(s)
    run_all(sched)
    # 19 prompt tokens in chunks of 4, then the last one feeds the first decode step
    assert [c[0] for c in runner.calls] == ["prefill"] * 5 + ["decode"] * 2
    assert [c[2] for c in runner.calls[:5]] == [0, 4, 8, 12, 16]


def test_the_batch_never_exceeds_max_batch(rng):
    runner, sched = make(num_blocks=256, block_size=4, max_batch=3, chunk=8)
    seqs = [new_seq(rng, i, max_tokens=8) for i in range(10)]
    for s in seqs:
        sched.add(s)
    while sched.has_work:
        sched.step()
        assert len(sched.running) <= 3
    assert max(c[1] for c in runner.calls if c[0] == "decode") == 3
    for s in seqs:
        assert s.output == expected(runner, sched, s)


def test_a_full_context_ends_with_length(rng):
    runner, sched = make(num_blocks=64, block_size=4, max_batch=4, chunk=8, max_blocks_per_seq=3)
    assert sched.n_ctx == 12
    s = new_seq(rng, 0, n_prompt=5, max_tokens=100)
    sched.add(s)
    run_all(sched)
    assert s.finish_reason == "length" and len(s.tokens) == 12 and len(s.output) == 7
    edge = new_seq(rng, 1, n_prompt=11, max_tokens=100)
    sched.add(edge)
    run_all(sched)
    assert len(edge.output) == 1 and edge.finish_reason == "length"
    with pytest.raises(ValueError, match="a prompt of 12 tokens leaves no room to generate in a "
                                         "context of 12 tokens"):
        sched.add(new_seq(rng, 2, n_prompt=12))


def test_the_pool_bounds_the_context(rng):
    runner, sched = make(num_blocks=5, block_size=4, max_batch=4, chunk=8, max_blocks_per_seq=64)
    assert sched.n_ctx == 20
    s = new_seq(rng, 0, n_prompt=6, max_tokens=100)
    sched.add(s)
    run_all(sched)
    assert len(s.tokens) == 20 and s.output == expected(runner, sched, s)


def test_a_stop_token_ends_with_stop(rng):
    runner, sched = make(num_blocks=64, block_size=4, max_batch=4, chunk=8)
    probe = new_seq(rng, 0, n_prompt=6, max_tokens=10)
    ref = runner.reference(probe.tokens, 10, GREEDY, probe.seed)
    s = new_seq(rng, 1, prompt=list(probe.tokens), max_tokens=10, stop_ids={ref[3]})
    sched.add(s)
    run_all(sched)
    cut = ref.index(ref[3]) + 1
    assert s.finish_reason == "stop" and s.output == ref[:cut]


def test_a_failing_prefill_ends_only_its_request(rng):
    runner, sched = make(num_blocks=64, block_size=4, max_batch=4, chunk=8)
    bad = new_seq(rng, 0, prompt=[999, 1, 2, 3, 4])
    good = [new_seq(rng, 1 + i, vocab=999) for i in range(3)]
    runner.fail_on = lambda item: hasattr(item, "tokens") and 999 in item.tokens
    sched.add(bad)
    for s in good:
        sched.add(s)
    run_all(sched)
    assert bad.finish_reason == "error" and "fake prefill failure" in bad.error
    for s in good:
        assert s.output == expected(runner, sched, s)
    assert_pool_as_started(sched)


def test_a_failing_decode_row_ends_only_its_request(rng):
    """The decode step fails whenever the bad row is in it: the scheduler
    retries halves until the row is alone, and the others go on."""
    runner, sched = make(num_blocks=64, block_size=4, max_batch=8, chunk=8)
    seqs = [new_seq(rng, i, n_prompt=5, max_tokens=12) for i in range(6)]
    bad = seqs[3]
    ref = expected(runner, sched, bad)
    # The bad row is named by its sequence's seed: a token and position
    # alone can recur in another sequence (seed 527539614 drew one).
    runner.fail_on = lambda row: getattr(row, "seed", None) == bad.seed \
        and getattr(row, "token", None) == ref[2] and row.position == bad.n_prompt + 2
    for s in seqs:
        sched.add(s)
    run_all(sched)
    assert bad.finish_reason == "error" and bad.output == ref[:3]
    assert "RuntimeError: fake failure" in bad.error
    for s in seqs:
        if s is not bad:
            assert s.output == expected(runner, sched, s)
    assert_pool_as_started(sched)


def test_a_bad_token_from_the_runner_is_an_error_for_its_request(rng):
    def next_token(ctx, s, seed, n_vocab):
        return 5000 if ctx[0] == 7 else int(ctx.sum()) % n_vocab
    runner, sched = make(num_blocks=64, block_size=4, max_batch=4, chunk=8, next_token=next_token)
    bad = new_seq(rng, 0, prompt=[7, 1, 2])
    good = new_seq(rng, 1, prompt=[8, 1, 2], max_tokens=4)
    sched.add(bad)
    sched.add(good)
    run_all(sched)
    assert bad.finish_reason == "error" and "token 5000, outside the vocabulary" in bad.error
    assert good.output == expected(runner, sched, good)


def test_the_runner_must_describe_itself():
    class Half:
        block_size, num_blocks, max_batch, chunk, max_blocks_per_seq = 16, 10, 4, 8, 0
        n_vocab = 10
    with pytest.raises(ValueError, match="runner.max_blocks_per_seq must be a positive int, "
                                         "got 0"):
        Scheduler(Half())
