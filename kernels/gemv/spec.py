"""What a GEMV computes (:class:`GemvSpec`), how fast it runs
(:class:`GemvConfig`), and the two resolved into the kernel a builder emits
(:class:`GemvPlan`).

A spec changes the kernel's meaning or interface; a config changes only its
speed (and, for ``dot="dp4a"``, the rounding of x within a stated bound).
:func:`~.tuning.select_config` picks the config for a spec from the
per-device tuning table.
"""

from __future__ import annotations

import attrs
import numpy as np

from ptxgen.target import CTA_RESERVED_SHARED, SHARED_LINE, TARGETS

from ..plan import PlanBase
from ..quants.qtypes import QTYPES, names_for
from ..rope import PAGED_BLOCKS
from ..spec_fields import has_bulk_copy, pdl_field, target_field
from .layout import BATCH_PIECES, batch_layout, staged_layout, threads

__all__ = ["GemvSpec", "GemvConfig", "GemvPlan", "GEMV_QTYPES", "DP4A_RING",
           "EPILOGUES", "BATCH_EPILOGUES", "BATCH_QTYPES", "MAX_BATCH", "FLOAT_UNIT", "check_k",
           "read_unit", "MAX_RING_BYTES", "batch_shared_limit", "neox_pair_rows"]

#: the weight types the GEMV reads (the registry's, kernels/quants/qtypes.py)
GEMV_QTYPES = names_for("gemv")
#: weights the GEMV reads of a float type (F16, BF16: GGUF blocks of one
#: weight) as one unit: 16 bytes, so their K is a multiple of 8
FLOAT_UNIT = 8


def read_unit(qtype: str) -> tuple:
    """``(weights, bytes)`` the GEMV reads of ``qtype`` as one block: the
    GGUF block, or :data:`FLOAT_UNIT` values of a float type."""
    q = QTYPES[qtype]
    n = FLOAT_UNIT if q.block_size == 1 else q.block_size
    return n, n // q.block_size * q.type_size


#: TRANSITIONAL, derived from the registry: qtype -> :func:`read_unit`, for
#: the formats whose pieces have a ``dot="dp4a"`` form through the ring
#: (Q4_K has one in both of its kernels)
DP4A_RING = ("Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K")
EPILOGUES = ("none", "residual", "swiglu", "geglu", "rope", "bias")
#: the epilogues of a gated FFN: two matrices, ``act(Wg x) * (Wu x)``
GATED = ("swiglu", "geglu")
#: what the batched GEMV (``batch >= 2``, :mod:`.batched`) reads and adds
BATCH_QTYPES = tuple(BATCH_PIECES)
BATCH_EPILOGUES = ("none", "residual", "swiglu", "bias")
#: the most activation rows one batched GEMV takes
MAX_BATCH = 32

#: dynamic shared memory a CTA may ask for on sm_80/sm_90 (the ring's limit)
MAX_RING_BYTES = 227 * 1024


def check_k(qtype: str, k: int) -> None:
    """Raise ValueError unless ``k`` is a positive multiple of ``qtype``'s block."""
    if qtype not in GEMV_QTYPES:
        raise ValueError(f"qtype must be one of {', '.join(GEMV_QTYPES)}, got {qtype!r}")
    bs = read_unit(qtype)[0]
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0 or k % bs:
        what = (f"of 8 (the GEMV reads {qtype} rows 16 bytes at a time)" if qtype in ("F16", "BF16")
                else f"of the {qtype} block size ({bs} weights)")
        raise ValueError(f"{qtype} GEMV: K={k!r} is not a positive multiple {what}")


def batch_shared_limit(target: str) -> int:
    """Dynamic plus static shared memory one CTA of the batched GEMV may
    hold on ``target``: an SM's, less the part the hardware keeps per CTA."""
    return TARGETS[target].shared_per_sm - CTA_RESERVED_SHARED


def _in(name, allowed):
    def check(inst, attr, v):
        if v not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {v!r}")
    return check


