#!/usr/bin/env bash
# The engine's overlapped decode loop on the GPU (branch overlap, issues 54
# and 55): the gpu-marked engine and server tests (the overlapped engine's
# tokens equal to the synchronous engine's over captured graphs, tokens fed
# on the device; each sequence of a batch as alone; `ptxgen serve` on a small
# file), then the batched table of the 8B file at B = 8, 32, 64 (npp 128,
# ntg 128) with the overlap and without (--no-overlap).  Logs in $OUT;
# SUMMARY lines at the end.  Under 3 minutes on an H100.
set -euo pipefail
source scripts/gpu_setup.sh
bash scripts/gpu_synth_files.sh start llama8b=llama3-8b

step "GPU tests: overlapped vs synchronous engine, the engine's batches, the server"
unset PTXGEN_SERVE_MODEL
rc=0
gpu_pytest 120 "$OUT/overlap_gpu_tests.log" -p no:randomly -o addopts="-rfEs" -m gpu \
  tests/llm/engine/test_overlap.py tests/llm/engine/test_engine_model.py \
  tests/llm/server/test_server_engine.py --basetemp=/tmp/overlap_bt || rc=$?
tail -5 "$OUT/overlap_gpu_tests.log"
tests_summary $rc "$OUT/overlap_gpu_tests.log"

bash scripts/gpu_synth_files.sh wait llama8b
for mode in overlap no-overlap; do
  step "engine ($mode): batched table, npp 128, ntg 128, B = 8, 32, 64"
  flag=""; [ "$mode" = no-overlap ] && flag="--no-overlap"
  rc=0
  timeout 80 python3 -m ptxgen bench /tmp/llama8b.gguf --backend cuda -p 0 -n 0 -r 1 \
    -npp 128 -ntg 128 -npl 8,32,64 $flag > "$OUT/overlap_bench_$mode.log" 2>&1 || rc=$?
  echo "bench $mode rc=$rc"
  tail -6 "$OUT/overlap_bench_$mode.log"
done

# per B: S_TG (decode tokens/s; with the overlap, wall time per step) and the
# ms per decode step against the GPU time of a step quoted before the
# overlap; S (all tokens over the batch's wall time) of both loops
python3 - "$OUT/overlap_bench_overlap.log" "$OUT/overlap_bench_no-overlap.log" <<'PY'
import sys
from ptxgen.llm.bench import read_batched
def table(path):
    try:
        rows = read_batched(open(path).read())
    except OSError:
        return {}
    return {b: (r["s_tg"], r["s"]) for b, r in rows.items()}
gpu_ms = {8: 4.9, 32: 6.3, 64: 8.9}
ov, sy = table(sys.argv[1]), table(sys.argv[2])
for b in sorted(ov):
    tg, s = ov[b]
    step_ms = b / tg * 1e3
    g = gpu_ms.get(b)
    host = f"  (GPU step {g} ms: {step_ms - g:+5.2f} ms)" if g else ""
    base = f"  S {s:8.1f} vs {sy[b][1]:8.1f} t/s without overlap ({s / sy[b][1]:4.2f}x)" \
        if b in sy else ""
    print(f"SUMMARY decode B={b:3d}: S_TG {tg:8.1f} t/s, {step_ms:5.2f} ms/step{host}{base}")
PY
step done
