"""``ptxgen.driver.ops`` with numpy arrays: run on the CPU emulator (always)
and on a GPU (marked ``gpu``), checked against float64 references written
here; plus how the backend of a call is chosen and mixed calls refused.

Inputs are fresh random data every run; each test prints its seed (pytest
shows it when the test fails) and puts it in assertion messages.  Outputs
given as ``out=`` are poisoned (NaN) first.  Shapes are tiny: the emulator
runs every thread of every block on the CPU.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from ptxgen import emu
from ptxgen.driver import ops
from ptxgen.driver import ops_backend
from ptxgen.kernels import quants

from backends import cuda_available

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

BACKENDS = ["emu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def seed(request):
    s = int.from_bytes(os.urandom(8), "little")
    print(f"{request.node.name}: seed={s}")
    request.node.user_properties.append(("seed", s))
    return s


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)


@pytest.fixture(params=BACKENDS)
def where(request):
    """The backend a numpy call is sent to (``backend=``)."""
    if request.param == "cuda" and not cuda_available():
        pytest.skip("no NVIDIA GPU / driver available for the cuda backend")
    return request.param


def rel_err(out, ref) -> float:
    """``max|out - ref| / max|ref|`` (inf when ``out`` has a non-finite value)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def nan(*shape):
    return np.full(shape, np.nan, np.float32)


# --- float64 references ---------------------------------------------------------

