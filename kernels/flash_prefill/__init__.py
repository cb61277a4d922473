"""Flash prefill: causal attention of a chunk of new query rows on tensor cores.

``out[i, qh] = softmax_j(q[i, qh] . K[h, j] * sm_scale) @ V[h, j]`` over the
keys ``j <= L + i`` (with a sliding window ``W``, also ``j > L + i - W``)
for chunk row ``i`` in ``[0, T)`` at position ``L + i``, every query head
``qh`` and its KV head ``h = qh // group`` (GQA).

Layout
    ``q``: f32 ``[T_max, n_q_heads, head_dim]``; ``out`` the same shape in
    f32 or f16 (``out_type``).  ``k_cache``,
    ``v_cache``: f16 ``[n_kv_heads, capacity, head_dim]``.  ``start_ptr``
    (``L``) and ``n_tokens_ptr`` (``T``): device int32, read by the kernel,
    so a CUDA graph captured for the largest chunk replays for any shorter
    one at any start; clamped to ``[0, capacity]``, ``[0, capacity - L]``
    and the grid's rows.  The chunk's own K and V rows (positions ``L ..
    L + T - 1``) must already be in the cache: the RoPE/KV-append launch
    before writes them.

Paged (``paged=block_size``)
    The keys and values of the chunk's sequence in a paged cache, the
    layout of :mod:`~ptxgen.kernels.paged_attention`: pools ``k_pool``,
    ``v_pool`` f16 ``[num_blocks, n_kv_heads, block_size, head_dim]``,
    ``block_table`` the sequence's row of the block table (int32
    ``[max_blocks]``, read from device memory: key ``p`` is in pool block
    ``block_table[p // block_size]``, an entry outside ``[0, num_blocks)``
    reads block ``num_blocks - 1``); the kernel takes ``max_blocks`` (at
    least 1) and ``num_blocks`` where the contiguous one takes
    ``capacity``, and clamps ``L`` and ``T`` to ``max_blocks *
    block_size`` keys.  The paged RoPE (``RopeSpec(rows=True,
    append="f16", paged=block_size)``) writes the chunk's own rows at their
    slots first.  On sm_90 the tensor maps cover each pool as ``num_blocks
    * n_kv_heads * block_size`` rows (:func:`pool_maps`).

Two kernel bodies (``FlashPrefillConfig.kernel``): ``mma.sync`` per warp
(sm_80+), and on sm_90a warpgroup ``wgmma`` with one tile's ``P V`` running
beside the next tile's softmax.

Accuracy: q and the probabilities are rounded to f16 (K and V are f16 as
stored) with f32 accumulation, so the output is within about 2e-3 of
float64 attention relative to the largest output value (tests: 5e-3).

What is computed is a :class:`FlashPrefillSpec`; how it runs a
:class:`FlashPrefillConfig` (``kernels/tuning/flash_prefill.json``); the
kernel: :func:`.kernel.build_prefill`.
"""

from __future__ import annotations

import ptxgen
from ptxgen import registry
from ptxgen.tensor_map import TensorMap

from ..plan import LaunchGeometry
from ..spec_fields import has_bulk_copy
from .kernel import build_prefill
from .reference import reference
from .spec import NEG, PAGED_SIZES, FlashPrefillConfig, FlashPrefillPlan, FlashPrefillSpec
from .tuning import select_config

__all__ = ["FlashPrefillSpec", "FlashPrefillConfig", "FlashPrefillPlan", "build", "plan",
           "select_config", "launch_geometry", "cache_maps", "pool_maps", "reference", "NEG",
           "PAGED_SIZES", "CANONICAL"]


def plan(spec: FlashPrefillSpec, config: FlashPrefillConfig | None = None, *,
         device: str | None = None) -> FlashPrefillPlan:
    """``spec`` with ``config`` (default: the tuned one)."""
    if isinstance(spec, FlashPrefillPlan):
        return spec
    return FlashPrefillPlan(spec, config or select_config(spec, device))


def build(spec, config: FlashPrefillConfig | None = None) -> ptxgen.Module:
    """PTX with the kernel ``plan.kernel_name`` (parameters: see
    :func:`.kernel.build_prefill`)."""
    p = plan(spec, config)
    m = ptxgen.Module(p.target)
    build_prefill(m, p)
    return m


