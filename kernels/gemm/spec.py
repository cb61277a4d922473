"""What a quantized GEMM computes (:class:`GemmSpec`), how it runs
(:class:`GemmConfig`), and the two checked together (:class:`GemmPlan`).

A spec changes the kernel's meaning or interface; a config changes only its
speed (tile sizes, warps, pipeline depth).  :func:`~.tuning.select_config`
picks a config from the per-device table ``kernels/tuning/gemm.json``.
"""

from __future__ import annotations

import attrs

from ..plan import PlanBase
from ..quants.qtypes import QTYPES, names_for
from ..spec_fields import pdl_field, target_field

__all__ = ["GemmSpec", "GemmConfig", "GemmPlan", "GEMM_QTYPES", "MMA_QTYPES", "WGMMA_QTYPES",
           "X_TYPES", "EPILOGUES", "MAX_SHARED", "KERNELS"]

#: the weight types the GEMM reads (the registry's, kernels/quants/qtypes.py),
#: in GGUF's blocks
GEMM_QTYPES = names_for("gemm")
#: the stage depths (K per stage) each format takes: a Q6_K stage holds whole
#: 128-weight halves of its super-blocks (their low and high nibbles and bits
#: are interleaved over the half)
_BK = {"Q4_K": (64, 128, 256), "Q6_K": (128, 256), "Q8_0": (64, 128, 256), "Q4_0": (64,),
       "Q5_0": (64,), "Q5_K": (64,), "F16": (64,), "BF16": (64,)}
X_TYPES = ("f32", "f16")
EPILOGUES = ("none", "residual", "bias")
#: dynamic shared memory one CTA may ask for on sm_80 / sm_90
MAX_SHARED = 227 * 1024
#: kernel bodies: ``mma`` (mma.sync, :mod:`.q4k`, sm_80+) and ``wgmma``
#: (warpgroup MMA, :mod:`.wgmma_q4k`, sm_90a, f16 X)
KERNELS = ("mma", "wgmma")
#: shared bytes a ``wgmma`` stage holds per token (64 halves, 128-byte
#: swizzled); a weight row takes :attr:`GemmPlan.w_pitch` (``bk = 64``)
WG_X_ROW = 128
#: the weight types the ``wgmma`` kernel decodes: all of them
WGMMA_QTYPES = GEMM_QTYPES
#: the weight types the ``mma`` kernel decodes (the others run on sm_90a only)
MMA_QTYPES = ("Q4_K", "Q6_K", "Q8_0")


def _in(name, allowed):
    def check(inst, attr, v):
        if v not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {v!r}")
    return check


def _pow2(lo, hi):
    def check(inst, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
                and not v & (v - 1)):
            raise ValueError(f"{attr.name} must be a power of two in {lo}..{hi}, got {v!r}")
    return check


def _int(lo, hi):
    def check(inst, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi):
            raise ValueError(f"{attr.name} must be an int in {lo}..{hi}, got {v!r}")
    return check


def _bool(inst, attr, v):
    if not isinstance(v, bool):
        raise ValueError(f"{attr.name} must be a bool, got {v!r}")


@attrs.frozen
class GemmSpec:
    """A quantized GEMM ``Y[T, M] = X[T, K] . W[M, K]^T`` (``W`` in GGUF rows
    of blocks, ``uint8 [M, row_bytes]``; ``X`` row-major; ``Y`` f32
    row-major).

    Parameters
    ----------
    qtype : str
        Weight format, one of :data:`GEMM_QTYPES` (the ``mma`` kernel decodes
        :data:`MMA_QTYPES`, the ``wgmma`` kernel all of them).
    k : int
        Row length, a multiple of the format's block (256 for the K-quants,
        32 for Q8_0, Q4_0 and Q5_0; the config's ``bk`` must divide it too); a build-time
        constant.  M and T are
        launch arguments.
    x_type : {"f32", "f16"}
        X's element type.  Either way X enters the tensor cores as f16
        (f32 is rounded to nearest on the way into shared memory).
    epilogue : {"none", "residual", "bias"}
        ``Y = X W^T``, ``Y = X W^T + R`` (``R`` f32 ``[T, M]``; ``Y`` may
        be ``R``) or ``Y = X W^T + b`` (``b`` f32 ``[M]``, added to every
        row; passed as ``r``).
    y_stride : int
        Row stride of Y (and R) in elements, a build-time constant; 0: M
        (Y dense).  Lets a GEMM write a column block of a wider output (the
        q, k and v blocks of a QKV row of differing weight types).
    t_device : bool
        T is read from device memory (a ``u32`` the kernel's ``t_ptr``
        points at) rather than passed by value, so a captured launch sized
        for a maximum T can be replayed for any smaller T.
    target : str
        ``sm_80`` ... ``sm_90a``.
    pdl : bool
        Built for programmatic dependent launch (:func:`spec_fields.pdl_field`).
    """

    qtype: str = attrs.field(validator=_in("qtype", GEMM_QTYPES))
    k: int = attrs.field()
    x_type: str = attrs.field(default="f32", validator=_in("x_type", X_TYPES))
    epilogue: str = attrs.field(default="none", validator=_in("epilogue", EPILOGUES))
    t_device: bool = attrs.field(default=False, validator=_bool)
    target: str = target_field()
    y_stride: int = attrs.field(default=0, validator=_int(0, 1 << 24))
    pdl: bool = pdl_field()

    @k.validator
    def _check_k(self, attr, v):
        bw = QTYPES[self.qtype].block_size
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v % bw:
            raise ValueError(f"{self.qtype} GEMM: K={v!r} is not a positive multiple of the "
                             f"{self.qtype} super-block ({bw} weights)")

    @property
    def block_weights(self) -> int:
        return QTYPES[self.qtype].block_size

    @property
    def block_bytes(self) -> int:
        return QTYPES[self.qtype].type_size

    @property
    def row_bytes(self) -> int:
        return self.k // self.block_weights * self.block_bytes

    @property
    def x_bytes(self) -> int:
        return 4 if self.x_type == "f32" else 2


