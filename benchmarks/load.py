"""A load generator for ``python -m ptxgen serve``: streaming clients at
several concurrencies, against the engine's offline throughput.

Against a running server::

    python -m benchmarks.load http://127.0.0.1:8080 --concurrency 1,8,64,128 \\
        --prompt-len 64:512 --max-tokens 128 --ignore-eos --json out.json

Each concurrency level runs that many clients for ``--requests-per-client``
requests each (a closed loop: a client sends its next request when the last
ended).  A request is a streamed ``/v1/completions`` of random token ids
(``--prompt-len LO:HI``, uniform; ``--chat`` sends random words to
``/v1/chat/completions`` instead), ``--max-tokens`` long (``--ignore-eos``
makes every reply that long).  Reported per level: requests done and
abandoned, generated tokens per second over the level's wall time, time to
first token (p50, p99), the time between streamed tokens (p50, p99) and
per-token latency after the first (p50).  ``--disconnect P`` abandons a
share P of the requests at a random point of their stream; after each level
the script waits for the server's ``/metrics`` to show no sequence running
and no KV block used, and reports what it found.

The clients are spread over ``--procs`` processes (each an asyncio loop with
httpx) so that parsing the events does not bound what is measured.

The engine's own offline throughput, the reference for the server's::

    python -m benchmarks.load --offline MODEL.gguf --batch 64 --prompt-len 128 \\
        --max-tokens 128

runs ``Engine.generate`` on ``--batch`` prompts of random token ids in one
call (after a warm-up) and reports generated tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import time

__all__ = ["main", "run_level", "offline_throughput"]


def _span(text: str) -> tuple:
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _levels(text: str) -> list:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected e.g. 1,8,64, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def _pct(xs, q) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


_WORDS = ("the model reads a prompt and writes tokens one after another on the GPU while "
          "other requests share its batch").split()


def _request_body(rng: random.Random, a, model: str) -> tuple:
    n = rng.randint(*a.prompt_len)
    body = {"model": model, "max_tokens": a.max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}, "ignore_eos": a.ignore_eos}
    if a.chat:
        body["messages"] = [{"role": "user", "content": " ".join(rng.choice(_WORDS)
                                                                 for _ in range(n))}]
        return "/v1/chat/completions", body
    lo, hi = a.vocab_range
    body["prompt"] = [rng.randrange(lo, hi) for _ in range(n)]
    return "/v1/completions", body


async def _one(client, url, path, body, abandon_after, rec):
    t0 = time.perf_counter()
    times = []
    usage = None
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            rec["errors"].append(f"{r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                rec["errors"].append(str(obj["error"])[:200])
                return
            if obj.get("usage"):
                usage = obj["usage"]
            choices = obj.get("choices") or []
            if choices and (choices[0].get("text") or (choices[0].get("delta") or {})
                            .get("content")):
                times.append(time.perf_counter())
                if abandon_after is not None and len(times) >= abandon_after:
                    rec["abandoned"] += 1
                    return
    if not times or usage is None:
        rec["errors"].append("no tokens or no usage")
        return
    n = usage["completion_tokens"]
    rec["tokens"] += n
    rec["done"] += 1
    rec["ttft"].append(times[0] - t0)
    rec["itl"].extend(b - a for a, b in zip(times, times[1:]))
    if n > 1:
        rec["tpot"].append((times[-1] - times[0]) / (n - 1))


def _worker(args):
    """One process: ``clients`` clients, each ``per_client`` requests."""
    url, model, a, clients, per_client, seed = args
    import httpx

    rec = {"done": 0, "abandoned": 0, "tokens": 0, "errors": [], "ttft": [], "itl": [],
           "tpot": [], "abandoned_tokens": 0}

    async def client_loop(client, k):
        rng = random.Random(seed * 1000003 + k)
        for _ in range(per_client):
            path, body = _request_body(rng, a, model)
            cut = None
            if rng.random() < a.disconnect:
                cut = rng.randint(1, max(1, a.max_tokens // 2))
            try:
                await _one(client, url, path, body, cut, rec)
            except httpx.HTTPError as e:
                rec["errors"].append(f"{type(e).__name__}: {e}")

    async def run():
        limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            await asyncio.gather(*[client_loop(client, k) for k in range(clients)])

    asyncio.run(run())
    return rec


def _metrics(url) -> dict:
    import httpx
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _drained(url, timeout: float = 60.0) -> dict:
    """Wait until no sequence runs or waits and no KV block is used; the
    last gauges read."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        g = {k: m.get(k) for k in ("ptxgen_sequences_running", "ptxgen_sequences_waiting",
                                   "ptxgen_kv_blocks_used")}
        if all(v == 0 for v in g.values()) or time.monotonic() > deadline:
            return g
        time.sleep(0.2)


