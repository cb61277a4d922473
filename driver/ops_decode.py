"""Entry points for the decode-step kernels (re-exported by ``ptxgen.driver.ops``).

Each function takes device tensors (a :class:`~ptxgen.driver.DeviceArray`, or
a torch/cupy tensor through ``__cuda_array_interface__``), builds its kernel
once per spec (cached), and launches it on ``stream`` (default: the legacy
default stream).  Outputs are :class:`DeviceArray` unless ``out=`` is given.

Values a replayed CUDA graph must see change (position, KV length, token
id) are device int32 arrays; a Python int is accepted for convenience and
copied to a fresh device scalar (not graph-safe).  Workspaces (flash-decode
partials, argmax scratch) are cached per shape and device, so a call inside
a graph capture allocates nothing once the same shapes ran before it.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np

from ptxgen.kernels import argmax as _argmax
from ptxgen.kernels import embedding as _emb
from ptxgen.kernels import flash_decode as _fd
from ptxgen.kernels import kv_append as _kva
from ptxgen.kernels import rmsnorm as _rms
from ptxgen.kernels import rope as _rope
from ptxgen.kernels import swiglu as _swiglu
from ptxgen.kernels.spec_fields import has_griddepcontrol
from ptxgen.target import TARGETS

from .device import get_device
from .launch import launch
from .memory import DeviceArray, as_device_array
from .module import Module

__all__ = ["rmsnorm", "rope", "swiglu", "flash_decode", "embedding", "kv_append", "argmax",
           "device_target"]

_lock = threading.Lock()
_workspaces: dict = {}


def device_target(device=None) -> str:
    """The newest ptxgen target the device can run (``"sm_90"`` on H100/H200)."""
    major, minor = get_device(device).compute_capability
    sm = major * 10 + minor
    ok = [t for t in TARGETS if t.startswith("sm_") and t[3:].isdigit() and int(t[3:]) <= sm]
    if not ok:
        raise RuntimeError(f"ptxgen has no target for compute capability {major}.{minor}")
    return max(ok, key=lambda t: int(t[3:]))


@functools.lru_cache(maxsize=None)
def _module(build, spec):
    return Module.from_ptx(build(spec).to_ptx())


def _fn(build, spec, name=None):
    return _module(build, spec).function(name or spec.kernel_name)


def _arr(x, what) -> DeviceArray:
    try:
        return as_device_array(x)
    except ValueError as e:
        raise TypeError(f"{what}: expected a device array or a CUDA tensor ({e})") from None


def _check_dtype(a, dtype, what):
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{what} must be {np.dtype(dtype).name}, got {a.dtype.name}")


def _scalar_i32(x, what) -> DeviceArray:
    if isinstance(x, (int, np.integer)):
        return DeviceArray.from_numpy(np.array([x], dtype=np.int32))
    a = _arr(x, what)
    _check_dtype(a, np.int32, what)
    return a


def _out(out, shape, dtype=np.float32, what="out"):
    if out is None:
        return DeviceArray.empty(shape, dtype)
    o = _arr(out, what)
    _check_dtype(o, dtype, what)
    if o.size != math.prod(shape):
        raise ValueError(f"{what} has {o.size} elements, expected {math.prod(shape)}")
    return o


def _workspace(key, shape, dtype, zero=False):
    """A device array cached per ``key``, made on the first call (``zero``:
    filled with zero bytes, and the device synchronized once, since the
    memset runs on the legacy stream and the array's first user may be on
    another; so the first call for a key must come before a graph capture)."""
    with _lock:
        ws = _workspaces.get(key)
        if ws is None:
            ws = (DeviceArray.zeros if zero else DeviceArray.empty)(shape, dtype)
            if zero:
                get_device().synchronize()
            _workspaces[key] = ws
        return ws


def _constant(key, make):
    """A device copy of the host array ``make()``, uploaded once per key."""
    with _lock:
        a = _workspaces.get(key)
        if a is None:
            a = _workspaces[key] = DeviceArray.from_numpy(make())
        return a


def rmsnorm(x, w, eps: float, out=None, residual=None, sum_out=None, *, precise=True,
            block=None, pdl=None, stream=None):
    """``out = x / sqrt(mean(x**2) + eps) * w`` row by row (f32).

    ``block`` defaults to the fewest threads (256 to 1024) that hold a row of
    up to 16384 values in registers (16 per thread).

    With ``residual``, ``s = x + residual`` is normalised and written to
    ``sum_out`` (allocated if None); returns ``out`` or ``(out, sum_out)``.

    ``pdl`` (default: on for sm_90 and newer) launches it as a programmatic
    dependent launch: it may start while the previous kernel in the stream
    finishes, and waits for it (``griddepcontrol.wait``) before reading.
    """
    xa, wa = _arr(x, "x"), _arr(w, "w")
    _check_dtype(xa, np.float32, "x")
    _check_dtype(wa, np.float32, "w")
    n = wa.size
    if n == 0 or xa.size % n:
        raise ValueError(f"x has {xa.size} elements, not a multiple of len(w) = {n}")
    rows = xa.size // n
    if block is None:
        # enough threads for the row to sit in registers (4 x 16 bytes each)
        block = min(1024, max(256, -(-n // 512) * 32))
    tgt = device_target()
    spec = _rms.RmsNormSpec(residual=residual is not None, block=block, precise=precise,
                            target=tgt, pdl=has_griddepcontrol(tgt) if pdl is None else bool(pdl))
    f = _fn(_rms.build, spec)
    out = _out(out, xa.shape)
    grid, blk, _ = _rms.launch_geometry(spec, rows)
    if residual is None:
        launch(f, grid, blk, xa, wa, out, n, float(eps), stream=stream, pdl=spec.pdl)
        return out
    ra = _arr(residual, "residual")
    _check_dtype(ra, np.float32, "residual")
    sum_out = _out(sum_out, xa.shape, what="sum_out")
    launch(f, grid, blk, xa, ra, sum_out, wa, out, n, float(eps), stream=stream, pdl=spec.pdl)
    return out, sum_out


def rope(q, k, pos, *, head_dim=None, layout="neox", theta=10000.0, scaling=None, stream=None):
    """Rotate ``q [n_q_heads, head_dim]`` and ``k [n_kv_heads, head_dim]`` in place.

    ``pos`` is a device int32 scalar; ``scaling`` is None or a dict of
    Llama-3 parameters (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_context``).
    """
    qa, ka = _arr(q, "q"), _arr(k, "k")
    _check_dtype(qa, np.float32, "q")
    _check_dtype(ka, np.float32, "k")
    d = head_dim or qa.shape[-1]
    if qa.size % d or ka.size % d:
        raise ValueError(f"q ({qa.size}) and k ({ka.size}) must be whole heads of {d}")
    extra = dict(scaling or {})
    spec = _rope.RopeSpec(head_dim=d, layout=layout, theta=float(theta),
                          scaling="llama3" if scaling else "none", target=device_target(),
                          **extra)
    f = _fn(_rope.build, spec)
    table = _constant(("rope", spec), lambda: _rope.freq_table(spec))
    n_q, n_kv = qa.size // d, ka.size // d
    grid, blk, _ = _rope.launch_geometry(spec, n_q, n_kv)
    launch(f, grid, blk, qa, ka, table, _scalar_i32(pos, "pos"), n_q, n_kv, stream=stream)
    return q, k


def swiglu(g, u, out=None, *, stream=None):
    """``out = silu(g) * u`` (f32, any length)."""
    ga, ua = _arr(g, "g"), _arr(u, "u")
    _check_dtype(ga, np.float32, "g")
    _check_dtype(ua, np.float32, "u")
    if ga.size != ua.size:
        raise ValueError(f"g has {ga.size} elements, u {ua.size}")
    spec = _swiglu.SwiGluSpec(target=device_target())
    out = _out(out, ga.shape)
    grid, blk, _ = _swiglu.launch_geometry(spec, ga.size)
    launch(_fn(_swiglu.build, spec), grid, blk, ga, ua, out, ga.size, stream=stream)
    return out


@functools.lru_cache(maxsize=None)
def _resident_cached(handle, block, shared=0):
    from .errors import check, cuda
    d = cuda()
    return int(check(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(handle, block, shared),
                     "cuOccupancyMaxActiveBlocksPerMultiprocessor"))


def _resident(fn, block, shared=0) -> int:
    """Blocks of ``fn`` one SM holds at once with ``shared`` bytes of
    dynamic shared memory each (the driver's occupancy; the function's
    dynamic shared memory limit is raised to ``shared`` first, without which
    the driver counts no block past 48 KB)."""
    if shared:
        fn.require_dynamic_shared(shared)
    try:
        return max(1, _resident_cached(fn.handle, block, shared))
    except Exception:                      # an old driver binding: the spec's estimate
        return None


def flash_decode(q, k_cache, v_cache, kv_len, out=None, *, sm_scale=None, n_splits=None,
                 warps=None, unroll=None, chunks=None, prefetch=None, min_keys=None,
                 fused_combine=None, merge_unroll=None, stages=None, early_kv=None,
                 mma=None, per_sm=None, combine_warps=None, interleave=None, l2_prefetch=None,
                 l1_bypass=None, bypass_from=None, blocks_per_sm=None, pdl=None,
                 stream=None):
    """Attention of one token ``q [n_q_heads, d]`` (f32) over the first
    ``kv_len`` rows of ``k_cache``/``v_cache [n_kv_heads, capacity, d]``.

    ``kv_len`` is a device int32 scalar (read by the kernel, so a replayed
    graph follows it); ``n_splits`` defaults to :func:`choose_splits` for
    this device and the cache's capacity (fixed per shape), with
    ``blocks_per_sm`` defaulting to the driver's occupancy of the split
    kernel (one whole wave).  ``warps``, ``unroll``, ``chunks``,
    ``prefetch``, ``min_keys``, ``fused_combine``, ``merge_unroll``, ``stages``,
    ``mma`` (the split on tensor cores; None: on where the shape allows, f16
    cache, head_dim 64 or 128, group at most 8, and none of ``chunks``,
    ``prefetch``, ``stages`` nor an ``unroll`` past 4 is given, with
    ``flash_decode.MMA_KNOBS`` under the knobs given: ``flash_decode.op_knobs``),
    ``per_sm``,
    ``combine_warps``, ``interleave``, ``l2_prefetch``, ``l1_bypass``,
    ``bypass_from`` pick the
    spec (None: the :class:`~ptxgen.kernels.flash_decode.FlashDecodeSpec`
    default: a split kernel and a separate combine kernel; ``fused_combine=True``
    makes it one launch, the last split block of each KV head merging the
    partials).  ``pdl`` (default: on for sm_90 and newer) launches both with
    programmatic dependent launch, so the combine starts while the split
    kernel drains.  ``early_kv=True`` reads the length and the first K/V tile
    before the split kernel's wait (see ``FlashDecodeSpec.early_kv``: under
    PDL, the kernel launched just before may write the cache row
    ``kv_len - 1`` and nothing else the split reads).  The fused merge's
    per-KV-head counter is cached per shape and device, zeroed once (each
    launch leaves it at zero).
    """
    qa = _arr(q, "q")
    kc, vc = _arr(k_cache, "k_cache"), _arr(v_cache, "v_cache")
    _check_dtype(qa, np.float32, "q")
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
    knobs = {k_: v_ for k_, v_ in dict(warps=warps, unroll=unroll, chunks=chunks,
                                        prefetch=prefetch, min_keys=min_keys,
                                        fused_combine=fused_combine,
                                        merge_unroll=merge_unroll, stages=stages,
                                        early_kv=early_kv, mma=mma, per_sm=per_sm,
                                        combine_warps=combine_warps,
                                        interleave=interleave,
                                        l2_prefetch=l2_prefetch,
                                        l1_bypass=l1_bypass,
                                        bypass_from=bypass_from).items()
             if v_ is not None}
    tgt = device_target()
    # the tensor-core split where the shape takes it and no knob of the
    # CUDA-core split's own was asked for
    knobs = _fd.op_knobs(knobs, d, n_q // n_kv, kv_dtype)
    spec = _fd.FlashDecodeSpec(head_dim=d, group=n_q // n_kv, kv_dtype=kv_dtype, target=tgt,
                               pdl=has_griddepcontrol(tgt) if pdl is None else bool(pdl),
                               **knobs)
    dev = get_device()
    mod = _module(_fd.build, spec)
    split = mod.function(spec.split_name)
    split.require_dynamic_shared(spec.dynamic_shared)
    if n_splits is None:
        if blocks_per_sm is None:
            blocks_per_sm = _resident(split, 32 * spec.warps, spec.dynamic_shared)
        n_splits = _fd.choose_splits(spec, dev.sm_count, n_kv, cap, blocks_per_sm)
    part_o = _workspace(("fd_o", n_q, n_splits, d), (n_q, n_splits, d), np.float32)
    part_ml = _workspace(("fd_ml", n_q, n_splits), (n_q, n_splits, 2), np.float32)
    out = _out(out, (n_q, d))
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    counter = _workspace(("fd_counter", n_kv), (n_kv,), np.uint32, zero=True)
    (g1, b1), comb = _fd.launch_geometry(spec, n_kv, n_splits)
    launch(split, g1, b1, qa, kc, vc, _scalar_i32(kv_len, "kv_len"),
           part_o, part_ml, out, counter, cap, scale, shared=spec.dynamic_shared, stream=stream,
           pdl=spec.pdl)
    if comb is not None:
        launch(mod.function(spec.combine_name), *comb, part_o, part_ml, out, n_splits,
               stream=stream, pdl=spec.pdl)
    return out


def embedding(table, qtype: str, token_id, out=None, *, n=None, stream=None):
    """Gather row ``token_id`` (device int32) of ``table`` as f32.

    ``table`` holds ``[n_vocab, n]`` weights in ``qtype`` (``"f32"``,
    ``"f16"``, ``"Q8_0"``, ``"Q4_K"``, ``"Q6_K"``); for raw quantized bytes
    give ``n`` (else the last dimension of ``table`` is used).
    """
    ta = _arr(table, "table")
    qtype = {"q8_0": "Q8_0", "q4_k": "Q4_K", "q6_k": "Q6_K"}.get(str(qtype).lower(), str(qtype))
    spec = _emb.EmbeddingSpec(qtype=qtype, target=device_target())
    if n is None:
        if qtype in ("f32", "f16"):
            n = ta.shape[-1]
        else:
            raise ValueError("give n (weights per row) for a quantized table")
    rb = spec.row_bytes(n)
    if ta.nbytes % rb:
        raise ValueError(f"table of {ta.nbytes} bytes is not whole rows of {rb} bytes")
    n_vocab = ta.nbytes // rb
    out = _out(out, (n,))
    grid, blk, _ = _emb.launch_geometry(spec, n)
    launch(_fn(_emb.build, spec), grid, blk, ta, _scalar_i32(token_id, "token_id"), out, n,
           n_vocab, stream=stream)
    return out


def kv_append(k, v, k_cache, v_cache, pos, *, stream=None):
    """Write ``k``, ``v [n_kv_heads, head_dim]`` (f32) into row ``pos`` (device
    int32) of the caches ``[n_kv_heads, capacity, head_dim]``."""
    ka, va = _arr(k, "k"), _arr(v, "v")
    kc, vc = _arr(k_cache, "k_cache"), _arr(v_cache, "v_cache")
    _check_dtype(ka, np.float32, "k")
    _check_dtype(va, np.float32, "v")
    if kc.ndim != 3 or kc.shape != vc.shape or kc.dtype != vc.dtype:
        raise ValueError("k_cache and v_cache must both be [n_kv_heads, capacity, head_dim]")
    n_kv, cap, d = kc.shape
    if ka.size != n_kv * d or va.size != n_kv * d:
        raise ValueError(f"k and v must have {n_kv}x{d} values")
    cdt = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}[kc.dtype]
    spec = _kva.KvAppendSpec(head_dim=d, cache_dtype=cdt, target=device_target())
    grid, blk, _ = _kva.launch_geometry(spec, n_kv)
    launch(_fn(_kva.build, spec), grid, blk, ka, va, kc, vc, _scalar_i32(pos, "pos"), n_kv,
           cap, stream=stream)


def argmax(x, out=None, *, stream=None):
    """Index (int32, in device memory) of the largest value of ``x`` (f32)."""
    xa = _arr(x, "x")
    _check_dtype(xa, np.float32, "x")
    spec = _argmax.ArgmaxSpec(target=device_target())
    grid, blk, _ = _argmax.launch_geometry(spec, xa.size, get_device().sm_count)
    out = _out(out, (1,), np.int32)
    scratch = _workspace(("argmax_scratch", grid[0]), (grid[0],), np.uint64)
    counter = _workspace(("argmax_counter",), (1,), np.uint32, zero=True)
    launch(_fn(_argmax.build, spec), grid, blk, xa, xa.size, out, scratch, counter,
           stream=stream)
    return out
