"""Global-memory races between the CTAs of a kernel that spin-waits.

The CTAs of a persistent kernel hand data to each other through global
memory while it runs: a CTA writes, then raises a counter with a release;
another waits for the counter with an acquire, then reads.  This module
checks those hand-offs with vector clocks (happens-before, as in
FastTrack), at the granularity of CTAs and 4-byte words:

- each CTA ``c`` has a clock vector ``VC[c]``; a release by ``c`` (a
  ``st``/``red``/``atom`` with ``.release`` or ``.acq_rel``, or any strong
  write after a ``fence.acq_rel``/``fence.sc``/``membar.gl``) joins
  ``VC[c]`` (as of the release, or of the fence) into the word's sync
  vector and ticks ``VC[c][c]``; an acquire by ``d`` (an ``ld``/``atom``
  with ``.acquire``/``.acq_rel``, or a fence after strong reads) joins the
  word's sync vector into ``VC[d]``;
- a plain (weak) load or store of a word checks the word's last write by
  another CTA (and a store, the reads by other CTAs since that write)
  against the accessing CTA's clock: an access the CTA cannot know to
  come after is a :class:`RaceError` naming both instructions.

Strong accesses (``.relaxed``, ``.acquire``, ``.release``, ``.volatile``,
atomics) are synchronisation, not data: they are not checked against each
other, as on the GPU.  Operations of ``.cta`` scope order nothing between
CTAs.  What it cannot see: the order of the threads *inside* a CTA (a
CTA's accesses count as one thread's, so a store another thread of the CTA
makes after the releasing thread's release, with no ``bar.sync`` between,
still counts as released), the asynchronous copies' writes
(``cp.async``/bulk, whose reads are checked), and races between CTAs of a
kernel that does not spin-wait (the emulator runs those in batches, one
after another).
"""

from __future__ import annotations

import numpy as np

from .errors import Fault, RaceError, describe_op

__all__ = ["GlobalRaces", "sync_class"]

_WORD = 4


def sync_class(mods, atomic=False):
    """``(strong, acquire, release)`` of a memory instruction with modifiers
    ``mods`` (``.cta`` scope: neither acquires nor releases across CTAs)."""
    strong = atomic or any(m in mods for m in ("relaxed", "acquire", "release", "acq_rel",
                                                "volatile"))
    cross = "cta" not in mods
    acq = cross and any(m in mods for m in ("acquire", "acq_rel"))
    rel = cross and any(m in mods for m in ("release", "acq_rel"))
    return strong, acq, rel


class _Map:
    """Per allocation: each word's last writer (CTA, clock, instruction) and
    the clock of each CTA's last read since that write."""

    __slots__ = ("wcta", "wclock", "wop", "rclock", "rop")

    def __init__(self, nwords, nctas):
        self.wcta = np.full(nwords, -1, np.int32)
        self.wclock = np.zeros(nwords, np.int64)
        self.wop = np.full(nwords, -1, np.int32)
        self.rclock = np.zeros((nctas, nwords), np.int64)
        self.rop = np.full((nctas, nwords), -1, np.int32)


