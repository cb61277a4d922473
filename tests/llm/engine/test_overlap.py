"""The overlapped decode loop (a step on the device while the host takes the
last one's tokens) chooses what the synchronous loop chooses: the same
tokens and stop reasons for every request, every block freed, on the fake
runner's split step (``launch``/``collect``)."""

from __future__ import annotations

import pytest

from engine_fakes import FakeRunner, OverlapFakeRunner
from ptxgen.llm.engine import Engine, RequestSettings
from ptxgen.llm.engine.scheduler import FINISHED, Scheduler, Sequence
from ptxgen.llm.generation import SamplingSettings


def _jobs(rng, n, n_vocab):
    """``(prompt, settings, seed, stop_ids, join step, cancel step or None)``."""
    out = []
    for i in range(n):
        prompt = [int(t) for t in rng.integers(0, n_vocab, int(rng.integers(1, 14)))]
        sampling = SamplingSettings(temperature=float(rng.integers(0, 2)), seed=i)
        settings = RequestSettings(max_tokens=int(rng.integers(1, 24)), sampling=sampling)
        stop = frozenset(int(t) for t in rng.integers(0, n_vocab, int(rng.integers(0, 3))))
        join = int(rng.integers(0, 40))
        cancel = join + int(rng.integers(1, 30)) if rng.random() < 0.25 else None
        out.append((prompt, settings, i, stop, join, cancel))
    return out


def _run(runner, jobs, overlap: bool):
    """Drive a scheduler step by step: requests join and are cancelled at
    the steps ``jobs`` names; returns each request's tokens and reason."""
    sched = Scheduler(runner, overlap=overlap)
    runner.blocks = sched.blocks
    seqs = [Sequence(f"r{i}", p, s, seed, stop) for i, (p, s, seed, stop, _, _) in
            enumerate(jobs)]
    step = 0
    while step < 1000:
        for seq, (*_, join, cancel) in zip(seqs, jobs):
            if join == step:
                sched.add(seq)
            if cancel == step:
                sched.abort(seq)
        if not sched.has_work and step > max(j[4] for j in jobs):
            break
        sched.step()
        sched.check()
        step += 1
    sched.drain()
    assert all(s.status == FINISHED for s in seqs)
    assert sched.blocks.num_used == 0, "blocks left allocated"
    sched.blocks.check([])
    return [(s.output, s.finish_reason) for s in seqs], sched


def _overlapped(**runner_kw):
    """An ``OverlapFakeRunner`` (4-token blocks, 8-token chunks, and
    ``runner_kw``) and a scheduler over it, the runner sharing the
    scheduler's block pool."""
    runner = OverlapFakeRunner(block_size=4, chunk=8, **runner_kw)
    sched = Scheduler(runner)
    runner.blocks = sched.blocks
    return runner, sched


def _run_to_end(sched, seqs):
    """Add ``seqs`` and step, checking the scheduler after each step,
    until no work is left; then drain the step in flight."""
    for s in seqs:
        sched.add(s)
    while sched.has_work:
        sched.step()
        sched.check()
    sched.drain()


@pytest.mark.parametrize("max_batch", [4, 8])
def test_overlapped_scheduler_chooses_the_synchronous_tokens(rng, max_batch):
    """Staggered joins, stop tokens, lengths and cancels: the overlapped
    loop's tokens and reasons are the synchronous loop's, both free every
    block, and the overlap ran (steps launched to follow the one before)."""
    jobs = _jobs(rng, 40, 50)
    # each way of ending at least once, whatever the draw: request 0 stops
    # at its first token (every id stops it), 1 is cancelled two steps
    # after it joins, 2 runs to its length
    every = frozenset(range(50))
    jobs[0] = jobs[0][:3] + (every,) + jobs[0][4:5] + (None,)
    jobs[1] = jobs[1][:1] + (RequestSettings(max_tokens=23, sampling=jobs[1][1].sampling),) + \
        jobs[1][2:3] + (frozenset(), jobs[1][4], jobs[1][4] + 2)
    jobs[2] = jobs[2][:3] + (frozenset(), jobs[2][4], None)
    kw = dict(num_blocks=48, block_size=4, max_batch=max_batch, chunk=8, n_vocab=50)
    sync, _ = _run(FakeRunner(**kw), jobs, overlap=False)
    runner = OverlapFakeRunner(**kw)
    over, sched = _run(runner, jobs, overlap=True)
    for i, (a, b) in enumerate(zip(sync, over)):
        if jobs[i][5] is None:
            assert a == b, f"request {i}"
        else:   # a cancel lands at a step: the tokens before it are the same
            n = min(len(a[0]), len(b[0]))
            assert a[0][:n] == b[0][:n], f"request {i}"
    reasons = {r for _, r in over}
    assert {"stop", "length", "cancelled"} <= reasons
    followed = sum(1 for c in runner.calls if c[0] == "launch" and c[2])
    assert followed >= 5, runner.calls
    assert not any(c[0] == "decode" for c in runner.calls)
    assert sched.counters["decode_steps"] > 0


