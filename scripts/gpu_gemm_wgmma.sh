#!/usr/bin/env bash
# The sm_90a (wgmma) Q4_K GEMM on the GPU machine: its tests (emulator and
# GPU), the mma.sync GEMM tests (the family now builds for sm_90a on an
# H100), then the benchmark at T = 16, 64, 256, 512, 2048 beside the mma.sync
# kernel and cuBLAS f16, with the wgmma config sweep at T = 512 and 2048.
# Results in $OUT (gemm_wgmma_tests.log, gemm_wgmma.json, gemm_wgmma.log).
set -u
source "$(dirname "$0")/gpu_setup.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_gemm_wgmma.py \
  tests/kernels/test_gemm.py 2>&1 | tee "$OUT/gemm_wgmma_tests.log" | tail -15
timeout 450 python3 -m benchmarks.bench_gemm "$OUT/gemm_wgmma.json" --qtypes Q4_K --sweep-wgmma 2>&1 \
  | grep -v Warning | tee "$OUT/gemm_wgmma.log"
