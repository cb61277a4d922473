"""GPU benchmark of the decode-step kernels beside their torch equivalents.

Both sides are replayed from CUDA graphs: ours captured with
:class:`ptxgen.driver.capture`, torch's with ``torch.cuda.CUDAGraph``; each
graph holds ``REPS`` calls and a timing is the median over ``REPEATS``
replays, divided by ``REPS``.  A device-to-device copy measured in the same
run gives the bandwidth ceiling (bytes read + written per second).

``python -m benchmarks.bench_decode`` prints the table; :func:`run_all`
returns the numbers (microseconds, TB/s); ``--flash`` runs :func:`bench_flash`
instead (flash decode only: fused vs separate combine vs SDPA, with numerics).
"""

from __future__ import annotations

import json
import sys

import attrs
import numpy as np

from .bench_common import graph_us, torch_graph_us

REPS = 10
REPEATS = 7
#: flash-decode variants (``ops.flash_decode`` keyword arguments) timed beside the
#: default (the tuned config: the tensor-core split; splits from the driver's
#: occupancy, programmatic dependent launch on sm_90+); ``no_pdl``: the same two
#: launches fully serialised
FD_VARIANTS = {
    # the default is the tensor-core split (8 warps, 1 chunk of 16 keys a trip,
    # dealt round robin from two rounds on)
    "contiguous": dict(interleave=0),
    "w8u2": dict(unroll=2, interleave=0),             # the default before
    "no_pdl": dict(pdl=False),
    "early_kv": dict(early_kv=True),
    "w4u1": dict(warps=4, unroll=1),
    # the CUDA-core split: its default (w4u3p) and with early_kv
    "cuda_cores": dict(mma=False, warps=4, unroll=3),
    "cuda_cores_early_kv": dict(mma=False, warps=4, unroll=3, early_kv=True),
}


def _ours(fn, stream):
    """Median µs per call of ``fn(stream)`` replayed from a ptxgen graph."""
    return graph_us(fn, stream, REPS, REPEATS)


def _torch(fn):
    """Median µs per call of ``fn()`` replayed from a torch CUDA graph."""
    return torch_graph_us(fn, REPS, REPEATS)


def _dev(t):
    from ptxgen.driver import as_device_array
    return as_device_array(t)


def _i32(torch, v):
    return torch.tensor([v], dtype=torch.int32, device="cuda")


