"""The command line: list, dump, check, errors and exit codes."""

import subprocess
import sys

import pytest

from ptxgen import registry
from ptxgen.cli import main


def run(*args):
    p = subprocess.run([sys.executable, "-m", "ptxgen", *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def test_list_shows_every_canonical_spec(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in registry.canonical_specs():
        assert name in out


def test_dump_matches_builder_and_honours_overrides(capsys):
    fam, spec = registry.canonical_specs()["vector_add"]
    assert main(["dump", "vector_add", "--set", "block=128", "--target", "sm_90",
                 "--color", "never"]) == 0
    out = capsys.readouterr().out
    import attrs
    assert out == fam.build(attrs.evolve(spec, block=128, target="sm_90")).to_ptx()
    assert ".maxntid 128, 1, 1" in out and ".target sm_90" in out


def test_dump_to_file_and_annotate(tmp_path):
    f = tmp_path / "k.ptx"
    assert main(["dump", "block_reduce", "--annotate", "-o", str(f)]) == 0
    assert "// reduce.py:" in f.read_text()


def test_dump_colour_always():
    pytest.importorskip("pygments")
    rc, out, _ = run("dump", "vector_add", "--color", "always")
    assert rc == 0 and "\x1b[" in out


@pytest.mark.parametrize("args,needle", [
    (("dump", "no_such_kernel"), "unknown kernel 'no_such_kernel'; valid: "),
    (("dump", "vector_add", "--set", "blok=64"), "has no field 'blok'; valid: dtype, block, target"),
    (("dump", "vector_add", "--set", "block=33"), "block must be a multiple of 32"),
    (("dump", "vector_add", "--set", "block=abc"), "expected a int"),
    (("dump", "vector_add", "--set", "noequals"), "--set takes key=value"),
])
def test_usage_errors_exit_2(args, needle):
    rc, out, err = run(*args)
    assert rc == 2 and needle in err and out == ""


def test_unknown_target_is_argparse_error():
    rc, _, err = run("dump", "vector_add", "--target", "sm_70")
    assert rc == 2 and "invalid choice: 'sm_70'" in err


def test_check_reports_resources():
    from ptxgen.ptxas import PtxasNotFound, find_ptxas
    try:
        find_ptxas()
    except PtxasNotFound:
        pytest.skip("no ptxas")
    rc, out, err = run("check", "block_reduce", "--target", "sm_90")
    assert rc == 0, err
    assert "assembles for sm_90" in out
    line = next(l for l in out.splitlines() if l.startswith("block_reduce_sum_f32"))
    regs, spill_st, spill_ld, stack, shared, local = map(int, line.split()[1:])
    assert regs > 0 and spill_st == 0 and shared == 32 and local == 0


def test_check_bad_ptx_file_exits_1(tmp_path):
    from ptxgen.ptxas import PtxasNotFound, find_ptxas
    try:
        find_ptxas()
    except PtxasNotFound:
        pytest.skip("no ptxas")
    fam, spec = registry.canonical_specs()["vector_add"]
    text = fam.build(spec).to_ptx().replace("add.rn.f32", "add.rn.f33")
    f = tmp_path / "bad.ptx"
    f.write_text(text)
    rc, out, err = run("check", str(f))
    assert rc == 1 and "add.rn.f33" in err and "PTX line" in err


def test_every_listed_family_dumps_and_assembles(tmp_path, capsys):
    """`dump FAMILY` for every family in `list` gives PTX ptxas accepts: the
    text of a canonical spec that tests/test_ptxas.py assembles for the
    target, or else assembled here.  A family built only for an
    arch-specific target (sm_90a: warpgroup MMA) dumps for that target and
    refuses the others with an error that names it."""
    from ptxgen.ptxas import PtxasNotFound, assemble, find_ptxas
    try:
        find_ptxas()
        have_ptxas = True
    except PtxasNotFound:
        have_ptxas = False
    for name, fam in registry.families().items():
        out = tmp_path / f"{name}.ptx"
        own = next(iter(fam.canonical.values())).target if fam.canonical else None
        if own is not None and own.endswith("a"):
            for target in ("sm_80", "sm_90"):
                capsys.readouterr()
                assert main(["dump", name, "--target", target, "-o", str(out)]) == 2, name
                assert f"needs target {own}" in capsys.readouterr().err, name
            targets = (own,)
        else:
            targets = ("sm_80", "sm_90")
        for target in targets:
            assert main(["dump", name, "--target", target, "-o", str(out)]) == 0, name
            text = out.read_text()
            if have_ptxas and text != _assembled_by_test_ptxas(fam, target):
                assemble(text, target)


def _assembled_by_test_ptxas(fam, target):
    """The PTX test_canonical_spec_assembles gives ptxas for the family's
    first canonical spec on ``target`` (None where it has none)."""
    import attrs
    if not fam.canonical:
        return None
    try:
        spec = attrs.evolve(next(iter(fam.canonical.values())), target=target)
    except ValueError:
        return None
    return fam.build(spec).to_ptx()


def test_dump_of_a_model_file_prints_its_tape_and_persistent_kernel(tmp_path):
    """`dump MODEL.gguf` (and `tape MODEL.gguf --ptx`): the decode step's
    tape, then the PTX of the persistent kernel that runs it, the same as
    the library builds; the SM count the tape is cut for is honoured."""
    pytest.importorskip("gguf")
    from ptxgen.llm.gguf.synth import write_synthetic_llama
    from ptxgen.llm.tape import build_tape, decode_graph, fused_kernel
    path = tmp_path / "tiny.gguf"
    write_synthetic_llama(str(path), seed=3, n_layers=1, hidden=256, ffn=512, n_heads=4,
                          n_kv_heads=2, vocab=512, context_length=256)
    rc, out, err = run("dump", str(path), "--sm-count", "4")
    assert rc == 0, err
    g = decode_graph(str(path), sm_count=4)
    assert out == build_tape(g, 4).dump() + "\n" + fused_kernel(g, "sm_90")[0].ptx
    rc, tape_only, err = run("tape", str(path), "--sm-count", "4")
    assert rc == 0 and out.startswith(tape_only) and ".entry" not in tape_only, err
    rc, _, err = run("dump", str(tmp_path / "missing.gguf"))
    assert rc == 2 and err.startswith("error: ") and "missing.gguf" in err
    assert "Traceback" not in err
