"""PTX fundamental types.

Each :class:`PtxType` knows its PTX spelling (``u32``), its width in bits, its
kind (bit, unsigned, signed, float, predicate) and how registers of the type
are declared in a kernel (prefix and ``.reg`` type).  Types are singletons, so
``is`` and ``==`` agree and they can be dictionary keys.
"""

from __future__ import annotations

__all__ = [
    "PtxType", "b8", "b16", "b32", "b64", "u8", "u16", "u32", "u64",
    "s8", "s16", "s32", "s64", "f16", "f16x2", "bf16", "bf16x2",
    "f32", "f64", "pred", "ALL_TYPES", "type_by_name",
]


class PtxType:
    """One PTX fundamental type, such as ``.u32`` or ``.f16x2``."""

    __slots__ = ("name", "bits", "kind", "reg_prefix", "reg_decl", "np_dtype")

    def __init__(self, name: str, bits: int, kind: str, reg_prefix: str,
                 reg_decl: str, np_dtype: str | None):
        self.name = name
        self.bits = bits
        #: one of "b" (untyped bits), "u", "s", "f", "pred"
        self.kind = kind
        self.reg_prefix = reg_prefix
        self.reg_decl = reg_decl
        self.np_dtype = np_dtype

    @property
    def bytes(self) -> int:
        return max(1, self.bits // 8)

    @property
    def is_int(self) -> bool:
        return self.kind in ("u", "s")

    @property
    def is_signed(self) -> bool:
        return self.kind == "s"

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_packed(self) -> bool:
        """True for the two-lane half types ``f16x2`` and ``bf16x2``."""
        return self.name.endswith("x2")

    @property
    def is_bits(self) -> bool:
        return self.kind == "b"

    @property
    def is_pred(self) -> bool:
        return self.kind == "pred"

    @property
    def can_be_register(self) -> bool:
        """8-bit types exist in memory only; registers are 16 bits or wider."""
        return self.bits >= 16 or self.is_pred

    def __repr__(self) -> str:
        return self.name

    def __str__(self) -> str:
        return self.name

    def __reduce__(self):
        return (type_by_name, (self.name,))


def _t(name, bits, kind, prefix, decl=None, np_dtype=None):
    return PtxType(name, bits, kind, prefix, decl or name, np_dtype)


b8 = _t("b8", 8, "b", "", np_dtype="uint8")
u8 = _t("u8", 8, "u", "", np_dtype="uint8")
s8 = _t("s8", 8, "s", "", np_dtype="int8")
b16 = _t("b16", 16, "b", "%bh", np_dtype="uint16")
u16 = _t("u16", 16, "u", "%rs", np_dtype="uint16")
s16 = _t("s16", 16, "s", "%ss", np_dtype="int16")
b32 = _t("b32", 32, "b", "%b", np_dtype="uint32")
u32 = _t("u32", 32, "u", "%r", np_dtype="uint32")
s32 = _t("s32", 32, "s", "%si", np_dtype="int32")
b64 = _t("b64", 64, "b", "%bd", np_dtype="uint64")
u64 = _t("u64", 64, "u", "%rd", np_dtype="uint64")
s64 = _t("s64", 64, "s", "%sd", np_dtype="int64")
f16 = _t("f16", 16, "f", "%h", "b16", np_dtype="float16")
bf16 = _t("bf16", 16, "f", "%hb", "b16")
f16x2 = _t("f16x2", 32, "f", "%hh", "b32")
bf16x2 = _t("bf16x2", 32, "f", "%hhb", "b32")
f32 = _t("f32", 32, "f", "%f", np_dtype="float32")
f64 = _t("f64", 64, "f", "%fd", np_dtype="float64")
pred = _t("pred", 1, "pred", "%p")

ALL_TYPES: tuple[PtxType, ...] = (
    pred, b8, b16, b32, b64, u8, u16, u32, u64, s8, s16, s32, s64,
    f16, f16x2, bf16, bf16x2, f32, f64,
)
_BY_NAME = {t.name: t for t in ALL_TYPES}


def type_by_name(name: str | PtxType) -> PtxType:
    """Look a type up by its PTX name (``"u32"`` or ``".u32"``)."""
    if isinstance(name, PtxType):
        return name
    key = name.lstrip(".")
    try:
        return _BY_NAME[key]
    except KeyError:
        valid = ", ".join(t.name for t in ALL_TYPES)
        raise ValueError(f"unknown PTX type {name!r}; valid types: {valid}") from None


def compatible(reg: PtxType, inst: PtxType) -> bool:
    """PTX operand compatibility: may a register of type ``reg`` appear where
    an instruction of type ``inst`` expects an operand?

    Follows the PTX ISA rules (section "Operand Type Information"): the sizes
    must match; bit types match any type of the same size; signed and unsigned
    integers of one size are interchangeable; floats match only floats (or
    bit types) of the same kind.
    """
    if reg is inst:
        return True
    if reg.is_pred or inst.is_pred:
        return False
    if reg.bits != inst.bits:
        return False
    if reg.is_bits or inst.is_bits:
        return True
    if reg.is_int and inst.is_int:
        return True
    return False