def run_all(verbose: bool = True) -> dict:
    """Run every benchmark; returns ``{name: {ours_us, torch_us, ...}}``."""
    import torch
    import torch.nn.functional as F

    from ptxgen.driver import Stream, get_device
    from ptxgen.driver import ops_decode as ops

    dev = get_device()
    stream = Stream(non_blocking=True)
    res: dict = {"device": dev.name, "sm_count": dev.sm_count}

    # copy ceiling: 1 GiB device-to-device, read + write
    from .bench_common import copy_bandwidth
    bw, t_copy = copy_bandwidth()
    copy_bw = bw / 1e12
    res["copy"] = {"copy_1gib_us": t_copy * 1e6, "tbps": copy_bw}

    def rec(name, ours, theirs, nbytes=None, **extra):
        r = {"ours_us": ours, "torch_us": theirs, "ratio": ours / theirs, **extra}
        if nbytes:
            r["ours_tbps"] = nbytes / (ours * 1e-6) / 1e12
            r["ours_frac_copy"] = r["ours_tbps"] / copy_bw
        res[name] = r
        if verbose:
            print(f"  {name}: ours {ours:.2f} us, torch {theirs:.2f} us", flush=True)

    n_q, n_kv, d, cap = 32, 8, 128, 32768

    def bench_rmsnorm():
        # RMSNorm
        for rows, n in ((1, 4096), (1, 8192), (4096, 4096)):
            x = torch.randn(rows, n, device="cuda")
            w = torch.randn(n, device="cuda")
            o = torch.empty_like(x)
            dx, dw, do = _dev(x), _dev(w), _dev(o)
            ours = _ours(lambda s: ops.rmsnorm(dx, dw, 1e-5, out=do, stream=s), stream)
            theirs = _torch(lambda: F.rms_norm(x, (n,), w, 1e-5))
            rec(f"rmsnorm_{rows}x{n}", ours, theirs, nbytes=2 * rows * n * 4)
            sweep = {}
            for b in (256, 512, 1024):
                sweep[f"b{b}"] = _ours(lambda s: ops.rmsnorm(dx, dw, 1e-5, out=do, block=b,
                                                            stream=s), stream)
            # without programmatic dependent launch (torch's graph has none)
            sweep["no_pdl"] = _ours(lambda s: ops.rmsnorm(dx, dw, 1e-5, out=do, pdl=False,
                                                         stream=s), stream)
            res[f"rmsnorm_{rows}x{n}"]["variants_us"] = sweep
            if verbose:
                print("    variants:", {k: round(v, 2) for k, v in sweep.items()}, flush=True)

    def bench_flash_decode():
        # flash decode: 32 q / 8 kv heads, d=128, f16 cache of capacity 32768
        kc = torch.randn(n_kv, cap, d, device="cuda", dtype=torch.float16)
        vc = torch.randn(n_kv, cap, d, device="cuda", dtype=torch.float16)
        q = torch.randn(n_q, d, device="cuda")
        o = torch.empty(n_q, d, device="cuda")
        dq, dk, dv, do = _dev(q), _dev(kc), _dev(vc), _dev(o)
        step_knobs = {"early_kv": True}     # as Model runs it (its tuned config)
        for L in (1024, 4096, 16384, 32768):
            lens = _i32(torch, L)
            dl = _dev(lens)
            ours = _ours(lambda s: ops.flash_decode(dq, dk, dv, dl, out=do, stream=s), stream)
            qt = q.half().view(1, n_q, 1, d)
            kt = kc[:, :L].unsqueeze(0).contiguous()
            vt = vc[:, :L].unsqueeze(0).contiguous()
            theirs = _torch(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
            rec(f"flash_decode_L{L}", ours, theirs, nbytes=2 * n_kv * L * d * 2)
            # the configuration the decode step runs (early_kv: the length and
            # the first trip read before the PDL wait; the call before in this
            # chain, a combine, writes nothing the split reads)
            step = _ours(lambda s: ops.flash_decode(dq, dk, dv, dl, out=do, stream=s,
                                                    **step_knobs), stream)
            rec(f"flash_decode_step_L{L}", step, theirs, nbytes=2 * n_kv * L * d * 2)
            # variants (combine, merge, split kernel) at the same length
            sweep = {}
            for name, kw in FD_VARIANTS.items():
                try:
                    sweep[name] = _ours(lambda s: ops.flash_decode(
                        dq, dk, dv, dl, out=do, stream=s, **kw), stream)
                except Exception as e:          # a variant that does not fit this device
                    sweep[name] = repr(e)
            if verbose:
                print("    variants:", {k: (round(v, 2) if isinstance(v, float) else v)
                                        for k, v in sweep.items()}, flush=True)
            res[f"flash_decode_L{L}"]["variants_us"] = sweep
            del kt, vt

    def bench_rope():
        # RoPE (Llama-3 scaling, neox) on 32 q + 8 k heads of 128
        qr = torch.randn(n_q, d, device="cuda")
        kr = torch.randn(n_kv, d, device="cuda")
        pos = _i32(torch, 1234)
        dqr, dkr, dpos = _dev(qr), _dev(kr), _dev(pos)
        scal = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192)
        ours = _ours(lambda s: ops.rope(dqr, dkr, dpos, theta=500000.0, scaling=scal, stream=s),
                     stream)
        inv = torch.tensor(_rope_freqs(), device="cuda")

        def torch_rope():
            ang = pos.float() * inv
            c, s_ = torch.cos(ang), torch.sin(ang)
            for t in (qr, kr):
                a, b = t[:, :64], t[:, 64:]
                t.copy_(torch.cat((a * c - b * s_, a * s_ + b * c), dim=-1))
        rec("rope_32q_8k_d128", ours, _torch(torch_rope))

    def bench_swiglu():
        # SwiGLU 14336
        g = torch.randn(14336, device="cuda")
        u = torch.randn(14336, device="cuda")
        so = torch.empty_like(g)
        dg, du, dso = _dev(g), _dev(u), _dev(so)
        rec("swiglu_14336", _ours(lambda s: ops.swiglu(dg, du, out=dso, stream=s), stream),
            _torch(lambda: F.silu(g) * u))

    def bench_embedding():
        # embedding: 1024-row tables of 4096 (random bytes: timing only)
        tok = _i32(torch, 517)
        tok64 = tok.long()
        dtok = _dev(tok)
        eo = torch.empty(4096, device="cuda")
        deo = _dev(eo)
        tf16 = torch.randn(1024, 4096, device="cuda", dtype=torch.float16)
        formats = (("Q4_K", 16 * 144), ("Q6_K", 16 * 210), ("Q8_0", 128 * 34), ("f16", 0))
        for qt_name, bpr in formats:
            if qt_name == "f16":
                table = _dev(tf16)
            else:
                table = _dev(torch.randint(0, 255, (1024 * bpr,), device="cuda",
                                           dtype=torch.uint8))
            ours = _ours(lambda s: ops.embedding(table, qt_name, dtok, out=deo, n=4096, stream=s),
                         stream)
            rec(f"embedding_{qt_name}_4096", ours,
                _torch(lambda: torch.index_select(tf16, 0, tok64).float()))

    def bench_kv_append():
        # KV append (8 kv heads x 128, f16 cache)
        kk = torch.randn(n_kv, d, device="cuda")
        vv = torch.randn(n_kv, d, device="cuda")
        kc = torch.zeros(n_kv, 4096, d, device="cuda", dtype=torch.float16)
        vc = torch.zeros_like(kc)
        pos = _i32(torch, 1234)
        dkk, dvv, dk, dv, dpos = _dev(kk), _dev(vv), _dev(kc), _dev(vc), _dev(pos)
        pos64 = pos.long()
        rec("kv_append_8x128", _ours(lambda s: ops.kv_append(dkk, dvv, dk, dv, dpos, stream=s),
                                     stream),
            _torch(lambda: (kc.index_copy_(1, pos64, kk.half().unsqueeze(1)),
                            vc.index_copy_(1, pos64, vv.half().unsqueeze(1)))))

    def bench_argmax():
        # argmax over 128256
        xl = torch.randn(128256, device="cuda")
        am = torch.empty(1, device="cuda", dtype=torch.int32)
        dxl, dam = _dev(xl), _dev(am)
        rec("argmax_128256", _ours(lambda s: ops.argmax(dxl, out=dam, stream=s), stream),
            _torch(lambda: torch.argmax(xl)))

    for fn_ in (bench_rmsnorm, bench_flash_decode, bench_rope, bench_swiglu, bench_embedding,
                bench_kv_append, bench_argmax):
        try:
            fn_()
        except Exception:                      # keep going: report what failed
            import traceback
            res.setdefault("errors", []).append(fn_.__name__)
            print(f"!! {fn_.__name__} failed:", traceback.format_exc(), flush=True)

    if verbose:
        print(format_table(res))
    return res


