#!/usr/bin/env bash
# Chunk attention over a paged KV cache on a GPU: its tests (emulator, GPU,
# and the two compared, beside the contiguous kernel's), compute-sanitizer
# memcheck and racecheck (tests/kernels/sanitize_prefill_paged.py on the 8B
# shape, and the tests' GPU cases), then the benchmark against the
# contiguous kernel.  Results in $OUT (or ./gpu-out): prefill_paged_tests.log,
# emu_vs_gpu_prefill_paged.json, sanitizer_prefill_paged_*.log,
# prefill_paged.json, bench_prefill_paged.log.
# Usage: bash scripts/gpu_prefill_paged.sh [all|tests|sanitize|bench]
# (one part per call keeps each under the device tool's 10 minutes).
set -u
PART=${1:-all}
source "$(dirname "$0")/gpu_setup.sh"
if want tests; then
echo "== prefill tests (paged and contiguous)"
PTXGEN_EMU_GPU_REPORT="$OUT/emu_vs_gpu_prefill_paged.json" timeout 300 python3 -m pytest -q \
  -p no:cacheprovider -o addopts="" tests/kernels/test_flash_prefill_paged.py \
  tests/kernels/test_flash_prefill.py > "$OUT/prefill_paged_tests.log" 2>&1; echo "pytest rc=$?"
tail -8 "$OUT/prefill_paged_tests.log"
fi
if ! want sanitize; then
  :
elif command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer (paged prefill)"
  for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool --print-limit 5 --error-exitcode 3 \
      python3 tests/kernels/sanitize_prefill_paged.py > "$OUT/sanitizer_prefill_paged_$tool.log" 2>&1
    echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^OK|Error" "$OUT/sanitizer_prefill_paged_$tool.log" | tail -3
    timeout 150 compute-sanitizer --tool $tool --print-limit 5 --error-exitcode 3 python3 -m pytest -q \
      -p no:cacheprovider -o addopts="" tests/kernels/test_flash_prefill_paged.py \
      -k "cuda and not emu_vs" > "$OUT/sanitizer_prefill_paged_tests_$tool.log" 2>&1
    echo "tests $tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer_prefill_paged_tests_$tool.log" | tail -3
  done
else
  echo "== compute-sanitizer not on PATH: skipped"
fi
if want bench; then
echo "== bench_prefill_paged"
timeout 400 python3 -m benchmarks.bench_prefill_paged "$OUT/prefill_paged.json" 2>&1 \
  | grep -v Warning | tee "$OUT/bench_prefill_paged.log"
fi
