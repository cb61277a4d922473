#!/usr/bin/env bash
# This session's one GPU call: correctness of what changed, the Q6_K ring A/B,
# the graph timer, and the persistent kernel's timeline on an 8B-shaped file.
set -u
source scripts/gpu_setup.sh
T0=$(date +%s)
echo "== gemv ring over unaligned rows (cuda cases) + persistent GPU test"
timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/kernels/test_gemv_qtypes.py -k "not_16_byte or qwen2_output" \
  tests/llm/test_persistent.py -k "gpu" 2>&1 | tail -4
echo "== driver.timing.graph_us"
timeout 30 python3 - <<'PY'
import numpy as np
from ptxgen.driver import DeviceArray, Stream, get_device, ops
from ptxgen.driver.timing import graph_us
from ptxgen.kernels import quants
get_device()
s = Stream()
m, k = 4096, 4096
w = DeviceArray.from_numpy(quants.quantize(np.random.default_rng(0).standard_normal((m, k)).astype(np.float32), "Q4_K"))
x = DeviceArray.from_numpy(np.random.default_rng(1).standard_normal(k).astype(np.float32))
y = DeviceArray.empty((m,), np.float32)
us = graph_us(lambda i: ops.gemv(w, x, "Q4_K", out=y, stream=s), s, 20, 5)
print(f"graph_us Q4_K 4096x4096 gemv: {us:.1f} us ({w.nbytes / us / 1e6:.0f} GB/s)")
PY
echo "== Q6_K ring A/B ($(( $(date +%s) - T0 )) s)"
timeout 60 python3 -m benchmarks.bench_gemv_ab benchmarks/ab/q6k_unaligned_rows.json --rounds 3 \
  --json "$OUT/q6k_ab.json" 2>&1 | tail -12
echo "== persistent timeline, 8B shape 2 layers ($(( $(date +%s) - T0 )) s)"
timeout 20 python3 -m ptxgen.llm.gguf.synth /tmp/l8b2.gguf --preset llama3-8b --layers 2 --quiet \
  && timeout 60 python3 scripts/persistent_timeline.py /tmp/l8b2.gguf --steps 8 \
     --json "$OUT/timeline.json" 2>&1 | tail -22
echo "== done ($(( $(date +%s) - T0 )) s)"
