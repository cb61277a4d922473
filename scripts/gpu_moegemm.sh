#!/usr/bin/env bash
# The experts' grouped GEMM of a prompt chunk (issue 56, item 2) on the GPU,
# about two minutes on an H100 (most of it the sweep's module loads):
#  1. the GPU tests of the grouping and the grouped GEMM (GPU, and emulator
#     and GPU compared);
#  2. one layer's MoE FFN at the Qwen3-30B-A3B shape (hidden 2048, 128
#     experts, 8 used, expert FFN 768; gate/up Q4_K, down Q6_K; random blocks
#     made in memory) for chunks of 64, 128 and 512 rows, the ids random
#     (8 distinct experts a token): the per-token grouped GEMV (gate/up with
#     SwiGLU, down) against the grouping and the grouped GEMM (gate, up with
#     SwiGLU, down), each timed as a CUDA graph (median of 5 replays of 10),
#     with the two paths' outputs compared; the router and the weighted sum,
#     the same on both paths, are not timed.  The rows from which the GEMM
#     wins are kernels/tuning/moe_ffn.json's rows_min.  Then, per chunk, a
#     sweep of the grouped GEMM's configs (CANDIDATES: tiles, ring depth,
#     x_ahead, packed grid), gate + up timed together and down alone, each checked
#     against the table config's output; "SUMMARY ... best" lines give the
#     fastest of each with its time, for moe_ffn.json's rows; and the
#     chunk's router at 1 to 16 tokens a CTA (moe_ffn.json's router_tokens),
#     each checked bit for bit against 1;
#  3. the tiny qwen3moe model's GPU test (prefill buckets 64 and 128, which
#     take the grouped GEMM by the table, against token-by-token decode).
# One summary line per number ("SUMMARY"); logs in $OUT (or ./gpu-out); every
# candidate's time in moegemm_bench.log.
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

rc=0
timeout 40 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="-rfE" -m gpu \
  tests/kernels/test_moe_gemm.py > "$OUT/moegemm_tests.log" 2>&1 || rc=$?
echo "SUMMARY moe gemm kernel gpu tests rc=$rc: $(grep -E "passed|failed" "$OUT/moegemm_tests.log" | tail -1)"
grep -E "^FAILED|^ERROR" "$OUT/moegemm_tests.log" | head -10 || true

rc=0
timeout 240 python3 - > "$OUT/moegemm_bench.log" 2>&1 <<'PY' || rc=$?
import statistics

import attrs
import numpy as np

from ptxgen.driver import Event
from ptxgen.driver.backend import get_backend
from ptxgen.kernels import gemm as GM
from ptxgen.kernels import tuning
from ptxgen.kernels.moe import expert_gemm, expert_gemv, group, router
from ptxgen.kernels.quants.qtypes import qtype_of
from ptxgen.llm.lowering.common import TensorInfo, Tuning
from ptxgen.llm.lowering.matmul import gemv_plan
from ptxgen.target import TARGETS

E, NU, H, F = 128, 8, 2048, 768
be = get_backend("cuda")
DeviceArray = be.DeviceArray
s = be.stream()
rng = np.random.default_rng(0)


