#!/usr/bin/env bash
# The engine loop's and the server's hand-off on the GPU (branch serverpath):
# the gpu-marked engine and server tests on tiny synthetic files (real graph
# replays under the engine loop; the OpenAI client against `ptxgen serve`).
# Under 60 s on an H100.  Expect "2 passed" (and the 8B serve test skipped
# unless PTXGEN_SERVE_MODEL is set).
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
unset PTXGEN_SERVE_MODEL
timeout 55 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="-rfEs" -m gpu \
  "tests/llm/engine/test_engine_model.py::test_gpu_batch_equals_alone_with_shared_prefixes" \
  "tests/llm/server/test_server_engine.py::test_serve_on_the_gpu_with_a_small_file" \
  --basetemp=/tmp/serverpath_bt 2>&1 | tee "$OUT/serverpath_tests.log"
