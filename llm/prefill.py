"""Chunked prefill: a prompt's tokens but the last run through the model a
chunk at a time (:class:`~.lowering.chunk.ChunkLowering`), their K and V
rows written to the model's cache, then the decode step takes over.

The graphs of a :class:`Prefill` are the model definition lowered once per
*bucket*, the chunk sizes that have a launch sequence (and, on the GPU, a
captured CUDA graph) of their own: the buckets below the chunk
(:data:`BUCKETS`) and the chunk itself.  A chunk of ``T`` tokens runs the
smallest bucket that holds it.  The buckets share the model's weights and
KV cache (its :class:`~ptxgen.driver.executor.DeviceMemory`) and one
activation arena.
"""

from __future__ import annotations

import numpy as np

from ptxgen.driver.executor import Arena, Executor

from .lowering.chunk import ChunkLowering, gemm_ready
from .parallel import SINGLE

__all__ = ["Prefill", "DEFAULT_CHUNK", "BUCKETS", "gemm_ready"]

DEFAULT_CHUNK = 512
#: chunk sizes a graph is captured for (those below the chunk, and the chunk)
BUCKETS = (64, 128, 256)


class Prefill:
    """The prefill graphs of one model for chunks of up to ``chunk`` tokens.

    Parameters
    ----------
    arch : Architecture
        The model definition (with its file).
    store, memory : the model's persistent buffers and their device arrays
    backend : the model's backend
    stream : the model's stream
    target, capacity, device, pdl : as the model's
    chunk : int
        The most tokens a chunk holds.
    buckets : sequence of int, optional
        Chunk sizes with a graph of their own; those below ``chunk`` are
        kept and ``chunk`` is added.  Default :data:`BUCKETS`.
    tp, comm : the model's tensor-parallel rank and its communicator
    """

    def __init__(self, arch, store, memory, backend, stream, *, target, capacity, chunk,
                 device=None, pdl=True, buckets=None, tp=SINGLE, comm=None):
        if chunk < 1:
            raise ValueError(f"prefill chunk must be at least 1, got {chunk}")
        self.chunk = int(chunk)
        bs = BUCKETS if buckets is None else buckets
        self.buckets = tuple(sorted({int(b) for b in bs if 0 < int(b) < self.chunk})) + (
            self.chunk,)
        self.backend, self.stream, self.memory = backend, stream, memory
        self.comm = comm
        self.arena = Arena(backend)
        self._graphs = {}
        for b in self.buckets:
            lw = ChunkLowering(arch.file, store, target=target, capacity=capacity,
                               rope_layout=arch.rope_layout, rows=b, chunk=self.chunk,
                               device=device, pdl=pdl, tp=tp)
            arch.forward(lw)
            self._graphs[b] = lw
        from ptxgen.driver.executor import plan_activations
        for lw in self._graphs.values():
            self.arena.reserve(plan_activations(lw.g))
        self._executors: dict = {}
        self._tokens = np.zeros(capacity, np.int32)

    def graph(self, bucket: int):
        """The :class:`~ptxgen.driver.executor.ComputeGraph` of ``bucket``."""
        return self._graphs[bucket].g

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds ``n`` tokens."""
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"a chunk of {n} tokens exceeds the prefill chunk of {self.chunk}")

    def _executor(self, bucket: int) -> Executor:
        ex = self._executors.get(bucket)
        if ex is None:
            ex = self._executors[bucket] = Executor(self._graphs[bucket].g, self.backend,
                                                    memory=self.memory, arena=self.arena,
                                                    comm=self.comm)
        return ex

    def run_chunk(self, tokens, start: int, mode: str = "graph"):
        """Run ``tokens`` (at most ``chunk``) at positions ``start ..``: one
        graph replay (``mode="graph"`` where the backend captures) or the
        launches one by one."""
        T = len(tokens)
        B = self.bucket(T)
        lw = self._graphs[B]
        ex = self._executor(B)
        self._tokens[:] = 0
        self._tokens[:T] = tokens
        ex.write(lw.tokens, self._tokens, stream=self.stream)
        ex.write(lw.info, np.array([start, T], np.int32), stream=self.stream)
        if mode == "graph" and self.backend.can_capture:
            if not ex.is_captured():
                ex.capture(self.stream)
            ex.replay(self.stream)
        else:
            ex.run_eager(self.stream, pdl=False)

    def run(self, prompt, mode: str = "graph") -> int:
        """Prefill every token of ``prompt`` but the last; returns how many."""
        prompt = [int(t) for t in prompt]
        n = len(prompt)
        for s in range(0, n - 1, self.chunk):
            self.run_chunk(prompt[s:min(s + self.chunk, n - 1)], s, mode)
        self.backend.synchronize(self.stream)
        return n - 1
