"""CPU emulator for the PTX text ptxgen emits.

Mirrors the driver's API (:mod:`ptxgen.driver`), so one test can run a
kernel on either backend::

    from ptxgen import emu
    mod = emu.Module.from_ptx(ptx_text)          # text, or a ptxgen.Module
    a = emu.DeviceArray.from_numpy(x)
    out = emu.DeviceArray.empty(n, np.float32)
    emu.launch(mod["vector_add_f32"], grid, block, a, b, out, n)
    result = out.to_numpy()

Blocks run in batches of consecutive blocks (up to 64K threads); all the
threads of a batch run together as numpy arrays with per-thread PCs (min-PC
scheduling) and per-block shared memory and barriers, so divergence, barriers,
warp shuffles/votes and the tensor-core instructions (mma.sync, ldmatrix,
wgmma, TMA with :class:`ptxgen.tensor_map.TensorMap` arguments) behave as
on the GPU.  Out-of-bounds or
misaligned accesses, reads of unwritten registers, barriers not all threads
reach and shared-memory races raise :class:`EmulatorError` subclasses that
name the PTX line, the block and the thread, and for a module built in this
process (a :class:`ptxgen.Module`) the Python file:line that built the
instruction.  See docs/emulator.md.
"""

from __future__ import annotations

from ..abi import LaunchArgumentError, ParamInfo
from ..tensor_map import TensorMap
from .errors import (BarrierError, EmulatorError, LaunchConfigError, MemoryFault,
                     PtxParseError, RaceError, SpinDeadlock, UninitializedRegister,
                     UnsupportedError, WarpSyncError)
from .executor import CompiledKernel, run_grid
from .memory import DeviceArray
from .operands import SEMANTICS
from .parser import parse_module

__all__ = ["Module", "Function", "launch", "DeviceArray", "EmulatorError", "PtxParseError",
           "UnsupportedError", "MemoryFault", "BarrierError", "RaceError", "SpinDeadlock",
           "UninitializedRegister", "WarpSyncError", "LaunchConfigError",
           "LaunchArgumentError", "ParamInfo", "SEMANTICS"]

MAX_SHARED = 227 * 1024


def _text(ptx) -> str:
    if hasattr(ptx, "to_ptx"):
        return ptx.to_ptx()
    if isinstance(ptx, (bytes, bytearray)):
        return bytes(ptx).decode()
    if isinstance(ptx, str):
        return ptx
    raise TypeError(f"expected PTX text, bytes or an object with to_ptx(), got {type(ptx).__name__}")


class Function:
    """One kernel of an emulator :class:`Module`.

    Attributes
    ----------
    name : str
    params : list of ParamInfo
    max_threads_per_block : int
        From ``.reqntid``/``.maxntid`` (else 1024).
    shared_size_bytes : int
        Static shared memory.
    thread_instructions : int
        Thread-instructions run so far by launches of this function.
    waits_for_grids : bool
        The body executes ``griddepcontrol.wait`` (may be launched with ``pdl=True``).
    cluster : tuple of int or None
        ``.reqnctapercluster`` (x, y, z): launches run in clusters of this shape.
    """

    __slots__ = ("module", "name", "params", "compiled", "max_threads_per_block",
                 "shared_size_bytes", "reqntid", "waits_for_grids", "cluster")

    def __init__(self, module, compiled: CompiledKernel):
        self.module = module
        self.name = compiled.name
        self.compiled = compiled
        self.params = list(compiled.kt.params)
        d = compiled.kt.directives
        self.reqntid = d.get(".reqntid")
        c = d.get(".reqnctapercluster")
        self.cluster = None if c is None else tuple(c) + (1,) * (3 - len(c))
        lim = d.get(".reqntid") or d.get(".maxntid")
        self.max_threads_per_block = 1024 if lim is None else min(1024, _prod(lim))
        self.shared_size_bytes = compiled.static_shared
        self.waits_for_grids = any(st.op == "griddepcontrol" and "wait" in st.mods
                                   for st in compiled.kt.body)

    @property
    def packer(self):
        return self.compiled.packer

    @property
    def thread_instructions(self) -> int:
        return self.compiled.thread_instructions

    def require_dynamic_shared(self, nbytes: int) -> None:
        """The driver's opt-in past 48 KB; the emulator has none (its launch
        checks the total against the device maximum)."""

    def __repr__(self):
        return f"<emu.Function {self.name}>"


def _prod(t):
    out = 1
    for v in t:
        out *= v
    return out


