"""Entry points for the decode-step kernels (re-exported by ``ptxgen.driver.ops``).

Each function takes device tensors (a :class:`~ptxgen.driver.DeviceArray`, a
torch/cupy tensor through ``__cuda_array_interface__``, or a
``ptxgen.emu.DeviceArray``) or numpy arrays (copied; the op then runs on the
GPU if there is one, else on the CPU emulator, and returns numpy: see
:mod:`ptxgen.driver.ops_backend`), builds its kernel once per spec and
backend (cached), and launches it on ``stream`` (default: the legacy default
stream).  Outputs are device arrays of the arguments' backend unless ``out=``
is given.

Values a replayed CUDA graph must see change (position, KV length, token
id) are device int32 arrays; a Python int is accepted for convenience and
copied to a fresh device scalar (not graph-safe).  Workspaces (flash-decode
partials, argmax scratch) are cached per shape and device, so a call inside
a graph capture allocates nothing once the same shapes ran before it.
"""

from __future__ import annotations

import math

import numpy as np

from ptxgen.kernels import argmax as _argmax
from ptxgen.kernels import embedding as _emb
from ptxgen.kernels import flash_decode as _fd
from ptxgen.kernels import kv_append as _kva
from ptxgen.kernels import rmsnorm as _rms
from ptxgen.kernels import rope as _rope
from ptxgen.kernels import swiglu as _swiglu
from ptxgen.kernels.quants import qtype_of
from ptxgen.kernels.spec_fields import has_griddepcontrol

from .backend import device_target, get_backend
from .ops_backend import op_args

__all__ = ["rmsnorm", "rope", "swiglu", "flash_decode", "embedding", "kv_append", "argmax",
           "device_target"]


# The GPU's module cache and workspaces, as the benchmarks reach them.

def _module(build, spec):
    return get_backend("cuda").module(build, spec)


def _fn(build, spec, name=None):
    return _module(build, spec).function(name or spec.kernel_name)


def _workspace(key, shape, dtype, zero=False):
    return get_backend("cuda").workspace(key, shape, dtype, zero)


