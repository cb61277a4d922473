"""Property: random straight-line programs over random types build without
error and assemble with ptxas (for sm_80 and sm_90)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ptxgen
from ptxgen import types as T
from ptxgen.ptxas import assemble

SCALARS = [T.u16, T.s16, T.u32, T.s32, T.u64, T.s64, T.f32, T.f64]
INT_OPS = ["add", "sub", "mul", "min", "max", "and", "or", "xor", "shl", "shr", "div", "rem"]
FLT_OPS = ["add", "sub", "mul", "min", "max", "div", "fma"]
UNARY_F = ["neg", "abs", "sqrt", "rcp"]


step = st.tuples(st.sampled_from(["bin", "unary", "cvt", "const", "select"]),
                 st.integers(0, 10_000), st.integers(0, 10_000), st.integers(0, 10_000))


def _build(types_in, steps, target):
    m = ptxgen.Module(target)
    with m.kernel("prop") as k:
        out = k.param_ptr("out", T.u8)
        pool = [k.param(f"p{i}", t) for i, t in enumerate(types_in)]
        for kind, a, b, c in steps:
            x = pool[a % len(pool)]
            same = [r for r in pool if r.type is x.type]
            y = same[b % len(same)]
            ty = x.type
            if kind == "bin":
                ops = FLT_OPS if ty.is_float else INT_OPS
                op = ops[c % len(ops)]
                if op == "fma":
                    r = k.fma(x, y, x)
                elif op in ("and", "or", "xor"):
                    r = getattr(k, {"xor": "xor"}.get(op, op + "_"))(x, y)
                elif op in ("shl", "shr"):
                    r = getattr(k, op)(x, c % ty.bits)
                elif op in ("div", "rem"):
                    r = getattr(k, op)(x, (c % 97) + 1)
                else:
                    r = getattr(k, op)(x, y)
            elif kind == "unary":
                if ty.is_float:
                    r = getattr(k, UNARY_F[c % len(UNARY_F)])(x)
                elif ty.is_signed:
                    r = k.neg(x)
                else:
                    r = k.not_(x)
            elif kind == "cvt":
                r = k.cvt(SCALARS[c % len(SCALARS)], x, sat=bool(b % 2) and SCALARS[c % len(SCALARS)].is_int and ty.is_float)
            elif kind == "const":
                t2 = SCALARS[c % len(SCALARS)]
                r = k.const(t2, (b % 1000) * (0.5 if t2.is_float else 1))
            else:
                r = k.select(x < y, x, y)
            pool.append(r)
        for j, r in enumerate(pool[len(types_in):]):
            k.st(out[8 * j], r, ty=r.type)
    return m.to_ptx()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(types_in=st.lists(st.sampled_from(SCALARS), min_size=1, max_size=5),
       steps=st.lists(step, min_size=1, max_size=25),
       target=st.sampled_from(["sm_80", "sm_90"]))
def test_random_programs_assemble(ptxas, types_in, steps, target):
    text = _build(types_in, steps, target)
    assemble(text, target)
