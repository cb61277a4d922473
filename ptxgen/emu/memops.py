"""Memory instructions: ``ld``, ``st``, ``atom``, ``red``, ``cp.async``.

State spaces: ``.param`` reads the launch's packed parameter buffer;
``.global``/``.const`` and generic addresses outside the shared window go
to the global allocations (bounds- and alignment-checked); ``.shared`` and
generic addresses inside the window go to the block's shared memory, and
every shared access is logged for race detection.  8- and 16-bit memory
types load into wider registers sign- or zero-extended and store
truncated.  Atomics are applied in thread order when several threads hit
one address (in rounds: round ``r`` applies the ``r``-th access to every
address at once; else all at once): the result equals a serial execution in
lane order (= global thread id order within a batch of blocks), as the
hardware's equals one for some order.  In a batch of blocks, each block's
shared memory is its own window of the batch's flat buffer.

``.shared::cluster`` addresses come from ``mapa``: a CTA's own shared
offset ``a`` (below ``2**24``, :data:`CLUSTER_SHIFT`) is also its address in
the cluster window, and ``mapa`` turns it into ``a + (rank + 1) << 24`` for
the CTA of that rank; a load or store there reads or writes that CTA's
window of the batch's buffer (a cluster's CTAs always run in one batch).
Touching the shared memory of a CTA whose threads have all exited is a
:class:`MemoryFault`.

``cp.async`` reads its global source when issued but writes shared memory
only when the issuing thread's ``cp.async.wait_group``/``wait_all`` retires
the copy's group: the latest moment the hardware allows, so a kernel that
reads the data before waiting for it sees stale bytes, and the race check
places the write where the wait is.  Copies never waited for are dropped.
"""

from __future__ import annotations

import numpy as np

from ..isa import TABLE
from ..types import type_by_name
from .errors import Fault, MemoryFault, UnsupportedError
from .global_races import sync_class
from .floatops import decode, encode
from .memory import MEMORY, SHARED_WINDOW, gather, scatter
from .numerics import flush32, round_format
from .operands import NAT, UINT, Op, finish_op, getter, semantics, setter, width
from .races import check_races

__all__ = ["READ", "WRITE", "ATOMIC"]

READ, WRITE, ATOMIC = 0, 1, 2
_WINDOW_END = SHARED_WINDOW + (1 << 32)

#: a ``.shared::cluster`` address holds ``rank + 1`` above this bit (0: the CTA's own)
CLUSTER_SHIFT = 24


def _space(stmt):
    for s in ("global", "shared", "param", "local", "const"):
        if s in stmt.mods:
            return s
    if "shared::cluster" in stmt.mods:
        return "cluster"
    if "shared::cta" in stmt.mods:
        return "shared"
    return "generic"


def shared_address(ctx, o, space):
    """``st -> uint64 addresses`` (or a shared offset) for an address operand;
    for ``.param`` the constant byte offset in the parameter buffer."""
    if o[0] != "addr":
        raise ctx.error(f"expected a memory operand [..], got {o!r}")
    base, off = o[1], o[2]
    if space == "param":
        if base[0] != "sym" or base[1] not in ctx.params:
            raise ctx.error("ld.param needs [parameter] or [parameter+offset]", UnsupportedError)
        return ctx.kt.param_offsets[base[1]] + off, ctx.params[base[1]].size
    if base[0] == "sym":
        if base[1] not in ctx.shared_offsets:
            raise ctx.error(f"{base[1]} is not a shared array")
        val = ctx.shared_offsets[base[1]] + off
        if space == "generic":
            val += SHARED_WINDOW
        const = np.uint64(val)
        return (lambda st: const), None
    if base[0] == "imm":
        const = np.uint64(base[2] + off)
        return (lambda st: const), None
    i = ctx.reg(base[1])
    rw = width(ctx.reg_types[i])
    delta = np.uint64(off & 0xFFFFFFFFFFFFFFFF)
    if rw == 64:
        if off:
            return (lambda st: st.regs[i] + delta), None
        return (lambda st: st.regs[i]), None
    if rw == 32:
        return (lambda st: st.regs[i].astype(np.uint64) + delta), None
    raise ctx.error(f"address register {base[1]} must be 32 or 64 bits")


