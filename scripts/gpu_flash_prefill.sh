#!/usr/bin/env bash
# Flash prefill (causal chunk attention) on a GPU: its tests (emulator and
# GPU), compute-sanitizer memcheck and racecheck on small GPU cases, then the
# attention benchmark beside torch SDPA at T = 512, L = 0 / 4096 / 16384 with
# the config sweep.  Results in $OUT (or ./gpu-out): flash_prefill_tests.log,
# sanitizer_flash_prefill_*.log, flash_prefill.json, bench_flash_prefill.log.
set -u
source "$(dirname "$0")/gpu_setup.sh"
echo "== flash_prefill tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_flash_prefill.py \
  > "$OUT/flash_prefill_tests.log" 2>&1; echo "pytest rc=$?"
tail -8 "$OUT/flash_prefill_tests.log"
if command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer (flash_prefill, cuda cases)"
  for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
      -o addopts="" tests/kernels/test_flash_prefill.py -k "cuda and (layouts or warpgroup or tuned or 40-17 or slack)" \
      > "$OUT/sanitizer_flash_prefill_$tool.log" 2>&1
    echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer_flash_prefill_$tool.log" | tail -3
  done
else
  echo "== compute-sanitizer not on PATH: skipped"
fi
echo "== bench_prefill (attention, config sweep)"
timeout 300 python3 -m benchmarks.bench_prefill "$OUT/flash_prefill.json" --sweep --skip-model 2>&1 \
  | grep -v Warning | tee "$OUT/bench_flash_prefill.log"
