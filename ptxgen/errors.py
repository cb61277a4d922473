"""Errors that point at the user's own source line.

Every instruction records the Python frame that built it: the innermost frame
outside the ptxgen DSL package.  Builder errors carry that location so the
message reads ``rmsnorm.py:42: add.f32 got a u32 operand``.
"""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["SourceLoc", "PtxBuildError", "PtxTypeError", "PtxVerifyError",
           "TargetError", "caller_loc"]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# frames of these files are plumbing between the user's line and ptxgen
_SKIP_FILES = frozenset({contextlib.__file__})


class SourceLoc:
    """A ``file:line`` in the user's code."""

    __slots__ = ("filename", "lineno")

    def __init__(self, filename: str, lineno: int):
        self.filename = filename
        self.lineno = lineno

    @property
    def short(self) -> str:
        return f"{os.path.basename(self.filename)}:{self.lineno}"

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}"

    def __repr__(self) -> str:
        return f"SourceLoc({self.filename!r}, {self.lineno})"


_internal: dict[str, bool] = {}


def caller_loc() -> SourceLoc | None:
    """The innermost frame whose file is not part of the ptxgen DSL package."""
    f = sys._getframe(1)
    internal = _internal
    while f is not None:
        fn = f.f_code.co_filename
        inside = internal.get(fn)
        if inside is None:
            inside = internal[fn] = fn.startswith(_PKG_DIR) or fn in _SKIP_FILES
        if not inside:
            return SourceLoc(fn, f.f_lineno)
        f = f.f_back
    return None


class PtxBuildError(Exception):
    """A misuse of the builder, reported at the user's line."""

    def __init__(self, message: str, loc: SourceLoc | None = None):
        self.message = message
        self.loc = loc if loc is not None else caller_loc()
        prefix = f"{self.loc}: " if self.loc is not None else ""
        super().__init__(prefix + message)


class PtxTypeError(PtxBuildError, TypeError):
    """An operand of the wrong type."""


class TargetError(PtxBuildError):
    """An instruction or feature that the chosen target lacks."""


class PtxVerifyError(PtxBuildError):
    """A check that runs over a whole kernel before emission failed."""
