"""The streaming ceiling: how fast a kernel could be in each position of the decode step.

``python -m benchmarks.bench_ceiling [OUT.json]`` (GPU, torch for graphs).

A GEMV, a flash-decode split or a decode step is judged by its share of a
device copy's bandwidth.  Part of what it misses is its own (instructions,
loads in flight); part belongs to the position it runs in: a launch that must
wait for the one before it pays the DRAM pipeline's drain and refill however
little it computes.  This benchmark separates the two.  It times the
stream-read kernel (``kernels/stream_read.py``: read every byte once, fold
with XOR, nothing else) where the real kernels run, with the same bytes per
launch, programmatic dependent launch, CUDA-graph replay and buffers rotated
past the 50 MB L2:

1. **Per size**: every read variant (one step per block over many waves, or
   a persistent grid) on the byte counts of the Q4_K GEMV shapes, the
   gate/up pair, the flash-decode K/V at 16K and 32K and the Q4_K/Q6_K
   output matrices; the best variant again without PDL.
2. **Chains**: one Llama-3-8B layer's four GEMVs (QKV, O, gate/up, down, 8
   layers of distinct memory); the same with the layer's small launches
   (RMSNorm, RoPE + append, attention split and combine at context 128,
   RMSNorm) as one-block reads; flash decode as a split read plus a
   dependent one-block launch (the combine); the whole decode step (32 such
   layers, the Q6_K output matrix, embedding, final norm and argmax), 292
   launches.

Each row gives the time, the share of copy, and so the most any kernel in
that chain could reach.  ``make bench`` runs the real kernels in the same
positions (docs/notes/gemv.md, "The yardstick").
"""

from __future__ import annotations

import json
import math
import sys
import time

import attrs
import numpy as np

from ptxgen.kernels import stream_read as S

__all__ = ["run_all", "SIZES", "VARIANTS"]

MB = 1e6
Q4K_ROW = 4096 // 256 * 144            # bytes of a K = 4096 Q4_K row
Q6K_ROW = 4096 // 256 * 210
SIZES = {
    "Q4_K 1024x4096": 1024 * Q4K_ROW,
    "Q4_K 4096x4096 (O)": 4096 * Q4K_ROW,
    "Q4_K 6144x4096 (QKV)": 6144 * Q4K_ROW,
    "Q4_K 14336x4096 / 4096x14336 (down)": 14336 * Q4K_ROW,
    "Q4_K 2x14336x4096 (gate/up)": 2 * 14336 * Q4K_ROW,
    "flash K/V 16K (8 heads, d 128, f16)": 2 * 8 * 16384 * 128 * 2,
    "flash K/V 32K": 2 * 8 * 32768 * 128 * 2,
    "Q4_K 128256x4096": 128256 * Q4K_ROW,
    "Q6_K 128256x4096 (output)": 128256 * Q6K_ROW,
}
VARIANTS = {
    "c256x4": S.StreamReadSpec(block=256, loads=4),
    "c256x8": S.StreamReadSpec(block=256, loads=8),
    "c512x4": S.StreamReadSpec(block=512, loads=4),
    "c512x8": S.StreamReadSpec(block=512, loads=8),
    "p256x8": S.StreamReadSpec(block=256, loads=8, persistent=True),
    "p512x4": S.StreamReadSpec(block=512, loads=4, persistent=True),
    "p1024x4": S.StreamReadSpec(block=1024, loads=4, persistent=True),
}
TINY = S.StreamReadSpec(block=128, loads=8)          # one block reading 16 KB
TINY_BYTES = TINY.step_units * 16
L2_DEFEAT_BYTES = 256 << 20
CALLS = 20


class _Reader:
    """Launch one stream-read variant on the torch stream, PDL or not."""

    def __init__(self, spec, pdl, sms, out):
        from ptxgen.kernels.spec_fields import has_griddepcontrol

        from ptxgen.driver import ops_decode as ops
        from ptxgen.driver.launch import launch
        self._launch = launch
        target = ops.device_target()
        self.pdl = pdl and has_griddepcontrol(target)
        self.spec = attrs.evolve(spec, pdl=self.pdl, target=target)
        self.fn = ops._fn(S.build, self.spec)
        self.resident = ops._resident(self.fn, spec.block) or 1
        self.sms, self.out = sms, out

    def grid(self, nbytes):
        g = S.launch_geometry(self.spec, nbytes).grid[0]
        return min(g, self.resident * self.sms) if self.spec.persistent else g

    def __call__(self, ptr, nbytes, stream):
        self._launch(self.fn, self.grid(nbytes), self.spec.block, ptr, self.out, nbytes // 16,
               stream=stream, pdl=self.pdl)


