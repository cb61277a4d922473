#!/usr/bin/env bash
# Why the engine's B = 32 decode step is slower as a CUDA graph than its
# kernels (H200, 6e44331: the kernels of an eager step sum to 4.64 ms, a graph
# replay's step takes 7.15 ms; at B = 1 the two agree, 1.881 vs 1.888 ms).
# Eager steps launch without programmatic dependent launch and a capture
# with it (Executor.capture runs run_eager(pdl=True)), so the first suspect
# is PDL between the multi-row step's GEMMs.
# About 5 minutes:
#  1. the 8B-shaped Q4_K file (scripts/gpu_synth_files.sh);
#  2. scripts/profile_batch_step.py at B = 32 and 64 with every bucket built
#     without programmatic dependent launch (--pdl off): graph and eager wall
#     steps;
#  3. the same as built (PDL where the lowering sets it), with torch's CUPTI
#     profile of a B = 32 step over eager launches and over graph replays: the
#     kernels' sum inside the graph says whether the graph's kernels run
#     slower (PDL neighbours) or the time is between them;
#  4. the engine's batched table (npp 128, ntg 128, B = 1..128) with the
#     buckets as built and without PDL (scripts/batched_table.py): what the
#     difference is worth in S_TG.
# Logs in $OUT (or ./gpu-out).
set -u
source "$(dirname "$0")/gpu_setup.sh" > /dev/null
bash scripts/gpu_synth_files.sh start llama8b=llama3-8b
bash scripts/gpu_synth_files.sh wait llama8b
echo "== PDL off"
timeout 60 python3 scripts/profile_batch_step.py /tmp/llama8b.gguf --batches 32,64 --profile "" \
  --pdl off > "$OUT/batch_gap_nopdl.log" 2>&1
grep -E "^B=" "$OUT/batch_gap_nopdl.log"
echo "== as built, with the kernels' profile at B = 32"
timeout 100 python3 scripts/profile_batch_step.py /tmp/llama8b.gguf --batches 32,64 --profile 32 \
  > "$OUT/batch_gap.log" 2>&1
grep -E "^B=|kernels" "$OUT/batch_gap.log"
for p in table off; do
  echo "== the engine's batched table, PDL $p"
  timeout 120 python3 scripts/batched_table.py /tmp/llama8b.gguf --pdl $p \
    > "$OUT/batch_gap_table_$p.log" 2>&1 || echo "rc=$?"
  grep -E "^\|" "$OUT/batch_gap_table_$p.log" | tail -5
done