def _int_in(lo, hi, pow2=False, zero=False):
    def check(inst, attr, v):
        ok = isinstance(v, int) and not isinstance(v, bool) and (
            (zero and v == 0) or (lo <= v <= hi and not (pow2 and v & (v - 1))))
        if not ok:
            what = "a power of two" if pow2 else "an int"
            raise ValueError(f"{attr.name} must be {what} in {lo}..{hi}"
                             f"{' or 0' if zero else ''}, got {v!r}")
    return check


def _bool(inst, attr, v):
    if not isinstance(v, bool):
        raise ValueError(f"{attr.name} must be a bool, got {v!r}")


def neox_pair_rows(head_dim: int, n_q_heads: int, n_kv_heads: int) -> np.ndarray:
    """The row order of the stacked ``[Wq; Wk; Wv]`` that the rope epilogue
    with ``rope_layout="neox"`` reads: ``W_kernel = W[order]``.  In each q
    and k head, rows ``2i`` and ``2i + 1`` are the natural rows ``i`` and
    ``i + head_dim / 2`` (a NeoX rotation pair); v rows keep their order."""
    d = head_dim
    j = np.arange(d)
    within = (j >> 1) + (j & 1) * (d // 2)
    qk = (np.arange(n_q_heads + n_kv_heads)[:, None] * d + within).reshape(-1)
    return np.concatenate([qk, np.arange(qk.size, qk.size + n_kv_heads * d)])


@attrs.frozen
class GemvSpec:
    """A quantized GEMV ``y = W x`` (``W`` ``[M, K]`` in GGUF rows of blocks,
    ``x`` and ``y`` f32).

    Parameters
    ----------
    qtype : {"Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K", "F16", "BF16"}
        Weight format (GGUF's bytes; the types the registry says the GEMV
        reads, :data:`GEMV_QTYPES`).
    k : int
        Row length (a multiple of the block: 256 for the K-quants, 32 for
        Q4_0 ... Q8_0, 8 for F16 and BF16); a build-time constant so loops
        over K unroll.  M is a launch argument.
    epilogue : {"none", "residual", "swiglu", "geglu", "rope", "bias"}
        ``y = W x``; ``y = W x + r``; ``y = silu(Wg x) * (Wu x)``; ``y =
        gelu(Wg x) * (Wu x)`` (GELU's tanh form, Gemma's FFN); the
        stacked ``[Wq; Wk; Wv]`` projection of a decode step with RoPE on its
        q and k rows and this token's k and v rows appended to an f16 KV
        cache (needs ``rope``); or ``y = W x + bias`` (``batch >= 2`` only).
    norm : bool
        Q4_K: RMSNorm of x fused in front, ``y = W (x / sqrt(mean(x^2) +
        eps) * nw)``; the kernel takes ``nw`` (f32 [K]) and ``eps`` after x.
    norm_out : bool
        With ``norm``: CTA 0 also stores the normed x (``x * nw`` times the
        scale) to ``h`` (f32 [K], the parameter after ``eps``), for the
        GEMVs after it that read the same normed row and cannot fuse the
        norm (another weight type).
    rope : tuple
        ``(head_dim, n_q_heads, n_kv_heads)`` with ``epilogue="rope"`` (else
        empty): y holds the query heads, then the key heads, then as many
        value heads, ``head_dim`` rows each.
    bias : bool
        With ``epilogue="rope"``: ``b[row]`` (f32 ``[M]``, the parameter
        ``bias`` before ``freqs``) is added to each row's sum before the
        rotation and the append (Qwen2's q/k/v biases).
    rope_layout : {"interleaved", "neox"}
        With ``epilogue="rope"``: the pairs rotated together.  ``"neox"``
        pairs ``(i, i + head_dim / 2)`` of a head, which the kernel finds
        adjacent because W's q and k rows come in pair order
        (:func:`neox_pair_rows`); y, the bias and the caches are in the
        natural order.
    paged : {0, 16, 32, 64, 128, 256}
        With ``epilogue="rope"``: 0, the caches ``[n_kv_heads, capacity,
        head_dim]`` at row ``pos``; else the block size of paged pools
        ``[num_blocks, n_kv_heads, paged, head_dim]`` (the layout of
        :mod:`~ptxgen.kernels.paged_attention`), the k and v rows stored at
        the device slot ``slots[0]`` (block ``slot // paged``, offset ``slot
        % paged``) when ``0 <= slot < n_slots``: the kernel takes ``slots``
        after ``pos_ptr`` and names the caches and their size ``k_pool,
        v_pool, n_slots``.
    target : str
        ``sm_80`` ... ``sm_90a``.
    pdl : bool
        Built for programmatic dependent launch (:func:`spec_fields.pdl_field`).
    batch : int
        1: one activation row (the kernels above).  ``B >= 2``: the batched
        GEMV (:mod:`.batched`): ``y[b] = W x[b]`` for ``b < B`` rows of x
        and y (each weight read once and decoded once for all of them; the
        rows in use read from device memory), Q4_K, Q6_K and Q8_0, the
        epilogues none, residual, swiglu and bias.
    """

    qtype: str = attrs.field(validator=_in("qtype", GEMV_QTYPES))
    k: int = attrs.field()
    epilogue: str = attrs.field(default="none", validator=_in("epilogue", EPILOGUES))
    norm: bool = attrs.field(default=False, validator=_bool)
    rope: tuple = attrs.field(default=(), converter=tuple)
    bias: bool = attrs.field(default=False, validator=_bool)
    rope_layout: str = attrs.field(default="interleaved",
                                   validator=_in("rope_layout", ("interleaved", "neox")))
    paged: int = attrs.field(default=0)
    target: str = target_field()
    pdl: bool = pdl_field()
    batch: int = attrs.field(default=1, validator=_int_in(1, MAX_BATCH))
    norm_out: bool = attrs.field(default=False, validator=_bool)

    @norm_out.validator
    def _check_norm_out(self, attr, v):
        if v and not self.norm:
            raise ValueError("norm_out=True stores the fused RMSNorm's output: it needs norm=True")

    @k.validator
    def _check_k(self, attr, v):
        check_k(self.qtype, v)

    @batch.validator
    def _check_batch(self, attr, v):
        if v == 1:
            if self.epilogue == "bias":
                raise ValueError("epilogue='bias' is built for the batched GEMV (batch >= 2)")
            return
        if self.qtype not in BATCH_QTYPES:
            raise ValueError(f"batch={v}: the batched GEMV reads {', '.join(BATCH_QTYPES)}, "
                             f"not {self.qtype}")
        if self.epilogue not in BATCH_EPILOGUES or self.norm:
            what = "norm=True" if self.norm else f"epilogue={self.epilogue!r}"
            raise ValueError(f"batch={v}: {what} is not built for the batched GEMV "
                             f"(epilogues: {', '.join(BATCH_EPILOGUES)}; no fused RMSNorm)")

    @norm.validator
    def _check_norm(self, attr, v):
        if v and self.qtype != "Q4_K":
            raise ValueError(f"norm=True (fused RMSNorm) is built for Q4_K, not {self.qtype}")

    @rope.validator
    def _check_rope(self, attr, v):
        if self.epilogue != "rope":
            if v:
                raise ValueError(f"rope={v!r} is for epilogue='rope', not {self.epilogue!r}")
            return
        if (len(v) != 3 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                   for n in v) or v[0] % 2 or v[0] > 512):
            raise ValueError("epilogue='rope' needs rope=(head_dim, n_q_heads, n_kv_heads): "
                             f"positive ints, head_dim even and at most 512; got {v!r}")

    @bias.validator
    def _check_bias(self, attr, v):
        if v and self.epilogue != "rope":
            raise ValueError(f"bias=True is built for epilogue='rope' (use the residual "
                             f"epilogue for a bias elsewhere), not {self.epilogue!r}")

    @rope_layout.validator
    def _check_rope_layout(self, attr, v):
        if v != "interleaved" and self.epilogue != "rope":
            raise ValueError(f"rope_layout={v!r} is for epilogue='rope', not {self.epilogue!r}")

    @paged.validator
    def _check_paged(self, attr, v):
        if v not in PAGED_BLOCKS or isinstance(v, bool):
            raise ValueError(f"paged must be 0 (a contiguous cache) or a block size in "
                             f"{', '.join(map(str, PAGED_BLOCKS[1:]))}, got {v!r}")
        if v and self.epilogue != "rope":
            raise ValueError(f"paged={v} is for epilogue='rope', not {self.epilogue!r}")

    @property
    def block_weights(self) -> int:
        return read_unit(self.qtype)[0]

    @property
    def block_bytes(self) -> int:
        return read_unit(self.qtype)[1]

    @property
    def row_bytes(self) -> int:
        return self.k // self.block_weights * self.block_bytes

    @property
    def n_mats(self) -> int:
        return 2 if self.epilogue in GATED else 1

    @property
    def rope_rows(self) -> int:
        """Rows of y (M) that ``epilogue="rope"`` expects."""
        d, nq, nkv = self.rope
        return (nq + 2 * nkv) * d