def cache_maps(plan: FlashPrefillPlan, k_address: int, v_address: int, n_kv_heads: int,
               capacity: int):
    """The tensor maps (:class:`ptxgen.tensor_map.TensorMap`) of the K and V
    caches (f16 ``[n_kv_heads, capacity, head_dim]`` at those device
    addresses) that the kernel of ``plan`` takes as its last two arguments,
    or None where it takes none (before sm_90 every tile comes by
    ``cp.async``).  A box is 64 dims x ``block_keys`` rows, 128B-swizzled."""
    if plan.paged:
        raise ValueError(f"{plan.kernel_name} reads a paged cache: its maps come from pool_maps")
    if not has_bulk_copy(plan.target):
        return None
    d = plan.head_dim
    return tuple(TensorMap("f16", a, (d, n_kv_heads * capacity), (2 * d,),
                           (64, plan.block_keys), swizzle="128B", oob_fill="zero")
                 for a in (k_address, v_address))


def pool_maps(plan: FlashPrefillPlan, k_address: int, v_address: int, n_kv_heads: int,
              num_blocks: int):
    """The tensor maps of the K and V pools (f16 ``[num_blocks, n_kv_heads,
    paged, head_dim]`` at those device addresses, seen as ``num_blocks *
    n_kv_heads * paged`` rows of ``head_dim``) that the paged kernel of
    ``plan`` takes as its last two arguments, or None before sm_90.  A box
    is 64 dims x ``min(paged, block_keys)`` rows, 128B-swizzled (a tile of
    ``block_keys`` keys is ``block_keys / paged`` boxes a half when the
    blocks are smaller)."""
    if not plan.paged:
        raise ValueError(f"{plan.kernel_name} reads a contiguous cache: its maps come from "
                         "cache_maps")
    if not has_bulk_copy(plan.target):
        return None
    d = plan.head_dim
    rows = num_blocks * n_kv_heads * plan.paged
    return tuple(TensorMap("f16", a, (d, rows), (2 * d,),
                           (64, min(plan.paged, plan.block_keys)), swizzle="128B",
                           oob_fill="zero")
                 for a in (k_address, v_address))


def launch_geometry(plan: FlashPrefillPlan, n_q_heads: int, max_tokens: int):
    """The launch for chunks of up to ``max_tokens`` rows of ``n_q_heads``
    query heads."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if n_q_heads % plan.group:
        raise ValueError(f"{n_q_heads} query heads are not a multiple of the group {plan.group}")
    return LaunchGeometry(plan.kernel_name, (-(-max_tokens // plan.block_rows),
                                             n_q_heads // plan.heads),
                          32 * plan.warps, plan.dynamic_shared)


CANONICAL = {
    "flash_prefill": FlashPrefillPlan.make(),
    "flash_prefill_d64": FlashPrefillPlan.make(head_dim=64, group=1, heads=1, warps=2,
                                               block_keys=32, stages=3),
    "flash_prefill_o16": FlashPrefillPlan.make(out_type="f16"),
    # the warpgroup kernel as the table picks it on an H100 (sm_90a, f16 out
    # for the next GEMM, PDL)
    "flash_prefill_wg": FlashPrefillPlan.make(out_type="f16", target="sm_90a", pdl=True,
                                              kernel="wgmma", stages=3),
    # the same over a paged cache of 64-token blocks (one pool block a tile),
    # and the mma.sync kernel over 16-token blocks (four a tile)
    "flash_prefill_wg_paged": FlashPrefillPlan.make(out_type="f16", target="sm_90a", pdl=True,
                                                    kernel="wgmma", stages=3, paged=64),
    "flash_prefill_paged16": FlashPrefillPlan.make(paged=16),
    # Gemma 3 4B's local layers on an H100: head_dim 256, group 2, a window
    # of 1024 keys, the table's config for head_dim 256
    "flash_prefill_d256_window": FlashPrefillPlan.make(
        head_dim=256, group=2, out_type="f16", target="sm_90a", pdl=True, window=1024, heads=2,
        block_keys=16, stages=3),
}

registry.register("flash_prefill", FlashPrefillPlan, build, CANONICAL,
                  doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
