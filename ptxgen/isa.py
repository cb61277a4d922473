"""The instruction table: one entry per PTX opcode ptxgen can build.

The builder checks every instruction against its :class:`OpSpec` (modifiers,
type suffixes, operand kinds, minimum sm and PTX ISA version); the emitter
renders it from the same record; the CPU emulator (``ptxgen.emu``) keys its
semantics on the same opcode names, and a test fails if an entry here has no
semantics there.

Operand kinds (``OpSpec.operands``), one code per operand:

``d``  destination register of the instruction type ``T``
``D``  destination of ``T``, or twice ``T``'s width with ``.wide``
``s``  source of ``T`` (register, immediate or special register)
``C``  source of ``T``, or twice ``T``'s width with ``.wide``
``d2`` / ``s2``  destination / source of the second type suffix
``du`` destination of type u32 whatever the instruction type (popc, clz)
``u``  source of 32-bit unsigned integer kind (shift amounts, lanes, masks)
``p``  destination predicate;  ``q``  source predicate (``!p`` allowed)
``m``  memory operand ``[addr]``;  ``l``  label
``V``  destination: one register or a ``{...}`` vector of ``T`` (``.v2``/``.v4``)
``W``  source: one register or a ``{...}`` vector of ``T``
An opcode name may hold dots (``cp.async.wait_group``): PTX text is matched
to the longest table name that prefixes its dotted opcode.
``fA``/``fB``/``fC``/``fD``  mma.sync fragments (vectors of registers)
``xd`` / ``xs``  ldmatrix destination / stmatrix source: ``.x1/.x2/.x4`` b32 registers
``gD`` wgmma accumulator (a vector of registers, read and written)
``gA`` wgmma A: a 64-bit matrix descriptor or a vector of 4 b32 registers
``g``  a 64-bit matrix descriptor (wgmma B)
``i``  an integer immediate (wgmma's scale and transpose constants)
``t``  a tensor operand ``[tensorMap, {c0, ...}]`` (cp.async.bulk.tensor)
A trailing ``?`` marks an optional operand.

An entry with ``arch_specific=True`` needs the architecture-specific target
(``sm_90a``): ptxas refuses it for plain ``sm_90``.
"""

from __future__ import annotations

from .types import type_by_name

__all__ = ["OpSpec", "TABLE", "spec", "ROUNDING_F", "ROUNDING_I",
           "CMP_OPS", "BOOL_OPS"]

ROUNDING_F = ("rn", "rz", "rm", "rp")          # float rounding
ROUNDING_I = ("rni", "rzi", "rmi", "rpi")      # round to integer
CMP_OPS = ("eq", "ne", "lt", "le", "gt", "ge",
           "lo", "ls", "hi", "hs",
           "equ", "neu", "ltu", "leu", "gtu", "geu", "num", "nan")
BOOL_OPS = ("and", "or", "xor")
SCOPES = ("cta", "cluster", "gpu", "sys")

INT = ("u16", "u32", "u64", "s16", "s32", "s64")
INT32_64 = ("u32", "u64", "s32", "s64")
BITS = ("b16", "b32", "b64")
BITS_PRED = ("pred", "b16", "b32", "b64")
FLT = ("f32", "f64")
HALF = ("f16", "f16x2", "bf16", "bf16x2")
ALLNUM = INT + FLT
# ld/st move half types with the bit types of their width (ld.b16, ld.b32)
MEM = ("b8", "b16", "b32", "b64", "u8", "u16", "u32", "u64",
       "s8", "s16", "s32", "s64", "f32", "f64")


#: operand codes of written operands (they come first)
DEST_CODES = frozenset({"d", "D", "d2", "du", "p", "V", "fD", "xd", "gD"})


