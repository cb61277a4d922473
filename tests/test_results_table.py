"""scripts/results_table.py: docs/results.md is exactly what the committed
benchmark JSON renders to, the newest measurement of a quantity wins, bad
files are refused naming what is wrong, and a `make bench` run converts."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("results_table", ROOT / "scripts" / "results_table.py")
rt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rt)


def _write(path: Path, run: dict) -> Path:
    path.write_text(json.dumps(run, ensure_ascii=False), encoding="utf-8")
    return path


def _run(date, commit, rows, device="GPU X"):
    return {"device": device, "date": date, "commit": commit, "source": "test", "rows": rows}


def test_page_is_rendered_from_the_committed_json():
    files = rt.result_files()
    assert files, "benchmarks/results/ holds no results"
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert rt.render(files) == page, ("docs/results.md differs from what benchmarks/results/*.json "
                                      "render to: run python scripts/results_table.py")


def test_every_row_names_device_date_and_commit():
    rows = rt.current_rows(rt.result_files())
    assert set(rows) <= set(rt.AREAS)
    for area_rows in rows.values():
        for r in area_rows:
            assert r["device"] and r["commit"]
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"])


def test_check_mode_notices_a_stale_page(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    _write(res / "a.json", _run("2026-01-02", "abc1234",
                                [{"area": "decode", "what": "x", "value": 1.5, "unit": "ms"}]))
    page = tmp_path / "results.md"
    args = ["--results", str(res), "--page", str(page)]
    assert rt.main(args + ["--check"]) == 1          # no page yet
    assert rt.main(args) == 0
    assert rt.main(args + ["--check"]) == 0
    page.write_text(page.read_text(encoding="utf-8") + "edited\n", encoding="utf-8")
    assert rt.main(args + ["--check"]) == 1


def test_newest_measurement_of_a_quantity_wins(tmp_path, rng):
    dates = sorted({f"2026-{m:02d}-{d:02d}" for m, d in zip(rng.integers(1, 13, 6),
                                                           rng.integers(1, 29, 6))})
    values = [round(float(v), 2) for v in rng.uniform(1, 100, len(dates))]
    order = [int(i) for i in rng.permutation(len(dates))]
    for i in order:                     # file names do not follow the dates
        _write(tmp_path / f"run{i:02d}-{rng.integers(1 << 30)}.json",
               _run(dates[i], f"c{i}", [{"area": "gemv", "what": "Q4_K 4096×4096",
                                         "value": values[i], "unit": "% of copy"},
                                        {"area": "gemv", "what": f"only in run {i}",
                                         "value": i, "unit": "µs"}]))
    rows = rt.current_rows(rt.result_files(tmp_path))["gemv"]
    shared = [r for r in rows if r["what"] == "Q4_K 4096×4096"]
    assert len(shared) == 1
    newest = len(dates) - 1
    assert (shared[0]["value"], shared[0]["date"], shared[0]["commit"]) == (
        values[newest], dates[newest], f"c{newest}")
    assert len(rows) == 1 + len(dates)          # every run's own row stays


def test_runs_of_one_day_are_ordered_by_their_time(tmp_path, rng):
    times = sorted({f"{h:02d}:{m:02d}:{s:02d}" for h, m, s in rng.integers(0, 60, (5, 3)) % [24, 60, 60]})
    row = {"area": "decode", "what": "step", "unit": "ms"}
    # names in the reverse order of the times, and one file without a time
    for i, t in enumerate(times):
        run = dict(_run("2026-05-05", f"t{i}", [dict(row, value=float(i))]), time=t)
        _write(tmp_path / f"{len(times) - i:02d}.json", run)
    _write(tmp_path / "zz-no-time.json", _run("2026-05-05", "none", [dict(row, value=-1.0)]))
    (r,) = rt.current_rows(rt.result_files(tmp_path))["decode"]
    assert (r["value"], r["commit"]) == (float(len(times) - 1), f"t{len(times) - 1}")


def test_a_row_may_carry_its_own_commit_and_date(tmp_path):
    _write(tmp_path / "a.json", _run("2026-03-01", "aaaaaaa", [
        {"area": "gemm", "what": "Q6_K", "value": 43.2, "unit": "µs", "commit": "fc90be6"},
        {"area": "gemm", "what": "Q8_0", "value": 35.3, "unit": "µs", "date": "2026-02-01"}]))
    rows = {r["what"]: r for r in rt.current_rows([tmp_path / "a.json"])["gemm"]}
    assert (rows["Q6_K"]["commit"], rows["Q6_K"]["date"]) == ("fc90be6", "2026-03-01")
    assert (rows["Q8_0"]["commit"], rows["Q8_0"]["date"]) == ("aaaaaaa", "2026-02-01")


def test_values_keep_their_written_decimals(rng):
    # three written decimals, the last not 0 (a range shows what its ends were written with)
    lo = round(int(rng.integers(100, 900)) / 100 + int(rng.integers(1, 10)) / 1000, 3)
    hi = round(lo + 2.0, 3)
    assert rt.fmt_value([lo, hi]) == f"{lo:.3f}–{hi:.3f}"
    assert rt.fmt_value(1.92, 3) == "1.920"
    assert rt.fmt_value(29962) == "29,962"
    assert rt.fmt_value(104.0) == "104.0"
    row = {"what": "w", "value": 12.70, "unit": "µs", "decimals": 2, "device": "d",
           "date": "2026-01-01", "commit": "c", "peer": {"name": "p", "value": 915.25}}
    assert "| 12.70 µs | p 915.25 µs |" in rt.render_row(row)
    row = dict(row, unit="% of copy", peer={"name": "cuBLAS", "time_ratio": 0.29, "decimals": 3})
    assert "| 12.70% of copy | cuBLAS, time ratio 0.290 |" in rt.render_row(row)


def test_numbers_in_names_sort_by_value():
    names = ["L = 16384", "L = 4096", "L = 1024", "L = 4,096 cached"]
    assert sorted(names, key=rt._natural) == ["L = 1024", "L = 4096", "L = 4,096 cached",
                                              "L = 16384"]


@pytest.mark.parametrize("run, message", [
    ({"device": "d", "date": "2026-1-2", "commit": "c", "source": "s",
      "rows": [{"area": "decode", "what": "x", "value": 1, "unit": "u"}]}, "YYYY-MM-DD"),
    ({"device": "d", "date": "2026-01-02", "commit": "c", "source": "s", "rows": []},
     "non-empty list"),
    ({"device": "d", "date": "2026-01-02", "commit": "c",
      "rows": [{"area": "decode", "what": "x", "value": 1, "unit": "u"}]}, "no 'source'"),
    (_run("2026-01-02", "c", [{"area": "nowhere", "what": "x", "value": 1, "unit": "u"}]),
     "unknown area 'nowhere'"),
    (_run("2026-01-02", "c", [{"area": "decode", "what": "x", "value": "1.9", "unit": "u"}]),
     "a number or [low, high]"),
    (_run("2026-01-02", "c", [{"area": "decode", "what": "x", "value": [2, 1], "unit": "u"}]),
     "a number or [low, high]"),
    (_run("2026-01-02", "c", [{"area": "decode", "what": "x", "value": 1}]), "no 'unit'"),
    (dict(_run("2026-01-02", "c", [{"area": "decode", "what": "x", "value": 1, "unit": "u"}]),
          time="9:30"), "HH:MM or HH:MM:SS"),
    (_run("2026-01-02", "c", [{"area": "decode", "what": "x", "value": 1, "unit": "u",
                               "speed": 3}]), "unknown key(s) speed"),
    (_run("2026-01-02", "c", [{"area": "decode", "what": "x", "value": 1, "unit": "u",
                               "peer": {"name": "p"}}]), "'value' or a 'time_ratio'"),
    (_run("2026-01-02", "c", [{"area": "decode", "what": "x", "value": 1, "unit": "u"},
                              {"area": "decode", "what": "x", "value": 2, "unit": "u"}]),
     "appears twice"),
])
def test_bad_files_are_refused_naming_the_problem(tmp_path, run, message):
    f = _write(tmp_path / "bad.json", run)
    with pytest.raises(rt.ResultsError) as e:
        rt.load_run(f)
    assert message in str(e.value) and "bad.json" in str(e.value)


def test_make_bench_output_becomes_one_results_file(tmp_path, monkeypatch, rng):
    """bench_all's own writer (its GPU parts replaced by fixed results of the
    shape they return) -> --add -> rows on the page."""
    from benchmarks import bench_all
    share, ratio, us = (round(float(x), 4) for x in rng.uniform(0.5, 1.1, 3))
    fake = {
        "gemv": {"gemv": [{"qtype": "Q4_K", "m": 14336, "k": 4096, "copy_share": share,
                           "vs_cublas": ratio}], "swiglu": []},
        "gemm": {"rows": [{"qtype": "Q6_K", "m": 4096, "k": 4096, "t": 512,
                           "f16": {"us": 40 * us}, "cublas_f16": {"us": 25 * us}},
                          {"qtype": "Q6_K", "m": 4096, "k": 4096, "t": 64,
                           "f16": {"us": 9.0}, "cublas_f16": {"us": 8.0}}]},
        "model": {"rows": [{"context": 128, "mode": "graph", "config": "default",
                            "seconds_per_token": 1.9e-3 * us, "share_of_floor": share},
                           {"context": 128, "mode": "eager", "config": "default",
                            "seconds_per_token": 5e-3, "share_of_floor": 0.3}]},
    }
    monkeypatch.setattr(bench_all, "_run", lambda name: fake[name])
    monkeypatch.setattr(bench_all, "_device_name", lambda: "GPU Y")
    out = tmp_path / "bench-results"
    skip = ",".join(p for p in bench_all.PARTS if p not in fake)
    assert bench_all.main([str(out), "--skip", skip]) == 0

    res = tmp_path / "results"
    page = tmp_path / "results.md"
    assert rt.main(["--add", str(out), "--results", str(res), "--page", str(page)]) == 0
    (added,) = res.glob("*.json")
    run = rt.load_run(added)
    assert run["device"] == "GPU Y" and re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"])
    assert re.fullmatch(r"\d{2}:\d{2}:\d{2}", run["time"])
    rows = {(r["area"], r["what"]): r for r in run["rows"]}
    assert rows[("gemv", "Q4_K 14336×4096")]["value"] == round(100 * share, 1)
    assert rows[("gemm", "Q6_K 4096×4096")]["value"] == round(40 * us, 1)
    assert rows[("decode", "8B-shaped Q4_K decode step, context 128")]["value"] == round(
        1.9 * us, 3)
    assert len(rows) == 3                        # T = 64 and eager rows are not reported
    text = page.read_text(encoding="utf-8")
    assert f"{100 * share:.1f}% of copy" in text and "GPU Y" in text
    # a second --add of the same run would overwrite it: refused
    assert rt.main(["--add", str(out), "--results", str(res), "--page", str(page)]) == 2


def test_add_refuses_a_run_without_a_device(tmp_path):
    out = tmp_path / "bench-results"
    out.mkdir()
    (out / "gemv.json").write_text(json.dumps({
        "meta": {"date": "2026-01-02", "commit": "abc", "device": None},
        "result": {"gemv": [{"qtype": "Q8_0", "m": 4096, "k": 4096, "copy_share": 0.7,
                             "vs_cublas": 0.5}]}}), encoding="utf-8")
    with pytest.raises(rt.ResultsError, match="give --device"):
        rt.from_bench(out)
    assert rt.from_bench(out, device="GPU Z")["device"] == "GPU Z"
