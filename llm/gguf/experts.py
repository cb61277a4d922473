"""Mixture-of-experts files as llama.cpp reads them: the hyperparameters, the
tensors of a layer's expert FFN, and one expert's slice of them.

``qwen3moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B; llama.cpp's
``llama_model_qwen3moe``): every layer's FFN is a router and ``expert_count``
experts, of which ``expert_used_count`` run for each token:

- ``{arch}.expert_count`` (1 to :data:`MAX_EXPERTS`, llama.cpp's
  ``LLAMA_MAX_EXPERTS``) and ``{arch}.expert_used_count`` (1 to the expert
  count) are required, one value for every layer;
- ``{arch}.expert_feed_forward_length``, an expert's hidden size F, defaults
  to ``feed_forward_length / expert_used_count`` as in llama.cpp (and
  ``feed_forward_length``, which nothing else reads, may then be absent);
- ``{arch}.expert_group_count`` above 1 (DeepSeek-V3's grouped selection,
  which llama.cpp applies to any architecture) is refused;
- per layer, ``ffn_gate_inp`` (the router, ``[expert_count, hidden]``,
  kept in F32 by llama.cpp's converter and quantizer) and the experts'
  ``ffn_gate_exps`` and ``ffn_up_exps`` (``[expert_count, F, hidden]``) and
  ``ffn_down_exps`` (``[expert_count, hidden, F]``), 3-D tensors (GGUF
  dims ``[hidden, F, expert_count]`` and ``[F, hidden, expert_count]``)
  whose expert ``e`` is the ``e``-th of ``expert_count`` equal slices,
  stored back to back (ggml's ``mul_mat_id`` reads them so).

The FFN llama.cpp computes (``build_moe_ffn`` with softmax gating and
``norm_w``): ``p = softmax(W_router h)``; the ``expert_used_count`` experts
of largest ``p`` (ties to the lower expert id, as its fused CUDA top-k
kernel breaks them; its CPU argsort leaves the order of equal values
unspecified); their weights ``p_e / max(sum p_sel, 2^-14)``; the output
``sum_sel w_e down_e(silu(gate_e h) * up_e h)``.
"""

from __future__ import annotations

import attrs
import numpy as np

__all__ = ["MOE_ARCHS", "MAX_EXPERTS", "EXPERT_TENSORS", "ExpertHParams", "read_experts",
           "expert_shapes", "expert_slice"]

#: architectures whose FFN is a mixture of experts
MOE_ARCHS = ("qwen3moe",)
#: most experts a layer may have (llama.cpp's LLAMA_MAX_EXPERTS)
MAX_EXPERTS = 1024
#: the per-layer tensors of an expert FFN, the router first
EXPERT_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@attrs.frozen
class ExpertHParams:
    """A layer's experts: how many, how many run per token, their FFN size."""

    n_expert: int
    n_used: int
    ffn: int


def read_experts(f, a: str, max_width: int) -> ExpertHParams:
    """The expert hyperparameters of the file ``f`` (a
    :class:`~.file.LlamaFile` reading its metadata) of architecture ``a``;
    an expert's FFN size is at most ``max_width`` (the file's limit on
    widths)."""
    n_expert = f._int(f"{a}.expert_count", 1, MAX_EXPERTS, per_layer=True,
                      why=" (a mixture of experts needs at least one; llama.cpp's limit)")
    n_used = f._int(f"{a}.expert_used_count", 1, n_expert, per_layer=True,
                    why=f" (at least one of the {n_expert} experts, key '{a}.expert_count')")
    groups = int(f._field(f"{a}.expert_group_count", default=0, required=False))
    if groups > 1:
        raise f._error(f"metadata key '{a}.expert_group_count' is {groups}: grouped expert "
                       "selection is not supported")
    key = f"{a}.expert_feed_forward_length"
    if f._field(key, required=False) is not None:
        ffn = f._int(key, 1, max_width, per_layer=True)
    else:
        dense = f._field(f"{a}.feed_forward_length", required=False)
        if dense is None:
            raise f._error(f"metadata key {key!r} is missing (and '{a}.feed_forward_length', "
                           "which llama.cpp divides by the experts used, too)")
        ffn = f._int(f"{a}.feed_forward_length", 1, max_width, per_layer=True) // n_used
        if ffn < 1:
            raise f._error(f"metadata key '{a}.feed_forward_length' is smaller than "
                           f"'{a}.expert_used_count' ({n_used}), and {key!r} is missing")
    return ExpertHParams(n_expert, n_used, ffn)


def expert_shapes(hp) -> dict:
    """Short name -> logical shape (outermost first) of a layer's expert
    FFN tensors for the hyperparameters ``hp``."""
    E, F, H = hp.n_expert, hp.expert_ffn, hp.hidden
    return {"ffn_gate_inp": (E, H), "ffn_gate_exps": (E, F, H), "ffn_up_exps": (E, F, H),
            "ffn_down_exps": (E, H, F)}


def expert_slice(data: np.ndarray, shape: tuple, e: int) -> np.ndarray:
    """Expert ``e``'s ``[rows, row_bytes]`` (or ``[rows, cols]`` of a float
    type) of a 3-D tensor's stored ``data`` (its ``[experts * rows, ...]``
    array) of logical ``shape`` ``(experts, rows, cols)``."""
    n, rows = int(shape[0]), int(shape[1])
    if not 0 <= e < n:
        raise IndexError(f"expert {e} of a tensor of {n} experts")
    return data.reshape(n, rows, data.shape[-1])[e]