class OpSpec:
    """One opcode: what it accepts and what it needs from the target."""

    __slots__ = ("name", "operands", "types", "mods", "min_sm", "min_ptx",
                 "type_sm", "doc", "ndst", "exclude", "arch_specific")

    def __init__(self, name, operands, types, mods=(), min_sm=20, min_ptx=(1, 0),
                 type_sm=None, doc="", exclude=(), arch_specific=False):
        self.name = name
        #: needs the architecture-specific target (sm_90a), not only its sm
        self.arch_specific = arch_specific
        #: operand kind codes, see module docstring
        self.operands = tuple(operands.split()) if isinstance(operands, str) else tuple(operands)
        #: allowed type names per type-suffix slot (a tuple of tuples)
        self.types = tuple(tuple(t) for t in types)
        #: ordered modifier groups; each group a tuple of alternatives
        self.mods = tuple(tuple(g) for g in mods)
        self.min_sm = min_sm
        self.min_ptx = min_ptx
        #: extra (min_sm, min_ptx) needs for particular type names
        self.type_sm = dict(type_sm or {})
        self.doc = doc
        #: (modifier, type name) pairs PTX does not define, e.g. div.approx.f64;
        #: a dict gives the ISA's reason for each
        self.exclude = dict(exclude) if isinstance(exclude, dict) else dict.fromkeys(exclude)
        #: how many leading operands are written
        self.ndst = 0
        for code in self.operands:
            if code not in DEST_CODES:
                break
            self.ndst += 1

    def check_mods(self, mods) -> str | None:
        """Return an error text if ``mods`` are not a valid ordered choice."""
        gi = 0
        for m in mods:
            while gi < len(self.mods) and m not in self.mods[gi]:
                gi += 1
            if gi == len(self.mods):
                allowed = " ".join("{" + "|".join(g) + "}" for g in self.mods) or "none"
                where = "out of order or unknown" if any(m in g for g in self.mods) else "unknown"
                return f"{self.name}: modifier .{m} is {where}; allowed, in order: {allowed}"
            gi += 1
        return None

    def check_combination(self, mods, tys) -> str | None:
        for m in mods:
            for t in tys:
                if (m, t.name) in self.exclude:
                    why = self.exclude[(m, t.name)]
                    return f"{self.name}.{m}.{t.name}: {why}" if why else \
                        f"PTX has no {self.name}.{m}.{t.name}"
        return None

    def check_types(self, tys) -> str | None:
        if len(tys) != len(self.types):
            return (f"{self.name} takes {len(self.types)} type suffix(es), "
                    f"got {len(tys)}")
        for i, (t, allowed) in enumerate(zip(tys, self.types)):
            if t.name not in allowed:
                return (f"{self.name} does not take .{t.name}"
                        + (f" in type slot {i + 1}" if len(self.types) > 1 else "")
                        + f"; allowed: {', '.join(allowed)}")
        return None

    def requirement(self, mods, tys) -> tuple[int, tuple[int, int]]:
        """The (sm, ptx version) this particular form needs."""
        sm, ptx = self.min_sm, self.min_ptx
        for key in [t.name for t in tys] + list(mods):
            if key in self.type_sm:
                s2, p2 = self.type_sm[key]
                sm, ptx = max(sm, s2), max(ptx, p2)
        return sm, ptx

    def __repr__(self) -> str:
        return f"OpSpec({self.name})"


def _table(*specs: OpSpec) -> dict[str, OpSpec]:
    out = {}
    for s in specs:
        assert s.name not in out, s.name
        for slot in s.types:
            for t in slot:
                type_by_name(t)
        out[s.name] = s
    return out


#: mma.sync shapes ptxgen builds (m16n8k8: f16/bf16; m16n8k32: s8/u8)
MMA_SHAPES = ("m16n8k16", "m16n8k8", "m16n8k32")
#: wgmma.mma_async shapes: m64nNk16 (f16/bf16) and m64nNk32 (s8/u8), N = 8..256 step 8
WGMMA_SHAPES = tuple(f"m64n{n}k{k}" for k in (16, 32) for n in range(8, 257, 8))

_HALF_SM = {"bf16": (90, (7, 8)), "bf16x2": (90, (7, 8)),
            "f16": (53, (4, 2)), "f16x2": (53, (4, 2))}
_FMA_HALF_SM = {"bf16": (80, (7, 0)), "bf16x2": (80, (7, 0)),
                "f16": (53, (4, 2)), "f16x2": (53, (4, 2))}

