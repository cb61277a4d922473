#!/usr/bin/env bash
# The quantized GEMM on the GPU machine: its tests (emulator and GPU, the
# emu_vs_cuda comparison where the test has one), then its benchmark beside
# cuBLAS f16 with the config sweep. Results in $OUT (gemm_tests.log,
# gemm.json, gemm.log).
set -u
source "$(dirname "$0")/gpu_setup.sh"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemm.py 2>&1 \
  | tee "$OUT/gemm_tests.log" | tail -15
timeout 330 python3 -m benchmarks.bench_gemm "$OUT/gemm.json" --sweep 2>&1 \
  | grep -v Warning | tee "$OUT/gemm.log"
