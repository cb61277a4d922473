"""The sampler's rows mode (``SamplingSpec(rows=True)``): one launch samples
``B`` rows of logits, ``grid = (G, B)``, every block of row ``y =
ctaid.y`` working on that row's part of each array exactly as a one-row
launch works on the whole array, so each row's token, ``info`` and
``work`` equal those of a one-row launch with the same inputs.

Arrays (row ``y`` at ``y * stride`` elements; each array below ``2**32``
elements)
    ``logits``, ``work``: f32 ``[B, n]``.  ``history``: int32 ``[B,
    window]``, a ring: token ``p`` of row ``y``'s sequence at ``history[y, p
    % window]``; ``history_len``: int32 ``[B]``, the tokens the row has seen
    (prompt and generated), so its penalty window is its last
    ``min(penalty_last_n, history_len, window)`` tokens (``penalty_last_n =
    -1``: ``min(history_len, window)``).  ``pos``: int32 ``[B]``, the
    position that keys the row's draw (Philox counter ``(pos, r, 0, 0)``
    for draw ``r``); a one-row launch's window is ``history[pos - n + 1 ..
    pos]``, so it equals a row whose ``history_len`` is ``pos + 1``.
    ``params``: u32 ``[B, PARAM_WORDS]`` (:func:`.pack_params` per row).
    ``out``: int32 ``[B, n_draws]``.  ``info``: int32 ``[B, INFO_WORDS]``
    or a null pointer.  ``scratch``: u64 ``[B, scratch_words(spec, n)]``.
    ``counter``: u32 ``[B]``, zero before the first launch (the last block
    of each row resets its own).  With ``logprobs = N``: ``logprob`` f32
    ``[B, n_draws]``, ``top_ids`` int32 ``[B, N]``, ``top_logprobs`` f32
    ``[B, N]``.
"""

from __future__ import annotations

from ptxgen.types import s32

from .params import INFO_WORDS, PARAM_WORDS

__all__ = ["row_arrays"]


def row_arrays(k, spec, n, n_draws, window, logits, history, hist_len, pos_p, prm, out, work,
               info, scratch, counter, lp_out):
    """Row ``ctaid.y``'s part of each array (a null ``info`` stays null),
    in the order given; ``lp_out`` (the logprob outputs, or None) last."""
    row = k.ctaid.y

    def at(p, stride):
        return p + row * stride

    info_row = k.ptr_reg(s32)
    k.select(k.setp("ne", info, 0), at(info, INFO_WORDS), info, out=info_row)
    words = k.nctaid.x * (spec.record + (spec.logprobs + 1 if spec.logprobs else 0)) + n
    if lp_out is not None:
        lp_out = (at(lp_out[0], n_draws), at(lp_out[1], spec.logprobs),
                  at(lp_out[2], spec.logprobs))
    return (at(logits, n), at(history, window), at(hist_len, 1), at(pos_p, 1),
            at(prm, PARAM_WORDS), at(out, n_draws), at(work, n), info_row, at(scratch, words),
            at(counter, 1), lp_out)
