"""What a flash-decode kernel pair computes (:class:`FlashDecodeSpec`), how
it runs (:class:`FlashDecodeConfig`, chosen by :func:`~.tuning.select_config`
from ``kernels/tuning/flash_decode.json``), and the two resolved
(:class:`FlashDecodePlan`), which the kernel bodies read."""

from __future__ import annotations

import attrs

from ptxgen.target import MAX_STATIC_SHARED, TARGETS

from ..plan import PlanBase
from ..spec_fields import pdl_field, target_field

__all__ = ["FlashDecodeSpec", "FlashDecodeConfig", "FlashDecodePlan", "mma_fits",
           "NEG", "MAX_SPLITS", "COMBINE_WARPS"]

NEG = -1.0e30           # finite "minus infinity" for running maxima
MAX_SPLITS = 512        # the most splits a launch may have
COMBINE_WARPS = 2       # warps of the combine block by default


def _one_of(name, allowed):
    def check(inst, attr, v):
        if isinstance(v, bool) or v not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {v!r}")
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


def _mma_shape_misses(head_dim: int, group: int, kv_dtype: str) -> list:
    """What of this shape the tensor-core split does not take (empty: all)."""
    return [what for what, ok in (("an f16 cache", kv_dtype == "f16"),
                                  ("head_dim 64 or 128", head_dim in (64, 128)),
                                  ("group at most 8", 1 <= group <= 8)) if not ok]


def mma_fits(head_dim: int, group: int, kv_dtype: str) -> bool:
    """Whether the tensor-core split (``mma=True``) takes this shape (every
    ptxgen target, sm_80 and newer, has ``mma.sync.m16n8k16``)."""
    return not _mma_shape_misses(head_dim, group, kv_dtype)


@attrs.frozen
class FlashDecodeSpec:
    """Attention of one query token per head against a KV cache
    (``out[qh] = softmax(q[qh] . K[h]^T * sm_scale) @ V[h]``, ``h = qh //
    group``), split over the cache and combined.

    Parameters
    ----------
    head_dim : {64, 128, 256}
        (256 with an f16 cache only.)
    group : int
        Query heads per KV head (GQA), 1..16.
    kv_dtype : {"f16", "f32"}
    window : int
        A sliding window: the query sees only the last ``window`` keys
        ``[kv_len - window, kv_len)`` (0: all ``kv_len``; Gemma's local
        layers).  The splits deal out the window's keys.
    early_kv : bool
        The split reads the length and issues its first K/V loads
        (``ld.global.cg``) before ``griddepcontrol.wait``, so under PDL they
        overlap the previous grid; q is loaded after the wait, and the cache
        row ``kv_len - 1`` again after it.  The contract (under PDL): the
        grid launched just before may write that row and nothing else the
        split reads before its wait; as in a decode step, where the length
        advances at the end of the step and the RoPE launch appends the row.
    target : str
    pdl : bool
    """

    head_dim: int = attrs.field(default=128, validator=_one_of("head_dim", (64, 128, 256)))
    group: int = attrs.field(default=4, validator=_int_in(1, 16))
    kv_dtype: str = attrs.field(default="f16", validator=_one_of("kv_dtype", ("f16", "f32")))
    early_kv: bool = attrs.field(default=False, validator=_bool)
    target: str = target_field()
    pdl: bool = pdl_field()
    window: int = attrs.field(default=0, validator=_int_in(0, (1 << 31) - 1))

    @property
    def elems_per_lane(self) -> int:
        return 8 if self.kv_dtype == "f16" else 4

    @property
    def row_bytes(self) -> int:
        """Bytes of one K or V cache row."""
        return self.head_dim * (2 if self.kv_dtype == "f16" else 4)


@attrs.frozen
class FlashDecodeConfig:
    """How the split and combine kernels run.

    Parameters
    ----------
    mma : bool
        The split on tensor cores (``mma.sync.m16n8k16``; f16 cache,
        head_dim 64 or 128, group at most 8): q and the probabilities enter
        as two f16 halves each, K and V as stored, f32 accumulation; a warp
        takes ``unroll`` chunks of 16 keys a trip.  False: the CUDA-core
        split, lane groups of ``head_dim / 8`` lanes (f16; ``/ 4`` for f32)
        sharing a key row, the next tile's loads in flight during this
        tile's math.
    warps : int
        Warps per split block, 1..8.
    unroll : int
        Keys per lane group per tile (CUDA cores) or 16-key chunks per warp
        trip (tensor cores, at most 4).
    min_keys : int
        Fewest keys a split takes: at short lengths only the first
        ``ceil(kv_len / min_keys)`` splits work (a power of two, 8..1024).
    per_sm : int
        At most this many split blocks resident on one SM (0: no cap): the
        launch asks for enough dynamic shared memory that one more would
        not fit.
    interleave : int
        (``mma`` only.)  ``t >= 1``: where every warp has at least ``t`` trips
        (``kv_len >= t * splits * warps * 16 * unroll``, decided in the
        kernel) a KV head's keys are dealt a warp trip at a time, round
        robin over the blocks; shorter lengths keep contiguous ranges.
    l2_prefetch : bool
        (``mma`` only.)  ``.L2::256B`` on the K/V loads.
    l1_bypass : bool
        (``mma`` only.)  K/V loads after the wait pass by L1
        (``.L1::no_allocate``).
    bypass_from : int
        (``l1_bypass`` only.)  0: at every length; ``t >= 1``: only where
        every warp has at least ``t`` trips (a second copy of the loop
        otherwise).
    combine_warps : {1, 2, 4, 8, 16}
        Warps of a combine block (one block per query head).
    """

    mma: bool = attrs.field(default=False, validator=_bool)
    warps: int = attrs.field(default=4, validator=_int_in(1, 8))
    unroll: int = attrs.field(default=3, validator=_int_in(1, 8))
    min_keys: int = attrs.field(default=8, validator=_int_in(8, 1024, pow2=True))
    per_sm: int = attrs.field(default=0, validator=_int_in(0, 32))
    interleave: int = attrs.field(default=0, validator=_int_in(0, 64))
    l2_prefetch: bool = attrs.field(default=False, validator=_bool)
    l1_bypass: bool = attrs.field(default=False, validator=_bool)
    bypass_from: int = attrs.field(default=0, validator=_int_in(0, 64))
    combine_warps: int = attrs.field(default=COMBINE_WARPS,
                                     validator=_one_of("combine_warps", (1, 2, 4, 8, 16)))


