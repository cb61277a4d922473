#!/usr/bin/env bash
# The experts' grouped GEMM of a prompt chunk (issue 56, item 2) on the GPU,
# under a minute on an H100:
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
#     wins are kernels/tuning/moe_ffn.json's rows_min;
#  3. the tiny qwen3moe model's GPU test (prefill buckets 64 and 128, which
#     take the grouped GEMM by the table, against token-by-token decode).
# One summary line per number ("SUMMARY"); logs in $OUT (or ./gpu-out).
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

rc=0
timeout 15 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="-rfE" -m gpu \
  tests/kernels/test_moe_gemm.py > "$OUT/moegemm_tests.log" 2>&1 || rc=$?
echo "SUMMARY moe gemm kernel gpu tests rc=$rc: $(grep -E "passed|failed" "$OUT/moegemm_tests.log" | tail -1)"
grep -E "^FAILED|^ERROR" "$OUT/moegemm_tests.log" | head -10 || true

rc=0
timeout 18 python3 - > "$OUT/moegemm_bench.log" 2>&1 <<'PY' || rc=$?
import statistics

import numpy as np

from ptxgen.driver import Event
from ptxgen.driver.backend import get_backend
from ptxgen.kernels import gemm as GM
from ptxgen.kernels import tuning
from ptxgen.kernels.moe import expert_gemm, expert_gemv, group
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
PY
grep SUMMARY "$OUT/moegemm_bench.log" || tail -15 "$OUT/moegemm_bench.log"
echo "SUMMARY moe ffn bench rc=$rc"

rc=0
timeout 20 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="-rfE" -m gpu \
  tests/llm/test_qwen3moe.py > "$OUT/moegemm_model.log" 2>&1 || rc=$?
echo "SUMMARY qwen3moe gpu test (prefill buckets 64, 128 by the grouped GEMM) rc=$rc: $(grep -E "passed|failed" "$OUT/moegemm_model.log" | tail -1)"
grep -E "^FAILED|^ERROR" "$OUT/moegemm_model.log" | head -10 || true
