"""Compilation targets: the ``.target`` and ``.version`` a module is emitted for.

Each target's PTX ISA version is the one its compiler release introduced it
with, well inside what a CUDA 13.0 driver (PTX ISA 9.0) accepts.  A module
emits that version unless one of its instructions needs a newer one (up to
:data:`MAX_PTX`, which CUDA 12.0 and newer accept): then it emits the newest
version its instructions need.  An instruction that needs a newer sm than
the target, or an ISA beyond :data:`MAX_PTX`, is refused when it is built.
"""

from __future__ import annotations

__all__ = ["Target", "TARGETS", "get_target", "DEFAULT_TARGET", "MAX_PTX",
           "CTA_RESERVED_SHARED", "MAX_STATIC_SHARED", "SHARED_LINE"]

#: the newest PTX ISA a module may be raised to (CUDA 12.0)
MAX_PTX = (8, 0)

#: static (``.shared`` with a size) bytes a kernel may declare on every target;
#: more must be dynamic, asked for at launch (the JIT refuses a larger module)
MAX_STATIC_SHARED = 48 * 1024

#: bytes of a shared-memory line.  A dynamic shared array is placed right after
#: the kernel's static ones, at the alignment it declares; one filled by
#: warp-wide 16-byte ``cp.async`` copies should start on a line, or every
#: warp's copy spans an extra line, with more L2 sectors and shared wavefronts
#: than it needs (seen with ncu on an H100)
SHARED_LINE = 128

#: shared memory the hardware sets aside for every resident CTA (sm_80+)
CTA_RESERVED_SHARED = 1024

#: shared memory of one SM, KB (CUDA programming guide, compute capabilities:
#: 164 on sm_80 / sm_87, 100 on sm_86 / sm_89, 228 on sm_90)
_SHARED_PER_SM_KB = {80: 164, 86: 100, 89: 100, 90: 228}


class Target:
    """An sm architecture with the PTX ISA version ptxgen emits for it."""

    __slots__ = ("name", "sm", "ptx_version", "arch_specific")

    def __init__(self, name: str, sm: int, ptx_version: tuple[int, int],
                 arch_specific: bool = False):
        self.name = name
        self.sm = sm
        self.ptx_version = ptx_version
        self.arch_specific = arch_specific

    @property
    def version_text(self) -> str:
        return f"{self.ptx_version[0]}.{self.ptx_version[1]}"

    @property
    def shared_per_sm(self) -> int:
        """Bytes of shared memory one SM holds for its resident CTAs
        (each also takes :data:`CTA_RESERVED_SHARED` of it)."""
        return _SHARED_PER_SM_KB[self.sm] * 1024

    def capped_shared(self, per_sm: int, dynamic: int = 0, static: int = 0) -> int:
        """The dynamic shared memory (at least ``dynamic``) a launch asks for so
        that at most ``per_sm`` of its CTAs, each also holding ``static`` bytes
        of static shared memory, fit on one SM.  ValueError if ``per_sm`` of
        them do not fit even at ``dynamic``."""
        per = self.shared_per_sm
        if per_sm * (dynamic + static + CTA_RESERVED_SHARED) > per:
            raise ValueError(f"{per_sm} CTAs with {dynamic + static} bytes of shared memory "
                             f"each do not fit in the {per} bytes of a {self.name} SM")
        # the smallest size (16-byte granules) at which per_sm + 1 CTAs overflow
        need = per // (per_sm + 1) - CTA_RESERVED_SHARED - static + 1
        return max(dynamic, -(-need // 16) * 16)

    def supports(self, min_sm: int, min_ptx: tuple[int, int]) -> bool:
        """Whether a module for this target can hold the instruction (its
        ``.version`` may rise to ``MAX_PTX``)."""
        return self.sm >= min_sm and max(self.ptx_version, MAX_PTX) >= min_ptx

    def __repr__(self) -> str:
        return f"Target({self.name}, .version {self.version_text})"

    def __str__(self) -> str:
        return self.name

    def __reduce__(self):
        return (get_target, (self.name,))


# PTX ISA 7.8 (CUDA 11.8) is the first with sm_89 and sm_90 and the bf16
# arithmetic forms; 8.0 (CUDA 12.0) adds sm_90a.  A CUDA 13.0 driver accepts
# up to 9.0.
TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("sm_80", 80, (7, 8)),
    Target("sm_86", 86, (7, 8)),
    Target("sm_89", 89, (7, 8)),
    Target("sm_90", 90, (7, 8)),
    Target("sm_90a", 90, (8, 0), arch_specific=True),
)}

DEFAULT_TARGET = "sm_80"


def get_target(t: "str | Target | None") -> Target:
    """Return the :class:`Target` named ``t`` (``"sm_90"``), or the default."""
    if isinstance(t, Target):
        return t
    if t is None:
        t = DEFAULT_TARGET
    try:
        return TARGETS[t]
    except KeyError:
        raise ValueError(f"unknown target {t!r}; supported: {', '.join(TARGETS)}") from None