@attrs.frozen
class GemmConfig:
    """How a GEMM runs; :func:`~.tuning.select_config` picks one per device
    and shape from the tuning table.

    Parameters
    ----------
    bm : int
        Weight rows (columns of Y) per CTA.
    bn : int
        Tokens (rows of Y) per CTA.
    bk : {64, 128, 256}
        K per pipeline stage (Q4_K: a quarter, half or whole super-block;
        Q6_K: 128 or 256; Q8_0: 2, 4 or 8 blocks; the warpgroup kernel and
        the types only it decodes: 64).
    warps_m, warps_n : int
        The CTA's warps as a ``warps_m x warps_n`` grid; a warp owns a
        ``bm / warps_m`` (multiple of 16) by ``bn / warps_n`` (multiple of
        8) tile of Y.
    stages : int
        Shared-memory stages of the ``cp.async`` ring (``stages - 1`` in
        flight while one is computed).
    min_ctas : int
        ``.minnctapersm`` hint (0: none).
    split_k : int
        CTAs sharing each output tile, each over ``1 / split_k`` of K
        (the warpgroup kernel only; 1: none).  Each writes its partial sums
        to a workspace and the last to finish adds them in a fixed order,
        so the result does not depend on which finishes first; for few
        tokens, where a tile's CTAs are too few to keep the memory busy.
    kernel : {"mma", "wgmma"}
        ``mma``: ``mma.sync`` with the weights decoded into A fragments
        per warp (:mod:`.q4k`, :mod:`.q6k`, :mod:`.q8_0`; ``MMA_QTYPES``).
        ``wgmma``: sm_90a warpgroups, each 64 weight rows by all ``bn``
        tokens, A decoded into registers and X brought by TMA into shared
        memory (:mod:`.wgmma_q4k` and the format modules; every type of
        ``WGMMA_QTYPES``); ``bm`` 64, 128 or 256, ``bk`` 64, f16 X, K a
        multiple of 256; ``warps_m``/``warps_n`` unused (``2 bm`` threads).
    """

    bm: int = attrs.field(default=128, validator=_pow2(16, 256))
    bn: int = attrs.field(default=128, validator=_pow2(8, 256))
    bk: int = attrs.field(default=64, validator=_in("bk", (64, 128, 256)))
    warps_m: int = attrs.field(default=2, validator=_pow2(1, 16))
    warps_n: int = attrs.field(default=2, validator=_pow2(1, 16))
    stages: int = attrs.field(default=3, validator=_int(2, 8))
    min_ctas: int = attrs.field(default=0, validator=_int(0, 32))
    kernel: str = attrs.field(default="mma", validator=_in("kernel", KERNELS))
    split_k: int = attrs.field(default=1, validator=_int(1, 32))


SPEC_FIELDS = tuple(f.name for f in attrs.fields(GemmSpec))
CONFIG_FIELDS = tuple(f.name for f in attrs.fields(GemmConfig))


