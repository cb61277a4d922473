"""A chunk's pairs grouped by expert (kernels/moe/group.py) and the experts'
grouped GEMM over them (kernels/moe/expert_gemm.py), against independent
references.

The grouping is integer work: its counts, offsets and pairs must equal
numpy's (``bincount`` and a stable ``argsort`` of the ids) exactly, and
the pairs past the chunk's must stay as they were.

The GEMM's oracle is float64: each pair's row of X times its expert's
float64 weights (Q4_K from ``quants.dequantize``, Q6_K from gguf's
decoder), ``silu(g) *`` that for the SwiGLU epilogue.  The bound per output
is the GEMM family's (tests/kernels/test_gemm.py and test_gemm_qtypes.py:
X and the scales rounded to f16, the mma chain's f32 sums, summed with
absolute values over K), times ``|silu(g)|`` for the SwiGLU epilogue, plus
``2^-20 |y|`` for its ``ex2.approx``, ``div.rn`` and ``mul.rn``.
"""

import numpy as np
import pytest

from ptxgen.kernels import gemm as GM
from ptxgen.kernels import quants
from ptxgen.kernels.moe import expert_gemm as XG
from ptxgen.kernels.moe import group as GR
from ptxgen.ptxas import assemble

import test_gemm
import test_gemm_qtypes

gguf = pytest.importorskip("gguf")


def _ids(rng, T, NU, E):
    """``[T, NU]`` distinct experts a token, with expert 0 chosen by every
    token, expert 1 by one token and expert ``E - 1`` by none (the rest at
    random)."""
    ids = np.empty((T, NU), np.int32)
    lone = rng.integers(T)
    for t in range(T):
        pool = np.arange(2, E - 1)
        rest = rng.choice(pool, NU - 1 - (t == lone), replace=False)
        row = [0] + ([1] if t == lone else []) + list(rest)
        ids[t] = rng.permutation(row)
    return ids


def _check_group(run, rng, seed, ids, T, E, NU, block):
    """Launch the grouping of ``ids`` (``[t_rows, NU]``, rows past ``T``
    garbage) and compare with the reference; returns the counts."""
    t_rows = ids.shape[0]
    spec = GR.MoeGroupSpec(E, NU, block=block)
    fn = run.function(GR.build, spec)
    pairs0 = rng.integers(0, 2 ** 32, t_rows * NU, dtype=np.uint32)
    args = dict(ids=run.array(ids), t_ptr=run.array(np.array([T], np.uint32)),
                counts=run.poisoned(E, np.uint32), offsets=run.poisoned(E, np.uint32),
                pairs=run.array(pairs0))
    run.launch(fn, GR.launch_geometry(spec), args)
    counts, offsets, pairs = GR.reference(ids[:T], E)
    got = run.get(args["pairs"])
    assert np.array_equal(run.get(args["counts"]), counts), f"seed={seed}: counts"
    assert np.array_equal(run.get(args["offsets"]), offsets), f"seed={seed}: offsets"
    assert np.array_equal(got[:T * NU], pairs), f"seed={seed}: pairs"
    assert np.array_equal(got[T * NU:], pairs0[T * NU:]), f"seed={seed}: pairs past T"
    return counts


# one warp (E past the block) and several, a warp count that does not
# divide the pairs (96 threads), segments of whole and part rounds, the
# default block (16 warps) with warps left without pairs (T = 5), and the
# most experts (8 warps, ten bits an id)
@pytest.mark.parametrize("E,NU,T,t_rows,block", [(6, 2, 5, 7, 32), (40, 3, 9, 9, 32),
                                                  (40, 3, 9, 9, 96), (128, 8, 20, 24, 128),
                                                  (128, 8, 150, 160, 128),
                                                  (128, 8, 150, 160, GR.default_block(128)),
                                                  (40, 3, 5, 8, GR.default_block(40)),
                                                  (1024, 8, 40, 40, GR.default_block(1024))])
def test_group(run, rng, seed, E, NU, T, t_rows, block):
    """Counts, offsets and the stable order of the pairs; the ids of the
    rows past T (the bucket's) are garbage and must not be read."""
    ids = np.concatenate([_ids(rng, T, NU, E), np.full((t_rows - T, NU), -0x5A5A5A5A,
                                                        np.int32)])
    counts = _check_group(run, rng, seed, ids, T, E, NU, block)
    assert counts[0] == T and counts[1] >= 1 and counts[E - 1] == 0


