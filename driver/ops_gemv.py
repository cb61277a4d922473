"""Quantized GEMV entry points (re-exported by ``ptxgen.driver.ops``).

``gemv(w, x, qtype)`` computes ``y = W x`` for a GGUF-layout weight ``w``
(``uint8 [M, row_bytes]``; F16/BF16 matrices as their bytes, e.g.
``w.view(np.uint8)``) and f32 ``x`` (``K`` values); ``gemv_swiglu``
fuses the gate/up pair with ``silu(Wg x) * (Wu x)``.  Arguments may be
:class:`~ptxgen.driver.DeviceArray`, torch/cupy CUDA tensors (zero copy),
``ptxgen.emu.DeviceArray`` (the CPU emulator) or numpy arrays (copied; numpy
in, numpy out, on the GPU if there is one, else on the emulator: see
:mod:`ptxgen.driver.ops_backend`).  Kernels are built once per (qtype, K,
epilogue, target) and backend and cached; launches go to ``stream``.
"""

from __future__ import annotations


import numpy as np

from ptxgen.kernels import gemv as _g
from ptxgen.kernels.quants import qtype_of
from ptxgen.kernels.spec_fields import has_griddepcontrol

from .memory import DeviceArray, as_device_array
from .backend import get_backend
from .ops_backend import op_args

__all__ = ["gemv", "gemv_swiglu", "gemv_spec"]


def _function(spec, backend="cuda"):
    return get_backend(backend).function(_g.build, spec, dynamic_shared=spec.dynamic_shared)


def _dev(a, what):
    """A device view of ``a`` (numpy arrays are copied)."""
    if isinstance(a, np.ndarray):
        return DeviceArray.from_numpy(np.ascontiguousarray(a))
    try:
        return as_device_array(a)
    except ValueError as e:
        raise TypeError(f"{what}: expected a device array, a CUDA tensor or numpy ({e})") from None


def _shape_of(w, qtype):
    """(M, K) from a weight's byte shape [M, row_bytes]."""
    shape = tuple(w.shape)
    if len(shape) != 2:
        raise ValueError(f"weights must be 2-D [M, row_bytes] uint8, got shape {shape}")
    if np.dtype(w.dtype) != np.uint8:
        raise TypeError(f"weights must be uint8 GGUF bytes, got {np.dtype(w.dtype).name}")
    q = qtype_of(qtype, "gemv").name
    bw, bb = _g.read_unit(q)
    m, rb = shape
    if q in ("F16", "BF16"):
        if rb % 2:
            raise ValueError(f"{q}: row of {rb} bytes is not a whole number of 2-byte values")
        _g.check_k(q, rb // 2)              # K a multiple of 8, said so
    elif rb % bb:
        raise ValueError(f"{q}: row of {rb} bytes is not a whole number of {bb}-byte blocks")
    return m, rb // bb * bw


def gemv_spec(qtype, k, epilogue="none", m=None, *, backend="cuda", **knobs):
    """The plan (spec and tuned config, a cached kernel) used for this call
    on the current device (``m``: the call's row count, when known; the
    config depends on it; ``backend``: the GPU's, or the emulator's
    stand-in target).  ``knobs``: GemvConfig fields replacing the tuned
    ones; ``pdl`` (programmatic dependent launch) defaults to on for sm_90
    and newer."""
    be = get_backend(backend)
    tgt = be.target
    pdl = knobs.pop("pdl", None)
    if pdl is None:
        pdl = has_griddepcontrol(tgt)
    # the SM count spreads a ring's CTAs evenly, as the decode step's lowering does
    return _g.default_plan(qtype.upper(), k, epilogue, target=tgt, m=m, pdl=pdl,
                           sm_count=be.sm_count, device=be.device_name, **knobs)


def _vec(a, n, what):
    d = _dev(a, what)
    if np.dtype(d.dtype) != np.float32:
        raise TypeError(f"{what} must be float32, got {np.dtype(d.dtype).name}")
    if d.size != n:
        raise ValueError(f"{what} has {d.size} elements, expected {n}")
    return d


def _run(a, spec, m, args):
    y = a.out("out", (m,))
    a.launch(_function(spec, a.backend.name), _g.launch_geometry(spec, m), dict(args, y=y, m=m),
             pdl=spec.pdl)
    return a.result(y)


def _weights(a, name):
    w = a.array(name, np.uint8)
    if w.ndim != 2:
        raise ValueError(f"{name} must be 2-D [M, row_bytes] uint8, got shape {w.shape}")
    return w


def gemv(w, x, qtype, out=None, residual=None, *, stream=None, backend=None, **knobs):
    """``y = W x`` (``+ residual``) for quantized ``W``.

    Parameters
    ----------
    w : uint8 [M, row_bytes]
        GGUF weight bytes (device or numpy).
    x : float32 [K]
    qtype : str
        A type the GEMV reads (``kernels.quants.names_for("gemv")``: Q4_K,
        Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q5_K, F16, BF16), in any case.
    out : float32 [M], optional
        Written in place; allocated when None.
    residual : float32 [M], optional
        Fused ``y = W x + residual``.
    stream : Stream, optional
    **knobs
        Spec overrides (rows, tile, ...), for tuning.

    backend : {"cuda", "emu"}, optional
        Where a call with numpy arrays only runs (default: the GPU if there
        is one, else the CPU emulator; ``$PTXGEN_OPS_BACKEND``).

    Returns
    -------
    The output array (``out`` when given, else a new device array, or numpy
    when every array argument was numpy).

    Raises
    ------
    ValueError
        K not a multiple of the block size, or mismatched sizes.
    TypeError
        Wrong dtypes.
    """
    a = op_args(backend, writes=("out",), stream=stream, w=w, x=x, out=out, residual=residual)
    m, k = _shape_of(_weights(a, "w"), qtype)
    wd = a["w"]
    xd = a.array("x", np.float32, k)
    be = a.backend.name
    if residual is None:
        spec = gemv_spec(qtype, k, "none", m=m, backend=be, **knobs)
        return _run(a, spec, m, dict(w=wd, x=xd))
    spec = gemv_spec(qtype, k, "residual", m=m, backend=be, **knobs)
    return _run(a, spec, m, dict(w=wd, x=xd, r=a.array("residual", np.float32, m)))


def gemv_swiglu(wg, wu, x, qtype, out=None, *, stream=None, backend=None, **knobs):
    """``y = silu(Wg x) * (Wu x)`` in one kernel reading both matrices.

    ``wg`` and ``wu`` are uint8 ``[M, row_bytes]`` of the same shape and
    qtype; see :func:`gemv` for the other arguments.
    """
    a = op_args(backend, writes=("out",), stream=stream, wg=wg, wu=wu, x=x, out=out)
    m, k = _shape_of(_weights(a, "wg"), qtype)
    if tuple(_weights(a, "wu").shape) != tuple(wg.shape):
        raise ValueError(f"gate {tuple(wg.shape)} and up {tuple(wu.shape)} weights differ in shape")
    spec = gemv_spec(qtype, k, "swiglu", m=m, backend=a.backend.name, **knobs)
    return _run(a, spec, m, dict(w=a["wg"], wu=a["wu"], x=a.array("x", np.float32, k)))
