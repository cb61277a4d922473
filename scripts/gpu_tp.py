"""Tensor-parallel greedy decode on the GPUs of one host against one GPU.

One process per rank (spawned), each with its GPU's context current, its
shard of the file (ptxgen.llm.parallel) and an NCCL communicator through
nccl4py (NCCL_NVLS_ENABLE=0); then the same prompt on one GPU.  Prints one
JSON line: both runs' tokens, whether they agree, and their decode speeds.

    python scripts/gpu_tp.py MODEL.gguf --tp 2 --new 32 [--chunk 128]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys


def _run(path, rank, world, uid, prompt, new, chunk, out):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    from ptxgen.driver.backend import CudaBackend
    from ptxgen.llm.gguf.file import LlamaFile
    from ptxgen.llm.model import Model
    from ptxgen.llm.parallel import TensorParallel
    try:
        be = CudaBackend(device=rank)
        kw = {}
        if world > 1:
            from ptxgen.driver.nccl import communicator
            kw = dict(tp=TensorParallel(rank, world), comm=communicator(rank, world, uid))
        m = Model(LlamaFile(path), be, capacity=len(prompt) + new + 1, progress=False, **kw)
        m.generate(prompt, 2, prefill_chunk=chunk)            # warm-up: builds and captures
        res = m.generate(prompt, new, prefill_chunk=chunk)
        out.put((rank, dict(tokens=list(res.tokens), tokens_per_second=res.tokens_per_second)))
    except BaseException as e:
        out.put((rank, dict(error=f"{type(e).__name__}: {e}")))
        raise


def _group(path, world, prompt, new, chunk):
    ctx = mp.get_context("spawn")
    uid = b""
    if world > 1:
        from ptxgen.driver.nccl import unique_id
        uid = unique_id()
    out = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(path, r, world, uid, prompt, new, chunk, out))
             for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return [got[r] for r in range(world)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=0, help="prompt chunk (0: token by token)")
    a = ap.parse_args(argv)
    prompt = [(7919 * i + 11) % 1000 + 1 for i in range(a.prompt_tokens)]
    ranks = _group(a.model, a.tp, prompt, a.new, a.chunk)
    one = _group(a.model, 1, prompt, a.new, a.chunk)[0]
    errors = [r["error"] for r in ranks + [one] if "error" in r]
    report = dict(model=a.model, tp=a.tp, chunk=a.chunk, errors=errors)
    if not errors:
        report.update(
            same_tokens=all(r["tokens"] == one["tokens"] for r in ranks),
            ranks_agree=all(r["tokens"] == ranks[0]["tokens"] for r in ranks),
            tp_tokens_per_second=ranks[0]["tokens_per_second"],
            one_gpu_tokens_per_second=one["tokens_per_second"],
            tokens_tp=ranks[0]["tokens"], tokens_one=one["tokens"])
    print(json.dumps(report))
    return 0 if not errors and report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
