"""Golden PTX: the emitted text of every registered canonical spec equals
tests/golden/<name>.ptx.  `make golden` (PTXGEN_UPDATE_GOLDEN=1) rewrites
them after a reviewed change; under CI (``CI=true``) the variable is refused,
so a rewrite can never pass for a check there.  Outside CI a rewrite that
changed a file is reported as a skip naming the file, never as a pass."""

import difflib
import functools
import os
from pathlib import Path

import pytest

from ptxgen import registry

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("PTXGEN_UPDATE_GOLDEN") == "1"
UNDER_CI = os.environ.get("CI", "").lower() == "true"
SPECS = registry.canonical_specs()


@functools.lru_cache(maxsize=None)
def _emitted(name):
    """The emitted PTX of canonical spec ``name`` (built once a session)."""
    fam, spec = SPECS[name]
    return fam.build(spec).to_ptx()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_golden_ptx(name):
    text = _emitted(name)
    path = GOLDEN / f"{name}.ptx"
    if UPDATE:
        if UNDER_CI:
            pytest.fail("PTXGEN_UPDATE_GOLDEN=1 is set under CI (CI=true): golden files are "
                        "only rewritten by `make golden` on a developer's machine, never by a "
                        "check", pytrace=False)
        old = path.read_text() if path.exists() else None
        if old != text:
            GOLDEN.mkdir(exist_ok=True)
            path.write_text(text)
            pytest.skip(f"rewrote golden/{name}.ptx (PTXGEN_UPDATE_GOLDEN=1); review the diff")
        return
    assert path.exists(), f"no golden file {path}; run `make golden` and review it"
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(
            expected.splitlines(True), text.splitlines(True),
            fromfile=f"golden/{name}.ptx", tofile=f"emitted {name}"))
        pytest.fail(f"emitted PTX of {name} differs from its golden file:\n{diff}", pytrace=False)


def test_no_stale_golden_files():
    names = {p.stem for p in GOLDEN.glob("*.ptx")}
    stale = sorted(names - set(SPECS))
    assert not stale, f"golden files with no canonical spec: {stale} (delete them)"


WGMMA_SPECS = sorted(n for n in SPECS if "wgmma.mma_async" in _emitted(n))


@pytest.mark.parametrize("relocatable", [False, True], ids=["whole", "relocatable"])
@pytest.mark.parametrize("name", WGMMA_SPECS)
def test_wgmma_is_not_serialized(ptxas, name, relocatable):
    """ptxas keeps every canonical warpgroup kernel's wgmma asynchronous:
    no "Potential Performance Loss" note (C7509 / C7520: the wgmma
    instructions serialized), both as a whole program and as relocatable
    code (``-c``), which is how the driver's linker, the disk cache's path,
    compiles the PTX: an IEEE ``div.rn`` there is an extern call, and ptxas
    then waits after every wgmma."""
    from ptxgen.ptxas import assemble
    _, reports = assemble(_emitted(name), "sm_90a",
                          extra_args=("-c",) if relocatable else ())
    assert reports, "ptxas reported no kernel"
    notes = {r.name: r.advisories for r in reports if r.advisories}
    assert not notes, f"ptxas serializes wgmma in {name}: {notes}"
