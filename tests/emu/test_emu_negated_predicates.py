"""Negated predicate operands (``!p``) against Python booleans: ``selp``
with ``!p``, ``and/or/xor.pred`` with either operand negated, ``setp`` with
``.and/.or/.xor`` of a negated predicate (the form the sampler and RoPE
kernels emit), ``@!p`` on ordinary instructions and on ``bra``, under
divergence too; and the emulator's uninitialised-register check sees a
``!p`` source as a read of ``p``.  The backend fixture runs each on the
GPU as well (ptxas takes every form here)."""

import numpy as np
import pytest

import ptxgen
from backends import run_map
from ptxgen import emu
from ptxgen import types as T

N = 256


def _inputs(rng, ty):
    """Three operands drawn from a small range (so that equal values and
    every outcome of the comparisons occur)."""
    t = T.type_by_name(ty)
    lo = -6 if t.is_signed else 0
    return [rng.integers(lo, lo + 13, N).astype(t.np_dtype) for _ in range(3)]


def _pred_body(k, a, b, c):
    """Nine predicate results packed into bits 0..8 of a u32, each computed
    with a negated operand."""
    p = k.setp("lt", a, b)
    q = k.setp("gt", c, b)
    one, zero = k.mov(1, T.u32), k.mov(0, T.u32)
    preds = [
        None,                                          # bit 0: selp on !p
        k.setp("le", a, c, combine=("and", ~q)),
        k.setp("le", a, c, combine=("or", ~q)),
        k.setp("le", a, c, combine=("xor", ~q)),
        k.pand(p, ~q),
        k.pand(~p, q),
        k.por(~p, q),
        k.por(p, ~q),
        k.xor(~p, q),
    ]
    r = k.select(~p, one, zero)
    for i, pr in enumerate(preds[1:], 1):
        r = r | k.select(pr, k.mov(1 << i, T.u32), zero)
    return r


def _pred_ref(a, b, c):
    p, q, le = a < b, c > b, a <= c
    bits = [not p, le and not q, le or not q, le != (not q), p and not q, (not p) and q,
            (not p) or q, p or not q, (not p) != q]
    return sum(int(v) << i for i, v in enumerate(bits))


@pytest.mark.parametrize("ty", ["u32", "s32", "u64", "s64"])
def test_negated_predicate_sources(backend, ty, rng):
    a, b, c = _inputs(rng, ty)
    got = run_map(backend, _pred_body, [a, b, c], [ty] * 3, "u32")
    want = [_pred_ref(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    assert got.tolist() == want


def _guard_body(k, a, b, c):
    """``@!p`` on adds, and on a branch, at the top level and inside a
    divergent ``if``; the bits record which ran."""
    p = k.setp("lt", a, b)
    q = k.setp("gt", c, b)
    r = k.var(T.u32, 0)
    k.add(r, 1, out=r, guard=~p)                 # @!p add
    k.add(r, 2, out=r, guard=p)                  # @p add
    skip = k.label("skip")
    k.bra(skip, guard=~q)                        # @!q bra
    k.add(r, 4, out=r)
    k.place(skip)
    with k.if_(k.setp("ne", a, c)):              # divergent: threads with a == c wait
        k.add(r, 8, out=r, guard=~q)
        inner = k.label("inner")
        k.bra(inner, guard=~p)
        k.add(r, 16, out=r)
        k.place(inner)
    with k.if_(~q):                              # if on a negated predicate
        k.add(r, 32, out=r)
    return r


def _guard_ref(a, b, c):
    p, q = a < b, c > b
    r = (1 if not p else 0) + (2 if p else 0) + (4 if q else 0)
    if a != c:
        r += (8 if not q else 0) + (16 if p else 0)
    return r + (32 if not q else 0)


@pytest.mark.parametrize("ty", ["u32", "s64"])
def test_negated_guards_and_branches(backend, ty, rng):
    a, b, c = _inputs(rng, ty)
    got = run_map(backend, _guard_body, [a, b, c], [ty] * 3, "u32")
    want = [_guard_ref(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    assert got.tolist() == want


def test_ptxas_takes_the_negated_forms(ptxas):
    """Every form above is PTX (so the GPU runs the same instructions)."""
    from backends import map_kernel
    from ptxgen.ptxas import assemble
    for body in (_pred_body, _guard_body):
        text = map_kernel(body, ["s64"] * 3, "u32").to_ptx()
        assert "!%p" in text
        assemble(text, "sm_90")


def test_unwritten_predicate_read_negated(emu_backend):
    """``selp`` of ``!p`` where some threads never wrote ``p``: an
    uninitialised read of ``p``, named at the selp line."""
    m = ptxgen.Module("sm_80")
    with m.kernel("maybe_p") as k:
        x = k.param_ptr("x", T.u32)
        t = k.tid.x
        p = k.var(T.pred)
        with k.if_(t < 5):
            k.setp("eq", t, 3, out=p)
        k.st(x[t], k.select(~p, k.mov(1, T.u32), k.mov(0, T.u32)))
    text = m.to_ptx()
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "selp" in s)
    assert "!%p" in text.splitlines()[line - 1]
    with pytest.raises(emu.UninitializedRegister) as ei:
        emu.launch(emu.Module.from_ptx(text)["maybe_p"], 1, 32, emu.DeviceArray.zeros(32, np.uint32))
    assert ei.value.line == line and ei.value.thread == (5, 0, 0)
