#!/usr/bin/env bash
# The GEMM's Q6_K and Q8_0 formats on the GPU machine: their tests (emulator
# and GPU), the Q4_K tests (the shared stage loop), the prefill tests (Q4_K_M
# and Q8_0 files against token-by-token decoding), then the benchmark of all
# three types beside cuBLAS f16 on the 8B shapes. Results in $OUT
# (gemm_qtypes_tests.log, gemm_qtypes.json, gemm_qtypes.log).
set -u
source "$(dirname "$0")/gpu_setup.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemm_qtypes.py \
  tests/kernels/test_gemm.py -k "not emu" 2>&1 | tee "$OUT/gemm_qtypes_tests.log" | tail -15
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/llm/test_prefill.py -m gpu 2>&1 \
  | tee -a "$OUT/gemm_qtypes_tests.log" | tail -8
timeout 280 python3 -m benchmarks.bench_gemm "$OUT/gemm_qtypes.json" --qtypes Q4_K,Q6_K,Q8_0 2>&1 \
  | grep -v Warning | tee "$OUT/gemm_qtypes.log"