class GlobalRaces:
    """The happens-before state of one batch of ``nctas`` CTAs."""

    def __init__(self, ctaids):
        nctas = len(ctaids)
        self.ctaids = ctaids
        self.n = nctas
        self.vc = np.eye(nctas, dtype=np.int64)
        #: sync vectors joined by strong reads, acquired at the CTA's next fence
        self.pending = np.zeros((nctas, nctas), np.int64)
        #: each CTA's clock at its last fence (what a later strong write releases)
        self.fenced = np.zeros((nctas, nctas), np.int64)
        self.sync = {}        # (allocation id, word) -> sync vector
        self.maps = {}        # allocation id -> _Map
        self.ops = []         # instruction index -> Op, for the messages
        self._op_index = {}

    def _index(self, op):
        i = self._op_index.get(id(op))
        if i is None:
            i = self._op_index[id(op)] = len(self.ops)
            self.ops.append(op)
        return i

    # ------------------------------------------------------------ sync
    def fence(self, ctas):
        """A ``fence.acq_rel``/``fence.sc``/``membar.gl`` by the CTAs ``ctas``."""
        for c in np.unique(ctas):
            np.maximum(self.vc[c], self.pending[c], out=self.vc[c])
            self.fenced[c] = self.vc[c]
            self.vc[c, c] += 1

    def _strong(self, buf, words, ctas, cls, reads, writes):
        strong, acq, rel = cls
        key = id(buf)
        for w, c in zip(words, ctas):
            c = int(c)
            sv = self.sync.get((key, int(w)))
            if reads and sv is not None:
                if acq:
                    np.maximum(self.vc[c], sv, out=self.vc[c])
                else:
                    np.maximum(self.pending[c], sv, out=self.pending[c])
            if writes:
                pub = self.vc[c] if rel else self.fenced[c]
                if pub.any():
                    if sv is None:
                        self.sync[(key, int(w))] = pub.copy()
                    else:
                        np.maximum(sv, pub, out=sv)
                if rel:
                    self.vc[c, c] += 1

    # ------------------------------------------------------------ data
    def access(self, op, cls, kind, buf, offs, nbytes, ctas, tids, addr):
        """Lanes ``tids`` (of the batch's CTAs ``ctas``) access ``nbytes`` at
        byte offsets ``offs`` of the allocation ``buf`` (addresses ``addr``);
        ``kind`` 0 read, 1 write, 2 atomic; ``cls`` from :func:`sync_class`."""
        first = offs // _WORD
        last = (offs + nbytes - 1) // _WORD
        span = int((last - first).max()) + 1 if offs.size else 1
        words = (first[:, None] + np.arange(span)).reshape(-1)
        keep = words <= np.repeat(last, span)
        words = words[keep]
        c = np.repeat(ctas, span)[keep]
        t = np.repeat(tids, span)[keep]
        self._base = int(addr[0]) - int(offs[0]) if offs.size else 0
        if cls[0] or kind == 2:
            self._strong(buf, words, c, cls, kind != 1, kind != 0)
            return
        m = self.maps.get(id(buf))
        if m is None:
            m = self.maps[id(buf)] = _Map(buf.shape[0] // _WORD + 1, self.n)
        oi = self._index(op)
        wc = m.wcta[words]
        other = (wc >= 0) & (wc != c)
        if other.any():
            known = self.vc[c, np.where(other, wc, 0)]
            bad = other & (known < m.wclock[words])
            if bad.any():
                j = int(np.flatnonzero(bad)[0])
                self._raise(op, kind, int(t[j]), int(c[j]), int(words[j]), int(wc[j]),
                            int(m.wop[words[j]]), "writes")
        if kind == 0:
            m.rclock[c, words] = self.vc[c, c]
            m.rop[c, words] = oi
            return
        # a store: the other CTAs' reads since the last write must come before it
        rc = m.rclock[:, words]                          # [ctas, n]
        mine = np.arange(self.n)[:, None] == c[None, :]
        late = (rc > self.vc[c].T) & ~mine & (rc > 0)
        if late.any():
            d, j = (int(v[0]) for v in np.nonzero(late))
            self._raise(op, kind, int(t[j]), int(c[j]), int(words[j]), d,
                        int(m.rop[d, words[j]]), "reads")
        # two CTAs storing one word in the same instruction
        if np.unique(c).size > 1:
            order = np.argsort(words, kind="stable")
            sw, sc = words[order], c[order]
            clash = (sw[1:] == sw[:-1]) & (sc[1:] != sc[:-1])
            if clash.any():
                j = int(order[int(np.flatnonzero(clash)[0]) + 1])
                self._raise(op, kind, int(t[j]), int(c[j]), int(words[j]), int(sc[0]),
                            oi, "writes")
        m.wcta[words] = c
        m.wclock[words] = self.vc[c, c]
        m.wop[words] = oi
        m.rclock[:, words] = 0

    def _raise(self, op, kind, tid, cta, word, other_cta, other_op, what):
        theirs = self.ops[other_op] if other_op >= 0 else None
        verb = "reads" if kind == 0 else "writes"
        mine, other = (tuple(int(v) for v in self.ctaids[i]) for i in (cta, other_cta))
        msg = (f"global-memory race on the word at 0x{self._base + word * _WORD:x}: block "
               f"{mine} {verb} it here, and block {other} {what} it at "
               f"{describe_op(theirs) if theirs is not None else 'an earlier instruction'} "
               f"with no release/acquire ordering the two")
        f = Fault(RaceError, msg, tid)
        raise f
