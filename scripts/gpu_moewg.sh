#!/usr/bin/env bash
# The experts' warpgroup GEMM of a prompt chunk (issue 56: MoE prompt speed)
# on the GPU (an H100 or H200: sm_90a), about three minutes:
#  1. the GPU tests of the permutation and the warpgroup experts' GEMM
#     (tests/kernels/test_moe_wgmma.py: against float64, on the GPU);
#  2. one Qwen3-30B-A3B layer's experts (hidden 2048, 128 experts, 8 used,
#     expert FFN 768; gate/up Q4_K, down Q6_K and Q4_K; random blocks) at
#     64, 128 and 512 rows on the mma.sync path and the wgmma path side by
#     side, each with kernels/tuning/moe_ffn.json's configs, timed as CUDA
#     graphs, the two paths' outputs compared; then a sweep of the wgmma
#     tiles (scripts/bench_moewg.py: "SUMMARY moewg sweep ... best" lines
#     for moe_ffn.json's wgmma_gate_up and wgmma_down);
#  3. the tiny qwen3moe model's GPU test (prefill buckets 64 and 128, which
#     now take the wgmma path by the table, against token-by-token decode).
# One summary line per number ("SUMMARY", microseconds); logs in $OUT (or
# ./gpu-out); every candidate's time in moewg_bench.log.
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"

step "permute and warpgroup experts' GEMM tests"
rc=0
gpu_pytest 90 "$OUT/moewg_tests.log" -p no:randomly -o addopts="-rfE" -m gpu \
  tests/kernels/test_moe_wgmma.py || rc=$?
tests_summary "$rc" "$OUT/moewg_tests.log"

step "one 30B-A3B layer's experts: mma.sync and wgmma"
rc=0
timeout 180 python3 scripts/bench_moewg.py > "$OUT/moewg_bench.log" 2>&1 || rc=$?
grep SUMMARY "$OUT/moewg_bench.log" || true
echo "SUMMARY moewg bench rc=$rc"
[ "$rc" = 0 ] || tail -15 "$OUT/moewg_bench.log"

step "qwen3moe GPU test"
rc=0
gpu_pytest 60 "$OUT/moewg_model.log" -p no:randomly -o addopts="-rfE" -m gpu \
  tests/llm/test_qwen3moe.py || rc=$?
echo "SUMMARY qwen3moe gpu test (prefill buckets 64, 128 by the wgmma experts) rc=$rc: $(grep -E "passed|failed" "$OUT/moewg_model.log" | tail -1)"
grep -E "^FAILED|^ERROR" "$OUT/moewg_model.log" | head -10 || true