class Access:
    """One instruction's memory access for the executing threads."""

    __slots__ = ("ctx_space", "size", "vec", "what", "op", "sync")

    def __init__(self, space, size, vec, what, op, sync=(False, False, False)):
        self.ctx_space = space
        self.size = size
        self.vec = vec
        self.what = what
        self.op = op
        #: (strong, acquire, release) for the global race check (global_races)
        self.sync = sync

    def parts(self, st, addr, tids, kind, log=True):
        """(buffer, byte offsets, selection) triples for ``addr``; logs shared
        accesses for race detection (unless ``log`` is false)."""
        nbytes = self.size * self.vec
        if addr.size and (addr % np.uint64(nbytes)).any():
            j = int(np.flatnonzero(addr % np.uint64(nbytes))[0])
            raise Fault(MemoryFault, f"misaligned {self.what} of {nbytes} bytes at "
                        f"0x{int(addr[j]):x}", tids[j])
        space = self.ctx_space
        if space == "generic":
            in_sh = (addr >= np.uint64(SHARED_WINDOW)) & (addr < np.uint64(_WINDOW_END))
            if not in_sh.any():
                space = "global"
            elif in_sh.all():
                space = "shared"
                addr = addr - np.uint64(SHARED_WINDOW)
            else:
                out = []
                for sel, sp in ((in_sh, "shared"), (~in_sh, "global")):
                    a = addr[sel] - (np.uint64(SHARED_WINDOW) if sp == "shared" else np.uint64(0))
                    sub = self._one(st, sp, a, tids[sel], kind, log)
                    out += [(b, o, sel if s is None else _compose(sel, s)) for b, o, s in sub]
                return out
        return self._one(st, space, addr, tids, kind, log)

    def _one(self, st, space, addr, tids, kind, log=True):
        nbytes = self.size * self.vec
        if space == "cluster":
            return self._cluster(st, addr, tids, kind, log)
        if space == "shared":
            size = st.shared_size
            bad = addr + np.uint64(nbytes) > np.uint64(size)
            if bad.any():
                j = int(np.flatnonzero(bad)[0])
                raise Fault(MemoryFault, f"shared {self.what} of {nbytes} bytes at offset "
                            f"{int(addr[j])} is outside the block's {size} bytes of shared memory",
                            tids[j])
            offs = addr.astype(np.int64)
            if st.shared_base is not None:      # a batch of blocks: each its own window
                offs += st.shared_base if tids is st.all_tids else st.shared_base[tids]
            if log and st.race_log is not None:
                st.race_log.append((self.op, tids, offs, nbytes, kind))
            return [(st.shared, offs, None)]
        try:
            parts, _ = MEMORY.locate(addr, nbytes, f"global {self.what}")
        except Fault as f:
            f.thread = tids[f.thread]
            raise
        if st.gsync is not None and self.op is not None:
            for buf, offs, sel in parts:
                t, a = (tids, addr) if sel is None else (tids[sel], addr[sel])
                st.gsync.access(self.op, self.sync, kind, buf, offs, nbytes, st.blk[t], t, a)
        return parts

    def _cluster(self, st, addr, tids, kind, log):
        """A ``.shared::cluster`` access: the window of the CTA the address
        names (see the module docstring)."""
        nbytes = self.size * self.vec
        size = st.shared_size
        rank = (addr >> np.uint64(CLUSTER_SHIFT)).astype(np.int64) - 1
        off = (addr & np.uint64((1 << CLUSTER_SHIFT) - 1)).astype(np.int64)
        blk = st.blk[tids] if st.nblocks > 1 else np.zeros(tids.size, np.int64)
        n = st.cluster_n
        mine = rank < 0
        target = np.where(mine, blk, blk - blk % n + rank)
        bad = (rank >= n) | (off + nbytes > size)
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            what = (f"names cluster rank {int(rank[j])} of a cluster of {n}" if rank[j] >= n
                    else f"is outside the {size} bytes of shared memory")
            raise Fault(MemoryFault, f"shared::cluster {self.what} of {nbytes} bytes at 0x"
                        f"{int(addr[j]):x} {what}", tids[j])
        if n > 1:
            T = st.block_threads
            gone = st.exited.reshape(-1, T).all(axis=1)
            dead = gone[target] & ~mine
            if dead.any():
                j = int(np.flatnonzero(dead)[0])
                raise Fault(MemoryFault, f"shared::cluster {self.what} of {nbytes} bytes to "
                            f"cluster rank {int(rank[j])}, whose threads have all exited",
                            tids[j])
        offs = target * size + off
        if log and st.race_log is not None:
            st.race_log.append((self.op, tids, offs, nbytes, kind))
        return [(st.shared, offs, None)]


