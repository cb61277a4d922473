"""The batched GEMV (``GemvSpec(batch=B)``): ``y[b] = W x[b]`` for B rows of
x against the float64 reference (``gemv.reference`` per row: gguf-decoded
weights times x), over several B, shapes, row counts in use and epilogues;
what it refuses; ptxas reports without spills."""

import numpy as np
import pytest

from ptxgen.kernels import gemv as G
from ptxgen.kernels import quants
from ptxgen.ptxas import assemble

BOUND = 1e-5


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _weights(rng, qtype, m, k, n):
    return [quants.quantize(rng.standard_normal((m, k)).astype(np.float32), qtype)
            for _ in range(n)]


def run_batched(run, spec, ws, x, n_rows, *, r=None, bias=None, ys=None, y_init=None):
    """Launch ``spec`` over ``x`` ([B, K]) with ``n_rows`` in use; returns
    the whole y buffer ([B, ys])."""
    m = ws[0].shape[0]
    B = spec.batch
    ys = ys or m
    fn = run.function(G.build, spec)
    y = run.array(y_init) if y_init is not None else run.poisoned(B * ys)
    args = dict(zip(("w", "wu"), map(run.array, ws)), x=run.array(x.reshape(-1)), y=y, m=m,
                n_ptr=run.array(np.array([n_rows], np.int32)), ys=ys)
    if spec.epilogue == "residual":
        args["r"] = y if r is None else run.array(r.reshape(-1))
    if spec.epilogue == "bias":
        args["bias"] = run.array(bias)
    run.launch(fn, G.launch_geometry(spec, m), args)
    return run.get(y).reshape(B, ys)


def _ref_rows(spec, ws, x, n_rows, r=None, bias=None):
    out = []
    for b in range(n_rows):
        res = r[b] if r is not None else bias
        epi = "residual" if res is not None else spec.epilogue
        out.append(G.reference(spec.qtype, ws[0], x[b], residual=res,
                               w_up=ws[1] if len(ws) > 1 else None, epilogue=epi))
    return np.array(out)


CASES = [
    # qtype, K, epilogue, B, rows in use, config
    ("Q4_K", 512, "none", 2, 2, dict(rows=2, stages=3)),
    ("Q4_K", 512, "residual", 4, 3, dict(rows=4, stages=2)),
    ("Q4_K", 256, "swiglu", 3, 3, dict(rows=1, stages=3)),
    ("Q4_K", 768, "bias", 5, 4, dict(rows=2, stages=3, pieces=2)),
    ("Q4_K", 512, "none", 8, 8, dict(rows=2, stages=2, interleave=True)),
    ("Q6_K", 2048, "none", 2, 1, dict(rows=2, stages=3)),
    ("Q6_K", 2048, "residual", 4, 4, dict(rows=1, stages=2)),
    ("Q6_K", 2048, "swiglu", 2, 2, dict(rows=2, stages=2, pieces=2)),
    ("Q8_0", 512, "none", 3, 3, dict(rows=2, stages=3)),
    ("Q8_0", 512, "bias", 2, 2, dict(rows=4, stages=2)),
    # K in slices, each slice's sums added to y
    ("Q4_K", 512, "residual", 4, 3, dict(rows=2, stages=3, kslices=2)),
    ("Q4_K", 1024, "bias", 3, 3, dict(rows=4, stages=2, kslices=4)),
    ("Q4_K", 768, "none", 2, 2, dict(rows=1, stages=3, kslices=3, interleave=True)),
    ("Q6_K", 4096, "none", 3, 2, dict(rows=2, stages=2, kslices=2)),
    ("Q8_0", 512, "residual", 2, 2, dict(rows=2, stages=3, kslices=2)),
    # teams of threads sharing x, each taking rows / teams of a group
    ("Q4_K", 512, "residual", 3, 3, dict(rows=4, teams=2, stages=3)),
    ("Q4_K", 512, "swiglu", 4, 4, dict(rows=4, teams=4, stages=2)),
    ("Q4_K", 1024, "bias", 5, 4, dict(rows=8, teams=2, stages=2, kslices=2, interleave=True)),
    ("Q6_K", 4096, "residual", 2, 2, dict(rows=2, teams=2, stages=3, kslices=2)),
    ("Q8_0", 512, "none", 3, 2, dict(rows=8, teams=8, stages=2)),
]


