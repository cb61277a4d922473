"""A PTX module: a target and one or more kernels, emitted as text."""

from __future__ import annotations

import hashlib

from .builder import KernelBuilder
from .errors import PtxBuildError
from .target import Target, get_target

__all__ = ["Module"]


class Module:
    """A translation unit of PTX: ``.version``/``.target`` and its kernels.

    Parameters
    ----------
    target : str or Target, optional
        ``"sm_80"``, ``"sm_86"``, ``"sm_89"``, ``"sm_90"`` or ``"sm_90a"``
        (default ``sm_80``).  It picks ``.version``/``.target`` and which
        instructions may be built.

    Examples
    --------
    >>> import ptxgen
    >>> from ptxgen.types import f32, u32
    >>> m = ptxgen.Module("sm_90")
    >>> with m.kernel("scale") as k:
    ...     x = k.param_ptr("x", f32)
    ...     n = k.param("n", u32)
    ...     i = k.global_id()
    ...     with k.if_(i < n):
    ...         k.st(x[i], k.ld(x[i]) * 2.0)
    >>> text = m.to_ptx()
    """

    def __init__(self, target: "str | Target | None" = None):
        self.target = get_target(target)
        self.kernels: list[KernelBuilder] = []

    def kernel(self, name: str, **directives) -> KernelBuilder:
        """Start a new kernel (``.visible .entry name``); see :class:`KernelBuilder`."""
        if any(k.name == name for k in self.kernels):
            raise PtxBuildError(f"module already has a kernel named {name!r}")
        kb = KernelBuilder(self, name, **directives)
        self.kernels.append(kb)
        return kb

    def __getitem__(self, name: str) -> KernelBuilder:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(f"no kernel {name!r}; kernels: {[k.name for k in self.kernels]}")

    def finish(self) -> "Module":
        for k in self.kernels:
            k.finish()
        return self

    def to_ptx(self, *, annotate: bool = False) -> str:
        """The module as PTX text; ``annotate`` adds each instruction's
        Python ``file:line`` as a comment."""
        from .emit import emit_module
        self.finish()
        return emit_module(self, annotate=annotate)

    def to_ptx_and_sources(self) -> "tuple[str, dict]":
        """The module's PTX text (as :meth:`to_ptx`) and ``{1-based PTX
        line: SourceLoc}``: the Python ``file:line`` that built the
        instruction on each line (instructions built with no user frame
        have none).  The emulator reports run-time errors with it."""
        from .emit import emit_module
        self.finish()
        sources: dict = {}
        return emit_module(self, sources=sources), sources

    def __str__(self) -> str:
        return self.to_ptx()

    @property
    def ptx_hash(self) -> str:
        return hashlib.sha256(self.to_ptx().encode()).hexdigest()

    def instruction_count(self) -> int:
        from .instr import Instr
        return sum(1 for k in self.kernels for i in k.body if isinstance(i, Instr))
