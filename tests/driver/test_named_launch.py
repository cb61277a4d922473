"""Launches by parameter name: the ABI orders them, a backend launches them
with a family's LaunchGeometry, the graph executor resolves them once (on
the emulator; no GPU)."""

import numpy as np
import pytest

from ptxgen.abi import ArgPacker, LaunchArgumentError, parse_entries
from ptxgen.driver.errors import LaunchConfigError
from ptxgen.driver.executor import ComputeGraph, Executor, Launch
from ptxgen.driver.backend import get_backend
from ptxgen.kernels import gemv, vector_add
from ptxgen.kernels.plan import LaunchGeometry

SPEC = vector_add.VectorAddSpec()


def _packer():
    (name, params), = parse_entries(vector_add.build(SPEC).to_ptx()).items()
    return ArgPacker(name, params)


def test_order_puts_names_in_declaration_order():
    p = _packer()
    assert p.order({"n": 7, "c": 3, "a": 1, "b": 2}) == (1, 2, 3, 7)


@pytest.mark.parametrize("named,match", [
    ({"a": 1, "b": 2, "c": 3}, r"parameter 'n' \(position 3 of 4, \.param \.u32 n\) has no "
                               r"argument"),
    ({"b": 2, "c": 3}, r"parameter 'a' .* has no argument, nor do 'n'"),
    ({"a": 1, "b": 2, "c": 3, "n": 4, "m": 5}, r"no parameter named 'm'; its parameters are "
                                               r"vector_add_f32\(\.u64 \.ptr a"),
    ({"a": 1, "b": 2, "c": 3, "nn": 4}, r"no parameter named 'nn'.* and 'n' has no argument"),
])
def test_order_refuses_missing_and_unknown_names(named, match):
    with pytest.raises(LaunchArgumentError, match=match):
        _packer().order(named)


def test_backend_launches_by_name(rng):
    be = get_backend("emu")
    n = int(rng.integers(300, 700))
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    c = be.DeviceArray.from_numpy(np.full(n, np.nan, np.float32))
    fn = be.function(vector_add.build, SPEC)
    geo = vector_add.launch_geometry(SPEC, n)
    args = dict(n=n, c=c, b=be.DeviceArray.from_numpy(b), a=be.DeviceArray.from_numpy(a))
    be.launch(fn, geo, args)
    np.testing.assert_array_equal(c.to_numpy(), a + b)      # one f32 add: exact
    with pytest.raises(LaunchArgumentError, match=r"parameter 'n' .* expected an integer"):
        be.launch(fn, geo, dict(args, n=float(n)))
    with pytest.raises(LaunchConfigError, match="geometry of kernel 'other'"):
        be.launch(fn, geo.evolve(kernel="other"), args)


def test_geometry_arguments_are_not_given_twice():
    plan = gemv.GemvPlan.make("Q8_0", 64)
    be = get_backend("emu")
    fn = be.function(gemv.build, plan)
    geo = gemv.launch_geometry(plan, 8)
    with pytest.raises(LaunchArgumentError, match=r"'rpc' is decided by the launch geometry "
                                                  r"\(rpc=4\)"):
        be.launch(fn, geo, dict(w=0, x=0, y=0, m=8, rpc=4))


def _graph(name="n"):
    g = ComputeGraph()
    n = 1000
    a = g.buffer("a", (n,), np.float32, "weight", np.arange(n, dtype=np.float32))
    b = g.buffer("b", (n,), np.float32, "state")
    c = g.buffer("c", (n,), np.float32)
    d = g.buffer("d", (n,), np.float32, "state")
    geo = vector_add.launch_geometry(SPEC, n)
    g.add("Add", "c", [a, b], [c], [Launch("vector_add", SPEC, geo, dict(a=a, b=b, c=c, n=n))])
    g.add("Add", "d", [c, a], [d], [Launch("vector_add", SPEC, geo, {"a": c, "b": a, "c": d,
                                                                     name: n})])
    return g, b, d


def test_executor_resolves_names(rng):
    g, b, d = _graph()
    ex = Executor(g, get_backend("emu"))
    x = rng.standard_normal(1000).astype(np.float32)
    ex.write(b, x)
    ex.run_eager()
    want = (np.arange(1000, dtype=np.float32) + x) + np.arange(1000, dtype=np.float32)
    np.testing.assert_array_equal(ex.read(d), want)


def test_executor_refuses_a_misspelled_name_when_built():
    g, _, _ = _graph("count")
    with pytest.raises(LaunchArgumentError, match="no parameter named 'count'"):
        Executor(g, get_backend("emu"))