TABLE: dict[str, OpSpec] = _table(
    # -- data movement -------------------------------------------------------
    # no f16/bf16 forms: ptxas refuses mov.f16 and friends ("unexpected
    # instruction types"); half values move as .b16/.b32 (KernelBuilder.mov)
    OpSpec("mov", "V W", [BITS_PRED + ALLNUM], doc="copy; {a,b} packs/unpacks"),
    OpSpec("cvt", "d s2", [INT + FLT + HALF[::2], INT + FLT + HALF[::2]],
           [ROUNDING_F + ROUNDING_I, ("ftz",), ("sat",)],
           type_sm={"bf16": (80, (7, 0))}, doc="convert between types"),
    OpSpec("cvta", "d s", [("u64",)], [("to",), ("global", "shared", "param")],
           type_sm={"param": (70, (7, 7))},
           doc="generic <-> state-space address (cvta.param: a kernel parameter's "
               "generic address)"),
    OpSpec("ld", "V m", [MEM],
           [("weak", "relaxed", "acquire", "volatile"), SCOPES,
            ("global", "shared", "shared::cta", "shared::cluster", "param"),
            ("ca", "cg", "cs", "lu", "cv"), ("nc",),
            ("L1::evict_normal", "L1::evict_unchanged", "L1::evict_first",
             "L1::evict_last", "L1::no_allocate"),
            ("L2::64B", "L2::128B", "L2::256B"), ("v2", "v4")],
           type_sm={"relaxed": (70, (6, 0)), "acquire": (70, (6, 0)),
                    "L1::no_allocate": (70, (7, 4)), "L1::evict_last": (70, (7, 4)),
                    "L1::evict_first": (70, (7, 4)), "L1::evict_normal": (70, (7, 4)),
                    "L1::evict_unchanged": (70, (7, 4)),
                    "L2::64B": (75, (7, 4)), "L2::128B": (75, (7, 4)), "L2::256B": (80, (7, 4)),
                    "shared::cta": (90, (7, 8)), "shared::cluster": (90, (7, 8))},
           doc="load; .nc = read-only non-coherent path; .shared::cluster reads a cluster "
               "peer's shared memory at a mapa address"),
    OpSpec("cp.async", "m m u", [],
           [("ca", "cg"), ("shared", "shared::cta"), ("global",), ("L2::128B", "L2::256B")],
           min_sm=80, min_ptx=(7, 0), type_sm={"L2::128B": (80, (7, 4)), "L2::256B": (80, (7, 4))},
           doc="asynchronous global -> shared copy of 4, 8 or 16 bytes (cg: 16 only)"),
    OpSpec("cp.async.commit_group", "", [], min_sm=80, min_ptx=(7, 0),
           doc="close the thread's pending cp.async copies into one group"),
    OpSpec("cp.async.wait_group", "u", [], min_sm=80, min_ptx=(7, 0),
           doc="wait until at most N of the thread's committed groups are pending"),
    OpSpec("cp.async.wait_all", "", [], min_sm=80, min_ptx=(7, 0),
           doc="commit and wait for all of the thread's cp.async copies"),
    OpSpec("cp.async.bulk.prefetch.L2", "m u", [], [("global",)], min_sm=90, min_ptx=(8, 0),
           doc="asynchronous prefetch of a byte range (16-aligned, a multiple of 16) into L2"),
    OpSpec("cp.async.bulk", "m m u m", [],
           [("shared::cluster",), ("global",), ("mbarrier::complete_tx::bytes",)],
           min_sm=90, min_ptx=(8, 0),
           doc="bulk copy engine: global -> shared, a 16-aligned multiple of 16 bytes, "
               "completing its bytes on an mbarrier"),
    OpSpec("mbarrier.init", "m u", [("b64",)], [("shared",)], min_sm=80, min_ptx=(7, 0),
           doc="set an 8-byte shared mbarrier to phase 0 expecting COUNT arrivals"),
    OpSpec("mbarrier.arrive.expect_tx", "d m u", [("b64",)], [("shared",)],
           min_sm=90, min_ptx=(8, 0),
           doc="raise the mbarrier's pending bytes by TX, then arrive once"),
    OpSpec("mbarrier.try_wait.parity", "p m u", [("b64",)], [("shared",)],
           min_sm=90, min_ptx=(7, 8),
           doc="true once the mbarrier's phase of the given parity has completed "
               "(may wait a while first)"),
    OpSpec("fence.mbarrier_init", "", [], [("release",), ("cluster",)], min_sm=90, min_ptx=(8, 0),
           doc="make mbarrier.init visible to the bulk copy engine"),
    OpSpec("st", "m W", [MEM],
           [("weak", "relaxed", "release", "volatile"), SCOPES,
            ("global", "shared", "shared::cta", "shared::cluster"),
            ("wb", "cg", "cs", "wt"),
            ("L1::evict_normal", "L1::evict_unchanged", "L1::evict_first",
             "L1::evict_last", "L1::no_allocate"),
            ("v2", "v4")],
           type_sm={"relaxed": (70, (6, 0)), "release": (70, (6, 0)),
                    "shared::cta": (90, (7, 8)), "shared::cluster": (90, (7, 8))},
           doc="store; .shared::cluster writes a cluster peer's shared memory at a mapa "
               "address"),
    # -- integer and float arithmetic -----------------------------------------
    OpSpec("add", "d s s", [ALLNUM + HALF], [ROUNDING_F, ("ftz",), ("sat",)],
           type_sm=_HALF_SM),
    OpSpec("sub", "d s s", [ALLNUM + HALF], [ROUNDING_F, ("ftz",), ("sat",)],
           type_sm=_HALF_SM),
    OpSpec("mul", "D s s", [ALLNUM + HALF], [("lo", "hi", "wide"), ROUNDING_F, ("ftz",), ("sat",)],
           type_sm=_HALF_SM),
    OpSpec("mad", "D s s C", [INT], [("lo", "hi", "wide"), ("sat",)],
           doc="integer multiply-add; floats use fma"),
    OpSpec("fma", "d s s s", [FLT + HALF], [ROUNDING_F, ("ftz",), ("sat",), ("relu",)],
           type_sm=_FMA_HALF_SM,
           exclude={(r, t): "PTX's half-precision fma rounds to nearest only (.rnd = .rn)"
                    for r in ROUNDING_F[1:] for t in HALF}),
    OpSpec("div", "d s s", [ALLNUM], [("approx", "full") + ROUNDING_F, ("ftz",)],
           exclude=[("approx", "f64"), ("full", "f64")]),
    OpSpec("rem", "d s s", [INT]),
    OpSpec("neg", "d s", [("s16", "s32", "s64") + FLT + HALF], [("ftz",)],
           type_sm={"bf16": (80, (7, 0)), "bf16x2": (80, (7, 0))}),
    OpSpec("abs", "d s", [("s16", "s32", "s64") + FLT + HALF], [("ftz",)],
           type_sm={"bf16": (80, (7, 0)), "bf16x2": (80, (7, 0))}),
    OpSpec("min", "d s s", [ALLNUM + HALF], [("ftz",), ("NaN",)],
           type_sm={"f16": (80, (7, 0)), "f16x2": (80, (7, 0)),
                    "bf16": (80, (7, 0)), "bf16x2": (80, (7, 0))}),
    OpSpec("max", "d s s", [ALLNUM + HALF], [("ftz",), ("NaN",)],
           type_sm={"f16": (80, (7, 0)), "f16x2": (80, (7, 0)),
                    "bf16": (80, (7, 0)), "bf16x2": (80, (7, 0))}),
    OpSpec("popc", "du s", [("b32", "b64")], doc="population count into a u32"),
    OpSpec("clz", "du s", [("b32", "b64")], doc="leading zeros into a u32"),
    # -- special functions ------------------------------------------------------
    OpSpec("rcp", "d s", [FLT], [("approx",) + ROUNDING_F, ("ftz",)],
           exclude=[("approx", "f64")]),
    OpSpec("sqrt", "d s", [FLT], [("approx",) + ROUNDING_F, ("ftz",)],
           exclude=[("approx", "f64")]),
    OpSpec("rsqrt", "d s", [FLT], [("approx",), ("ftz",)]),
    OpSpec("ex2", "d s", [("f32",)], [("approx",), ("ftz",)]),
    OpSpec("lg2", "d s", [("f32",)], [("approx",), ("ftz",)]),
    OpSpec("sin", "d s", [("f32",)], [("approx",), ("ftz",)]),
    OpSpec("cos", "d s", [("f32",)], [("approx",), ("ftz",)]),
    OpSpec("tanh", "d s", [("f32",)], [("approx",)], min_sm=75, min_ptx=(7, 0)),
    # -- logic and bits -----------------------------------------------------------
    OpSpec("and", "d s s", [BITS_PRED]),
    OpSpec("or", "d s s", [BITS_PRED]),
    OpSpec("xor", "d s s", [BITS_PRED]),
    OpSpec("not", "d s", [BITS_PRED]),
    OpSpec("shl", "d s u", [BITS]),
    OpSpec("shr", "d s u", [BITS + INT]),
    OpSpec("bfe", "d s u u", [INT32_64]),
    OpSpec("bfi", "d s s u u", [("b32", "b64")]),
    OpSpec("prmt", "d s s s", [("b32",)], [("f4e", "b4e", "rc8", "ecl", "ecr", "rc16")]),
    OpSpec("dp4a", "d2 s s s2", [("u32", "s32"), ("u32", "s32")], min_sm=61, min_ptx=(5, 0)),
    OpSpec("dp2a", "d2 s s s2", [("u32", "s32"), ("u32", "s32")], [("lo", "hi")],
           min_sm=61, min_ptx=(5, 0)),
    # -- comparison and selection -----------------------------------------------
    OpSpec("setp", "p s s q?", [ALLNUM + BITS + HALF[::2]], [CMP_OPS, BOOL_OPS, ("ftz",)],
           type_sm={"bf16": (90, (7, 8))},
           exclude=[(c, t) for c in ("lo", "ls", "hi", "hs")
                    for t in ("s16", "s32", "s64", "f32", "f64", "f16", "bf16")]
           + [(c, t) for c in ("equ", "neu", "ltu", "leu", "gtu", "geu", "num", "nan")
              for t in INT + BITS]
           + [(c, t) for c in ("lt", "le", "gt", "ge") for t in BITS]),
    OpSpec("selp", "d s s q", [ALLNUM + BITS + HALF[::2]]),
    # -- control flow ------------------------------------------------------------
    OpSpec("bra", "l", [], [("uni",)]),
    OpSpec("ret", "", []),
    OpSpec("exit", "", []),
    # -- synchronisation and communication --------------------------------------
    OpSpec("bar", "u? u?", [], [("cta",), ("sync", "arrive")],
           doc="bar.sync barrier[, count]"),
    OpSpec("barrier.cluster.arrive", "", [], [("release", "relaxed"), ("aligned",)],
           min_sm=90, min_ptx=(7, 8),
           type_sm={"release": (90, (8, 0)), "relaxed": (90, (8, 0))},
           doc="arrive at the cluster-wide barrier (every thread of every CTA of the cluster)"),
    OpSpec("barrier.cluster.wait", "", [], [("acquire",), ("aligned",)], min_sm=90,
           min_ptx=(7, 8), type_sm={"acquire": (90, (8, 0))},
           doc="wait until every thread of the cluster has arrived"),
    OpSpec("mapa", "d s u", [("u32",)], [("shared::cluster",)], min_sm=90, min_ptx=(7, 8),
           doc="the shared::cluster address of the same shared variable in CTA RANK "
               "of the cluster"),
    OpSpec("fence.proxy.async", "", [], [("shared::cta", "shared::cluster", "global")],
           min_sm=90, min_ptx=(8, 0),
           doc="order this thread's generic-proxy memory accesses with the async proxy's "
               "(the bulk copy engine)"),
    OpSpec("membar", "", [], [("cta", "gl", "sys")]),
    OpSpec("nanosleep", "u", [("u32",)], [], min_sm=70, min_ptx=(6, 3),
           doc="suspend the thread for about N nanoseconds (0..1,000,000), e.g. in a "
               "spin-wait on another CTA's counter"),
    OpSpec("fence", "", [], [("sc", "acq_rel"), SCOPES], min_sm=70, min_ptx=(6, 0)),
    OpSpec("griddepcontrol", "", [], [("launch_dependents", "wait")], min_sm=90, min_ptx=(7, 8),
           doc="programmatic dependent launch: let the next grid start / wait for the previous"),
    OpSpec("atom", "d m s s?", [INT32_64 + ("b32", "b64", "f32", "f64", "f16x2", "bf16x2")],
           [("relaxed", "acquire", "release", "acq_rel"), SCOPES, ("global", "shared"),
            ("add", "min", "max", "inc", "dec", "and", "or", "xor", "cas", "exch"),
            ("noftz",)],
           type_sm={"relaxed": (70, (6, 3)), "acquire": (70, (6, 3)),
                    "release": (70, (6, 3)), "acq_rel": (70, (6, 3)),
                    "cta": (60, (5, 0)), "gpu": (60, (5, 0)), "sys": (60, (5, 0)),
                    "f64": (60, (5, 0)), "f16x2": (60, (6, 3)), "bf16x2": (90, (7, 8))}),
    OpSpec("red", "m s", [INT32_64 + ("b32", "b64", "f32", "f64", "f16x2", "bf16x2")],
           [("relaxed", "release"), SCOPES, ("global", "shared"),
            ("add", "min", "max", "inc", "dec", "and", "or", "xor"), ("noftz",)],
           type_sm={"relaxed": (70, (6, 3)), "release": (70, (6, 3)),
                    "cta": (60, (5, 0)), "gpu": (60, (5, 0)), "sys": (60, (5, 0)),
                    "f64": (60, (5, 0)), "f16x2": (60, (6, 3)), "bf16x2": (90, (7, 8))}),
    OpSpec("shfl", "d s u u u", [("b32",)], [("sync",), ("up", "down", "bfly", "idx")],
           min_sm=30, min_ptx=(6, 0)),
    OpSpec("vote", "d q u", [("pred", "b32")], [("sync",), ("all", "any", "uni", "ballot")],
           min_sm=30, min_ptx=(6, 0)),
    # -- tensor cores ------------------------------------------------------------
    OpSpec("mma", "fD fA fB fC", [("f32", "s32"), ("f16", "bf16", "s8", "u8"),
                                  ("f16", "bf16", "s8", "u8"), ("f32", "s32")],
           [("sync",), ("aligned",), MMA_SHAPES, ("row",), ("col",), ("satfinite",)],
           min_sm=80, min_ptx=(7, 0),
           exclude={**{("satfinite", t): "PTX has .satfinite on the integer mma only"
                       for t in ("f16", "bf16", "f32")},
                    **{("m16n8k8", t): "PTX has no 8-bit m16n8k8 (8-bit mma is k16 or k32)"
                       for t in ("s8", "u8")},
                    **{("m16n8k16", t): "ptxgen builds the 8-bit mma as m16n8k32 only"
                       for t in ("s8", "u8")},
                    **{("m16n8k32", t): "PTX has no f16/bf16 m16n8k32 (k8 or k16)"
                       for t in ("f16", "bf16")}},
           doc="mma.sync.aligned: a warp's 16x8 tile D = A.B + C (m16n8k16 / m16n8k8 "
               "f16 and bf16 into f32, m16n8k32 s8/u8 into s32)"),
    OpSpec("ldmatrix", "xd m", [("b16",)],
           [("sync",), ("aligned",), ("m8n8",), ("x1", "x2", "x4"), ("trans",), ("shared",)],
           min_sm=75, min_ptx=(6, 5),
           doc="load 1, 2 or 4 8x8 b16 matrices from shared memory into a warp's "
               "registers (rows addressed by lanes 0-7, 8-15, 16-23, 24-31)"),
    OpSpec("stmatrix", "m xs", [("b16",)],
           [("sync",), ("aligned",), ("m8n8",), ("x1", "x2", "x4"), ("trans",), ("shared",)],
           min_sm=90, min_ptx=(7, 8),
           doc="store 1, 2 or 4 8x8 b16 matrices from a warp's registers to shared "
               "memory (the inverse of ldmatrix)"),
    OpSpec("wgmma.fence", "", [], [("sync",), ("aligned",)], min_sm=90, min_ptx=(8, 0),
           arch_specific=True,
           doc="order the warpgroup's register accesses before the wgmma.mma_async "
               "that follow"),
    OpSpec("wgmma.commit_group", "", [], [("sync",), ("aligned",)], min_sm=90,
           min_ptx=(8, 0), arch_specific=True,
           doc="close the warpgroup's pending wgmma.mma_async into one group"),
    OpSpec("wgmma.wait_group", "i", [], [("sync",), ("aligned",)], min_sm=90,
           min_ptx=(8, 0), arch_specific=True,
           doc="wait until at most N of the warpgroup's committed wgmma groups are pending"),
    OpSpec("wgmma.mma_async", "gD gA g q i? i? i? i?",
           [("f32", "s32"), ("f16", "bf16", "s8", "u8"), ("f16", "bf16", "s8", "u8")],
           [("sync",), ("aligned",), WGMMA_SHAPES, ("satfinite",)],
           min_sm=90, min_ptx=(8, 0), arch_specific=True,
           exclude=[("satfinite", t) for t in ("f16", "bf16", "f32")],
           doc="a warpgroup's (4 warps) 64xN tile D = A.B + scale-d * D; A from a "
               "shared-memory descriptor or registers, B from a descriptor"),
    OpSpec("cp.async.bulk.tensor", "m t m", [],
           [("1d", "2d", "3d", "4d", "5d"), ("shared::cluster",), ("global",), ("tile",),
            ("mbarrier::complete_tx::bytes",)],
           min_sm=90, min_ptx=(8, 0),
           doc="TMA: copy a box of a tensor (described by a tensor map) from global to "
               "shared memory, completing its bytes on an mbarrier"),
)


def spec(name: str) -> OpSpec:
    try:
        return TABLE[name]
    except KeyError:
        raise KeyError(f"{name!r} is not in ptxgen's instruction table") from None
