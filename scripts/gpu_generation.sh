#!/usr/bin/env bash
# The text path on the GPU: the generation and model tests (real CUDA graphs
# per variant, seeded sampling eager = graph), the text CLI, the demo, and
# the sampler's cost inside the decode step (greedy vs top-p/min-p graph
# replays of the 8B-shaped synthetic model).  Results land in $OUT (or ./gpu-out).
set -u
source "$(dirname "$0")/gpu_setup.sh"
echo "== tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="-rfE" \
  tests/llm/test_generation.py tests/llm/test_llama_model.py tests/test_cli_text.py \
  -k "gpu or cuda or run_streams or chat_reads" > "$OUT/gen_tests.log" 2>&1; echo "pytest rc=$?"
tail -15 "$OUT/gen_tests.log"
echo "== run -p on the GPU"
python3 -m ptxgen.llm.gguf.synth "$OUT/tiny-phi3.gguf" --preset tiny --seed 1 --quiet \
  --vocab tests/data/vocab/ggml-vocab-phi-3.gguf
timeout 60 python3 -m ptxgen run "$OUT/tiny-phi3.gguf" -p "Hello" -n 32 --temp 0.8 --seed 1 \
  --backend cuda 2>&1 | tail -3
echo "== demo"
timeout 90 python3 -m ptxgen demo 2>&1 | tee "$OUT/demo.log" | tail -14
echo "== sampler in the decode step (bench_model --sampler)"
timeout 270 python3 -m benchmarks.bench_model "$OUT/bench_sampler.json" --sampler 2>&1 \
  | tee "$OUT/bench_sampler.log" | tail -14
