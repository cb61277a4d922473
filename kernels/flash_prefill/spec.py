"""What a flash-prefill kernel computes (:class:`FlashPrefillSpec`), how it
runs (:class:`FlashPrefillConfig`, chosen by :func:`~.tuning.select_config`
from ``kernels/tuning/flash_prefill.json``), and the two resolved
(:class:`FlashPrefillPlan`), which the kernel body reads."""

from __future__ import annotations

import attrs

from ptxgen.target import TARGETS

from ..paged_attention.spec import BLOCK_SIZES as PAGED_SIZES
from ..plan import PlanBase
from ..spec_fields import has_bulk_copy, pdl_field, target_field

__all__ = ["FlashPrefillSpec", "FlashPrefillConfig", "FlashPrefillPlan", "NEG", "PAGED_SIZES"]

NEG = -1.0e30           # finite "minus infinity" for running maxima


def _one_of(name, allowed):
    def check(inst, attr, v):
        if isinstance(v, bool) or v not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {v!r}")
    return check


def _int_in(lo, hi):
    def check(inst, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi):
            raise ValueError(f"{attr.name} must be an int in {lo}..{hi}, got {v!r}")
    return check


@attrs.frozen
class FlashPrefillSpec:
    """Causal attention of a chunk of new query rows against an f16 KV cache.

    Parameters
    ----------
    head_dim : {64, 128, 256}
    group : int
        Query heads per KV head (GQA), 1..16.
    out_type : {"f32", "f16"}
        Element type of ``out`` (f16 feeds the next GEMM's f16 X directly;
        rounded once, ``cvt.rn``, from the f32 result).
    paged : {0, 16, 32, 64, 128, 256}
        0: the keys and values are a contiguous cache ``[n_kv_heads,
        capacity, head_dim]``; else the block size of a paged cache (pools
        ``[num_blocks, n_kv_heads, paged, head_dim]`` read through the
        sequence's block-table row, the layout of
        :mod:`~ptxgen.kernels.paged_attention`).
    target : str
    pdl : bool
    window : int
        A sliding window: row ``i`` (position ``p = start + i``) sees only
        the keys ``p - window + 1 .. p`` (0: all keys ``0 .. p``; Gemma's
        local layers).  The walk starts at the tile of the block's first
        row's first key.
    """

    head_dim: int = attrs.field(default=128, validator=_one_of("head_dim", (64, 128, 256)))
    group: int = attrs.field(default=4, validator=_int_in(1, 16))
    out_type: str = attrs.field(default="f32", validator=_one_of("out_type", ("f32", "f16")))
    paged: int = attrs.field(default=0, validator=_one_of("paged", (0,) + PAGED_SIZES))
    target: str = target_field()
    pdl: bool = pdl_field()
    window: int = attrs.field(default=0, validator=_int_in(0, (1 << 31) - 1))


@attrs.frozen
class FlashPrefillConfig:
    """How the kernel runs.

    Parameters
    ----------
    warps : {1, 2, 4, 8}
        Warps per block; each takes 16 query rows of one query head.
    heads : {1, 2, 4, 8}
        Query heads per block, all of one KV head (a divisor of ``group``
        and of ``warps``): every K/V tile copied into shared memory serves
        ``heads`` heads of the block's ``16 * warps / heads`` rows
        (``block_rows``).
    block_keys : {16, 32, 64}
        Keys per shared-memory tile (K and V, rows padded by 8 halves).
    stages : {2, 3, 4}
        K/V tiles in the ring: tile ``i + stages - 1`` is copied while tile
        ``i`` is computed (``wgmma``: tile ``i + stages - 2``, the tile
        before's V being still in use; at least 3).
    kernel : {"mma", "wgmma"}
        ``mma``: each warp multiplies its 16 rows with ``mma.sync`` on
        ``ldmatrix`` fragments (sm_80+).  ``wgmma``: each warpgroup (4
        warps: 4 heads of one 16-row group, so ``heads`` must be a multiple
        of 4) multiplies with ``wgmma.mma_async``, K and V read from the
        shared tiles through matrix descriptors (sm_90a).
    """

    warps: int = attrs.field(default=8, validator=_one_of("warps", (1, 2, 4, 8)))
    heads: int = attrs.field(default=4, validator=_one_of("heads", (1, 2, 4, 8)))
    block_keys: int = attrs.field(default=64, validator=_one_of("block_keys", (16, 32, 64)))
    stages: int = attrs.field(default=2, validator=_one_of("stages", (2, 3, 4)))
    kernel: str = attrs.field(default="mma", validator=_one_of("kernel", ("mma", "wgmma")))