def rmsnorm(x, w, eps: float, out=None, residual=None, sum_out=None, *, precise=True,
            block=None, pdl=None, stream=None, backend=None):
    """``out = x / sqrt(mean(x**2) + eps) * w`` row by row (f32).

    ``block`` defaults to the fewest threads (256 to 1024) that hold a row of
    up to 16384 values in registers (16 per thread).

    With ``residual``, ``s = x + residual`` is normalised and written to
    ``sum_out`` (allocated if None); returns ``out`` or ``(out, sum_out)``.

    ``pdl`` (default: on for sm_90 and newer) launches it as a programmatic
    dependent launch: it may start while the previous kernel in the stream
    finishes, and waits for it (``griddepcontrol.wait``) before reading.

    ``backend`` ("cuda" or "emu") picks where a call with numpy arrays only
    runs (:mod:`ptxgen.driver.ops_backend`); the other ops take it too.

    A float16 ``out`` gets the result rounded to nearest (the f16 X of a
    GEMM); ``sum_out`` is float32 either way.
    """
    a = op_args(backend, writes=("out", "sum_out"), stream=stream, x=x, w=w, out=out,
                residual=residual, sum_out=sum_out)
    xa, wa = a.array("x", np.float32), a.array("w", np.float32)
    n = wa.size
    if n == 0 or xa.size % n:
        raise ValueError(f"x has {xa.size} elements, not a multiple of len(w) = {n}")
    rows = xa.size // n
    if block is None:
        # enough threads for the row to sit in registers (4 x 16 bytes each)
        block = min(1024, max(256, -(-n // 512) * 32))
    tgt = a.backend.target
    odt = a.out_dtype("out")
    spec = _rms.RmsNormSpec(residual=residual is not None, block=block, precise=precise,
                            out_type="f16" if odt == np.float16 else "f32",
                            target=tgt, pdl=has_griddepcontrol(tgt) if pdl is None else bool(pdl))
    f = a.backend.function(_rms.build, spec)
    out = a.out("out", xa.shape, odt)
    geo = _rms.launch_geometry(spec, rows)
    args = dict(x=xa, w=wa, out=out, n=n, eps=float(eps))
    if residual is None:
        a.launch(f, geo, args, pdl=spec.pdl)
        return a.result(out)
    sum_out = a.out("sum_out", xa.shape)
    a.launch(f, geo, dict(args, res=a.array("residual", np.float32), sum_out=sum_out),
             pdl=spec.pdl)
    return a.result((out, sum_out))


def rope(q, k, pos, *, head_dim=None, layout="neox", theta=10000.0, scaling=None, stream=None,
         backend=None):
    """Rotate ``q [n_q_heads, head_dim]`` and ``k [n_kv_heads, head_dim]`` in place
    (numpy ``q``/``k`` too); returns ``(q, k)``.

    ``pos`` is a device int32 scalar; ``scaling`` is None or a dict of
    Llama-3 parameters (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_context``).
    """
    a = op_args(backend, writes=("q", "k"), stream=stream, q=q, k=k, pos=pos)
    qa, ka = a.array("q", np.float32), a.array("k", np.float32)
    d = head_dim or qa.shape[-1]
    if qa.size % d or ka.size % d:
        raise ValueError(f"q ({qa.size}) and k ({ka.size}) must be whole heads of {d}")
    extra = dict(scaling or {})
    spec = _rope.RopeSpec(head_dim=d, layout=layout, theta=float(theta),
                          scaling="llama3" if scaling else "none", target=a.backend.target,
                          **extra)
    f = a.backend.function(_rope.build, spec)
    table = a.backend.constant(("rope", spec), lambda: _rope.freq_table(spec))
    n_q, n_kv = qa.size // d, ka.size // d
    a.launch(f, _rope.launch_geometry(spec, n_q, n_kv),
             dict(q=qa, k=ka, freqs=table, pos_ptr=a.scalar_i32("pos"), n_q_heads=n_q,
                  n_kv_heads=n_kv))
    a.result(None)
    return q, k


def swiglu(g, u, out=None, *, pdl=False, stream=None, backend=None):
    """``out = silu(g) * u`` (f32 inputs, any length; a float16 ``out`` gets
    the result rounded to nearest); ``pdl``: launched as a programmatic
    dependent launch (sm_90 and newer)."""
    a = op_args(backend, writes=("out",), stream=stream, g=g, u=u, out=out)
    ga, ua = a.array("g", np.float32), a.array("u", np.float32)
    if ga.size != ua.size:
        raise ValueError(f"g has {ga.size} elements, u {ua.size}")
    odt = a.out_dtype("out")
    spec = _swiglu.SwiGluSpec(out_type="f16" if odt == np.float16 else "f32",
                              target=a.backend.target, pdl=bool(pdl))
    out = a.out("out", ga.shape, odt)
    a.launch(a.backend.function(_swiglu.build, spec), _swiglu.launch_geometry(spec, ga.size),
             dict(g=ga, u=ua, out=out, n=ga.size), pdl=spec.pdl)
    return a.result(out)


def _resident(fn, block, shared=0) -> "int | None":
    """Blocks of the GPU function ``fn`` one SM holds at once with
    ``shared`` bytes of dynamic shared memory each (the driver's occupancy;
    the function's dynamic shared memory limit is raised to ``shared``
    first, without which the driver counts no block past 48 KB); None
    where the driver binding cannot say (the caller uses its spec's estimate)."""
    return get_backend("cuda").resident(fn, block, shared)


def flash_decode(q, k_cache, v_cache, kv_len, out=None, *, sm_scale=None, n_splits=None,
                 early_kv=False, blocks_per_sm=None, pdl=None, stream=None, backend=None,
                 **config):
    """Attention of one token ``q [n_q_heads, d]`` (f32) over the first
    ``kv_len`` rows of ``k_cache``/``v_cache [n_kv_heads, capacity, d]``.

    ``kv_len`` is a device int32 scalar (read by the kernel, so a replayed
    graph follows it); ``n_splits`` defaults to :func:`choose_splits` for
    this device and the cache's capacity (fixed per shape), with
    ``blocks_per_sm`` defaulting to the driver's occupancy of the split
    kernel (one whole wave).  The kernels' config is the tuned one for the
    device and shape (``kernels/tuning/flash_decode.json``); ``config``
    fields (``warps``, ``unroll``, ``mma``, ``per_sm``, ...) replace its
    own (:func:`ptxgen.kernels.flash_decode.with_overrides`).  ``pdl``
    (default: on for sm_90 and newer) launches both kernels with
    programmatic dependent launch.  ``early_kv=True`` reads the length and
    the first K/V tile before the split kernel's wait (see
    ``FlashDecodeSpec.early_kv``: under PDL, the kernel launched just before
    may write the cache row ``kv_len - 1`` and nothing else the split reads).
    """
    a = op_args(backend, writes=("out",), stream=stream, q=q, k_cache=k_cache,
                v_cache=v_cache, kv_len=kv_len, out=out)
    qa = a.array("q", np.float32)
    kc, vc = a.array("k_cache"), a.array("v_cache")
    if kc.ndim != 3 or kc.shape != vc.shape or kc.dtype != vc.dtype:
        raise ValueError(f"k_cache {kc.shape} {kc.dtype} and v_cache {vc.shape} {vc.dtype} "
                         "must both be [n_kv_heads, capacity, head_dim] of one dtype")
    n_kv, cap, d = kc.shape
    if qa.size % d or (qa.size // d) % n_kv:
        raise ValueError(f"q ({qa.size} values) is not a multiple of {n_kv} KV heads of {d}")
    n_q = qa.size // d
    kv_dtype = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}.get(kc.dtype)
    if kv_dtype is None:
        raise TypeError(f"the KV cache must be float16 or float32, got {kc.dtype}")
    be = a.backend
    tgt = be.target
    fspec = _fd.FlashDecodeSpec(head_dim=d, group=n_q // n_kv, kv_dtype=kv_dtype,
                                early_kv=bool(early_kv), target=tgt,
                                pdl=has_griddepcontrol(tgt) if pdl is None else bool(pdl))
    spec = _fd.with_overrides(fspec, config, be.device_name)
    split = be.function(_fd.build, spec, spec.split_name, spec.dynamic_shared)
    if n_splits is None:
        if blocks_per_sm is None:
            blocks_per_sm = be.resident(split, 32 * spec.warps, spec.dynamic_shared)
        n_splits = _fd.choose_splits(spec, be.sm_count, n_kv, cap, blocks_per_sm)
    part_o = be.workspace(("fd_o", n_q, n_splits, d), (n_q, n_splits, d), np.float32)
    part_ml = be.workspace(("fd_ml", n_q, n_splits), (n_q, n_splits, 2), np.float32)
    out = a.out("out", (n_q, d))
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    split_geo, combine_geo = _fd.launch_geometry(spec, n_kv, n_splits)
    a.launch(split, split_geo,
             dict(q=qa, k_cache=kc, v_cache=vc, kv_len_ptr=a.scalar_i32("kv_len"),
                  part_o=part_o, part_ml=part_ml, capacity=cap, sm_scale=scale), pdl=spec.pdl)
    a.launch(be.function(_fd.build, spec, combine_geo.kernel), combine_geo,
             dict(part_o=part_o, part_ml=part_ml, out=out), pdl=spec.pdl)
    return a.result(out)


def embedding(table, qtype: str, token_id, out=None, *, n=None, rows=False, stream=None,
              backend=None):
    """Gather row ``token_id`` (device int32) of ``table`` as f32.

    ``table`` holds ``[n_vocab, n]`` weights in ``qtype``, a type the gather
    reads (``kernels.quants.names_for("embedding")``: ``"F32"``, ``"F16"``,
    ``"BF16"``, ``"Q8_0"``, ``"Q4_0"``, ``"Q4_1"``, ``"Q5_0"``, ``"Q5_1"``,
    ``"Q4_K"``, ``"Q5_K"``, ``"Q6_K"``; any case); for raw quantized bytes give
    ``n`` (else the last dimension of ``table`` is used; a BF16 table is
    2-byte values).  With
    ``rows``, ``token_id`` is a device int32 array of ``R`` ids and one
    launch writes ``out [R, n]``.
    """
    a = op_args(backend, writes=("out",), stream=stream, table=table, token_id=token_id,
                out=out)
    ta = a.array("table")
    spec = _emb.EmbeddingSpec(qtype=str(qtype), rows=bool(rows), target=a.backend.target)
    if n is None:
        if qtype_of(spec.qtype).block_size == 1:       # a float type: one weight an element
            n = ta.shape[-1]
        else:
            raise ValueError("give n (weights per row) for a quantized table")
    rb = spec.row_bytes(n)
    if ta.nbytes % rb:
        raise ValueError(f"table of {ta.nbytes} bytes is not whole rows of {rb} bytes")
    n_vocab = ta.nbytes // rb
    if rows:
        ids = a.array("token_id", np.int32)
        r = int(ids.size)
        out = a.out("out", (r, n))
    else:
        ids, r = a.scalar_i32("token_id"), 1
        out = a.out("out", (n,))
    a.launch(a.backend.function(_emb.build, spec), _emb.launch_geometry(spec, n, r),
             dict(table=ta, token_ptr=ids, out=out, n=n, n_vocab=n_vocab))
    return a.result(out)


def kv_append(k, v, k_cache, v_cache, pos, *, stream=None, backend=None):
    """Write ``k``, ``v [n_kv_heads, head_dim]`` (f32) into row ``pos`` (device
    int32) of the caches ``[n_kv_heads, capacity, head_dim]`` (numpy caches
    too: they receive the rows in place)."""
    a = op_args(backend, writes=("k_cache", "v_cache"), stream=stream, k=k, v=v,
                k_cache=k_cache, v_cache=v_cache, pos=pos)
    ka, va = a.array("k", np.float32), a.array("v", np.float32)
    kc, vc = a.array("k_cache"), a.array("v_cache")
    if kc.ndim != 3 or kc.shape != vc.shape or kc.dtype != vc.dtype:
        raise ValueError("k_cache and v_cache must both be [n_kv_heads, capacity, head_dim]")
    n_kv, cap, d = kc.shape
    if ka.size != n_kv * d or va.size != n_kv * d:
        raise ValueError(f"k and v must have {n_kv}x{d} values")
    cdt = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}.get(kc.dtype)
    if cdt is None:
        raise TypeError(f"the KV cache must be float16 or float32, got {kc.dtype}")
    spec = _kva.KvAppendSpec(head_dim=d, cache_dtype=cdt, target=a.backend.target)
    a.launch(a.backend.function(_kva.build, spec), _kva.launch_geometry(spec, n_kv),
             dict(k=ka, v=va, k_cache=kc, v_cache=vc, pos_ptr=a.scalar_i32("pos"),
                  n_kv_heads=n_kv, capacity=cap))
    a.result(None)


def argmax(x, out=None, *, stream=None, backend=None):
    """Index (int32 ``[1]``, in device memory, or numpy for a numpy ``x``) of
    the largest value of ``x`` (f32)."""
    a = op_args(backend, writes=("out",), stream=stream, x=x, out=out)
    xa = a.array("x", np.float32)
    be = a.backend
    spec = _argmax.ArgmaxSpec(target=be.target)
    geo = _argmax.launch_geometry(spec, xa.size, be.sm_count)
    out = a.out("out", (1,), np.int32)
    scratch = be.workspace(("argmax_scratch", geo.grid[0]), (geo.grid[0],), np.uint64)
    counter = be.workspace(("argmax_counter",), (1,), np.uint32, zero=True)
    a.launch(be.function(_argmax.build, spec), geo,
             dict(x=xa, n=xa.size, out=out, scratch=scratch, counter=counter))
    return a.result(out)
