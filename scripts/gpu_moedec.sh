#!/usr/bin/env bash
# Qwen3-MoE decode speed on the GPU, one call (under 4 minutes on an H100):
#  1. the gpu-marked MoE kernel and model tests (router with the folded
#     RMSNorm, the experts' GEMV with the folded weighted sum, the qwen3moe
#     decode graph and prefill against the float64 reference);
#  2. a Qwen3-30B-A3B-shaped Q4_K_M file (real shapes, random weights, ~17 GB)
#     and a 4-layer one, written into /tmp in the background while the tests
#     run;
#  3. decode tokens/s of the graph path at context 128 and pp512 (scripts/ab_model_step.py),
#     with two floors: every weight read once (the script's, all 128 experts)
#     and the bytes a step actually reads (the 8 chosen experts: `info`'s
#     decode_read_bytes), both over the copy bandwidth measured beside it;
#  4. the per-kernel breakdown of the 4-layer file's step
#     (scripts/profile_decode_step.py);
#  5. llama-bench on the full file when $LLAMACPP_BIN is set.
# One SUMMARY line per number; logs in $OUT (or ./gpu-out).
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"
F=/tmp/q30moe.gguf
F4=/tmp/q30l4.gguf

echo "== writing $F and $F4 in the background"
t0=$(date +%s)
bash scripts/gpu_synth_files.sh start q30moe=qwen3-30b-a3b:--mix=Q4_K_M \
  "q30l4=qwen3-30b-a3b:--mix=Q4_K_M --layers 4"

echo "== gpu tests"
rc_tests=0
gpu_pytest 150 "$OUT/moedec_tests.log" -p no:randomly -m gpu -o addopts="-rfE" \
  tests/kernels/test_moe_router.py tests/kernels/test_moe_experts.py \
  tests/llm/test_qwen3moe.py || rc_tests=$?
tail -6 "$OUT/moedec_tests.log"

bash scripts/gpu_synth_files.sh wait q30moe q30l4
echo "synthetic files written in $(( $(date +%s) - t0 )) s (with the tests beside them)"

echo "== decode, graph path, context 128; pp512"
set +e
timeout 150 python3 scripts/ab_model_step.py "$F" --label moedec --contexts 128 --prompts 512 \
  --steps 40 --rounds 3 > "$OUT/q30moe_step.json" 2> "$OUT/q30moe_step.err"
rc_step=$?
set -e
tail -3 "$OUT/q30moe_step.err"

echo "== per-kernel breakdown, 4 layers"
set +e
timeout 90 python3 scripts/profile_decode_step.py "$F4" --ctx 128 --top 20 \
  2>&1 | tee "$OUT/q30l4_profile.txt"
set -e

llama_bench "$F" "$OUT/q30moe_llamabench.txt"

echo "== summary"
echo "SUMMARY moe gpu tests: $(pass_fail $rc_tests "$OUT/moedec_tests.log")"
[ $rc_step = 0 ] || echo "SUMMARY decode: ab_model_step failed (rc=$rc_step, see $OUT/q30moe_step.err)"
python3 - "$F" "$OUT/q30moe_step.json" "$peer" <<'EOF'
import json, re, sys
from ptxgen.llm.info import decode_read_bytes, read_info

path, step, peer = sys.argv[1:4]
try:
    out = json.loads(open(step).read().strip().splitlines()[-1])
except (OSError, ValueError, IndexError):
    sys.exit(0)
d = out["decode"][0]
tps, ms, bw = d["tokens_per_s"], d["ms_per_token"], out["copy_bytes_per_s"]
active = decode_read_bytes(read_info(path))
print(f"SUMMARY launches per token: {out['launches_per_token']}")
print(f"SUMMARY qwen3-30b-a3b Q4_K_M decode (graph, ctx 128) on {out['device']}: "
      f"{tps:.1f} tokens/s, {ms:.3f} ms/token")
print(f"SUMMARY active read floor: {active / 1e9:.3f} GB/token (8 of 128 experts) = "
      f"{active / bw * 1e3:.3f} ms at the measured copy bandwidth {bw / 1e9:.0f} GB/s; "
      f"the step is {100 * active / bw * 1e3 / ms:.1f}% of it")
print(f"SUMMARY all-weights floor (every expert, ab_model_step's): {d['floor_ms']:.3f} ms "
      f"({100 * d['share_of_floor']:.1f}%)")
if peer:
    m = re.search(r"\|\s*tg128\s*\|\s*([\d.]+)", open(peer).read())
    if m:
        lc = float(m.group(1))
        print(f"SUMMARY llama.cpp tg128 {lc:.1f} tokens/s; ptxgen/llama.cpp = {tps / lc:.2f}x "
              f"(target 1.5x = {1.5 * lc:.1f} tokens/s)")
    m = re.search(r"\|\s*pp512\s*\|\s*([\d.]+)", open(peer).read())
    if m and out["prompt"]:
        lc, pp = float(m.group(1)), out["prompt"][0]["tokens_per_s"]
        print(f"SUMMARY pp512 {pp:.1f} tokens/s, llama.cpp {lc:.1f}; ptxgen/llama.cpp = "
              f"{pp / lc:.2f}x (target 2x)")
    else:
        print(f"SUMMARY llama.cpp: no tg128 number (see {peer})")
EOF