SPEC_FIELDS = tuple(f.name for f in attrs.fields(FlashDecodeSpec))
CONFIG_FIELDS = tuple(f.name for f in attrs.fields(FlashDecodeConfig))
_SPEC_PROPS = ("elems_per_lane", "row_bytes")


@attrs.frozen(init=False)
class FlashDecodePlan(PlanBase):
    """A spec and a config resolved and checked together; the builders read
    both kinds of field from it (``plan.head_dim``, ``plan.warps``).  Spec
    and config fields given as keywords replace theirs, so
    ``attrs.evolve(plan, warps=4)`` works."""

    spec: FlashDecodeSpec
    config: FlashDecodeConfig

    SPEC, CONFIG, WHAT = FlashDecodeSpec, FlashDecodeConfig, "flash-decode"
    SPEC_PROPS = _SPEC_PROPS

    @classmethod
    def make(cls, **fields) -> "FlashDecodePlan":
        """A plan from spec and config fields side by side (the others at
        their defaults, not the tuned ones)."""
        return cls(FlashDecodeSpec(), FlashDecodeConfig(), **fields)

    def _check(self):
        sp, c = self.spec, self.config
        if c.mma:
            bad = _mma_shape_misses(sp.head_dim, sp.group, sp.kv_dtype)
            if c.unroll > 4:
                bad.append("unroll at most 4")
            if bad:
                raise ValueError("mma=True needs " + ", ".join(bad))
        else:
            for knob in ("interleave", "l2_prefetch", "l1_bypass"):
                if getattr(c, knob):
                    raise ValueError(f"{knob} is built for the tensor-core split (mma=True)")
        if c.bypass_from and not c.l1_bypass:
            raise ValueError("bypass_from chooses where l1_bypass applies; it needs "
                             "l1_bypass=True")
        if self.lanes_per_key > 32:
            raise ValueError(f"head_dim {sp.head_dim} with a {sp.kv_dtype} cache needs "
                             f"{self.lanes_per_key} lanes per key row (at most 32)")
        if c.per_sm:
            try:
                self.dynamic_shared
            except ValueError as e:
                raise ValueError(f"per_sm={c.per_sm}: {e}") from None
        if self.shared_bytes > MAX_STATIC_SHARED:
            raise ValueError(f"group {sp.group} x head_dim {sp.head_dim} x {c.warps} "
                             f"warps needs {self.shared_bytes} bytes of shared memory "
                             f"(limit {MAX_STATIC_SHARED}); use fewer warps")

    @property
    def lanes_per_key(self) -> int:
        return self.head_dim // self.elems_per_lane

    @property
    def row_groups(self) -> int:
        """Key rows a block loads at once (lane groups per block)."""
        return self.warps * (32 // self.lanes_per_key)

    @property
    def tile(self) -> int:
        """Keys per block per loop iteration (a split's last tile is masked)."""
        if self.mma:
            return 16 * self.warps * self.unroll
        return self.row_groups * self.unroll

    @property
    def shared_bytes(self) -> int:
        """Static shared memory of the split kernel (the warps' partials)."""
        return 4 * self.warps * self.group * (self.head_dim + 2)

    @property
    def dynamic_shared(self) -> int:
        """Dynamic shared memory a split launch asks for: 0, raised with
        ``per_sm`` so that no more than ``per_sm`` blocks fit on an SM."""
        if not self.per_sm:
            return 0
        return TARGETS[self.target].capped_shared(self.per_sm, 0, self.shared_bytes)

    @property
    def kernel_name(self) -> str:
        return (f"flash_decode_d{self.head_dim}_g{self.group}_{self.kv_dtype}"
                + ("_mma" if self.mma else "") + f"_w{self.warps}u{self.unroll}"
                + ("" if self.mma else "p")
                + (f"k{self.min_keys}" if self.min_keys != 8 else "")
                + ("e" if self.early_kv else "")
                + (f"i{self.interleave}" if self.interleave else "")
                + ("l" if self.l2_prefetch else "") + ("n" if self.l1_bypass else "")
                + (str(self.bypass_from) if self.bypass_from else "")
                + (f"_sw{self.window}" if self.window else ""))

    @property
    def split_name(self) -> str:
        return self.kernel_name + "_split"

    @property
    def combine_name(self) -> str:
        cw = self.combine_warps
        return self.kernel_name + "_combine" + (str(cw) if cw != COMBINE_WARPS else "")
