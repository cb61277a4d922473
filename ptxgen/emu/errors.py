"""Errors the emulator raises.

Every run-time error names the PTX line (number and text), the block
``(x, y, z)`` and the thread ``(x, y, z)`` where it happened::

    MemoryFault: line 31 `st.global.f32 [%rd6], %f24;`, block (3, 0, 0),
    thread (17, 0, 0): global store of 4 bytes at 0x400000001000 is 4 bytes
    past the end of a 4096-byte allocation at 0x400000000000

When the module came from a :class:`ptxgen.Module` (built in this process),
the Python ``file:line`` that built the instruction follows the PTX line::

    MemoryFault: line 31 `st.global.f32 [%rd6], %f24;` at /home/me/copy.py:12, ...
"""

from __future__ import annotations

__all__ = ["EmulatorError", "PtxParseError", "UnsupportedError", "MemoryFault",
           "BarrierError", "RaceError", "UninitializedRegister", "WarpSyncError",
           "LaunchConfigError", "SpinDeadlock",
           "Fault", "describe_op"]


class EmulatorError(Exception):
    """Base of every error of :mod:`ptxgen.emu`.

    Attributes
    ----------
    line : int or None
        1-based PTX line number.
    text : str or None
        That line's instruction text.
    block, thread : tuple of int or None
        Where it happened.
    source : ptxgen.errors.SourceLoc or None
        The Python ``file:line`` that built the instruction (modules built
        in-process only).
    """

    def __init__(self, message, *, line=None, text=None, block=None, thread=None, source=None):
        self.message = message
        self.line = line
        self.text = text
        self.block = block
        self.thread = thread
        self.source = source
        where = []
        if line is not None:
            where.append(f"line {line}" + (f" `{text}`" if text else "")
                         + (f" at {source}" if source is not None else ""))
        if block is not None:
            where.append(f"block {tuple(block)}")
        if thread is not None:
            where.append(f"thread {tuple(thread)}")
        super().__init__((", ".join(where) + ": " if where else "") + message)


class PtxParseError(EmulatorError):
    """The PTX text has a construct the emulator does not know."""


class UnsupportedError(EmulatorError):
    """A form the table admits but the emulator cannot run (e.g. ``.local``)."""


class MemoryFault(EmulatorError):
    """Out-of-bounds or misaligned global/shared/param access."""


class BarrierError(EmulatorError):
    """A ``bar.sync`` that not all (non-exited) threads of the block reach."""


class RaceError(EmulatorError):
    """Two threads touch one shared-memory byte between two barriers and at
    least one of them writes it; or two CTAs of a kernel that spin-waits
    touch one global word, one of them writing it, and no release/acquire
    pair orders the two accesses (:mod:`ptxgen.emu.global_races`)."""


class SpinDeadlock(EmulatorError):
    """Threads spin-wait (a loop around ``nanosleep``) on memory that no
    thread of the launch writes any more."""


class UninitializedRegister(EmulatorError):
    """A register is read by a thread on whose path nothing has written it."""


class WarpSyncError(EmulatorError):
    """``shfl.sync``/``vote.sync``/``mma.sync`` whose member threads are not
    all converged at the instruction."""


class Fault(Exception):
    """Internal: raised by an instruction's semantics; the executor adds the
    line, block and thread and re-raises it as ``cls``."""

    def __init__(self, cls, message, thread=None):
        super().__init__(message)
        self.cls = cls
        self.message = message
        #: lane of the running batch of blocks (block * threads_per_block +
        #: linear thread index in the block), or None
        self.thread = thread


def describe_op(op) -> str:
    """``line N (`text`)``, with ``at file:line`` inside the parentheses
    when the builder's call site of the instruction is known: how a message
    names an instruction other than the one the error is raised at."""
    src = getattr(op, "src", None)
    return f"line {op.line} (`{op.text}`" + (f" at {src})" if src is not None else ")")


class LaunchConfigError(EmulatorError, ValueError):
    """A bad grid, block or shared-memory size for the kernel."""
