"""The engine's and the server's host time, on the CPU: the real
:class:`~ptxgen.llm.engine.Engine`, scheduler and server over a stand-in for
the GPU runner that takes a fixed device time per step.

::

    python -m benchmarks.serverpath --batches 1,8,64,128 --clients 64 \\
        --device-ms 10 --max-tokens 64 --json out.json

:class:`TimedRunner` sleeps (releasing the GIL, as a graph replay and a stream
synchronisation do) for ``--device-ms`` per decode step and per prefill step
(a decode step may be launched and collected later, as ``BatchRunner``'s:
the stand-in's device runs it from its launch, or from the end of the step
before, and collecting it sleeps what is left)
and chooses plausible tokens (word pieces of a real vocabulary, so the
engine's detokenisation and stop-string scan do real work).  Reported:

- **host µs per step** at each batch size: the wall time of the decode steps
  of an offline ``Engine.generate`` less the stand-in's device time, per
  step: the time the device waits for the engine's own Python between two
  steps (all of that Python with ``--sync``; what the overlap leaves exposed
  without).
- **server**: the real app under uvicorn on a free port, ``--clients``
  streaming ``/v1/completions`` clients (httpx, in a process of their own)
  with ``ignore_eos``: the tokens per second they receive, as a fraction of
  what the stand-in allows at that batch (``clients / device time``) and of
  the engine's offline rate at the same batch, with the time to first token
  (requests that start late, or wait for prefill, cost the rate that much).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import socket
import sys
import threading
import time

from .load import _levels

__all__ = ["TimedRunner", "host_per_step", "server_rate", "main"]

VOCAB = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "vocab",
                     "ggml-vocab-llama-bpe.gguf")


def word_tokens(tokenizer, limit: int = 4000) -> list:
    """Token ids whose pieces are a letter word, with or without a leading
    space (what a model mostly writes)."""
    out = []
    for t in range(tokenizer.n_vocab):
        piece = tokenizer.token_to_piece(t)
        word = piece[1:] if piece[:1] == b" " else piece
        if 2 <= len(word) and word.isalpha() and word.isascii():
            out.append(t)
            if len(out) >= limit:
                break
    if not out:
        raise ValueError("the vocabulary has no word pieces")
    return out


class TimedRunner:
    """A stand-in for ``BatchRunner``: each step sleeps ``device_s``; a
    decode row's token is a word piece chosen from its seed and position.

    The attributes the scheduler reads are ``BatchRunner``'s; ``slept``,
    ``decode_steps`` and the first and last decode times are what
    :func:`host_per_step` needs.
    """

    def __init__(self, words, n_vocab: int, *, device_s: float, max_batch: int,
                 block_size: int = 16, chunk: int = 512, n_ctx: int = 1024):
        from ptxgen.llm.engine.rows import RowOutput
        self._row_output = RowOutput
        self.words = list(words)
        self.n_vocab = n_vocab
        self.device_s = float(device_s)
        self.max_batch = max_batch
        self.block_size = block_size
        self.chunk = chunk
        self.max_blocks_per_seq = -(-n_ctx // block_size)
        self.num_blocks = (max_batch + 2) * self.max_blocks_per_seq
        self.reset()

    def reset(self) -> None:
        self.slept = 0.0
        self.steps = self.decode_steps = 0
        self.first_decode = self.last_decode = None
        self.window_slept = 0.0      # slept from the first decode step to the last
        self.window_steps = 0        # steps from the first decode step to the last
        self._free_at = 0.0          # when the device is done with the steps launched

    def _sleep(self) -> tuple:
        t0 = time.perf_counter()
        time.sleep(self.device_s)
        t1 = time.perf_counter()
        self.slept += t1 - t0
        self.steps += 1
        return t0, t1

    def _decoded(self, rows, t0: float, t1: float) -> list:
        if self.first_decode is None:
            self.first_decode = t0
            self._before = (self.slept - (t1 - t0), self.steps - 1)
        self.last_decode = t1
        self.window_slept = self.slept - self._before[0]
        self.window_steps = self.steps - self._before[1]
        self.decode_steps += 1
        w, nw, out = self.words, len(self.words), self._row_output
        return [out(w[(r.seed * 7919 + r.position * 104729) % nw], -1.0) for r in rows]

    def _check(self, rows) -> None:
        if not 1 <= len(rows) <= self.max_batch:
            raise ValueError(f"a decode step takes 1..{self.max_batch} rows, got {len(rows)}")

    def decode(self, rows, mode: str = "graph") -> list:
        self._check(rows)
        self._drain()
        t0, t1 = self._sleep()
        return self._decoded(rows, t0, t1)

    def buckets(self, kind: str) -> tuple:
        out, b = [], 1
        while b < self.max_batch:
            out.append(b)
            b *= 2
        return tuple(out) + (self.max_batch,)

    def launch(self, rows, follow=None, mode: str = "graph"):
        """Queue a step on the stand-in's device: it starts when the step
        before it ends (or now) and takes ``device_s``; returns at once."""
        self._check(rows)
        t0 = max(time.perf_counter(), self._free_at)
        self._free_at = t1 = t0 + self.device_s
        self.slept += self.device_s
        self.steps += 1
        return [rows, t1, self._decoded(rows, t0, t1)]

    def collect(self, handle) -> list:
        """Wait for what is left of a launched step's device time."""
        rows, t1, out = handle
        left = t1 - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return out

    def _drain(self) -> None:
        left = self._free_at - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def prefill(self, chunks, mode: str = "graph") -> None:
        self._drain()
        self._sleep()


