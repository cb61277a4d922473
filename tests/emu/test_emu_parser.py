"""Parser: every registered kernel round-trips; what ptxgen never emits is
refused with the construct and its line."""

import re

import pytest

from ptxgen import emu, registry
from ptxgen.emu.parser import parse_module

CANONICAL = registry.canonical_specs()


def _norm(s):
    return re.sub(r"\s+", " ", s.strip())


@pytest.mark.parametrize("cname", sorted(CANONICAL))
def test_canonical_kernels_round_trip(cname):
    fam, spec = CANONICAL[cname]
    module = fam.build(spec)
    text = module.to_ptx()
    kernels = parse_module(text)
    assert [k.name for k in module.kernels] == list(kernels)
    lines = text.split("\n")
    externs = {s.name for kb in module.kernels for s in kb.shared if s.count is None}
    for kb in module.kernels:
        kt = kernels[kb.name]
        # one statement per emitted instruction (+ the trailing ret), each
        # naming the line it came from, with the text of that line
        start = next(i for i, ln in enumerate(lines) if ln == f".visible .entry {kb.name}(")
        end = lines.index("}", start)
        emitted = [ln for ln in lines[start:end] if ln.startswith("\t")
                   and not ln.startswith("\t.") and not ln.strip().startswith("//")
                   and ln.strip() not in ("",)]
        assert len(kt.body) == len(emitted)
        for st in kt.body:
            assert _norm(lines[st.line - 1]) == _norm(st.text)
        for label, idx in kt.labels.items():
            assert any(ln == f"{label}:" for ln in lines)
            assert 0 <= idx <= len(kt.body)
        assert [p.name for p in kt.params] == [p.name for p in kb.params]
        # a dynamic (.extern) array is declared at module scope: every kernel
        # of the module sees it
        assert ({s.name for s in kb.shared} | externs) == {s[0] for s in kt.shared}
        # everything parsed also compiles
        mod = emu.Module.from_ptx(text)
        assert mod.function(kb.name).compiled.ops


HEADER = ".version 7.8\n.target sm_80\n.address_size 64\n\n"


def _kernel(body, decls=".reg .u32 %r<4>;"):
    return HEADER + ".visible .entry k(\n\t.param .u32 n\n)\n{\n\t" + decls + "\n" + body + "\n}\n"


@pytest.mark.parametrize("body,what", [
    ("\tsuld.b.1d.b32.trap {%r1}, [%r2, {%r3}];", "suld"),
    ("\tmov.u32 %r1, %r9;", "%r9 is not declared"),
    ("\tadd.q32 %r1, %r2, %r3;", "q32"),
    ("\tadd.u32 %r1, %r2;", "operands"),
    ("\t.local .align 4 .b8 buf[16];", ".local"),
    ("\tbra $L_nowhere;", "undefined label"),
    ("\tmov.u32 %r1, 1.5e;", "operand"),
    ("\tld.global.v8.f32 %r1, [%r2];", "v8"),
])
def test_refused_constructs_name_their_line(body, what):
    text = _kernel(body)
    bad_line = text.split("\n").index(body) + 1
    with pytest.raises(emu.PtxParseError) as ei:
        emu.Module.from_ptx(text)
    assert what in str(ei.value)
    assert ei.value.line == bad_line
    assert f"line {bad_line}" in str(ei.value)


def test_handwritten_forms_parse():
    text = HEADER + """.visible .entry k(
\t.param .u64 .ptr .global .align 4 x,
\t.param .u32 n
)
.maxntid 64, 1, 1
{
\t.reg .pred %p<2>;
\t.reg .b32 %r<6>;
\t.reg .b64 %rd<3>;
\t.reg .f32 %f<3>;
\t.shared .align 4 .f32 tile[64];
\t.extern .shared .align 16 .b8 dyn[];

\tld.param.u64 %rd1, [x];
\tmov.f32 %f1, 0f3F800000;
\tmov.f32 %f2, 0fBF800000;
\tmov.u32 %r1, -5;
\tmov.u32 %r2, 0xFF;
\tmov.u32 %r3, tile;
\tld.shared.f32 %f1, [tile+8];
DONE: ret;
}
"""
    kt = parse_module(text)["k"]
    ops = [s.operands for s in kt.body]
    assert ops[1][1] == ("imm", "f32", 0x3F800000)
    assert ops[3][1] == ("imm", "int", -5)
    assert ops[4][1] == ("imm", "int", 255)
    assert ops[5][1] == ("sym", "tile")
    assert ops[6][1] == ("addr", ("sym", "tile"), 8)
    assert kt.labels["DONE"] == 7
    assert kt.shared == [("tile", 4, 256), ("dyn", 16, None)]
    assert kt.directives[".maxntid"] == (64, 1, 1)
