"""The engine's batched table (llama-batched-bench's columns) with the
decode buckets built with or without programmatic dependent launch.

    python scripts/batched_table.py MODEL.gguf [--pdl table|on|off] [-npl 1,8,32,64,128]

The same rows as ``python -m ptxgen bench MODEL.gguf -p 0 -n 0 -npp 128
-ntg 128``, on a :class:`~ptxgen.llm.engine.runner.BatchRunner` built with
``pdl`` as asked ("table": as the runner decides), so a GPU call can set
the two side by side (scripts/gpu_batch_gap.sh), each row's decode read
floor after the table on the GPU (:func:`ptxgen.llm.bench.format_floor`).
"""

import argparse

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--pdl", choices=("table", "on", "off"), default="table")
    ap.add_argument("-npp", type=int, default=128)
    ap.add_argument("-ntg", type=int, default=128)
    ap.add_argument("-npl", default="1,8,32,64,128")
    ap.add_argument("--backend", default="cuda")
    a = ap.parse_args()
    from ptxgen.driver.backend import get_backend
    from ptxgen.llm.bench import batched_bench, format_batched, format_floor
    from ptxgen.llm.engine import Engine
    from ptxgen.llm.engine.runner import BatchRunner
    from ptxgen.llm.gguf.file import LlamaFile
    npl = tuple(int(x) for x in a.npl.split(","))
    f = LlamaFile(a.model)
    bandwidth = None
    if a.backend == "cuda" and not f.hparams.n_expert:     # before the KV pool takes the memory
        from ptxgen.driver.timing import copy_ceiling
        bandwidth = copy_ceiling()
    r = BatchRunner(f, get_backend(a.backend), max_batch=max(npl), ctx_size=a.npp + a.ntg + 1,
                    pdl=None if a.pdl == "table" else a.pdl == "on")
    with Engine.from_gguf(f, runner=r) as e:
        rows = batched_bench(e, (a.npp,), (a.ntg,), npl, True, np.random.default_rng(1))
    print(format_batched(rows, f"pdl = {a.pdl}"))
    if bandwidth is not None:
        print()
        print(format_floor(rows, f, bandwidth))


if __name__ == "__main__":
    main()
