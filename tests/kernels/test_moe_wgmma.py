"""The experts' warpgroup GEMM (kernels/moe/expert_wgmma.py) and the rows
it reads in the experts' order (kernels/moe/permute.py), against
independent references.

The permutation is a gather and one rounding: ``xs`` must equal numpy's
``x[pairs // n_used]`` rounded to f16 bit for bit, and the rows past the
chunk's pairs must keep their poison.

The GEMM's oracle is float64: each row of X (in the experts' order, f16 so
exact) times its expert's float64 weights (Q4_K from
``quants.dequantize``, Q6_K from gguf's decoder), ``silu(g) *`` that for
the SwiGLU epilogue.  The bound per output is the warpgroup GEMM's (the
dense kernel's tests, tests/kernels/test_gemm_wgmma.py: the scales and
weights rounded to f16, the wgmma chain's f32 sums, summed with absolute
values over K), times ``|silu(g)|`` for the SwiGLU epilogue, plus ``2^-20
|y|`` for its ``ex2.approx``, ``div.rn`` and ``mul.rn`` and ``2^-11 |y|``
for its rounding to f16.  Experts are chosen by every token (several
column tiles), by one token and by none; the rows of X past the pairs are
random (a tile's rows past its expert's count read them, and must not be
stored).
"""

import numpy as np
import pytest

from ptxgen.kernels import gemm as GM
from ptxgen.kernels.moe import expert_wgmma as XW
from ptxgen.kernels.moe import group as GR
from ptxgen.kernels.moe import permute as PM
from ptxgen.ptxas import assemble

import test_gemm
from test_moe_gemm import _bound, _experts, _ids


def _spec(qtype, k, out, E, **config):
    return XW.ExpertWgmmaSpec(GM.GemmPlan.make(qtype, k, x_type="f16", target="sm_90a",
                                               kernel="wgmma", **config), E, out)


# (qtype, K, out, config): M = 72 cuts the 64- and 128-row tiles short;
# column tiles of 8 (the popular expert's 11 pairs in two) and 16; rings of
# 3 to 5 stages over 1 and 2 super-blocks; one and two warpgroups; 70
# experts over 128 threads of the scan
CASES = [
    ("Q4_K", 256, "sorted", 6, dict(bm=64, bn=8, stages=3)),
    ("Q4_K", 512, "swiglu", 6, dict(bm=128, bn=16, stages=4)),
    ("Q4_K", 512, "pairs", 70, dict(bm=64, bn=8, stages=5)),
    ("Q6_K", 256, "pairs", 6, dict(bm=64, bn=8, stages=3)),
    ("Q6_K", 512, "swiglu", 6, dict(bm=64, bn=16, stages=4)),
    ("Q6_K", 512, "sorted", 6, dict(bm=128, bn=8, stages=3)),
]


@pytest.mark.parametrize("qtype,K,out,E,config", CASES)
def test_expert_wgmma(backend, rng, seed, qtype, K, out, E, config):
    backend.require_sm(90)
    NU, M, T, t_rows = 2, 72, 11, 13
    spec = _spec(qtype, K, out, E, **config)
    raw, wd, wa = _experts(rng, qtype, E, M, K)
    ids = _ids(rng, T, NU, E)
    counts, offsets, pairs = GR.reference(ids, E)
    P, R = T * NU, t_rows * NU
    xs = rng.standard_normal((R, K)).astype(np.float16)
    ydt = np.float16 if out == "swiglu" else np.float32
    y = backend.poisoned((R, M), ydt)
    fn = backend.load(XW.build(spec))[spec.kernel_name]
    xa = backend.array(xs)
    args = dict(w=backend.array(raw), y=y, m=M, counts=backend.array(counts),
                offsets=backend.array(offsets),
                xmap=backend.tensor_map(GM.x_map(spec.plan, int(xa.ptr), R)))
    gate = None
    if out == "swiglu":
        gate = (2 * rng.standard_normal((R, M))).astype(np.float32)
        args["r"] = backend.array(gate)
    if out == "pairs":
        args["pairs"] = backend.array(np.concatenate(
            [pairs, rng.integers(0, 2 ** 32, R - P, dtype=np.uint32)]))
    backend.launch(fn, XW.launch_geometry(spec, M, t_rows, NU), args)
    got = y.to_numpy()
    ref = XW.reference(spec, wd, xs, counts, pairs, gate)
    flat = np.repeat(np.arange(E), counts)
    plain = np.einsum("qmk,qk->qm", wd[flat], xs[:P].astype(np.float64))
    bnd = _bound(qtype, xs[:P], wa[flat], plain)
    if out == "swiglu":
        g = gate[:P].astype(np.float64)
        bnd = np.abs(g / (1 + np.exp(-g))) * bnd + (2.0 ** -20 + 2.0 ** -11) * np.abs(ref)
    if out == "pairs":
        bnd[pairs] = bnd.copy()
    test_gemm._check(got[:P].astype(np.float32), ref, bnd, f"seed={seed}: {spec.kernel_name}")
    assert np.all(np.isnan(got[P:])), f"seed={seed}: rows past the pairs written"
    assert counts[0] == T and counts[1] >= 1 and counts[E - 1] == 0


