"""The compute graph and the activation planner (no GPU)."""

import numpy as np
import pytest

from ptxgen.driver.executor import ComputeGraph, Launch, plan_activations
from ptxgen.kernels.plan import LaunchGeometry


def _chain(sizes):
    """a0 -> op -> a1 -> op -> a2 ...: each op reads the previous activation."""
    g = ComputeGraph()
    bufs = [g.buffer(f"a{i}", (n,), np.float32) for i, n in enumerate(sizes)]
    for i in range(len(bufs) - 1):
        L = Launch("f", None, LaunchGeometry("k", 1, 32), dict(a=bufs[i], b=bufs[i + 1]))
        g.add("Op", f"op{i}", [bufs[i]], [bufs[i + 1]], [L])
    return g, bufs


def _overlap(a, b):
    return a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes


def test_chain_reuses_dead_buffers():
    g, bufs = _chain([1000, 1000, 1000, 1000, 1000])
    size = plan_activations(g)
    # at most two activations are live at once (input and output of one op)
    assert size == 2 * 4096   # two 4000-byte tensors, each rounded up to 256-byte units
    for i in range(len(bufs) - 1):
        assert not _overlap(bufs[i], bufs[i + 1]), (i, bufs[i].offset, bufs[i + 1].offset)
    assert any(_overlap(bufs[0], b) for b in bufs[2:])  # something reused a0's bytes


def test_live_buffers_never_overlap_random_graphs(rng):
    for _ in range(20):
        g = ComputeGraph()
        acts = [g.buffer("in", (int(rng.integers(1, 5000)),), np.float32)]
        for i in range(30):
            ins = list(rng.choice(len(acts), size=min(len(acts), int(rng.integers(1, 4))),
                                  replace=False))
            out = g.buffer(f"t{i}", (int(rng.integers(1, 5000)),), np.float32)
            L = Launch("f", None, LaunchGeometry("k", 1, 32),
                       {**{f"in{n}": acts[j] for n, j in enumerate(ins)}, "out": out})
            g.add("Op", f"op{i}", [acts[j] for j in ins], [out], [L])
            acts.append(out)
        size = plan_activations(g)
        # reconstruct lifetimes and check pairwise: live at the same op => disjoint
        first, last = {}, {}
        for t, op in enumerate(g.ops):
            for b in op.inputs + op.outputs:
                first.setdefault(id(b), t)
                last[id(b)] = t
        for a in acts:
            assert a.offset % 256 == 0 and a.offset + a.nbytes <= size
            for b in acts:
                if a is b:
                    continue
                if first[id(a)] <= last[id(b)] and first[id(b)] <= last[id(a)]:
                    assert not _overlap(a, b), (a.name, b.name)
        assert size < sum(-(-a.nbytes // 256) * 256 for a in acts)


def test_graph_rejects_foreign_buffers_and_reports_summary():
    g = ComputeGraph()
    a = g.buffer("a", (4,), np.float32)
    w = g.buffer("w", (4,), np.float32, "weight", np.ones(4, np.float32))
    other = ComputeGraph().buffer("z", (4,), np.float32)
    with pytest.raises(ValueError, match="'z' is not part of this graph"):
        g.add("Op", "bad", [other], [a], [])
    with pytest.raises(ValueError, match="used twice"):
        g.buffer("a", (4,), np.float32)
    with pytest.raises(ValueError, match="outside buffer 'w'"):
        w.at(16)
    L = Launch("f", None, LaunchGeometry("k", 1, 32), dict(w=w.at(4), a=a))
    g.add("MulMat", "mm", [w], [a], [L, L])
    text = g.summary()
    assert "MulMat" in text and "total" in text and "weight buffers: 1" in text
    assert g.launch_count == 2
