"""A cost model of the sampler kernel from one emulated launch.

``python -m benchmarks.sampling_cost [--vocab 128256] [--chains default,top_k]
[--json OUT]`` runs ``ptxgen.kernels.sampling`` at the op's geometry (blocks
of 512 threads, 64 keys per block, sm_90) on the CPU emulator with the
logits and history of ``benchmarks/bench_sampling.py``, and counts, per
phase, what the GPU would issue:

- ``block``: the per-block phase (load, penalties, keys, sort, records), the
  largest count over the blocks (they run side by side, one per SM);
- ``last``: the last block's merge, cut and draw (it runs alone, after).

Counts are warp-instructions (one per warp with an active lane; branches
and predicated-off warps are not counted), by class; ``warp_path`` is the
most any one warp issued (the phase's serial length); ``alu``, ``smem``
(shared loads and stores), ``gmem`` (global), ``shfl``, ``atom32`` (native
32-bit shared atomics) and ``atom64`` (64-bit shared adds, which ptxas
turns into a compare-and-swap loop, ``ATOMS.CAST.SPIN.64``, on sm_90), and
``bar`` (block barriers passed).  ``a64_hot`` is the most 64-bit atomics one
shared address received in the phase: they succeed one at a time, so it is
a lower bound on the serial chain.  ``conflict`` is the sum over 32-bit
atomic warp-instructions of the most lanes of one warp on one address (the
hardware's serialisation of a warp's same-address lanes).

The model (µs) = ``T0 + (warp_instr / IPC + bar * C_BAR + a64_hot * C_CAS
+ conflict * C_CONF) / F``, the two phases added.  Its constants were
fitted to the H100 times of the kernel before the merge by warps (µs:
default 295.96, top-p 22.65, min-p 20.55): ``F`` = 1.755 GHz, ``IPC`` =
1.6 warp-instructions per cycle per SM, ``C_BAR`` = 40 cycles,
``C_CAS`` = 58 cycles per 64-bit atomic on the hottest address (two
histograms, a compare-and-swap each), ``C_CONF`` = 2 cycles, ``T0`` =
2.5 µs (graph launch, first global loads, fence and counter).  Latency
chains (``warp_path``) are outside it.  A rough guide: the GPU decides.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np

from ptxgen.emu import DeviceArray, Module, executor, launch, memops
from ptxgen.kernels import sampling as S

from .bench_sampling import CHAINS

F_GHZ, IPC, C_BAR, C_CAS, C_CONF, T0_US = 1.755, 1.6, 40, 58, 2, 2.5
CLASSES = ("alu", "smem", "gmem", "shfl", "atom32", "atom64", "bar")


def bench_inputs(v, chain="default"):
    """The logits, history and position of bench_sampling.py (seed 0); for
    ``top_p_peaked`` a sharper distribution whose top-p set is small."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(v) * 2.5).astype(np.float32)
    x[rng.integers(0, v, 30)] += 9.0
    if chain == "top_p_peaked":
        x[rng.integers(0, v, 5)] += 12.0
    hist = rng.integers(0, v, 256).astype(np.int32)
    return x, hist, 200


def _classify(text):
    op = text.split()[0] if text else ""
    if op.startswith(("atom.shared", "red.shared")):
        return "atom64" if op.endswith(("64", ".u64", ".s64", ".b64")) else "atom32"
    if op.startswith(("ld.shared", "st.shared")):
        return "smem"
    if op.startswith(("ld.", "st.", "atom.", "red.")):
        return "gmem"
    if op.startswith("shfl"):
        return "shfl"
    return "alu"