def _engine(tokenizer, words, device_s, batch, max_queue=None, overlap=True):
    from ptxgen.llm.engine import Engine
    runner = TimedRunner(words, tokenizer.n_vocab, device_s=device_s, max_batch=batch)
    return Engine(runner, tokenizer=tokenizer, model_name="serverpath",
                  max_queue=max_queue or max(256, 2 * batch), overlap=overlap)


def _prompts(rng, n, length, words):
    return [[rng.choice(words) for _ in range(length)] for _ in range(n)]


def host_per_step(tokenizer, words, batch: int, *, device_s: float, max_tokens: int,
                  prompt_len: int = 16, seed: int = 0, overlap: bool = True) -> dict:
    """Offline ``generate`` of ``batch`` prompts; host µs per decode step
    and the tokens per second against what the stand-in allows."""
    from ptxgen.llm.engine import RequestSettings
    rng = random.Random(seed)
    eng = _engine(tokenizer, words, device_s, batch, overlap=overlap)
    try:
        settings = RequestSettings(max_tokens=max_tokens, ignore_eos=True)
        eng.generate(_prompts(rng, batch, prompt_len, words), settings)      # warm-up
        r = eng.runner
        r.reset()
        t0 = time.perf_counter()
        outs = eng.generate(_prompts(rng, batch, prompt_len, words), settings)
        wall = time.perf_counter() - t0
    finally:
        eng.close()
    n_tok = sum(len(o.token_ids) for o in outs)
    # from the first decode step's start to the last one's end: every step's
    # sleep and, between two steps, the engine's host work
    window = r.last_decode - r.first_decode
    host = max(0.0, window - r.window_slept) / max(1, r.window_steps - 1)
    return {"batch": batch, "decode_steps": r.decode_steps, "tokens": n_tok,
            "host_us_per_step": round(host * 1e6, 1),
            "host_us_per_token": round(host * 1e6 / batch, 2),
            "tokens_per_s": round(n_tok / wall, 1),
            "allowed_tokens_per_s": round(batch / device_s, 1),
            "fraction": round(n_tok / wall / (batch / device_s), 3)}


# ---------------------------------------------------------------- the server
def _client_process(url, clients, max_tokens, prompt_len, words, seed, conn):
    """``clients`` streaming clients, one request each, all at once; sends
    back ``(tokens, wall seconds, errors)``."""
    import httpx

    from benchmarks.load import _one

    rec = {"done": 0, "abandoned": 0, "tokens": 0, "errors": [], "ttft": [], "itl": [],
           "tpot": []}

    async def run():
        limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients)
        rng = random.Random(seed)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
            body = lambda: {"model": "serverpath", "max_tokens": max_tokens, "stream": True,  # noqa: E731
                            "temperature": 0, "ignore_eos": True,
                            "stream_options": {"include_usage": True},
                            "prompt": [rng.choice(words) for _ in range(prompt_len)]}
            # one warm-up request opens the connection pool and the routes
            await _one(client, url, "/v1/completions", {**body(), "max_tokens": 2}, None,
                       {**rec, "errors": [], "ttft": [], "itl": [], "tpot": []})
            t0 = time.perf_counter()
            await asyncio.gather(*[_one(client, url, "/v1/completions", body(), None, rec)
                                   for _ in range(clients)])
            return time.perf_counter() - t0

    wall = asyncio.run(run())
    conn.send((rec["tokens"], wall, rec["errors"][:3], rec["itl"], rec["ttft"]))
    conn.close()


