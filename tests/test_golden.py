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


def _check_golden(path: Path, text: str, what: str):
    """``text`` equals the golden file ``path`` (rewritten under `make golden`)."""
    rel = path.relative_to(GOLDEN)
    if UPDATE:
        if UNDER_CI:
            pytest.fail("PTXGEN_UPDATE_GOLDEN=1 is set under CI (CI=true): golden files are "
                        "only rewritten by `make golden` on a developer's machine, never by a "
                        "check", pytrace=False)
        old = path.read_text() if path.exists() else None
        if old != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            pytest.skip(f"rewrote golden/{rel} (PTXGEN_UPDATE_GOLDEN=1); review the diff")
        return
    assert path.exists(), f"no golden file {path}; run `make golden` and review it"
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(
            expected.splitlines(True), text.splitlines(True),
            fromfile=f"golden/{rel}", tofile=f"emitted {what}"))
        pytest.fail(f"emitted {what} differs from its golden file:\n{diff}", pytrace=False)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_golden_ptx(name):
    _check_golden(GOLDEN / f"{name}.ptx", _emitted(name), f"PTX of {name}")


#: the canonical tape: a tiny Llama's decode step cut for 8 SMs (the shapes,
#: not the weights, decide the tape and the persistent kernel)
TAPE_MODEL = dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
                  context_length=256)


@pytest.fixture(scope="module")
def canonical_tape(tmp_path_factory):
    pytest.importorskip("gguf")
    from ptxgen.llm.gguf.synth import write_synthetic_llama
    from ptxgen.llm.tape import build_tape, decode_graph, fused_kernel
    path = tmp_path_factory.mktemp("tape") / "tiny.gguf"
    write_synthetic_llama(str(path), seed=0, **TAPE_MODEL)
    g = decode_graph(str(path), sm_count=8, capacity=64)
    return build_tape(g, 8).dump(instructions=True) + "\n", fused_kernel(g, "sm_90")[0].ptx


def test_golden_tape(canonical_tape):
    """The tiny Llama's greedy decode tape, every instruction listed."""
    _check_golden(GOLDEN / "tape" / "tiny_llama_greedy.txt", canonical_tape[0],
                  "tape of the tiny Llama")


def test_golden_persistent_kernel(canonical_tape):
    """The persistent kernel that runs that tape."""
    _check_golden(GOLDEN / "tape" / "tiny_llama_persistent.ptx", canonical_tape[1],
                  "persistent kernel of the tiny Llama")


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
