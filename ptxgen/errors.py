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


def caller_loc(known: int = 0) -> SourceLoc | None:
    """The innermost frame whose file is not part of the ptxgen DSL package.

    ``known`` is how many frames, starting with the caller's own, the caller
    knows to be ptxgen code (an instruction method knows its own frame, a
    private helper also its caller's); the search starts above them.  This
    is for speed: ``sys._getframe(n)`` jumps over frames, while each frame
    reached through ``f_back`` gets a Python frame object made for it, which
    for every short-lived internal call costs more than the rest of the
    search.  A count that is too small is harmless (those frames are looked
    at); one too large would skip the user's frame, so count only frames
    that are ptxgen's on every path.
    """
    f = sys._getframe(1 + known)
    internal = _internal
    while f is not None:
        fn = f.f_code.co_filename
        inside = internal.get(fn)
        if inside is None:
            inside = internal[fn] = fn.startswith(_PKG_DIR) or fn in _SKIP_FILES
        if not inside:
            return _loc_at(f)
        f = f.f_back
    return None


# One SourceLoc per call site, shared by every instruction built there: an
# unrolled Python loop builds thousands of instructions from one line, and a
# SourceLoc each would be that many more objects for the garbage collector
# to walk.  The key is the code object and the offset of the call in it
# (``f_lasti``, read now: it moves on as the frame runs), which fix the line.
# The entry keeps the code object alive, so its id() is not reused while
# the entry exists.
_locs: dict[tuple[int, int], tuple[object, SourceLoc]] = {}
_MAX_LOCS = 1 << 16


def _loc_at(f) -> SourceLoc:
    code = f.f_code
    key = (id(code), f.f_lasti)
    hit = _locs.get(key)
    if hit is not None:
        return hit[1]
    loc = SourceLoc(code.co_filename, f.f_lineno)
    if len(_locs) >= _MAX_LOCS:   # bound the memory of a long-running process
        _locs.clear()
    _locs[key] = (code, loc)
    return loc


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
