"""Encode and decode speed of the GGUF tokenizer on English text, one core.

The text is the English reference documentation that ships with Python
(``pydoc_data.topics``, ~0.47 MB of prose and some code), so every machine
has it and runs the same input.  Reported per vocabulary:

* load: reading the GGUF metadata and building the tokenizer;
* encode, cold: a fresh tokenizer's first pass (its word cache empty);
* encode, warm: later passes over the same text (every word cached);

each the best of several runs (``--trials``, ``--repeat``);
* decode: the ids back to text.

Times are the process's CPU time (``time.process_time``), so that other
work on a shared machine does not count; MB is 10**6 bytes of UTF-8 input.
Usage::

    python benchmarks/bench_tokenizer.py [VOCAB.gguf ...] [--repeat N]

Without files it runs the vocabularies in ``tests/data/vocab/``.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

from ptxgen.llm.gguf.metadata import read_gguf_metadata
from ptxgen.llm.text.tokenizer import Tokenizer


def english_text() -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


def bench(path: str, text: str, repeat: int, trials: int) -> dict:
    nbytes = len(text.encode("utf-8"))
    t0 = time.process_time()
    meta = read_gguf_metadata(path)
    t_read = time.process_time() - t0
    loads, colds = [], []
    for _ in range(trials):
        t0 = time.process_time()
        tok = Tokenizer.from_metadata(meta)
        t1 = time.process_time()
        ids = tok.encode(text, add_special=False)
        t2 = time.process_time()
        loads.append(t1 - t0)
        colds.append(t2 - t1)
    warm = []
    for _ in range(repeat):
        s = time.process_time()
        again = tok.encode(text, add_special=False)
        warm.append(time.process_time() - s)
        assert again == ids
    s = time.process_time()
    back = tok.decode(ids)
    t_dec = time.process_time() - s
    return {
        "name": os.path.basename(path), "load_s": t_read + min(loads), "tokens": len(ids),
        "cold_mbs": nbytes / 1e6 / min(colds), "warm_mbs": nbytes / 1e6 / min(warm),
        "decode_mbs": len(back.encode("utf-8")) / 1e6 / t_dec,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("vocab", nargs="*", help="GGUF files (default: tests/data/vocab/*.gguf)")
    ap.add_argument("--repeat", type=int, default=3, help="warm passes (best is reported)")
    ap.add_argument("--trials", type=int, default=3,
                    help="fresh tokenizers for the load and cold pass (best is reported)")
    args = ap.parse_args(argv)
    paths = args.vocab or sorted(glob.glob(os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "vocab", "*.gguf")))
    if not paths:
        print("no vocabulary files given or found", file=sys.stderr)
        return 2
    text = english_text()
    print(f"text: pydoc_data.topics, {len(text.encode('utf-8')) / 1e6:.3f} MB; one thread, CPU time")
    print(f"{'vocabulary':34} {'load s':>7} {'tokens':>8} {'cold MB/s':>10} {'warm MB/s':>10} "
          f"{'decode MB/s':>12}")
    for p in paths:
        r = bench(p, text, args.repeat, args.trials)
        print(f"{r['name']:34} {r['load_s']:7.2f} {r['tokens']:8d} {r['cold_mbs']:10.2f} "
              f"{r['warm_mbs']:10.2f} {r['decode_mbs']:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
