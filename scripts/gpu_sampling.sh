#!/usr/bin/env bash
# The sampler on a GPU: its tests (emulator, GPU and both compared),
# compute-sanitizer on the GPU cases, and the benchmark against torch
# (six chains and greedy at vocab 128,256).  Results land in $OUT (or
# ./gpu-out): sampling_tests.log, sanitizer_sampling_*.log, sampling.json.
set -u
source "$(dirname "$0")/gpu_setup.sh"
echo "== sampler tests"
timeout 400 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_sampling.py \
  > "$OUT/sampling_tests.log" 2>&1; echo "pytest rc=$?"
tail -8 "$OUT/sampling_tests.log"
echo "== compute-sanitizer (sampler, cuda cases)"
for tool in memcheck racecheck; do
  timeout 200 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
    -o addopts="" tests/kernels/test_sampling.py -k "llama_vocab or (cuda and not emu_vs and (filtered or cut_below))" \
    > "$OUT/sanitizer_sampling_$tool.log" 2>&1
  echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer_sampling_$tool.log" | tail -3
done
echo "== bench_sampling"
timeout 300 python3 -m benchmarks.bench_sampling "$OUT/sampling.json" 2>&1 | tee "$OUT/bench_sampling.log"
