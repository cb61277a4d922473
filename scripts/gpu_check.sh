#!/usr/bin/env bash
# One GPU session, part 1: install, every gpu-marked test (the emulator is
# compared with the GPU on every kernel test), compute-sanitizer on the
# GEMV kernels and on the decode kernels + a tiny model (PDL graph), and the demo.  Results land in $OUT (or ./gpu-out).
set -u
source "$(dirname "$0")/gpu_setup.sh"
echo "== gpu tests"
PTXGEN_EMU_GPU_REPORT="$OUT/emu_vs_gpu.json" timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider \
  -o addopts="" tests > "$OUT/gpu_tests.log" 2>&1; echo "pytest rc=$?"
tail -25 "$OUT/gpu_tests.log"
echo "== compute-sanitizer (GEMV, cuda cases)"
for tool in memcheck racecheck; do
  timeout 100 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/kernels/test_gemv.py -k "cuda and not emu_vs" > "$OUT/sanitizer_$tool.log" 2>&1
  echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer_$tool.log" | tail -3
  timeout 100 compute-sanitizer --tool $tool --print-limit 5 python3 tests/kernels/sanitize_decode.py \
    > "$OUT/sanitizer_decode_$tool.log" 2>&1
  echo "decode $tool rc=$?"; grep -E "SUMMARY|^OK" "$OUT/sanitizer_decode_$tool.log" | tail -2
done
echo "== demo"
timeout 120 python3 -m ptxgen demo 2>&1 | tee "$OUT/demo.log" | tail -8
