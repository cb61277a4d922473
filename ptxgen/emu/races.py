"""Shared-memory race detection between barriers.

Every shared access of a barrier interval is logged as ``(op, threads,
byte offsets, size, kind)``; at the next block-wide barrier (and at the end
of the block) :func:`check_races` looks for a byte that two different
threads touch where at least one access is a plain write, or an atomic
meets a plain access.  Reads by many threads, and atomics by many threads,
are fine.
"""

from __future__ import annotations

import numpy as np

from .errors import Fault, RaceError, describe_op

__all__ = ["check_races"]

_KIND = {0: "reads", 1: "writes", 2: "atomically updates"}


def check_races(log, coords, block_bytes=None, split=None):
    """Raise a :class:`Fault` (RaceError) for the first racing byte in ``log``.

    ``coords(linear_thread) -> (x, y, z)`` names threads in the message.
    Offsets are those of a batch's flat shared buffer (block ``b`` at
    ``b * block_bytes``), so two blocks never share a byte; the message
    gives the offset in the block (modulo ``block_bytes``).

    ``split``: only pairs of an entry before index ``split`` with one from
    ``split`` on are checked (two sets of accesses ordered within each set,
    by different threads across them)."""
    if not log or all(k == 0 for *_, k in log):     # reads never race
        return
    # every access covers whole units of ``unit`` bytes (the gcd of the sizes
    # and offsets), and all bytes of a unit have the same accesses: the search
    # runs over units, and the first racing unit's first byte is the first
    # racing byte
    unit = int(np.gcd.reduce([n for *_, n, _k in log]
                             + [int(np.gcd.reduce(o)) for _, _t, o, _n, _k in log if o.size]))
    unit = max(unit, 1)
    byte, tid, kind, entry = [], [], [], []
    for e, (_, tids, offs, nbytes, k) in enumerate(log):
        n = nbytes // unit
        b = (offs[:, None] // unit + np.arange(n)).reshape(-1)
        byte.append(b)
        tid.append(np.repeat(tids, n))
        kind.append(np.full(b.size, k, np.int8))
        entry.append(np.full(b.size, e, np.int32))
    byte = np.concatenate(byte)
    if byte.size == 0:
        return
    tid, kind, entry = np.concatenate(tid), np.concatenate(kind), np.concatenate(entry)
    order = np.argsort(byte, kind="stable")
    b, t, kd, en = byte[order], tid[order], kind[order], entry[order]
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])

    def any_(m):
        return np.maximum.reduceat(m.astype(np.int8), starts) > 0

    if split is None:
        tmin = np.minimum.reduceat(t, starts)
        tmax = np.maximum.reduceat(t, starts)
        race = (tmin != tmax) & any_(kd != 0) & any_(kd != 2)
    else:
        side = en >= split
        # per kind (read, write, atomic): (before split, from split on)
        rd, wr, at = [(any_(~side & (kd == q)), any_(side & (kd == q))) for q in range(3)]
        # a write meets anything; an atomic meets a read
        race = ((wr[0] & (rd[1] | wr[1] | at[1])) | (wr[1] & (rd[0] | at[0]))
                | (at[0] & rd[1]) | (at[1] & rd[0]))
    if not race.any():
        return
    g = int(np.flatnonzero(race)[0])
    lo = starts[g]
    hi = starts[g + 1] if g + 1 < starts.size else b.size
    gk, gt, ge = kd[lo:hi], t[lo:hi], en[lo:hi]
    # first access that is not a read (or any access if all are atomics), then
    # the first access by another thread (on the other side) that conflicts with it
    if split is None:
        i = int(np.flatnonzero(gk != 0)[0])
        others = gt != gt[i]
    else:
        gs = ge >= split
        i = next(int(c) for c in np.flatnonzero(gk != 0)
                 if (((gs != gs[c]) & ((gk != 2) | (gk[c] != 2))).any()))
        others = gs != gs[i]
    others = others & ((gk != 2) | (gk[i] != 2)) & ((gk != 0) | (gk[i] != 0))
    j = int(np.flatnonzero(others)[0])
    op_i, op_j = log[ge[i]][0], log[ge[j]][0]
    byte = int(b[lo]) * unit
    byte = byte % block_bytes if block_bytes else byte
    msg = (f"shared-memory race on byte {byte}: thread {coords(int(gt[i]))} "
           f"{_KIND[int(gk[i])]} it at {describe_op(op_i)} and thread "
           f"{coords(int(gt[j]))} {_KIND[int(gk[j])]} it at {describe_op(op_j)} "
           f"with no bar.sync between")
    f = Fault(RaceError, msg, int(gt[j]))
    f.op = op_j
    raise f
