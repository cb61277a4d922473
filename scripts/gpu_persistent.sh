#!/usr/bin/env bash
# The persistent decode kernel (issue 57) on a GPU, from the repository root:
#   tests      the -m gpu tests of tests/llm/test_persistent.py and the
#              megakernel kernel tests;
#   sanitize   compute-sanitizer memcheck, then racecheck, on
#              tests/llm/sanitize_persistent.py (a tiny model's persistent steps,
#              32 CTAs: fewer instrumented CTAs spinning on the counters);
#   timeline   8B- and 1B-shaped synthetic Q4_K files: graph vs persistent
#              tokens/s and the persistent step's node timeline
#              (scripts/persistent_timeline.py), llama.cpp's tg128 on the same
#              files where $LLAMACPP_BIN is set.
# `bash scripts/gpu_persistent.sh [tests|sanitize|timeline]` runs one part (all
# without an argument).  Results in $OUT (./gpu-out): persistent_tests.log,
# sanitizer_persistent_{memcheck,racecheck}.log, timeline_{llama8b,llama1b}.{log,json},
# llamacpp_{llama8b,llama1b}.log; a SUMMARY line per number on stdout.
# Under 5 minutes on an H100.
set -euo pipefail
PART=${1:-all}
source "$(dirname "$0")/gpu_setup.sh"

if want timeline; then
  bash scripts/gpu_synth_files.sh start llama8b=llama3-8b
  # the 1B shape (Llama 3.2 1B: 16 layers, 2048 wide, FFN 8192, 32/8 heads), in the background too
  if [ ! -f /tmp/llama1b.gguf ]; then
    (python3 -c "
from ptxgen.llm.gguf.synth import write_synthetic_llama
write_synthetic_llama('/tmp/llama1b.part.gguf', n_layers=16, hidden=2048, ffn=8192, n_heads=32,
                      n_kv_heads=8, vocab=128256, context_length=8192, rope_theta=500000.0, seed=7)
" > /tmp/llama1b.synth.log 2>&1 && mv -f /tmp/llama1b.part.gguf /tmp/llama1b.gguf) &
    synth1b=$!
  fi
fi

if want tests; then
  echo "== gpu tests: persistent decode, megakernel"
  rc=0
  timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="-rfE" -m gpu \
    tests/llm/test_persistent.py tests/kernels/test_megakernel.py tests/kernels/test_megakernel_inline.py \
    > "$OUT/persistent_tests.log" 2>&1 || rc=$?
  tail -3 "$OUT/persistent_tests.log"
  echo "SUMMARY tests: rc=$rc $(grep -E '[0-9]+ (passed|failed|skipped|errors?)' "$OUT/persistent_tests.log" | tail -1)"
fi

if ! want sanitize; then
  :
elif command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer on tests/llm/sanitize_persistent.py"
  for tool in memcheck racecheck; do
    rc=0
    timeout 120 compute-sanitizer --tool $tool --print-limit 5 --error-exitcode 3 \
      python3 tests/llm/sanitize_persistent.py --grid 32 > "$OUT/sanitizer_persistent_$tool.log" 2>&1 || rc=$?
    grep -E "^seed=|^steps |max relative|^OK" "$OUT/sanitizer_persistent_$tool.log" || true
    echo "SUMMARY sanitizer $tool: rc=$rc ok=$(grep -c '^OK$' "$OUT/sanitizer_persistent_$tool.log" || true)" \
      "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_persistent_$tool.log" | tail -1 || true)"
  done
else
  echo "SUMMARY sanitizer: compute-sanitizer not on PATH, skipped"
fi

if want timeline; then
  bash scripts/gpu_synth_files.sh wait llama8b
  if [ -n "${synth1b:-}" ]; then
    wait "$synth1b" || { echo "no /tmp/llama1b.gguf"; cat /tmp/llama1b.synth.log; exit 1; }
  fi
  for name in llama8b llama1b; do
    echo "== graph vs persistent decode, the persistent step's timeline: $name"
    rc=0
    timeout 100 python3 scripts/persistent_timeline.py /tmp/$name.gguf --steps 64 \
      --json "$OUT/timeline_$name.json" > "$OUT/timeline_$name.log" 2>&1 || rc=$?
    # the nodes taking the most of the step, then the step's line
    grep -E "^ +[0-9]+ " "$OUT/timeline_$name.log" | sort -k8 -n -r | head -8 || true
    tail -1 "$OUT/timeline_$name.log"
    python3 - "$OUT/timeline_$name.json" "$name" "$rc" <<'EOF' || echo "SUMMARY $name: rc=$rc, no timeline"
import json, sys
path, name, rc = sys.argv[1:]
j = json.load(open(path))
print(f"SUMMARY {name} graph: {j['graph_tps']:.1f} tokens/s")
print(f"SUMMARY {name} persistent: {j['persistent_tps']:.1f} tokens/s "
      f"({j['persistent_tps'] / max(j['graph_tps'], 1e-9):.2f}x graph)")
print(f"SUMMARY {name} persistent step: {j['step_us']:.1f} us on {j['grid']} CTAs, "
      f"busy share {j['busy']:.1%}, same tokens: {j.get('same_tokens')} (rc={rc})")
EOF
  done
  if [ -n "${LLAMACPP_BIN:-}" ]; then
    for name in llama8b llama1b; do
      echo "== llama.cpp tg128: $name"
      timeout 90 "$LLAMACPP_BIN/llama-bench" -m /tmp/$name.gguf -fa 1 -ngl 99 -p 0 -n 128 -r 3 \
        > "$OUT/llamacpp_$name.log" 2>&1 || true
      grep -E "tg128" "$OUT/llamacpp_$name.log" || tail -3 "$OUT/llamacpp_$name.log"
      echo "SUMMARY $name llama.cpp tg128: $(grep -E 'tg128' "$OUT/llamacpp_$name.log" \
        | awk -F'|' '{print $(NF-1)}' | tr -s ' ' | head -1) tokens/s"
    done
  else
    echo "SUMMARY llama.cpp: LLAMACPP_BIN not set, skipped"
  fi
fi