def ref_rmsnorm(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def ref_silu_mul(g, u):
    g = np.asarray(g, np.float64)
    return g / (1.0 + np.exp(-g)) * np.asarray(u, np.float64)


def ref_inv_freq(d, theta, scaling=None):
    f = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if scaling:
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept,
        # a linear blend in between
        lo_wl = scaling["original_context"] / scaling["low_freq_factor"]
        hi_wl = scaling["original_context"] / scaling["high_freq_factor"]
        wl = 2 * math.pi / f
        smooth = ((scaling["original_context"] / wl - scaling["low_freq_factor"])
                  / (scaling["high_freq_factor"] - scaling["low_freq_factor"]))
        blended = (1 - smooth) * f / scaling["factor"] + smooth * f
        f = np.where(wl < hi_wl, f, np.where(wl > lo_wl, f / scaling["factor"], blended))
    return f


def ref_rope(x, pos, theta, layout, scaling=None):
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    ang = pos * ref_inv_freq(d, theta, scaling)
    c, s = np.cos(ang), np.sin(ang)
    if layout == "neox":
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def ref_attention(q, kc, vc, kv_len):
    q = np.asarray(q, np.float64)
    n_q, d = q.shape
    group = n_q // kc.shape[0]
    out = np.empty((n_q, d))
    for h in range(n_q):
        k = kc[h // group, :kv_len].astype(np.float64)
        v = vc[h // group, :kv_len].astype(np.float64)
        s = k @ q[h] / math.sqrt(d)
        p = np.exp(s - s.max())
        out[h] = p @ v / p.sum()
    return out


def dequant(raw, qtype):
    """float64 weights of GGUF bytes, by the gguf package's decoder."""
    return gguf_dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)


# --- every op, numpy in, numpy out ----------------------------------------------

# Relative bounds (max |error| / max |reference|).  f32 arithmetic over at most
# a few hundred terms; rope's sin/cos are sin.approx/cos.approx (absolute error
# about 5e-7 on the reduced angle), attention's exponentials ex2.approx.  Largest
# errors seen on the emulator over 12 seeds: rmsnorm 1.4e-7, swiglu 1.1e-7, rope
# 1.9e-7, attention 2.5e-7, GEMV 6.8e-7 (Q6_K, K = 256).
BOUND = 1e-6
ROPE_BOUND = 2e-6
ATTN_BOUND = 2e-6
GEMV_BOUND = 4e-6


def test_rmsnorm(where, rng, seed):
    x, w = f32(rng, 3, 200), f32(rng, 200)
    eps = float(rng.uniform(1e-6, 1e-4))
    got = ops.rmsnorm(x, w, eps, backend=where)
    assert isinstance(got, np.ndarray) and got.shape == x.shape and got.dtype == np.float32
    assert rel_err(got, ref_rmsnorm(x, w, eps)) <= BOUND, f"seed={seed}"


def test_rmsnorm_residual_into_poisoned_outputs(where, rng, seed):
    x, r, w = f32(rng, 2, 96), f32(rng, 2, 96), f32(rng, 96)
    out, s = nan(2, 96), nan(2, 96)
    got, got_s = ops.rmsnorm(x, w, 1e-5, out=out, residual=r, sum_out=s, backend=where)
    assert got is out and got_s is s
    total = x.astype(np.float64) + r
    assert rel_err(s, total) <= BOUND, f"seed={seed}"
    assert rel_err(out, ref_rmsnorm(total, w, 1e-5)) <= BOUND, f"seed={seed}"


@pytest.mark.parametrize("layout,d,scaled", [("neox", 64, False), ("interleaved", 32, False),
                                             ("neox", 64, True)])
def test_rope_in_place(where, rng, seed, layout, d, scaled):
    q, k = f32(rng, 4, d), f32(rng, 2, d)
    q0, k0 = q.copy(), k.copy()
    pos = int(rng.integers(0, 2000))
    theta = float(rng.choice([10000.0, 500000.0]))
    scaling = (dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_context=int(rng.choice([128, 8192]))) if scaled else None)
    rq, rk = ops.rope(q, k, np.array([pos], np.int32), head_dim=d, layout=layout, theta=theta,
                      scaling=scaling, backend=where)
    assert rq is q and rk is k
    msg = f"seed={seed} pos={pos} theta={theta}"
    assert rel_err(q, ref_rope(q0, pos, theta, layout, scaling)) <= ROPE_BOUND, msg
    assert rel_err(k, ref_rope(k0, pos, theta, layout, scaling)) <= ROPE_BOUND, msg


def test_swiglu(where, rng, seed):
    n = int(rng.integers(100, 700))
    g, u, out = f32(rng, n) * 3, f32(rng, n), nan(n)
    assert ops.swiglu(g, u, out=out, backend=where) is out
    assert rel_err(out, ref_silu_mul(g, u)) <= BOUND, f"seed={seed}"
    assert rel_err(ops.swiglu(g, u, backend=where), ref_silu_mul(g, u)) <= BOUND, f"seed={seed}"


@pytest.mark.parametrize("kv_dtype,d,group", [(np.float16, 64, 4), (np.float32, 64, 2)])
def test_flash_decode(where, rng, seed, kv_dtype, d, group):
    n_kv, cap = 2, 96
    kc = rng.standard_normal((n_kv, cap, d)).astype(kv_dtype)
    vc = rng.standard_normal((n_kv, cap, d)).astype(kv_dtype)
    q = f32(rng, n_kv * group, d)
    kv_len = int(rng.integers(1, cap + 1))
    out = nan(n_kv * group, d)
    got = ops.flash_decode(q, kc, vc, np.array([kv_len], np.int32), out=out, backend=where)
    assert got is out
    assert rel_err(out, ref_attention(q, kc, vc, kv_len)) <= ATTN_BOUND, f"seed={seed} L={kv_len}"
    # a Python int length, the output allocated
    got = ops.flash_decode(q, kc, vc, kv_len, backend=where)
    assert rel_err(got, ref_attention(q, kc, vc, kv_len)) <= ATTN_BOUND, f"seed={seed} L={kv_len}"


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_K", "Q6_K"])
def test_embedding(where, rng, seed, qtype):
    n_vocab, n = 5, 512
    rows = f32(rng, n_vocab, n)
    tok = int(rng.integers(0, n_vocab))
    if qtype == "F32":
        table, ref, kw = rows, rows[tok].astype(np.float64), {}
    elif qtype == "F16":
        table = rows.astype(np.float16)
        ref, kw = table[tok].astype(np.float64), {}
    else:
        table = quants.quantize(rows, qtype)
        ref, kw = dequant(table[tok], qtype), {"n": n}
    out = nan(n)
    assert ops.embedding(table, qtype, tok, out=out, backend=where, **kw) is out
    assert rel_err(out, ref) <= BOUND, f"seed={seed} token={tok}"


@pytest.mark.parametrize("cache_dtype", [np.float16, np.float32])
def test_kv_append_into_numpy_caches(where, rng, seed, cache_dtype):
    n_kv, cap, d = 2, 16, 64
    kc = rng.standard_normal((n_kv, cap, d)).astype(cache_dtype)
    vc = rng.standard_normal((n_kv, cap, d)).astype(cache_dtype)
    k, v = f32(rng, n_kv, d), f32(rng, n_kv, d)
    pos = int(rng.integers(0, cap))
    want_k, want_v = kc.copy(), vc.copy()
    want_k[:, pos], want_v[:, pos] = k, v      # numpy's round-to-nearest-even to f16, as cvt.rn
    assert ops.kv_append(k, v, kc, vc, pos, backend=where) is None
    np.testing.assert_array_equal(kc, want_k, err_msg=f"seed={seed} pos={pos}")
    np.testing.assert_array_equal(vc, want_v, err_msg=f"seed={seed} pos={pos}")


def test_argmax(where, rng, seed):
    n = int(rng.integers(1000, 20000))
    x = f32(rng, n)
    x[int(rng.integers(0, n))] = 10.0          # one clear maximum
    out = np.full(1, -1, np.int32)
    assert ops.argmax(x, out=out, backend=where) is out
    assert int(out[0]) == int(np.argmax(x)), f"seed={seed}"
    got = ops.argmax(x, backend=where)
    assert isinstance(got, np.ndarray) and int(got[0]) == int(np.argmax(x)), f"seed={seed}"


@pytest.mark.parametrize("qtype,k", [("Q4_K", 512), ("Q6_K", 256), ("Q8_0", 256)])
def test_gemv(where, rng, seed, qtype, k):
    m = int(rng.integers(5, 40))
    w = quants.quantize(f32(rng, m, k), qtype)
    x, r = f32(rng, k), f32(rng, m)
    wf = dequant(w, qtype)
    y = ops.gemv(w, x, qtype, backend=where)
    assert isinstance(y, np.ndarray) and y.shape == (m,)
    assert rel_err(y, wf @ x) <= GEMV_BOUND, f"seed={seed} m={m}"
    out = nan(m)
    assert ops.gemv(w, x, qtype, out=out, residual=r, backend=where) is out
    assert rel_err(out, wf @ x + r) <= GEMV_BOUND, f"seed={seed} m={m}"


def test_gemv_swiglu(where, rng, seed):
    m, k = int(rng.integers(5, 40)), 256
    wg, wu = (quants.quantize(f32(rng, m, k), "Q4_K") for _ in range(2))
    x, out = f32(rng, k), nan(m)
    assert ops.gemv_swiglu(wg, wu, x, "Q4_K", out=out, backend=where) is out
    Wg, Wu = dequant(wg, "Q4_K"), dequant(wu, "Q4_K")
    g, u = Wg @ x, Wu @ x
    ref = ref_silu_mul(g, u)
    # each output against its own condition, not the largest one's: silu(g) u
    # moves by |silu'(g) u| |dg| + |silu(g)| |du|, and f32 sums over K move g
    # and u by a few unit roundoffs of |W| |x| (a small u or g cancels; a
    # normwise 4e-6 failed at seed 18012108562605197232, 1.6 roundoffs here)
    sg = 1.0 / (1.0 + np.exp(-g))
    cond = np.abs(sg * (1 + g * (1 - sg)) * u) * (np.abs(Wg) @ np.abs(x)) \
        + np.abs(sg * g) * (np.abs(Wu) @ np.abs(x))
    err = np.abs(np.asarray(out, np.float64) - ref)
    assert np.all(np.isfinite(out)), f"seed={seed} m={m}"
    assert np.all(err <= 16 * 2.0 ** -24 * cond + 1e-6 * np.max(np.abs(ref))), \
        f"seed={seed} m={m}: {np.max(err / cond) / 2.0 ** -24:.1f} roundoffs"


# --- which backend, what comes back -----------------------------------------------

def test_emulator_arrays_stay_on_the_emulator(rng, seed):
    x, w = f32(rng, 2, 64), f32(rng, 64)
    ex, ew = emu.DeviceArray.from_numpy(x), emu.DeviceArray.from_numpy(w)
    got = ops.rmsnorm(ex, ew, 1e-5)                   # no backend=: where the arrays are
    assert isinstance(got, emu.DeviceArray)
    assert rel_err(got.to_numpy(), ref_rmsnorm(x, w, 1e-5)) <= BOUND, f"seed={seed}"
    # numpy beside emulator arrays: copied in; an allocated output stays a device array,
    # a numpy `out` receives the result
    out = nan(2, 64)
    assert ops.rmsnorm(x, ew, 1e-5, out=out) is out
    assert rel_err(out, ref_rmsnorm(x, w, 1e-5)) <= BOUND, f"seed={seed}"
    assert isinstance(ops.rmsnorm(x, ew, 1e-5), emu.DeviceArray)


class _GpuTensor:
    """Looks like a CUDA tensor (``__cuda_array_interface__``); viewing it
    would need a GPU, so a call that gets past the refusal fails otherwise."""

    __cuda_array_interface__ = {"shape": (64,), "typestr": "<f4", "data": (0, False),
                                "strides": None, "version": 3}


def test_two_backends_in_one_call_are_refused():
    ex = emu.DeviceArray.from_numpy(np.ones(64, np.float32))
    with pytest.raises(ValueError, match=r"two backends: w is a GPU array.*x is an emulator"):
        ops.rmsnorm(ex, _GpuTensor(), 1e-5)
    with pytest.raises(ValueError, match=r"backend='cuda', but k_cache is an emulator array"):
        ops.kv_append(np.ones((1, 8), np.float32), np.ones((1, 8), np.float32),
                      emu.DeviceArray.zeros((1, 4, 8), np.float16),
                      np.zeros((1, 4, 8), np.float16), 0, backend="cuda")
    with pytest.raises(ValueError, match=r"backend='emu', but g is a GPU array"):
        ops.swiglu(_GpuTensor(), np.ones(4, np.float32), backend="emu")


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match=r"^u: expected a numpy array.*got list"):
        ops.swiglu(np.ones(4, np.float32), [1.0, 2.0, 3.0, 4.0], backend="emu")
    with pytest.raises(TypeError, match="x must be float32, got float64"):
        ops.argmax(np.ones(10), backend="emu")
    with pytest.raises(ValueError, match="out has 3 elements, expected 4"):
        ops.swiglu(np.ones(4, np.float32), np.ones(4, np.float32), out=nan(3), backend="emu")
    with pytest.raises(ValueError, match="backend='tpu'"):
        ops.argmax(np.ones(10, np.float32), backend="tpu")
    # an output of another float type than the op writes
    with pytest.raises(TypeError, match="out must be float32 or float16, got float64"):
        ops.swiglu(np.ones(4, np.float32), np.ones(4, np.float32), out=np.zeros(4),
                   backend="emu")
    with pytest.raises(TypeError, match="out must be float32 or float16, got float64"):
        ops.rmsnorm(np.ones((2, 4), np.float32), np.ones(4, np.float32), 1e-5,
                    out=np.zeros((2, 4)), backend="emu")


