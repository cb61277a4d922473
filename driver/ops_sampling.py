"""The sampler as an op (``ptxgen.kernels.sampling``): penalties, top-k,
top-p, min-p, temperature and a seeded Philox draw over f32 logits, one
launch writing int32 tokens to device memory."""

from __future__ import annotations

import numpy as np

from ptxgen.kernels import sampling as _smp
from ptxgen.kernels.spec_fields import has_griddepcontrol

from .memory import DeviceArray
from .backend import device_target
from .ops_backend import op_args

__all__ = ["sample", "sampling_params", "sampling_spec"]


def sampling_spec(n_vocab: int, *, pdl=None, target=None) -> _smp.SamplingSpec:
    """The spec :func:`sample` uses for ``n_vocab`` logits on this device:
    blocks of 512 threads (1024 logits each) and 64 keys per block, up to
    524,288 logits."""
    tgt = target or device_target()
    block = 512 if n_vocab <= 2 * 512 * 512 else 1024
    return _smp.SamplingSpec(block=block, top=64, target=tgt,
                             pdl=has_griddepcontrol(tgt) if pdl is None else bool(pdl))


def sampling_params(**kw) -> DeviceArray:
    """A device copy of :func:`ptxgen.kernels.sampling.pack_params` (u32[12]).
    Keep it and rewrite it with ``copy_from`` between graph replays to change
    the sampling without recapture."""
    return DeviceArray.from_numpy(_smp.pack_params(**kw))


def sample(logits, history, pos, params=None, *, out=None, n_draws: int = 1, info=None,
           work=None, pdl=None, stream=None, backend=None, **kw):
    """Draw ``n_draws`` tokens (int32, device) from ``logits`` (f32[V]).

    Parameters
    ----------
    logits : device array or CUDA tensor, float32, V values
    history : device int32 array of the sequence's tokens (prompt and
        generated); the penalty window is ``history[pos - n + 1 .. pos]``.
    pos : device int32 scalar (graph-safe) or int: the position of the
        token whose logits these are; with the seed it keys the draw.
    params : device u32[12] from :func:`sampling_params` (graph-safe), or
        None to pack ``**kw`` (``top_k``, ``top_p``, ``min_p``,
        ``temperature``, ``penalty_last_n``, ``penalty_repeat``,
        ``penalty_freq``, ``penalty_present``, ``seed``) into a fresh
        device array (not graph-safe).
    out : int32[n_draws] or None.  Draw ``r`` uses the Philox counter
        ``(pos, r, 0, 0)``.
    info : int32[4] or None: kept count, flags, smallest kept index, keys
        known exactly (see ``ptxgen.kernels.sampling``).
    work : f32[V] or None: receives the penalised logits.

    Returns
    -------
    DeviceArray or the given ``out``.
    """
    if n_draws < 1:
        raise ValueError(f"n_draws must be at least 1, got {n_draws}")
    if params is None:
        params = _smp.pack_params(**kw)      # copied to the op's backend
    elif kw:
        raise TypeError(f"give either params or keyword parameters, not both ({sorted(kw)})")
    a = op_args(backend, writes=("out", "work", "info"), stream=stream, logits=logits,
                history=history, pos=pos, params=params, out=out, work=work, info=info)
    be = a.backend
    xa = a.array("logits", np.float32)
    ha = a.array("history", np.int32)
    pa = a["params"]
    if pa.size != _smp.PARAM_WORDS or pa.dtype.itemsize != 4:
        raise ValueError(f"params must be {_smp.PARAM_WORDS} 32-bit words "
                         f"(sampling_params()), got {pa.size} of {pa.dtype}")
    v = xa.size
    spec = sampling_spec(v, pdl=pdl, target=be.target)
    geo = _smp.launch_geometry(spec, v)
    out = a.out("out", (n_draws,), np.int32)
    work = (be.workspace(("sample_work", v), (v,), np.float32) if work is None
            else a.out("work", (v,), np.float32))
    info_arg = 0 if info is None else a.out("info", (_smp.INFO_WORDS,), np.int32)
    scratch = be.workspace(("sample_scratch", spec.block, v), (_smp.scratch_words(spec, v),),
                           np.uint64)
    counter = be.workspace(("sample_counter",), (1,), np.uint32, zero=True)
    a.launch(be.function(_smp.build, spec), geo,
             dict(logits=xa, n=v, history=ha, pos=a.scalar_i32("pos"), params=pa, out=out,
                  n_draws=n_draws, work=work, info=info_arg, scratch=scratch, counter=counter),
             pdl=spec.pdl)
    return a.result(out)
