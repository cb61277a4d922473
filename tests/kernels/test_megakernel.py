"""The persistent kernel (kernels/megakernel.py) running a tape cut by
llm/tape.py from a small graph of RMSNorms and f32 GEMVs (two residual
layers and an output), on the emulator with its global-memory race check
(and on the GPU where there is one): the result is the float64 forward
pass's, for any grid and any cut; with the waits dropped the race check
sees the hand-offs break."""

import attrs
import numpy as np
import pytest

from ptxgen import emu
from ptxgen.driver.executor import ComputeGraph, Launch
from ptxgen.kernels import megakernel as mk
from ptxgen.kernels.plan import LaunchGeometry
from ptxgen.llm.tape import build_tape

N, F, V = 64, 96, 40
EPS = 1e-5
THREADS = 64


def _graph():
    """The toy step: per layer ``h = rms(x) * wn``, ``a = W1 h``, ``x = W2 a + x``;
    then ``logits = W3 (rms(x) * wn)``.  Returns the graph and the ops'
    kernel words: name -> (op, addresses by buffer name, words)."""
    g = ComputeGraph()
    buf = {}

    def b(name, shape, kind="activation"):
        buf[name] = g.buffer(name, shape, np.float32, kind)
        return buf[name]
    x = b("x", (N,), "state")
    h, a = b("h", (N,)), b("a", (F,))
    logits = b("logits", (V,), "state")
    plan = {}

    def norm(name, wname):
        w = b(wname, (N,), "weight")
        g.add("RmsNorm", name, [x, w], [h], [Launch("rmsnorm", None,
                                                    LaunchGeometry("rmsnorm", 1, THREADS), {})])
        plan[name] = ("rmsnorm", ("x", wname, "h"), (N, EPS))

    def gemv(name, wname, xin, y, rows, cols, residual):
        w = b(wname, (rows, cols), "weight")
        ins = [w, xin] + ([y] if residual else [])
        g.add("MulMat", name, ins, [y], [Launch("gemv", None,
                                                LaunchGeometry("gemv", rows, THREADS), {})])
        plan[name] = ("gemv_f32", (wname, xin.name, y.name, y.name), (cols, int(residual)))
    for i in range(2):
        norm(f"norm{i}", f"wn{i}")
        gemv(f"up{i}", f"w1_{i}", h, a, F, N, False)
        gemv(f"down{i}", f"w2_{i}", a, x, N, F, True)
    norm("norm_out", "wn_out")
    gemv("output", "w3", h, logits, V, N, False)
    return g, plan


def _reference(p, steps):
    x = p["x"].astype(np.float64)

    def rms(v, w):
        return v / np.sqrt(np.mean(v * v) + EPS) * w
    for _ in range(steps):
        for i in range(2):
            h = rms(x, p[f"wn{i}"])
            x = p[f"w2_{i}"] @ (p[f"w1_{i}"] @ h) + x
    return x, p["w3"] @ rms(x, p["wn_out"])


