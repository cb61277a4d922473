#!/usr/bin/env bash
# Mixture of experts (qwen3moe) on the GPU, one call (under 6 minutes on an H100):
#  1. the MoE kernels' GPU tests (router, experts' GEMV, weighted sum: emulator
#     and GPU compared) and a tiny qwen3moe model against the float64 reference
#     (decode graph replays, prefill chunks against the token-by-token prompt);
#  2. a Qwen3-30B-A3B-shaped Q4_K_M file (real shapes, random weights, ~17 GB,
#     written into /tmp in the background while the tests run): decode tg128 and
#     prompt pp512 (`ptxgen bench`), the decode's share of its read floor (the
#     bytes of the experts it actually reads), and llama-bench on the same file
#     when $LLAMACPP_BIN is set.
# One summary line per number ("== summary"); logs in $OUT (or ./gpu-out).
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"
F=/tmp/q30moe.gguf

echo "== writing $F in the background"
t0=$(date +%s)
bash scripts/gpu_synth_files.sh start q30moe=qwen3-30b-a3b:--mix=Q4_K_M

echo "== tests"
rc_tests=0
gpu_pytest 200 "$OUT/moe_tests.log" -p no:randomly -o addopts="-rfE" \
  tests/kernels/test_moe_router.py tests/kernels/test_moe_experts.py \
  tests/llm/test_qwen3moe.py || rc_tests=$?
tail -6 "$OUT/moe_tests.log"

bash scripts/gpu_synth_files.sh wait q30moe
t1=$(date +%s)
echo "synthetic file: $(du -h $F | cut -f1) written in $((t1 - t0)) s (with the tests beside it)"
python3 -m ptxgen info "$F" --gpu-memory 80 | tee "$OUT/q30moe_info.txt" \
  | grep -E "^(architecture|parameters|weights|experts)" || true

echo "== ptxgen bench (pp512, tg128)"
timeout 200 python3 -m ptxgen bench "$F" -p 512 -n 128 -r 3 -npl 0 --backend cuda \
  2>&1 | tee "$OUT/q30moe_bench.txt" | grep -E "^\|" || tail -15 "$OUT/q30moe_bench.txt"

llama_bench "$F" "$OUT/q30moe_llamabench.txt"

echo "== summary"
echo "moe gpu tests: $(pass_fail $rc_tests "$OUT/moe_tests.log")"
python3 - "$F" "$OUT/q30moe_bench.txt" "$peer" <<'EOF'
import re, sys
from ptxgen.llm.info import decode_read_bytes, read_info

path, ours, peer = sys.argv[1], sys.argv[2], sys.argv[3]
PEAK = 3.35e12        # H100 SXM HBM3 nominal bandwidth, bytes/s


def rates(text):
    out = {}
    for test in ("pp512", "tg128"):
        m = re.search(rf"\|\s*{test}\s*\|\s*([\d.]+)", text)
        if m:
            out[test] = float(m.group(1))
    return out


mine = rates(open(ours).read())
theirs = rates(open(peer).read()) if peer else {}
floor = decode_read_bytes(read_info(path))
for test, what in (("tg128", "decode tg128"), ("pp512", "prompt pp512")):
    if test not in mine:
        print(f"qwen3-30b-a3b Q4_K_M {what}: ptxgen gave no number (see {ours})")
        continue
    line = f"qwen3-30b-a3b Q4_K_M {what}: ptxgen {mine[test]:,.1f} tokens/s"
    if test in theirs:
        line += (f", llama.cpp {theirs[test]:,.1f} tokens/s "
                 f"({mine[test] / theirs[test]:.2f}x)")
    print(line)
if "tg128" in mine:
    bw = floor * mine["tg128"]
    print(f"qwen3-30b-a3b decode read floor: {floor / 1e9:.3f} GB/token (the 8 of 128 experts "
          f"chosen and every other matrix); at tg128 {bw / 1e9:,.0f} GB/s = "
          f"{100 * bw / PEAK:.1f}% of 3.35 TB/s")
EOF
