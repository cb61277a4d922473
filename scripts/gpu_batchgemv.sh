#!/usr/bin/env bash
# The batched GEMV on the GPU (issue 54): its GPU tests and the engine's with
# it; the batched GEMV against the GEMM per projection shape of the 8B file at
# B = 1..32 (prints the crossover for kernels/tuning/gemv_batch.json and keeps
# it in the user tuning cache, so the engine bench after it uses it); the
# engine's batched table at B = 1, 8, 32, 64, 128 (npp 128, ntg 128) beside
# llama-batched-bench on the same file when $LLAMACPP_BIN is set (the
# directory `scripts/gpu_llamacpp_cuda.sh wait` prints).  Logs in $OUT; one
# summary line per number.  Under 6 minutes on an H100.
set -euo pipefail
source scripts/gpu_setup.sh
bash scripts/gpu_synth_files.sh start llama8b=llama3-8b

step "GPU tests: the batched GEMV kernel, the batch runner and the engine"
rc=0
gpu_pytest 100 "$OUT/batchgemv_gpu_tests.log" -o addopts="-rfE" -m gpu \
  tests/kernels/test_gemv_batched.py tests/llm/engine/test_engine_model.py || rc=$?
tests_summary $rc "$OUT/batchgemv_gpu_tests.log"

step "batched GEMV vs GEMM per projection shape of the 8B file"
rc=0
timeout 150 python3 scripts/bench_batchgemv.py --b 1,2,4,8,16,32 --store \
  --json "$OUT/batchgemv_sweep.json" > "$OUT/batchgemv_sweep.log" 2>&1 || rc=$?
cat "$OUT/batchgemv_sweep.log"
echo "SUMMARY sweep rc=$rc: $(grep CROSSOVER "$OUT/batchgemv_sweep.log" || echo 'no crossover line')"

bash scripts/gpu_synth_files.sh wait llama8b
step "engine: batched table, npp 128, ntg 128, B = 1, 8, 32, 64, 128"
rc=0
timeout 150 python3 -m ptxgen bench /tmp/llama8b.gguf --backend cuda -p 0 -n 0 -r 1 \
  -npp 128 -ntg 128 -npl 1,8,32,64,128 > "$OUT/batchgemv_bench.log" 2>&1 || rc=$?
echo "bench rc=$rc"
tail -12 "$OUT/batchgemv_bench.log"

if [ -n "${LLAMACPP_BIN:-}" ]; then
  step "llama.cpp llama-batched-bench, same file"
  timeout 60 "$LLAMACPP_BIN/llama-batched-bench" -m /tmp/llama8b.gguf -c 36000 -b 2048 -ub 512 \
    -npp 128 -ntg 128 -npl 1,8,32,64,128 -fa 1 -ngl 99 2>/dev/null | tail -7 \
    | tee "$OUT/batchgemv_llamacpp.txt" || echo "llama-batched-bench rc=$?"
else
  echo "LLAMACPP_BIN not set: no llama.cpp peer"
fi

# S_TG (decode tokens/s of all sequences) per B of both tables
python3 - "$OUT/batchgemv_bench.log" "$OUT/batchgemv_llamacpp.txt" <<'PY'
import sys
from ptxgen.llm.bench import read_batched
def s_tg(path):
    try:
        return {b: r["s_tg"] for b, r in read_batched(open(path).read()).items()}
    except OSError:
        return {}
ours, peer = s_tg(sys.argv[1]), s_tg(sys.argv[2])
for b in sorted(ours):
    p = peer.get(b)
    tail = f"  llama.cpp {p:9.1f}  ratio {ours[b] / p:4.2f} (target 1.5)" if p else ""
    print(f"SUMMARY decode B={b:3d}: ptxgen {ours[b]:9.1f} tok/s{tail}")
PY
step done