def test_a_finished_row_runs_on_and_its_tokens_are_dropped(rng):
    """Four rows, one ending by a stop token: the steps after its end still
    hold it (four rows, the same bucket) until it would need a new block,
    and it gets no token more."""
    stop_at = {}

    def next_token(ctx, sampling, seed, n_vocab):
        return 7 if len(ctx) == stop_at.get(int(ctx[0]), -1) else (int(ctx[-1]) + 1) % 5

    runner, sched = _overlapped(num_blocks=32, max_batch=4, n_vocab=10, next_token=next_token)
    stop_at[9] = 6                    # the request whose prompt starts with 9 stops at 6 tokens
    seqs = [Sequence(f"r{i}", [9 if i == 0 else 8, 1, 2], RequestSettings(max_tokens=10),
                     0, frozenset({7})) for i in range(4)]
    _run_to_end(sched, seqs)
    assert seqs[0].finish_reason == "stop" and seqs[0].output == [3, 4, 0, 7]
    for s in seqs[1:]:
        assert s.finish_reason == "length" and len(s.output) == 10
    launches = [c for c in runner.calls if c[0] == "launch"]
    # four steps of all four; the ended row (6 tokens, its next position 7
    # in its second 4-token block) runs on at positions 6 and 7
    assert [c[1] for c in launches].count(4) == 6, launches
    assert launches[:6] == [("launch", 4, False)] + [("launch", 4, True)] * 5, launches
    assert sched.blocks.num_used == 0


def test_rows_leaving_the_bucket_rerun_synchronously(rng):
    """Three rows in the 4-row bucket, two ending by a stop token at once:
    the step in flight (3 rows) is dropped and the last row runs it again
    in the 1-row bucket, choosing the tokens it chooses alone."""
    def next_token(ctx, sampling, seed, n_vocab):
        return 7 if int(ctx[0]) != 6 and len(ctx) == 5 else (int(ctx[-1]) * 3 + 1) % 7

    runner, sched = _overlapped(num_blocks=32, max_batch=4, n_vocab=10, next_token=next_token)
    seqs = [Sequence(f"r{i}", [first, 2, 3], RequestSettings(max_tokens=9), 0, frozenset({7}))
            for i, first in enumerate((9, 8, 6))]
    _run_to_end(sched, seqs)
    for s in seqs:
        want = runner.reference(s.tokens[:3], 9, s.settings.sampling, 0, {7})
        assert s.output == want
    assert [s.finish_reason for s in seqs] == ["stop", "stop", "length"]
    launches = [c for c in runner.calls if c[0] == "launch"]
    # three steps of three rows taken, a fourth launched and dropped
    assert [c[1] for c in launches].count(3) == 4, launches
    assert ("launch", 1, False) in launches      # the last row, from the host
    assert sched.counters["decode_steps"] == 3 + 6
    assert sched.blocks.num_used == 0


