#!/usr/bin/env bash
# One device call for the batched engine and the server (issues 54, 55, 59):
# the GPU tests of the model, engine, server and batch kernels; the engine's
# batched table beside the single-sequence pp/tg (python -m ptxgen bench) on
# the 8B-shaped Q4_K file; the server under 64 streaming clients and 256
# requests with abandoned streams; llama.cpp's llama-batched-bench on the same
# file; the issue-59 churn loop; compute-sanitizer on the paged kernels.
# In order of importance, each step under its own timeout, logs in $OUT.
# Needs .carry/llcpp.tar.xz and the wheels in .whl/ (gguf, the server's).
set -u
export PYTHONUNBUFFERED=1
bash scripts/gpu_llamacpp_cuda.sh start
source scripts/gpu_setup.sh
python3 -c "from ptxgen.llm.named_templates import resolve_chat_template as r
open('/tmp/llama3.jinja', 'w').write(r('llama3'))"
bash scripts/gpu_synth_files.sh start llama8b=llama3-8b \
  "llama8bv=llama3-8b:--vocab tests/data/vocab/ggml-vocab-llama-bpe.gguf --chat-template /tmp/llama3.jinja"

step "GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="-rfE" -m gpu \
  tests/llm tests/driver/test_capture_gpu.py tests/kernels/test_paged_attention.py \
  tests/kernels/test_flash_prefill_paged.py tests/kernels/test_sampling_rows.py \
  > "$OUT/gpu_tests.log" 2>&1; echo "pytest rc=$?"
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -12

bash scripts/gpu_synth_files.sh wait llama8b || exit 1
step "engine: pp/tg of one sequence, and the batched table"
timeout 240 python3 -m ptxgen bench /tmp/llama8b.gguf --backend cuda -p 512 -n 128 -r 2 \
  -npp 128 -ntg 128 -npl 1,8,32,64,128 > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
tail -14 "$OUT/bench.log"

bash scripts/gpu_synth_files.sh wait llama8bv || exit 1
step "server tests on the GPU: the openai client against ptxgen serve, 8B file"
PTXGEN_SERVE_MODEL=/tmp/llama8bv.gguf timeout 150 python3 -m pytest -q -p no:cacheprovider \
  -o addopts="-rfE" -m gpu tests/llm/server/test_server_engine.py > "$OUT/serve_tests.log" 2>&1
echo "pytest rc=$?"; tail -3 "$OUT/serve_tests.log"
step "server: 64 streaming clients, then 256 requests with 30% abandoned"
python3 -m ptxgen serve /tmp/llama8bv.gguf --port 8080 --parallel 64 -c 1024 --max-queue 1024 \
  --log-level warning > "$OUT/serve.log" 2>&1 &
PID=$!
for i in $(seq 240); do curl -sf http://127.0.0.1:8080/health > /dev/null && break; sleep 1; done
timeout 120 python3 -m benchmarks.load http://127.0.0.1:8080 --concurrency 64 \
  --requests-per-client 1 --prompt-len 128:128 --max-tokens 128 --ignore-eos \
  --json "$OUT/load.json" 2>&1 | tail -8
timeout 90 python3 -m benchmarks.load http://127.0.0.1:8080 --concurrency 64 \
  --requests-per-client 4 --prompt-len 16:512 --max-tokens 128 --disconnect 0.3 \
  --json "$OUT/disconnect.json" 2>&1 | tail -4
curl -s http://127.0.0.1:8080/metrics | grep -E "^ptxgen_(sequences|kv_blocks)"
kill -INT $PID; wait $PID; echo "serve rc=$?"

step "llama.cpp llama-batched-bench, same file"
B=$(bash scripts/gpu_llamacpp_cuda.sh wait 120) && timeout 120 "$B/llama-batched-bench" \
  -m /tmp/llama8b.gguf -c 36000 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,8,32,64,128 -fa 1 \
  -ngl 99 2>/dev/null | tail -7 | tee "$OUT/llamacpp_batched.txt"

step "issue 59: 200 models dropped without a collection"
timeout 150 python3 scripts/gpu_model_churn.py > "$OUT/churn.log" 2>&1; echo "churn rc=$?"
tail -4 "$OUT/churn.log"

step "compute-sanitizer, paged kernels"
for tool in memcheck racecheck; do
  timeout 60 compute-sanitizer --tool $tool --print-limit 5 --error-exitcode 3 \
    python3 tests/kernels/sanitize_paged.py > "$OUT/sanitizer_paged_$tool.log" 2>&1
  echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^OK" "$OUT/sanitizer_paged_$tool.log" | tail -2
done
step done
