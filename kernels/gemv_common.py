"""Shared parts of the quantized GEMV kernels: spec, geometry, epilogues, references.

``y = W @ x`` with ``W`` an ``[M, K]`` matrix stored as GGUF rows of
quantized blocks (``uint8 [M, row_bytes]``), ``x`` and ``y`` float32.  One
spec class, :class:`GemvSpec`, covers every format and epilogue; the
format-specific builders live in :mod:`gemv_q4k` (Q4_K, direct 16-byte
loads) and :mod:`gemv_staged` (Q6_K and Q8_0, staged through shared memory).

Kernel parameters, in order::

    w      u8*   weights (gate weights for swiglu)
    wu     u8*   up weights                      (swiglu only)
    x      f32*  activations, K values
    r      f32*  residual, M values              (residual only)
    y      f32*  output, M values
    m      u32   rows
    rpc    u32   rows per CTA (a multiple of ``spec.rows``; see launch_geometry)

(``norm`` adds ``nw, eps`` after ``x``; ``rope`` replaces ``r`` with its
table, position and caches: :func:`declare_params`.)  Launch: ``grid =
ceil(M / rpc)`` CTAs of ``threads(spec)`` threads, with the ring's
dynamic shared memory (:func:`launch_geometry`).
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from ptxgen.target import MAX_STATIC_SHARED, SHARED_LINE, TARGETS
from ptxgen.types import f16, f32, s32, u8, u32

from .spec_fields import has_bulk_copy, pdl_field, target_field

__all__ = ["GemvSpec", "QTYPE_INFO", "EPILOGUES", "check_k", "threads",
           "launch_geometry", "reference", "rope_reference",
           "RopeArgs", "warp_sum", "silu_times", "write_outputs", "XFULL",
           "PLANE_W", "PLANE_SIGNED", "plane_inverse", "x_planes"]

#: qtype -> (weights per block, bytes per block)
QTYPE_INFO = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q8_0": (32, 34)}
EPILOGUES = ("none", "residual", "swiglu", "rope")
LOG2E = 1.4426950408889634


def check_k(qtype: str, k: int) -> None:
    """Raise ValueError unless ``k`` is a positive multiple of ``qtype``'s block."""
    if qtype not in QTYPE_INFO:
        raise ValueError(f"unsupported qtype {qtype!r}; supported: {', '.join(QTYPE_INFO)}")
    bs = QTYPE_INFO[qtype][0]
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0 or k % bs:
        raise ValueError(f"{qtype} GEMV: K={k!r} is not a positive multiple of the "
                         f"{qtype} block size ({bs} weights)")


def _check_k_field(inst, attr, value):
    check_k(inst.qtype, value)


def _pos_pow2(lo, hi):
    def check(inst, attr, v):
        if not isinstance(v, int) or not lo <= v <= hi or v & (v - 1):
            raise ValueError(f"{attr.name} must be a power of two in {lo}..{hi}, got {v!r}")
    return check


#: dynamic shared memory a CTA may ask for on sm_80/sm_90 (the ring's limit)
MAX_RING_BYTES = 227 * 1024


