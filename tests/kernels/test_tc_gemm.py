"""The tensor-core GEMM examples (tests/kernels/tc_gemm_examples.py) against
a float64 numpy product: ``Y = X . W^T`` with f16 inputs and f32 results.

Bound: each 16-wide K step of an ``mma``/``wgmma`` is within
``2**-21 * (|X| . |W|^T)`` of its exact contribution (docs/emulator.md), so
Y is within ``(K / 16) * 2**-21 * (|X| . |W|^T)``."""

import zlib

import numpy as np
import pytest

from ptxgen.ptxas import assemble
from tc_gemm_examples import mma_gemm, tensor_maps, wgmma_gemm


def _inputs(request, M, N, K):
    seed = zlib.crc32(request.node.nodeid.encode())
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float16)
    w = rng.standard_normal((N, K)).astype(np.float16)
    return seed, x, w


def _check(got, x, w, seed):
    X, W = x.astype(np.float64), w.astype(np.float64)
    want = X @ W.T
    bound = (x.shape[1] / 16) * 2.0 ** -21 * (np.abs(X) @ np.abs(W).T)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"seed={seed}: max error {err.max():.3g} (bound {bound.min():.3g})"


def test_mma_gemm(backend, request):
    M, N, K = 64, 128, 128
    seed, x, w = _inputs(request, M, N, K)
    mod = backend.load(mma_gemm(M, N, K))
    y = backend.poisoned((M, N), np.float32)
    backend.launch_positional(mod["mma_gemm"], (N // 64, M // 64), 128, backend.array(x),
                              backend.array(w), y)
    _check(y.to_numpy(), x, w, seed)


def test_wgmma_gemm(backend, request):
    backend.require_sm(90)
    M, N, K = 128, 64, 128
    seed, x, w = _inputs(request, M, N, K)
    mod = backend.load(wgmma_gemm(M, N, K))
    dx, dw = backend.array(x), backend.array(w)
    xm, wm = tensor_maps(dx, dw)
    y = backend.poisoned((M, N), np.float32)
    backend.launch_positional(mod["wgmma_gemm"], (N // 64, M // 64), 128,
                              backend.tensor_map(xm), backend.tensor_map(wm), y)
    _check(y.to_numpy(), x, w, seed)


@pytest.mark.parametrize("which", ["mma", "wgmma"])
def test_gemm_examples_assemble(ptxas, which):
    if which == "mma":
        for target in ("sm_80", "sm_90"):
            assemble(mma_gemm(64, 64, 128, target).to_ptx(), target)
    else:
        _, reports = assemble(wgmma_gemm(64, 64, 128).to_ptx(), "sm_90a")
        assert all(r.spill_stores == 0 for r in reports)