def _check(torch, reader, pool, nbytes):
    """The fold of one launch equals numpy's XOR of the same bytes."""
    n = min(nbytes, 16 << 20)
    reader.out.zero_()
    reader(pool.data_ptr(), n, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    g = reader.grid(n)
    got = np.bitwise_xor.reduce(reader.out[:g].cpu().numpy().view(np.uint32))
    want = np.bitwise_xor.reduce(pool[:n].cpu().numpy().view(np.uint32))
    if got != want:
        raise AssertionError(f"stream_read {reader.spec.kernel_name}: XOR {got:#x} != {want:#x}")


def run_all(verbose: bool = True) -> dict:
    import torch

    from . import bench_gemv as BG
    from .bench_common import copy_bandwidth

    def say(*a):
        if verbose:
            print(*a, flush=True)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw, _ = copy_bandwidth()
    res = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), sms=sms,
               copy_bw_gbps=bw / 1e9, sizes=[], chains=[])
    say(f"{res['device']}: {sms} SMs, copy {bw / 1e9:.0f} GB/s (read + write)")
    layer = [SIZES["Q4_K 6144x4096 (QKV)"], SIZES["Q4_K 4096x4096 (O)"],
             SIZES["Q4_K 2x14336x4096 (gate/up)"], SIZES["Q4_K 14336x4096 / 4096x14336 (down)"]]
    attn128 = 2 * 8 * 128 * 128 * 2
    layer_bytes = sum(layer) + attn128 + 5 * TINY_BYTES
    step_bytes = 32 * layer_bytes + SIZES["Q6_K 128256x4096 (output)"] + 3 * TINY_BYTES
    pool_bytes = max(step_bytes, L2_DEFEAT_BYTES + max(SIZES.values())) + (1 << 20)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    pool = torch.randint(-128, 128, (pool_bytes,), dtype=torch.int8, device="cuda",
                         generator=gen).view(torch.uint8)
    out = torch.zeros(1 << 22, dtype=torch.int32, device="cuda")
    base = pool.data_ptr()
    readers = {(n, pdl): _Reader(v, pdl, sms, out) for n, v in VARIANTS.items()
               for pdl in (True, False)}
    tiny = _Reader(TINY, True, sms, out)
    for r in readers.values():
        _check(torch, r, pool, 9 << 20)
    _check(torch, tiny, pool, TINY_BYTES)

    def stream():
        return torch.cuda.current_stream().cuda_stream

    def time_size(reader, nbytes):
        copies = max(2, math.ceil(L2_DEFEAT_BYTES / nbytes))
        span = (nbytes + 4095) // 4096 * 4096
        copies = min(copies, (pool_bytes - nbytes) // span + 1)
        return BG._time_graph(torch, lambda i: reader(base + (i % copies) * span, nbytes,
                                                      stream()), calls=CALLS)

    best = {}
    for name, nbytes in SIZES.items():
        row = dict(name=name, bytes=nbytes, floor_us=nbytes / bw * 1e6, variants_us={})
        for vn in VARIANTS:
            row["variants_us"][vn] = time_size(readers[(vn, True)], nbytes) * 1e6
        vb = min(row["variants_us"], key=row["variants_us"].get)
        row["best"], row["best_us"] = vb, row["variants_us"][vb]
        row["best_share"] = row["floor_us"] / row["best_us"]
        row["best_no_pdl_us"] = time_size(readers[(vb, False)], nbytes) * 1e6
        best[nbytes] = readers[(vb, True)]
        res["sizes"].append(row)
        say(f"{name:<40} {nbytes / MB:8.2f} MB  floor {row['floor_us']:7.2f} us  best {vb} "
            f"{row['best_us']:7.2f} us ({100 * row['best_share']:.1f}% of copy), no PDL "
            f"{row['best_no_pdl_us']:.2f}; all: "
            + " ".join(f"{k} {v:.2f}" for k, v in row["variants_us"].items()))

    def chain(name, seq, reps, calls=1, same=False):
        """Time ``reps`` copies of ``seq`` (reader, bytes) over distinct
        memory (``same``: every copy reads the same bytes)."""
        def run(i):
            off = 0
            for _ in range(reps):
                if same:
                    off = 0
                for reader, nbytes in seq:
                    reader(base + off, nbytes, stream())
                    off += (nbytes + 4095) // 4096 * 4096
        nb = sum(n for _, n in seq)
        t = BG._time_graph(torch, run, calls=calls) / reps
        row = dict(name=name, bytes=nb, launches=len(seq), floor_us=nb / bw * 1e6, us=t * 1e6,
                   share=nb / bw / t)
        res["chains"].append(row)
        say(f"{name:<52} {len(seq):3d} launches {nb / MB:8.2f} MB  floor {row['floor_us']:8.2f} us"
            f"  ceiling {row['us']:8.2f} us  {100 * row['share']:.1f}% of copy")
        return row

    attn_reader = readers[("c256x4", True)]
    gemvs = [(best[n], n) for n in layer]
    chain("layer: QKV, O, gate/up, down", gemvs, 8)
    small = [(tiny, TINY_BYTES), gemvs[0], (tiny, TINY_BYTES), (attn_reader, attn128),
             (tiny, TINY_BYTES), gemvs[1], (tiny, TINY_BYTES), gemvs[2], gemvs[3]]
    chain("layer with its 5 small launches (context 128)", small, 8)
    for L, key in ((16384, "flash K/V 16K (8 heads, d 128, f16)"), (32768, "flash K/V 32K")):
        nb = SIZES[key]
        fl = [(best[nb], nb), (tiny, TINY_BYTES)]
        chain(f"flash decode {L}: split read + 1-block combine", fl,
              max(2, math.ceil(L2_DEFEAT_BYTES / nb)))
        # bench_decode replays one cache: part of it may stay in L2 between calls
        chain(f"flash decode {L}, one cache re-read (as bench_decode)", fl, 20, same=True)
    out_bytes = SIZES["Q6_K 128256x4096 (output)"]
    step = [(tiny, TINY_BYTES)] + small * 32 + [(tiny, TINY_BYTES), (best[out_bytes], out_bytes),
                                                (tiny, TINY_BYTES)]
    chain("decode step, context 128 (292 launches)", step, 1, calls=2)
    return res


if __name__ == "__main__":
    r = run_all()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(r, f, indent=1)
