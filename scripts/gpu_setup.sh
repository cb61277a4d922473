# Sourced by the GPU-session scripts: results directory, unbuffered Python,
# the carried wheels (.whl/, e.g. gguf) and ptxgen installed editable into
# the GPU machine's own python3 (which has torch).
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
# the device and the commit, at the top of every run's results
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt" || true
# `want NAME`: whether the part NAME was asked for (a script sets PART from its
# first argument before sourcing this; all parts when it does not)
want() { [ "${PART:-all}" = all ] || [ "${PART:-all}" = "$1" ]; }

# `step TITLE`: a part's heading, with the time
step() { echo "== $1 ($(date +%T))"; }

# `gpu_pytest SECONDS LOG ARGS...`: pytest ARGS (quiet, no cache) under a time
# limit, its output into LOG; returns pytest's status (124 past the limit)
gpu_pytest() { timeout "$1" python3 -m pytest -q -p no:cacheprovider "${@:3}" > "$2" 2>&1; }

# `tests_summary RC LOG`: the SUMMARY line of a pytest run (its status RC and
# pytest's count line from LOG), then its first failures
tests_summary() {
  echo "SUMMARY gpu tests rc=$1: $(grep -E "passed|failed" "$2" | tail -1)"
  grep -E "^FAILED|^ERROR" "$2" | head -10 || true
}

# `pass_fail RC LOG`: PASS for status 0, else FAIL with the status and LOG
pass_fail() { if [ "$1" = 0 ]; then echo PASS; else echo "FAIL (rc=$1, see $2)"; fi; }

# `llama_bench FILE OUTPUT`: where $LLAMACPP_BIN is set, llama-bench (pp512 and
# tg128, flash attention, every layer on the GPU, 3 repetitions) on FILE, its
# output into OUTPUT and its table shown; sets `peer` to OUTPUT, or to "" where
# $LLAMACPP_BIN is not set
llama_bench() {
  peer=""
  [ -n "${LLAMACPP_BIN:-}" ] || return 0
  echo "== llama-bench (same file)"
  local rc=0
  timeout 120 "$LLAMACPP_BIN/llama-bench" -m "$1" -p 512 -n 128 -fa 1 -ngl 99 -r 3 \
    > "$2" 2>&1 || rc=$?
  echo "llama-bench rc=$rc"
  grep -E "^\|" "$2" || tail -5 "$2"
  peer=$2
}
