"""Time candidate kernel configs on the present GPU and keep the fastest per
call in the user's tuning cache (:mod:`ptxgen.kernels.tuning`), which the
family's selector then prefers over the shipped table on this device.

The command, ``python -m ptxgen tune``, is :mod:`ptxgen.llm.tune` (it reads
a model's shapes); this module times the calls it is given.

For ``gemv`` the calls are the weight shapes of ``--model`` (every distinct
GEMV of a GGUF file's decode step, with its weight type and epilogue) or, by
default, those of an 8B Llama: for each, :func:`gemv.candidate_configs`
(the selected config and its neighbours) are timed in alternating rounds,
each a CUDA graph of launches over copies of random valid weights larger
than the L2, as the decode step reads them.
For ``flash_decode`` the call is the model's attention shape (8B: 32 query
and 8 KV heads of 128, f16 cache), with and without ``early_kv``; each
candidate (the tuned config and its neighbours in warps, unroll, the
per-SM cap, the round-robin threshold and the L1 bypass threshold) is timed
at 1K, 4K and 16K keys (CUDA graphs of its launches, as for the GEMV) and
ranked by the sum.

``--qtypes Q4_0,Q5_K`` tunes the 8B shapes with every matrix of those weight
types (plain GEMVs, the shapes ``make bench`` reports), and ``--search``
walks further than the neighbours: a greedy descent over one knob at a time
(rows, stages, grid cap, pieces, dot, interleave, bulk), each move kept when
it is faster, until no move is (:func:`search_gemv`).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from .timing import graph_timer

from ptxgen.kernels import gemv, tuning

__all__ = ["LLAMA_8B", "qtype_calls", "tune_gemv", "search_moves", "flash_candidates",
           "tune_flash"]

#: (qtype, m, k, epilogue) of an 8B Llama's decode step
LLAMA_8B = [("Q4_K", 6144, 4096, "rope"), ("Q4_K", 4096, 4096, "residual"),
            ("Q4_K", 14336, 4096, "swiglu"), ("Q4_K", 4096, 14336, "residual"),
            ("Q6_K", 128256, 4096, "none")]


def qtype_calls(qtypes) -> list:
    """The 8B shapes (QKV stack, attention output, FFN up, FFN down, output)
    with every matrix of each of ``qtypes``, plain GEMVs."""
    shapes = [(m, k) for _, m, k, _ in LLAMA_8B]
    return [(q, m, k, "none") for q in qtypes for m, k in shapes]


#: the values :func:`search_moves` tries per knob
SEARCH = {"rows": (1, 2, 4, 8), "stages": (0, 2, 3, 4, 6), "max_ctas": (132, 264, 396, 528, 1056,
                                                                        2112),
          "pieces": (0, 1, 2, 4, 8), "dot": ("fma", "dp4a"), "interleave": (False, True),
          "bulk": (False, True), "min_ctas": (0, 2)}


def search_moves(spec, config, m: int, sm_count: int | None = None) -> list:
    """Every config one knob away from ``config`` (values of :data:`SEARCH`)
    whose plan builds for ``spec`` at ``m`` rows, its CTAs spread over
    ``sm_count`` SMs as the selector spreads them."""
    import attrs
    config = attrs.evolve(config, per_sm=0)
    out = []
    for knob, values in SEARCH.items():
        for v in values:
            if getattr(config, knob) == v:
                continue
            extra = {"ahead": 0} if knob == "stages" else {}
            try:
                c = gemv.tuning.balanced(spec, attrs.evolve(config, **{knob: v}, **extra),
                                         m, sm_count)
                gemv.GemvPlan(spec, c)
            except ValueError:
                continue
            if c not in out:
                out.append(c)
    return out


def _spec(qtype, m, k, epi, target, hp_heads, pdl=False):
    rope = hp_heads if epi == "rope" else ()
    return gemv.GemvSpec(qtype, k, epilogue=epi, rope=rope, target=target, pdl=pdl)


#: weight bytes a GEMV candidate rotates over (copies of the matrix), so its
#: reads come from DRAM as in a decode step, not from the 50 MB L2
L2_DEFEAT_BYTES = 256 << 20


def tune_gemv(calls, rounds: int = 5, reps: int = 50, out=sys.stdout, search: bool = False,
              max_steps: int = 6) -> list:
    """Time every candidate of every call (with ``search``, a greedy descent
    from the selected config over :func:`search_moves`, at most
    ``max_steps`` moves); store the winners; return rows ``(call, config,
    us, default_us)``."""
    from ptxgen.kernels.quants import quantize
    from . import DeviceArray, Stream, get_device
    from .launch import launch
    from .module import Module
    dev = get_device()
    target, sms, name = dev.target, dev.attribute("MULTIPROCESSOR_COUNT"), dev.name
    from ptxgen.kernels.spec_fields import has_griddepcontrol
    pdl = has_griddepcontrol(target)           # as the decode step launches them
    rng = np.random.default_rng(0)
    stream = Stream()
    rows = []
    for qtype, m, k, epi in calls:
        heads = (128, (m - 2048) // 128, 8) if epi == "rope" else ()
        spec = _spec(qtype, m, k, epi, target, heads, pdl)
        if epi == "rope" and spec.rope_rows != m:
            print(f"skip {qtype} {m}x{k} rope: not an 8-KV-head stack", file=out)
            continue
        w0 = [quantize(rng.standard_normal((m, k)).astype(np.float32) * 0.02, qtype)
              for _ in range(spec.n_mats)]
        copies = max(1, -(-L2_DEFEAT_BYTES // sum(a.nbytes for a in w0)))
        ws = [[DeviceArray.from_numpy(a) for a in w0] for _ in range(copies)]
        x = DeviceArray.from_numpy(rng.standard_normal(k).astype(np.float32))
        y = DeviceArray.empty((m,), np.float32)
        extra = ()
        if epi == "residual":
            extra = (DeviceArray.from_numpy(np.zeros(m, np.float32)),)
        elif epi == "rope":
            d, nq, nkv = heads
            extra = (DeviceArray.from_numpy(np.ones((d // 2, 2), np.float32)),
                     DeviceArray.from_numpy(np.zeros(8, np.int32)),
                     DeviceArray.empty((nkv, 16, d), np.float16),
                     DeviceArray.empty((nkv, 16, d), np.float16), 16)
        built = {}

        def launcher(cfg):
            """The config's timer: a graph of ``reps`` launches over the copies."""
            if cfg not in built:
                plan = gemv.GemvPlan(spec, cfg)
                fn = Module.from_ptx(gemv.build(plan).to_ptx()).function(plan.kernel_name)
                geo = gemv.launch_geometry(plan, m)
                if geo.shared:
                    fn.require_dynamic_shared(geo.shared)

                def go(i, fn=fn, g=geo.grid, b=geo.block, s=geo.shared, rpc=geo.args["rpc"]):
                    launch(fn, g, b, *ws[i % copies], x, *extra, y, m, rpc, shared=s,
                           stream=stream, pdl=spec.pdl)
                built[cfg] = graph_timer(go, stream, reps)
            return built[cfg]

        def timed(cands, n_rounds):
            times = [[] for _ in cands]
            for _ in range(n_rounds):
                for i, c in enumerate(cands):
                    times[i].append(launcher(c)())
            return [statistics.median(t) for t in times]

        cands = gemv.candidate_configs(spec, m, sms)
        med = timed(cands, rounds)
        best = min(range(len(cands)), key=med.__getitem__)
        if search:
            cur, cur_us, tried = cands[best], med[best], set(cands)
            for _ in range(max_steps):
                moves = [c for c in search_moves(spec, cur, m, sms) if c not in tried]
                if not moves:
                    break
                tried.update(moves)
                mt = timed(moves, 2)
                j = min(range(len(moves)), key=mt.__getitem__)
                if mt[j] >= cur_us * 0.99:
                    break
                conf = timed([cur, moves[j]], rounds)     # confirm, alternating
                if conf[1] >= conf[0]:
                    break
                cur, cur_us = moves[j], conf[1]
            cands, med = [cands[0], cur], timed([cands[0], cur], rounds)
            best = 1 if med[1] < med[0] else 0
        call = gemv.tuning.call_of(spec, m)
        import attrs
        cfg = attrs.asdict(cands[best])
        cfg.pop("per_sm")            # derived from the grid and the SMs at selection
        tuning.store_user_config("gemv", name, call, cfg,
                                 {"us": round(med[best], 3), "default_us": round(med[0], 3),
                                  "date": time.strftime("%Y-%m-%d")})
        print(f"{qtype} {m}x{k} {epi:8s} default {med[0]:8.2f} us  best {med[best]:8.2f} us "
              f"({len(cands)} configs){'  (default kept)' if best == 0 else ''}", file=out)
        if best:
            print(f"    {cfg}", file=out)
        rows.append(((qtype, m, k, epi), cands[best], med[best], med[0]))
    return rows


