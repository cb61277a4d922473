"""The experts' GEMV (the selected experts' rows of a 3-D ``*_exps`` weight,
ids read from device memory) and the weighted sum of the experts' outputs,
against float64.

The oracle: ``gemv.reference`` of each selected expert's matrix, sliced
from the 3-D weight in numpy (float64 weights from ``quants.dequantize``,
which tests/test_quants.py checks against gguf's decoder), and
``combine.reference`` (``r + sum_j w_j y_j`` in float64).  Bounds: the
GEMV family's (``BOUND`` relative to the largest output, f32 sums of
``K`` terms); the combine adds ``n_used`` f32 products.
"""

import attrs
import numpy as np
import pytest

from ptxgen.kernels import gemv as G
from ptxgen.kernels import quants
from ptxgen.kernels.moe import combine as C
from ptxgen.kernels.moe import expert_gemv as X
from ptxgen.kernels.moe import router as R
from ptxgen.ptxas import assemble

BOUND = 1e-5


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _experts(rng, qtype, n_expert, m, k):
    """A 3-D weight ``uint8 [n_expert, m, row_bytes]`` of random experts."""
    return np.stack([quants.quantize(rng.standard_normal((m, k)).astype(np.float32), qtype)
                     for _ in range(n_expert)])


def _spec(qtype, k, epilogue, x_slot, norm=False, **config):
    return X.ExpertGemvSpec(G.GemvPlan(G.GemvSpec(qtype, k, epilogue=epilogue, norm=norm),
                                       G.GemvConfig(**config)), x_slot=x_slot)


CASES = [
    ("Q4_K", 256, "swiglu", False, dict(rows=1)),
    ("Q4_K", 512, "swiglu", False, dict(rows=2, stages=3)),
    ("Q4_K", 512, "swiglu", False, dict(rows=2, dot="dp4a")),
    ("Q4_K", 256, "none", True, dict(rows=4)),
    ("Q6_K", 256, "none", True, dict(rows=2)),
    ("Q8_0", 256, "none", True, dict(rows=2, stages=2, tile=256)),
    ("Q8_0", 256, "swiglu", False, dict(rows=2)),
    ("Q5_K", 256, "none", True, dict(rows=1)),
]


@pytest.mark.parametrize("qtype,k,epi,x_slot,config", CASES)
def test_expert_gemv(run, rng, seed, qtype, k, epi, x_slot, config):
    E, NU, M = 6, 3, 24
    spec = _spec(qtype, k, epi, x_slot, **config)
    w = _experts(rng, qtype, E, M, k)
    wu = _experts(rng, qtype, E, M, k) if epi == "swiglu" else None
    ids = rng.choice(E, NU, replace=False).astype(np.int32)
    x = rng.standard_normal((NU, k) if x_slot else k).astype(np.float32)
    fn = run.function(X.build, spec)
    args = dict(w=run.array(w), x=run.array(x), y=run.poisoned((NU, M)), m=M,
                ids=run.array(ids))
    if wu is not None:
        args["wu"] = run.array(wu)
    run.launch(fn, X.launch_geometry(spec, M, NU), args)
    out = run.get(args["y"])
    ref = X.reference(spec, w, ids, x, w_up=wu)
    for j in range(NU):
        err = rel_err(out[j], ref[j])
        assert err <= BOUND, f"seed={seed}: expert {ids[j]} (slot {j}) off by {err:.3g}"


@pytest.mark.parametrize("x_slot", [False, True])
def test_expert_gemv_tokens(run, rng, seed, x_slot):
    """A chunk's tokens (grid.z): each token its own experts and x; the
    token planes past T (read from t_ptr) leave y alone."""
    E, NU, M, K, T, t_rows = 6, 2, 16, 256, 3, 4
    spec = X.ExpertGemvSpec(G.GemvPlan(G.GemvSpec("Q4_K", K, epilogue="none"),
                                       G.GemvConfig(rows=2)), x_slot=x_slot, tokens=True)
    w = _experts(rng, "Q4_K", E, M, K)
    ids = np.stack([rng.choice(E, NU, replace=False) for _ in range(t_rows)]).astype(np.int32)
    x = rng.standard_normal((t_rows, NU, K) if x_slot else (t_rows, K)).astype(np.float32)
    fn = run.function(X.build, spec)
    args = dict(w=run.array(w), x=run.array(x), y=run.poisoned((t_rows, NU, M)), m=M,
                ids=run.array(ids), t_ptr=run.array(np.array([T], np.uint32)))
    run.launch(fn, X.launch_geometry(spec, M, NU, t_rows), args)
    out = run.get(args["y"])
    for t in range(T):
        err = rel_err(out[t], X.reference(spec, w, ids[t], x[t]))
        assert err <= BOUND, f"seed={seed}: token {t} off by {err:.3g}"
    assert np.all(np.isnan(out[T:]))


