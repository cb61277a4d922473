"""SIMT execution of a compiled kernel, a batch of blocks at a time.

The blocks of a launch run in batches of consecutive blocks (linear block
id order, ``x`` fastest); the threads of every block of a batch run
together as numpy arrays of ``blocks_in_batch × threads_per_block``
elements (lane ``b * T + t`` is thread ``t`` of the batch's block ``b``).
Each thread has a PC; the scheduler always runs the group of threads at the
*smallest* PC, so threads that diverge at a branch reconverge where their
paths meet (the immediate post-dominator, for the structured code ptxgen
emits), and a loop runs until its last thread leaves it.  The running group
is a boolean mask plus one PC; threads that branch elsewhere are parked by
PC.  Blocks that take the same path therefore run in lockstep: one numpy
call per instruction for the whole batch.

Per-block state: shared memory is one flat buffer of ``blocks × bytes`` and
a lane adds its block's base to every shared offset (bounds are checked
against the block's own size); ``bar.sync`` parks the arriving threads
until every non-exited thread *of their block* has arrived at the same
instruction; a thread arriving at a different ``bar.sync`` for the same
barrier, or exiting while others of its block wait, is a
:class:`BarrierError`; ``bar.sync a, b`` waits for ``b`` threads, and warps
(not the lanes of one warp) may name different barriers at one instruction.
Between two block-wide barriers of a block every shared-memory access is
logged and, at that block's barrier, checked for a race
(:mod:`ptxgen.emu.races`); a barrier of part of the block orders its
threads' accesses only among themselves (:func:`_races`).  A register read
by a thread for which no path has written it is an
:class:`UninitializedRegister` error.  Global
memory is shared by all blocks and sequentially consistent: a store is
complete for all its lanes before the next instruction runs; atomics are
serialised in lane (= global thread id) order.

Spin-waits: a thread at a ``nanosleep`` is set aside (``yielded``) and
resumes, with every thread set aside, only when no other thread of the
batch can run; a kernel with a nanosleep runs its whole grid as one batch
(its CTAs wait for each other, so they must be resident together), and
its global hand-offs between CTAs are checked (:mod:`.global_races`).
Threads that keep coming back to their nanosleeps with nothing stored in
between are a :class:`SpinDeadlock`.

Thread-block clusters (``.reqnctapercluster``, along x only): a batch holds
whole clusters, so a cluster's CTAs run together and ``.shared::cluster``
accesses reach the peer's window of the batch's buffer.  A thread at
``barrier.cluster.wait`` must have arrived (``barrier.cluster.arrive``) and
is parked until every non-exited thread of its cluster waits at the same
instruction; threads of the cluster waiting at two different waits, or a
thread exiting while others of its cluster wait, is a
:class:`BarrierError`.  At the release every shared access the cluster's
threads logged is checked for races (a race between a peer's remote
access and a CTA's own, across that CTA's ``bar.sync``, goes unseen).
"""

from __future__ import annotations

import numpy as np

from ..abi import ArgPacker
from . import alu, convert, memops, mma, tma, warpops, wgmma  # noqa: F401  (semantics)
from .errors import (BarrierError, EmulatorError, Fault, LaunchConfigError, SpinDeadlock,
                     UninitializedRegister, WarpSyncError, describe_op)
from .operands import BAR, BRA, CBAR, EXIT, NORMAL, SEMANTICS, UINT, YIELD, Ctx, Op, width
from .global_races import GlobalRaces
from .races import check_races

__all__ = ["CompiledKernel", "compile_kernel", "run_grid", "batch_blocks", "MAX_STEPS",
           "BATCH_THREADS", "BATCH_BYTES"]

#: thread-instructions one block may run before the emulator gives up (an
#: endless loop, or a spin-wait on another block); a batch of B blocks may
#: run B times as many
MAX_STEPS = 2_000_000_000

#: most threads (lanes) run together in one batch of blocks
BATCH_THREADS = 1 << 16

#: most bytes of registers + shared memory one batch may hold
BATCH_BYTES = 256 << 20