@attrs.frozen
class GemvConfig:
    """How a GEMV runs; :func:`~.tuning.select_config` picks one per device
    and shape from the tuning table.

    Parameters
    ----------
    rows : int
        Rows a CTA works on at once (one row group: their loads are in
        flight together, x is reused across them).
    pieces : int
        Q4_K: 32-weight pieces a thread owns (0 = as few as fit in 1024
        threads).  The other formats through the ring: pieces a thread (0 =
        one; a piece is 16 weights of Q6_K and of Q4_0 ... Q5_1, 8 of Q8_0,
        F16 and BF16, 32 of Q5_K).
    tile : int
        The other formats without the ring: weights per K tile (a multiple
        of the block).  With the ring the tile is the whole row.
    max_ctas : int
        Upper bound on the grid; rows per CTA grow beyond it.
    min_ctas : int
        ``.minnctapersm`` hint (0: none): ptxas limits registers so that
        many CTAs fit an SM.
    stages : int
        0: weights loaded straight into registers (Q4_K) or tile by tile
        through shared memory (Q6_K/Q8_0).  ``S >= 2``: streamed with
        ``cp.async`` through a ring of S row-group stages in dynamic shared
        memory, S - 1 groups in flight while one is computed (:mod:`.ring`).
    dot : {"fma", "dp4a"}
        How products are summed: f32 fma against dequantized weights, or
        ``dp4a`` against x split once into three byte planes (``x ~ s (x0
        2^16 + x1 2^8 + x2)``, ``s = max|x| / 4e6``: error below 2^-22.9 of
        ``max|x|``; :func:`.common.x_planes`).  Q4_K, and Q6_K, Q4_0, Q4_1,
        Q5_0, Q5_1 and Q5_K through the ring.
    ahead : int
        Ring: how many of the first ``S - 1`` row groups are issued before
        the PDL wait and x (0: all of them).
    per_sm : int
        Ring: at most this many CTAs resident on one SM (0: no cap); the
        launch asks for enough dynamic shared memory that another would not
        fit.  The kernel text is the same.
    bulk : bool
        Ring, sm_90+: one thread fills each stage with the bulk copy engine
        (``cp.async.bulk``) onto the stage's mbarrier.
    interleave : bool
        Ring: CTA ``c`` of ``n`` takes row groups ``c, c + n, ...`` instead
        of consecutive rows.
    kslices : int
        The batched GEMV: K in this many equal slices, one after the other
        (x of one slice in shared memory at a time; each slice's sums added
        to y), so that many rows of x fit at a large K.
    teams : int
        The batched GEMV: teams of threads, each the threads of one K slice,
        sharing x in shared memory; a row group's ``rows`` are dealt out
        ``rows / teams`` to a team (more warps per copy of x).
    """

    rows: int = attrs.field(default=4, validator=_int_in(1, 16, pow2=True))
    pieces: int = attrs.field(default=0, validator=_int_in(0, 8))
    tile: int = attrs.field(default=2048, validator=_int_in(1, 1 << 20))
    max_ctas: int = attrs.field(default=1056, validator=_int_in(1, 1 << 20))
    min_ctas: int = attrs.field(default=0, validator=_int_in(0, 32))
    stages: int = attrs.field(default=0, validator=_int_in(2, 8, zero=True))
    dot: str = attrs.field(default="fma", validator=_in("dot", ("fma", "dp4a")))
    ahead: int = attrs.field(default=0, validator=_int_in(0, 7))
    per_sm: int = attrs.field(default=0, validator=_int_in(0, 32))
    bulk: bool = attrs.field(default=False, validator=_bool)
    interleave: bool = attrs.field(default=False, validator=_bool)
    kslices: int = attrs.field(default=1, validator=_int_in(1, 16))
    teams: int = attrs.field(default=1, validator=_int_in(1, 8, pow2=True))