def test_environment_variable_picks_the_backend(monkeypatch, rng, seed):
    x = f32(rng, 50)
    monkeypatch.setenv(ops_backend.ENV_VAR, "emu")
    assert ops_backend.op_args(None, x=x).backend.name == "emu"      # on a GPU machine too
    assert int(ops.argmax(x)[0]) == int(np.argmax(x)), f"seed={seed}"
    # a device array still runs where it lives
    assert ops_backend.op_args(None, x=emu.DeviceArray.from_numpy(x)).backend.name == "emu"
    monkeypatch.setenv(ops_backend.ENV_VAR, "gpu")
    with pytest.raises(ValueError, match="PTXGEN_OPS_BACKEND='gpu'"):
        ops.argmax(x)
    if not cuda_available():
        # "cuda" really is asked of the driver, which is not there
        monkeypatch.setenv(ops_backend.ENV_VAR, "cuda")
        with pytest.raises(Exception, match="(?i)cuda|driver|gpu"):
            ops.argmax(x)


def test_numpy_only_calls_default_to_the_gpu_when_there_is_one(monkeypatch):
    monkeypatch.delenv(ops_backend.ENV_VAR, raising=False)
    a = ops_backend.op_args(None, x=np.ones(3, np.float32))
    assert a.backend.name == ("cuda" if cuda_available() else "emu")
    assert a.host