@pytest.mark.parametrize("faults", [1, 3])
def test_a_fault_at_collect_reruns_the_step_synchronously(rng, faults):
    """A step whose tokens cannot be read back runs again through decode()
    (the step launched after it is dropped): every request still gets its
    reference tokens, or, where a row fails alone, an error; no block is
    left allocated."""
    runner, sched = _overlapped(num_blocks=48, max_batch=4, n_vocab=40)
    seqs = [Sequence(f"r{i}", [int(t) for t in rng.integers(0, 40, 3 + i)],
                     RequestSettings(max_tokens=8 + i), 0) for i in range(4)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_work:
        sched.step()
        sched.check()
        steps += 1
        if steps == 4:
            runner.collect_faults = faults
    sched.drain()
    for s in seqs:
        want = runner.reference(s.tokens[:s.n_prompt], s.settings.max_tokens,
                                s.settings.sampling, 0)
        assert s.finish_reason == "length" and s.output == want
    assert any(c[0] == "decode" for c in runner.calls)      # the rerun
    assert sched.blocks.num_used == 0


def test_penalties_and_logprobs_run_synchronously(rng):
    """Rows that need the host between steps take the runner's decode()."""
    runner, sched = _overlapped(num_blocks=32, max_batch=4)
    s1 = Sequence("a", [1, 2], RequestSettings(max_tokens=4, logprobs=2), 0)
    s2 = Sequence("b", [3, 4], RequestSettings(
        max_tokens=4, sampling=SamplingSettings(repeat_penalty=1.3)), 0)
    for s in (s1, s2):
        sched.add(s)
    while sched.has_work:
        sched.step()
    assert not any(c[0] == "launch" for c in runner.calls)
    assert len(s1.output) == len(s2.output) == 4


def test_overlapped_engine_generates_the_synchronous_outputs(rng):
    """The engine over the split step: each request's tokens and stop
    reason are the synchronous engine's, and the pool ends empty."""
    n_vocab = 60
    prompts = [[int(t) for t in rng.integers(0, n_vocab, int(rng.integers(1, 20)))]
               for _ in range(30)]
    settings = [RequestSettings(max_tokens=int(rng.integers(1, 30)), stop_token_ids=(5, 11),
                                sampling=SamplingSettings(temperature=float(i % 2), seed=i))
                for i in range(30)]
    outs = {}
    for overlap in (False, True):
        cls = OverlapFakeRunner if overlap else FakeRunner
        runner = cls(num_blocks=64, block_size=4, max_batch=8, chunk=8, n_vocab=n_vocab)
        with Engine(runner, overlap=overlap) as eng:
            outs[overlap] = [(o.token_ids, o.finish_reason)
                             for o in eng.generate(prompts, settings)]
            st = eng.stats()
            assert st.blocks_used == 0 and st.running == 0
            eng._core.sched.check()
        if overlap:
            assert any(c[0] == "launch" and c[2] for c in runner.calls)
    assert outs[True] == outs[False]
    assert {"stop", "length"} <= {r for _, r in outs[True]}


@pytest.mark.gpu
def test_gpu_overlapped_engine_equals_synchronous(tmp_path, seed, rng):
    """The real runner on the GPU (captured graphs, tokens fed on the
    device): 12 requests in buckets of up to 8 rows, greedy and sampled,
    ending at staggered lengths and stop tokens, give the synchronous
    engine's tokens and reasons, and the pool ends empty."""
    from backends import cuda_available
    if not cuda_available():
        pytest.skip("no NVIDIA GPU / driver available")
    pytest.importorskip("gguf")
    from ptxgen.llm.gguf.synth import write_synthetic_llama
    path = str(tmp_path / "small.gguf")
    write_synthetic_llama(path, seed=seed, n_layers=2, hidden=256, ffn=512, n_heads=4,
                          n_kv_heads=2, qtype="Q8_0", output_qtype="Q8_0",
                          context_length=256, vocab=256)
    prompts = [[int(t) for t in rng.integers(0, 256, int(rng.integers(3, 40)))]
               for _ in range(12)]
    settings = [RequestSettings(max_tokens=int(rng.integers(4, 48)), ignore_eos=True,
                                stop_token_ids=(int(rng.integers(0, 256)),),
                                sampling=SamplingSettings(temperature=0.8 * (i % 2), seed=i))
                for i in range(12)]
    outs = {}
    for overlap in (False, True):
        with Engine.from_gguf(path, backend="cuda", max_seqs=8, ctx_size=128, chunk=32,
                              progress=False, overlap=overlap) as eng:
            eng.warm_up()
            outs[overlap] = [(o.token_ids, o.finish_reason)
                             for o in eng.generate(prompts, settings)]
            assert eng.stats().blocks_used == 0
            eng._core.sched.check()
    assert outs[True] == outs[False]


def test_overlapped_decode_seconds_are_wall_time():
    """A step launched behind another counts from that one's tokens to its
    own: with host work between steps hidden behind the device, the decode
    seconds still add up to at least the device's time (not only the wait
    left at collect)."""
    import time

    from benchmarks.serverpath import TimedRunner
    runner = TimedRunner(list(range(100)), 100, device_s=0.006, max_batch=4)
    sched = Scheduler(runner)
    seqs = [Sequence(f"r{i}", [i + 1, 2], RequestSettings(max_tokens=12), i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    while sched.has_work:
        out = sched.step()
        if out.kind == "decode":
            time.sleep(0.004)            # the host's work on the step's tokens
    assert all(len(s.output) == 12 for s in seqs)
    steps = sched.counters["decode_steps"]
    assert steps == 12 and runner.decode_steps == 12
    assert sched.counters["decode_seconds"] >= 0.9 * steps * 0.006
