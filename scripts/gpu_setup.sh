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
