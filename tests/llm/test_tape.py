"""The decode step's instruction tape (llm/tape.py) on a tiny synthetic
Llama: every launch of the step covered once, every ordering the graph
needs present (checked against the ops' declared inputs and outputs, not
the tape's own access sets), nothing waited on twice over."""

import numpy as np
import pytest

pytest.importorskip("gguf")

from ptxgen.driver.executor import ComputeGraph, Launch, plan_activations
from ptxgen.kernels.plan import LaunchGeometry
from ptxgen.llm.gguf.synth import write_synthetic_llama
from ptxgen.llm.tape import build_tape, decode_tape, main

TINY = dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
            context_length=256)

#: DecodeLowering arguments that change the graph's shape
SHAPES = [dict(), dict(fuse_rope=False), dict(fuse_norm=True), dict(fuse_norm=False)]
SHAPE_IDS = ["default", "fuse_rope=False", "fuse_norm=True", "fuse_norm=False"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    p = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_synthetic_llama(str(p), seed=module_seed, **TINY)
    return str(p)


def _tape_and_graph(path, sm_count, variant=None, **lowering):
    """The tape and the graph it was cut from (lowered once more the same way)."""
    from ptxgen.driver.executor import Store
    from ptxgen.llm.gguf.file import LlamaFile
    from ptxgen.llm.lowering.common import Tuning
    from ptxgen.llm.lowering.decode import DecodeLowering
    from ptxgen.llm.models import architecture_of
    f = LlamaFile(path)
    arch = architecture_of(f)
    s = DecodeLowering(f, Store(), target="sm_90", sm_count=sm_count, capacity=64,
                       rope_layout=arch.rope_layout, tuning=Tuning(sm_count), **lowering)
    arch.forward(s)
    return build_tape(s.g, sm_count, variant), s.g


def _closure(tape):
    """Every node's ancestors through the waits, as sets."""
    anc = []
    for n in tape.nodes:
        a = set()
        for w in n.waits:
            a |= anc[w] | {w}
        anc.append(a)
    return anc


def _declared_conflict(a, b) -> bool:
    """``b`` after ``a`` needs ordering by their declared inputs and outputs:
    the same buffer, or activations whose arena bytes overlap."""
    def same(x, y):
        if x is y:
            return True
        return (x.kind == y.kind == "activation" and x.offset is not None
                and y.offset is not None and x.offset < y.offset + y.nbytes
                and y.offset < x.offset + x.nbytes)
    return (any(same(r, w) for r in b.inputs for w in a.outputs)
            or any(same(w, x) for w in b.outputs for x in a.inputs + a.outputs))


@pytest.mark.parametrize("lowering", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("variant", ["greedy", "sample"])
def test_every_launch_of_the_step_covered_once(tiny, rng, lowering, variant):
    sm = int(rng.integers(1, 200))
    tape, g = _tape_and_graph(tiny, sm, variant, **lowering)
    launches = [(op, li, L) for op in g.ops_of(variant) for li, L in enumerate(op.launches)]
    assert len(tape.nodes) == len(launches), sm
    seen_ins = 0
    for node, (op, li, L) in zip(tape.nodes, launches):
        assert (node.op, node.kind, node.launch, node.kernel) == (op.name, op.kind, li, L.kernel)
        grid = int(np.prod(L.geometry.grid))
        assert node.grid == grid and node.threads == L.geometry.threads
        mine = tape.instructions_of(node)
        assert node.first == seen_ins and 1 <= len(mine) <= min(sm, grid)
        seen_ins += len(mine)
        ctas = np.zeros(grid, np.int64)
        for ins in mine:
            assert ins.node == node.index and ins.cta0 < ins.cta1
            ctas[ins.cta0:ins.cta1] += 1
        assert (ctas == 1).all(), (node.op, sm)
        if L.family == "gemv":
            rows = np.zeros(L.args["m"], np.int64)
            for ins in mine:
                rows[ins.row0:ins.row1] += 1
            assert (rows == 1).all(), (node.op, sm)
        else:
            assert all(ins.row0 is None for ins in mine)
    assert seen_ins == len(tape.instructions)
    assert [i.index for i in tape.instructions] == list(range(seen_ins))


@pytest.mark.parametrize("lowering", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("variant", ["greedy", "sample"])
def test_waits_are_acyclic_complete_and_reduced(tiny, rng, lowering, variant):
    sm = int(rng.integers(1, 200))
    tape, g = _tape_and_graph(tiny, sm, variant, **lowering)
    anc = _closure(tape)
    for n in tape.nodes:
        assert all(w < n.index for w in n.waits), n      # earlier only: acyclic, in order
        for w in n.waits:                                # no wait another implies
            assert not any(w in anc[o] for o in n.waits if o != w), (n.op, w)
        for ins in tape.instructions_of(n):
            assert ins.waits == tuple((w, tape.nodes[w].count) for w in n.waits)
    ops = g.ops_of(variant)
    first, last = {}, {}
    for n in tape.nodes:
        first.setdefault(n.op, n.index)
        last[n.op] = n.index
    for n in tape.nodes:
        if n.launch:
            assert n.index - 1 in anc[n.index]
    plan_activations(g)
    missing = [(a.name, b.name) for j, b in enumerate(ops) for a in ops[:j]
               if _declared_conflict(a, b) and last[a.name] not in anc[first[b.name]]]
    assert not missing
    # the step is a chain in a decoder: every node after the first waits on something
    assert all(n.waits for n in tape.nodes[1:])


def _toy_graph():
    """Three ops on activations that the arena lays over each other: ``b``'s
    bytes reuse ``a``'s once ``a`` is read, so the op writing ``b`` must
    wait for the one reading ``a`` though the two share no buffer."""
    g = ComputeGraph()
    w = g.buffer("w", (64,), np.float32, "weight", np.zeros(64, np.float32))
    a = g.buffer("a", (64,), np.float32)
    t = g.buffer("t", (64,), np.float32)
    b = g.buffer("b", (64,), np.float32)
    out = g.buffer("out", (64,), np.float32, "state", np.zeros(64, np.float32))

    def L(**args):
        return Launch("toy", None, LaunchGeometry("toy", 3, 32), args)
    g.add("Write", "write_a", [w], [a], [L(w=w, y=a)])
    g.add("Read", "read_a", [a], [t], [L(x=a, y=t)])
    g.add("Write", "write_b", [w], [b], [L(w=w, y=b)])
    g.add("Sum", "sum", [t, b], [out], [L(x=t, z=b, y=out)])
    return g


def test_activations_sharing_arena_bytes_are_ordered():
    g = _toy_graph()
    tape = build_tape(g, 2)
    a, b = g.buffers[1], g.buffers[3]
    assert a.offset == b.offset                  # the arena reuses a's bytes for b
    by = {n.op: n for n in tape.nodes}
    assert by["write_b"].waits == (by["read_a"].index,)
    assert by["read_a"].waits == (by["write_a"].index,)
    assert by["sum"].waits == (by["write_b"].index,)   # read_a is implied through write_b
    assert [(i.cta0, i.cta1) for i in tape.instructions_of(by["sum"])] == [(0, 2), (2, 3)]
    assert tape.instructions_of(by["sum"])[0].waits == ((by["write_b"].index, 2),)


def test_dump_names_every_node_and_its_waits(tiny, capsys):
    tape = decode_tape(tiny, sm_count=16, capacity=64)
    text = tape.dump(instructions=True)
    assert text.splitlines()[0] == (f"tape [greedy]: {len(tape.nodes)} nodes, "
                                    f"{len(tape.instructions)} instructions, "
                                    f"{len(tape.nodes)} counters")
    for n in tape.nodes:
        assert f" {n.op} " in text and n.kernel in text
    attn = next(n for n in tape.nodes if n.kind == "MulMat" and n.op.endswith("attn_output"))
    want = " ".join(f"{w}:{tape.nodes[w].count}" for w in attn.waits)
    assert f"waits {want}" in text
    assert text.count("\n       #") == len(tape.instructions)
    assert main([tiny, "--sm-count", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tape [greedy]") and "#0 ctas" not in out
    assert main([tiny, "--sm-count", "16", "--ptx"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tape [greedy]") and ".visible .entry megakernel(" in out
    kernels = list(dict.fromkeys(n.kernel for n in tape.nodes))
    for i, name in enumerate(kernels):       # every kernel of the step, inlined once
        if name.startswith("argmax"):        # the argmax with fewer threads
            name = "argmax_f32_b256"
        assert out.count(f"// op {i}: {name}\n") == 1


def test_bad_arguments_are_refused(tiny):
    g = _toy_graph()
    with pytest.raises(ValueError, match="sm_count must be at least 1, got 0"):
        build_tape(g, 0)
    with pytest.raises(ValueError, match="unknown variant 'beam'"):
        decode_tape(tiny, sm_count=4, capacity=16, variant="beam")
    with pytest.raises(ValueError, match="no ops"):
        build_tape(ComputeGraph(), 4)


def test_the_decode_tape_runs_to_the_end_on_the_persistent_kernel(tiny, rng):
    """The tiny model's tape, every instruction a no-op, under the
    persistent kernel on the emulator for a random grid and cut: no wait
    is left unmet (a deadlock would raise) and every counter ends at its
    node's instruction count times the steps run."""
    from ptxgen import emu
    from ptxgen.kernels import megakernel as mk
    grid, sm = int(rng.integers(1, 9)), int(rng.integers(1, 17))
    tape = decode_tape(tiny, sm_count=sm, capacity=64)
    records = tape.records(lambda n: "noop")
    spec = mk.MegakernelSpec(ops=("noop",), threads=32, target="sm_90")
    fn = emu.Module.from_ptx(mk.build(spec))[spec.kernel_name]
    args = [emu.DeviceArray.from_numpy(records), len(records),
            emu.DeviceArray.from_numpy(np.zeros((len(tape.nodes), mk.NODE_ARGS), np.uint64))]
    counters = emu.DeviceArray.from_numpy(np.zeros(tape.n_counters, np.uint32))
    for epoch in (1, 2):
        emu.launch(fn, (grid,), (32,), *args, counters, epoch)
    np.testing.assert_array_equal(counters.to_numpy(), [2 * n.count for n in tape.nodes])
