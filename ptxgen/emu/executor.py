"""SIMT execution of a compiled kernel, one block at a time.

Threads of a block run together as numpy arrays.  Each thread has a PC;
the scheduler always runs the group of threads at the *smallest* PC, so
threads that diverge at a branch reconverge where their paths meet (the
immediate post-dominator, for the structured code ptxgen emits), and a loop
runs until its last thread leaves it.  The running group is a boolean mask
plus one PC; threads that branch elsewhere are parked by PC.

``bar.sync`` parks the arriving threads until every non-exited thread of
the block has arrived at the same instruction; a thread arriving at a
different ``bar.sync`` for the same barrier, or exiting while others wait,
is a :class:`BarrierError`.  Between two block-wide barriers every
shared-memory access is logged and, at the barrier, checked for a race
(:mod:`ptxgen.emu.races`).  A register read by a thread for which no path
has written it is an :class:`UninitializedRegister` error.
"""

from __future__ import annotations

import numpy as np

from ..abi import ArgPacker
from . import alu, convert, memops, warpops  # noqa: F401  (register semantics)
from .errors import (BarrierError, EmulatorError, Fault, UninitializedRegister)
from .operands import BAR, BRA, EXIT, NORMAL, SEMANTICS, UINT, Ctx, Op, width
from .races import check_races

__all__ = ["CompiledKernel", "compile_kernel", "run_grid", "MAX_STEPS"]

#: thread-instructions one block may run before the emulator gives up (an
#: endless loop); about a minute of emulation
MAX_STEPS = 2_000_000_000


class CompiledKernel:
    """A kernel's instructions compiled to :class:`~ptxgen.emu.operands.Op`."""

    def __init__(self, kt):
        self.name = kt.name
        self.kt = kt
        self.ctx = Ctx(kt)
        self.ops = []
        for st in kt.body:
            self.ctx.stmt = st
            op = SEMANTICS[st.op](st, self.ctx)
            op.pc = len(self.ops)
            self.ops.append(op)
        self.ctx.stmt = None
        ret = Op(kind=EXIT)
        ret.line, ret.text = 0, "(end of kernel)"
        ret.pc = len(self.ops)
        self.ops.append(ret)
        self.packer = ArgPacker(kt.name, kt.params)
        self.static_shared = self.ctx.static_shared
        self.has_dynamic_shared = any(n is None for _, _, n in kt.shared)
        self.reg_widths = [width(t) for t in self.ctx.reg_types]
        #: thread-instructions executed (sum over instructions of the threads
        #: in the running group), for the benchmark
        self.thread_instructions = 0


def compile_kernel(kt) -> CompiledKernel:
    return CompiledKernel(kt)


