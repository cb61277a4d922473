"""Quantized GEMM entry point (re-exported by ``ptxgen.driver.ops``).

``gemm(w, x, qtype)`` computes ``Y[T, M] = X[T, K] . W[M, K]^T`` for a
GGUF-layout weight ``w`` (``uint8 [M, row_bytes]``) and ``x`` f32 or f16
``[T, K]`` on tensor cores (:mod:`ptxgen.kernels.gemm`).  Arguments may be
device arrays, torch/cupy CUDA tensors, ``ptxgen.emu.DeviceArray`` or numpy
(numpy in, numpy out, on the GPU if there is one, else the CPU emulator:
:mod:`ptxgen.driver.ops_backend`).  Kernels are built once per plan and
backend and cached.
"""

from __future__ import annotations

import numpy as np

from ptxgen.kernels import gemm as _g
from ptxgen.kernels.quants import qtype_of
from ptxgen.kernels.spec_fields import has_griddepcontrol

from .backend import get_backend
from .ops_backend import op_args

__all__ = ["gemm", "gemm_plan", "gemm_target"]

_X_TYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}


def gemm_target(target: str) -> str:
    """The target the GEMM family is built for on a device whose general
    target is ``target``: ``sm_90a`` on sm_90 (H100, H200), so the tuning
    table can choose the warpgroup (wgmma) kernel there; ``target``
    otherwise."""
    return "sm_90a" if target == "sm_90" else target


def gemm_plan(qtype, k, m=None, t=None, *, x_type="f32", epilogue="none", t_device=False,
              backend="cuda", y_stride=0, **knobs):
    """The plan (spec and tuned config) of a call on ``backend``'s device
    (``m`` weight rows and ``t`` tokens, when known, pick the config);
    ``knobs``: GemmConfig fields replacing the tuned ones; ``pdl`` defaults
    to on for sm_90 and newer.  On an sm_90 device the family is built for
    sm_90a (:func:`gemm_target`)."""
    tgt = gemm_target(get_backend(backend).target)
    pdl = knobs.pop("pdl", None)
    if pdl is None:
        pdl = has_griddepcontrol(tgt)
    return _g.default_plan(qtype, k, x_type=x_type, epilogue=epilogue, t_device=t_device,
                           target=tgt, pdl=pdl, y_stride=y_stride, m=m, t=t, **knobs)


_SCRATCH: dict = {}


def _split_scratch(be, ws_n: int, tiles: int):
    """A split-K launch's workspace and zeroed tile counters on ``be``, kept
    per size for the process (so a call inside a graph capture finds them
    made by an earlier call; each launch leaves the counters zero)."""
    key = (be.name, ws_n, tiles)
    if key not in _SCRATCH:
        _SCRATCH[key] = (be.empty((ws_n,), np.float32),
                         be.from_numpy(np.zeros(tiles, np.uint32)))
    return _SCRATCH[key]


def _weights(a, name, qtype):
    w = a.array(name, np.uint8)
    if w.ndim != 2:
        raise ValueError(f"{name} must be 2-D [M, row_bytes] uint8, got shape {tuple(w.shape)}")
    q = qtype_of(qtype, "gemm")
    m, rb = w.shape
    if rb % q.type_size:
        raise ValueError(f"{q}: a row of {rb} bytes is not a whole number of {q.type_size}-byte "
                         f"blocks")
    return q.name, m, rb // q.type_size * q.block_size