def flash_candidates(spec) -> list:
    """The tuned config of ``spec`` and its neighbours that build."""
    import attrs
    from ptxgen.kernels import flash_decode as fd
    base = fd.select_config(spec)
    moves = [dict(warps=4), dict(warps=8), dict(unroll=2), dict(unroll=1),
             dict(per_sm=0), dict(per_sm=2)]
    if base.mma:
        moves += [dict(interleave=0), dict(interleave=1), dict(bypass_from=0),
                  dict(bypass_from=6), dict(l1_bypass=False, bypass_from=0)]
    out = [base]
    for mv in moves:
        try:
            c = attrs.evolve(base, **mv)
            fd.FlashDecodePlan(spec, c)
        except ValueError:
            continue
        if c not in out:
            out.append(c)
    return out


def tune_flash(calls, rounds: int = 5, reps: int = 50, out=sys.stdout) -> list:
    """Time the candidates of each attention shape (with and without
    early_kv); store the winners; return rows ``(spec, config, us, default_us)``."""
    import attrs
    from ptxgen.kernels import flash_decode as fd
    from ptxgen.kernels.spec_fields import has_griddepcontrol
    from . import DeviceArray, Stream, get_device
    from .ops_decode import flash_decode
    dev = get_device()
    rng = np.random.default_rng(0)
    stream = Stream()
    rows = []
    lengths = (1024, 4096, 16384)
    for n_q, n_kv, d in calls:
        cap = max(lengths)
        q = DeviceArray.from_numpy(rng.standard_normal((n_q, d)).astype(np.float32))
        kc = DeviceArray.from_numpy(rng.standard_normal((n_kv, cap, d)).astype(np.float16))
        vc = DeviceArray.from_numpy(rng.standard_normal((n_kv, cap, d)).astype(np.float16))
        o = DeviceArray.empty((n_q, d), np.float32)
        lens = {L: DeviceArray.from_numpy(np.array([L], np.int32)) for L in lengths}
        for early in (False, True):
            spec = fd.FlashDecodeSpec(head_dim=d, group=n_q // n_kv, early_kv=early,
                                      target=dev.target, pdl=has_griddepcontrol(dev.target))
            cands = flash_candidates(spec)
            timers = [[graph_timer(lambda i, kw=attrs.asdict(c), L=L: flash_decode(
                q, kc, vc, lens[L], out=o, early_kv=early, stream=stream, **kw),
                stream, reps) for L in lengths] for c in cands]
            times = [[] for _ in cands]
            for _ in range(rounds):
                for i, per_len in enumerate(timers):
                    times[i].append(sum(t() for t in per_len))
            med = [statistics.median(t) for t in times]
            best = min(range(len(cands)), key=med.__getitem__)
            tuning.store_user_config("flash_decode", dev.name, fd.tuning.call_of(spec),
                                     attrs.asdict(cands[best]),
                                     {"us_sum": round(med[best], 3),
                                      "default_us_sum": round(med[0], 3),
                                      "lengths": list(lengths),
                                      "date": time.strftime("%Y-%m-%d")})
            print(f"flash_decode {n_q}/{n_kv} heads d{d} early_kv={early}: default "
                  f"{med[0]:.2f} us, best {med[best]:.2f} us (sum over L = "
                  f"{'/'.join(map(str, lengths))}; {len(cands)} configs)", file=out)
            rows.append((spec, cands[best], med[best], med[0]))
    return rows