def test_expert_wgmma_no_pairs(backend):
    """Every expert empty: all CTAs exit after the scan, nothing stored."""
    backend.require_sm(90)
    E, NU, M, K, T = 6, 2, 64, 256, 4
    spec = _spec("Q4_K", K, "sorted", E, bm=64, bn=8, stages=3)
    xa = backend.array(np.zeros((T * NU, K), np.float16))
    y = backend.poisoned((T * NU, M), np.float32)
    rb = spec.plan.row_bytes
    args = dict(w=backend.array(np.zeros((E, M, rb), np.uint8)), y=y, m=M,
                counts=backend.array(np.zeros(E, np.uint32)),
                offsets=backend.array(np.zeros(E, np.uint32)),
                xmap=backend.tensor_map(GM.x_map(spec.plan, int(xa.ptr), T * NU)))
    fn = backend.load(XW.build(spec))[spec.kernel_name]
    backend.launch(fn, XW.launch_geometry(spec, M, T, NU), args)
    assert np.all(np.isnan(y.to_numpy()))


@pytest.mark.parametrize("K,block", [(256, 64), (2048, 256), (264, 32)])
def test_permute(backend, rng, seed, K, block):
    """``xs`` bit for bit numpy's; the rows past T n_used keep their poison
    (their pairs are garbage and must not be read)."""
    E, NU, T, t_rows = 40, 3, 9, 12
    spec = PM.MoePermuteSpec(NU, K, block=block)
    ids = _ids(rng, T, NU, E)
    _, _, pairs = GR.reference(ids, E)
    pairs = np.concatenate([pairs, np.full((t_rows - T) * NU, 0xA5A5A5A5, np.uint32)])
    x = (rng.standard_normal((t_rows, K)) * 300).astype(np.float32)
    xs = backend.poisoned((t_rows * NU, K), np.float16)
    fn = backend.load(PM.build(spec))[spec.kernel_name]
    backend.launch(fn, PM.launch_geometry(spec, t_rows),
                   dict(x=backend.array(x), pairs=backend.array(pairs),
                        t_ptr=backend.array(np.array([T], np.uint32)), xs=xs))
    got = xs.to_numpy()
    want = PM.reference(x, pairs[:T * NU], NU)
    assert np.array_equal(got[:T * NU].view(np.uint16), want.view(np.uint16)), f"seed={seed}"
    assert np.all(np.isnan(got[T * NU:])), f"seed={seed}: rows past T n_used written"


@pytest.mark.parametrize("family,name", [(XW, n) for n in sorted(XW.CANONICAL)]
                         + [(PM, n) for n in sorted(PM.CANONICAL)])
def test_moe_wgmma_ptxas_clean(ptxas, family, name):
    """The canonical kernels assemble for sm_90a with no spills and no stack."""
    spec = family.CANONICAL[name]
    target = "sm_90a" if family is XW else "sm_90"
    _, reports = assemble(family.build(spec).to_ptx(), target)
    assert len(reports) == 1, reports
    r = reports[0]
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r


@pytest.mark.parametrize("bad, message", [
    (dict(plan="x", n_expert=8), "plan must be a GemmPlan"),
    (dict(plan=GM.GemmPlan.make("Q4_K", 256), n_expert=8), "the wgmma kernel, not 'mma'"),
    (dict(plan=GM.GemmPlan.make("Q4_K", 512, x_type="f16", target="sm_90a", kernel="wgmma",
                                split_k=2), n_expert=8), "no t_device, y_stride or split_k"),
    (dict(plan=GM.GemmPlan.make("Q4_K", 256, x_type="f16", target="sm_90a", kernel="wgmma"),
          n_expert=0), "n_expert must be"),
    (dict(plan=GM.GemmPlan.make("Q4_K", 256, x_type="f16", target="sm_90a", kernel="wgmma"),
          n_expert=8, out="scatter"), "out must be one of"),
])
def test_expert_wgmma_refuses(bad, message):
    with pytest.raises(ValueError, match=message):
        XW.ExpertWgmmaSpec(**bad)


def test_expert_wgmma_geometry():
    """The packed grid (the most nonempty column tiles there can be) and
    an expert's matrix that would start unaligned."""
    spec = _spec("Q6_K", 768, "pairs", 128, bm=128, bn=32, stages=4)
    geo = XW.launch_geometry(spec, 2048, 512, 8)
    assert geo.grid == ((512 * 8 + 128 * 31 + 31) // 32, 16, 1)
    assert geo.block == (256, 1, 1)
    assert XW.launch_geometry(spec, 2048, 2, 8).grid[0] == 16
    with pytest.raises(ValueError, match="M=4 rows of 630 bytes"):
        XW.launch_geometry(spec, 4, 64, 8)
    with pytest.raises(ValueError, match="k must be a positive multiple of 8"):
        PM.MoePermuteSpec(8, 100)
