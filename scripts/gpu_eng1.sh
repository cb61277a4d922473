#!/usr/bin/env bash
# Issue 54, "B = 1 through the engine within 3% of today's single-sequence
# decode": the engine's one-row decode step lowered as the decode step (the
# attention norm in the QKV GEMV's prologue, RoPE and the paged append in its
# epilogue, gate/up with SwiGLU in one GEMV, PDL on every launch, the paged
# attention's first loads before its wait, the argmax for a greedy row).  The GPU tests of the engine, the
# batch runner, the paged rope epilogue and paged attention; on the
# 8B-shaped Q4_K file the single-sequence decode (tg128) beside the engine at
# B = 1 (the batched table, 128 + 128), with SUMMARY lines and their ratio;
# then the one-row step per kernel beside the decode step's.  Under 4 minutes
# on an H100; logs in $OUT.
set -euo pipefail
source scripts/gpu_setup.sh
bash scripts/gpu_synth_files.sh start llama8b=llama3-8b

step "GPU tests: engine, batch runner, paged rope epilogue, paged attention"
rc=0
gpu_pytest 120 "$OUT/eng1_tests.log" -o addopts="-rfE" -m gpu \
  tests/llm/engine tests/llm/test_batch_runner.py \
  "tests/kernels/test_gemv.py::test_gemv_rope_epilogue_paged" \
  tests/kernels/test_paged_attention.py || rc=$?
echo "pytest rc=$rc"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/eng1_tests.log" | tail -12 || true

bash scripts/gpu_synth_files.sh wait llama8b
step "single-sequence decode (Model, graph path): tg128"
timeout 75 python3 -m ptxgen bench /tmp/llama8b.gguf --backend cuda -p 0 -n 128 -r 3 -npl 0 \
  > "$OUT/eng1_single.log" 2>&1 || { tail -20 "$OUT/eng1_single.log"; exit 1; }
cat "$OUT/eng1_single.log"
step "the engine at B = 1: 128 prompt + 128 new tokens"
timeout 90 python3 -m ptxgen bench /tmp/llama8b.gguf --backend cuda -p 0 -n 0 -r 1 \
  -npp 128 -ntg 128 -npl 1 > "$OUT/eng1_engine.log" 2>&1 \
  || { tail -20 "$OUT/eng1_engine.log"; exit 1; }
cat "$OUT/eng1_engine.log"
python3 - "$OUT/eng1_single.log" "$OUT/eng1_engine.log" <<'EOF'
import re, sys
single = [float(m.group(1)) for m in re.finditer(r"\|\s+tg128 \|\s+([\d.]+) ±", open(sys.argv[1]).read())]
rows = [l.split("|") for l in open(sys.argv[2]) if re.match(r"\|\s*128 \|\s*128 \|\s*1 \|", l)]
engine = [float(r[8]) for r in rows]
if not single or not engine:
    sys.exit(f"SUMMARY missing: single {single}, engine {engine}")
s, e = single[0], engine[0]
print(f"SUMMARY single-sequence decode tg128 {s:.1f} t/s")
print(f"SUMMARY engine B=1 S_TG {e:.1f} t/s")
print(f"SUMMARY engine/single {e / s:.3f} (issue 54 asks >= 0.97)")
EOF

step "the one-row step per kernel (engine), then the decode step's (Model)"
timeout 50 python3 scripts/profile_batch_step.py /tmp/llama8b.gguf --batches 1 --profile 1 \
  2>&1 | tee "$OUT/eng1_profile_batch.log" | tail -34 || true
timeout 40 python3 scripts/profile_decode_step.py /tmp/llama8b.gguf --ctx 200 --top 12 \
  2>&1 | tee "$OUT/eng1_profile_decode.log" | tail -18 || true
step done