def _split_only(dq, dk, dv, dl, do, stream, **kw):
    """A launch function of the split kernel alone (partials only: the floor
    that the combine adds to)."""
    import math

    from ptxgen.kernels import flash_decode as fd

    from ptxgen.driver import ops_decode as ops
    from ptxgen.driver.device import get_device
    from ptxgen.driver.launch import launch
    n_kv, cap, d = dk.shape
    n_q = dq.size // d
    spec = fd.with_overrides(fd.FlashDecodeSpec(head_dim=d, group=n_q // n_kv,
                                                target=ops.device_target()), kw)
    fn = ops._module(fd.build, spec).function(spec.split_name)
    S = fd.choose_splits(spec, get_device().sm_count, n_kv, cap,
                         ops._resident(fn, 32 * spec.warps, spec.dynamic_shared))
    po = ops._workspace(("fd_o", n_q, S, d), (n_q, S, d), np.float32)
    pml = ops._workspace(("fd_ml", n_q, S), (n_q, S, 2), np.float32)
    split, _ = fd.launch_geometry(spec, n_kv, S)
    return lambda s: launch(fn, split.grid, split.block, dq, dk, dv, dl, po, pml, cap,
                            1.0 / math.sqrt(d), shared=split.shared, stream=s)


def bench_flash(verbose: bool = True, extra: dict | None = None) -> dict:
    """Flash decode only (32 q / 8 KV heads, d = 128, f16 cache of 32768): the
    default (split and combine, two launches) and the split kernel alone, beside SDPA (timed before and
    after ours) at L = 1024, 4096, 16384, 32768; every output is checked
    against float64 attention after its timed replays (``err``: max error
    over the largest output).  ``extra``: more variants, name -> knobs of
    :func:`ops.flash_decode`."""
    import torch
    import torch.nn.functional as F

    from ptxgen.driver import Stream, get_device
    from ptxgen.kernels import flash_decode as fd
    from ptxgen.driver import ops_decode as ops

    dev = get_device()
    stream = Stream(non_blocking=True)
    res: dict = {"device": dev.name, "sm_count": dev.sm_count}
    from .bench_common import copy_bandwidth
    copy_bw = copy_bandwidth()[0] / 1e12
    res["copy_tbps"] = copy_bw
    n_q, n_kv, d, cap = 32, 8, 128, 32768
    torch.manual_seed(0)
    kc = torch.randn(n_kv, cap, d, device="cuda", dtype=torch.float16)
    vc = torch.randn(n_kv, cap, d, device="cuda", dtype=torch.float16)
    q = torch.randn(n_q, d, device="cuda") * 2
    o = torch.empty(n_q, d, device="cuda")
    kh, vh, qh = kc.cpu().numpy(), vc.cpu().numpy(), q.cpu().numpy()
    dq, dk, dv, do = _dev(q), _dev(kc), _dev(vc), _dev(o)
    variants = {"sep": {}, "sep_no_pdl": dict(pdl=False), "sep_early": dict(early_kv=True),
                **(extra or {})}
    fields = attrs.fields_dict(fd.FlashDecodeConfig).keys()
    for name, kw in variants.items():             # the JIT's registers, occupancy, splits
        # config fields (ops also takes early_kv and launch knobs: pdl, blocks_per_sm)
        spec = fd.with_overrides(
            fd.FlashDecodeSpec(target=ops.device_target(), early_kv=kw.get("early_kv", False)),
            {k: v for k, v in kw.items() if k in fields})
        fn = ops._module(fd.build, spec).function(spec.split_name)
        bps = kw.get("blocks_per_sm") or ops._resident(fn, 32 * spec.warps, spec.dynamic_shared)
        res[name] = {"regs": fn.num_regs, "blocks_per_sm": bps,
                     "n_splits": fd.choose_splits(spec, dev.sm_count, n_kv, cap, bps)}
    if verbose:
        print(json.dumps({k: res[k] for k in variants}), flush=True)
    for L in (1024, 4096, 16384, 32768):
        dl = _dev(_i32(torch, L))
        ref = fd.reference(qh, kh, vh, L)
        qt = q.half().view(1, n_q, 1, d)
        kt = kc[:, :L].unsqueeze(0).contiguous()
        vt = vc[:, :L].unsqueeze(0).contiguous()

        def sdpa():
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        r = {"sdpa_us": _torch(sdpa)}
        for name, kw in variants.items():
            o.fill_(float("nan"))
            r[name + "_us"] = _ours(lambda s: ops.flash_decode(dq, dk, dv, dl, out=do, stream=s,
                                                               **kw), stream)
            torch.cuda.synchronize()
            out = o.cpu().numpy().astype(np.float64)
            r[name + "_err"] = (float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
                                if np.all(np.isfinite(out)) else float("inf"))
        r["split_only_us"] = _ours(_split_only(dq, dk, dv, dl, do, stream), stream)
        r["sdpa_us_2"] = _torch(sdpa)
        nb = 2 * n_kv * L * d * 2
        r["sep_frac_copy"] = nb / (r["sep_us"] * 1e-6) / 1e12 / copy_bw
        r["sdpa_frac_copy"] = nb / (min(r["sdpa_us"], r["sdpa_us_2"]) * 1e-6) / 1e12 / copy_bw
        res[f"L{L}"] = r
        if verbose:
            print(f"L={L}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()), flush=True)
        del kt, vt
    return res


def _rope_freqs():
    from ptxgen.kernels import rope
    spec = rope.RopeSpec(theta=500000.0, scaling="llama3")
    return rope.inv_freq(spec).astype(np.float32).tolist()


def format_table(res: dict) -> str:
    lines = [f"device: {res.get('device')}  ({res.get('sm_count')} SMs); "
             f"copy {res['copy']['tbps']:.2f} TB/s (r+w)",
             f"{'kernel':28s} {'ours µs':>9s} {'torch µs':>9s} {'ours/torch':>10s} "
             f"{'TB/s':>6s} {'of copy':>8s}"]
    for name, r in res.items():
        if not isinstance(r, dict) or "ours_us" not in r:
            continue
        bw = f"{r['ours_tbps']:.2f}" if "ours_tbps" in r else ""
        fr = f"{100 * r['ours_frac_copy']:.0f}%" if "ours_frac_copy" in r else ""
        lines.append(f"{name:28s} {r['ours_us']:9.2f} {r['torch_us']:9.2f} "
                     f"{r['ratio']:10.2f} {bw:>6s} {fr:>8s}")
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    flash = "--flash" in args
    args = [a for a in args if a != "--flash"]
    out = bench_flash() if flash else run_all()
    if args:
        with open(args[0], "w") as f:
            json.dump(out, f, indent=1)
