"""The GPU sampler against the same chain in torch, at the Llama-3 vocabulary.

``python benchmarks/bench_sampling.py OUT.json [--vocab 128256]`` on a GPU
with torch.  Six chains over f32 logits (``N(0, 2.5)`` with a
few strong tokens) and a 64-token history:

- ``default``: penalties over 64 tokens (repeat 1.1, frequency 0.05,
  presence 0.1), top-k 40, top-p 0.95, min-p 0.05, temperature 0.8;
- ``top_p``: top-p 0.95 alone (torch sorts the whole vocabulary); on these
  logits the set holds about 12,000 tokens, more than the kernel knows
  exactly, so ours is cut at the known keys (``info`` flag 1);
- ``min_p``: min-p 0.05 alone;
- ``top_k``: top-k 40 alone;
- ``penalties``: the penalties alone, then the whole-vocabulary draw;
- ``top_p_peaked``: top-p 0.95 alone on logits with five tokens 12 higher
  (a set of a few thousand tokens, cut by the radix select);

plus greedy (``ops.argmax`` against ``torch.argmax``).  The table shows the
kernel's ``info``: kept count and flags (1: cut at the keys known exactly,
2: whole-vocabulary draw).  Ours: one
``ops_sampling.sample`` launch; torch: the ops a user writes (``topk`` or
``sort``, ``softmax``, ``cumsum``, masks, ``multinomial``).  Both are
replayed from CUDA graphs holding ``REPS`` calls; a time is the median over
``REPEATS`` replays divided by ``REPS``.  Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import time

import numpy as np

from benchmarks.bench_common import graph_us, torch_graph_us

REPS = 20
REPEATS = 30


def _ours(fn, stream):
    """Median µs per call of ``fn(stream)`` replayed from a ptxgen graph."""
    return graph_us(fn, stream, REPS, REPEATS)


def _torch(fn):
    """Median µs per call of ``fn()`` from a torch CUDA graph (eagerly where
    torch refuses the capture) and how it was timed."""
    return torch_graph_us(fn, REPS, REPEATS, eager_fallback=True)


CHAINS = {
    "default": dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, penalty_last_n=64,
                    penalty_repeat=1.1, penalty_freq=0.05, penalty_present=0.1),
    "top_p": dict(top_p=0.95, temperature=0.8),
    "min_p": dict(min_p=0.05, temperature=0.8),
    "top_k": dict(top_k=40, temperature=0.8),
    "penalties": dict(temperature=0.8, penalty_last_n=64, penalty_repeat=1.1,
                      penalty_freq=0.05, penalty_present=0.1),
    "top_p_peaked": dict(top_p=0.95, temperature=0.8),
}
#: chains run on the peaked logits
PEAKED = {"top_p_peaked"}


def torch_chain(torch, logits, window, kw):
    """The chain in torch ops (graph-capturable: fixed shapes, no host sync)."""
    v = logits.numel()
    counts = torch.zeros(v, device=logits.device, dtype=torch.float32)
    ones = torch.ones(window.numel(), device=logits.device, dtype=torch.float32)
    temp = kw["temperature"]

    def run():
        x = logits
        if kw.get("penalty_last_n", 0):
            counts.zero_()
            counts.scatter_add_(0, window, ones)
            hit = counts > 0
            rep = kw["penalty_repeat"]
            pen = torch.where(x <= 0, x * rep, x / rep) - (counts * kw["penalty_freq"]
                                                            + kw["penalty_present"])
            x = torch.where(hit, pen, x)
        if kw.get("top_k", 0):
            vals, idx = torch.topk(x, kw["top_k"])
        elif kw.get("top_p", 1.0) < 1.0:
            vals, idx = torch.sort(x, descending=True)
        else:
            vals, idx = x, None
        keep = torch.ones_like(vals, dtype=torch.bool)
        if kw.get("top_p", 1.0) < 1.0:
            p = torch.softmax(vals, -1)
            c = torch.cumsum(p, -1)
            keep &= (c - p) < kw["top_p"]
        if kw.get("min_p", 0.0) > 0.0:
            keep &= vals >= vals.max() + math.log(kw["min_p"])
        probs = torch.softmax(vals.masked_fill(~keep, float("-inf")) / temp, -1)
        pick = torch.multinomial(probs, 1)
        return pick if idx is None else idx[pick]
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args(argv)

    import torch

    from ptxgen.driver import DeviceArray, Stream, get_device, ops
    from ptxgen.driver.ops_sampling import sample, sampling_params, sampling_spec

    v = args.vocab
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(v) * 2.5).astype(np.float32)
    x[rng.integers(0, v, 30)] += 9.0
    xp = x.copy()
    xp[rng.integers(0, v, 5)] += 12.0
    hist = rng.integers(0, v, 256).astype(np.int32)
    pos = 200
    tx, txp = torch.from_numpy(x).cuda(), torch.from_numpy(xp).cuda()
    window = torch.from_numpy(hist[pos - 63: pos + 1].astype(np.int64)).cuda()
    dx, dxp = DeviceArray.from_numpy(x), DeviceArray.from_numpy(xp)
    dh = DeviceArray.from_numpy(hist)
    dpos = DeviceArray.from_numpy(np.array([pos], np.int32))
    out = DeviceArray.empty((1,), np.int32)
    info = DeviceArray.empty((4,), np.int32)
    stream = Stream()
    rows = []
    for name, kw in CHAINS.items():
        params = sampling_params(seed=1234, **kw)
        lx, ltx = (dxp, txp) if name in PEAKED else (dx, tx)
        sample(lx, dh, dpos, params, out=out, info=info, stream=stream)
        stream.synchronize()
        kept, flags = (int(i) for i in info.to_numpy()[:2])
        ours = _ours(lambda s, p=params, lx=lx: sample(lx, dh, dpos, p, out=out, stream=s),
                     stream)
        theirs, mode = _torch(torch_chain(torch, ltx, window, kw))
        rows.append(dict(chain=name, params=kw, ours_us=ours, torch_us=theirs,
                         torch_mode=mode, ratio=ours / theirs, kept=kept, flags=flags))
    am = DeviceArray.empty((1,), np.int32)
    ours = _ours(lambda s: ops.argmax(dx, out=am, stream=s), stream)
    theirs, mode = _torch(lambda: torch.argmax(tx))
    rows.append(dict(chain="greedy", params={}, ours_us=ours, torch_us=theirs, torch_mode=mode,
                     ratio=ours / theirs, kept=1, flags=0))

    spec = sampling_spec(v)
    dev = get_device()
    print(f"{dev.name}, vocab {v}, {spec.kernel_name}; µs per call, median of {REPEATS} "
          f"graph replays of {REPS} calls")
    print(f"{'chain':13s} {'ptxgen':>9s} {'torch':>9s} {'ratio':>7s} {'kept':>7s} {'flags':>5s}")
    for r in rows:
        print(f"{r['chain']:13s} {r['ours_us']:9.2f} {r['torch_us']:9.2f} {r['ratio']:7.3f} "
              f"{r['kept']:7d} {r['flags']:5d}"
              + ("" if r["torch_mode"] == "graph" else f"  (torch {r['torch_mode']})"))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    with open(args.out, "w") as f:
        json.dump(dict(device=dev.name, vocab=v, kernel=spec.kernel_name, reps=REPS,
                       repeats=REPEATS, torch=torch.__version__, commit=commit,
                       date=time.strftime("%Y-%m-%d"), python=platform.python_version(),
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