@pytest.mark.parametrize("qtype,k,epi,B,n,knobs", CASES)
def test_batched_gemv_numerics(run, qtype, k, epi, B, n, knobs, rng):
    """M = 37 (not a multiple of rows), max_ctas=4 so CTAs walk several row
    groups; rows of y past ``n`` keep their poison."""
    m = 37
    spec = G.GemvPlan.make(qtype, k, epi, batch=B, dot="dp4a", max_ctas=4, **knobs)
    ws = _weights(rng, qtype, m, k, spec.n_mats)
    x = rng.standard_normal((B, k)).astype(np.float32)
    x[:, rng.choice(k, 4, replace=False)] *= 50.0        # outliers, as hidden states have
    r = rng.standard_normal((B, m)).astype(np.float32) if epi == "residual" else None
    bias = rng.standard_normal(m).astype(np.float32) if epi == "bias" else None
    y = run_batched(run, spec, ws, x, n, r=r, bias=bias)
    assert rel_err(y[:n], _ref_rows(spec, ws, x, n, r, bias)) <= BOUND
    assert np.all(np.isnan(y[n:])), "rows past the count in use were written"


def test_batched_gemv_strided_in_place_residual(run, rng):
    """``y`` a column block of wider rows (``ys``) and the residual read from
    y itself (``x += W a`` in place), as the decode step's projections are."""
    qtype, k, m, B, ys = "Q4_K", 512, 40, 4, 53
    spec = G.GemvPlan.make(qtype, k, "residual", batch=B, dot="dp4a", rows=2, stages=3,
                           max_ctas=5)
    ws = _weights(rng, qtype, m, k, 1)
    x = rng.standard_normal((B, k)).astype(np.float32)
    y0 = rng.standard_normal((B, ys)).astype(np.float32)
    y = run_batched(run, spec, ws, x, B, ys=ys, y_init=y0.reshape(-1))
    ref = _ref_rows(spec, ws, x, B, r=y0[:, :m])
    assert rel_err(y[:, :m], ref) <= BOUND
    assert np.array_equal(y[:, m:], y0[:, m:]), "columns past M were written"


def test_batched_rows_in_use_zero_writes_nothing(run, rng):
    spec = G.GemvPlan.make("Q8_0", 512, batch=4, dot="dp4a", rows=2, stages=2, max_ctas=3)
    ws = _weights(rng, "Q8_0", 9, 512, 1)
    y = run_batched(run, spec, ws, rng.standard_normal((4, 512)).astype(np.float32), 0)
    assert np.all(np.isnan(y))


@pytest.mark.parametrize("bad,match", [
    (dict(qtype="Q5_K", batch=4), "reads Q4_K, Q6_K, Q8_0"),
    (dict(batch=4, epilogue="rope", rope=(64, 2, 1)), "not built for the batched"),
    (dict(batch=4, norm=True), "no fused RMSNorm"),
    (dict(batch=33), "batch"),
    (dict(batch=1, epilogue="bias"), "batch >= 2"),
    (dict(batch=4, dot="fma"), "dp4a"),
    (dict(batch=4, bulk=True, target="sm_90"), "bulk"),
    (dict(qtype="Q6_K", k=512, batch=4), "16-byte"),
    (dict(k=14336, batch=8), "shared memory"),
    (dict(batch=4, epilogue="swiglu", kslices=2), "whole sums"),
    (dict(batch=4, kslices=3), "kslices=3"),
    (dict(qtype="Q6_K", k=2048, batch=4, kslices=2), "kslices=2"),
    (dict(batch=1, stages=3, kslices=2), "batch >= 2"),
    (dict(batch=1, stages=3, teams=2), "batch >= 2"),
    (dict(batch=4, rows=2, teams=4), "multiple of teams"),
    (dict(batch=4, teams=3), "teams"),
])
def test_batched_refused(bad, match):
    fields = dict(qtype="Q4_K", k=4096, epilogue="none", dot="dp4a", stages=3, rows=2)
    fields.update(bad)
    with pytest.raises(ValueError, match=match):
        G.GemvPlan.make(fields.pop("qtype"), fields.pop("k"), fields.pop("epilogue"), **fields)


