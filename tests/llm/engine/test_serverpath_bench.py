"""benchmarks/serverpath.py: the host-time benchmark runs the real engine
and server over its timed stand-in and reports sane numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")


def test_serverpath_bench_runs(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.serverpath", "--batches", "1,8",
                        "--clients", "4", "--device-ms", "5", "--max-tokens", "8",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["host"]] == [1, 8]
    for r in res["host"]:
        # every request ran to max_tokens (ignore_eos), one token per decode step
        assert r["tokens"] == r["batch"] * 8
        assert r["decode_steps"] == 8
        assert 0 <= r["host_us_per_step"] < 200_000     # the device's idle time between steps
        assert 0 < r["fraction"] <= 1.0
    (s,) = res["server"]
    assert s["clients"] == 4 and s["tokens"] == 4 * 8
    assert 0 < s["fraction"] <= 1.0
    assert 0 < s["ttft_ms_p50"] <= s["ttft_ms_max"]
    assert "B" in p.stdout and "clients" in p.stdout
