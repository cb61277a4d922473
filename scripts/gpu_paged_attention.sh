#!/usr/bin/env bash
# Paged decode attention and the paged RoPE + KV append on a GPU: their tests
# (emulator, GPU, and the two compared), compute-sanitizer memcheck and
# racecheck (tests/kernels/sanitize_paged.py on the 8B shape, and the tests'
# GPU cases), then the benchmark beside contiguous flash decode and torch SDPA.
# Results in $OUT (or ./gpu-out): paged_tests.log, emu_vs_gpu_paged.json,
# sanitizer_paged_*.log, paged_attention.json, bench_paged.log.
# Usage: bash scripts/gpu_paged_attention.sh [all|tests|sanitize|bench]
# (one part per call keeps each under the device tool's 10 minutes).
set -u
PART=${1:-all}
source "$(dirname "$0")/gpu_setup.sh"
if want tests; then
echo "== paged tests"
PTXGEN_EMU_GPU_REPORT="$OUT/emu_vs_gpu_paged.json" timeout 240 python3 -m pytest -q \
  -p no:cacheprovider -o addopts="" tests/kernels/test_paged_attention.py \
  tests/kernels/test_rope.py -k "paged" > "$OUT/paged_tests.log" 2>&1; echo "pytest rc=$?"
tail -8 "$OUT/paged_tests.log"
fi
if ! want sanitize; then
  :
elif command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer (paged)"
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool $tool --print-limit 5 --error-exitcode 3 \
      python3 tests/kernels/sanitize_paged.py > "$OUT/sanitizer_paged_$tool.log" 2>&1
    echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^OK|Error" "$OUT/sanitizer_paged_$tool.log" | tail -3
    timeout 150 compute-sanitizer --tool $tool --print-limit 5 --error-exitcode 3 python3 -m pytest -q \
      -p no:cacheprovider -o addopts="" tests/kernels/test_paged_attention.py tests/kernels/test_rope.py \
      -k "paged and cuda and not emu_vs" > "$OUT/sanitizer_paged_tests_$tool.log" 2>&1
    echo "tests $tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer_paged_tests_$tool.log" | tail -3
  done
else
  echo "== compute-sanitizer not on PATH: skipped"
fi
if want bench; then
echo "== bench_paged"
timeout 300 python3 -m benchmarks.bench_paged "$OUT/paged_attention.json" 2>&1 \
  | grep -v Warning | tee "$OUT/bench_paged.log"
fi
