"""Quantized GEMV entry points (re-exported by ``ptxgen.driver.ops``).

``gemv(w, x, qtype)`` computes ``y = W x`` for a GGUF-layout weight ``w``
(``uint8 [M, row_bytes]``) and f32 ``x`` (``K`` values); ``gemv_swiglu``
fuses the gate/up pair with ``silu(Wg x) * (Wu x)``; ``gemv_ffn`` runs a
whole Llama FFN (gate/up, SwiGLU, down + residual) in one persistent kernel.  Arguments may be
:class:`~ptxgen.driver.DeviceArray`, torch/cupy CUDA tensors (zero copy),
``ptxgen.emu.DeviceArray`` (the CPU emulator) or numpy arrays (copied; numpy
in, numpy out, on the GPU if there is one, else on the emulator: see
:mod:`ptxgen.driver.ops_backend`).  Kernels are built once per (qtype, K,
epilogue, target) and backend and cached; launches go to ``stream``.
"""

from __future__ import annotations

import functools

import numpy as np

from ptxgen.kernels import gemv as _g
from ptxgen.kernels import gemv_ffn as _ffn
from ptxgen.kernels.spec_fields import has_griddepcontrol

from .launch import launch
from .memory import DeviceArray, as_device_array
from .module import Module
from .ops_backend import get_backend, op_args

__all__ = ["gemv", "gemv_swiglu", "gemv_spec", "gemv_ffn", "ffn_spec", "ffn_geometry"]


def _function(spec, backend="cuda"):
    return get_backend(backend).function(_g.build, spec, dynamic_shared=spec.dynamic_shared)


def _target(backend="cuda"):
    return get_backend(backend).target


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


def gemv_spec(qtype, k, epilogue="none", m=None, *, backend="cuda", **knobs):
    """The (cached-kernel) spec used for this call on the current device
    (``m``: the call's row count, when known; some defaults depend on it;
    ``backend``: the GPU's, or the emulator's stand-in target).
    ``pdl`` (programmatic dependent launch) defaults to on for sm_90 and newer."""
    tgt = _target(backend)
    if knobs.get("pdl") is None:
        knobs["pdl"] = has_griddepcontrol(tgt)
    return _g.default_spec(qtype.upper(), k, epilogue, target=tgt, m=m, **knobs)


def _vec(a, n, what):
    d = _dev(a, what)
    if np.dtype(d.dtype) != np.float32:
        raise TypeError(f"{what} must be float32, got {np.dtype(d.dtype).name}")
    if d.size != n:
        raise ValueError(f"{what} has {d.size} elements, expected {n}")
    return d


def _run(a, spec, m, ptrs):
    y = a.out("out", (m,))
    grid, block, shared, rpc = _g.launch_geometry(spec, m)
    a.launch(_function(spec, a.backend.name), grid, block, *ptrs, y, m, rpc, shared=shared,
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
    qtype : {"Q4_K", "Q6_K", "Q8_0"}
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
        return _run(a, spec, m, [wd, xd])
    spec = gemv_spec(qtype, k, "residual", m=m, backend=be, **knobs)
    return _run(a, spec, m, [wd, xd, a.array("residual", np.float32, m)])


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
    return _run(a, spec, m, [a["wg"], a["wu"], a.array("x", np.float32, k)])


@functools.lru_cache(maxsize=None)
def _ffn_function(spec):
    fn = Module.from_ptx(_ffn.build(spec).to_ptx()).function(spec.kernel_name)
    fn.require_dynamic_shared(spec.shared_bytes)
    return fn


def ffn_resident(fn, spec) -> int:
    """CTAs of the persistent FFN kernel one SM holds at once (the driver's
    occupancy with the kernel's ring of dynamic shared memory)."""
    from .errors import check, cuda
    return int(check(cuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        fn.handle, spec.threads, spec.shared_bytes),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor"))


def ffn_spec(hidden, ffn, **knobs):
    """The :class:`~ptxgen.kernels.gemv_ffn.FfnSpec` used on the current
    device (``pdl`` on for sm_90 and newer unless given)."""
    tgt = _target()
    if knobs.get("pdl") is None:
        knobs["pdl"] = has_griddepcontrol(tgt)
    return _ffn.FfnSpec(hidden=hidden, ffn=ffn, target=tgt, **knobs)


def ffn_geometry(spec, ctas_per_sm=None):
    """``(grid, block, shared)`` of one resident wave on the current device:
    ``ctas_per_sm`` (default ``spec.ctas_per_sm``) times the SM count, refused above the
    driver's occupancy (a persistent grid whose CTAs cannot all be resident
    would wait at its grid barrier forever)."""
    from .device import get_device
    fn = _ffn_function(spec)
    occ = ffn_resident(fn, spec)
    n = spec.ctas_per_sm if ctas_per_sm is None else ctas_per_sm
    if occ < 1 or n > occ:
        raise ValueError(f"{spec.kernel_name}: {n} CTA(s) per SM requested, the device holds "
                         f"{occ} ({spec.threads} threads, {spec.shared_bytes} bytes of shared "
                         f"memory each)")
    return _ffn.launch_geometry(spec, get_device().sm_count, n)


def _counters(stream):
    """Three zeroed u32 of the persistent FFN kernel, one set per stream
    (every launch leaves them at zero; launches on one stream run in turn)."""
    from .ops_decode import _workspace
    from .stream import stream_handle
    return _workspace(("ffn_counters", int(stream_handle(stream))), (3,), np.uint32, zero=True)


def gemv_ffn(wg, wu, wd, x, residual, out=None, *, h=None, stream=None, ctas_per_sm=None,
             **knobs):
    """``y = Wd (silu(Wg x) * (Wu x)) + residual`` in one persistent kernel
    (all three weights Q4_K; :mod:`ptxgen.kernels.gemv_ffn`).

    ``wg``, ``wu``: uint8 ``[ffn, row_bytes(hidden)]``; ``wd``: uint8
    ``[hidden, row_bytes(ffn)]``; ``x``, ``residual``: f32 ``[hidden]``;
    ``out`` may be ``residual`` (in place).  ``h`` (f32 ``[ffn]``) receives
    the SwiGLU activations (allocated when None).  ``knobs``: FfnSpec fields.
    """
    f, hidden = _shape_of(wg, "Q4_K")
    if tuple(wu.shape) != tuple(wg.shape):
        raise ValueError(f"gate {tuple(wg.shape)} and up {tuple(wu.shape)} weights differ in shape")
    hd, fd = _shape_of(wd, "Q4_K")
    if (hd, fd) != (hidden, f):
        raise ValueError(f"down weights are {hd}x{fd}, expected {hidden}x{f} for gate/up "
                         f"{f}x{hidden}")
    spec = ffn_spec(hidden, f, **knobs)
    grid, block, shared = ffn_geometry(spec, ctas_per_sm)
    r = _vec(residual, hidden, "residual")
    y = r if out is residual else (DeviceArray.empty((hidden,), np.float32) if out is None
                                   else _vec(out, hidden, "out"))
    hbuf = DeviceArray.empty((f,), np.float32) if h is None else _vec(h, f, "h")
    launch(_ffn_function(spec), grid, block, _dev(wg, "wg"), _dev(wu, "wu"), _dev(wd, "wd"),
           _vec(x, hidden, "x"), r, hbuf, y, _counters(stream), shared=shared, stream=stream,
           pdl=spec.pdl)
    return y
