"""Flash decode: one query token against a KV cache, split-KV with online softmax.

``out[qh] = softmax(q[qh] . K[h]^T * sm_scale) @ V[h]`` over the first
``kv_len`` cache rows (the last ``window`` of them with a sliding window),
for every query head ``qh`` and its KV head ``h = qh // group`` (GQA:
``n_q_heads = group * n_kv_heads``).

Layout
    ``q``, ``out``: f32 ``[n_q_heads, head_dim]``.  ``k_cache``, ``v_cache``:
    ``[n_kv_heads, capacity, head_dim]`` (f16, or f32), row ``pos`` of head
    ``h`` at element ``(h * capacity + pos) * head_dim``; 16-byte aligned.
    ``kv_len_ptr``: a device int32, clamped to ``[0, capacity]``, so a
    replayed CUDA graph sees the current length.
    Workspace: ``part_o`` f32 ``[n_q_heads, n_splits, head_dim]`` and
    ``part_ml`` f32 ``[n_q_heads, n_splits, 2]``.

What is computed is a :class:`FlashDecodeSpec`; how it runs a
:class:`FlashDecodeConfig` from :func:`select_config` (the tuning table
``kernels/tuning/flash_decode.json``).  Measurements: docs/notes/flash_decode.md.

Kernels (one module; :mod:`.split_cuda`, :mod:`.split_mma`, :mod:`.combine`)
    ``split``: ``grid = (n_splits, n_kv_heads)``, ``block = 32 * warps``.
    The first ``n = min(n_splits, ceil(kv_len / min_keys))`` splits work:
    the ``g`` row groups (the block's rows loaded at once) of ``[0, kv_len)``
    are dealt out evenly, block ``(s, h)`` taking groups ``[s g / n, (s + 1)
    g / n)``, so the grid is fixed (graph-replay safe) while every length
    uses it and no block has more than one group more than another; a block
    past ``n`` writes a neutral ``(m, l, o) = (-1e30, 0, 0)`` and exits.
    ``head_dim / 8``
    lanes (f16; ``/ 4`` for f32)
    share one key row: each loads 16 bytes of K and of V with
    ``ld.global.nc.v4``, so a warp streams whole rows and the K/V bytes are
    read once for all ``group`` query heads.  Scores are prescaled by
    ``sm_scale * log2(e)`` (folded into q) and exponentiated with
    ``ex2.approx``; each lane group keeps a running max, sum and ``o`` and
    rescales once per tile of ``unroll`` keys (the next tile's loads are in
    flight during this tile's math).  The lane groups of a warp
    are merged with shuffles, the warps through shared memory.
    ``combine``: ``grid = n_q_heads``, ``block = 32 * combine_warps`` (2 warps
    by default): warp ``w`` merges splits ``w, w + warps, ...``, ``max(6,
    16 // warps)`` at a time with every load of a round issued at once (one
    round for up to 16 splits with 2 warps): all its lanes read a
    split's ``(m, l)`` (one broadcast transaction) and lane ``i`` its
    ``head_dim / 32`` columns of the split's ``o``, merged online (``M = max
    m``, weights ``2^(m - M)``), so the warp needs no shuffles and no
    barrier.  An empty split's block writes ``(m, l, o) = (-1e30, 0, 0)``,
    so its weight needs no test on ``l`` (with one, ptxas predicates the
    ``o`` loads on it: a second round trip).  The warp partials meet in
    shared memory behind one barrier; thread ``j`` merges columns ``j, j +
    32 warps, ...`` and divides (``div.rn``; one warp divides its own
    columns, no barrier); ``kv_len = 0`` gives 0.  At most ``MAX_SPLITS``
    (512) splits.

    ``split`` on tensor cores (``mma=True``): the same parameters, partials
    and key dealing; a warp computes 16 keys at a time with
    ``mma.sync.m16n8k16`` (q and the probabilities as two f16 halves, K and V
    as stored, f32 accumulation); see :func:`_build_split_mma`.

Accuracy: within 1e-4 (relative to the largest output) of float64
attention over the same f16 K/V (``ex2.approx``: 2^-22 relative).
"""

from __future__ import annotations

import ptxgen
from ptxgen import registry

from ..plan import LaunchGeometry
from .combine import build_combine
from .reference import reference
from .spec import (COMBINE_WARPS, MAX_SPLITS, NEG, FlashDecodeConfig, FlashDecodePlan,
                   FlashDecodeSpec, mma_fits)
from .split_cuda import build_split
from .split_mma import build_split_mma
from .tuning import choose_splits, resident_blocks, select_config, with_overrides

__all__ = ["FlashDecodeSpec", "FlashDecodeConfig", "FlashDecodePlan", "build", "plan",
           "select_config", "with_overrides", "launch_geometry", "choose_splits",
           "resident_blocks", "reference", "mma_fits", "MAX_SPLITS", "NEG", "COMBINE_WARPS",
           "CANONICAL"]


def plan(spec: FlashDecodeSpec, config: FlashDecodeConfig | None = None, *,
         device: str | None = None) -> FlashDecodePlan:
    """``spec`` with ``config`` (default: the tuned one), checked together."""
    if isinstance(spec, FlashDecodePlan):
        return spec
    return FlashDecodePlan(spec, config or select_config(spec, device))


def build(spec, config: FlashDecodeConfig | None = None) -> ptxgen.Module:
    """PTX with the plan's ``split_name`` and ``combine_name`` kernels.

    split parameters: ``q, k_cache, v_cache, kv_len_ptr: s32*, part_o,
    part_ml, capacity: u32, sm_scale: f32``; combine parameters: ``part_o,
    part_ml, out, n_splits: u32``.
    """
    p = plan(spec, config)
    m = ptxgen.Module(p.target)
    (build_split_mma if p.mma else build_split)(m, p)
    build_combine(m, p)
    return m


def launch_geometry(plan: FlashDecodePlan, n_kv_heads: int, n_splits: int):
    """``(split, combine)``: the two launches, in order; the split asks for
    ``plan.dynamic_shared`` bytes of dynamic shared memory, the combine
    takes ``n_splits`` as an argument."""
    if not 1 <= n_splits <= MAX_SPLITS:
        raise ValueError(f"n_splits must be in 1..{MAX_SPLITS}, got {n_splits}")
    return (LaunchGeometry(plan.split_name, (n_splits, n_kv_heads), 32 * plan.warps,
                           plan.dynamic_shared),
            LaunchGeometry(plan.combine_name, n_kv_heads * plan.group, 32 * plan.combine_warps,
                           args={"n_splits": n_splits}))


def _canon(**fields):
    return FlashDecodePlan.make(**fields)


CANONICAL = {
    "flash_decode": _canon(),
    "flash_decode_d64_f32": _canon(head_dim=64, group=3, kv_dtype="f32", warps=2, unroll=2),
    "flash_decode_mma": _canon(mma=True, warps=8, unroll=1, early_kv=True),
    "flash_decode_d256_window": _canon(head_dim=256, group=2, early_kv=True, window=1024,
                                       unroll=2),
    "flash_decode_mma_window": _canon(mma=True, warps=8, unroll=1, early_kv=True, interleave=2,
                                      window=1024),
}

registry.register("flash_decode", FlashDecodePlan, build, CANONICAL,
                  doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