class Profile:
    """Counters filled while the wrapped kernel runs."""

    def __init__(self, compiled, block):
        self.T = block
        self.k = compiled
        self.split = next(i for i, st in enumerate(compiled.kt.body)
                          if st.op == "ld" and "is_last" in str(st.operands))
        self.counts = {}          # (phase, global block) -> Counter
        self.hot = {}             # (phase, global block) -> Counter of addresses (64-bit atomics)
        self.path = {}            # (phase, global block) -> Counter of instructions per warp

    def phase(self, pc):
        return "last" if pc > self.split else "block"

    def _warps(self, st, m):
        lanes = st.all_tids if m is None else np.flatnonzero(m)
        return lanes // 32

    def add(self, st, pc, cls, m, addr_get=None):
        w = self._warps(st, m)
        if w.size == 0:
            return
        per_block = self.T // 32
        uw = np.unique(w)
        blocks = uw // per_block
        gblocks = self._gblock(st, blocks)
        ph = self.phase(pc)
        for b, n in zip(*np.unique(gblocks, return_counts=True)):
            self.counts.setdefault((ph, int(b)), Counter())[cls] += int(n)
        for b, wi in zip(gblocks, uw % per_block):
            self.path.setdefault((ph, int(b)), Counter())[int(wi)] += 1
        if addr_get is None:
            return
        tids = st.all_tids if m is None else np.flatnonzero(m)
        addr = memops._addr_for(addr_get, st, tids, m).astype(np.int64)
        key = w.astype(np.int64) * (1 << 32) + addr
        uk, cnt = np.unique(key, return_counts=True)
        worst = np.zeros(uw.size, np.int64)
        np.maximum.at(worst, np.searchsorted(uw, uk >> 32), cnt)
        if cls == "atom32":
            for b, c in zip(gblocks, worst):
                self.counts[(ph, int(b))]["conflict"] += int(c)
        if cls == "atom64":
            bl = self._gblock(st, tids // self.T)
            for b in np.unique(bl):
                a, c = np.unique(addr[bl == b], return_counts=True)
                hc = self.hot.setdefault((ph, int(b)), Counter())
                for ai, ci in zip(a, c):
                    hc[int(ai)] += int(ci)

    @staticmethod
    def _gblock(st, blocks):
        c = st.ctaids[blocks]
        return c[:, 0]

    def wrap(self):
        for pc, (op, stmt) in enumerate(zip(self.k.ops, self.k.kt.body)):
            if op.kind != executor.NORMAL or op.fn is None:
                continue
            cls = _classify(op.text)
            get = None
            if cls in ("atom32", "atom64"):
                o = stmt.operands[0] if stmt.op == "red" else stmt.operands[1]
                get, _ = memops._address(self.k.ctx, o, "shared")
            op.fn = self._wrapped(op.fn, pc, cls, get)

    def _wrapped(self, fn, pc, cls, get):
        def run(st, m):
            self.add(st, pc, cls, m, get)
            return fn(st, m)
        return run

    def barrier_hook(self):
        orig = executor._barrier
        prof = self

        def hooked(k, op, st, geo, waiting, parked, active, arr):
            if k is prof.k:
                per = geo.T // 32
                w = np.unique(np.flatnonzero(arr) // 32)
                gb = prof._gblock(st, w // per)
                for b, n in zip(*np.unique(gb, return_counts=True)):
                    prof.counts.setdefault((prof.phase(op.pc), int(b)), Counter())["bar"] += \
                        n / per
            return orig(k, op, st, geo, waiting, parked, active, arr)
        return orig, hooked

    def summary(self):
        out = {}
        for ph in ("block", "last"):
            rows = {b: c for (p, b), c in self.counts.items() if p == ph}
            if not rows:
                continue
            if ph == "block":
                b = max(rows, key=lambda i: _cycles(rows[i], self.hot.get((ph, i))))
            else:
                b = max(rows, key=lambda i: sum(rows[i].values()))
            c = rows[b]
            hot = self.hot.get((ph, b))
            r = {cl: int(round(c.get(cl, 0))) for cl in CLASSES}
            r["warp_instr"] = sum(r[cl] for cl in CLASSES if cl != "bar")
            r["conflict"] = int(c.get("conflict", 0))
            r["a64_hot"] = max(hot.values()) if hot else 0
            r["warp_path"] = max(self.path[(ph, b)].values())
            r["cycles"] = int(_cycles(c, hot))
            r["block_id"] = b
            out[ph] = r
        return out


def _cycles(c, hot):
    wi = sum(c.get(cl, 0) for cl in CLASSES if cl != "bar")
    a64 = max(hot.values()) if hot else 0
    return wi / IPC + c.get("bar", 0) * C_BAR + a64 * C_CAS + c.get("conflict", 0) * C_CONF


def profile_chain(chain, v=128256, spec=None):
    """Emulate one launch of ``chain``; returns (summary dict, info words)."""
    spec = spec or S.SamplingSpec(block=512, top=64, target="sm_90")
    mod = Module.from_ptx(S.build(spec))
    fn = mod[spec.kernel_name]
    prof = Profile(fn.compiled, spec.block)
    prof.wrap()
    orig, hooked = prof.barrier_hook()
    x, hist, pos = bench_inputs(v, chain)
    geo = S.launch_geometry(spec, v)
    out = DeviceArray.from_numpy(np.full(1, -7, np.int32))
    info = DeviceArray.from_numpy(np.full(S.INFO_WORDS, -7, np.int32))
    args = [DeviceArray.from_numpy(x), v, DeviceArray.from_numpy(hist),
            DeviceArray.from_numpy(np.array([pos], np.int32)),
            DeviceArray.from_numpy(S.pack_params(seed=1234, **CHAINS[chain])), out, 1,
            DeviceArray.from_numpy(np.zeros(v, np.float32)), info,
            DeviceArray.from_numpy(np.zeros(S.scratch_words(spec, v), np.uint64)),
            DeviceArray.from_numpy(np.zeros(1, np.uint32))]
    executor._barrier = hooked
    try:
        launch(fn, geo.grid, geo.block, *args, shared=geo.shared)
    finally:
        executor._barrier = orig
    return prof.summary(), info.to_numpy()


def model_us(summary):
    return T0_US + sum(r["cycles"] for r in summary.values()) / (F_GHZ * 1e3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--chains", default=",".join(CHAINS))
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args(argv)
    res = {}
    cols = ("warp_instr", "warp_path", "alu", "smem", "gmem", "shfl", "atom32", "atom64", "bar",
            "conflict", "a64_hot", "cycles")
    print(f"vocab {args.vocab}; per phase: warp-instructions by class, barriers, atomics")
    print(f"{'chain':13s} {'phase':5s} " + " ".join(f"{c:>9s}" for c in cols) + "  model µs")
    for name in args.chains.split(","):
        summ, info = profile_chain(name, args.vocab)
        res[name] = dict(phases=summ, info=[int(i) for i in info], model_us=model_us(summ))
        for ph, r in summ.items():
            print(f"{name:13s} {ph:5s} " + " ".join(f"{r[c]:9d}" for c in cols)
                  + (f"  {model_us(summ):7.1f}" if ph == "last" else ""))
        print(f"{'':13s} info {list(int(i) for i in info)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
