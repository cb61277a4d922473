#!/usr/bin/env bash
# A GEMV knob A/B on the GPU machine: scripts/gpu_ab.sh benchmarks/ab/CONFIG.json
# [--rounds N] (python -m benchmarks.bench_gemv_ab; results JSON in $OUT).
set -u
source "$(dirname "$0")/gpu_setup.sh"
cfg=$1; shift
timeout 560 python3 -m benchmarks.bench_gemv_ab "$cfg" --json "$OUT/ab_$(basename "$cfg")" "$@" \
  2>&1 | grep -v Warning | tee "$OUT/ab.log"
