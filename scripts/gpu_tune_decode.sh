#!/usr/bin/env bash
# GEMV configs for the Qwen2, Qwen3 and Qwen3-MoE decode shapes (issue 52's
# 72% share, issue 56's MoE decode), one GPU call of about 8 minutes:
#  1. Qwen2-7B-, Qwen3-8B- and 4-layer Qwen3-30B-A3B-shaped files
#     (scripts/gpu_synth_files.sh, seed 7);
#  2. `python -m ptxgen tune gemv --model F --search` for each, into a cache
#     of its own (/tmp/tuned);
#  3. decode at context 128 (scripts/ab_model_step.py) with the shipped table
#     and with the tuned cache, alternating, two rounds each: tokens/s and
#     the share of the read floor.
# Where the tuned configs win, their rules go into kernels/tuning/gemv.json
# (the cache's entries are in $OUT/tuned_gemv.json).  Logs in $OUT.
set -u
source "$(dirname "$0")/gpu_setup.sh"
bash scripts/gpu_synth_files.sh start qwen2=qwen2.5-7b qwen3=qwen3-8b \
  "q30l4=qwen3-30b-a3b:--mix=Q4_K_M --layers 4"
bash scripts/gpu_synth_files.sh wait qwen2 qwen3 q30l4 || exit 1
for f in q30l4 qwen2 qwen3; do
  step "tune $f"
  PTXGEN_CACHE_DIR=/tmp/tuned timeout 150 python3 -m ptxgen tune gemv --model /tmp/$f.gguf \
    --rounds 3 --search > "$OUT/tune_$f.log" 2>&1 || echo "rc=$?"
  tail -8 "$OUT/tune_$f.log"
done
cp /tmp/tuned/tuning/gemv.json "$OUT/tuned_gemv.json" 2>/dev/null
step "decode, shipped table against tuned cache"
for f in qwen2 qwen3 q30l4; do
  for c in /tmp/shipped /tmp/tuned /tmp/shipped /tmp/tuned; do
    PTXGEN_CACHE_DIR=$c timeout 90 python3 scripts/ab_model_step.py /tmp/$f.gguf --label "$c" \
      --contexts 128 --prompts "" --steps 40 --rounds 3 2>/dev/null | python3 -c "
import json, sys
d = json.loads(sys.stdin.read().strip().splitlines()[-1]); x = d['decode'][0]
print(f\"SUMMARY $f {d['label']}: {x['tokens_per_s']:.1f} tokens/s, \"
      f\"{100 * x['share_of_floor']:.1f}% of the read floor\")"
  done
done
