"""The sampler as an op (``ptxgen.kernels.sampling``): penalties, top-k,
top-p, min-p, temperature and a seeded Philox draw over f32 logits, one
launch writing int32 tokens to device memory; for one row (:func:`sample`)
or a batch of rows, each with its own settings (:func:`sample_rows`)."""

from __future__ import annotations

import numpy as np

from ptxgen.kernels import sampling as _smp
from ptxgen.kernels.spec_fields import has_griddepcontrol

from .memory import DeviceArray
from .backend import device_target
from .ops_backend import op_args

__all__ = ["sample", "sample_rows", "sampling_params", "sampling_spec"]


def sampling_spec(n_vocab: int, *, pdl=None, target=None, rows=False,
                  logprobs=0) -> _smp.SamplingSpec:
    """The spec :func:`sample` (and with ``rows``, :func:`sample_rows`) uses
    for ``n_vocab`` logits on this device: blocks of 512 threads (1024
    logits each) and 64 keys per block, up to 524,288 logits."""
    tgt = target or device_target()
    block = 512 if n_vocab <= 2 * 512 * 512 else 1024
    return _smp.SamplingSpec(block=block, top=64, target=tgt, rows=rows, logprobs=logprobs,
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


def sample_rows(logits, history, history_len, pos, params, *, out=None, n_draws: int = 1,
                info=None, work=None, logprobs: int = 0, logprob=None, top_ids=None,
                top_logprobs=None, pdl=None, stream=None, backend=None):
    """Draw ``n_draws`` tokens for each of ``B`` rows of logits in one launch,
    each row with its own settings, penalty window, position and outputs
    (the layout of :mod:`ptxgen.kernels.sampling.rows`).  Row ``b`` gets
    exactly what :func:`sample` gives for ``logits[b]``, ``params[b]`` and
    the same window at position ``pos[b]``.

    Parameters
    ----------
    logits : float32 [B, V]
    history : int32 [B, W]
        A ring per row: token ``p`` of row ``b``'s sequence at ``history[b,
        p % W]``.
    history_len : int32 [B]
        Tokens each row has seen; its penalty window is its last
        ``min(penalty_last_n, history_len, W)`` (``-1``: ``min(history_len,
        W)``).
    pos : int32 [B]
        Each row's position, which with its seed keys its draws (Philox
        counter ``(pos, r, 0, 0)`` for draw ``r``).
    params : uint32 [B, 12]
        Each row's :func:`ptxgen.kernels.sampling.pack_params` (graph-safe:
        rewrite between replays).
    out : int32 [B, n_draws], optional
    info : int32 [B, 4], optional
        Per row: kept count, flags, smallest kept index, keys known exactly.
    work : float32 [B, V], optional
        Receives the penalised logits.
    logprobs : int
        0, or ``N`` (1..20): also write, for each row whose params say
        ``logprobs=True``, ``logprob [B, n_draws]`` (float32: each draw's
        log-probability) and ``top_ids`` (int32) / ``top_logprobs``
        (float32) ``[B, N]``, the ``N`` most likely tokens, all under the
        log-softmax of the raw logits (rows that do not ask are left
        untouched).

    Returns
    -------
    ``out``, or with ``logprobs`` ``(out, logprob, top_ids, top_logprobs)``.
    """
    if n_draws < 1:
        raise ValueError(f"n_draws must be at least 1, got {n_draws}")
    a = op_args(backend, writes=("out", "work", "info", "logprob", "top_ids", "top_logprobs"),
                stream=stream, logits=logits, history=history, history_len=history_len,
                pos=pos, params=params, out=out, work=work, info=info, logprob=logprob,
                top_ids=top_ids, top_logprobs=top_logprobs)
    be = a.backend
    xa = a.array("logits", np.float32)
    if xa.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(xa.shape)}")
    B, v = (int(n) for n in xa.shape)
    ha = a.array("history", np.int32)
    if ha.ndim != 2 or ha.shape[0] != B or ha.shape[1] < 1:
        raise ValueError(f"history must be [{B}, W] with W >= 1, got shape {tuple(ha.shape)}")
    hl, ps = a.array("history_len", np.int32, B), a.array("pos", np.int32, B)
    pa = a["params"]
    if pa.size != B * _smp.PARAM_WORDS or pa.dtype.itemsize != 4:
        raise ValueError(f"params must be [{B}, {_smp.PARAM_WORDS}] 32-bit words "
                         f"(pack_params per row), got {pa.size} of {pa.dtype}")
    spec = sampling_spec(v, pdl=pdl, target=be.target, rows=True, logprobs=logprobs)
    geo = _smp.launch_geometry(spec, v, B)
    fn = be.function(_smp.build, spec)
    out = a.out("out", (B, n_draws), np.int32)
    work = (be.workspace(("sample_rows_work", B, v), (B, v), np.float32) if work is None
            else a.out("work", (B, v), np.float32))
    info_arg = 0 if info is None else a.out("info", (B, _smp.INFO_WORDS), np.int32)
    words = _smp.scratch_words(spec, v)
    scratch = be.workspace(("sample_rows_scratch", spec.block, logprobs, B, v), (B, words),
                           np.uint64)
    counter = be.workspace(("sample_rows_counter", B), (B,), np.uint32, zero=True)
    lp = ()
    args = dict(logits=xa, n=v, history=ha, window=int(ha.shape[1]), history_len=hl, pos=ps,
                params=pa, out=out, n_draws=n_draws, work=work, info=info_arg, scratch=scratch,
                counter=counter)
    if logprobs:
        lp = (a.out("logprob", (B, n_draws), np.float32),
              a.out("top_ids", (B, logprobs), np.int32),
              a.out("top_logprobs", (B, logprobs), np.float32))
        args.update(logprob=lp[0], top_ids=lp[1], top_logprobs=lp[2])
    a.launch(fn, geo, args, pdl=spec.pdl)
    return a.result((out, *lp) if logprobs else out)