class Module:
    """Parsed and compiled PTX; create with :meth:`from_ptx`.

    Attributes
    ----------
    ptx : str
    entries : dict of str to list of ParamInfo
    sources : dict of int to SourceLoc
        ``{PTX line: Python file:line}`` of the builder, for a module made
        from a :class:`ptxgen.Module`; empty for plain text.
    """

    def __init__(self, text: str, sources=None):
        self.ptx = text
        self.sources = dict(sources or {})
        self._kernels = parse_module(text)
        self.entries = {name: list(k.params) for name, k in self._kernels.items()}
        self._functions = {}

    @classmethod
    def from_ptx(cls, ptx, *, sources=None) -> "Module":
        """Parse and compile PTX text (``str``/``bytes``, or an object with
        ``to_ptx()`` such as a :class:`ptxgen.Module`).

        A :class:`ptxgen.Module` also hands over where the builder made each
        instruction (``to_ptx_and_sources``), so run-time errors name the
        Python ``file:line`` beside the PTX line; ``sources`` gives that
        map (``{1-based PTX line: SourceLoc or "file:line"}``) for text.

        Raises
        ------
        PtxParseError
            A construct outside what ptxgen emits, with its line.
        """
        with_sources = getattr(ptx, "to_ptx_and_sources", None)
        if with_sources is not None:
            text, found = with_sources()
            return cls(text, found if sources is None else sources)
        return cls(_text(ptx), sources)

    def function(self, name: str) -> Function:
        f = self._functions.get(name)
        if f is None:
            if name not in self._kernels:
                raise KeyError(f"no kernel {name!r} in this module; kernels: "
                               f"{', '.join(self._kernels)}")
            f = self._functions[name] = Function(self, CompiledKernel(self._kernels[name],
                                                                      self.sources))
        return f

    __getitem__ = function

    @property
    def kernel_names(self) -> list:
        return list(self._kernels)


def _dims(d, what):
    if isinstance(d, int) and not isinstance(d, bool):
        d = (d,)
    try:
        d = tuple(d)
    except TypeError:
        raise LaunchConfigError(f"{what} must be an int or a tuple of 1-3 ints, got {d!r}") from None
    if not 1 <= len(d) <= 3 or any(isinstance(v, bool) or not hasattr(v, "__index__") or int(v) < 1
                                  for v in d):
        raise LaunchConfigError(f"{what} must be 1 to 3 positive ints, got {d!r}")
    d = tuple(int(v) for v in d)
    return d + (1,) * (3 - len(d))


def launch(function: Function, grid, block, *args, shared: int = 0, stream=None,
           races: bool = True, pdl: bool = False) -> None:
    """Run ``function`` on the CPU over ``grid`` blocks of ``block`` threads.

    Same conventions as :func:`ptxgen.driver.launch`: ``args`` one per kernel
    parameter (ints/floats for scalars; for pointers an ``emu.DeviceArray``,
    an int address, or any object with an integer ``.ptr``), ``shared`` the
    dynamic shared memory in bytes.  ``stream`` is accepted and ignored (the
    emulator runs synchronously).  ``races=False`` skips race detection.
    ``pdl=True`` (programmatic dependent launch) is checked as the driver
    checks it (the kernel must execute ``griddepcontrol.wait``) and otherwise
    changes nothing: launches run one after another.

    Raises
    ------
    LaunchArgumentError
        Wrong argument count, kind or range (checked by :mod:`ptxgen.abi`).
    LaunchConfigError
        Bad geometry or shared size.
    EmulatorError
        A fault during the run (subclass says which), naming the PTX line,
        block and thread.
    """
    if not isinstance(function, Function):
        raise TypeError(f"launch needs an emu.Function (module[name]), got {type(function).__name__}")
    if pdl and not function.waits_for_grids:
        raise LaunchConfigError(f"{function.name}: pdl=True, but the kernel never executes "
                                f"griddepcontrol.wait; build it with pdl=True (sm_90 or newer)")
    g = _dims(grid, "grid")
    b = _dims(block, "block")
    n = _prod(b)
    if n > function.max_threads_per_block:
        raise LaunchConfigError(f"{function.name}: block {b} has {n} threads but the kernel "
                                f"allows at most {function.max_threads_per_block}")
    if function.reqntid is not None and tuple(function.reqntid) != b:
        raise LaunchConfigError(f"{function.name}: .reqntid {function.reqntid} requires block "
                                f"{tuple(function.reqntid)}, got {b}")
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise LaunchConfigError(f"{function.name}: shared must be a non-negative int of bytes, "
                                f"got {shared!r}")
    if function.shared_size_bytes + shared > MAX_SHARED:
        raise LaunchConfigError(f"{function.name}: {function.shared_size_bytes + shared} bytes of "
                                f"shared memory exceed {MAX_SHARED}")
    cluster = 1
    if function.cluster is not None:
        if any(v % c for v, c in zip(g, function.cluster)):
            raise LaunchConfigError(f"{function.name}: grid {g} is not a whole number of "
                                    f"clusters of {function.cluster} (.reqnctapercluster)")
        if function.cluster[1:] != (1, 1):
            raise UnsupportedError(f"{function.name}: the emulator runs clusters along x "
                                   f"only, the kernel asks for {function.cluster}")
        cluster = function.cluster[0]
    args = tuple(a.emu_bytes() if isinstance(a, TensorMap) else a for a in args)
    run_grid(function.compiled, g, b, args, shared, races, cluster)
