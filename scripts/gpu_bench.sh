#!/usr/bin/env bash
# One GPU session, part 2: `make bench` without the venv (the GPU machine
# has its own python3 with torch).  JSON per part in $OUT.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
timeout 560 python3 -m ptxgen.driver.bench_all "$OUT" ${BENCH_SKIP:+--skip $BENCH_SKIP} 2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$" | tail -120
