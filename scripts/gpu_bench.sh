#!/usr/bin/env bash
# One GPU session, part 2: `make bench` without the venv (the GPU machine
# has its own python3 with torch).  JSON per part in $OUT.
set -u
source "$(dirname "$0")/gpu_setup.sh"
timeout 560 python3 -m benchmarks.bench_all "$OUT" ${BENCH_SKIP:+--skip $BENCH_SKIP} 2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$" | tail -120