@attrs.frozen
class GemvSpec:
    """A quantized GEMV kernel.

    Parameters
    ----------
    qtype : {"Q4_K", "Q6_K", "Q8_0"}
        Weight format.
    k : int
        Row length (a multiple of the block: 256, or 32 for Q8_0).  It is a
        build-time constant so loops over K unroll; M is a launch argument.
    epilogue : {"none", "residual", "swiglu", "rope"}
        ``y = W x``; ``y = W x + r``; ``y = silu(Wg x) * (Wu x)``; or, for
        the stacked ``[Wq; Wk; Wv]`` projection of a decode step, ``y = W
        x`` with RoPE applied to its q and k rows and this token's k and v
        rows appended to an f16 KV cache (:func:`rope_kv_outputs`; needs
        ``rope`` and an even ``rows``).
    rope : tuple
        ``(head_dim, n_q_heads, n_kv_heads)`` with ``epilogue="rope"``
        (else empty): ``y`` holds ``n_q_heads`` query heads, then
        ``n_kv_heads`` key heads, then as many value heads, of
        ``head_dim`` rows each (M = ``(n_q_heads + 2 n_kv_heads) *
        head_dim``).
    rows : int
        Rows a CTA works on at once (their loads are all in flight together;
        x is reused across them).
    pieces : int
        Q4_K: 32-weight pieces each thread owns (0 = as few as fit in 1024
        threads).  Q6_K/Q8_0 (16- and 8-weight pieces): through the ring
        (``stages``) only, 0 meaning one a thread.
    tile : int
        Staged formats: weights per K tile (a multiple of the block).
    load_width : int
        Bytes per global load when staging (16, 8, 4 or 2; 0 = widest the
        row and tile alignment allow).  Q4_K always loads 16 bytes.
    prefetch : bool
        Q4_K: load the next row group while computing this one (software
        pipelining through loop-carried registers).
    stage : bool
        Q4_K: park each row group's weight loads in shared memory (every
        thread its own qs slot, headers once per super-block) behind a
        ``bar.sync``, so the whole group is in flight without holding
        registers (otherwise ptxas interleaves the loads with the math,
        1-3 in flight per thread).  One piece per thread only.
    early : bool
        Q4_K: issue the first row group's weight loads before loading x.
    l2_prefetch : bool
        Q4_K: ``.L2::256B`` prefetch-size hint on the weight loads.
    xmode : {"reg", "shared", "global"}
        Q4_K: where a thread keeps its pieces' 32 x values between row
        groups: registers (loaded once); its own slots of a static shared
        array (written once, K <= 12288); or re-read from global memory
        (``ld.global.nc``, L1 hits after the first group).  "shared" and
        "global" free ~32 registers per piece and walk the rows inside the
        4-value x chunk (one shared/L1 load per chunk for every row).
    min_ctas : int
        ``.minnctapersm`` hint (0: none): ptxas limits registers so that
        many CTAs fit on an SM.
    max_ctas : int
        Upper bound on the grid; rows per CTA grow beyond it (x is loaded
        once per CTA).
    norm : bool
        Q4_K, ``xmode="reg"``: RMSNorm of x fused in front of the product,
        ``y = W (x / sqrt(mean(x^2) + eps) * nw)`` (then the epilogue).  The
        kernel takes ``nw`` (f32 [K]) and ``eps`` (f32) after ``x``; each
        thread multiplies its x values by ``nw`` as it loads them and sums
        their squares; the squares are reduced with every row group's
        partials (no extra barrier) and the row sums scaled by
        ``1/sqrt.rn(mean + eps)`` before the epilogue.
    slices : int
        Q4_K (K <= 12288): the CTA is ``slices`` independent groups of
        threads (each as wide as K needs) that share one copy of x: x is
        read from global memory once per CTA into shared memory, then each
        thread takes its 32 values from there; slice ``j`` works on row
        groups ``j, j + slices, ...`` of the CTA's rows (the slices reduce
        side by side behind the CTA's barriers).  More slices: fewer CTAs
        reading x from L2 per weight byte.
    target : str
        ``sm_80`` ... ``sm_90a``.
    pdl : bool
        Programmatic dependent launch (sm_90+): Q4_K issues its first row
        group's weight loads before ``griddepcontrol.wait`` (with ``early``).
    stages : int
        0 loads weights straight into registers (Q4_K) or tile by tile
        (Q6_K/Q8_0); ``S >= 2`` streams them with ``cp.async`` through a ring
        of S row-group stages in dynamic shared memory (``S * rows *
        row_bytes`` bytes per matrix), S - 1 groups in flight while one is
        computed (:mod:`gemv_stream`).  ``xmode="reg"``, one slice, no
        prefetch/stage/norm; Q6_K/Q8_0 also need ``tile >= K`` and rows of
        a multiple of 16 bytes.
    dot : {"fma", "dp4a"}
        Q4_K, ``xmode="reg"``: how a piece's 32 products are summed.
        "fma": each nibble becomes the f32 ``1 + q/16`` (one ``prmt``) and
        meets its x in an f32 fma, two instructions per weight.  "dp4a": each
        thread splits its 32 x values once into three byte planes, ``x ~
        s (x0 2^16 + x1 2^8 + x2)`` with ``s = max|x| / 4e6`` (error below
        2^-22.9 of ``max|x|``; :func:`x_planes`, about 3.5 instructions a
        value), and a 32-bit word of four nibbles meets each plane in one
        ``dp4a``; the three exact integer sums are combined and converted
        once per half piece (the high nibbles are used in place, as 16 q).
        Three ``dp4a`` and one mask per four weights, and a sub-block pair's
        scales gathered with two ``prmt``: ptxas (sm_90) emits 106
        instructions per thread and row at K = 4096 (32 weights and the
        row's share of the reduction), 112 before the decode was rewritten
        (docs/gemv.md, thirteenth pass).  Q6_K through the ring: each run
        of four 6-bit q becomes the signed bytes ``4 (q - 32)`` against the
        same planes, the 16-weight scale applied in s32 (docs/gemv.md,
        twenty-fifth pass).
    ahead : int
        Ring (``stages >= 2``): how many of the first ``S - 1`` row groups are
        issued before the PDL wait and the x loads; the rest go out once the
        thread holds its x.  0 (default): all ``S - 1``.  Fewer lets thread
        0 reach the wait, and x be requested, before the memory system is
        full of this CTA's weight copies.
    bulk : bool
        Ring, sm_90+: one thread fills each stage with the bulk copy engine
        (``cp.async.bulk``, one copy per matrix of the row group's contiguous
        bytes) completing on the stage's mbarrier, which every thread waits
        on, instead of every thread copying 16-byte chunks with ``cp.async``.
    interleave : bool
        Ring: CTA ``c`` of ``n`` takes row groups ``c, c + n, c + 2 n, ...``
        (every CTA's stream in the same moving window of the matrix) instead
        of ``rows_per_cta`` consecutive rows; the grid is the same.
    per_sm : int
        Ring: at most this many CTAs resident on one SM (0: as many as
        registers and the ring allow).  The launch asks for enough dynamic
        shared memory (:attr:`dynamic_shared`) that a further CTA would not
        fit; the kernel text is the same.  A grid launched while an earlier
        kernel drains fills the freed SMs first, so without a cap the CTAs
        pile onto a few SMs and the last of them finish late.
    """

    qtype: str = attrs.field(validator=attrs.validators.in_(tuple(QTYPE_INFO)))
    k: int = attrs.field(validator=_check_k_field)
    epilogue: str = attrs.field(default="none", validator=attrs.validators.in_(EPILOGUES))
    rows: int = attrs.field(default=4, validator=_pos_pow2(1, 16))
    pieces: int = attrs.field(default=0)
    tile: int = attrs.field(default=2048)
    load_width: int = attrs.field(default=0, validator=attrs.validators.in_((0, 2, 4, 8, 16)))
    max_ctas: int = attrs.field(default=1056)
    prefetch: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    stage: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    early: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    l2_prefetch: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    xmode: str = attrs.field(default="reg", validator=attrs.validators.in_(("reg", "shared", "global")))
    min_ctas: int = attrs.field(default=0)
    norm: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    slices: int = attrs.field(default=1, validator=_pos_pow2(1, 8))
    target: str = target_field()
    pdl: bool = pdl_field()
    stages: int = attrs.field(default=0)
    dot: str = attrs.field(default="fma", validator=attrs.validators.in_(("fma", "dp4a")))
    ahead: int = attrs.field(default=0)
    per_sm: int = attrs.field(default=0)
    rope: tuple = attrs.field(default=(), converter=tuple)
    bulk: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    interleave: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @dot.validator
    def _check_dot(self, attr, v):
        if v == "dp4a" and not ((self.qtype == "Q4_K" and self.xmode == "reg")
                                or (self.qtype == "Q6_K" and self.stages)):
            raise ValueError("dot='dp4a' is built for Q4_K with xmode='reg' and for Q6_K "
                             "through the ring (stages >= 2)")

    @stages.validator
    def _check_stages(self, attr, v):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v == 1 or v > 8:
            raise ValueError(f"stages must be 0 (direct loads) or 2..8, got {v!r}")
        if v and (self.xmode != "reg" or self.slices > 1 or self.prefetch or self.stage):
            raise ValueError("stages > 0 (cp.async ring) is built for xmode='reg', "
                             "one slice, no prefetch/stage")
        if v and self.qtype != "Q4_K":
            from .gemv_staged import staged_layout
            lay = staged_layout(self)
            if lay["tiles"] != 1 or self.row_bytes % 16:
                raise ValueError(f"stages > 0 for {self.qtype} needs one tile per row "
                                 f"(tile >= K={self.k}) and 16-byte aligned rows "
                                 f"({self.row_bytes} bytes)")
        ring = self.ring_bytes
        static = self.ring_static_bytes if v else 0
        if ring + static > MAX_RING_BYTES:
            raise ValueError(f"stages={v} x rows={self.rows} x {self.n_mats} matrices of "
                             f"{self.row_bytes}-byte rows need {ring} bytes of shared memory, "
                             f"{ring + static} with the kernel's static arrays (at most "
                             f"{MAX_RING_BYTES})")

    @ahead.validator
    def _check_ahead(self, attr, v):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"ahead must be a non-negative int, got {v!r}")
        if v and not v < self.stages:
            raise ValueError(f"ahead={v} needs a ring of more than {v} stages "
                             f"(stages={self.stages})")

    def _ring_only(self, knob, what):
        """Refuse ``knob=True`` (which ``what``) without the ring."""
        if not self.stages:
            raise ValueError(f"{knob}=True {what} (stages >= 2); it needs stages")

    @bulk.validator
    def _check_bulk(self, attr, v):
        if v:
            self._ring_only("bulk", "fills the ring with the bulk copy engine")
        if v and not has_bulk_copy(self.target):
            raise ValueError(f"bulk=True needs the bulk copy engine of sm_90 or newer, "
                             f"not {self.target}")

    @interleave.validator
    def _check_interleave(self, attr, v):
        if v:
            self._ring_only("interleave", "deals the ring's row groups")

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
        if self.rows % 2:
            raise ValueError(f"epilogue='rope' rotates row pairs within a row group: rows "
                             f"must be even, got {self.rows}")

    @per_sm.validator
    def _check_per_sm(self, attr, v):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 32:
            raise ValueError(f"per_sm must be 0..32, got {v!r}")
        if v and not self.stages:
            raise ValueError("per_sm caps a ring's CTAs per SM: it needs stages >= 2")
        if v:
            try:
                TARGETS[self.target].capped_shared(v, self.ring_bytes)
            except ValueError as e:
                raise ValueError(f"per_sm={v}: {e}") from None

    @slices.validator
    def _check_slices(self, attr, v):
        if v > 1 and (self.qtype != "Q4_K" or self.xmode != "reg" or self.prefetch
                      or self.stage):
            raise ValueError("slices > 1 is built for Q4_K with xmode='reg', no prefetch/stage")
        if v > 1 and 4 * self.k > MAX_STATIC_SHARED:
            raise ValueError(f"slices > 1 keeps x ({4 * self.k} bytes) in static shared "
                             f"memory: K must be at most {MAX_STATIC_SHARED // 4}, got {self.k}")

    @norm.validator
    def _check_norm(self, attr, v):
        if v and (self.qtype != "Q4_K" or self.xmode != "reg"):
            raise ValueError(f"norm=True (fused RMSNorm) is built for Q4_K with xmode='reg', "
                             f"not {self.qtype} xmode={self.xmode!r}")

    @pieces.validator
    def _check_pieces(self, attr, v):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > 8:
            raise ValueError(f"pieces must be 0..8, got {v!r}")
        if v > 1 and self.qtype != "Q4_K" and not self.stages:
            raise ValueError(f"pieces={v} for {self.qtype} is built for the ring (stages >= 2); "
                             "tile by tile a thread owns one piece")

    @tile.validator
    def _check_tile(self, attr, v):
        bs = QTYPE_INFO[self.qtype][0]
        if not isinstance(v, int) or v <= 0 or v % bs:
            raise ValueError(f"tile must be a positive multiple of {bs}, got {v!r}")

    @min_ctas.validator
    def _check_min_ctas(self, attr, v):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 32:
            raise ValueError(f"min_ctas must be 0..32, got {v!r}")

    @max_ctas.validator
    def _check_ctas(self, attr, v):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"max_ctas must be a positive int, got {v!r}")

    @property
    def block_weights(self) -> int:
        return QTYPE_INFO[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        return QTYPE_INFO[self.qtype][1]

    @property
    def row_bytes(self) -> int:
        return self.k // self.block_weights * self.block_bytes

    @property
    def ring_bytes(self) -> int:
        """Dynamic shared memory of the ``stages`` ring (0 without one)."""
        return self.stages * self.n_mats * self.rows * self.row_bytes

    @property
    def ring_static_bytes(self) -> int:
        """Static shared memory in front of the ring: the reduction array
        (:func:`declare_params`) and with ``bulk`` the stages' mbarriers,
        padded to the line the ring starts on (``target.SHARED_LINE``)."""
        red = 4 * self.slices * (threads(self) // 32) * (self.n_mats * self.rows + self.norm)
        return -(-(red + (8 * self.stages if self.bulk else 0)) // SHARED_LINE) * SHARED_LINE

    @property
    def dynamic_shared(self) -> int:
        """Dynamic shared memory a launch asks for: the ring, raised with
        ``per_sm`` so that no more than ``per_sm`` CTAs fit on one SM."""
        if not self.per_sm:
            return self.ring_bytes
        return TARGETS[self.target].capped_shared(self.per_sm, self.ring_bytes)

    @property
    def n_mats(self) -> int:
        return 2 if self.epilogue == "swiglu" else 1

    @property
    def rope_rows(self) -> int:
        """Rows of y (M) that ``epilogue="rope"`` expects."""
        d, nq, nkv = self.rope
        return (nq + 2 * nkv) * d

    @property
    def kernel_name(self) -> str:
        """The PTX entry's name: every knob that changes the kernel's text
        and is not at its default (``max_ctas`` and ``per_sm`` shape only
        the launch), so that profiles and timelines tell variants apart.
        The target and ``pdl`` are left out: the executor builds a graph's
        launches by name and sets ``pdl`` for the device afterwards."""
        epi = "" if self.epilogue == "none" else "_" + self.epilogue
        if self.rope:
            epi += "{}h{}x{}".format(*self.rope)
        st = (f"_s{self.stages}" if self.stages else "") + (f"a{self.ahead}" if self.ahead else "")
        dp = ("_dp4a" if self.dot == "dp4a" else "") + ("_bulk" if self.bulk else "")
        dp += "_il" if self.interleave else ""
        if self.pieces:
            dp += f"_p{self.pieces}"
        if self.qtype != "Q4_K" and self.tile < self.k:
            dp += f"_t{self.tile}"
        if self.qtype != "Q4_K" and self.load_width:
            dp += f"_w{self.load_width}"
        if self.slices > 1:
            dp += f"_sl{self.slices}"
        if self.qtype == "Q4_K" and not self.stages:
            # read by the direct Q4_K kernel only
            if self.xmode != "reg":
                dp += f"_x{self.xmode}"
            dp += ("_pf" if self.prefetch else "") + ("_st" if self.stage else "")
            dp += ("_e" if self.early else "") + ("_l2" if self.l2_prefetch else "")
        if self.min_ctas:
            dp += f"_c{self.min_ctas}"
        return (f"gemv_{self.qtype.lower()}_k{self.k}{'_norm' if self.norm else ''}{epi}"
                f"_r{self.rows}{st}{dp}")


def threads(spec: GemvSpec) -> int:
    """Threads per CTA slice (the CTA has ``spec.slices`` of them)."""
    if spec.qtype == "Q4_K":
        from .gemv_q4k import q4k_layout
        return q4k_layout(spec)[1]
    from .gemv_staged import staged_layout
    return staged_layout(spec)["threads"]


def warp_threads(pieces: int, per_thread: int) -> int:
    """Threads for ``pieces`` pieces at ``per_thread`` a thread, rounded up
    to whole warps (at least one)."""
    return max(32, math.ceil(math.ceil(pieces / per_thread) / 32) * 32)


def groups_per_cta(m: int, unit: int, max_ctas: int) -> int:
    """Row groups of ``unit`` rows each CTA takes when ``m`` rows are dealt
    out over at most ``max_ctas`` CTAs (``launch_geometry``'s split)."""
    return math.ceil(math.ceil(m / unit) / max_ctas)


def launch_geometry(spec: GemvSpec, m: int):
    """``(grid, block, shared_bytes, rows_per_cta)`` for ``m`` rows
    (``shared_bytes``: :attr:`GemvSpec.dynamic_shared`, the ``stages`` ring
    and any ``per_sm`` cap).

    ``rows_per_cta`` is the kernel's last argument: the smallest multiple of
    ``spec.rows * spec.slices`` that keeps the grid within ``spec.max_ctas``.
    """
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"M must be a positive int, got {m!r}")
    unit = spec.rows * spec.slices
    rpc = groups_per_cta(m, unit, spec.max_ctas) * unit
    grid = math.ceil(m / rpc)
    return (grid, 1, 1), (threads(spec) * spec.slices, 1, 1), spec.dynamic_shared, rpc


def declare_params(k, spec, warps):
    """The GEMV kernel signature, shared by every weight format:
    ``w, [wu], x, [nw, eps], [r | freqs, pos_ptr, k_cache, v_cache,
    capacity], y, m, rpc`` (``wu`` with the SwiGLU epilogue, ``nw``/``eps``
    with ``norm``, ``r`` with the residual epilogue, the RoPE table, the
    device position and the f16 caches with the rope epilogue; the decode
    graph and ops pass arguments in this order), plus the ``red`` shared
    array :func:`write_outputs` reduces in.

    Returns ``(ws, x, r, y, m, rpc, red, norm)``; ``norm`` is ``(nw, eps)``
    or None; ``r`` is the residual pointer, the rope epilogue's
    :class:`RopeArgs`, or None.
    """
    ws = [k.param_ptr("w", u8, align=16)]
    if spec.n_mats == 2:
        ws.append(k.param_ptr("wu", u8, align=16))
    x = k.param_ptr("x", f32, align=16)
    norm = (k.param_ptr("nw", f32, align=16), k.param("eps", f32)) if spec.norm else None
    r = None
    if spec.epilogue == "residual":
        r = k.param_ptr("r", f32)
    elif spec.epilogue == "rope":
        r = RopeArgs(k.param_ptr("freqs", f32, align=8), k.param_ptr("pos_ptr", s32),
                     k.param_ptr("k_cache", f16, align=2), k.param_ptr("v_cache", f16, align=2),
                     k.param("capacity", u32))
    y = k.param_ptr("y", f32)
    mrows = k.param("m", u32)
    rpc = k.param("rpc", u32)
    red = k.shared_array("red", f32, spec.slices * warps * (spec.n_mats * spec.rows + spec.norm),
                         align=16)
    return ws, x, r, y, mrows, rpc, red, norm


@attrs.frozen
class RopeArgs:
    """The rope epilogue's kernel parameters: the ``[head_dim / 2, 2]`` (hi,
    lo) inverse-frequency table of :func:`kernels.rope.freq_table`, the
    device int32 position, the f16 caches ``[n_kv_heads, capacity,
    head_dim]`` and their capacity."""
    freqs: object
    pos_ptr: object
    k_cache: object
    v_cache: object
    capacity: object


def warp_sum(k, v):
    """Butterfly sum of an f32 over the 32 lanes (every lane gets the total)."""
    for off in (16, 8, 4, 2, 1):
        v = v + k.shfl_xor(v, off)
    return v


#: ``dot="dp4a"``: x is held as the integer ``T = round(x / s)``, ``|T| <=
#: XFULL``, ``s = max|x| / XFULL``, in three byte planes ``T = x0 2^16 + x1
#: 2^8 + x2`` (``x0`` signed, ``x1`` and ``x2`` the unsigned bytes of ``T``)
XFULL = 4.0e6
#: the planes' weights (planes 0 and 1; plane 2 has 1) and signedness
PLANE_W = (65536, 256)
PLANE_SIGNED = (True, False, False)
_ROUND = 12582912.0         # 1.5 * 2^23: x + _ROUND - _ROUND rounds |x| < 2^22


def plane_inverse(k, vals):
    """``(max|x|, XFULL / max|x|)`` over ``vals`` for :func:`x_planes`; the
    inverse is 0 where every value is 0 (a piece past K), not inf."""
    amax = k.abs(vals[0])
    for v in vals[1:]:
        amax = k.max(amax, k.abs(v))
    some = amax > 0.0
    inv = k.select(some, k.div(XFULL, amax, approx=False), k.mov(0.0, f32))
    return amax, inv


def x_planes(k, vals, inv):
    """Split f32 values into the three byte planes of ``dp4a`` (``XFULL``):
    ``x = (x0 2^16 + x1 2^8 + x2) / inv`` to half a unit, 2^-22.9 of
    ``max|x|`` (:func:`plane_inverse`).  Returns ``planes[p][w]``: plane
    ``p``'s bytes of values ``4w .. 4w + 3`` as one word.

    One ``fma`` a value: ``x inv + 1.5 2^23`` rounds ``x inv`` to the
    nearest integer ``T`` (ties to even) and holds ``0x4B400000 + T``, whose
    bytes 0 and 1 are those of ``T`` and byte 2 is ``(T >> 16) + 64`` (2..125
    for ``|T| <= 4e6 + 1``).  Seven ``prmt`` gather the three bytes of four
    values; plane 0 is byte 2 less 64 as an int8 (``v ^ 0x40``, with bit 6
    copied into bit 7)."""
    words = [[], [], []]
    for w in range(len(vals) // 4):
        b = [k.fma(v, inv, _ROUND).bitcast(u32) for v in vals[4 * w:4 * w + 4]]
        lo = k.prmt(b[0], b[1], 0x5140)         # [b0.0, b1.0, b0.1, b1.1]
        hi = k.prmt(b[2], b[3], 0x5140)
        words[2].append(k.prmt(lo, hi, 0x5410))
        words[1].append(k.prmt(lo, hi, 0x7632))
        top = k.prmt(k.prmt(b[0], b[1], 0x0062), k.prmt(b[2], b[3], 0x0062), 0x5410) ^ 0x40404040
        words[0].append(top + ((top & 0x40404040) << 1))
    return words


def silu_times(k, g, u):
    """``silu(g) * u = g * u / (1 + 2^(-g log2 e))`` (ex2.approx, div.rn)."""
    e = k.ex2(g * (-LOG2E))
    return (g * u) / (e + 1.0)


def write_outputs(k, spec, acc, red, warps, row0, row_end, y, r, tid, norm=None, slice_=None,
                  trailing_barrier=True):
    """Reduce per-thread partials ``acc[mat][row]`` over the CTA and store.

    Each warp folds its lanes with shuffles; lane 0 writes the warp's sums to
    the shared array ``red`` ([warps, mats*rows]); after a barrier thread
    ``i < rows`` adds the warps' values for row ``row0 + i``, applies the
    epilogue and stores it if the row is below ``row_end``.  A second
    barrier lets ``red`` be reused.

    ``norm`` (fused RMSNorm): the CTA's ``1/sqrt(mean(x^2) + eps)`` from
    :func:`norm_scale`, a register; the storing threads multiply the row
    sums by it.

    ``slice_`` (a register, with ``spec.slices > 1``): ``tid`` is the thread's
    index in its slice and the slice uses its own part of ``red``; the
    barriers are the whole CTA's (every slice runs the same number of row
    groups: ``rpc`` is a multiple of ``rows * slices``).

    ``trailing_barrier=False`` leaves out the second barrier, for a caller
    whose loop passes another barrier before ``red`` is written again.
    """
    nm, R = spec.n_mats, spec.rows
    lane = tid & 31
    warp = tid >> 5
    sums = [[warp_sum(k, acc[mi][i]) for i in range(R)] for mi in range(nm)]
    # the slice's part of red
    sbase = _red_slice_base(spec, warps, slice_)

    def slot(i):
        return red[i if sbase is None else sbase + i]

    if spec.epilogue == "rope":
        # the angle's inputs first, so their latency overlaps the reduction
        ropein = _rope_inputs(k, spec, r, row0 + tid, tid)
    with k.if_(lane.eq(0)):
        base = warp * (nm * R)
        for mi in range(nm):
            for i in range(R):
                k.st(slot(base + (mi * R + i)), sums[mi][i])
    k.bar_sync(0)
    row = row0 + tid
    ok = k.setp("lt", tid, R, combine=("and", row < row_end))
    if spec.epilogue == "rope":
        _rope_kv_outputs(k, spec, slot, warps, tid, row, ok, y, r, norm, ropein)
        if trailing_barrier:
            k.bar_sync(0)
        return
    with k.if_(ok):
        tot = _row_totals(k, spec, slot, warps, tid, norm)
        if spec.epilogue == "swiglu":
            out = silu_times(k, tot[0], tot[1])
        elif spec.epilogue == "residual":
            # plain ld, not .nc: y may alias r (x += W.a) within this launch
            out = tot[0] + k.ld(r[row])
        else:
            out = tot[0]
        k.st(y[row], out)
    if trailing_barrier:
        k.bar_sync(0)


def _red_slice_base(spec, warps, slice_):
    """Where slice ``slice_``'s part of ``red`` starts (None for a CTA of one
    slice): each slice has ``warps * (n_mats * rows + norm)`` words, the
    warps' row partials and, with a fused RMSNorm, their sums of x^2
    (:func:`declare_params`' layout)."""
    if slice_ is None:
        return None
    return slice_ * (warps * (spec.n_mats * spec.rows + spec.norm))


def _row_totals(k, spec, slot, warps, tid, norm):
    """Thread ``tid``'s row sums, one per matrix, added over the warps'
    partials in ``red`` (through ``slot``) in a fixed order, and multiplied
    by ``norm`` (the fused RMSNorm's scale from :func:`norm_scale`) if given."""
    nm, R = spec.n_mats, spec.rows
    tot = []
    for mi in range(nm):
        t = k.ld(slot(tid + mi * R))
        for w in range(1, warps):
            t = t + k.ld(slot(tid + (w * nm * R + mi * R)))
        tot.append(t)
    if norm is not None:
        tot = [t * norm for t in tot]
    return tot


def norm_scale(k, spec, red, warps, norm, tid, slice_=None):
    """The fused RMSNorm's ``1/sqrt.rn(sum(x^2)/K + eps)``, computed once per
    CTA (per slice) before the row loop, or None without ``norm``.

    ``norm = (sq, eps)``: ``sq`` is the warp's sum of x squares (every lane
    holds it).  Lane 0 of each warp stores it in the norm slots of ``red``
    (after the partials :func:`write_outputs` uses, so the loop never
    overwrites them); after one barrier every thread adds the warps' sums in
    a fixed order, so every CTA gets the same bits.  (Computing it inside
    every row group's reduction put two ``div.rn`` and a ``sqrt.rn`` on the
    storing threads' path once per group.)"""
    if norm is None:
        return None
    nm, R = spec.n_mats, spec.rows
    sq, eps = norm
    base = warps * nm * R
    sbase = _red_slice_base(spec, warps, slice_)
    if sbase is not None:
        base = sbase + base
    with k.if_((tid & 31).eq(0)):
        k.st(red[base + (tid >> 5)], sq)
    k.bar_sync(0)
    tot = k.ld(red[base])
    for w in range(1, warps):
        tot = tot + k.ld(red[base + w])
    mean = k.div(tot, k.mov(float(spec.k), f32))
    return k.div(k.mov(1.0, f32), k.sqrt(mean + eps))


def _rope_inputs(k, spec, ra, row, tid):
    """Per storing thread (``tid < rows``): the head-row index ``j = row mod
    head_dim`` and the (hi, lo) inverse frequency of its pair ``j / 2``, and
    the position (loads only; every thread of warp 0 issues them)."""
    d = spec.rope[0]
    j = k.rem(row, d)
    ok = k.setp("lt", tid, spec.rows)
    hi, lo = k.ld(ra.freqs[(j >> 1) << 1], vec=2, nc=True, guard=ok)
    # plain ld: the position is advanced by the previous decode step's last grid
    pos = k.ld(ra.pos_ptr[0], guard=ok)
    return j, hi, lo, pos


def _rope_kv_outputs(k, spec, slot, warps, tid, row, ok, y, ra, norm, ropein):
    """The rope epilogue's stores for one row group (warp 0 of the slice).

    Thread ``tid < rows`` sums row ``row``; rows come in rotation pairs
    ``(2i, 2i + 1)`` of a head (the interleaved RoPE layout GGUF Llama
    weights use), so lanes ``tid`` and ``tid ^ 1`` hold a pair (rows is even
    and row groups start at multiples of it) and exchange their sums with
    one shuffle.  Query and key rows are rotated by ``pos * inv_freq[i]``
    (:func:`kernels.rope.angle_sincos`) and stored to ``y``; value rows are
    stored as they are; key and value rows are also written (``cvt.rn`` to
    f16) to ``cache[h, pos, j]`` when ``0 <= pos < capacity``.
    """
    from .rope import angle_sincos, rotate_pair
    d, nq, nkv = spec.rope
    j, hi, lo, pos = ropein
    with k.if_(tid < 32):
        t = k.var(f32, 0.0)
        with k.if_(ok):
            t.set(_row_totals(k, spec, slot, warps, tid, norm)[0])
        other = k.shfl_xor(t, 1)
        with k.if_(ok):
            odd = k.setp("ne", tid & 1, 0)
            a = k.select(odd, other, t)
            b = k.select(odd, t, other)
            s, c = angle_sincos(k, pos.to(f32), hi, lo)
            a2, b2 = rotate_pair(k, a, b, s, c)
            rot = k.select(odd, b2, a2)
            qk_rows = (nq + nkv) * d
            out = k.select(k.setp("lt", row, qk_rows), rot, t)
            k.st(y[row], out)
            # K and V rows of a position inside the cache: f16 into [h, pos, j]
            kv = row - nq * d
            pos_u = pos.bitcast(u32)
            app = k.setp("ge", row, nq * d, combine=("and", pos >= 0))
            app = k.setp("lt", pos_u, ra.capacity, combine=("and", app))
            with k.if_(app):
                is_v = k.setp("ge", kv, nkv * d)
                kvr = k.select(is_v, kv - nkv * d, kv)
                head = kvr // d
                cache = k.ptr_reg(f16)
                k.select(is_v, ra.v_cache, ra.k_cache, out=cache)
                dst = k.mad(k.mad(head, ra.capacity, pos_u), d, j)
                k.st(cache[dst], k.cvt(f16, out, rnd="rn"))


def rope_reference(y, pos: int, spec: GemvSpec, inv_freq, k_cache=None, v_cache=None):
    """float64 model of the rope epilogue applied to the plain product
    ``y`` (float64, ``spec.rope_rows``): returns the stored ``y`` (q and k
    heads rotated in the interleaved layout by ``pos * inv_freq``, v as it
    is) and, when ``0 <= pos < capacity``, writes this token's k and v rows
    into the f16 caches ``[n_kv_heads, capacity, head_dim]`` in place."""
    from .rope import rotate
    d, nq, nkv = spec.rope
    y = np.array(y, dtype=np.float64)
    if y.shape != (spec.rope_rows,):
        raise ValueError(f"y has shape {y.shape}, the rope epilogue writes {spec.rope_rows} rows")
    qk = (nq + nkv) * d
    y[:qk] = rotate(y[:qk].reshape(nq + nkv, d), pos, inv_freq, "interleaved").reshape(-1)
    if k_cache is not None and 0 <= pos < k_cache.shape[1]:
        k_cache[:, pos, :] = y[nq * d:(nq + nkv) * d].reshape(nkv, d)
        v_cache[:, pos, :] = y[(nq + nkv) * d:].reshape(nkv, d)
    return y


def reference(spec_or_qtype, w_raw, x, residual=None, w_up=None, epilogue=None,
              norm_w=None, eps=None):
    """float64 reference: gguf-dequantized weights (as float64) times x.

    Parameters
    ----------
    spec_or_qtype : GemvSpec or str
    w_raw : uint8 [M, row_bytes]
        Weights (gate weights for swiglu).
    x : float [K]
    residual : float [M], optional
    w_up : uint8 [M, row_bytes], optional
        Up weights for swiglu.
    epilogue : str, optional
        Defaults to the spec's (or "none" for a bare qtype).
    norm_w, eps : optional
        Fused RMSNorm: x is replaced by ``x / sqrt(mean(x^2) + eps) * norm_w``.
    """
    from .quants import dequantize
    if isinstance(spec_or_qtype, GemvSpec):
        qtype, epi = spec_or_qtype.qtype, spec_or_qtype.epilogue
    else:
        qtype, epi = spec_or_qtype, "none"
    epi = epilogue or epi
    x = np.asarray(x, dtype=np.float64)
    if norm_w is not None:
        x = x / np.sqrt(np.mean(x * x) + float(eps)) * np.asarray(norm_w, dtype=np.float64)
    m = w_raw.shape[0]
    w = dequantize(np.ascontiguousarray(w_raw), qtype, (m, x.size)).astype(np.float64)
    y = w @ x
    if epi == "residual":
        y = y + np.asarray(residual, dtype=np.float64)
    elif epi == "swiglu":
        wu = dequantize(np.ascontiguousarray(w_up), qtype, (m, x.size)).astype(np.float64)
        u = wu @ x
        y = y / (1.0 + np.exp(-y)) * u
    return y


_ = f32