@pytest.mark.parametrize("block", [96, 512])
def test_group_ties(run, rng, seed, block):
    """Ids drawn with repeats (a token may name an expert twice), most of
    them from four experts, so a round of 32 holds many lanes of the same
    expert and the peers must keep their order; most experts get no pair."""
    E, NU, T = 128, 8, 70
    ids = np.where(rng.random((T, NU)) < 0.9, rng.integers(0, 4, (T, NU)),
                   rng.integers(0, E, (T, NU))).astype(np.int32)
    counts = _check_group(run, rng, seed, ids, T, E, NU, block)
    assert (counts == 0).sum() > E // 2


def _experts(rng, qtype, E, M, K):
    """``(bytes [E, M, row_bytes], float64 [E, M, K], |parts| [E, M, K])``
    of random experts; the bound's per-weight magnitude as the GEMM
    tests take it."""
    raw, wd, wa = [], [], []
    for _ in range(E):
        if qtype == "Q4_K":
            w, a = test_gemm._weights(rng, M, K)
            d = quants.dequantize(w, "Q4_K", (M, K)).astype(np.float64)
        else:
            w = test_gemm_qtypes.random_blocks(rng, qtype, M, K)
            d = np.asarray(gguf.quants.dequantize(w, getattr(gguf.GGMLQuantizationType, qtype)),
                           np.float64).reshape(M, K)
            a = np.abs(d)
        raw.append(w.reshape(M, -1))
        wd.append(d)
        wa.append(a)
    return np.stack(raw), np.stack(wd), np.stack(wa)


def _bound(qtype, xrows, wa_rows, ref):
    """Per output: the GEMM family's bound for each pair's row and expert."""
    out = np.empty_like(ref)
    for p in range(ref.shape[0]):
        x = xrows[p][None]
        if qtype == "Q4_K":
            out[p] = test_gemm.bound(x, wa_rows[p], ref[p][None], None)[0]
        else:
            out[p] = test_gemm_qtypes.bound(qtype, x, wa_rows[p], ref[p][None], None)[0]
    return out


# (qtype, K, x_token, swiglu, config): M cuts the tiles short, bn=8 gives
# the popular expert several column tiles; x_ahead with a ring of 2 (the
# stage stored into is the one just read), of 4 over 4 K steps (the loads
# past K masked from the first step), of 2 over one K step (no stage ahead
# at all) and of 3 over Q6_K's halves
CASES = [
    ("Q4_K", 256, True, False, dict(bm=32, bn=8, bk=64, warps_m=2, warps_n=1, stages=2)),
    ("Q4_K", 512, True, True, dict(bm=32, bn=16, bk=128, warps_m=1, warps_n=2, stages=3,
                                   target="sm_90", pdl=True)),
    ("Q6_K", 256, False, False, dict(bm=32, bn=8, bk=128, warps_m=2, warps_n=1, stages=2)),
    ("Q4_K", 256, False, False, dict(bm=16, bn=8, bk=64, warps_m=1, warps_n=1, stages=3)),
    ("Q4_K", 512, True, True, dict(bm=32, bn=16, bk=64, warps_m=1, warps_n=2, stages=2,
                                   x_ahead=True)),
    ("Q4_K", 256, True, False, dict(bm=32, bn=8, bk=64, warps_m=2, warps_n=1, stages=4,
                                    x_ahead=True)),
    ("Q4_K", 256, True, True, dict(bm=32, bn=8, bk=256, warps_m=2, warps_n=1, stages=2,
                                   x_ahead=True)),
    ("Q6_K", 512, False, False, dict(bm=32, bn=16, bk=128, warps_m=2, warps_n=2, stages=3,
                                     x_ahead=True)),
    # packed column tiles: the popular expert's several tiles (bn=8) and
    # experts in both warps (40 over 64 threads), a thread owning three
    # experts (70 over 32 threads), x_ahead
    ("Q6_K", 256, False, False, dict(bm=32, bn=8, bk=128, warps_m=2, warps_n=1, stages=2,
                                     n_expert=40)),
    ("Q4_K", 256, True, True, dict(bm=16, bn=8, bk=64, warps_m=1, warps_n=1, stages=3,
                                   n_expert=70)),
    ("Q4_K", 512, True, False, dict(bm=32, bn=16, bk=64, warps_m=1, warps_n=2, stages=3,
                                    x_ahead=True, n_expert=6)),
]


