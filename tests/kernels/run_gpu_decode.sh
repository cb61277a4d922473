#!/bin/bash
# One GPU session for the decode kernels: gpu tests, benchmark, compute-sanitizer.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash tests/kernels/run_gpu_decode.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/decode_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 \
  || { echo "pip install failed"; tail -20 "$OUT/pip.log"; }
echo "== gpu tests"
timeout 120 python3 -m pytest tests/kernels -m gpu -q -p no:cacheprovider -rfE \
  --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
echo "== bench"
timeout 85 python3 -m benchmarks.bench_decode "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
echo "== memcheck"
timeout 30 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/kernels/sanitize_decode.py \
  2>&1 | tail -15 | tee "$OUT/memcheck.log"
echo "== racecheck"
timeout 30 compute-sanitizer --tool racecheck --error-exitcode 3 python3 tests/kernels/sanitize_decode.py \
  2>&1 | tail -15 | tee "$OUT/racecheck.log"