def _compose(outer, inner):
    full = np.zeros(outer.shape, bool)
    full[np.flatnonzero(outer)[inner]] = True
    return full


def active_threads(st, m):
    return st.all_tids if m is None else np.flatnonzero(m)


def addr_for(get, st, tids, m):
    a = np.asarray(get(st), dtype=np.uint64)
    if a.ndim == 0:
        return np.full(tids.size, a, dtype=np.uint64)
    return a if m is None else a[tids]


@semantics("ld")
def _ld(stmt, ctx):
    ty = stmt.types[0]
    space = _space(stmt)
    if space == "local":
        raise ctx.error("ld.local: the emulator has no local memory", UnsupportedError)
    vec = 4 if "v4" in stmt.mods else 2 if "v2" in stmt.mods else 1
    d = stmt.operands[0]
    dsts = d[1] if d[0] == "vec" else [d]
    if len(dsts) != vec:
        raise ctx.error(f"ld with .v{vec} needs {vec} destination registers")
    size = max(1, ty.bits // 8)
    mem_ty = type_by_name(ty.name)
    puts = [setter(ctx, o, mem_ty) for o in dsts]
    nat = NAT[ty.name]
    u = UINT[size * 8]
    get, psize = shared_address(ctx, stmt.operands[1], space)
    op = Op()
    if space == "param":
        off = get
        if off + size * vec > ctx.kt.param_size:
            raise ctx.error("ld.param reads past the end of the parameters")

        def fn(st, m):
            vals = np.frombuffer(st.params, dtype=u, count=vec, offset=off)
            for put, v in zip(puts, vals):
                put(st, np.full(st.n, v.view(nat)), m)
    else:
        acc = Access(space, size, vec, "load", op, sync_class(stmt.mods))

        def fn(st, m):
            tids = active_threads(st, m)
            if tids.size == 0:
                return
            addr = addr_for(get, st, tids, m)
            words = [np.zeros(tids.size, u) for _ in range(vec)]
            for buf, offs, sel in acc.parts(st, addr, tids, READ):
                got = gather(buf, offs, size, vec)
                for w, g in zip(words, got):
                    if sel is None:
                        w[:] = g
                    else:
                        w[sel] = g
            for put, w in zip(puts, words):
                if m is None:
                    put(st, w.view(nat), None)
                else:
                    full = np.zeros(st.n, u)
                    full[tids] = w
                    put(st, full.view(nat), m)
    op.fn = fn
    return finish_op(op, stmt, ctx, TABLE["ld"])


@semantics("st")
def _st(stmt, ctx):
    ty = stmt.types[0]
    space = _space(stmt)
    if space in ("local", "param"):
        raise ctx.error(f"st.{space} is not supported by the emulator", UnsupportedError)
    vec = 4 if "v4" in stmt.mods else 2 if "v2" in stmt.mods else 1
    s = stmt.operands[1]
    srcs = s[1] if s[0] == "vec" else [s]
    if len(srcs) != vec:
        raise ctx.error(f"st with .v{vec} needs {vec} source registers")
    size = max(1, ty.bits // 8)
    gets = [getter(ctx, o, ty) for o in srcs]
    u = UINT[size * 8]
    get, _ = shared_address(ctx, stmt.operands[0], space)
    op = Op()
    acc = Access(space, size, vec, "store", op, sync_class(stmt.mods))

    def fn(st, m):
        tids = active_threads(st, m)
        if tids.size == 0:
            return
        addr = addr_for(get, st, tids, m)
        vals = []
        for g in gets:
            v = np.asarray(g(st))
            v = v.view(u) if v.dtype.itemsize == size else v.astype(u)
            if v.ndim == 0:
                v = np.full(tids.size, v, dtype=u)
            elif v.shape[0] != tids.size:
                v = v[tids]
            vals.append(v)
        for buf, offs, sel in acc.parts(st, addr, tids, WRITE):
            scatter(buf, offs, size, vals if sel is None else [v[sel] for v in vals])
        st.stores += 1
    op.fn = fn
    return finish_op(op, stmt, ctx, TABLE["st"])


@semantics("mapa")
def _mapa(stmt, ctx):
    ty = stmt.types[0]
    if "shared::cluster" not in stmt.mods:
        raise ctx.error("mapa: the emulator runs the .shared::cluster form", UnsupportedError)
    a = getter(ctx, stmt.operands[1], ty)
    r = getter(ctx, stmt.operands[2], type_by_name("u32"))
    put = setter(ctx, stmt.operands[0], ty)
    nat = NAT[ty.name]
    lim = 1 << CLUSTER_SHIFT

    def fn(st, m):
        av = np.broadcast_to(np.asarray(a(st)).astype(np.int64), (st.n,))
        rv = np.broadcast_to(np.asarray(r(st)).astype(np.int64), (st.n,))
        on = np.ones(st.n, bool) if m is None else m
        bad = on & ((rv >= st.cluster_n) | (av >= lim))
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            what = (f"rank {int(rv[j])} is outside the cluster of {st.cluster_n} CTAs"
                    if rv[j] >= st.cluster_n else
                    f"0x{int(av[j]):x} is not a shared address of this CTA")
            raise Fault(MemoryFault, f"mapa: {what}", j)
        put(st, (av + ((rv + 1) << CLUSTER_SHIFT)).astype(nat), m)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE["mapa"])


def _atom_fn(kind, ty):
    """new = f(old, b, c) for one atomic operation, natural type of ``ty``."""
    nat = NAT[ty.name]
    if kind == "add":
        if ty.name == "f32":
            return lambda old, b, c: flush32(flush32(old) + flush32(b)).astype(np.float32)
        if ty.name in ("f16x2", "bf16x2"):
            fmt = ty.name[:-2]

            def addx2(old, b, c):
                lanes = [round_format(x + y, fmt, "rn") for x, y in zip(decode(old, ty), decode(b, ty))]
                return encode(lanes, ty)
            return addx2
        return lambda old, b, c: (old + b).astype(nat)
    if kind in ("min", "max"):
        if ty.is_float:
            f = np.fmin if kind == "min" else np.fmax
        else:
            f = np.minimum if kind == "min" else np.maximum
        return lambda old, b, c: f(old, b).astype(nat)
    if kind == "inc":
        return lambda old, b, c: np.where(old >= b, nat(0), old + nat(1)).astype(nat)
    if kind == "dec":
        return lambda old, b, c: np.where((old == 0) | (old > b), b, old - nat(1)).astype(nat)
    if kind in ("and", "or", "xor"):
        f = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[kind]
        return lambda old, b, c: f(old, b).astype(nat)
    if kind == "exch":
        return lambda old, b, c: np.asarray(b, dtype=nat)
    if kind == "cas":
        return lambda old, b, c: np.where(old.view(UINT[ty.bits]) == np.asarray(b, dtype=nat).view(UINT[ty.bits]),
                                          c, old).astype(nat)
    raise AssertionError(kind)


def _atomic(stmt, ctx, has_dst):
    ty = stmt.types[0]
    space = _space(stmt)
    kind = next(m for m in stmt.mods if m in ("add", "min", "max", "inc", "dec", "and", "or",
                                               "xor", "cas", "exch"))
    ops = stmt.operands
    if has_dst:
        put = setter(ctx, ops[0], ty)
        ops = ops[1:]
    get, _ = shared_address(ctx, ops[0], space)
    b = getter(ctx, ops[1], ty)
    c = getter(ctx, ops[2], ty) if len(ops) > 2 else (lambda st: None)
    if kind == "cas" and len(ops) < 3:
        raise ctx.error("atom.cas needs a compare and a new value")
    size = width(ty) // 8
    u = UINT[size * 8]
    nat = NAT[ty.name]
    f = _atom_fn(kind, ty)
    op = Op()
    acc = Access(space, size, 1, "atomic", op, sync_class(stmt.mods, atomic=True))

    def pick(v, tids, m):
        v = np.asarray(v, dtype=nat) if v is not None else None
        if v is None:
            return None
        if v.ndim == 0:
            return np.full(tids.size, v, dtype=nat)
        return v if m is None else v[tids]

    def fn(st, m):
        tids = active_threads(st, m)
        if tids.size == 0:
            return
        addr = addr_for(get, st, tids, m)
        bv, cv = pick(b(st), tids, m), pick(c(st), tids, m)
        olds = np.zeros(tids.size, nat)
        for buf, offs, sel in acc.parts(st, addr, tids, ATOMIC):
            ii = np.arange(tids.size) if sel is None else np.flatnonzero(sel)
            if np.unique(offs).size == offs.size:
                old = gather(buf, offs, size, 1)[0].view(nat)
                new = f(old, bv[ii], None if cv is None else cv[ii])
                scatter(buf, offs, size, [np.asarray(new, dtype=nat).view(u)])
                olds[ii] = old
                continue
            # serial in thread order per address: round r applies, at once,
            # the r-th access to each address (addresses are independent)
            order = np.argsort(offs, kind="stable")
            so = offs[order]
            starts = np.r_[True, so[1:] != so[:-1]]
            grp = np.cumsum(starts) - 1
            rank = np.empty(offs.size, np.int64)
            rank[order] = np.arange(offs.size) - np.flatnonzero(starts)[grp]
            for r in range(int(rank.max()) + 1):
                sel = np.flatnonzero(rank == r)
                o, jj = offs[sel], ii[sel]
                old = gather(buf, o, size, 1)[0].view(nat)
                new = f(old, bv[jj], None if cv is None else cv[jj])
                scatter(buf, o, size, [np.asarray(new, dtype=nat).view(u)])
                olds[jj] = old
        st.stores += 1
        if has_dst:
            if m is None:
                put(st, olds, None)
            else:
                full = np.zeros(st.n, nat)
                full[tids] = olds
                put(st, full, m)
    op.fn = fn
    return finish_op(op, stmt, ctx, TABLE[stmt.op])


@semantics("atom")
def _atom(stmt, ctx):
    return _atomic(stmt, ctx, True)


@semantics("red")
def _red(stmt, ctx):
    return _atomic(stmt, ctx, False)


@semantics("cp.async")
def _cp_async(stmt, ctx):
    if "global" not in stmt.mods or not ({"shared", "shared::cta"} & set(stmt.mods)):
        raise ctx.error("cp.async copies .global to .shared")
    size_op = stmt.operands[2]
    if size_op[0] != "imm" or size_op[2] not in (4, 8, 16):
        raise ctx.error("cp.async: the copy size must be the constant 4, 8 or 16")
    nbytes = int(size_op[2])
    if "cg" in stmt.mods and nbytes != 16:
        raise ctx.error("cp.async.cg copies 16 bytes only")
    get_dst, _ = shared_address(ctx, stmt.operands[0], "shared")
    get_src, _ = shared_address(ctx, stmt.operands[1], "global")
    op = Op()
    src_acc = Access("global", 1, nbytes, "cp.async read", op)
    dst_acc = Access("shared", 1, nbytes, "cp.async write", op)

    def fn(st, m):
        tids = active_threads(st, m)
        if tids.size == 0:
            return
        src = addr_for(get_src, st, tids, m)
        data = np.zeros((tids.size, nbytes), np.uint8)
        for buf, offs, sel in src_acc.parts(st, src, tids, READ):
            got = buf[offs[:, None] + np.arange(nbytes)]
            if sel is None:
                data[:] = got
            else:
                data[sel] = got
        dst = addr_for(get_dst, st, tids, m)
        # logged for races when written (by the wait), not now
        (_, offs, _), = dst_acc.parts(st, dst, tids, WRITE, log=False)
        st.async_copies.append([op, tids, st.async_committed[tids].copy(), offs, data, nbytes])
    op.fn = fn
    return finish_op(op, stmt, ctx, TABLE["cp.async"])


def _retire(st, tids, pending):
    """Write the copies of threads ``tids`` whose group is older than their
    ``pending`` most recent committed groups."""
    if tids.size == 0 or not st.async_copies:
        return
    mine = np.zeros(st.n, bool)
    mine[tids] = True
    keep = []
    for e in st.async_copies:
        op, etids, group, offs, data, nbytes = e
        done = mine[etids] & (group < st.async_committed[etids] - pending)
        if done.any():
            o = offs[done]
            st.shared[o[:, None] + np.arange(nbytes)] = data[done]
            if st.race_log is not None:
                st.race_log.append((op, etids[done], o, nbytes, WRITE))
        if not done.all():
            keep.append([op, etids[~done], group[~done], offs[~done], data[~done], nbytes])
    st.async_copies[:] = keep


@semantics("cp.async.commit_group", "cp.async.wait_group", "cp.async.wait_all")
def _cp_async_sync(stmt, ctx):
    name = stmt.op
    if name == "cp.async.wait_group":
        o = stmt.operands[0]
        if o[0] != "imm":
            raise ctx.error("cp.async.wait_group takes a constant")
        pending = int(o[2])

    def fn(st, m):
        tids = active_threads(st, m)
        if name != "cp.async.wait_group":        # commit_group, wait_all
            st.async_committed[tids] += 1
        if name != "cp.async.commit_group":
            _retire(st, tids, 0 if name == "cp.async.wait_all" else pending)
    return finish_op(Op(fn=fn), stmt, ctx, TABLE[name])


@semantics("cp.async.bulk.prefetch.L2")
def _prefetch_l2_bulk(stmt, ctx):
    """A hint with no effect on memory; the range is still checked (16-byte
    aligned start, a positive multiple of 16 bytes, inside one allocation),
    since the hardware faults on a bad one."""
    if "global" not in stmt.mods:
        raise ctx.error("cp.async.bulk.prefetch.L2 needs .global")
    get_src, _ = shared_address(ctx, stmt.operands[0], "global")
    get_size = getter(ctx, stmt.operands[1], type_by_name("u32"))

    def fn(st, m):
        tids = active_threads(st, m)
        if tids.size == 0:
            return
        src = addr_for(get_src, st, tids, m)
        size = np.asarray(get_size(st), dtype=np.uint64)
        size = np.full(tids.size, size, np.uint64) if size.ndim == 0 else (
            size if m is None else size[tids])
        for j in range(tids.size):
            a, n = int(src[j]), int(size[j])
            if a % 16 or n == 0 or n % 16:
                raise Fault(MemoryFault, f"cp.async.bulk.prefetch.L2 of {n} bytes at 0x{a:x}: "
                            f"the address must be 16-byte aligned and the size a positive "
                            f"multiple of 16", tids[j])
            try:
                MEMORY.locate(np.array([a], np.uint64), n, "global cp.async.bulk.prefetch.L2")
            except Fault as f:
                f.thread = tids[j]
                raise
    return finish_op(Op(fn=fn), stmt, ctx, TABLE[stmt.op])


# ---------------------------------------------------------------- mbarriers
#
# An mbarrier's state lives beside the block's shared memory, keyed by its
# byte offset in the batch's flat buffer: the arrivals a phase expects, those
# still pending, the bytes still pending (``expect_tx`` raises them, a bulk
# copy's completion lowers them) and the phase number.  A phase completes when
# both counts reach zero.  A bulk copy reads its source when issued but writes
# shared memory only when a thread's ``try_wait`` first sees its phase
# complete (the latest moment the hardware allows, as for ``cp.async``), so a
# kernel that reads the stage without waiting sees stale bytes.  For the race
# check the copy's write is logged when it is issued, by the issuing thread,
# so a stage still being read in that barrier interval is a race (put a
# ``bar.sync`` between the readers and the next copy into their stage).  When
# a wait first sees the copy land, the accesses logged up to the copy are
# checked against it and its entry is dropped: reads after the wait are
# ordered by the mbarrier, not racing.

#: failed polls of one mbarrier, with nothing arriving, before the emulator
#: calls it a deadlock (a phase that nothing can complete)
_MBAR_SPIN_LIMIT = 256


class _MBarrier:
    __slots__ = ("count", "pending", "tx", "phase", "copies", "spins")

    def __init__(self, count):
        self.count = self.pending = count
        self.tx = 0
        self.phase = 0
        self.copies = []            # [phase, offs, data] not yet written
        self.spins = 0

    def settle(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count


def mbar_offsets(ctx, o, what):
    get, _ = shared_address(ctx, o, "shared")
    acc = Access("shared", 8, 1, what, None)
    return get, acc


def _mbar_state(st, off, tid, what):
    mb = st.mbarriers.get(int(off))
    if mb is None:
        raise Fault(MemoryFault, f"{what} on shared offset {int(off) % st.shared_size}, "
                    f"which no mbarrier.init set up", tid)
    return mb


def land_bulk_copy(st, op, tid, t, d, data, nb, boff, what):
    """A bulk copy of ``data`` (``nb`` bytes) by thread ``t`` to shared offset ``d``,
    completing on the mbarrier at ``boff``: logged for the race check now, by
    the issuing thread, and written to shared memory when the barrier's
    phase completes (its transaction count reaches zero)."""
    base = d + (0 if st.shared_base is None else int(st.shared_base[t]))
    entry = (op, tid, np.array([base], np.int64), nb, WRITE)
    if st.race_log is not None:
        st.race_log.append(entry)
    mb = _mbar_state(st, boff, t, what)
    mb.copies.append([mb.phase, base, data, entry])
    mb.tx -= nb
    mb.spins = 0
    mb.settle()


def _land_in_race_log(st, entry):
    """A bulk copy seen landed: check the accesses logged before it against
    it, then drop its entry (what comes after the wait is ordered)."""
    log = st.race_log
    if log is None:
        return
    idx = next((i for i, e in enumerate(log) if e is entry), None)
    if idx is None:
        return
    check_races(log[:idx + 1], st.coords, st.shared_size)
    del log[idx]


def _mbar_instr(stmt, ctx, kind, step, dst_ty=None):
    """The frame the mbarrier instructions share: ``[dst,] [mbar], value``;
    ``step(st, offset, thread, value)`` runs for each executing thread in
    thread order and returns its ``dst`` value (``dst_ty``: its type)."""
    name = stmt.op
    ai = 0 if dst_ty is None else 1
    put = setter(ctx, stmt.operands[0], type_by_name(dst_ty)) if dst_ty else None
    get, acc = mbar_offsets(ctx, stmt.operands[ai], name)
    get_v = getter(ctx, stmt.operands[ai + 1], type_by_name("u32"))
    op = Op()
    acc.op = op

    def fn(st, m):
        tids = active_threads(st, m)
        if tids.size == 0:
            return
        (_, offs, _), = acc.parts(st, addr_for(get, st, tids, m), tids, kind)
        v = np.asarray(get_v(st))
        out = np.zeros(st.n, bool if dst_ty == "pred" else np.uint64) if put else None
        for off, t in zip(offs, tids):
            r = step(st, int(off), int(t), int(v if v.ndim == 0 else v[t]))
            if out is not None:
                out[t] = r
        if put:
            put(st, out, m)
    op.fn = fn
    return finish_op(op, stmt, ctx, TABLE[name])


@semantics("mbarrier.init")
def _mbarrier_init(stmt, ctx):
    def step(st, off, t, count):
        if not 1 <= count < 1 << 20:
            raise Fault(MemoryFault, f"mbarrier.init with count {count} (1..2^20-1)", t)
        st.mbarriers[off] = _MBarrier(count)
        st.shared[off:off + 8] = 0
    return _mbar_instr(stmt, ctx, WRITE, step)


@semantics("mbarrier.arrive.expect_tx")
def _mbarrier_arrive_tx(stmt, ctx):
    def step(st, off, t, nbytes):
        mb = _mbar_state(st, off, t, "mbarrier.arrive.expect_tx")
        if mb.pending == 0:
            raise Fault(MemoryFault, "mbarrier.arrive.expect_tx on an mbarrier with no "
                        "arrival pending", t)
        state = mb.phase
        mb.tx += nbytes
        mb.pending -= 1
        mb.spins = 0
        mb.settle()
        return state
    return _mbar_instr(stmt, ctx, ATOMIC, step, "b64")


@semantics("mbarrier.try_wait.parity")
def _mbarrier_try_wait(stmt, ctx):
    def step(st, off, t, parity):
        mb = _mbar_state(st, off, t, "mbarrier.try_wait.parity")
        p = parity & 1
        # the phase of parity p is complete when the current one's differs
        if (mb.phase & 1) == p:
            mb.spins += 1
            if mb.spins > _MBAR_SPIN_LIMIT * st.n:
                raise Fault(MemoryFault, f"mbarrier.try_wait.parity: the phase of parity {p} "
                            f"never completes ({mb.pending} arrivals and {mb.tx} bytes "
                            f"pending; deadlock)", t)
            return False
        # its copies land now, at the latest (every phase before the current)
        keep = []
        for c in mb.copies:
            if c[0] < mb.phase:
                st.shared[c[1]:c[1] + c[2].size] = c[2]
                _land_in_race_log(st, c[3])
            else:
                keep.append(c)
        mb.copies[:] = keep
        mb.spins = 0
        return True
    return _mbar_instr(stmt, ctx, ATOMIC, step, "pred")


@semantics("cp.async.bulk")
def _cp_async_bulk(stmt, ctx):
    if tuple(stmt.mods[:2]) != ("shared::cluster", "global"):
        raise ctx.error("cp.async.bulk: the emulator runs the global -> shared::cluster form")
    get_dst, _ = shared_address(ctx, stmt.operands[0], "shared")
    get_src, _ = shared_address(ctx, stmt.operands[1], "global")
    get_n = getter(ctx, stmt.operands[2], type_by_name("u32"))
    get_bar, bar_acc = mbar_offsets(ctx, stmt.operands[3], "cp.async.bulk")
    op = Op()
    bar_acc.op = op

    def fn(st, m):
        tids = active_threads(st, m)
        if tids.size == 0:
            return
        src = addr_for(get_src, st, tids, m)
        dst = addr_for(get_dst, st, tids, m)
        n = np.asarray(get_n(st))
        (_, boffs, _), = bar_acc.parts(st, addr_for(get_bar, st, tids, m), tids, ATOMIC)
        for j in range(tids.size):
            t = int(tids[j])
            nb = int(n if n.ndim == 0 else n[t])
            a, d = int(src[j]), int(dst[j])
            if nb <= 0 or nb % 16 or a % 16 or d % 16:
                raise Fault(MemoryFault, f"cp.async.bulk of {nb} bytes from 0x{a:x} to shared "
                            f"offset {d}: addresses must be 16-byte aligned and the size a "
                            f"positive multiple of 16", t)
            if d + nb > st.shared_size:
                raise Fault(MemoryFault, f"cp.async.bulk of {nb} bytes to shared offset {d} "
                            f"runs past the block's {st.shared_size} bytes of shared memory", t)
            try:
                parts, _ = MEMORY.locate(np.array([a], np.uint64), nb, "global cp.async.bulk read")
            except Fault as f:
                f.thread = t
                raise
            (buf, offs, _), = parts
            data = buf[int(offs[0]):int(offs[0]) + nb].copy()
            land_bulk_copy(st, op, tids[j:j + 1], t, d, data, nb, boffs[j], "cp.async.bulk")
    op.fn = fn
    return finish_op(op, stmt, ctx, TABLE["cp.async.bulk"])
