"""Collectives between the ranks of a tensor-parallel model: the graph op
that names one, the communicator interface the executor runs it through,
and an in-process communicator whose ranks are threads of one process.

A graph of one rank holds a :class:`Collective` op where its partial
results meet the other ranks' (after a row-parallel projection, before the
next token's choice).  The :class:`~.executor.Executor` given a
communicator issues each such op, in order with the launches, as a call
on it with the op's buffers as :class:`DeviceSpan` s:

``all_reduce_sum(buf, stream)``
    every rank's ``buf`` replaced, in place, by the elementwise sum over
    the ranks;
``all_gather(src, dst, stream)``
    every rank's ``dst`` (``world`` times ``src``'s size) set to the ranks'
    ``src`` one after another, rank 0 first.

:class:`LocalGroup` runs the ranks of a group as threads of one process on
any backend (its communicators copy through the host): the emulator tests
of the sharded graph run on it.  The NCCL communicator, one process per
GPU, is :mod:`.nccl`'s.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs
import numpy as np

__all__ = ["Collective", "DeviceSpan", "Communicator", "LocalGroup", "LocalCommunicator"]

#: the collectives a graph op may name
KINDS = ("all_reduce_sum", "all_gather")


@attrs.frozen(eq=False)
class Collective:
    """A collective of one rank's graph: ``kind`` (:data:`KINDS`) over
    ``src`` (a :class:`~.executor.Buffer`) and, for ``all_gather``, into
    ``dst``."""

    kind: str
    src: Any
    dst: Any = None

    def __attrs_post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown collective {self.kind!r}; give one of {', '.join(KINDS)}")
        if (self.kind == "all_gather") != (self.dst is not None):
            raise ValueError(f"{self.kind}: a destination buffer is "
                             f"{'required' if self.dst is None else 'not taken'}")
        if self.dst is not None and self.dst.dtype != self.src.dtype:
            raise ValueError(f"all_gather: {self.src.name!r} is {self.src.dtype}, "
                             f"{self.dst.name!r} {self.dst.dtype}")

    @property
    def inputs(self) -> tuple:
        return (self.src,)

    @property
    def outputs(self) -> tuple:
        return (self.src,) if self.dst is None else (self.dst,)


@attrs.frozen
class DeviceSpan:
    """``count`` elements of ``dtype`` at device address ``ptr``: bytes
    ``offset ..`` of the backend array ``array`` (for communicators that
    copy through the host)."""

    ptr: int
    count: int
    dtype: Any
    array: Any
    offset: int
    backend: Any = attrs.field(repr=False)

    @property
    def nbytes(self) -> int:
        return self.count * np.dtype(self.dtype).itemsize

    def read(self) -> np.ndarray:
        """The span's values, copied to the host."""
        raw = self.backend.to_numpy(self.array).view(np.uint8).reshape(-1)
        return raw[self.offset:self.offset + self.nbytes].view(self.dtype).copy()

    def write(self, values: np.ndarray) -> None:
        """Overwrite the span from the host (the rest of its array kept)."""
        whole = self.backend.to_numpy(self.array).copy()
        raw = whole.view(np.uint8).reshape(-1)
        data = np.ascontiguousarray(values, dtype=self.dtype).reshape(-1).view(np.uint8)
        if data.nbytes != self.nbytes:
            raise ValueError(f"{data.nbytes} bytes for a span of {self.nbytes}")
        raw[self.offset:self.offset + self.nbytes] = data
        self.backend.copy_from_host(self.array, whole)


class Communicator:
    """What the executor needs of a rank's communicator (see the module
    docstring): its ``rank`` and ``world`` size and the collectives."""

    rank: int
    world: int

    def all_reduce_sum(self, buf: DeviceSpan, stream=None) -> None:
        raise NotImplementedError

    def all_gather(self, src: DeviceSpan, dst: DeviceSpan, stream=None) -> None:
        raise NotImplementedError


class LocalGroup:
    """``world`` ranks in one process, each run by a thread of its own
    (:meth:`run`), meeting at every collective.

    The communicators copy through the host and sum in rank order, so a
    collective's result is the same on every rank.  A rank that fails
    breaks the group's barrier: the others stop with it, and :meth:`run`
    raises the first rank's error.
    """

    def __init__(self, world: int, timeout: float = 600.0):
        if world < 1:
            raise ValueError(f"a group needs at least one rank, got world={world}")
        self.world = int(world)
        self._barrier = threading.Barrier(self.world, timeout=timeout)
        self._slots: list = [None] * self.world
        self.communicators = [LocalCommunicator(self, r) for r in range(self.world)]

    def _exchange(self, rank: int, values: np.ndarray) -> list:
        """Every rank's ``values`` (all ranks call this at the same collective)."""
        self._slots[rank] = values
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()
        return got

    def run(self, fn) -> list:
        """``fn(rank, communicator)`` on every rank, each in a thread; their
        results in rank order."""
        results: list = [None] * self.world
        errors: list = [None] * self.world

        def body(r):
            try:
                results[r] = fn(r, self.communicators[r])
            except BaseException as e:       # handed to the caller below
                errors[r] = e
                self._barrier.abort()
        threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}")
                   for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._barrier.reset()
        first = next((e for e in errors if e is not None
                      and not isinstance(e, threading.BrokenBarrierError)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


class LocalCommunicator(Communicator):
    """Rank ``rank`` of a :class:`LocalGroup`."""

    def __init__(self, group: LocalGroup, rank: int):
        self.group = group
        self.rank = rank
        self.world = group.world

    def all_reduce_sum(self, buf: DeviceSpan, stream=None) -> None:
        parts = self.group._exchange(self.rank, buf.read())
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        buf.write(total)

    def all_gather(self, src: DeviceSpan, dst: DeviceSpan, stream=None) -> None:
        if dst.count != self.world * src.count:
            raise ValueError(f"all_gather: {dst.count} elements to receive {self.world} "
                             f"ranks' {src.count}")
        parts = self.group._exchange(self.rank, src.read())
        dst.write(np.concatenate(parts))
