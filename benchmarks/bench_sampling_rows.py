"""GPU benchmark of the batched sampler (``ops.sample_rows``) at the Llama-3
vocabulary (128,256 f32 logits a row, ``N(0, 2.5)`` with a few strong
tokens): one launch for ``B`` rows against ``B`` one-row launches
(``ops.sample``) in one graph, for B = 1, 8, 32, 64 and 128, with every row
on llama.cpp's default chain (penalties over 64 tokens, top-k 40, top-p
0.95, min-p 0.05, temperature 0.8), every row greedy, and the default chain
with the top 20 log-probabilities asked for on every row.

Every timing is a CUDA-graph replay of ``REPS`` calls (bench_common.graph_us),
the median of ``REPEATS`` replays divided by ``REPS``.  The rows launch's
tokens must equal the one-row launches' (checked on each case).

    python -m benchmarks.bench_sampling_rows [out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import numpy as np

from .bench_common import graph_us

REPS = 10
REPEATS = 7
VOCAB = 128256
WINDOW = 256
BATCHES = (1, 8, 32, 64, 128)
DEFAULT = dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, penalty_last_n=64,
               penalty_repeat=1.1, penalty_freq=0.05, penalty_present=0.1)
CHAINS = {"default": DEFAULT, "greedy": dict(temperature=0.0),
          "default_logprobs20": dict(DEFAULT, logprobs=True)}


def bench_case(B, chain, rng):
    from ptxgen.driver import DeviceArray, Stream, ops
    from ptxgen.kernels import sampling as S
    stream = Stream(non_blocking=True)
    x = (rng.standard_normal((B, VOCAB)) * 2.5).astype(np.float32)
    x[:, rng.integers(0, VOCAB, 30)] += 9.0
    hist = rng.integers(0, VOCAB, (B, WINDOW)).astype(np.int32)
    hlen = np.full(B, WINDOW, np.int32)
    pos = hlen - 1
    kw = CHAINS[chain]
    params = np.stack([S.pack_params(seed=1000 + b, **kw) for b in range(B)])
    nlp = 20 if kw.get("logprobs") else 0
    dx, dh, dl, dp, dprm = (DeviceArray.from_numpy(a) for a in (x, hist, hlen, pos, params))
    out = DeviceArray.empty((B, 1), np.int32)
    lp = ((DeviceArray.empty((B, 1), np.float32), DeviceArray.empty((B, nlp), np.int32),
           DeviceArray.empty((B, nlp), np.float32)) if nlp else (None, None, None))

    def rows(s):
        ops.sample_rows(dx, dh, dl, dp, dprm, out=out, logprobs=nlp, logprob=lp[0],
                        top_ids=lp[1], top_logprobs=lp[2], stream=s)

    # the one-row launches: row b's logits, its window as a position-indexed
    # history, its params
    ones = []
    for b in range(B):
        ones.append((dx.view(offset=4 * b * VOCAB, shape=(VOCAB,)),
                     DeviceArray.from_numpy(hist[b]), DeviceArray.from_numpy(pos[b:b + 1]),
                     DeviceArray.from_numpy(S.pack_params(seed=1000 + b, **kw)),
                     DeviceArray.empty((1,), np.int32)))

    def singles(s):
        for row, h, p, prm, o in ones:
            ops.sample(row, h, p, prm, out=o, stream=s)

    rec = {"B": B, "chain": chain, "rows_us": graph_us(rows, stream, REPS, REPEATS),
           "singles_us": graph_us(singles, stream, REPS, REPEATS)}
    stream.synchronize()
    got = out.to_numpy()[:, 0]
    want = np.array([o.to_numpy()[0] for *_, o in ones])
    rec["same_tokens"] = bool(np.array_equal(got, want))
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json_out", nargs="?", help="write the results here")
    a = ap.parse_args(argv)
    from ptxgen.driver import get_device
    dev = get_device()
    rng = np.random.default_rng(0)
    res = {"device": dev.name, "date": time.strftime("%Y-%m-%d"), "vocab": VOCAB,
           "reps": REPS, "repeats": REPEATS,
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True).stdout.strip(),
           "cases": []}
    print(f"{dev.name}; vocab {VOCAB}; us per call (CUDA-graph replays)")
    print(f"{'chain':>20} {'B':>4} {'rows':>9} {'B x one':>9} {'rows/row':>9} {'same':>5}")
    bad = []
    for chain in CHAINS:
        for B in BATCHES:
            r = bench_case(B, chain, rng)
            res["cases"].append(r)
            print(f"{chain:>20} {B:>4} {r['rows_us']:9.1f} {r['singles_us']:9.1f} "
                  f"{r['rows_us'] / B:9.2f} {str(r['same_tokens']):>5}", flush=True)
            if not r["same_tokens"]:
                bad.append((chain, B))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", a.json_out)
    if bad:
        raise SystemExit(f"the rows launch's tokens differ from the one-row launches' at {bad}")


if __name__ == "__main__":
    main()
