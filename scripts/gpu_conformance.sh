#!/usr/bin/env bash
# ptxgen's decode step on the GPU against llama.cpp (CPU build): the tiny
# files of every convention (tests/test_conformance.py, side cuda), then an
# 8B-shaped synthetic Q4_K file with the analytic bound (the float64
# reference would need 8 bytes a weight).  The llama.cpp program is found as
# the tests find it (PTXGEN_LLAMACPP_LOGITS, or the build cache); results in $OUT.
# Usage: scripts/gpu_conformance.sh [tiny,8b]  (default both)
set -u
PARTS=",${1:-tiny,8b},"
source "$(dirname "$0")/gpu_setup.sh"
if [[ $PARTS == *,tiny,* ]]; then
  echo "== conformance, tiny files, GPU side"
  timeout 400 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "slow and gpu" \
    tests/test_conformance.py -rA > "$OUT/conformance_tiny_cuda.log" 2>&1; echo "pytest rc=$?"
  grep -E "top-1 agreement|passed|failed|PASSED|FAILED" "$OUT/conformance_tiny_cuda.log" | tail -40
fi
if [[ $PARTS == *,8b,* ]]; then
  M=${MODEL_8B:-/tmp/llama3-8b-q4k.gguf}
  [ -f "$M" ] || python3 -m ptxgen.llm.gguf.synth "$M" --preset llama3-8b --qtype Q4_K --quiet
  echo "== conformance, 8B-shaped Q4_K file, GPU side, analytic bound"
  timeout 400 python3 scripts/conformance.py "$M" --side cuda --bound analytic --threads 16 \
    --n-tokens 8 --seed 1 --json "$OUT/conformance_8b.json" 2>&1 | tee "$OUT/conformance_8b.log" | tail -14
fi