def _run(rng, grid, cut, drop_waits=False, backend=None, edit=None, steps=1):
    g, plan = _graph()
    tape = build_tape(g, cut)
    if drop_waits:
        tape = attrs.evolve(tape, instructions=tuple(attrs.evolve(i, waits=())
                                                     for i in tape.instructions))
    records = tape.records(lambda n: plan[n.op][0], lambda n: plan[n.op][2])
    shapes = {bb.name: bb.shape for bb in g.buffers}
    host = {}
    for name, shape in shapes.items():
        scale = 1.0 / np.sqrt(shape[-1]) if len(shape) == 2 else 1.0
        host[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    for name in ("wn0", "wn1", "wn_out"):
        host[name] = (1.0 + 0.1 * rng.standard_normal(N)).astype(np.float32)
    if backend is None:
        dev = {n: emu.DeviceArray.from_numpy(v) for n, v in host.items()}
        dev["logits"] = emu.DeviceArray.from_numpy(np.full(V, np.nan, np.float32))
    else:
        dev = {n: backend.array(v) for n, v in host.items()}
        dev["logits"] = backend.poisoned((V,), np.float32)
    table = np.zeros((len(tape.nodes), mk.NODE_ARGS), np.uint64)
    for node in tape.nodes:
        for j, name in enumerate(plan[node.op][1]):
            table[node.index, j] = dev[name].ptr
    spec = mk.MegakernelSpec(threads=THREADS, target="sm_90")
    args = [records, table, np.zeros(tape.n_counters, np.uint32)]
    if backend is None:
        t_d, a_d, c_d = (emu.DeviceArray.from_numpy(v) for v in args)
        text = mk.build(spec).to_ptx()
        if edit is not None:
            assert edit[0] in text
            text = text.replace(*edit)
        fn = emu.Module.from_ptx(text)[spec.kernel_name]
        for epoch in range(1, steps + 1):
            emu.launch(fn, (grid,), (THREADS,), t_d, len(records), a_d, c_d, epoch)
    else:
        t_d, a_d, c_d = (backend.array(v) for v in args)
        spec = mk.MegakernelSpec(threads=THREADS, target=backend.target)
        fn = backend.load(mk.build(spec))[spec.kernel_name]
        for epoch in range(1, steps + 1):
            backend.launch_positional(fn, grid, THREADS, t_d, len(records), a_d, c_d, epoch)
    counts = c_d.to_numpy()
    want_x, want_logits = _reference(host, steps)
    return dev["x"].to_numpy(), dev["logits"].to_numpy(), want_x, want_logits, counts, tape


def _rel(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("grid,cut", [(1, 3), (3, 2), (4, 4), (5, 8)])
def test_the_tape_runs_to_the_float64_forward_pass(rng, grid, cut):
    """Any persistent grid, any cut of the nodes: the state and the logits
    match float64 within 1e-5 relative (f32 sums of at most 96 terms), and
    every counter holds its node's instruction count."""
    x, logits, want_x, want_logits, counts, tape = _run(rng, grid, cut)
    assert _rel(x, want_x) < 1e-5 and _rel(logits, want_logits) < 1e-5
    np.testing.assert_array_equal(counts, [n.count for n in tape.nodes])


def test_counters_carry_over_steps(rng):
    """Three launches on the counters the last left (``epoch`` 1, 2, 3):
    each waits for its own step's counts, and the state is three steps'."""
    x, logits, want_x, want_logits, counts, tape = _run(rng, 3, 4, steps=3)
    assert _rel(x, want_x) < 1e-5 and _rel(logits, want_logits) < 1e-5
    np.testing.assert_array_equal(counts, [3 * n.count for n in tape.nodes])


def test_without_the_waits_the_race_check_sees_the_hand_off(rng):
    """The same tape with every wait dropped: the CTAs read what others have
    not yet published, and the emulator's global race check says so."""
    with pytest.raises(emu.RaceError, match="global-memory race"):
        _run(rng, 3, 3, drop_waits=True)


@pytest.mark.parametrize("edit", [
    ("ld.acquire.gpu.global", "ld.relaxed.gpu.global"),
    ("red.release.gpu.global", "red.relaxed.gpu.global"),
], ids=["no-acquire", "no-release"])
def test_the_race_check_needs_both_the_acquire_and_the_release(rng, edit):
    with pytest.raises(emu.RaceError, match="global-memory race"):
        _run(rng, 3, 3, edit=edit)


def test_encode_refuses_a_tape_that_could_deadlock():
    with pytest.raises(ValueError, match="waits on counter 1, which no earlier instruction"):
        mk.encode([("rmsnorm", 0, 0, 1, [(1, 1)], (N, EPS)),
                   ("rmsnorm", 1, 0, 1, [], (N, EPS))])
    with pytest.raises(ValueError, match="op 'softmax' is not one of rmsnorm, gemv_f32, noop"):
        mk.encode([("softmax", 0, 0, 1, [], (0, 0))])
    with pytest.raises(ValueError, match="at most 4"):
        mk.encode([("rmsnorm", 5, 0, 1, [], (N, EPS))] +
                  [("rmsnorm", 0, 0, 1, [(5, 1)] * 5, (N, EPS))])
    with pytest.raises(ValueError, match="threads must be a multiple of 32"):
        mk.MegakernelSpec(threads=48)
    with pytest.raises(ValueError, match="'attention' is not an op"):
        mk.MegakernelSpec(ops=("attention",))


def test_ptxas_takes_the_persistent_kernel(ptxas):
    from ptxgen.ptxas import assemble
    for target in ("sm_80", "sm_90"):
        assemble(mk.build(mk.MegakernelSpec(target=target)).to_ptx(), target)


@pytest.mark.gpu
def test_gpu_the_tape_runs_to_the_float64_forward_pass(rng):
    from backends import Backend, cuda_available
    if not cuda_available():
        pytest.skip("no GPU")
    be = Backend("cuda")
    x, logits, want_x, want_logits, counts, tape = _run(rng, 4, 4, backend=be, steps=2)
    assert _rel(x, want_x) < 1e-5 and _rel(logits, want_logits) < 1e-5
    np.testing.assert_array_equal(counts, [2 * n.count for n in tape.nodes])
