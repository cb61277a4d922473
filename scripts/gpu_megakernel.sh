#!/usr/bin/env bash
# The persistent decode kernel (issue 57) on a GPU: the
# tape and persistent-kernel tests (their GPU case included),
# compute-sanitizer memcheck and racecheck on the kernel's GPU test, then on
# 1B- and 8B-shaped synthetic Q4_K files: the scheduling cost of the step's
# tape under the persistent kernel (no-op instructions) beside a CUDA graph
# of the same launches with empty kernels, then in one call per file the
# graph path and the persistent kernel decoding: same greedy tokens, logits
# apart, tokens/s of each with its share of the read floor; llama.cpp's
# tg128 on the same files where $LLAMACPP_BIN is set.
# Results in $OUT (./gpu-out): megakernel_tests.log, sanitizer_megakernel_*.log,
# megakernel.json, bench_megakernel.log.  Under 6 minutes on an H100.
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"
bash scripts/gpu_synth_files.sh start llama8b=llama3-8b
# the 1B shape (Llama 3.2 1B: 16 layers, 2048 wide, FFN 8192, 32/8 heads), in the background too
[ -f /tmp/llama1b.gguf ] || (python3 -c "
from ptxgen.llm.gguf.synth import write_synthetic_llama
write_synthetic_llama('/tmp/llama1b.part.gguf', n_layers=16, hidden=2048, ffn=8192, n_heads=32,
                      n_kv_heads=8, vocab=128256, context_length=8192, rope_theta=500000.0, seed=7)
" > /tmp/llama1b.synth.log 2>&1 && mv -f /tmp/llama1b.part.gguf /tmp/llama1b.gguf) &
synth1b=$!

echo "== tape and persistent-kernel tests"
rc=0
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/llm/test_tape.py \
  tests/kernels/test_megakernel.py tests/kernels/test_megakernel_inline.py \
  tests/llm/test_persistent.py -k "not emulator" > "$OUT/megakernel_tests.log" 2>&1 || rc=$?
echo "pytest rc=$rc"; tail -4 "$OUT/megakernel_tests.log"

echo "== compute-sanitizer (the persistent kernel's GPU tests: the toy tape, the tiny model)"
for tool in memcheck racecheck; do
  rc=0
  timeout 60 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
    -o addopts="" tests/kernels/test_megakernel.py tests/llm/test_persistent.py -k gpu \
    > "$OUT/sanitizer_megakernel_$tool.log" 2>&1 || rc=$?
  echo "$tool rc=$rc"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|skipped" "$OUT/sanitizer_megakernel_$tool.log" | tail -3 || true
done

bash scripts/gpu_synth_files.sh wait llama8b
wait $synth1b || { echo "no /tmp/llama1b.gguf"; cat /tmp/llama1b.synth.log; exit 1; }
echo "== scheduling (no-op tape vs empty launches), then graph vs persistent decode"
rc=0
timeout 200 python3 -m benchmarks.bench_megakernel /tmp/llama1b.gguf /tmp/llama8b.gguf --decode \
  --json "$OUT/megakernel.json" 2>&1 | tee "$OUT/bench_megakernel.log" || rc=$?
echo "bench_megakernel rc=$rc"

if [ -n "${LLAMACPP_BIN:-}" ]; then
  echo "== llama.cpp tg128 on the same files"
fi
for name in llama1b llama8b; do
  if [ -n "${LLAMACPP_BIN:-}" ]; then
    timeout 60 "$LLAMACPP_BIN/llama-bench" -m /tmp/$name.gguf -p 0 -n 128 -r 3 -ngl 99 2>&1 \
      | tee "$OUT/llamacpp_$name.log" | grep -E "tg128" || true
  fi
done