def server_rate(tokenizer, words, clients: int, *, device_s: float, max_tokens: int,
                prompt_len: int = 16, seed: int = 0, overlap: bool = True) -> dict:
    """The real server over the stand-in; ``clients`` streaming clients in
    another process.  Tokens per second received, against the stand-in's rate."""
    import uvicorn

    from ptxgen.llm.server import create_app
    eng = _engine(tokenizer, words, device_s, clients, overlap=overlap)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(eng), log_level="warning",
                                           timeout_graceful_shutdown=2))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        while not server.started:
            if not th.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_client_process,
                        args=(url, clients, max_tokens, prompt_len, words, seed, child))
        p.start()
        child.close()
        try:
            tokens, wall, errors, itl, ttft = parent.recv()
        except EOFError:
            raise RuntimeError(f"the client process ended without results (exit code "
                               f"{p.join() or p.exitcode})") from None
        p.join()
    finally:
        server.should_exit = True
        th.join(timeout=30)
        sock.close()
        eng.close()
    if errors:
        raise RuntimeError(f"the clients got errors: {errors}")
    itl, ttft = sorted(itl), sorted(ttft)
    rate = tokens / wall
    return {"clients": clients, "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(rate, 1), "allowed_tokens_per_s": round(clients / device_s, 1),
            "fraction": round(rate / (clients / device_s), 3),
            "itl_ms_p50": round(itl[len(itl) // 2] * 1e3, 2) if itl else None,
            "itl_ms_p99": round(itl[min(len(itl) - 1, int(len(itl) * 0.99))] * 1e3, 2)
            if itl else None,
            "ttft_ms_p50": round(ttft[len(ttft) // 2] * 1e3, 2) if ttft else None,
            "ttft_ms_max": round(ttft[-1] * 1e3, 2) if ttft else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serverpath",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=_levels, default=[1, 8, 64, 128],
                    help="batch sizes of the host-time table (default 1,8,64,128)")
    ap.add_argument("--clients", type=_levels, default=[64],
                    help="streaming clients of the server runs (default 64; 0 runs none)")
    ap.add_argument("--device-ms", type=float, default=10.0,
                    help="the stand-in's device time per step, ms (default 10)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--no-server", action="store_true", help="the host-time table only")
    ap.add_argument("--sync", action="store_true",
                    help="no overlap: each step waits for the host's work on the one before")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    if a.device_ms <= 0 or a.max_tokens < 2 or a.prompt_len < 1:
        ap.error("--device-ms must be positive, --max-tokens at least 2, --prompt-len at least 1")
    from ptxgen.llm.text.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(VOCAB)
    words = word_tokens(tok)
    dev = a.device_ms / 1e3
    res = {"device_ms": a.device_ms, "max_tokens": a.max_tokens, "overlap": not a.sync,
           "host": [], "server": []}
    print(f"stand-in device time {a.device_ms} ms per step; {a.max_tokens} tokens per request; "
          f"{'synchronous steps' if a.sync else 'overlapped steps'}")
    print(f"{'B':>5} {'host us/step':>13} {'us/token':>9} {'tok/s':>10} {'allowed':>10} "
          f"{'fraction':>9}")
    offline = {}
    for b in a.batches:
        r = host_per_step(tok, words, b, device_s=dev, max_tokens=a.max_tokens,
                          prompt_len=a.prompt_len, overlap=not a.sync)
        offline[b] = r["tokens_per_s"]
        res["host"].append(r)
        print(f"{b:>5} {r['host_us_per_step']:>13.1f} {r['host_us_per_token']:>9.2f} "
              f"{r['tokens_per_s']:>10.1f} {r['allowed_tokens_per_s']:>10.1f} "
              f"{r['fraction']:>9.3f}", flush=True)
    if not a.no_server:
        print(f"{'clients':>7} {'tok/s':>10} {'allowed':>10} {'fraction':>9} "
              f"{'of offline':>10} {'itl p50/p99 ms':>15} {'ttft p50/max ms':>16}")
        for n in a.clients:
            r = server_rate(tok, words, n, device_s=dev, max_tokens=a.max_tokens,
                            prompt_len=a.prompt_len, overlap=not a.sync)
            if n not in offline:
                offline[n] = host_per_step(tok, words, n, device_s=dev,
                                           max_tokens=a.max_tokens,
                                           prompt_len=a.prompt_len,
                                           overlap=not a.sync)["tokens_per_s"]
            r["of_offline"] = round(r["tokens_per_s"] / offline[n], 3)
            res["server"].append(r)
            print(f"{n:>7} {r['tokens_per_s']:>10.1f} {r['allowed_tokens_per_s']:>10.1f} "
                  f"{r['fraction']:>9.3f} {r['of_offline']:>10.3f} "
                  f"{r['itl_ms_p50']:>7}/{r['itl_ms_p99']:<7} {r['ttft_ms_p50']:>8}/{r['ttft_ms_max']}",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