SPEC_FIELDS = tuple(f.name for f in attrs.fields(FlashPrefillSpec))
CONFIG_FIELDS = tuple(f.name for f in attrs.fields(FlashPrefillConfig))


@attrs.frozen(init=False)
class FlashPrefillPlan(PlanBase):
    """A spec and a config together; the builder reads both kinds of field
    from it (``plan.head_dim``, ``plan.warps``)."""

    spec: FlashPrefillSpec
    config: FlashPrefillConfig

    SPEC, CONFIG, WHAT = FlashPrefillSpec, FlashPrefillConfig, "flash-prefill"

    @classmethod
    def make(cls, **fields) -> "FlashPrefillPlan":
        """A plan from spec and config fields side by side (others at their
        defaults, not the tuned ones)."""
        return cls(FlashPrefillSpec(), FlashPrefillConfig(), **fields)

    def _check(self):
        c, g = self.config, self.spec.group
        if g % c.heads:
            raise ValueError(f"heads={c.heads} must divide the GQA group {g} (the block's "
                             "query heads share one KV head)")
        if c.warps % c.heads:
            raise ValueError(f"heads={c.heads} must divide warps={c.warps} (each warp "
                             "takes 16 rows of one head)")
        if c.kernel == "wgmma":
            t = TARGETS[self.spec.target]
            if not t.arch_specific or t.sm != 90:
                raise ValueError(f"kernel='wgmma' needs target sm_90a (wgmma is "
                                 f"arch-specific), got {self.spec.target}")
            if c.stages < 3:
                raise ValueError(f"kernel='wgmma' needs stages >= 3 (one tile's P V runs "
                                 f"beside the next one's scores), got stages={c.stages}")
            if c.heads % 4:
                raise ValueError(f"kernel='wgmma' needs heads a multiple of 4 (a warpgroup's "
                                 f"4 warps share one 16-row group), got heads={c.heads}")

    @property
    def block_rows(self) -> int:
        """Chunk rows of one block (each for ``heads`` query heads)."""
        return 16 * self.config.warps // self.config.heads

    @property
    def stage_bytes(self) -> int:
        """Shared bytes of one K/V tile pair (rows of ``head_dim`` halves in
        128-byte swizzled blocks of 64 dims, no padding)."""
        return 2 * self.config.block_keys * self.spec.head_dim * 2

    @property
    def dynamic_shared(self) -> int:
        """Dynamic shared bytes a block needs: the ring and, where whole
        tiles come by TMA (sm_90), one mbarrier a stage."""
        bars = 8 * self.config.stages if has_bulk_copy(self.spec.target) else 0
        return self.config.stages * self.stage_bytes + bars

    @property
    def kernel_name(self) -> str:
        c = self.config
        return (f"flash_prefill_d{self.head_dim}_g{self.group}_w{c.warps}_h{c.heads}"
                f"_bn{c.block_keys}_s{c.stages}" + ("_o16" if self.out_type == "f16" else "")
                + ("_wg" if c.kernel == "wgmma" else "") + (f"_p{self.paged}" if self.paged else "")
                + ("_pdl" if self.pdl else "") + (f"_sw{self.window}" if self.window else ""))