def run_level(url: str, model: str, a, concurrency: int) -> dict:
    """One concurrency level; the summary as a dict."""
    procs = max(1, min(a.procs, concurrency))
    split = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    jobs = [(url, model, a, c, a.requests_per_client, a.seed * 7919 + concurrency * 31 + i)
            for i, c in enumerate(split)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(procs) as pool:
        recs = pool.map(_worker, jobs)
    wall = time.perf_counter() - t0
    merged = {k: (sum if isinstance(recs[0][k], int) else
                  lambda xs: [x for r in xs for x in r])([r[k] for r in recs]) for k in recs[0]}
    after = _drained(url)
    ms = 1e3

    def pct(key, q):
        v = _pct(merged[key], q)
        return None if v is None else round(v * ms, 2)

    return {"concurrency": concurrency, "requests": concurrency * a.requests_per_client,
            "done": merged["done"], "abandoned": merged["abandoned"],
            "errors": len(merged["errors"]), "first_errors": merged["errors"][:3],
            "generated_tokens": merged["tokens"], "wall_s": round(wall, 3),
            "tokens_per_s": round(merged["tokens"] / wall, 1),
            "ttft_ms_p50": pct("ttft", 50), "ttft_ms_p99": pct("ttft", 99),
            "itl_ms_p50": pct("itl", 50), "itl_ms_p99": pct("itl", 99),
            "tpot_ms_p50": pct("tpot", 50), "after": after}


def offline_throughput(path: str, batch: int, prompt_len: tuple, max_tokens: int,
                       seed: int, vocab_range: tuple) -> dict:
    """Generated tokens per second of ``Engine.generate`` on ``batch``
    prompts at once (the second of two runs)."""
    from ptxgen.llm.engine import Engine, RequestSettings
    rng = random.Random(seed)
    engine = Engine.from_gguf(path, max_seqs=batch, progress=False)
    try:
        lo, hi = vocab_range
        prompts = [[rng.randrange(lo, hi) for _ in range(rng.randint(*prompt_len))]
                   for _ in range(batch)]
        settings = RequestSettings(max_tokens=max_tokens, ignore_eos=True)
        engine.generate(prompts, settings)                       # warm-up
        t0 = time.perf_counter()
        outs = engine.generate(prompts, settings)
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"batch": batch, "generated_tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("url", nargs="?", default=None, help="the server, e.g. http://127.0.0.1:8080")
    p.add_argument("--offline", metavar="MODEL.gguf", default=None,
                   help="measure the engine's offline throughput on this file instead")
    p.add_argument("--batch", type=int, default=64, help="--offline: prompts in one call")
    p.add_argument("--concurrency", type=_levels, default=[1, 8, 64, 128])
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompt-len", type=_span, default=(32, 512), metavar="LO:HI")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="every reply max-tokens long")
    p.add_argument("--chat", action="store_true", help="chat requests of random words")
    p.add_argument("--vocab-range", type=_span, default=(100, 20000), metavar="LO:HI",
                   help="the token ids random prompts are drawn from")
    p.add_argument("--disconnect", type=float, default=0.0, metavar="P",
                   help="share of requests abandoned at a random point of their stream")
    p.add_argument("--procs", type=int, default=min(8, os.cpu_count() or 1),
                   help="client processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results here")
    a = p.parse_args(argv)
    if a.offline:
        res = {"offline": offline_throughput(a.offline, a.batch, a.prompt_len, a.max_tokens,
                                             a.seed, a.vocab_range)}
        print(json.dumps(res["offline"]))
    elif a.url:
        import httpx
        url = a.url.rstrip("/")
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        res = {"url": url, "model": model, "args": {k: v for k, v in vars(a).items()
                                                    if k not in ("url", "json")}, "levels": []}
        print(f"{'conc':>5} {'done':>6} {'aband':>6} {'err':>4} {'tok/s':>9} {'ttft p50':>9} "
              f"{'p99':>8} {'itl p50':>8} {'p99':>8} {'tpot':>7}  after")
        for c in a.concurrency:
            r = run_level(url, model, a, c)
            res["levels"].append(r)
            print(f"{c:>5} {r['done']:>6} {r['abandoned']:>6} {r['errors']:>4} "
                  f"{r['tokens_per_s']:>9.1f} {r['ttft_ms_p50']!s:>9} {r['ttft_ms_p99']!s:>8} "
                  f"{r['itl_ms_p50']!s:>8} {r['itl_ms_p99']!s:>8} {r['tpot_ms_p50']!s:>7}  "
                  f"{r['after']}", flush=True)
            for e in r["first_errors"]:
                print(f"      error: {e}", file=sys.stderr)
    else:
        p.error("give the server's URL, or --offline MODEL.gguf")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