@attrs.frozen(init=False)
class GemmPlan(PlanBase):
    """A spec and a config resolved into the one kernel the builder emits,
    checked together.  ``GemmPlan(spec, config, **changes)``; spec and
    config fields read alike (``plan.k``, ``plan.bm``)."""

    spec: GemmSpec
    config: GemmConfig

    SPEC, CONFIG, WHAT = GemmSpec, GemmConfig, "GEMM"
    SPEC_PROPS = ("block_weights", "block_bytes", "row_bytes", "x_bytes")

    @classmethod
    def make(cls, qtype: str, k: int, **fields) -> "GemmPlan":
        """A plan from spec and config fields side by side (the others at
        their defaults, not the tuned ones)."""
        s, c = cls.split_fields(fields)
        return cls(GemmSpec(qtype, k, **s), GemmConfig(**c))

    def _check(self):
        c = self.config
        if c.kernel == "wgmma":
            return self._check_wgmma()
        if c.split_k != 1:
            raise ValueError(f"split_k={c.split_k}: only kernel='wgmma' splits K")
        if self.spec.qtype not in MMA_QTYPES:
            raise ValueError(f"{self.spec.qtype} GEMMs run on kernel='wgmma' (sm_90a, f16 X, K "
                             f"a multiple of 256) only, got kernel={c.kernel!r}")
        if c.bm % (16 * c.warps_m):
            raise ValueError(f"bm={c.bm} is not a multiple of 16 x warps_m={c.warps_m} "
                             f"(a warp's rows come in 16-row mma tiles)")
        if c.bn % (8 * c.warps_n):
            raise ValueError(f"bn={c.bn} is not a multiple of 8 x warps_n={c.warps_n} "
                             f"(a warp's tokens come in 8-column mma tiles)")
        if self.threads > 1024:
            raise ValueError(f"warps_m x warps_n = {c.warps_m * c.warps_n} warps is more "
                             f"than 1024 threads")
        if c.bk not in _BK[self.spec.qtype]:
            raise ValueError(f"bk={c.bk} is not a stage depth of {self.spec.qtype} (one of "
                             f"{', '.join(map(str, _BK[self.spec.qtype]))})")
        if self.spec.k % c.bk:
            raise ValueError(f"K={self.spec.k} is not a multiple of bk={c.bk}")
        if self.dynamic_shared > MAX_SHARED:
            raise ValueError(f"stages={c.stages} of bm={c.bm}, bn={c.bn}, bk={c.bk} need "
                             f"{self.dynamic_shared} bytes of shared memory (at most "
                             f"{MAX_SHARED})")

    def _check_wgmma(self):
        c, s = self.config, self.spec
        from ptxgen.target import TARGETS
        if not TARGETS[s.target].arch_specific or TARGETS[s.target].sm != 90:
            raise ValueError(f"kernel='wgmma' needs target sm_90a (wgmma is arch-specific), "
                             f"got {s.target}")
        if s.qtype not in WGMMA_QTYPES:
            raise ValueError(f"kernel='wgmma' is built for {' and '.join(WGMMA_QTYPES)} "
                             f"weights, got {s.qtype} (other types run on kernel='mma')")
        if s.x_type != "f16":
            raise ValueError(f"kernel='wgmma' takes f16 X, got x_type={s.x_type!r} (f32 X "
                             f"runs on kernel='mma')")
        if s.k % 256:
            raise ValueError(f"kernel='wgmma' walks K in super-blocks of 256 weights; "
                             f"K={s.k} is not a multiple of 256")
        if c.bm not in (64, 128, 256):
            raise ValueError(f"kernel='wgmma': bm={c.bm} must be 64, 128 or 256 (one "
                             f"warpgroup per 64 weight rows)")
        if c.bk != 64:
            raise ValueError(f"kernel='wgmma': bk={c.bk} must be 64 (a stage is one "
                             f"64-weight group of every row)")
        if c.split_k > 1:
            nsb = s.k // 256
            if nsb % c.split_k:
                raise ValueError(f"split_k={c.split_k} does not divide K={s.k}'s {nsb} "
                                 f"super-blocks of 256")
            if s.qtype == "Q6_K" or (self.row_bytes // c.split_k) % 16:
                raise ValueError(f"split_k={c.split_k}: a {s.qtype} row's parts would not start "
                                 f"16-byte aligned (the weight copies need it)")
        if c.stages < 3:
            raise ValueError(f"kernel='wgmma': stages={c.stages} must be at least 3 (the "
                             f"stage in the tensor cores, the one being decoded, one in flight)")
        if self.dynamic_shared > MAX_SHARED:
            raise ValueError(f"stages={c.stages} of bm={c.bm}, bn={c.bn} need "
                             f"{self.dynamic_shared} bytes of shared memory (at most "
                             f"{MAX_SHARED})")

    # ----------------------------------------------------------- geometry
    @property
    def threads(self) -> int:
        if self.config.kernel == "wgmma":
            return 2 * self.config.bm
        return 32 * self.config.warps_m * self.config.warps_n

    @property
    def w_chunks(self) -> int:
        """16-byte chunks of one weight row of a stage.  Q4_K: the
        super-block's header and ``bk / 32`` chunks of nibbles.  Q6_K and
        Q8_0 blocks are only 2-byte aligned, so a stage copies 16-byte
        aligned windows that hold them (the data starting 0..14 bytes in):
        Q8_0 one window of ``bk / 32`` blocks; Q6_K with ``bk = 256`` one
        window of the super-block, with ``bk = 128`` three (the half's 64
        bytes of ``ql``, its 32 of ``qh``, and the 16 scales with ``d``).
        Q5_K (``bk = 64``, the warpgroup kernel): the header, the
        super-block's 32 bytes of ``qh`` and 2 chunks of nibbles."""
        bk, q = self.config.bk, self.spec.qtype
        if q == "Q4_K":
            return 1 + bk // 32
        if q == "Q5_K":
            return 3 + bk // 32
        if q in ("F16", "BF16"):
            return bk // 8
        if q == "Q6_K":
            return 14 if bk == 256 else 5 + 3 + 2
        return -(-(14 + self.spec.block_bytes * bk // 32) // 16)

    @property
    def w_pitch(self) -> int:
        """Shared bytes of one weight row of a stage: its chunks and, for
        Q6_K / Q8_0, 16 bytes of padding, an odd multiple of 16 either way
        (the 8 rows a warp reads at once start on distinct banks)."""
        n = self.w_chunks
        return 16 * (n + 1 - n % 2) if self.spec.qtype not in ("Q4_K", "Q5_K") else 16 * n

    @property
    def x_pitch(self) -> int:
        """Shared bytes of one token row of a stage: ``bk`` halves and 16
        bytes of padding (an odd multiple of 16: no bank conflicts)."""
        return 2 * self.config.bk + 16

    @property
    def w_stage_bytes(self) -> int:
        return self.config.bm * self.w_pitch

    @property
    def stage_bytes(self) -> int:
        return self.w_stage_bytes + self.config.bn * self.x_pitch

    @property
    def scale_bytes(self) -> int:
        """The decoded scales of one stage.  Q4_K: per sub-block of 32 and
        row, the f16x2 pairs ``(s, s)`` and ``(-m, -m)``; Q6_K: per
        sub-block of 16 and row, ``(d sc, d sc)``; Q8_0 none (the kernel
        reads ``d`` beside the quants)."""
        c, q = self.config, self.spec.qtype
        if q == "Q4_K":
            return (c.bk // 32) * c.bm * 8
        if q == "Q6_K":
            return (c.bk // 16) * c.bm * 4
        return 0

    @property
    def dynamic_shared(self) -> int:
        c = self.config
        if c.kernel == "wgmma":
            return c.stages * (self.wgmma_stage_bytes + 8)
        return c.stages * self.stage_bytes + self.scale_bytes

    @property
    def wgmma_stage_bytes(self) -> int:
        """A ``wgmma`` stage: X's tile and the weight rows (a multiple of
        1024 bytes for the configs the tuning table holds; the next tile
        must start 1024-aligned for the 128B swizzle)."""
        c = self.config
        return c.bn * WG_X_ROW + c.bm * self.w_pitch

    @property
    def split_workspace(self) -> int:
        """f32 elements of partial sums a CTA of a split tile writes
        (``split_k > 1``): its threads' accumulators."""
        return self.threads * self.config.bn // 2

    @property
    def kernel_name(self) -> str:
        c = self.config
        epi = "" if self.epilogue == "none" else "_" + self.epilogue
        td = "_tdev" if self.t_device else ""
        td += f"_ys{self.y_stride}" if self.y_stride else ""
        mc = f"_c{c.min_ctas}" if c.min_ctas else ""
        if c.kernel == "wgmma":
            sk = f"_k{c.split_k}" if c.split_k > 1 else ""
            return (f"gemm_wg_{self.qtype.lower()}_k{self.k}{epi}{td}_{c.bm}x{c.bn}"
                    f"_s{c.stages}{mc}{sk}")
        return (f"gemm_{self.qtype.lower()}_k{self.k}_x{self.x_type}{epi}{td}_{c.bm}x{c.bn}"
                f"x{c.bk}_w{c.warps_m}x{c.warps_n}_s{c.stages}{mc}")
