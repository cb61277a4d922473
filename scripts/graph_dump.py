#!/usr/bin/env python3
"""Dump a model's decode graph (launches, their arguments and a hash of each
kernel's PTX, the buffers, the RoPE table) as JSON, without uploading
anything: for checking that a change leaves a model's decode step as it was.

    python scripts/graph_dump.py MODEL.gguf OUT.json ['{"fuse_rope": false}']

The graph is built for sm_90a with 132 SMs (an H100's; PDL on), capacity
4096, on the emulator backend (no GPU needed); the optional JSON object
gives more ``Model`` keyword arguments.  Compare two dumps (e.g. before
and after a change, same file) with ``cmp`` or ``diff``.
"""

import hashlib
import json
import sys

import numpy as np


def dump(path, out, kw):
    from ptxgen import registry
    from ptxgen.abi import parse_entries
    from ptxgen.driver.backend import get_backend
    from ptxgen.llm import model as L
    from ptxgen.llm.gguf.file import LlamaFile

    class _NoUpload:
        def __init__(self, *a, **k):
            pass

    L.Executor = _NoUpload
    m = L.Model(LlamaFile(path), get_backend("emu"), capacity=4096, target="sm_90a",
                     sm_count=132, progress=False, **kw)

    def arg(a):
        if hasattr(a, "buffer"):
            return f"{a.buffer.name}+{a.offset}"
        if hasattr(a, "name") and hasattr(a, "nbytes"):
            return a.name
        return repr(a)

    ptx, rows = {}, []
    for op in m.graph.ops:
        for ln in op.launches:
            key = repr(ln.spec)
            if key not in ptx:
                text = registry.family(ln.family).build(ln.spec).to_ptx()
                ptx[key] = (hashlib.sha256(text.encode()).hexdigest()[:16],
                            {k: [p.name for p in v] for k, v in parse_entries(text).items()})
            geo = ln.geometry
            named = {**dict(ln.args), **dict(geo.args)}       # in the kernel's parameter order
            args = [named[n] for n in ptx[key][1][geo.kernel]]
            rows.append([op.kind, op.name, ln.family, geo.kernel, list(geo.grid), list(geo.block),
                         geo.shared, [arg(a) for a in args], ptx[key][0]])
    bufs = {b.name: [list(b.shape), str(b.dtype), b.kind] for b in m.graph.buffers}
    tables = {b.name: hashlib.sha256(np.ascontiguousarray(b.data).tobytes()).hexdigest()[:16]
              for b in m.graph.buffers if b.name == "rope_freqs"}
    with open(out, "w") as f:
        json.dump({"launches": rows, "buffers": bufs, "tables": tables}, f, indent=0)
    print(f"{len(rows)} launches, {len(ptx)} kernels -> {out}")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    dump(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) == 4 else {})