def test_batched_names_tell_batches_apart():
    a = G.GemvPlan.make("Q4_K", 4096, batch=4, dot="dp4a", stages=3, rows=2)
    b = G.GemvPlan.make("Q4_K", 4096, batch=8, dot="dp4a", stages=3, rows=2)
    assert a.kernel_name != b.kernel_name
    assert a.kernel_name in G.build(a).to_ptx()


SHAPES = [("Q4_K", 4096, "none", 2), ("Q4_K", 4096, "residual", 8), ("Q4_K", 4096, "swiglu", 4),
          ("Q4_K", 14336, "residual", 2), ("Q6_K", 4096, "none", 8), ("Q6_K", 14336, "residual", 2),
          ("Q4_K", 14336, "residual", 16), ("Q6_K", 14336, "residual", 8),
          ("Q4_K", 4096, "bias", 32)]
#: the fused gate and up at 16 rows of x fit only sm_90's larger shared memory
SM90_SHAPES = [("Q4_K", 4096, "swiglu", 16)]


@pytest.mark.parametrize("target,qtype,k,epi,B",
                         [(t,) + s for t in ("sm_80", "sm_90") for s in SHAPES]
                         + [("sm_90",) + s for s in SM90_SHAPES])
def test_batched_ptxas_no_spills(ptxas, target, qtype, k, epi, B):
    """The model's shapes at the configs the selector gives them (K in
    slices where x of B rows does not fit whole)."""
    spec = G.batch_plan(qtype, k, epi, batch=B, m=4096, sm_count=132, target=target)
    _, reports = assemble(G.build(spec).to_ptx(), target)
    assert len(reports) == 1 and reports[0].spill_stores == 0, reports


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,m,k,epi,B,n", [
    ("Q4_K", 4096, 4096, "residual", 8, 7), ("Q4_K", 1031, 4096, "swiglu", 4, 4),
    ("Q4_K", 6144, 4096, "bias", 2, 2), ("Q4_K", 4096, 14336, "residual", 4, 3),
    ("Q6_K", 4096, 14336, "residual", 4, 4), ("Q6_K", 2053, 4096, "none", 16, 16),
    ("Q4_K", 4099, 4096, "none", 16, 13), ("Q4_K", 4096, 14336, "residual", 16, 16),
    ("Q6_K", 4096, 14336, "residual", 32, 29), ("Q4_K", 6144, 4096, "none", 32, 32)])
def test_batched_gemv_gpu_model_shapes(gpu_run, qtype, m, k, epi, B, n, rng):
    """The 8B model's projection shapes at the selector's config for the GPU
    (K in slices where x of B rows does not fit whole)."""
    spec = G.batch_plan(qtype, k, epi, batch=B, m=m, target=gpu_run.target(),
                        sm_count=gpu_run.backend.sm_count)
    ws = _weights(rng, qtype, m, k, spec.n_mats)
    x = rng.standard_normal((B, k)).astype(np.float32)
    r = rng.standard_normal((B, m)).astype(np.float32) if epi == "residual" else None
    bias = rng.standard_normal(m).astype(np.float32) if epi == "bias" else None
    y = run_batched(gpu_run, spec, ws, x, n, r=r, bias=bias)
    assert rel_err(y[:n], _ref_rows(spec, ws, x, n, r, bias)) <= BOUND
    assert np.all(np.isnan(y[n:]))


def test_crossover_from_the_table_unless_measured_on_the_device(tmp_path, monkeypatch):
    """The table's crossover, until one measured on the device is stored in
    the user tuning cache (what scripts/bench_batchgemv.py --store does);
    another device keeps the table's."""
    from ptxgen.kernels import tuning
    monkeypatch.setenv("PTXGEN_CACHE_DIR", str(tmp_path))
    spec = G.GemvSpec("Q4_K", 4096, target="sm_90", batch=2)
    table = G.batch_crossover(spec, 4096, "H100")
    assert table == tuning.cascade("gemv_batch", dict(
        qtype="Q4_K", epilogue="none", k=4096, m=4096, sm=90, target="sm_90",
        batch=2))["crossover"]
    measured = table + 5
    tuning.store_user_config("gemv_batch", "H100", G.crossover_call("sm_90"),
                             {"crossover": measured}, {})
    assert G.batch_crossover(spec, 4096, "H100") == measured
    assert G.batch_crossover(spec, 4096, "A100") == table
    assert G.batch_crossover(spec, 4096, None) == table
