"""Quantized GEMV entry points (re-exported by ``ptxgen.driver.ops``).

``gemv(w, x, qtype)`` computes ``y = W x`` for a GGUF-layout weight ``w``
(``uint8 [M, row_bytes]``) and f32 ``x`` (``K`` values); ``gemv_swiglu``
fuses the gate/up pair with ``silu(Wg x) * (Wu x)``.  Arguments may be
:class:`~ptxgen.driver.DeviceArray`, torch/cupy CUDA tensors (zero copy) or
numpy arrays (copied to the device).  Kernels are built once per
(qtype, K, epilogue, device target) and cached; launches go to ``stream``.
"""

from __future__ import annotations

import functools

import numpy as np

from ptxgen.kernels import gemv as _g
from ptxgen.kernels.spec_fields import has_griddepcontrol

from .launch import launch
from .memory import DeviceArray, as_device_array
from .module import Module

__all__ = ["gemv", "gemv_swiglu", "gemv_spec"]


@functools.lru_cache(maxsize=None)
def _function(spec):
    fn = Module.from_ptx(_g.build(spec).to_ptx()).function(spec.kernel_name)
    fn.require_dynamic_shared(spec.dynamic_shared)
    return fn


@functools.lru_cache(maxsize=None)
def _target():
    from .ops_decode import device_target
    return device_target()


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
    q = qtype.upper()
    if q not in _g.QTYPE_INFO:
        raise ValueError(f"unsupported qtype {qtype!r}; supported: {', '.join(_g.QTYPE_INFO)}")
    bw, bb = _g.QTYPE_INFO[q]
    m, rb = shape
    if rb % bb:
        raise ValueError(f"{q}: row of {rb} bytes is not a whole number of {bb}-byte blocks")
    return m, rb // bb * bw


def gemv_spec(qtype, k, epilogue="none", m=None, **knobs):
    """The plan (spec and tuned config, a cached kernel) used for this call
    on the current device (``m``: the call's row count, when known; the
    config depends on it).  ``knobs``: GemvConfig fields replacing the
    tuned ones; ``pdl`` (programmatic dependent launch) defaults to on for
    sm_90 and newer."""
    tgt = _target()
    pdl = knobs.pop("pdl", None)
    if pdl is None:
        pdl = has_griddepcontrol(tgt)
    return _g.default_plan(qtype.upper(), k, epilogue, target=tgt, m=m, pdl=pdl, **knobs)


def _vec(a, n, what):
    d = _dev(a, what)
    if np.dtype(d.dtype) != np.float32:
        raise TypeError(f"{what} must be float32, got {np.dtype(d.dtype).name}")
    if d.size != n:
        raise ValueError(f"{what} has {d.size} elements, expected {n}")
    return d


def _run(spec, m, ptrs, out, stream):
    y = DeviceArray.empty((m,), np.float32) if out is None else _vec(out, m, "out")
    grid, block, shared, rpc = _g.launch_geometry(spec, m)
    launch(_function(spec), grid, block, *ptrs[:-1], *([ptrs[-1]] if ptrs[-1] is not None else []),
           y, m, rpc, shared=shared, stream=stream, pdl=spec.pdl)
    return y


def gemv(w, x, qtype, out=None, residual=None, *, stream=None, **knobs):
    """``y = W x`` (``+ residual``) for quantized ``W``.

    Parameters
    ----------
    w : uint8 [M, row_bytes]
        GGUF weight bytes (device or numpy).
    x : float32 [K]
    qtype : {"Q4_K", "Q6_K", "Q8_0"}
    out : float32 [M], optional
        Written in place; allocated when None.
    residual : float32 [M], optional
        Fused ``y = W x + residual``.
    stream : Stream, optional
    **knobs
        Spec overrides (rows, tile, ...), for tuning.

    Returns
    -------
    The output array (``out`` when given, else a new DeviceArray).

    Raises
    ------
    ValueError
        K not a multiple of the block size, or mismatched sizes.
    TypeError
        Wrong dtypes.
    """
    m, k = _shape_of(w, qtype)
    wd = _dev(w, "w")
    xd = _vec(x, k, "x")
    if residual is None:
        spec = gemv_spec(qtype, k, "none", m=m, **knobs)
        return _run(spec, m, [wd, xd, None], out, stream)
    spec = gemv_spec(qtype, k, "residual", m=m, **knobs)
    return _run(spec, m, [wd, xd, _vec(residual, m, "residual")], out, stream)


def gemv_swiglu(wg, wu, x, qtype, out=None, *, stream=None, **knobs):
    """``y = silu(Wg x) * (Wu x)`` in one kernel reading both matrices.

    ``wg`` and ``wu`` are uint8 ``[M, row_bytes]`` of the same shape and
    qtype; see :func:`gemv` for the other arguments.
    """
    m, k = _shape_of(wg, qtype)
    if tuple(wu.shape) != tuple(wg.shape):
        raise ValueError(f"gate {tuple(wg.shape)} and up {tuple(wu.shape)} weights differ in shape")
    spec = gemv_spec(qtype, k, "swiglu", m=m, **knobs)
    return _run(spec, m, [_dev(wg, "wg"), _dev(wu, "wu"), _vec(x, k, "x"), None], out, stream)