def experts(q, m, k, d_at):
    """Random ``q`` blocks of ``E`` experts, their f16 scales set to 2^-8."""
    rb = qtype_of(q).row_bytes(k)
    bb = qtype_of(q).type_size
    w = rng.integers(0, 256, (E, m, rb // bb, bb), dtype=np.uint8)
    for o in d_at:
        w[..., o:o + 2] = np.frombuffer(np.float16(2.0 ** -8).tobytes(), np.uint8)
    return DeviceArray.from_numpy(w.reshape(E, m, rb))


wg = experts("Q4_K", F, H, (0, 2))
wu = experts("Q4_K", F, H, (0, 2))
wd = experts("Q6_K", H, F, (208,))


def graph_us(issue, reps=10, repeats=5):
    issue()
    s.synchronize()
    graph = be.capture(s, lambda: [issue() for _ in range(reps)])
    graph.launch(s)
    s.synchronize()
    ts = []
    for _ in range(repeats):
        a, b = Event(), Event()
        a.record(s)
        graph.launch(s)
        b.record(s)
        b.synchronize()
        ts.append(a.elapsed_ms(b) * 1000.0 / reps)
    return statistics.median(ts)


_fns = {}


def fn(build, spec):
    if spec not in _fns:
        _fns[spec] = be.load(build(spec)).function(spec.kernel_name)
    return _fns[spec]


tn = Tuning(device=be.device_name)
gp, _ = gemv_plan(TensorInfo("gate", "Q4_K", (F, H)), "swiglu", be.target, tn)
dp, _ = gemv_plan(TensorInfo("down", "Q6_K", (H, F)), "none", be.target, tn)
gs = expert_gemv.ExpertGemvSpec(gp, tokens=True)
ds = expert_gemv.ExpertGemvSpec(dp, x_slot=True, tokens=True)
f_gs, f_ds = fn(expert_gemv.build, gs), fn(expert_gemv.build, ds)


def spec_of(qtype, k, cfg, **kw):
    """The expert GEMM of ``cfg`` (a candidate), or the reason it is not one."""
    c = dict(cfg)
    xa, packed = c.pop("x_ahead", False), c.pop("packed", False)
    try:
        return expert_gemm.ExpertGemmSpec(GM.GemmPlan(GM.GemmSpec(qtype, k, target=be.target),
                                                      GM.GemmConfig(**c)), NU, x_ahead=xa,
                                          n_expert=E if packed else 0, **kw)
    except ValueError as e:
        return str(e)


def rel(got, want):
    a, b = got.to_numpy().astype(np.float64), want.to_numpy().astype(np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def show(cfg):
    return " ".join(f"{f}={v}" for f, v in cfg.items())


def sweep(T, x, srt, act_ref, down_ref, t_group):
    """Time each candidate of CANDIDATES at T rows (the pairs already
    grouped in ``srt``) against the table's outputs; print the best."""
    best = {}
    act_c = DeviceArray.from_numpy(np.zeros((T, NU, F), np.float32))
    down_c = DeviceArray.from_numpy(np.zeros((T, NU, H), np.float32))
    for part, qtype, k, m in (("gate_up", "Q4_K", H, F), ("down", "Q6_K", F, H)):
        for cfg in CANDIDATES[part]:
            if part == "gate_up":
                g = spec_of(qtype, k, cfg, x_token=True)
                if isinstance(g, str):
                    print(f"T={T} {part} {show(cfg)}: not a config: {g}")
                    continue
                u = attrs.evolve(g, swiglu=True)
                fg, fu = fn(expert_gemm.build, g), fn(expert_gemm.build, u)

                def issue():
                    be.launch(fg, expert_gemm.launch_geometry(g, m, T, E),
                              dict(w=wg, x=x, y=act_c, m=m, **srt), stream=s)
                    be.launch(fu, expert_gemm.launch_geometry(u, m, T, E),
                              dict(w=wu, x=x, r=act_c, y=act_c, m=m, **srt), stream=s)
                out, ref = act_c, act_ref
            else:
                d = spec_of(qtype, k, cfg)
                if isinstance(d, str):
                    print(f"T={T} {part} {show(cfg)}: not a config: {d}")
                    continue
                fd = fn(expert_gemm.build, d)

                def issue():
                    be.launch(fd, expert_gemm.launch_geometry(d, m, T, E),
                              dict(w=wd, x=act_ref, y=down_c, m=m, **srt), stream=s)
                out, ref = down_c, down_ref
            try:
                t = graph_us(issue)
            except Exception as e:          # a launch the device refuses (resources)
                print(f"T={T} {part} {show(cfg)}: failed: {type(e).__name__}: {e}")
                continue
            diff = rel(out, ref)
            ok = diff < 1e-3
            print(f"T={T} {part} {show(cfg)}: {t:8.1f} us, differs from the table's by "
                  f"{diff:.1e}{'' if ok else ' (WRONG: not counted)'}")
            if ok and (part not in best or t < best[part][0]):
                best[part] = (t, cfg)
    for part, (t, cfg) in best.items():
        print(f"SUMMARY moe gemm sweep T={T:3d} best {part:7s} {t:8.1f} us: {show(cfg)}")
    # the grid is sized for every token choosing every expert: the CTAs past
    # an expert's count only read it and exit; with no pairs at all, they
    # are all there is
    zero = dict(srt, counts=DeviceArray.from_numpy(np.zeros(E, np.uint32)))
    for part, qtype, k, m, cfg in (("gate", "Q4_K", H, F, CANDIDATES["gate_up"][0]),
                                   ("down", "Q6_K", F, H, CANDIDATES["down"][0])):
        sp = spec_of(qtype, k, cfg, x_token=part == "gate")
        fe = fn(expert_gemm.build, sp)
        geo = expert_gemm.launch_geometry(sp, m, T, E)
        xe = x if part == "gate" else act_ref
        out = act_c if part == "gate" else down_c
        t = graph_us(lambda: be.launch(fe, geo, dict(w=wg if part == "gate" else wd, x=xe,
                                                     y=out, m=m, **zero), stream=s))
        n = geo.grid[0] * geo.grid[1] * geo.grid[2]
        print(f"SUMMARY moe gemm T={T:3d} {part} of the table's config, no pairs (all {n} CTAs "
              f"exit at once): {t:6.1f} us")
    if len(best) == 2:
        layer = t_group + best["gate_up"][0] + best["down"][0]
        print(f"SUMMARY moe gemm sweep T={T:3d} grouping + best GEMMs {layer:8.1f} us a layer, "
              f"48 layers (experts only) {T / (48 * layer * 1e-6):8.0f} tokens/s")


w_router = DeviceArray.from_numpy((rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32))


def router_sweep(T, x, t_ptr):
    """The chunk's router at T rows, ``tokens`` a CTA of ROUTER_TOKENS;
    the ids of each must be those of one token a CTA."""
    logits = DeviceArray.from_numpy(np.zeros((T, E), np.float32))
    counter = DeviceArray.from_numpy(np.zeros(T, np.uint32))
    ids_r = DeviceArray.from_numpy(np.zeros((T, NU), np.int32))
    wts_r = DeviceArray.from_numpy(np.zeros((T, NU), np.float32))
    ref, best = None, None
    for tokens, block in ROUTER_TOKENS:
        spec = router.MoeRouterSpec(E, NU, H, rows=True, block=block, tokens=tokens,
                                    target=be.target)
        f = fn(router.build, spec)
        args = dict(w=w_router, x=x, logits=logits, counter=counter, ids=ids_r, weights=wts_r,
                    t_ptr=t_ptr)

        def issue():
            be.launch(f, router.launch_geometry(spec, T), args, stream=s)
        t = graph_us(issue)
        got = np.concatenate([ids_r.to_numpy().view(np.uint32).ravel(),
                              wts_r.to_numpy().view(np.uint32).ravel()])
        ref = got if ref is None else ref
        same = np.array_equal(got, ref)
        print(f"T={T} router tokens={tokens} block={block}: {t:8.1f} us"
              f"{'' if same else ' (WRONG: ids or weights differ from tokens=1)'}")
        if same and (best is None or t < best[0]):
            best = (t, tokens, block)
    print(f"SUMMARY moe router T={T:3d} best tokens={best[1]} (block {best[2]}) {best[0]:7.1f} us "
          f"a layer")


#: the router's (tokens a CTA, block) the sweep times: the first is today's
ROUTER_TOKENS = [(1, 256), (2, 256), (4, 256), (8, 256), (16, 512)]


def _c(bm, bn, bk, wm, wn, st, xa=False, packed=False):
    return dict(bm=bm, bn=bn, bk=bk, warps_m=wm, warps_n=wn, stages=st, x_ahead=xa,
                packed=packed)


#: the grouped GEMM's configs the sweep times at every T: the table's,
#: x_ahead on it, column tiles of 8..64 pairs (an expert holds about
#: 4, 8 and 32 pairs at T = 64, 128, 512), 64- and 256-row tiles (more
#: CTAs; fewer re-reads of X), deeper and shallower rings, the packed grid
CANDIDATES = {
    "gate_up": [_c(128, 32, 64, 2, 2, 4), _c(128, 32, 64, 2, 2, 4, True),
                _c(128, 64, 64, 2, 2, 4), _c(128, 64, 64, 2, 2, 4, True),
                _c(128, 64, 64, 2, 2, 3, True), _c(128, 16, 64, 4, 1, 4, True),
                _c(128, 8, 64, 4, 1, 6, True), _c(64, 32, 64, 2, 2, 4, True),
                _c(64, 16, 64, 4, 1, 6, True), _c(256, 32, 64, 4, 2, 3, True),
                _c(128, 32, 128, 2, 2, 3, True), _c(128, 32, 64, 2, 2, 4, False, True),
                _c(128, 32, 64, 2, 2, 4, True, True), _c(128, 64, 64, 2, 2, 4, True, True),
                _c(128, 16, 64, 4, 1, 4, True, True)],
    "down": [_c(128, 32, 128, 2, 2, 3), _c(128, 32, 128, 2, 2, 3, True),
             _c(128, 64, 128, 2, 2, 3), _c(128, 64, 128, 2, 2, 3, True),
             _c(128, 16, 128, 4, 1, 3, True), _c(128, 8, 128, 4, 1, 4, True),
             _c(64, 32, 128, 2, 2, 3, True), _c(64, 16, 128, 4, 1, 4, True),
             _c(256, 32, 128, 4, 2, 2, True), _c(128, 32, 128, 2, 2, 3, False, True),
             _c(128, 32, 128, 2, 2, 3, True, True), _c(128, 64, 128, 2, 2, 3, True, True),
             _c(128, 16, 128, 4, 1, 3, True, True)],
}

for T in (64, 128, 512):
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :NU].astype(np.int32)
    x = DeviceArray.from_numpy(rng.standard_normal((T, H)).astype(np.float32))
    t_ptr = DeviceArray.from_numpy(np.array([T], np.uint32))
    d_ids = DeviceArray.from_numpy(ids)
    act_v = DeviceArray.from_numpy(np.zeros((T, NU, F), np.float32))
    down_v = DeviceArray.from_numpy(np.zeros((T, NU, H), np.float32))
    a_gu = dict(w=wg, wu=wu, x=x, y=act_v, m=F, ids=d_ids, t_ptr=t_ptr)
    a_dn = dict(w=wd, x=act_v, y=down_v, m=H, ids=d_ids, t_ptr=t_ptr)
    g_gu = expert_gemv.launch_geometry(gs, F, NU, T)
    g_dn = expert_gemv.launch_geometry(ds, H, NU, T)

    def gemv_path():
        be.launch(f_gs, g_gu, a_gu, stream=s)
        be.launch(f_ds, g_dn, a_dn, stream=s)
    call = {"rows": T, "qtype": "Q4_K", "down_qtype": "Q6_K", "n_expert": E, "n_used": NU,
            "hidden": H, "expert_ffn": F, "sm": TARGETS[be.target].sm, "target": be.target}
    cfg = tuning.cascade("moe_ffn", call)
    grs = group.MoeGroupSpec(E, NU, target=be.target)
    gate = expert_gemm.ExpertGemmSpec(GM.GemmPlan(GM.GemmSpec("Q4_K", H, target=be.target),
                                                  GM.GemmConfig(**cfg["gate_up"])), NU,
                                      x_token=True)
    up = expert_gemm.ExpertGemmSpec(gate.plan, NU, x_token=True, swiglu=True)
    dn = expert_gemm.ExpertGemmSpec(GM.GemmPlan(GM.GemmSpec("Q6_K", F, target=be.target),
                                                GM.GemmConfig(**cfg["down"])), NU)
    f_gr, f_g, f_u, f_d = (fn(group.build, grs), fn(expert_gemm.build, gate),
                           fn(expert_gemm.build, up), fn(expert_gemm.build, dn))
    counts = DeviceArray.from_numpy(np.zeros(E, np.uint32))
    offsets = DeviceArray.from_numpy(np.zeros(E, np.uint32))
    pairs = DeviceArray.from_numpy(np.zeros(T * NU, np.uint32))
    act_m = DeviceArray.from_numpy(np.zeros((T, NU, F), np.float32))
    down_m = DeviceArray.from_numpy(np.zeros((T, NU, H), np.float32))
    srt = dict(counts=counts, offsets=offsets, pairs=pairs)

    def gemm_path():
        be.launch(f_gr, group.launch_geometry(grs), dict(ids=d_ids, t_ptr=t_ptr, **srt),
                  stream=s)
        be.launch(f_g, expert_gemm.launch_geometry(gate, F, T, E),
                  dict(w=wg, x=x, y=act_m, m=F, **srt), stream=s)
        be.launch(f_u, expert_gemm.launch_geometry(up, F, T, E),
                  dict(w=wu, x=x, r=act_m, y=act_m, m=F, **srt), stream=s)
        be.launch(f_d, expert_gemm.launch_geometry(dn, H, T, E),
                  dict(w=wd, x=act_m, y=down_m, m=H, **srt), stream=s)

    def group_only():
        be.launch(f_gr, group.launch_geometry(grs), dict(ids=d_ids, t_ptr=t_ptr, **srt),
                  stream=s)
    tv, tm, tg = graph_us(gemv_path), graph_us(gemm_path), graph_us(group_only)
    a, b = down_v.to_numpy().astype(np.float64), down_m.to_numpy().astype(np.float64)
    diff = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
    print(f"SUMMARY moe ffn layer T={T:3d}: grouped GEMV {tv:8.1f} us, grouped GEMM "
          f"{tm:8.1f} us (of it grouping {tg:6.1f} us), GEMV/GEMM {tv / tm:5.2f}x, "
          f"outputs differ by {diff:.2e} of the largest")
    if T == 512:
        print(f"SUMMARY moe ffn 48 layers T=512 (experts only): GEMV path "
              f"{512 / (48 * tv * 1e-6):8.0f} tokens/s, GEMM path {512 / (48 * tm * 1e-6):8.0f} "
              f"tokens/s")
    sweep(T, x, srt, act_m, down_m, tg)
    router_sweep(T, x, t_ptr)

PY
grep SUMMARY "$OUT/moegemm_bench.log" || tail -15 "$OUT/moegemm_bench.log"
echo "SUMMARY moe ffn bench rc=$rc"
[ "$rc" = 0 ] || tail -5 "$OUT/moegemm_bench.log"

rc=0
timeout 20 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="-rfE" -m gpu \
  tests/llm/test_qwen3moe.py > "$OUT/moegemm_model.log" 2>&1 || rc=$?
echo "SUMMARY qwen3moe gpu test (prefill buckets 64, 128 by the grouped GEMM) rc=$rc: $(grep -E "passed|failed" "$OUT/moegemm_model.log" | tail -1)"
grep -E "^FAILED|^ERROR" "$OUT/moegemm_model.log" | head -10 || true
