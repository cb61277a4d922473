"""pyproject.toml lists every package explicitly (kernels/ and driver/ install
inside ptxgen): a subpackage missing from the list would import from the
working tree and be absent from a wheel."""

import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")       # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = {v: k for k, v in cfg["package-dir"].items()}
    found = set()
    for folder, name in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name,) + rel))
    assert found == listed, (sorted(found - listed), sorted(listed - found))
