#!/usr/bin/env bash
# The batched sampler (SamplingSpec(rows=True), logprobs) on a GPU: its tests
# and the one-row sampler's (emulator, GPU and both compared),
# compute-sanitizer memcheck and racecheck on the GPU cases (the 8B
# vocabulary's op test included), then the benchmark against one-row
# launches.  Results in $OUT (or ./gpu-out): sampling_rows_tests.log,
# emu_vs_gpu_sampling_rows.json, sanitizer_sampling_rows_*.log,
# sampling_rows.json, bench_sampling_rows.log.
# Usage: bash scripts/gpu_sampling_rows.sh [all|tests|sanitize|bench]
set -u
PART=${1:-all}
source "$(dirname "$0")/gpu_setup.sh"
if want tests; then
echo "== sampler tests (rows and one row)"
PTXGEN_EMU_GPU_REPORT="$OUT/emu_vs_gpu_sampling_rows.json" timeout 500 python3 -m pytest -q \
  -p no:cacheprovider -o addopts="" tests/kernels/test_sampling_rows.py \
  tests/kernels/test_sampling.py > "$OUT/sampling_rows_tests.log" 2>&1; echo "pytest rc=$?"
tail -8 "$OUT/sampling_rows_tests.log"
fi
if ! want sanitize; then
  :
elif command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer (batched sampler, cuda cases)"
  for tool in memcheck racecheck; do
    timeout 250 compute-sanitizer --tool $tool --print-limit 5 --error-exitcode 3 python3 -m pytest -q \
      -p no:cacheprovider -o addopts="" tests/kernels/test_sampling_rows.py \
      -k "(cuda and not emu_vs) or llama_vocab" > "$OUT/sanitizer_sampling_rows_$tool.log" 2>&1
    echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer_sampling_rows_$tool.log" | tail -3
  done
else
  echo "== compute-sanitizer not on PATH: skipped"
fi
if want bench; then
echo "== bench_sampling_rows"
timeout 400 python3 -m benchmarks.bench_sampling_rows "$OUT/sampling_rows.json" 2>&1 \
  | grep -v Warning | tee "$OUT/bench_sampling_rows.log"
fi