@pytest.mark.parametrize("qtype,K,x_token,swiglu,config", CASES)
def test_expert_gemm(run, rng, seed, qtype, K, x_token, swiglu, config):
    config = dict(config)
    x_ahead, packed = config.pop("x_ahead", False), config.pop("n_expert", 0)
    E, NU, M, T, t_rows = packed or 6, 2, 40, 11, 13
    spec = XG.ExpertGemmSpec(GM.GemmPlan.make(qtype, K, **config), NU, x_token=x_token,
                             swiglu=swiglu, x_ahead=x_ahead, n_expert=packed)
    raw, wd, wa = _experts(rng, qtype, E, M, K)
    ids = _ids(rng, T, NU, E)
    counts, offsets, pairs = GR.reference(ids, E)
    x = rng.standard_normal((t_rows, K) if x_token else (t_rows * NU, K)).astype(np.float32)
    y0 = np.full((t_rows * NU, M), np.nan, np.float32)
    gate = None
    if swiglu:
        gate = (2 * rng.standard_normal((T * NU, M))).astype(np.float32)
        y0[:T * NU] = gate
    fn = run.function(XG.build, spec)
    y = run.array(y0)
    args = dict(w=run.array(raw), x=run.array(x), y=y, m=M, counts=run.array(counts),
                offsets=run.array(offsets), pairs=run.array(pairs))
    if swiglu:
        args["r"] = y
    run.launch(fn, XG.launch_geometry(spec, M, t_rows, E), args)
    got = run.get(y)
    ref = XG.reference(spec, wd, ids, x, gate=gate)
    flat = ids.reshape(-1)
    rows = np.arange(T * NU) // NU if x_token else np.arange(T * NU)
    plain = np.einsum("pmk,pk->pm", wd[flat], x[rows].astype(np.float64))
    bnd = _bound(qtype, x[rows], wa[flat], plain)
    if swiglu:
        g = gate.astype(np.float64)
        bnd = np.abs(g / (1 + np.exp(-g))) * bnd + 2.0 ** -20 * np.abs(ref)
    test_gemm._check(got[:T * NU], ref, bnd, f"seed={seed}: {spec.kernel_name}")
    assert np.all(np.isnan(got[T * NU:])), f"seed={seed}: rows past T written"


@pytest.mark.parametrize("family,name", [(XG, n) for n in sorted(XG.CANONICAL)]
                         + [(GR, n) for n in sorted(GR.CANONICAL)])
def test_moe_gemm_ptxas_clean(ptxas, family, name):
    """The canonical kernels assemble for sm_90 with no spills and no stack."""
    spec = family.CANONICAL[name]
    _, reports = assemble(family.build(spec).to_ptx(), "sm_90")
    assert len(reports) == 1, reports
    r = reports[0]
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r


@pytest.mark.parametrize("bad, message", [
    (dict(plan="x", n_used=2), "plan must be a GemmPlan"),
    (dict(plan=GM.GemmPlan.make("Q4_K", 256, x_type="f16"), n_used=2), "f32 X"),
    (dict(plan=GM.GemmPlan.make("Q4_K", 256, t_device=True), n_used=2), "no t_device"),
    (dict(plan=GM.GemmPlan.make("Q4_K", 256), n_used=0), "n_used must be"),
    (dict(plan=GM.GemmPlan.make("Q4_K", 256), n_used=2, n_expert=-1), "n_expert must be"),
])
def test_expert_gemm_refuses(bad, message):
    with pytest.raises(ValueError, match=message):
        XG.ExpertGemmSpec(**bad)


def test_expert_gemm_packed_geometry():
    """The packed grid: the most nonempty column tiles there can be, and
    the launch's expert count must be the spec's."""
    spec = XG.ExpertGemmSpec(GM.GemmPlan.make("Q4_K", 256, bn=32), 8, n_expert=128)
    assert XG.launch_geometry(spec, 768, 512, 128).grid[0] == (512 * 8 + 128 * 31 + 31) // 32
    assert XG.launch_geometry(spec, 768, 2, 128).grid[0] == 16      # a tile a pair at most
    with pytest.raises(ValueError, match="n_expert=64 is not the spec's 128"):
        XG.launch_geometry(spec, 768, 512, 64)


def test_group_refuses():
    with pytest.raises(ValueError, match="n_used=9 is more than n_expert=8"):
        GR.MoeGroupSpec(8, 9)
    with pytest.raises(ValueError, match="block=512 gives 16 warps .* more than 32768"):
        GR.MoeGroupSpec(1024, 8, block=512)


@pytest.mark.parametrize("E", [1, 6, 128, 512, 1024])
def test_group_default_block(E):
    """The default block is a valid spec's: whole warps, the table in bounds."""
    b = GR.default_block(E)
    GR.MoeGroupSpec(E, 1, block=b)
    assert b % 32 == 0 and 32 <= b <= 512
