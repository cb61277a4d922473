#!/usr/bin/env bash
# Gemma 3 (issue 56, part 1) on the GPU in one device call, under 6 minutes:
#  1. the GPU tests of its kernels (windowed flash decode and flash prefill,
#     head_dim 256, the GeGLU GEMV and launch, the accumulating RMSNorm, the
#     scaled embedding) and of the model (tests/llm/test_gemma3.py: greedy
#     decode and chunked prefill of a tiny gemma3 file against the float64
#     reference), and the gemma3 conformance cases' GPU side where a llama.cpp
#     CPU build is present;
#  2. a Gemma-3-4B-shaped Q4_K_M file (real shapes, random weights, gguf_synth)
#     timed with `python -m ptxgen bench` (pp512, tg128), beside llama-bench
#     on the same file when $LLAMACPP_BIN (a llama.cpp CUDA build's bin
#     directory, scripts/gpu_llamacpp_cuda.sh wait) is set.
# Logs in $OUT (or ./gpu-out); the last lines are one summary line a number.
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"
FILE=/tmp/gemma3_4b_q4km.gguf
bash scripts/gpu_synth_files.sh start "gemma3_4b_q4km=gemma3-4b:--mix Q4_K_M"

step "GPU tests: gemma3's kernels and model"
rc=0
timeout 130 python3 -m pytest -q -p no:cacheprovider -o addopts="-rfE" -m gpu \
  tests/llm/test_gemma3.py tests/kernels/test_flash_prefill.py tests/kernels/test_flash_decode.py \
  tests/kernels/test_gemv.py tests/kernels/test_swiglu.py tests/kernels/test_rmsnorm.py \
  tests/kernels/test_embedding.py \
  -k "gemma3 or gpu_decode or gpu_prefill or sliding_window or layouts or window or geglu or accumulate or scaled" \
  > "$OUT/gemma3_gpu_tests.log" 2>&1 || rc=$?
TESTS=$(grep -E "passed|failed|error" "$OUT/gemma3_gpu_tests.log" | tail -1 || true)
echo "pytest rc=$rc: $TESTS"; grep -E "^(FAILED|ERROR)" "$OUT/gemma3_gpu_tests.log" | head -10 || true

step "conformance: gemma3 files, the GPU side against llama.cpp's CPU build (skips without one)"
rc=0
timeout 30 python3 -m pytest -q -p no:cacheprovider -o addopts="-rfEs" -m slow \
  tests/test_conformance.py -k "gemma3 and cuda" > "$OUT/gemma3_conformance.log" 2>&1 || rc=$?
CONF=$(grep -E "passed|failed|skipped" "$OUT/gemma3_conformance.log" | tail -1 || true)
echo "pytest rc=$rc: $CONF"

bash scripts/gpu_synth_files.sh wait gemma3_4b_q4km
{ python3 -m ptxgen info "$FILE" || true; } > "$OUT/gemma3_4b_info.txt"
grep -E "^(parameters|  Q|sliding|attention|weights:)" "$OUT/gemma3_4b_info.txt" || true

step "ptxgen bench: pp512, tg128 (one sequence)"
rc=0
timeout 120 python3 -m ptxgen bench "$FILE" --backend cuda -p 512 -n 128 -r 3 -npl 0 \
  > "$OUT/gemma3_4b_bench.txt" 2> "$OUT/gemma3_4b_bench.log" || rc=$?
echo "bench rc=$rc"; cat "$OUT/gemma3_4b_bench.txt"; [ $rc = 0 ] || tail -5 "$OUT/gemma3_4b_bench.log"

: > "$OUT/gemma3_4b_llamabench.txt"
if [ -n "${LLAMACPP_BIN:-}" ] && [ -x "$LLAMACPP_BIN/llama-bench" ]; then
  step "llama-bench, same file"
  rc=0
  timeout 60 "$LLAMACPP_BIN/llama-bench" -m "$FILE" -p 512 -n 128 -r 3 -fa 1 -ngl 99 \
    > "$OUT/gemma3_4b_llamabench.txt" 2> "$OUT/gemma3_4b_llamabench.log" || rc=$?
  echo "llama-bench rc=$rc"; cat "$OUT/gemma3_4b_llamabench.txt"
else
  step "llama-bench: \$LLAMACPP_BIN not set, no peer numbers"
fi

step "summary"
echo "gemma3 GPU tests: $TESTS"
echo "gemma3 conformance (GPU side): $CONF"
python3 - "$OUT/gemma3_4b_bench.txt" "$OUT/gemma3_4b_llamabench.txt" <<'EOF'
import re, sys

def rates(path):
    """test -> mean t/s from a llama-bench-style markdown table."""
    out = {}
    for line in open(path, errors="replace"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"(pp|tg)\d+", cells[-2]):
            out[cells[-2]] = float(cells[-1].split()[0])
    return out

ours, peer = rates(sys.argv[1]), rates(sys.argv[2])
goal = {"pp512": 2.0, "tg128": 1.5}
for test in ("pp512", "tg128"):
    a, b = ours.get(test), peer.get(test)
    line = f"gemma3-4b Q4_K_M {test}: ptxgen " + (f"{a:.1f} t/s" if a else "n/a")
    if b:
        line += f", llama.cpp {b:.1f} t/s"
        if a:
            line += f", {a / b:.2f}x (issue 56 asks >= {goal[test]}x)"
    print(line)
EOF
step done