@pytest.mark.gpu
def test_numpy_in_numpy_out_on_the_gpu(monkeypatch, rng, seed):
    """With a GPU and no backend named, numpy arrays go to the GPU and the
    result comes back as numpy."""
    if not cuda_available():
        pytest.skip("no NVIDIA GPU / driver available")
    monkeypatch.delenv(ops_backend.ENV_VAR, raising=False)
    from ptxgen import driver
    x, w = f32(rng, 3, 4099), f32(rng, 4099)
    got = ops.rmsnorm(x, w, 1e-5)
    assert isinstance(got, np.ndarray)
    assert rel_err(got, ref_rmsnorm(x, w, 1e-5)) <= BOUND, f"seed={seed}"
    # numpy beside a GPU array: the allocated output stays on the GPU
    got = ops.rmsnorm(x, driver.DeviceArray.from_numpy(w), 1e-5)
    assert isinstance(got, driver.DeviceArray)
    assert rel_err(got.to_numpy(), ref_rmsnorm(x, w, 1e-5)) <= BOUND, f"seed={seed}"
    with pytest.raises(ValueError, match=r"two backends: x is a GPU array.*w is an emulator"):
        ops.rmsnorm(driver.DeviceArray.from_numpy(x), emu.DeviceArray.from_numpy(w), 1e-5)
