#!/usr/bin/env python3
"""Mutation check: apply each mutant of tests/mutants.toml to a copy of the
tree and run the tests that must catch it; exit 1 if any mutant survives.

A mutant names a file, a snippet that must occur exactly once in it, its
replacement, and the pytest selection (paths, optionally ``-k``) that must
fail.  The copy holds the tracked and untracked-but-not-ignored files of
this tree; the packages that pyproject.toml's ``package-dir`` places
inside ``ptxgen`` from the top of the tree (``kernels/``, ``driver/``,
``llm/``, ``testing/``) are linked into the copy's ``ptxgen/`` and
PYTHONPATH points at the copy, so the copy's modules are the ones imported
(not the editable install's).
Every selection first passes on the unmutated copy (a baseline), so a
failure can only come from the mutant.

Usage: ``python scripts/mutate.py [--only NAME ...] [--list]``; prints a
table and the elapsed time.  ``--control`` also runs a kv_append mutant
against the argmax tests, which must *not* fail (while its own tests kill
it: the mutation, not the copy, is what fails them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "tests" / "mutants.toml"


def linked_packages(root=ROOT):
    """``{subpackage: folder}`` for the subpackages of ``ptxgen`` that live
    outside ``ptxgen/`` (pyproject.toml's ``tool.setuptools.package-dir``)."""
    with open(root / "pyproject.toml", "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    out = {}
    for name, folder in dirs.items():
        parts = name.split(".")
        if parts[0] == "ptxgen" and len(parts) == 2 and folder != f"ptxgen/{parts[1]}":
            out[parts[1]] = folder
    return out


PYTEST = ["-x", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "-k", "not cuda"]


def load(path=MUTANTS):
    """The mutants of ``path``: dicts with name, file, old, new, tests."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    out = []
    for m in data["mutant"]:
        missing = {"name", "file", "old", "new", "tests"} - set(m)
        if missing:
            raise SystemExit(f"{path}: mutant {m.get('name', '?')!r} lacks {sorted(missing)}")
        if m["old"] == m["new"]:
            raise SystemExit(f"{path}: mutant {m['name']!r} changes nothing")
        out.append(m)
    names = [m["name"] for m in out]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: duplicate mutant names")
    return out


def copy_tree(dst: Path):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    for pkg, folder in linked_packages().items():
        (dst / "ptxgen" / pkg).symlink_to(dst / folder, target_is_directory=True)


def run_tests(tree: Path, selection: str, timeout=900):
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    env.pop("PTXGEN_UPDATE_GOLDEN", None)
    cmd = [sys.executable, "-m", "pytest", *PYTEST, *selection.split()]
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        rc, out = -1, "timeout"
    return rc, out, time.perf_counter() - t


def check_imports(tree: Path):
    env = dict(os.environ, PYTHONPATH=str(tree))
    names = ["ptxgen", "ptxgen.emu"] + [f"ptxgen.{p}" for p in linked_packages()]
    code = ("import importlib; print(*(importlib.import_module(n).__file__ for n in "
            f"{names!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    wrong = [p for p in out if not Path(p).resolve().is_relative_to(tree.resolve())]
    if wrong:
        raise SystemExit(f"the copy does not import its own modules: {wrong}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="run only these mutants (by name)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--control", action="store_true",
                    help="also check that a kv_append mutant survives the argmax tests")
    args = ap.parse_args(argv)
    mutants = load()
    if args.only:
        unknown = set(args.only) - {m["name"] for m in mutants}
        if unknown:
            raise SystemExit(f"unknown mutants: {sorted(unknown)}")
        mutants = [m for m in mutants if m["name"] in args.only]
    if args.list:
        for m in mutants:
            print(f"{m['name']:32} {m['file']:28} {m['tests']}")
        return 0
    start = time.perf_counter()
    rows, bad = [], 0
    with tempfile.TemporaryDirectory(prefix="ptxgen-mutate-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        check_imports(tree)
        for m in mutants:                       # every snippet occurs exactly once
            n = (tree / m["file"]).read_text().count(m["old"])
            if n != 1:
                raise SystemExit(f"mutant {m['name']}: snippet occurs {n} times in {m['file']}")
        for sel in sorted({m["tests"] for m in mutants}):
            rc, out, dt = run_tests(tree, sel)
            if rc != 0:
                print(out[-3000:])
                raise SystemExit(f"baseline fails ({rc}) for: {sel}")
        if args.control:
            # a kernel mutant its own tests kill, against another family's tests
            m = next(m for m in mutants if m["file"] == "kernels/kv_append.py")
            path = tree / m["file"]
            orig = path.read_text()
            path.write_text(orig.replace(m["old"], m["new"]))
            rc, _, _ = run_tests(tree, "tests/kernels/test_argmax.py")
            path.write_text(orig)
            print(f"control: mutant {m['name']} against tests/kernels/test_argmax.py -> rc {rc} "
                  f"({'survives, as it should' if rc == 0 else 'FAILS: the copy is not isolated?'})")
            bad += rc != 0
        for m in mutants:
            path = tree / m["file"]
            orig = path.read_text()
            path.write_text(orig.replace(m["old"], m["new"]))
            try:
                rc, out, dt = run_tests(tree, m["tests"])
            finally:
                path.write_text(orig)
            status = {1: "killed", 0: "SURVIVED"}.get(rc, f"ERROR rc={rc}")
            if rc != 1:
                bad += 1
                tail = [ln for ln in out.splitlines() if ln.strip()][-5:]
                print("\n".join(f"    {ln}" for ln in tail))
            rows.append((m["name"], m["file"], status, dt))
            print(f"{m['name']:34} {m['file']:28} {status:10} {dt:6.1f} s", flush=True)
    total = time.perf_counter() - start
    killed = sum(r[2] == "killed" for r in rows)
    print(f"\n{killed}/{len(rows)} mutants killed in {total:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
