#!/usr/bin/env bash
# Two ptxgen trees on one GPU in one call: this tree (installed editable by
# gpu_setup.sh) and an older one carried as .carry/old.tar (its packages,
# e.g. `git archive REV ptxgen kernels driver llm testing pyproject.toml README.md`),
# installed apart in /tmp/oldsite and put first on PYTHONPATH.  Runs
# scripts/ab_model_step.py on MODEL for each in alternating rounds (OLD_API=driver
# for a tree from before llm/ existed).
#   scripts/gpu_ab_trees.sh MODEL.gguf ROUNDS [ab_model_step args...]
set -u
source "$(dirname "$0")/gpu_setup.sh"
M=$1; R=$2; shift 2
if [ ! -d /tmp/oldsite ]; then
  mkdir -p /tmp/oldtree && tar xf .carry/old.tar -C /tmp/oldtree
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/oldsite /tmp/oldtree \
    > "$OUT/old_install.log" 2>&1 || { tail -5 "$OUT/old_install.log"; exit 1; }
fi
HERE=$(pwd)
for r in $(seq 1 "$R"); do
  python3 scripts/ab_model_step.py "$M" --label new --json "$OUT/ab_trees.jsonl" "$@" > /dev/null
  (cd /tmp && PYTHONPATH=/tmp/oldsite${PYTHONPATH:+:$PYTHONPATH} python3 "$HERE/scripts/ab_model_step.py" \
     "$M" --label old --api "${OLD_API:-llm}" --json "$OUT/ab_trees.jsonl" "$@" > /dev/null)
done
