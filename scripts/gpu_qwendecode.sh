#!/usr/bin/env bash
# Qwen decode with the fused QKV launches (issue 52's decode item), one GPU call:
#  1. the gpu tests of the changed kernels (the GEMV rope epilogue with biases
#     and NeoX pairs, the rope kernel's qk_norm mode) and of Qwen decode,
#     prefill, the batched runner and conformance against the float64
#     reference;
#  2. decode of Qwen2-7B- and Qwen3-8B-shaped Q4_K files (random weights) at
#     contexts 128 and 4096: tokens/s and the share of the read floor
#     (scripts/ab_model_step.py), alternating with the tree in .carry/old.tar
#     when there is one (as scripts/gpu_ab_trees.sh runs it; OLD_API=driver
#     for a tree from before ptxgen.llm);
#  3. llama-bench tg128 on the same files where $LLAMACPP_BIN is set.
# One summary line per number at the end (also in $OUT/qwendecode_summary.txt).
#   scripts/gpu_qwendecode.sh [ROUNDS]      # alternating rounds per file (default 2)
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"
ROUNDS=${1:-2}
HERE=$(pwd)
J="$OUT/qwendecode.jsonl"; rm -f "$J"
bash scripts/gpu_synth_files.sh start qwen2=qwen2.5-7b qwen3=qwen3-8b

echo "== gpu tests"
TESTS=ok
timeout 240 python3 -m pytest -q -p no:randomly -m gpu tests/kernels/test_gemv.py \
  -k "rope or neox" > "$OUT/qwendecode_tests_gemv.log" 2>&1 || TESTS=FAILED
tail -3 "$OUT/qwendecode_tests_gemv.log"
timeout 240 python3 -m pytest -q -p no:randomly -m gpu tests/kernels/test_rope_norm.py \
  tests/llm/test_conventions.py tests/llm/test_optional_tensors.py \
  > "$OUT/qwendecode_tests_qwen.log" 2>&1 || TESTS=FAILED
tail -3 "$OUT/qwendecode_tests_qwen.log"
timeout 180 python3 -m pytest -q -p no:randomly -m gpu tests/llm/test_prefill.py \
  tests/llm/test_batch_runner.py tests/test_conformance.py -k qwen > "$OUT/qwendecode_tests_prefill.log" 2>&1 || TESTS=FAILED
tail -3 "$OUT/qwendecode_tests_prefill.log"

OLD=""
if [ -f .carry/old.tar ]; then
  if [ ! -d /tmp/oldsite ]; then
    mkdir -p /tmp/oldtree && tar xf .carry/old.tar -C /tmp/oldtree
    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite /tmp/oldtree \
      > "$OUT/old_install.log" 2>&1 || { tail -5 "$OUT/old_install.log"; exit 1; }
  fi
  OLD=1
fi

bash scripts/gpu_synth_files.sh wait qwen2 qwen3
echo "== decode"
for f in qwen2 qwen3; do
  for r in $(seq 1 "$ROUNDS"); do
    timeout 120 python3 scripts/ab_model_step.py "/tmp/$f.gguf" --label new --json "$J" \
      --contexts 128,4096 --prompts 512 --rounds 3 > /dev/null
    if [ -n "$OLD" ]; then
      (cd /tmp && PYTHONPATH=/tmp/oldsite${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 \
        "$HERE/scripts/ab_model_step.py" "/tmp/$f.gguf" --label old --api "${OLD_API:-llm}" \
        --json "$J" --contexts 128,4096 --prompts 512 --rounds 3 > /dev/null)
    fi
  done
done

LB="$OUT/qwendecode_llamabench.jsonl"; rm -f "$LB"
if [ -n "${LLAMACPP_BIN:-}" ] && [ -x "$LLAMACPP_BIN/llama-bench" ]; then
  echo "== llama-bench"
  for f in qwen2 qwen3; do
    timeout 90 "$LLAMACPP_BIN/llama-bench" -m "/tmp/$f.gguf" -fa 1 -ngl 99 -p 0 -n 128 -r 3 \
      -o jsonl 2> "$OUT/llamabench_$f.log" | sed "s|^|{\"file\": \"$f\", \"row\": |; s|\$|}|" \
      >> "$LB" || echo "llama-bench failed on $f (see $OUT/llamabench_$f.log)"
  done
else
  echo "LLAMACPP_BIN not set: no llama.cpp peer numbers"
fi

echo "gpu tests: $TESTS (logs $OUT/qwendecode_tests_*.log)" | tee "$OUT/qwendecode_summary.txt"
python3 - "$J" "$LB" <<'EOF' | tee -a "$OUT/qwendecode_summary.txt"
import json, os, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for arch in ("qwen2", "qwen3"):
    for label in ("new", "old"):
        rs = [r for r in rows if r["arch"] == arch and r["label"] == label]
        if not rs:
            continue
        print(f"{arch} {label}: {rs[0]['launches_per_token']} launches a token, "
              f"{len(rs)} runs, {rs[0]['device']}")
        for i, d in enumerate(rs[0]["decode"]):
            tps = [r["decode"][i]["tokens_per_s"] for r in rs]
            share = [r["decode"][i]["share_of_floor"] for r in rs]
            print(f"{arch} {label} decode ctx {d['context']}: {statistics.median(tps):.1f} tok/s "
                  f"(runs {min(tps):.1f}-{max(tps):.1f}), {100 * statistics.median(share):.1f}% "
                  f"of the read floor (72% wanted)")
        pp = [r["prompt"][0]["tokens_per_s"] for r in rs if r["prompt"]]
        if pp:
            print(f"{arch} {label} pp512: {statistics.median(pp):,.0f} tok/s")
if os.path.exists(sys.argv[2]):
    for l in open(sys.argv[2]):
        r = json.loads(l)
        row = r["row"]
        if row.get("n_gen"):
            print(f"{r['file']} llama-bench tg{row['n_gen']}: {row['avg_ts']:.1f} tok/s")
EOF
