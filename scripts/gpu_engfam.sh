#!/usr/bin/env bash
# qwen3moe and gemma3 in the batched engine on the GPU, one short call (under
# a minute on an H100; tiny synthetic files only):
#  1. paged decode attention and paged flash prefill with a sliding window
#     (Gemma 3's 1024 keys on the tuned config, and the emulator's window cases
#     on the GPU) against the float64 reference;
#  2. Engine.generate for a tiny qwen3moe and a tiny gemma3 file (captured
#     graphs): each sequence of the batch gets the tokens the single-sequence
#     Model gives it alone, up to a near tie.
# Logs in $OUT (or ./gpu-out): engfam_tests.log.
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== tests"
set +e
timeout 50 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="-rfE" \
  tests/kernels/test_paged_attention.py tests/kernels/test_flash_prefill_paged.py \
  tests/llm/engine/test_engine_families.py \
  -k "window and cuda or window_gpu or gpu_each_sequence" > "$OUT/engfam_tests.log" 2>&1
rc=$?
set -e
tail -8 "$OUT/engfam_tests.log"
echo "pytest rc=$rc"
exit $rc