def test_expert_gemv_norm(run, rng, seed):
    """The gate/up GEMV with the FFN's RMSNorm folded in (Q4_K)."""
    E, NU, M, K = 5, 2, 16, 256
    spec = _spec("Q4_K", K, "swiglu", False, rows=1, norm=True)
    w, wu = _experts(rng, "Q4_K", E, M, K), _experts(rng, "Q4_K", E, M, K)
    ids = np.array([4, 1], np.int32)
    x = rng.standard_normal(K).astype(np.float32)
    nw = (1.0 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    eps = 1e-6
    fn = run.function(X.build, spec)
    args = dict(w=run.array(w), wu=run.array(wu), x=run.array(x), nw=run.array(nw), eps=eps,
                y=run.poisoned((NU, M)), m=M, ids=run.array(ids))
    run.launch(fn, X.launch_geometry(spec, M, NU), args)
    ref = X.reference(spec, w, ids, x, w_up=wu, norm_w=nw, eps=eps)
    err = rel_err(run.get(args["y"]), ref)
    assert err <= BOUND, f"seed={seed}: off by {err:.3g}"


@pytest.mark.parametrize("NU,M,block", [(8, 300, 128), (1, 64, 64), (3, 2048, 256)])
def test_combine(run, rng, seed, NU, M, block):
    spec = C.MoeCombineSpec(NU, block=block)
    y = rng.standard_normal((1, NU, M)).astype(np.float32)
    w = rng.dirichlet(np.ones(NU)).astype(np.float32)[None]
    r = rng.standard_normal((1, M)).astype(np.float32)
    fn = run.function(C.build, spec)
    out = run.poisoned((1, M))
    run.launch(fn, C.launch_geometry(spec, M), dict(y=run.array(y), weights=run.array(w),
                                                    r=run.array(r), out=out, m=M))
    err = rel_err(run.get(out), C.reference(y, w, r))
    assert err <= 1e-6, f"seed={seed}: off by {err:.3g}"


def test_combine_rows_in_place(run, rng, seed):
    """T of t_rows tokens, ``out`` the residual itself; rows past T untouched."""
    NU, M, T, t_rows = 4, 100, 2, 3
    spec = C.MoeCombineSpec(NU, rows=True, block=64)
    y = rng.standard_normal((t_rows, NU, M)).astype(np.float32)
    w = rng.dirichlet(np.ones(NU), size=t_rows).astype(np.float32)
    r = rng.standard_normal((t_rows, M)).astype(np.float32)
    rd = run.array(r)
    fn = run.function(C.build, spec)
    run.launch(fn, C.launch_geometry(spec, M, t_rows),
               dict(y=run.array(y), weights=run.array(w), r=rd, out=rd, m=M,
                    t_ptr=run.array(np.array([T], np.uint32))))
    out = run.get(rd)
    err = rel_err(out[:T], C.reference(y[:T], w[:T], r[:T]))
    assert err <= 1e-6, f"seed={seed}: off by {err:.3g}"
    assert np.array_equal(out[T:], r[T:])


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("family,name", [(X, n) for n in sorted(X.CANONICAL)]
                         + [(C, n) for n in sorted(C.CANONICAL)]
                         + [(R, n) for n in sorted(R.CANONICAL)])
def test_moe_ptxas_clean(ptxas, family, name, target):
    """The canonical MoE kernels assemble with no spills and no stack."""
    spec = family.CANONICAL[name]
    spec = spec.evolve(target=target) if hasattr(spec, "evolve") else attrs.evolve(
        spec, target=target, **({"pdl": False} if target == "sm_80" else {}))
    _, reports = assemble(family.build(spec).to_ptx(), target)    # raises on a ptxas error
    assert len(reports) == 1, reports
    r = reports[0]
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r


@pytest.mark.parametrize("bad, message", [
    (dict(plan="x"), "plan must be a GemvPlan"),
    (dict(plan=G.GemvPlan(G.GemvSpec("Q4_K", 256, epilogue="residual"), G.GemvConfig())),
     "epilogue 'none' or 'swiglu'"),
    (dict(plan=G.GemvPlan.make("Q4_K", 256, norm=True, norm_out=True)),
     "stores no normed x"),
    (dict(plan=G.GemvPlan.make("Q4_K", 256, "swiglu"), combine=True),
     "combine sums one token's down projections"),
    (dict(plan=G.GemvPlan.make("Q4_K", 256), x_slot=True, tokens=True, combine=True),
     "combine sums one token's down projections"),
])
def test_expert_gemv_refuses(bad, message):
    with pytest.raises(ValueError, match=message):
        X.ExpertGemvSpec(**bad)


def test_combine_refuses():
    with pytest.raises(ValueError, match="n_used must be an int in 1..64"):
        C.MoeCombineSpec(0)


COMBINE_CASES = [
    ("Q6_K", 256, 3, 24, dict(rows=2)),
    ("Q4_K", 256, 4, 30, dict(rows=4)),
    ("Q4_K", 512, 2, 20, dict(rows=2, stages=3, dot="dp4a")),
    ("Q4_K", 256, 3, 40, dict(rows=2, stages=2, dot="dp4a", interleave=True, max_ctas=3)),
    ("Q8_0", 256, 1, 16, dict(rows=2, stages=2, tile=256)),
]


def _combine_launches(run, rng, spec, n_expert, n_used, m, launches):
    """``launches`` launches in a row of the down projection with the
    weighted sum folded in (``spec.combine``), over one random weight of
    ``n_expert`` experts and one set of counters, each launch on new
    ``ids``, ``x``, weights and residual.  Yields after each launch the
    residual's relative error against ``X.combine_reference`` and the
    counters as the launch left them."""
    qtype, k = spec.plan.spec.qtype, spec.plan.spec.k
    w = _experts(rng, qtype, n_expert, m, k)
    wd = run.array(w)
    fn = run.function(X.build, spec)
    counter = run.array(np.zeros(X.counter_words(spec, m), np.uint32))
    for _ in range(launches):
        ids = rng.choice(n_expert, n_used, replace=False).astype(np.int32)
        x = rng.standard_normal((n_used, k)).astype(np.float32)
        wts = rng.dirichlet(np.ones(n_used)).astype(np.float32)
        r = rng.standard_normal(m).astype(np.float32)
        rd = run.array(r)
        run.launch(fn, X.launch_geometry(spec, m, n_used),
                   dict(w=wd, x=run.array(x), y=run.poisoned((n_used, m)), m=m,
                        ids=run.array(ids), weights=run.array(wts), r=rd, out=rd,
                        counter=counter))
        yield (rel_err(run.get(rd), X.combine_reference(spec, w, ids, x, wts, r)),
               run.get(counter))


@pytest.mark.parametrize("qtype,k,NU,M,config", COMBINE_CASES)
def test_expert_gemv_combine(run, rng, seed, qtype, k, NU, M, config):
    """The down projection with the weighted sum folded in: ``r += sum_j
    w_j W_{ids[j]} x_j`` in one launch, ``out`` the residual itself; a
    second launch (a replay) must find the counters reset.  The bound is
    the GEMV's plus the combine's f32 sums."""
    E = 6
    spec = X.ExpertGemvSpec(G.GemvPlan(G.GemvSpec(qtype, k), G.GemvConfig(**config)),
                            x_slot=True, combine=True)
    for err, counters in _combine_launches(run, rng, spec, E, NU, M, launches=2):
        assert err <= BOUND, f"seed={seed}: off by {err:.3g}"
        assert not counters.any(), f"seed={seed}: counters left {counters}"


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_expert_gemv_combine_real_shape_gpu(gpu_run, rng, seed, qtype):
    """On the GPU, Qwen3-30B-A3B's down projection (K 768, M 2048, 8 used)
    with the plan the decode step picks: thousands of CTAs race for each
    row group's counter; ten launches in a row, each with new experts, x
    and weights, must each match float64, and leave the counters at 0."""
    E, NU, M, K = 10, 8, 2048, 768
    plan = G.plan(G.GemvSpec(qtype, K, target=gpu_run.target()), m=M)
    spec = X.ExpertGemvSpec(plan, x_slot=True, combine=True)
    launches = _combine_launches(gpu_run, rng, spec, E, NU, M, launches=10)
    for i, (err, counters) in enumerate(launches):
        assert err <= BOUND, f"seed={seed}: launch {i} off by {err:.3g}"
    assert not counters.any()
