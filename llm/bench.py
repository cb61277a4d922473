"""``python -m ptxgen bench MODEL.gguf``: llama-bench-like tables for a GGUF
file, so a user can compare ptxgen with llama.cpp on their own files.

Two tables, each with llama.cpp's flags and columns where the meanings match:

* **pp / tg** (``llama-bench``): ``-p N`` times a prompt of N tokens
  (prompt tokens per second of the wall time until the first new token),
  ``-n N`` times N new tokens after a one-token prompt (tokens per second
  of the steps after the first); ``-r`` repetitions give the mean and the
  standard deviation.
  One sequence, through :class:`~ptxgen.llm.Model` (the single-sequence
  path).
* **batched** (``llama-batched-bench``): for each ``-npp`` PP, ``-ntg`` TG
  and ``-npl`` B, B requests of PP random prompt tokens, each generating
  TG + 1 tokens (the first comes with its prompt, TG more from decode
  steps), all added at once to an :class:`~ptxgen.llm.engine.Engine`.
  ``N_KV`` = B * (PP + TG); ``T_PP`` and ``T_TG`` are the seconds spent in
  the runner's prompt chunks and decode steps (the engine interleaves them,
  see :mod:`~ptxgen.llm.engine.scheduler`); ``S_PP`` = B * PP / T_PP,
  ``S_TG`` = B * TG / T_TG; ``T`` is the batch's wall time (scheduling
  included) and ``S`` = N_KV / T.

``-p 0 -n 0`` skips the first table, ``-npl 0`` the second.  Each table
starts with a warm-up run (its graphs captured) unless ``--no-warmup``.

On the GPU the batched table is followed by each row's **decode read
floor** (:func:`read_floor`): the S_TG the decode steps would reach if each
read only what it must (every weight once a step, the token embedding's
rows of the batch, each sequence's K and V up to its position, a
sliding-window layer's within its window) at the bandwidth of a 1 GiB
device-to-device copy measured in the same run, and the share of it S_TG
reached.  A mixture of experts has none: the experts a step reads depend on
its routing.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time

import attrs
import numpy as np

from ptxgen.cli import HelpFormatter as _HELP

__all__ = ["SingleResult", "BatchedResult", "single_bench", "batched_bench", "format_single",
           "format_batched", "read_batched", "step_read_bytes", "read_floor", "format_floor",
           "bench_command"]


@attrs.frozen
class SingleResult:
    """One row of the pp / tg table: ``test`` ("pp512", "tg128") and the
    tokens per second of each repetition."""

    test: str
    rates: tuple

    @property
    def mean(self) -> float:
        return float(np.mean(self.rates))

    @property
    def std(self) -> float:
        return float(np.std(self.rates, ddof=1)) if len(self.rates) > 1 else 0.0


@attrs.frozen
class BatchedResult:
    """One row of the batched table (llama-batched-bench's columns)."""

    pp: int
    tg: int
    b: int
    t_pp: float
    t_tg: float
    t: float
    preemptions: int = 0

    @property
    def n_kv(self) -> int:
        return self.b * (self.pp + self.tg)

    @property
    def s_pp(self) -> float:
        return self.b * self.pp / self.t_pp if self.t_pp > 0 else math.nan

    @property
    def s_tg(self) -> float:
        return self.b * self.tg / self.t_tg if self.t_tg > 0 else math.nan

    @property
    def s(self) -> float:
        return self.n_kv / self.t if self.t > 0 else math.nan


def _tokens(rng, n: int, vocab: int) -> list:
    return [int(t) for t in rng.integers(0, vocab, n)]


def single_bench(model, prompts=(512,), gens=(128,), reps: int = 5, warmup: bool = True,
                 rng=None, log=None) -> list:
    """The pp / tg rows for ``model`` (a :class:`~ptxgen.llm.Model`)."""
    rng = rng if rng is not None else np.random.default_rng()
    vocab = model.hp.vocab
    out = []
    for p in prompts:
        if warmup:
            model.generate(_tokens(rng, p, vocab), 1)
        rates = []
        for _ in range(reps):
            ids = _tokens(rng, p, vocab)
            t0 = time.perf_counter()
            model.generate(ids, 1)
            rates.append(p / (time.perf_counter() - t0))
        out.append(SingleResult(f"pp{p}", tuple(rates)))
        if log:
            log(f"pp{p}: {out[-1].mean:.2f} t/s")
    for n in gens:
        if warmup:
            model.generate(_tokens(rng, 1, vocab), 2)
        rates = []
        for _ in range(reps):
            res = model.generate(_tokens(rng, 1, vocab), n + 1)
            # the first step feeds the prompt token; the n after it are timed
            rates.append(len(res.step_seconds) / sum(res.step_seconds))
        out.append(SingleResult(f"tg{n}", tuple(rates)))
        if log:
            log(f"tg{n}: {out[-1].mean:.2f} t/s")
    return out


def batched_bench(engine, npp=(128, 256, 512), ntg=(128, 256), npl=(1, 2, 4, 8, 16, 32),
                  warmup: bool = True, rng=None, log=None) -> list:
    """The batched rows for ``engine`` (an :class:`~ptxgen.llm.engine.Engine`)."""
    from ptxgen.llm.engine import RequestSettings
    rng = rng if rng is not None else np.random.default_rng()
    vocab = engine.runner.n_vocab
    if warmup:
        engine.warm_up()                 # every step graph captured: none inside a timing
        for pp in npp:
            engine.generate([_tokens(rng, pp, vocab)], RequestSettings(max_tokens=2,
                                                                       ignore_eos=True))
        engine.generate([_tokens(rng, min(npp), vocab) for _ in range(max(npl))],
                        RequestSettings(max_tokens=2, ignore_eos=True))
    out = []
    for pp in npp:
        for tg in ntg:
            for b in npl:
                s = RequestSettings(max_tokens=tg + 1, ignore_eos=True)
                prompts = [_tokens(rng, pp, vocab) for _ in range(b)]
                before = engine.stats()
                t0 = time.perf_counter()
                res = engine.generate(prompts, s)
                t = time.perf_counter() - t0
                after = engine.stats()
                bad = [r for r in res if r.finish_reason != "length" or len(r.token_ids) != tg + 1]
                if bad:
                    raise RuntimeError(f"a benchmark request ended with {bad[0].finish_reason!r} "
                                       f"after {len(bad[0].token_ids)} tokens"
                                       + (f": {bad[0].error}" if bad[0].error else ""))
                row = BatchedResult(pp=pp, tg=tg, b=b,
                                    t_pp=after.prefill_seconds - before.prefill_seconds,
                                    t_tg=after.decode_seconds - before.decode_seconds, t=t,
                                    preemptions=after.preemptions - before.preemptions)
                out.append(row)
                if log:
                    log(_batched_line(row))
    return out


def format_single(rows, *, model: str, size: str, params: str, backend: str) -> str:
    """llama-bench's markdown table: model, size, params, backend, test, t/s."""
    head = ("| model                          |       size |     params | backend    "
            "|            test |                  t/s |")
    rule = ("| ------------------------------ | ---------: | ---------: | ---------- "
            "| --------------: | -------------------: |")
    lines = [head, rule]
    for r in rows:
        lines.append(f"| {model[:30]:<30} | {size:>10} | {params:>10} | {backend:<10} "
                     f"| {r.test:>15} | {f'{r.mean:.2f} ± {r.std:.2f}':>20} |")
    return "\n".join(lines)


def format_batched(rows, header: str = "") -> str:
    """llama-batched-bench's table (PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG
    s, S_TG t/s, T s, S t/s), after a ``header`` line."""
    names = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")
    widths = (6, 6, 4, 6, 8, 8, 8, 8, 8, 8)
    lines = [header, ""] if header else []
    lines.append("|" + " |".join(f"{n:>{w}}" if i == 0 else f" {n:>{w}}"
                                 for i, (n, w) in enumerate(zip(names, widths))) + " |")
    lines.append("|" + "|".join("-" * (w + 2) if i else "-" * (w + 1)
                                for i, w in enumerate(widths)) + "|")
    lines += [_batched_line(r) for r in rows]
    return "\n".join(lines)


def read_batched(text: str) -> dict:
    """The rates of a batched table (:func:`format_batched`'s, or
    llama-batched-bench's own) by its B column: ``{B: {"s_pp", "s_tg",
    "s"}}`` in tokens/s; lines that are not rows of the table are skipped."""
    out = {}
    for line in text.splitlines():
        c = [v.strip() for v in line.strip().strip("|").split("|")]
        if len(c) < 10 or not c[2].isdigit():
            continue
        try:
            out[int(c[2])] = {"s_pp": float(c[5]), "s_tg": float(c[7]), "s": float(c[9])}
        except ValueError:
            continue
    return out


def _batched_line(r: BatchedResult) -> str:
    return (f"|{r.pp:6d} | {r.tg:6d} | {r.b:4d} | {r.n_kv:6d} | {r.t_pp:8.3f} | {r.s_pp:8.2f} "
            f"| {r.t_tg:8.3f} | {r.s_tg:8.2f} | {r.t:8.3f} | {r.s:8.2f} |")


def step_read_bytes(file, contexts) -> int:
    """The bytes a decode step of ``len(contexts)`` sequences must read:
    every weight tensor once (of the token embedding, one row a sequence,
    unless it is also the output matrix), and each sequence's f16 K and V
    rows up to its context (``contexts[i]`` keys), a sliding-window layer's
    up to its window.

    Raises
    ------
    ValueError
        ``file`` is a mixture of experts (what a step reads depends on its
        routing), or a context is below 1.
    """
    contexts = _checked(file, contexts)
    return _weight_bytes(file, len(contexts)) + _kv_bytes(file.hparams, contexts)


def _checked(file, contexts) -> list:
    """``contexts`` as ints, for a file and contexts a read floor has."""
    if file.hparams.n_expert:
        raise ValueError("a mixture of experts has no fixed read floor: the experts a step "
                         "reads depend on its routing")
    contexts = [int(c) for c in contexts]
    if not contexts or min(contexts) < 1:
        raise ValueError(f"contexts must be one or more positive ints, got {contexts!r}")
    return contexts


def _weight_bytes(file, n_seqs: int) -> int:
    total = 0
    for name in file.names:
        data = file.tensor(name).data
        if name == "token_embd.weight" and not file.hparams.tied:
            total += data.nbytes // data.shape[0] * n_seqs
        else:
            total += data.nbytes
    return total


def _kv_bytes(hp, contexts) -> int:
    per_layer = 2 * hp.n_kv_heads * hp.head_dim * 2          # K and V of one token, f16
    total = 0
    for layer in range(hp.n_layers):
        w = hp.window(layer)
        total += per_layer * sum(min(c, w) if w else c for c in contexts)
    return total


def read_floor(row: BatchedResult, file, bandwidth: float) -> tuple:
    """``(floor S_TG, share)`` of a batched row: the decode tokens per second
    of its ``tg`` steps had each read :func:`step_read_bytes` at
    ``bandwidth`` bytes per second (step ``j`` of ``1..tg`` attends over
    ``pp + j`` keys), and ``row.s_tg`` over it."""
    _checked(file, [row.pp + 1] * row.b)
    weights = _weight_bytes(file, row.b)
    seconds = sum(weights + _kv_bytes(file.hparams, [row.pp + j] * row.b)
                  for j in range(1, row.tg + 1)) / bandwidth
    floor = row.b * row.tg / seconds
    return floor, row.s_tg / floor


def format_floor(rows, file, bandwidth: float) -> str:
    """The read-floor lines of the batched ``rows`` (:func:`read_floor`)."""
    lines = [f"decode read floor: each step reads every weight once and each sequence's K/V "
             f"once, at the copy bandwidth of this run ({bandwidth / 1e12:.2f} TB/s read + "
             f"written)", "",
             "|    PP |     TG |    B | floor S_TG t/s | S_TG t/s | share |",
             "|-------|--------|------|----------------|----------|-------|"]
    for r in rows:
        floor, share = read_floor(r, file, bandwidth)
        lines.append(f"|{r.pp:6d} | {r.tg:6d} | {r.b:4d} | {floor:14.2f} | {r.s_tg:8.2f} "
                     f"| {100 * share:4.1f}% |")
    return "\n".join(lines)


def _int_list(text: str) -> tuple:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return vals


def _describe(info) -> tuple:
    """``(model, size, params)`` as llama-bench names them."""
    main = info.types[0].qtype if info.types else "?"
    n = info.n_params
    label = f"{n / 1e9:.0f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    return (f"{info.arch} {label} {main}", f"{info.weight_bytes / (1 << 30):.2f} GiB",
            f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M")


def bench_command(argv) -> int:
    """``python -m ptxgen bench MODEL.gguf [-p ...] [-n ...] [-npp ...] [-ntg ...] [-npl ...]``."""
    from ptxgen.llm.cli import CliError, get_backend_for_cli, positive, run_guarded
    p = argparse.ArgumentParser(
        prog="python -m ptxgen bench", formatter_class=_HELP,
        description="llama-bench-like tables for a GGUF file: prompt and generation speed of "
                    "one sequence (pp/tg), and the batched engine's table with "
                    "llama-batched-bench's columns")
    p.add_argument("model", help="a .gguf file")
    p.add_argument("--backend", choices=("auto", "cuda", "emu"), default="auto",
                   help="the GPU, the CPU emulator, or the GPU when there is one")
    g = p.add_argument_group("pp / tg (llama-bench's flags)")
    g.add_argument("-p", "--n-prompt", type=_int_list, default="512", metavar="N[,N...]",
                   help="prompt lengths to time (0: none)")
    g.add_argument("-n", "--n-gen", type=_int_list, default="128", metavar="N[,N...]",
                   help="numbers of new tokens to time (0: none)")
    g.add_argument("-r", "--repetitions", type=positive, default=5, help="runs of each test")
    g = p.add_argument_group("batched (llama-batched-bench's flags)")
    g.add_argument("-npp", type=_int_list, default="128,256,512", metavar="N[,N...]",
                   help="prompt tokens per sequence")
    g.add_argument("-ntg", type=_int_list, default="128,256", metavar="N[,N...]",
                   help="generated tokens per sequence")
    g.add_argument("-npl", type=_int_list, default="1,2,4,8,16,32", metavar="N[,N...]",
                   help="sequences in parallel (0: no batched table)")
    g.add_argument("--max-seqs", type=positive, default=None,
                   help="the engine's most sequences at once (default: the largest -npl)")
    g.add_argument("--chunk", type=positive, default=512,
                   help="the most prompt tokens of one prefill chunk")
    g.add_argument("--block-size", type=positive, default=None,
                   help="tokens per KV block (default: the runner's)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="the share of the free GPU memory the KV pool takes")
    g.add_argument("--no-overlap", action="store_true",
                   help="run each decode step after the host's work on the one before "
                        "(default: the next step is prepared while the GPU runs this one)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up runs")
    p.add_argument("--seed", type=int, default=None, help="seed of the random prompt tokens")
    a = p.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    def body():
        from ptxgen.llm.info import read_info
        if not 0.0 < a.gpu_memory_utilization <= 1.0:
            raise CliError(f"--gpu-memory-utilization must be in (0, 1], got "
                           f"{a.gpu_memory_utilization}")
        prompts = tuple(n for n in a.n_prompt if n > 0)
        gens = tuple(n for n in a.n_gen if n > 0)
        npl = tuple(n for n in a.npl if n > 0)
        npp, ntg = tuple(n for n in a.npp if n > 0), a.ntg
        if npl and not npp:
            raise CliError("-npp needs at least one prompt length above 0")
        info = read_info(a.model)
        if info.not_runnable:
            raise CliError(f"{a.model}: {info.not_runnable}")
        be = get_backend_for_cli(a.backend)
        rng = np.random.default_rng(a.seed)
        warm = not a.no_warmup
        if prompts or gens:
            from ptxgen.llm import Model
            model = Model.from_gguf(a.model, backend=be, tokenizer=False,
                                    capacity=max(prompts + (1,)) + max(gens + (1,)) + 1)
            rows = single_bench(model, prompts, gens, a.repetitions, warm, rng, log)
            del model
            gc.collect()
            name, size, params = _describe(info)
            print(format_single(rows, model=name, size=size, params=params, backend=be.name))
            print(flush=True)
        if npl:
            from ptxgen.llm.engine import Engine
            bandwidth = floor = None
            if be.name == "cuda" and not info.hparams.n_expert:
                from ptxgen.driver.timing import copy_ceiling
                bandwidth = copy_ceiling()
            need = max(npp) + max(ntg) + 1
            engine = Engine.from_gguf(a.model, backend=be, max_seqs=a.max_seqs or max(npl),
                                      ctx_size=need, chunk=a.chunk,
                                      gpu_memory_utilization=a.gpu_memory_utilization,
                                      block_size=a.block_size, overlap=not a.no_overlap)
            with engine:
                pool = engine.num_blocks * engine.block_size
                header = (f"engine: n_kv_max = {pool}, block_size = {engine.block_size}, "
                          f"max_seqs = {engine.max_seqs}, chunk = {engine.runner.chunk}, "
                          f"backend = {be.name}")
                if max(npl) * need > pool:
                    log(f"note: the KV pool holds {pool} tokens; B = {max(npl)} sequences of "
                        f"up to {need} need {max(npl) * need}: some will be preempted")
                rows = batched_bench(engine, npp, ntg, npl, warm, rng, log)
                if bandwidth is not None:
                    floor = format_floor(rows, engine.runner.file, bandwidth)
            print(format_batched(rows, header))
            if floor is not None:
                print()
                print(floor)
            elif be.name == "cuda":
                print("\nno decode read floor: a mixture of experts reads the experts its "
                      "routing picks")
            n_pre = sum(r.preemptions for r in rows)
            if n_pre:
                log(f"note: {n_pre} preemptions (the KV pool ran out): their recomputed "
                    "prompts count in T_PP")
        return 0

    return run_guarded(body)