SPEC_FIELDS = tuple(f.name for f in attrs.fields(GemvSpec))
CONFIG_FIELDS = tuple(f.name for f in attrs.fields(GemvConfig))


@attrs.frozen(init=False)
class GemvPlan(PlanBase):
    """A spec and a config resolved into the one kernel the builders emit:
    every field of both, checked together (a config a spec cannot take is
    refused here, with the reason).  Make one with ``GemvPlan(spec,
    config)``, :meth:`make` or :func:`~.plan`.  Spec and config fields given
    as keywords replace theirs, so ``attrs.evolve(plan, rows=2)`` works."""

    spec: GemvSpec
    config: GemvConfig

    SPEC, CONFIG, WHAT = GemvSpec, GemvConfig, "GEMV"
    SPEC_PROPS = ("block_weights", "block_bytes", "row_bytes", "n_mats", "rope_rows")

    @classmethod
    def make(cls, qtype: str, k: int, epilogue: str = "none", **fields) -> "GemvPlan":
        """A plan from spec and config fields given side by side (fields not
        given take the spec's and the config's defaults, not the tuned ones)."""
        s, c = cls.split_fields({**fields, "epilogue": epilogue})
        return cls(GemvSpec(qtype, k, **s), GemvConfig(**c))

    def _check(self):
        sp, c = self.spec, self.config
        if sp.batch > 1:
            return self._check_batched()
        for knob in ("kslices", "teams"):
            if getattr(c, knob) != 1:
                raise ValueError(f"{knob}={getattr(c, knob)} is for the batched GEMV "
                                 f"(batch >= 2)")
        bs = sp.block_weights
        if c.tile % bs:
            raise ValueError(f"tile must be a positive multiple of {bs}, got {c.tile!r}")
        if c.dot == "dp4a" and not (sp.qtype == "Q4_K" or (sp.qtype in DP4A_RING and c.stages)):
            raise ValueError(f"dot='dp4a' is built for Q4_K and for {', '.join(DP4A_RING)} "
                             f"through the ring (stages >= 2), not {sp.qtype}"
                             f"{'' if c.stages else ' without it'}")
        if c.pieces > 1 and sp.qtype != "Q4_K" and not c.stages:
            raise ValueError(f"pieces={c.pieces} for {sp.qtype} is built for the ring "
                             "(stages >= 2); tile by tile a thread owns one piece")
        if c.stages and sp.qtype != "Q4_K":
            lay = staged_layout(self)
            rb = sp.row_bytes
            if lay["tiles"] != 1 or (c.rows * rb) % 16 or (c.bulk and rb % 16):
                raise ValueError(f"stages > 0 for {sp.qtype} needs one tile per row "
                                 f"(tile >= K={sp.k}) and row groups of whole 16-byte chunks "
                                 f"({c.rows} rows of {rb} bytes)"
                                 + ("; bulk copies need 16-byte aligned rows"
                                    if c.bulk and rb % 16 else ""))
        if c.ahead and not c.ahead < c.stages:
            raise ValueError(f"ahead={c.ahead} needs a ring of more than {c.ahead} stages "
                             f"(stages={c.stages})")
        for knob, on, what in (("bulk", c.bulk, "fills the ring with the bulk copy engine"),
                               ("interleave", c.interleave, "deals the ring's row groups"),
                               ("per_sm", c.per_sm, "caps a ring's CTAs per SM")):
            if on and not c.stages:
                raise ValueError(f"{knob}={on} {what} (stages >= 2); it needs stages")
        if c.bulk and not has_bulk_copy(sp.target):
            raise ValueError(f"bulk=True needs the bulk copy engine of sm_90 or newer, "
                             f"not {sp.target}")
        if sp.epilogue == "rope" and c.rows % 2:
            raise ValueError(f"epilogue='rope' rotates row pairs within a row group: rows "
                             f"must be even, got {c.rows}")
        ring, static = self.ring_bytes, (self.ring_static_bytes if c.stages else 0)
        if ring + static > MAX_RING_BYTES:
            raise ValueError(f"stages={c.stages} x rows={c.rows} x {sp.n_mats} matrices of "
                             f"{sp.row_bytes}-byte rows need {ring} bytes of shared memory, "
                             f"{ring + static} with the kernel's static arrays (at most "
                             f"{MAX_RING_BYTES})")
        if c.per_sm:
            try:
                TARGETS[sp.target].capped_shared(c.per_sm, self.ring_bytes)
            except ValueError as e:
                raise ValueError(f"per_sm={c.per_sm}: {e}") from None

    def _check_batched(self):
        sp, c = self.spec, self.config
        B = sp.batch
        if not c.stages or c.dot != "dp4a":
            raise ValueError(f"batch={B}: the batched GEMV streams its weights through the "
                             f"ring (stages >= 2) and sums with dp4a against byte planes of "
                             f"x (dot='dp4a'); got stages={c.stages}, dot={c.dot!r}")
        for knob, on in (("bulk", c.bulk), ("ahead", c.ahead)):
            if on:
                raise ValueError(f"batch={B}: {knob}={on} is not built for the batched GEMV")
        if c.rows % c.teams:
            raise ValueError(f"batch={B}: rows={c.rows} are dealt out to teams={c.teams}: "
                             f"rows must be a multiple of teams")
        n = c.kslices
        if sp.k % (n * sp.block_weights) or (sp.row_bytes // n) % 16 or \
                sp.k // n % BATCH_PIECES[sp.qtype][0]:
            raise ValueError(f"batch={B}: the batched GEMV copies 16-byte chunks of whole "
                             f"pieces; {sp.qtype} rows of K={sp.k} ({sp.row_bytes} bytes) "
                             f"do not split into kslices={n} such slices")
        if n > 1 and sp.epilogue == "swiglu":
            raise ValueError(f"batch={B}: kslices={n} adds each slice's sums to y; the "
                             f"swiglu epilogue needs whole sums (kslices=1)")
        lay = batch_layout(self)
        need = self.ring_bytes + lay["x_bytes"] + self.ring_static_bytes
        limit = batch_shared_limit(sp.target)
        if need > limit:
            raise ValueError(f"batch={B}: x of {B} rows of K={sp.k} ({lay['x_bytes']} bytes) "
                             f"and stages={c.stages} x rows={c.rows} x {sp.n_mats} matrices "
                             f"of {sp.row_bytes}-byte rows need {need} bytes of shared "
                             f"memory with the static arrays, more than the {limit} a CTA "
                             f"has on {sp.target}: fewer rows of x a launch, more "
                             f"kslices, or a smaller ring")
        if c.per_sm:
            try:
                TARGETS[sp.target].capped_shared(c.per_sm, self.ring_bytes + lay["x_bytes"])
            except ValueError as e:
                raise ValueError(f"per_sm={c.per_sm}: {e}") from None

    @property
    def ring_bytes(self) -> int:
        """Dynamic shared memory of the ``stages`` ring (0 without one)."""
        return self.stages * self.n_mats * self.rows * self.row_bytes // self.kslices

    @property
    def batch_slots(self) -> int:
        """The batched GEMV's per-warp reduction slots: ``n_mats * rows /
        teams * batch`` sums, rounded up to a power of two."""
        n = self.n_mats * self.rows // self.teams * self.batch
        return 1 << (n - 1).bit_length()

    @property
    def ring_static_bytes(self) -> int:
        """Static shared memory in front of the ring: the reduction array
        (:func:`.common.declare_params`) and with ``bulk`` the stages'
        mbarriers, padded to the line the ring starts on."""
        if self.batch > 1:
            red = 4 * (threads(self) // 32) * self.batch_slots
        else:
            red = 4 * (threads(self) // 32) * (self.n_mats * self.rows + self.norm)
        return -(-(red + (8 * self.stages if self.bulk else 0)) // SHARED_LINE) * SHARED_LINE

    @property
    def x_bytes(self) -> int:
        """The batched GEMV's x in shared memory, after the ring (0 at ``batch=1``)."""
        return batch_layout(self)["x_bytes"] if self.batch > 1 else 0

    @property
    def dynamic_shared(self) -> int:
        """Dynamic shared memory a launch asks for: the ring (and the
        batched GEMV's x), raised with ``per_sm`` so that no more than
        ``per_sm`` CTAs fit on one SM."""
        need = self.ring_bytes + self.x_bytes
        if not self.per_sm:
            return need
        return TARGETS[self.target].capped_shared(self.per_sm, need)

    @property
    def kernel_name(self) -> str:
        """The PTX entry's name: the spec and every config field that changes
        the kernel's text and is not at its default (``max_ctas`` and
        ``per_sm`` shape only the launch).  The target and ``pdl`` are left
        out: the executor sets ``pdl`` for the device after naming launches."""
        epi = "" if self.epilogue == "none" else "_" + self.epilogue
        if self.batch > 1:
            tail = ("_il" if self.interleave else "") + (f"_p{self.pieces}" if self.pieces else "")
            tail += f"_c{self.min_ctas}" if self.min_ctas else ""
            tail += f"_x{self.kslices}" if self.kslices > 1 else ""
            tail += f"_t{self.teams}" if self.teams > 1 else ""
            return (f"gemv_{self.qtype.lower()}_k{self.k}{epi}_b{self.batch}_r{self.rows}"
                    f"_s{self.stages}{tail}")
        if self.rope:
            epi += "{}h{}x{}".format(*self.rope) + ("_bias" if self.bias else "")
            epi += "_neox" if self.rope_layout == "neox" else ""
            epi += f"_paged{self.paged}" if self.paged else ""
        st = (f"_s{self.stages}" if self.stages else "") + (f"a{self.ahead}" if self.ahead else "")
        dp = ("_dp4a" if self.dot == "dp4a" else "") + ("_bulk" if self.bulk else "")
        dp += "_il" if self.interleave else ""
        if self.pieces:
            dp += f"_p{self.pieces}"
        if self.qtype != "Q4_K" and self.tile < self.k:
            dp += f"_t{self.tile}"
        if self.min_ctas:
            dp += f"_c{self.min_ctas}"
        nm = ("_normh" if self.norm_out else "_norm") if self.norm else ""
        return (f"gemv_{self.qtype.lower()}_k{self.k}{nm}{epi}"
                f"_r{self.rows}{st}{dp}")
