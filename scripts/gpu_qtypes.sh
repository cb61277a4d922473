#!/usr/bin/env bash
# The GEMV and embedding of the weight types Q4_0, Q4_1, Q5_0, Q5_1, Q5_K,
# F16, BF16 on one GPU: their gpu-marked tests (GPU alone and against the
# emulator), compute-sanitizer on their GEMV cuda cases, then the GEMV
# benchmark of every type at the 8B shapes beside cuBLAS f16 (share of copy
# and the goal per row).  Results land in $OUT (or ./gpu-out).
# Usage: scripts/gpu_qtypes.sh [tests,sanitize,bench]  (default: all three;
# each part takes a few minutes, so on a 10-minute limit run them apart).
set -u
PARTS=",${1:-tests,sanitize,bench},"
source "$(dirname "$0")/gpu_setup.sh"
if [[ $PARTS == *,tests,* ]]; then
echo "== gpu tests"
PTXGEN_EMU_GPU_REPORT="$OUT/emu_vs_gpu_qtypes.json" timeout 500 python3 -m pytest -q -m gpu \
  -p no:cacheprovider -o addopts="" tests/kernels/test_gemv_qtypes.py tests/kernels/test_embedding.py \
  > "$OUT/gpu_tests_qtypes.log" 2>&1; echo "pytest rc=$?"
tail -15 "$OUT/gpu_tests_qtypes.log"
fi
if [[ $PARTS == *,sanitize,* ]]; then
echo "== compute-sanitizer (new-type GEMV, default configs on the GPU)"
for tool in memcheck racecheck; do
  timeout 240 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
    -o addopts="" tests/kernels/test_gemv_qtypes.py -k "gpu_default and 1031" \
    > "$OUT/sanitizer_qtypes_$tool.log" 2>&1
  echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer_qtypes_$tool.log" | tail -3
done
fi
if [[ $PARTS == *,bench,* ]]; then
echo "== bench"
timeout 500 python3 -m benchmarks.bench_gemv "$OUT/gemv_qtypes.json" \
  --qtypes Q4_K,Q6_K,Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q5_K,F16,BF16 2>&1 | tee "$OUT/bench_qtypes.log" | tail -80
fi
