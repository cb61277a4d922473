"""Unit tests of the builder: types, operands, errors at the user's line,
control flow, emission details and determinism."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import ptxgen
from ptxgen import types as T
from ptxgen.errors import PtxBuildError, PtxTypeError, PtxVerifyError, TargetError
from ptxgen.types import b32, f16, f16x2, f32, f64, pred, s32, u8, u32, u64

from backends import line_of

HERE = os.path.basename(__file__)


def _kernel(target="sm_80"):
    m = ptxgen.Module(target)
    return m, m.kernel("t")


def _line_of(marker):
    """Line number of the line in this file that contains ``marker``."""
    return line_of(__file__, marker)


# ---------------------------------------------------------------- types
def test_type_lookup_and_properties():
    assert T.type_by_name("u32") is u32
    assert T.type_by_name(".f16x2") is f16x2
    assert u32.bits == 32 and u32.bytes == 4 and u32.is_int and not u32.is_signed
    assert s32.is_signed and f32.is_float and pred.is_pred and f16x2.is_packed
    assert not u8.can_be_register and u32.can_be_register
    with pytest.raises(ValueError, match="unknown PTX type 'u33'"):
        T.type_by_name("u33")


@pytest.mark.parametrize("a,b,ok", [
    (u32, s32, True), (b32, f32, True), (u32, f32, False), (u32, u64, False),
    (f16, T.b16, True), (pred, b32, False), (f32, f32, True), (f64, T.b64, True),
])
def test_operand_compatibility(a, b, ok):
    assert T.compatible(a, b) is ok


@pytest.mark.parametrize("value,ty,text", [
    (1.0, f32, "0f3F800000"), (-2.5, f32, "0fC0200000"), (0.1, f64, "0d3FB999999999999A"),
    (7, u32, "7"), (0xFFFFFFFF, u32, "0xFFFFFFFF"), (-1, s32, "-1"), (-1, u32, "0xFFFFFFFF"),
])
def test_immediates_are_exact(value, ty, text):
    from ptxgen.values import Imm
    assert Imm(value, ty).render() == text


def test_immediate_out_of_range():
    from ptxgen.values import Imm
    with pytest.raises(PtxTypeError, match="does not fit in u16"):
        Imm(70000, T.u16)


# ---------------------------------------------------------- operators
def test_operators_pick_opcodes():
    m, k = _kernel()
    a = k.param("a", u32)
    b = k.param("b", u32)
    x = k.param("x", f32)
    ops = [a + b, a - b, a * b, a // b, a % b, a & b, a | b, a ^ b, a << 3, a >> b,
           ~a, x * 2.0, x / x, -x, a < b, x >= 1.0, a.eq(b), a.ne(7)]
    assert all(isinstance(o, ptxgen.values.Reg) for o in ops)
    text = m.to_ptx()
    for opcode in ("add.u32", "sub.u32", "mul.lo.u32", "div.u32", "rem.u32", "and.b32",
                   "or.b32", "xor.b32", "shl.b32", "shr.u32", "not.b32", "mul.rn.f32",
                   "div.rn.f32", "neg.f32", "setp.lt.u32", "setp.ge.f32", "setp.eq.u32",
                   "setp.ne.u32"):
        assert f"\t{opcode} " in text, opcode
    assert "mul.rn.f32 \t%f2, %f1, 0f40000000;" in text


def test_float_arithmetic_is_rounded_as_written_unless_contraction_is_asked():
    m, k = _kernel()
    x = k.param("x", f32)
    k.add(k.mul(x, x), x)
    k.add(k.mul(x, x, contract=True), x, contract=True)
    text = m.to_ptx()
    assert "mul.rn.f32" in text and "add.rn.f32" in text
    assert "\tmul.f32 " in text and "\tadd.f32 " in text


def test_signed_shift_is_arithmetic():
    m, k = _kernel()
    a = k.param("a", s32)
    a >> 1
    assert "shr.s32" in m.to_ptx()


def test_var_updates_in_place():
    m, k = _kernel()
    n = k.param("n", u32)
    acc = k.var(u32, 0)
    acc += n
    acc.set(5)
    acc <<= 1
    text = m.to_ptx()
    assert re.search(r"add\.u32 \t(%r\d+), \1, %r1;", text)
    assert re.search(r"shl\.b32 \t(%r\d+), \1, 1;", text)


def test_vector_load_store_and_packing():
    m, k = _kernel("sm_90")
    p = k.param_ptr("p", f32, align=16)
    v = k.ld(p[0], vec=4, nc=True)
    assert len(v) == 4
    k.st(p[4], v)
    h = k.const(f16, 1.0)
    hh = k.pack(f16x2, h, h)
    lo, hi = k.unpack(hh, f16)
    text = m.to_ptx()
    assert "ld.global.nc.v4.f32 \t{%f1, %f2, %f3, %f4}, [%rd2];" in text
    assert "st.global.v4.f32 \t[%rd2+16], {%f1, %f2, %f3, %f4};" in text
    assert "mov.b16 \t%h1, 0x3C00;" in text
    assert "mov.b32 \t%hh1, {%h1, %h1};" in text
    assert "mov.b32 \t{%h2, %h3}, %hh1;" in text


def test_static_shared_over_48k_refused_at_the_users_line():
    m = ptxgen.Module("sm_90")
    with m.kernel("big") as k:
        k.shared_array("a", f32, 8192)                  # 32 KB
        with pytest.raises(PtxBuildError, match=r"test_builder\.py:\d+: shared array 'b' "
                           r"brings the static shared memory of kernel 'big' to 65536 bytes"):
            k.shared_array("b", f32, 8192)
        k.shared_array("c", f32, 4096)                  # 48 KB in all is allowed
        k.dynamic_shared("dyn", f32)                    # and dynamic memory beside it


def test_shared_arrays_and_dynamic_shared():
    m = ptxgen.Module("sm_80")
    with m.kernel("a") as k:
        s = k.shared_array("tile", f32, 64, align=16)
        d = k.dynamic_shared("dyn", f32)
        i = k.tid.x
        k.st(s[i], k.ld(d[i]))
    with m.kernel("b") as k2:
        k2.dynamic_shared("dyn", f32, align=8)
    text = m.to_ptx()
    assert "\t.shared .align 16 .b8 tile[256];" in text
    # one module-scope declaration at the larger alignment: the default, a
    # shared-memory line (target.SHARED_LINE), against kernel b's 8
    assert text.count(".extern .shared") == 1
    assert ".extern .shared .align 128 .b8 dyn[];" in text
    assert "ld.shared.f32" in text and "st.shared.f32" in text


def test_directives():
    m = ptxgen.Module("sm_90")
    with m.kernel("k1", maxntid=(128, 2), minnctapersm=4):
        pass
    with m.kernel("k2", reqntid=64):
        pass
    text = m.to_ptx()
    assert ".maxntid 128, 2, 1\n.minnctapersm 4" in text
    assert ".reqntid 64, 1, 1" in text
    with pytest.raises(PtxBuildError, match="minnctapersm needs"):
        m.kernel("k3", minnctapersm=2)


# ------------------------------------------------------- errors at the user's line
def test_type_error_names_callers_line():
    m, k = _kernel()
    a = k.param("a", u32)
    x = k.param("x", f32)
    with pytest.raises(PtxTypeError) as ei:
        a + x  # MARK-type-error
    msg = str(ei.value)
    assert f"{HERE}:{_line_of('MARK-type-error')}:" in msg
    assert "u32 and f32" in msg and "convert one explicitly" in msg


def test_mixing_u32_u64_refused():
    m, k = _kernel()
    a = k.param("a", u32)
    b = k.param("b", u64)
    with pytest.raises(PtxTypeError, match=r"u32 and u64") as ei:
        a * b  # MARK-u64
    assert ei.value.loc.lineno == _line_of("MARK-u64")
    assert os.path.basename(ei.value.loc.filename) == HERE


def test_wide_register_through_16_bit_pointer_refused():
    # st.v4.b16 of b32 registers is legal PTX that keeps each register's low
    # half: through an f16 pointer with the type left to the pointer, refuse
    m, k = _kernel("sm_90")
    p = k.param_ptr("p", f16, align=16)
    w = k.pack(f16x2, k.const(f16, 1.0), k.const(f16, 2.0))
    with pytest.raises(PtxTypeError, match=r"low 16 bits; pass ty=") as ei:
        k.st(p[0], (w, w, w, w))  # MARK-wide-st
    assert ei.value.loc.lineno == _line_of("MARK-wide-st")
    k.st(p[0], (w, w, w, w), "b32")             # the type given: 16 bytes, as asked
    k.st(p[8], k.const(f16, 3.0))               # an f16 register through it: fine
    text = m.to_ptx()
    assert "st.global.v4.b32 \t[%rd2], {%hh1, %hh1, %hh1, %hh1};" in text
    assert "st.global.b16 \t[%rd2+16]" in text


def test_float_literal_into_int_refused():
    m, k = _kernel()
    a = k.param("a", u32)
    with pytest.raises(PtxTypeError, match="float 1.5 used where u32"):
        a + 1.5


def test_explicit_emit_type_error():
    m, k = _kernel()
    a = k.param("a", u32)
    d = k.reg(f32)
    with pytest.raises(PtxTypeError, match=r"add\.f32 got a u32 operand") as ei:
        k.emit("add", [], [f32], [d, a, a])  # MARK-emit
    assert ei.value.loc.lineno == _line_of("MARK-emit")


def test_bad_modifier_and_type_suffix():
    m, k = _kernel()
    a = k.param("a", u32)
    with pytest.raises(PtxTypeError, match=r"modifier \.bogus is unknown"):
        k.emit("add", ["bogus"], [u32], [k.reg(u32), a, a])
    with pytest.raises(PtxTypeError, match=r"out of order"):
        k.emit("ld", ["nc", "global"], [u32], [k.reg(u32), a])
    with pytest.raises(PtxTypeError, match=r"shl does not take \.f32"):
        k.emit("shl", [], [f32], [k.reg(f32), a, a])


def test_read_before_write():
    m, k = _kernel()
    v = k.var(u32)
    with pytest.raises(PtxBuildError, match="read before anything writes it") as ei:
        v + 1  # MARK-undef
    assert ei.value.loc.lineno == _line_of("MARK-undef")


def test_write_once_and_read_only():
    m, k = _kernel()
    a = k.param("a", u32)
    r = a + 1
    with pytest.raises(PtxBuildError, match="written twice"):
        k.add(a, 2, out=r)
    from ptxgen.values import SpecialReg
    with pytest.raises(PtxBuildError, match="read-only operand %tid.x"):
        k.emit("mov", [], [u32], [SpecialReg("%tid.x", u32), a])
    with pytest.raises(PtxBuildError, match="not a Var"):
        k.assign(r, 3)


def test_register_of_another_kernel():
    m = ptxgen.Module()
    k1 = m.kernel("one")
    a = k1.param("a", u32)
    k2 = m.kernel("two")
    with pytest.raises(PtxBuildError, match="belongs to kernel one, not two"):
        k2.add(a, 1)


def test_param_loaded_with_wrong_type():
    from ptxgen.values import Address
    m, k = _kernel()
    k.param("n", u32)
    sym = k.param_symbol("n")
    with pytest.raises(PtxTypeError, match="parameter n is u32 but is loaded as u64") as ei:
        k.emit("ld", ["param"], [u64], [k.reg(u64), Address(sym, 0, "param")])  # MARK-param
    assert ei.value.loc.lineno == _line_of("MARK-param")


def test_duplicate_and_undefined_labels():
    m, k = _kernel()
    lab = k.label("again")
    k.place(lab)
    with pytest.raises(PtxBuildError, match="placed twice"):
        k.place(lab)
    m2, k2 = _kernel()
    p = k2.param("a", u32) < 3
    k2.bra(k2.label("nowhere"), guard=p)  # MARK-bra
    with pytest.raises(PtxVerifyError, match="never placed") as ei:
        m2.to_ptx()
    assert ei.value.loc.lineno == _line_of("MARK-bra")


def test_target_refuses_missing_instruction():
    m, k = _kernel("sm_80")
    h = k.const(T.bf16x2, 1.0)
    with pytest.raises(TargetError, match=r"add\.rn\.bf16x2 needs sm_90.*target sm_80") as ei:
        h + h  # MARK-target
    assert ei.value.loc.lineno == _line_of("MARK-target")
    m9, k9 = _kernel("sm_90")
    h9 = k9.const(T.bf16x2, 1.0)
    h9 + h9
    assert "add.rn.bf16x2" in m9.to_ptx()


def test_python_truthiness_of_register_refused():
    m, k = _kernel()
    a = k.param("a", u32)
    with pytest.raises(PtxBuildError, match="no Python truth value"):
        if a < 3:
            pass


def test_address_space_mismatch():
    m, k = _kernel()
    p = k.param_ptr("p", f32)
    with pytest.raises(PtxTypeError, match="a global address used by ld.shared"):
        k.emit("ld", ["shared"], [f32], [k.reg(f32), p[0]])


# ------------------------------------------------------------- control flow
def test_if_else_and_loops_generate_unique_labels():
    m, k = _kernel()
    n = k.param("n", u32)
    acc = k.var(u32, 0)
    with k.for_range(n) as i:
        with k.if_else(i < 3) as (then, other):
            with then:
                acc += i
            with other:
                acc -= 1
        k.continue_(guard=acc > 100)
    with k.while_(lambda: acc > 0):
        acc >>= 1
        k.break_(guard=acc.eq(5))
    text = m.to_ptx()
    labels = re.findall(r"^(\$L_\w+):$", text, re.M)
    assert len(labels) == len(set(labels)) >= 7
    for lab in labels:  # every placed label is a branch target
        assert re.search(rf"bra(\.uni)? \t{re.escape(lab)};", text), lab


def test_strided_guards_only_the_last_round():
    """k.strided(tid, n, step) unrolls ceil(n / step) rounds, tests
    ``item < n`` in the last round only, and on the emulator reaches every
    item below n once (n = 70 over 32 threads: rounds of 32, 32 and 6)."""
    from ptxgen import emu
    m = ptxgen.Module("sm_80")
    with m.kernel("fill", reqntid=32) as k:
        out = k.param_ptr("out", u32)
        for i in k.strided(k.tid.x, 70, 32):
            k.st(out[i], i + 1)
        with pytest.raises(PtxBuildError, match=r"test_builder\.py:\d+: .*positive int step"):
            list(k.strided(k.tid.x, 70, 0))
    text = m.to_ptx()
    assert text.count("st.global.u32") == 3
    assert len(re.findall(r"setp\.lt\.u32", text)) == 1
    buf = emu.DeviceArray.from_numpy(np.zeros(80, np.uint32))
    emu.launch(emu.Module.from_ptx(m)["fill"], 1, 32, buf)
    got = buf.to_numpy()
    assert list(got[:70]) == list(range(1, 71)) and not got[70:].any()


def test_if_else_order_enforced():
    m, k = _kernel()
    p = k.param("n", u32) < 2
    with pytest.raises(PtxBuildError, match="'then' arm .* before 'otherwise'"):
        with k.if_else(p) as (then, other):
            with other:
                pass


def test_unclosed_block_is_reported():
    m, k = _kernel()
    p = k.param("n", u32) < 2
    cm = k.if_(p)
    cm.__enter__()
    with pytest.raises(PtxVerifyError, match="still open"):
        m.to_ptx()


def test_guarded_block():
    m, k = _kernel()
    p = k.param("n", u32) < 2
    x = k.var(u32, 1)
    with k.guarded(~p):
        x += 1
    assert re.search(r"@!%p1 add\.u32", m.to_ptx())


# ------------------------------------------------------------- emission
def test_annotate_names_builder_lines():
    m, k = _kernel()
    a = k.param("a", u32)
    a + 1  # MARK-annotate
    text = m.to_ptx(annotate=True)
    assert f"// {HERE}:{_line_of('MARK-annotate')}" in text


def test_emission_is_deterministic_across_processes():
    code = ("from ptxgen import registry\n"
            "print(''.join(f.build(s).to_ptx() for f, s in registry.canonical_specs().values()))")
    outs = set()
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout)
    assert len(outs) == 1 and len(next(iter(outs))) > 1000


def test_header_per_target():
    for name, ver in (("sm_80", "7.8"), ("sm_90", "7.8"), ("sm_90a", "8.0")):
        text = ptxgen.Module(name).to_ptx()
        assert f".version {ver}\n.target {name}\n.address_size 64" in text
    with pytest.raises(ValueError, match="unknown target 'sm_70'"):
        ptxgen.Module("sm_70")


def test_threads_build_independently():
    from concurrent.futures import ThreadPoolExecutor
    from ptxgen import registry
    fam, spec = registry.canonical_specs()["block_reduce"]
    expect = fam.build(spec).to_ptx()
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda _: fam.build(spec).to_ptx(), range(16)))
    assert all(o == expect for o in outs)


def test_undefined_forms_refused():
    """Forms PTX does not define are refused when built, not by ptxas later."""
    m, k = _kernel()
    a = k.param("a", s32)
    x = k.param("x", f64)
    with pytest.raises(PtxTypeError, match=r"PTX has no setp\.hi\.s32"):
        k.setp("hi", a, a)
    with pytest.raises(PtxTypeError, match=r"PTX has no div\.approx\.f64"):
        k.div(x, x, approx=True)
    with pytest.raises(PtxTypeError, match=r"mad does not take \.f64"):
        k.emit("mad", ["lo"], [f64], [k.reg(f64), x, x, x])
    r = k.popc(a.bitcast(b32))
    assert r.type is u32 and "popc.b32" in m.to_ptx()


def test_registers_by_type_name_share_the_declaration():
    m, k = _kernel()
    a, b = k.reg(u32), k.reg("u32")
    v = k.var("u32", 0)
    assert (a.name, b.name, v.name) == ("%r1", "%r2", "%r3")
    k.mov(1, u32, out=a)
    k.mov(2, u32, out=b)
    assert "\t.reg .u32 \t%r<4>;" in m.to_ptx()


def test_mma_refuses_fragments_ptxas_would_reject():
    """ptxas refuses ``u32`` registers as mma fragments ("Arguments mismatch");
    the builder says so at the user's line, before any PTX is written."""
    m, k = _kernel()
    with k:
        w = k.param("w", u32)
        x = k.param("x", f32)
        a = (w, w, w, w)
        with pytest.raises(PtxTypeError, match=rf"{HERE}:{_line_of('# mma-u32')}:.*"
                                               r"a registers must be b32 or f16x2") as e:
            k.mma_m16n8k16(a, (w, w), (x, x, x, x))  # mma-u32
        assert "u32" in str(e.value)
        bw = k.bitcast(b32, w)
        with pytest.raises(PtxTypeError, match="b takes 2 registers, got 1"):
            k.mma_m16n8k16((bw,) * 4, (bw,), (x, x, x, x))
        with pytest.raises(PtxTypeError, match="c registers must be f32"):
            k.mma_m16n8k16((bw,) * 4, (bw, bw), (bw, x, x, x))
        k.mma_m16n8k16((bw,) * 4, (bw, bw), (x, x, x, x))


def test_half_fma_directed_rounding_refused_at_users_line():
    """PTX defines fma on f16/bf16 (and the x2 forms) with .rn only: the
    builder refuses .rz/.rm/.rp there, naming the caller's line and why
    (ptxas takes fma.rm.bf16 but computes it through f16 conversions)."""
    from ptxgen import types as T
    m, k = _kernel()
    a = k.bitcast(T.bf16, k.param("h", T.u16))
    with pytest.raises(PtxTypeError) as ei:
        k.emit("fma", ["rm"], [T.bf16], [k.reg(T.bf16), a, a, a])  # MARK-fma-rm-bf16
    assert ei.value.loc.lineno == _line_of("MARK-fma-rm-bf16")
    assert "fma.rm.bf16" in str(ei.value) and "rounds to nearest only" in str(ei.value)
    k.emit("fma", ["rn"], [T.bf16], [k.reg(T.bf16), a, a, a])