def gemm(w, x, qtype, out=None, residual=None, *, bias=None, n_tokens=None, y_stride=None,
         stream=None, backend=None, **knobs):
    """``Y = X . W^T`` (``+ residual``) for quantized ``W``.

    Parameters
    ----------
    w : uint8 [M, row_bytes]
        GGUF weight bytes.
    x : float32 or float16 [T, K]
        Rounded to f16 on the way into the tensor cores either way.
    qtype : {"Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "Q5_K", "F16", "BF16"}
        The last five on sm_90a only (the warpgroup kernel).
    out : float32 [T, M], optional
        Written in place; allocated when None.  With ``y_stride``: any
        float32 array of at least ``(T - 1) y_stride + M`` elements, row
        ``t`` of Y at element ``t y_stride``.
    residual : float32 [T, M], optional
        Fused ``Y = X W^T + residual`` (``out`` may be ``residual``; laid
        out as ``out`` is).
    bias : float32 [M], optional
        Fused ``Y = X W^T + bias`` (added to every row); not with ``residual``.
    n_tokens : device int32 scalar, optional
        The rows of ``x`` to compute, read by the kernel (``t_device``): the
        launch covers all ``T`` rows of ``x`` and the tiles past
        ``n_tokens`` exit, so a captured launch serves any shorter chunk.
    y_stride : int, optional
        Row stride of ``out`` (and ``residual``) in elements, at least M:
        Y is a column block of a wider array.
    stream : Stream, optional
    backend : {"cuda", "emu"}, optional
        Where a call with numpy arrays only runs.
    **knobs
        GemmConfig fields (bm, bn, bk, warps_m, warps_n, stages, ...).

    Returns
    -------
    The output array (``out`` when given; numpy when every array argument
    was numpy).

    Raises
    ------
    ValueError
        K not whole blocks of the qtype, mismatched shapes, an unsupported
        qtype.
    TypeError
        Wrong dtypes.
    """
    if residual is not None and bias is not None:
        raise ValueError("gemm takes a residual or a bias, not both")
    a = op_args(backend, writes=("out",), stream=stream, w=w, x=x, out=out, residual=residual,
                bias=bias, n_tokens=n_tokens)
    q, m, k = _weights(a, "w", qtype)
    xd = a.array("x")
    x_type = _X_TYPES.get(np.dtype(xd.dtype))
    if x_type is None:
        raise TypeError(f"x must be float32 or float16, got {np.dtype(xd.dtype).name}")
    if xd.ndim != 2 or xd.shape[1] != k:
        raise ValueError(f"x must be [T, K={k}] for weights of shape {tuple(w.shape)} ({q}), "
                         f"got shape {tuple(xd.shape)}")
    t = int(xd.shape[0])
    if t < 1:
        raise ValueError("x has no rows (T = 0)")
    be = a.backend
    epi = "residual" if residual is not None else "bias" if bias is not None else "none"
    t_dev = n_tokens is not None
    ys = 0
    if y_stride is not None:
        if out is None or not isinstance(y_stride, int) or y_stride < m:
            raise ValueError(f"y_stride needs out= and an int of at least M={m}, got "
                             f"{y_stride!r}")
        ys = y_stride
    plan = gemm_plan(q, k, m, t, x_type=x_type, epilogue=epi, t_device=t_dev, backend=be.name,
                     y_stride=ys, **knobs)
    span = (t - 1) * ys + m if ys else t * m
    if ys:
        y = a.array("out", np.float32)
        if y.size < span:
            raise ValueError(f"out has {y.size} elements; T={t} rows of stride {ys} need "
                             f"{span}")
    else:
        y = a.out("out", (t, m))
    args = dict(w=a["w"], x=xd, y=y, m=m)
    if residual is not None:
        args["r"] = a.array("residual", np.float32, None if ys else t * m)
    if bias is not None:
        args["r"] = a.array("bias", np.float32, m)
    if t_dev:
        args["t_ptr"] = a.scalar_i32("n_tokens")
    else:
        args["t"] = t
    xm = _g.x_map(plan, int(xd.ptr), t)
    if xm is not None:
        args["xmap"] = be.tensor_map(xm)
    ws_n, tiles = _g.split_scratch(plan, m, t)
    if tiles:
        args["ws"], args["counters"] = _split_scratch(be, ws_n, tiles)
    a.launch(be.function(_g.build, plan), _g.launch_geometry(plan, m, t), args, pdl=plan.pdl)
    return a.result(y)
