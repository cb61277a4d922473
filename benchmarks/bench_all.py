"""``make bench``: every benchmark in one run, results as JSON.

``python -m benchmarks.bench_all [OUT_DIR] [--skip model,...]`` runs the
driver (launch, graph, module-load) benchmark, the GEMV, GEMM (prefill), decode-kernel and
Llama-decode benchmarks on the GPU, the streaming ceiling of the same
positions (``bench_ceiling``), plus the CPU-side DSL emission and
emulator speeds, and writes ``OUT_DIR/<name>.json`` for each:
``{"meta": {"date", "time", "commit", "device"}, "result": ...}``.
``python scripts/results_table.py --add OUT_DIR`` turns the GPU parts into a
file of ``benchmarks/results/`` and rewrites docs/results.md from them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

PARTS = ("emit", "emulator", "driver", "gemv", "gemm", "decode", "model", "ceiling")


def _run(name):
    if name == "emit":
        from . import bench_dsl as bench
        return bench.main()
    if name == "emulator":
        from . import bench_emu as bench
        return bench.main([])
    if name == "driver":
        from . import bench_driver as bench
        return bench.run_all()
    if name == "gemv":
        from . import bench_gemv
        return bench_gemv.run_all()
    if name == "gemm":
        from . import bench_gemm
        return bench_gemm.run_all()
    if name == "decode":
        from . import bench_decode
        return bench_decode.run_all()
    if name == "model":
        from . import bench_model
        return bench_model.run_all()
    if name == "ceiling":
        from . import bench_ceiling
        return bench_ceiling.run_all()
    raise ValueError(name)


def _device_name():
    """The GPU's name, or None where there is none."""
    try:
        from ptxgen.driver import get_device, is_available
        return get_device().name if is_available() else None
    except Exception:           # a broken driver: the GPU parts will say why
        return None


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    skip = set()
    if "--skip" in argv:
        i = argv.index("--skip")
        skip = set(argv[i + 1].split(","))
        del argv[i:i + 2]
    out_dir = argv[0] if argv else "bench-results"
    os.makedirs(out_dir, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    meta = {"date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
            "commit": commit, "device": _device_name()}
    failed = []
    for name in PARTS:
        if name in skip:
            continue
        print(f"\n=== {name} ===", flush=True)
        try:
            res = _run(name)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            continue
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump({"meta": meta, "result": res}, f, indent=1, default=str)
    if failed:
        print(f"failed parts: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