class CompiledKernel:
    """A kernel's instructions compiled to :class:`~ptxgen.emu.operands.Op`.

    ``sources`` (optional): ``{PTX line: SourceLoc}`` of the module, from
    the builder; errors name the ``file:line`` beside the PTX line."""

    def __init__(self, kt, sources=None):
        self.name = kt.name
        self.kt = kt
        self.ctx = Ctx(kt, sources)
        self.ops = []
        for st in kt.body:
            self.ctx.stmt = st
            op = SEMANTICS[st.op](st, self.ctx)
            op.pc = len(self.ops)
            if sources:
                op.src = sources.get(st.line)
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
        self.reg_names = list(self.ctx.reg_index)
        #: register bytes per thread (values + written flags), for batch sizing
        self.reg_bytes = sum(max(1, w // 8) + 1 for w in self.reg_widths)
        #: the kernel spin-waits (has a nanosleep): its CTAs run as one batch
        self.spins = any(op.kind == YIELD for op in self.ops)
        #: thread-instructions executed (sum over instructions of the threads
        #: in the running group), for the benchmark
        self.thread_instructions = 0


def compile_kernel(kt, sources=None) -> CompiledKernel:
    return CompiledKernel(kt, sources)


def batch_blocks(k: CompiledKernel, nthreads: int, shared_bytes: int, nblocks: int) -> int:
    """How many blocks of ``nthreads`` threads (and ``shared_bytes`` of shared
    memory each) run together: at most :data:`BATCH_THREADS` threads and
    :data:`BATCH_BYTES` of registers and shared memory, at least one block."""
    per_block = nthreads * (k.reg_bytes + 64) + shared_bytes
    b = min(nblocks, BATCH_THREADS // nthreads, BATCH_BYTES // max(1, per_block))
    return max(1, b)


class Geometry:
    """Thread layout of a batch of ``nblocks`` blocks of shape ``block``."""

    def __init__(self, block, nblocks=1):
        bx, by, bz = block
        T = bx * by * bz
        n = T * nblocks
        lin = np.arange(n)
        t = lin % T if nblocks > 1 else lin
        self.n = n
        self.T = T
        self.nblocks = nblocks
        self.block = block
        self.tid = {"x": (t % bx).astype(np.uint32), "y": ((t // bx) % by).astype(np.uint32),
                    "z": (t // (bx * by)).astype(np.uint32)}
        lane = t % 32
        self.lane = lane.astype(np.uint32)
        wpb = (T + 31) // 32
        self.blk = lin // T
        self.warp = (self.blk * wpb + t // 32).astype(np.int64)
        self.warp_in_block = (t // 32).astype(np.uint32)
        self.warp_base = lin - lane
        self.warp_end = np.minimum(self.warp_base + 32, (self.blk + 1) * T)
        self.warp_starts = np.flatnonzero(lane == 0)
        self.lanebit = (np.uint32(1) << self.lane).astype(np.uint32)
        self.full = np.ones(n, bool)
        self.all_tids = lin

    def coords(self, j):
        """(x, y, z) of thread ``j`` (a lane of the batch) in its block."""
        bx, by, _ = self.block
        j = int(j) % self.T
        return (j % bx, (j // bx) % by, j // (bx * by))


class BlockState:
    """Registers, memory views and masks of the batch of blocks being run."""

    __slots__ = ("n", "regs", "written", "sreg", "shared", "shared_size", "shared_base",
                 "params", "exited", "race_log", "race_tagged", "all_tids", "full_mask", "lanebit",
                 "warp_starts", "uniform_warps", "lane", "warp", "warp_base", "warp_end",
                 "block_threads", "nblocks", "blk", "ctaids", "async_copies",
                 "async_committed", "mbarriers", "coords", "cluster_n", "cl_of_lane",
                 "cl_arrived", "cl_waited", "cl_wait", "cl_wait_pc", "wg_pending",
                 "wg_committed", "stores", "gsync")

    def __init__(self, k, geo, ctaids, grid, params, shared_bytes, races, cluster_n=1):
        n = geo.n
        self.n = n
        self.block_threads = geo.T
        self.nblocks = geo.nblocks
        self.blk = geo.blk
        self.ctaids = ctaids
        zeros = {w: np.zeros(n, UINT[w]) for w in (16, 32, 64)}
        zeros[1] = np.zeros(n, bool)
        self.regs = [zeros[w] for w in k.reg_widths]
        unwritten = np.zeros(n, bool)
        self.written = [unwritten] * len(k.reg_widths)
        s = {f"%tid.{c}": geo.tid[c] for c in "xyz"}
        for c, v in zip("xyz", geo.block):
            s[f"%ntid.{c}"] = np.uint32(v)
        for i, c in enumerate("xyz"):
            col = ctaids[:, i]
            if geo.nblocks == 1 or (col == col[0]).all():
                s[f"%ctaid.{c}"] = np.uint32(col[0])
            else:
                s[f"%ctaid.{c}"] = col.astype(np.uint32)[geo.blk]
        for c, v in zip("xyz", grid):
            s[f"%nctaid.{c}"] = np.uint32(v)
        s["%laneid"] = geo.lane
        s["%warpid"] = geo.warp_in_block
        s["%nwarpid"] = np.uint32((geo.T + 31) // 32)
        s["%smid"] = np.uint32(0)
        s["%nsmid"] = np.uint32(1)
        s["%clock"] = np.uint32(0)
        s["%clock64"] = np.uint64(0)
        s["%globaltimer"] = np.uint64(0)
        s["%cluster_nctarank"] = np.uint32(cluster_n)
        rank = (ctaids[:, 0] % cluster_n).astype(np.uint32)
        s["%cluster_ctarank"] = rank[geo.blk] if geo.nblocks > 1 else rank[0]
        # cluster barrier state: arrivals and completed waits per thread, the
        # threads parked at a wait, the wait's pc per cluster of the batch
        self.cluster_n = cluster_n
        self.cl_of_lane = geo.blk // cluster_n
        self.cl_arrived = np.zeros(n, np.int64)
        self.cl_waited = np.zeros(n, np.int64)
        self.cl_wait = np.zeros(n, bool)
        self.cl_wait_pc = np.full(max(1, geo.nblocks // cluster_n), -1, np.int64)
        lane = geo.lane.astype(np.uint64)
        one = np.uint64(1)
        s["%lanemask_eq"] = (one << lane).astype(np.uint32)
        s["%lanemask_lt"] = ((one << lane) - one).astype(np.uint32)
        s["%lanemask_le"] = ((one << (lane + one)) - one).astype(np.uint32)
        s["%lanemask_ge"] = (~((one << lane) - one)).astype(np.uint32)
        s["%lanemask_gt"] = (~((one << (lane + one)) - one)).astype(np.uint32)
        self.sreg = s
        size = k.static_shared + shared_bytes
        self.shared_size = size
        self.shared = np.full(size * geo.nblocks, 0xFF, np.uint8)
        self.shared_base = None if geo.nblocks == 1 else geo.blk * size
        self.params = params
        self.exited = np.zeros(n, bool)
        self.race_log = [] if races else None
        # (lane mask, entries) batches a partial barrier ordered (_races)
        self.race_tagged = []
        # cp.async copies not yet written to shared memory (see memops)
        self.async_copies = []
        self.async_committed = np.zeros(n, np.int64)
        # mbarriers by shared offset (see memops)
        self.mbarriers = {}
        # wgmma accumulators in flight: register -> (thread mask, group per
        # thread), and each thread's committed wgmma groups (see wgmma)
        self.wg_pending = {}
        self.wg_committed = np.zeros(n, np.int64)
        # store and atomic instructions run, the progress a spin-wait waits for
        self.stores = 0
        # the CTAs' global hand-offs, checked for a kernel that spin-waits
        self.gsync = GlobalRaces(ctaids) if races and k.spins else None
        self.coords = geo.coords
        self.all_tids = geo.all_tids
        self.full_mask = geo.full
        self.lanebit = geo.lanebit
        self.warp_starts = geo.warp_starts
        self.uniform_warps = geo.T % 32 == 0
        self.lane = geo.lane
        self.warp = geo.warp
        self.warp_base = geo.warp_base
        self.warp_end = geo.warp_end


def run_grid(k: CompiledKernel, grid, block, args, shared=0, races=True, cluster=1):
    """Run every block of the launch, in batches of consecutive blocks
    (whole clusters of ``cluster`` CTAs along x; ``grid[0]`` a multiple)."""
    params = k.packer.pack(tuple(args))
    gx, gy, gz = grid
    total = gx * gy * gz
    T = block[0] * block[1] * block[2]
    per = batch_blocks(k, T, k.static_shared + shared, total)
    per = max(cluster, per - per % cluster)
    if k.spins and per < total:
        raise LaunchConfigError(f"{k.name} spin-waits (nanosleep) on other CTAs, so its "
                                f"{total} CTAs must run together, as one batch; at most {per} "
                                f"CTAs of {T} threads fit one (the emulator's "
                                f"BATCH_THREADS / BATCH_BYTES)")
    geos = {}
    with np.errstate(all="ignore"):
        for first in range(0, total, per):
            nb = min(per, total - first)
            geo = geos.get(nb)
            if geo is None:
                geo = geos[nb] = Geometry(block, nb)
            lin = np.arange(first, first + nb)
            ctaids = np.stack([lin % gx, (lin // gx) % gy, lin // (gx * gy)], axis=1)
            st = BlockState(k, geo, ctaids, grid, params, shared, races, cluster)
            _run_batch(k, st, geo)


class _Wait:
    """Threads waiting at one barrier id, per block of the batch."""

    __slots__ = ("pc", "mask", "count")

    def __init__(self, nblocks, n):
        self.pc = np.full(nblocks, -1, np.int64)     # bar.sync pc each block waits at
        self.mask = np.zeros(n, bool)                # waiting threads
        self.count = np.zeros(nblocks, np.int64)     # arrivals so far


def _error(cls, msg, op, st, geo, lane, blk=None):
    """``cls`` naming the line, the block of ``lane`` (or batch block ``blk``)
    and the thread."""
    if lane is not None:
        blk = int(lane) // geo.T
    block = tuple(int(v) for v in st.ctaids[0 if blk is None else blk])
    return cls(msg, line=op.line or None, text=op.text if op.line else None, block=block,
               thread=None if lane is None else geo.coords(int(lane)),
               source=op.src if op.line else None)


def _first(mask):
    return int(np.flatnonzero(mask)[0])


def _per_block(mask, geo):
    """Count of ``mask`` lanes in each block of the batch."""
    if geo.nblocks == 1:
        return np.array([np.count_nonzero(mask)], np.int64)
    return np.count_nonzero(mask.reshape(geo.nblocks, geo.T), axis=1)


def _check_uniform(op, st, geo, active, taken):
    """``bra.uni`` promises the guard is the same in every active thread of
    a warp: a warp whose active threads split is a :class:`WarpSyncError`."""
    split = np.zeros(int(geo.warp.max()) + 1, np.int64)
    np.add.at(split, geo.warp[active & taken], 1)
    stay = np.zeros_like(split)
    np.add.at(stay, geo.warp[active & ~taken], 1)
    bad = np.flatnonzero((split > 0) & (stay > 0))
    if bad.size:
        lane = int(np.flatnonzero((geo.warp == bad[0]) & active & ~taken)[0])
        raise _error(WarpSyncError, "bra.uni whose guard differs between the active threads "
                     "of a warp (the branch is declared non-divergent)", op, st, geo, lane)


def _run_batch(k, st, geo):
    ops = k.ops
    n = geo.n
    written = st.written
    regs = st.regs
    pc = 0
    active = geo.full
    full = True
    nact = n
    parked = {}
    yielded = {}      # pc -> threads that passed a nanosleep, run when nothing else can
    spin = _SpinCheck()
    waiting = {}      # barrier id -> _Wait
    steps = 0
    limit = MAX_STEPS * geo.nblocks
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
                             "path writes it", op, st, geo, _first(active & ~written[gi]))
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
                        raise _error(UninitializedRegister, f"{k.reg_names[r]} is read before "
                                     "any path writes it", op, st, geo, _first(bad))
            if st.wg_pending and op.extra is not wgmma.ASYNC:
                try:
                    wgmma.check_pending(op, st, m, k.reg_names)
                except Fault as f:
                    raise _error(f.cls, f.message, op, st, geo, f.thread) from None
            if m is None or m.any():
                try:
                    op.fn(st, m)
                except Fault as f:
                    raise _error(f.cls, f.message, op, st, geo, f.thread) from None
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
                if op.extra == "uni":
                    _check_uniform(op, st, geo, active, m)
                prev = parked.get(op.target)
                parked[op.target] = m if prev is None else prev | m
                active = active & ~m
                nact -= nt
                full = False
                pc += 1
        elif kind == EXIT:
            e = active if m is None else m
            if waiting and e.any():
                _check_exit(ops, op, st, geo, waiting, e)
            if st.cluster_n > 1 and st.cl_wait.any() and e.any():
                _check_cluster_exit(ops, op, st, geo, e)
            st.exited = st.exited | e
            active = active & ~e
            nact = int(np.count_nonzero(active))
            full = False
            if nact == 0:
                if not parked and not yielded:
                    break
                pc, active = _next_group(k, st, geo, parked, yielded, spin)
                nact = int(np.count_nonzero(active))
            else:
                pc += 1
        elif kind == BAR or kind == CBAR:
            arr = active if m is None else m
            if not arr.any():
                pc += 1
                continue
            if kind == BAR:
                active = _barrier(k, op, st, geo, waiting, parked, active, arr)
            else:
                active = _cluster_wait(k, op, st, geo, active, arr)
            nact = int(np.count_nonzero(active))
            if nact == 0:
                if not parked and not yielded:
                    raise (_deadlock(ops, op, st, geo, waiting) if kind == BAR
                           else _cluster_deadlock(ops, st, geo))
                pc, active = _next_group(k, st, geo, parked, yielded, spin)
                nact = int(np.count_nonzero(active))
            else:
                pc += 1
            full = nact == n
        elif kind == YIELD:
            y = active if m is None else m
            if y.any():
                prev = yielded.get(pc + 1)
                yielded[pc + 1] = y if prev is None else prev | y
                active = active & ~y
                nact = int(np.count_nonzero(active))
            if nact == 0:
                pc, active = _next_group(k, st, geo, parked, yielded, spin)
                nact = int(np.count_nonzero(active))
            else:
                pc += 1
            full = nact == n
        if steps > limit:
            who = active if active.any() else ~st.exited
            lane = _first(who) if who.any() else None
            raise _error(EmulatorError, f"too many instructions: more than {MAX_STEPS:,} "
                         "thread-instructions per block (an endless loop, or a spin-wait on "
                         "another block, which the emulator cannot run)", op, st, geo, lane)
    k.thread_instructions += steps
    if waiting and any(w.count.any() for w in waiting.values()):
        raise _deadlock(ops, ops[-1], st, geo, waiting)
    if st.cl_wait.any():
        raise _cluster_deadlock(ops, st, geo)
    if st.race_log is not None:
        _races(k, st, geo, None)


#: rounds in a row in which every running thread spins (resumes from a
#: nanosleep and comes back to it) and nothing is stored, before
#: :class:`SpinDeadlock` (a spin whose exit depends on registers alone,
#: e.g. a bounded retry loop, has this many rounds to leave)
SPIN_ROUNDS = 256


class _SpinCheck:
    """Notices threads spinning forever: the yielded threads resumed the
    same way (same pcs, same threads) with no store or atomic in between."""

    __slots__ = ("last", "idle")

    def __init__(self):
        self.last = None
        self.idle = 0

    def resume(self, k, st, geo, yielded):
        snap = (st.stores, tuple((pc, np.flatnonzero(m).tobytes())
                                 for pc, m in sorted(yielded.items())))
        self.idle = self.idle + 1 if snap == self.last else 0
        self.last = snap
        if self.idle > SPIN_ROUNDS:
            pc, m = min(yielded.items())
            n = sum(int(np.count_nonzero(v)) for v in yielded.values())
            raise _error(SpinDeadlock, f"spin-wait deadlock: {n} threads wait in a nanosleep "
                         f"loop and every other thread has exited or waits at a barrier; no "
                         f"store or atomic changed memory in {SPIN_ROUNDS} rounds",
                         k.ops[pc - 1], st, geo, _first(m))


def _next_group(k, st, geo, parked, yielded, spin):
    """``(pc, threads)`` to run once the running group is empty: the parked
    group at the smallest pc, else (every other thread waits at a barrier or
    has exited) the threads parked at nanosleeps, all of them at once."""
    if not parked:
        spin.resume(k, st, geo, yielded)
        parked.update(yielded)
        yielded.clear()
    pc = min(parked)
    return pc, parked.pop(pc)


def _check_exit(ops, op, st, geo, waiting, e):
    """A thread may not exit while threads of its block wait at a barrier."""
    for bid, w in waiting.items():
        has = w.count > 0
        if not has.any():
            continue
        bad = e & has[geo.blk] if geo.nblocks > 1 else e
        if bad.any():
            lane = _first(bad)
            b = lane // geo.T
            bpc = int(w.pc[b])
            nw = int(np.count_nonzero(w.mask[b * geo.T:(b + 1) * geo.T]))
            where = (f"bar.sync {bid} on {describe_op(ops[bpc])}"
                     if bpc >= 0 else f"barrier {bid}")
            raise _error(BarrierError, f"thread exits while {nw} threads wait at {where}, "
                         "which it never reached", op, st, geo, lane)


def _deadlock(ops, op, st, geo, waiting):
    for bid, w in waiting.items():
        if not w.count.any():
            continue
        b = int(np.flatnonzero(w.count)[0])
        lo, hi = b * geo.T, (b + 1) * geo.T
        missing = ~st.exited[lo:hi] & ~w.mask[lo:hi]
        nw = int(np.count_nonzero(w.mask[lo:hi]))
        bpc = int(w.pc[b])
        at = ops[bpc] if bpc >= 0 else op
        return _error(BarrierError, f"deadlock: {nw} threads wait at bar.sync {bid} and the "
                      "others never arrive", at, st, geo,
                      lo + _first(missing) if missing.any() else None, blk=b)
    return _error(BarrierError, "deadlock: no thread can run", op, st, geo, None)


def _barrier(k, op, st, geo, waiting, parked, active, arr):
    """Threads ``arr`` of the running group arrive at ``bar`` ``op``; returns
    the threads that continue at the next instruction."""
    ops = k.ops
    n, B, T = geo.n, geo.nblocks, geo.T
    pc = op.pc
    gid, gcnt, arrive_only = op.extra
    bidv = np.asarray(gid(st))
    if bidv.ndim == 0:
        groups = [(int(bidv), arr)]
    else:
        vals = np.broadcast_to(bidv, (n,)).astype(np.int64)
        # the id must be the same across a warp (warps may name different
        # barriers at one instruction, as a CTA's slices do)
        wid = np.arange(n, dtype=np.int64) // T * ((T + 31) // 32) + np.arange(n) % T // 32
        nwid = B * ((T + 31) // 32)
        lo = np.full(nwid, np.iinfo(np.int64).max)
        hi = np.full(nwid, -1, np.int64)
        np.minimum.at(lo, wid[arr], vals[arr])
        np.maximum.at(hi, wid[arr], vals[arr])
        bad = (hi >= 0) & (lo != hi)
        if bad.any():
            w_ = int(np.flatnonzero(bad)[0])
            lane = int(np.flatnonzero(arr & (wid == w_))[0])
            raise _error(BarrierError, "bar.sync barrier id differs between the threads of a "
                         "warp", op, st, geo, lane)
        groups = [(int(u), arr & (vals == u)) for u in np.unique(vals[arr])]
    active = active & ~arr
    if arrive_only:
        active = active | arr
    alive = None
    for bid, a in groups:
        cnt = _per_block(a, geo)
        has = cnt > 0
        w = waiting.get(bid)
        if w is None:
            w = waiting[bid] = _Wait(B, n)
        if not arrive_only:
            clash = has & (w.pc >= 0) & (w.pc != pc)
            if clash.any():
                b = int(np.flatnonzero(clash)[0])
                other = ops[int(w.pc[b])]
                nw = int(np.count_nonzero(w.mask[b * T:(b + 1) * T]))
                raise _error(BarrierError, f"divergent barrier: threads reach bar.sync {bid} "
                             f"here while {nw} threads wait at {describe_op(other)}", op, st, geo,
                             b * T + _first(a[b * T:(b + 1) * T]))
            w.pc[has] = pc
            w.mask |= a
        w.count += cnt
        if alive is None:
            alive = _per_block(~st.exited, geo)
        if gcnt is None:
            expected = alive
        else:
            cv = np.broadcast_to(np.asarray(gcnt(st)), (n,))
            firsts = np.argmax(a.reshape(B, T), axis=1) + np.arange(B) * T
            expected = cv[firsts].astype(np.int64)
        release = has & (w.count >= expected)
        if not release.any():
            continue
        rel = release[geo.blk] if B > 1 else np.broadcast_to(release[0], (n,))
        freed = w.mask & rel
        targets = w.pc[release] + 1
        w.mask = w.mask & ~rel
        w.count[release] = 0
        w.pc[release] = -1
        if not w.count.any() and not w.mask.any():
            del waiting[bid]
        if st.race_log is not None:
            # a block checks at a barrier all its threads pass (blocks with
            # no thread left have no accesses to come: check them too)
            full_bar = (release & (expected >= alive)) | (alive == 0)
            for obid, ow in waiting.items():
                if obid != bid:
                    full_bar &= ow.count == 0
            if full_bar.any():
                _races(k, st, geo, None if full_bar.all() else full_bar)
            part = release & ~full_bar
            if part.any():
                # a barrier of some of a block's threads (a CTA's slices):
                # check the block's accesses so far, then set aside those of
                # the threads it released (ordered before what those threads
                # do next, not before the others' accesses)
                _races(k, st, geo, part, drop=freed)
        if not freed.any():
            continue
        tset = np.unique(targets[targets > 0])
        rb = np.flatnonzero(release)
        for t in tset:
            t = int(t)
            if tset.size == 1:
                sel = freed
            else:
                tb = np.zeros(B, bool)
                tb[rb[targets == t]] = True
                sel = freed & tb[geo.blk]
            if t == pc + 1:
                active = active | sel
            else:
                parked[t] = sel if t not in parked else parked[t] | sel
    return active


def _cluster_wait(k, op, st, geo, active, arr):
    """Threads ``arr`` reach ``barrier.cluster.wait`` ``op``; returns the
    threads that continue at the next instruction (those of every cluster
    now complete, including its threads parked here before)."""
    early = arr & (st.cl_arrived <= st.cl_waited)
    if early.any():
        raise _error(BarrierError, "barrier.cluster.wait without a barrier.cluster.arrive "
                     "before it", op, st, geo, _first(early))
    cl = st.cl_of_lane
    C = st.cl_wait_pc.size
    has = np.zeros(C, bool)
    has[cl[arr]] = True
    clash = has & (st.cl_wait_pc >= 0) & (st.cl_wait_pc != op.pc)
    if clash.any():
        c = int(np.flatnonzero(clash)[0])
        other = k.ops[int(st.cl_wait_pc[c])]
        raise _error(BarrierError, f"divergent cluster barrier: threads reach this wait while "
                     f"others of their cluster wait at {describe_op(other)}",
                     op, st, geo, _first(arr & (cl == c)))
    st.cl_wait_pc[has] = op.pc
    st.cl_wait = st.cl_wait | arr
    active = active & ~arr
    pending = (~st.exited & ~st.cl_wait).reshape(C, -1).any(axis=1)
    release = (st.cl_wait_pc == op.pc) & ~pending
    if release.any():
        lanes = release[cl] & st.cl_wait
        st.cl_wait = st.cl_wait & ~lanes
        st.cl_waited = st.cl_waited + lanes
        st.cl_wait_pc[release] = -1
        if st.race_log is not None:
            _races(k, st, geo, np.repeat(release, st.cluster_n))
        active = active | lanes
    return active


def _check_cluster_exit(ops, op, st, geo, e):
    """A thread may not exit while threads of its cluster wait at a
    cluster barrier."""
    cl = st.cl_of_lane
    waits = np.zeros(st.cl_wait_pc.size, bool)
    waits[cl[st.cl_wait]] = True
    bad = e & waits[cl]
    if bad.any():
        lane = _first(bad)
        at = ops[int(st.cl_wait_pc[cl[lane]])]
        nw = int(np.count_nonzero(st.cl_wait & (cl == cl[lane])))
        raise _error(BarrierError, f"thread exits while {nw} threads of its cluster wait at "
                     f"barrier.cluster.wait on {describe_op(at)}, which it never reached",
                     op, st, geo, lane)


def _cluster_deadlock(ops, st, geo):
    cl = st.cl_of_lane
    c = int(cl[_first(st.cl_wait)])
    mine = cl == c
    missing = mine & ~st.exited & ~st.cl_wait
    at = ops[int(st.cl_wait_pc[c])]
    nw = int(np.count_nonzero(st.cl_wait & mine))
    return _error(BarrierError, f"deadlock: {nw} threads of a cluster wait at "
                  "barrier.cluster.wait and the others never arrive", at, st, geo,
                  _first(missing) if missing.any() else _first(st.cl_wait & mine))


def _split(log, lanes):
    """``(in, out)``: the entries of ``log`` cut into the parts of lanes with
    ``lanes[tid]`` true and the rest."""
    ins, outs = [], []
    for e in log:
        op, tids, offs, nbytes, kind = e
        sel = lanes[tids]
        if sel.all():
            ins.append(e)
        elif not sel.any():
            outs.append(e)
        else:
            ins.append((op, tids[sel], offs[sel], nbytes, kind))
            outs.append((op, tids[~sel], offs[~sel], nbytes, kind))
    return ins, outs


def _races(k, st, geo, blocks, drop=None):
    """Check the logged shared accesses of the batch's blocks ``blocks`` (a
    bool per block; ``None``: all) at a barrier and drop what it orders.

    A block-wide barrier orders everything before it: those blocks' entries
    are dropped.  A barrier of part of a block (``drop``: the lanes it
    released, e.g. one slice of a CTA) orders its threads' accesses only
    before what those same threads do next: their entries move to
    ``st.race_tagged`` as a batch with that lane mask, and are checked at
    every later barrier against the accesses of threads outside the mask,
    until a block-wide barrier drops them.  (Batches of one mask are merged;
    two batches are checked against each other one way, the later one's
    accesses by threads outside the earlier mask: exact for groups that are
    disjoint or equal, as a CTA's slices are.)"""
    log = st.race_log
    tagged = st.race_tagged
    if not log and not tagged:
        return
    lanes = None if blocks is None else blocks[geo.blk]
    mine, keep = (log, []) if lanes is None else _split(log, lanes)
    checks = [(mine, None)]
    cut = [(mask, batch if lanes is None else _split(batch, lanes)[0]) for mask, batch in tagged]
    for n_, (mask, tb) in enumerate(cut):
        if tb:
            # the batch against every access of the threads it does not order
            # (not within itself: a partial barrier ordered those), logged or
            # in a later batch
            others = _split(mine, ~mask)[0]
            for o, (_, ob) in enumerate(cut):
                if o > n_:
                    others += _split(ob, ~mask)[0]
            checks.append((tb + others, len(tb)))
    try:
        for c, split in checks:
            check_races(c, geo.coords, st.shared_size, split=split)
    except Fault as f:
        raise _error(f.cls, f.message, f.op, st, geo, f.thread) from None
    if drop is None:
        log[:] = keep
        # the batches' entries of other blocks stay
        left = [] if lanes is None else [(mk, _split(b, ~lanes)[0]) for mk, b in tagged]
        tagged[:] = [(mk, b) for mk, b in left if b]
        return
    moved, stay = _split(log, drop)
    log[:] = stay
    if moved:
        for n_, (mask, batch) in enumerate(tagged):
            if np.array_equal(mask, drop):
                tagged[n_] = (mask, batch + moved)
                break
        else:
            tagged.append((drop.copy(), moved))
