"""What a paged decode-attention kernel pair computes
(:class:`PagedAttentionSpec`), how it runs (:class:`PagedAttentionConfig`,
chosen by :func:`~.tuning.select_config` from
``kernels/tuning/paged_attention.json``), and the two resolved
(:class:`PagedAttentionPlan`), which the kernel bodies read."""

from __future__ import annotations

import attrs

from ..flash_decode.spec import COMBINE_WARPS, MAX_SPLITS, NEG
from ptxgen.target import MAX_STATIC_SHARED

from ..plan import PlanBase
from ..spec_fields import pdl_field, target_field

__all__ = ["PagedAttentionSpec", "PagedAttentionConfig", "PagedAttentionPlan", "BLOCK_SIZES",
           "MAX_SPLITS", "NEG", "COMBINE_WARPS"]

#: block sizes (tokens a pool block holds) the kernels are built for
BLOCK_SIZES = (16, 32, 64, 128, 256)


def _one_of(allowed):
    def check(inst, attr, v):
        if isinstance(v, bool) or v not in allowed:
            raise ValueError(f"{attr.name} must be one of {', '.join(map(str, allowed))}, "
                             f"got {v!r}")
    return check


def _int_in(lo, hi, pow2=False):
    def check(inst, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
                and not (pow2 and v & (v - 1))):
            what = "a power of two" if pow2 else "an int"
            raise ValueError(f"{attr.name} must be {what} in {lo}..{hi}, got {v!r}")
    return check


def _bool(inst, attr, v):
    if not isinstance(v, bool):
        raise ValueError(f"{attr.name} must be a bool, got {v!r}")


@attrs.frozen
class PagedAttentionSpec:
    """Attention of one query token per sequence over its paged f16 KV
    cache, for a batch of sequences of different lengths
    (``out[b, qh] = softmax(q[b, qh] . K_b[h]^T * sm_scale) @ V_b[h]``,
    ``h = qh // group``), split over the keys and combined.

    Parameters
    ----------
    head_dim : {64, 128, 256}
    group : int
        Query heads per KV head (GQA), 1..8.
    block_size : {16, 32, 64, 128, 256}
        Tokens per pool block.
    out_type : {"f32", "f16"}
        ``out``'s element type (f16: rounded to nearest from the f32 result,
        for a GEMM that takes f16 X).
    window : int
        A sliding window: sequence ``b`` of length ``L`` sees only its last
        ``window`` keys ``[L - window, L)`` (0: all ``L``; Gemma's local
        layers).
    early_kv : bool
        The split reads the lengths and the block table and issues its first
        trip's K/V loads (``ld.global.cg``) before ``griddepcontrol.wait``,
        so under PDL they overlap the previous grid; q is loaded after the
        wait, and each sequence's row ``seq_lens[b] - 1`` again after it.
        The contract (under PDL): the grid launched just before may write
        those rows (and q) and nothing else the split reads before its
        wait; the tables and lengths are written before the step; as in a
        decode step, whose QKV GEMV or RoPE launch appends each sequence's
        newest row.  Flash decode's ``early_kv``.
    target : str
    pdl : bool
    """

    head_dim: int = attrs.field(default=128, validator=_one_of((64, 128, 256)))
    group: int = attrs.field(default=4, validator=_int_in(1, 8))
    block_size: int = attrs.field(default=16, validator=_one_of(BLOCK_SIZES))
    out_type: str = attrs.field(default="f32", validator=_one_of(("f32", "f16")))
    window: int = attrs.field(default=0, validator=_int_in(0, (1 << 31) - 1))
    early_kv: bool = attrs.field(default=False, validator=_bool)
    target: str = target_field()
    pdl: bool = pdl_field()


@attrs.frozen
class PagedAttentionConfig:
    """How the split and combine kernels run.

    Parameters
    ----------
    warps : int
        Warps per split block, 1..8; each takes ``unroll`` chunks of 16
        keys a trip.
    unroll : int
        16-key chunks per warp trip, 1..4.
    min_keys : int
        Fewest keys a split takes: a sequence of length ``L`` works on
        ``ceil(L / min_keys)`` splits at most (a power of two, 16..1024).
    l2_prefetch : bool
        ``.L2::256B`` on the K/V loads.
    l1_bypass : bool
        K/V loads pass by L1 (``.L1::no_allocate``).
    combine_warps : {1, 2, 4, 8, 16}
        Warps of a combine block (one block per sequence and query head).
    """

    warps: int = attrs.field(default=8, validator=_int_in(1, 8))
    unroll: int = attrs.field(default=1, validator=_int_in(1, 4))
    min_keys: int = attrs.field(default=16, validator=_int_in(16, 1024, pow2=True))
    l2_prefetch: bool = attrs.field(default=True, validator=_bool)
    l1_bypass: bool = attrs.field(default=True, validator=_bool)
    combine_warps: int = attrs.field(default=COMBINE_WARPS,
                                     validator=_one_of((1, 2, 4, 8, 16)))


@attrs.frozen(init=False)
class PagedAttentionPlan(PlanBase):
    """A spec and a config resolved together; the builders read both kinds
    of field from it (``plan.block_size``, ``plan.warps``)."""

    spec: PagedAttentionSpec
    config: PagedAttentionConfig

    SPEC, CONFIG, WHAT = PagedAttentionSpec, PagedAttentionConfig, "paged-attention"

    def _check(self):
        if self.shared_bytes > MAX_STATIC_SHARED:
            raise ValueError(f"group {self.group} x head_dim {self.head_dim} x {self.warps} "
                             f"warps needs {self.shared_bytes} bytes of shared memory "
                             f"(limit {MAX_STATIC_SHARED}); use fewer warps")

    @classmethod
    def make(cls, **fields) -> "PagedAttentionPlan":
        """A plan from spec and config fields side by side (the others at
        their defaults, not the tuned ones)."""
        return cls(PagedAttentionSpec(), PagedAttentionConfig(), **fields)

    @property
    def shared_bytes(self) -> int:
        """Static shared memory of the split kernel (the warps' partials)."""
        return 4 * self.warps * self.group * (self.head_dim + 2)

    @property
    def keys_per_trip(self) -> int:
        """Keys a split block takes per loop trip (16 per chunk)."""
        return 16 * self.warps * self.unroll

    @property
    def kernel_name(self) -> str:
        return (f"paged_attention_d{self.head_dim}_g{self.group}_b{self.block_size}"
                f"_w{self.warps}u{self.unroll}"
                + (f"k{self.min_keys}" if self.min_keys != 16 else "")
                + ("l" if self.l2_prefetch else "") + ("n" if self.l1_bypass else "")
                + ("e" if self.early_kv else "")
                + ("_out_f16" if self.out_type == "f16" else "")
                + (f"_sw{self.window}" if self.window else ""))

    @property
    def split_name(self) -> str:
        return self.kernel_name + "_split"

    @property
    def combine_name(self) -> str:
        cw = self.combine_warps
        return self.kernel_name + "_combine" + (str(cw) if cw != COMBINE_WARPS else "")