class Geometry:
    """Per-launch thread layout of a block (shared by all its blocks)."""

    def __init__(self, block):
        bx, by, bz = block
        n = bx * by * bz
        lin = np.arange(n)
        self.n = n
        self.block = block
        self.tid = {"x": (lin % bx).astype(np.uint32), "y": ((lin // bx) % by).astype(np.uint32),
                    "z": (lin // (bx * by)).astype(np.uint32)}
        self.lane = (lin % 32).astype(np.uint32)
        self.warp = (lin // 32).astype(np.int64)
        self.warp_base = (lin // 32) * 32
        self.warp_starts = np.arange(0, n, 32)
        self.lanebit = (np.uint32(1) << self.lane).astype(np.uint32)
        self.full = np.ones(n, bool)
        self.all_tids = lin

    def coords(self, j):
        bx, by, _ = self.block
        return (j % bx, (j // bx) % by, j // (bx * by))


class BlockState:
    """Registers, memory views and masks of the block being run."""

    __slots__ = ("n", "regs", "written", "sreg", "shared", "params", "exited", "race_log",
                 "all_tids", "full_mask", "lanebit", "warp_starts", "uniform_warps", "lane",
                 "warp", "warp_base")

    def __init__(self, k, geo, ctaid, grid, params, shared_bytes, races):
        n = geo.n
        self.n = n
        zeros = {w: np.zeros(n, UINT[w]) for w in (16, 32, 64)}
        zeros[1] = np.zeros(n, bool)
        self.regs = [zeros[w] for w in k.reg_widths]
        unwritten = np.zeros(n, bool)
        self.written = [unwritten] * len(k.reg_widths)
        s = {f"%tid.{c}": geo.tid[c] for c in "xyz"}
        for c, v in zip("xyz", geo.block):
            s[f"%ntid.{c}"] = np.uint32(v)
        for c, v in zip("xyz", ctaid):
            s[f"%ctaid.{c}"] = np.uint32(v)
        for c, v in zip("xyz", grid):
            s[f"%nctaid.{c}"] = np.uint32(v)
        s["%laneid"] = geo.lane
        s["%warpid"] = geo.warp.astype(np.uint32)
        s["%nwarpid"] = np.uint32((n + 31) // 32)
        s["%smid"] = np.uint32(0)
        s["%nsmid"] = np.uint32(1)
        s["%clock"] = np.uint32(0)
        s["%clock64"] = np.uint64(0)
        s["%globaltimer"] = np.uint64(0)
        lane = geo.lane.astype(np.uint64)
        one = np.uint64(1)
        s["%lanemask_eq"] = (one << lane).astype(np.uint32)
        s["%lanemask_lt"] = ((one << lane) - one).astype(np.uint32)
        s["%lanemask_le"] = ((one << (lane + one)) - one).astype(np.uint32)
        s["%lanemask_ge"] = (~((one << lane) - one)).astype(np.uint32)
        s["%lanemask_gt"] = (~((one << (lane + one)) - one)).astype(np.uint32)
        self.sreg = s
        self.shared = np.full(k.static_shared + shared_bytes, 0xFF, np.uint8)
        self.params = params
        self.exited = np.zeros(n, bool)
        self.race_log = [] if races else None
        self.all_tids = geo.all_tids
        self.full_mask = geo.full
        self.lanebit = geo.lanebit
        self.warp_starts = geo.warp_starts
        self.uniform_warps = n % 32 == 0
        self.lane = geo.lane
        self.warp = geo.warp
        self.warp_base = geo.warp_base


def run_grid(k: CompiledKernel, grid, block, args, shared=0, races=True):
    """Run every block of the launch, in order."""
    params = k.packer.pack(tuple(args))
    geo = Geometry(block)
    with np.errstate(all="ignore"):
        for z in range(grid[2]):
            for y in range(grid[1]):
                for x in range(grid[0]):
                    st = BlockState(k, geo, (x, y, z), grid, params, shared, races)
                    _run_block(k, st, geo, (x, y, z))


def _error(cls, msg, op, block, geo, thread):
    return cls(msg, line=op.line or None, text=op.text if op.line else None, block=block,
               thread=None if thread is None else geo.coords(int(thread)))


def _first(mask):
    return int(np.flatnonzero(mask)[0])


def _run_block(k, st, geo, block):
    ops = k.ops
    n = geo.n
    written = st.written
    regs = st.regs
    pc = 0
    active = geo.full
    full = True
    nact = n
    parked = {}
    waiting = {}      # barrier id -> [pc, waiting mask, arrivals]
    steps = 0
    while True:
        if parked:
            p = parked.pop(pc, None)
            if p is not None:
                active = active | p
                nact = int(np.count_nonzero(active))
            if parked:
                mp = min(parked)
                if mp < pc:
                    parked[pc] = active
                    pc = mp
                    active = parked.pop(mp)
                    nact = int(np.count_nonzero(active))
            full = nact == n
        op = ops[pc]
        steps += nact
        if op.guard is not None:
            gi = op.guard
            if written[gi] is not None and (active & ~written[gi]).any():
                raise _error(UninitializedRegister, "the guard predicate is read before any "
                             "path writes it", op, block, geo, _first(active & ~written[gi]))
            g = regs[gi]
            if op.neg:
                g = ~g
            m = g if full else active & g
        else:
            m = None if full else active
        kind = op.kind
        if kind == NORMAL:
            for r in op.reads:
                w = written[r]
                if w is not None:
                    bad = ~w if m is None else m & ~w
                    if bad.any():
                        name = list(k.ctx.reg_index)[r]
                        raise _error(UninitializedRegister, f"{name} is read before any path "
                                     "writes it", op, block, geo, _first(bad))
            if m is None or m.any():
                try:
                    op.fn(st, m)
                except Fault as f:
                    raise _error(f.cls, f.message, op, block, geo, f.thread) from None
                for r in op.writes:
                    w = written[r]
                    if w is not None:
                        if m is None:
                            written[r] = None
                        else:
                            w = w | m
                            written[r] = None if w.all() else w
            pc += 1
        elif kind == BRA:
            if m is None:
                pc = op.target
                continue
            nt = int(np.count_nonzero(m))
            if nt == nact:
                pc = op.target
            elif nt == 0:
                pc += 1
            else:
                prev = parked.get(op.target)
                parked[op.target] = m if prev is None else prev | m
                active = active & ~m
                nact -= nt
                full = False
                pc += 1
        elif kind == EXIT:
            e = active if m is None else m
            if waiting and e.any():
                bid, (bpc, wmask, _) = next(iter(waiting.items()))
                raise _error(BarrierError, f"thread exits while {int(np.count_nonzero(wmask))} "
                             f"threads wait at bar.sync {bid} on line {ops[bpc].line} "
                             f"(`{ops[bpc].text}`), which it never reached",
                             op, block, geo, _first(e))
            st.exited = st.exited | e
            active = active & ~e
            nact = int(np.count_nonzero(active))
            full = False
            if nact == 0:
                if not parked:
                    break
                pc = min(parked)
                active = parked.pop(pc)
                nact = int(np.count_nonzero(active))
            else:
                pc += 1
        elif kind == BAR:
            arr = active if m is None else m
            na = int(np.count_nonzero(arr))
            if na == 0:
                pc += 1
                continue
            gid, gcnt, arrive_only = op.extra
            bids = np.broadcast_to(np.asarray(gid(st)), (n,))[arr]
            bid = int(bids[0])
            if (bids != bid).any():
                raise _error(BarrierError, "bar.sync barrier id differs between threads",
                             op, block, geo, _first(arr))
            w = waiting.get(bid)
            if w is None:
                w = waiting[bid] = [pc, np.zeros(n, bool), 0]
            elif w[0] != pc and not arrive_only:
                other = ops[w[0]]
                raise _error(BarrierError, f"divergent barrier: threads reach bar.sync {bid} "
                             f"here while {int(np.count_nonzero(w[1]))} threads wait at line "
                             f"{other.line} (`{other.text}`)", op, block, geo, _first(arr))
            if not arrive_only:
                w[1] = w[1] | arr
            w[2] += na
            alive = int(np.count_nonzero(~st.exited))
            expected = alive if gcnt is None else int(np.asarray(gcnt(st)).reshape(-1)[0])
            rest = active & ~arr
            if w[2] >= expected:
                del waiting[bid]
                if st.race_log is not None and expected >= alive and not waiting:
                    _races(k, st, geo, block)
                target = w[0] + 1
                if target == pc + 1:
                    active = rest | w[1]
                else:
                    parked[target] = w[1] if target not in parked else parked[target] | w[1]
                    active = rest | (arr if arrive_only else np.zeros(n, bool))
                nact = int(np.count_nonzero(active))
                pc += 1
            else:
                active = rest | (arr if arrive_only else np.zeros(n, bool))
                nact = int(np.count_nonzero(active))
                if nact == 0:
                    if not parked:
                        missing = ~st.exited & ~w[1]
                        raise _error(BarrierError, f"deadlock: {int(np.count_nonzero(w[1]))} "
                                     f"threads wait at bar.sync {bid} and the others never "
                                     "arrive", op, block, geo,
                                     _first(missing) if missing.any() else None)
                    pc = min(parked)
                    active = parked.pop(pc)
                    nact = int(np.count_nonzero(active))
                else:
                    pc += 1
            full = nact == n
        if steps > MAX_STEPS:
            raise _error(EmulatorError, "too many instructions in one block (endless loop?)",
                         op, block, geo, None)
    k.thread_instructions += steps
    if st.race_log is not None:
        _races(k, st, geo, block)


def _races(k, st, geo, block):
    try:
        check_races(st.race_log, geo.coords)
    except Fault as f:
        raise _error(f.cls, f.message, f.op, block, geo, f.thread) from None
    finally:
        st.race_log.clear()
