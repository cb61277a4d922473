"""The decode step as one persistent kernel: the step's tape
(:mod:`.tape`) run by :func:`~ptxgen.kernels.megakernel.build_fused` over
the bodies of the step's own kernels, one launch a token.

:class:`PersistentDecode` takes a :class:`~.model.Model` whose executor
holds the weights, the KV cache and the activation arena, and makes from
its greedy variant: the tape cut for ``grid`` CTAs, the fused kernel (one
op per distinct kernel of the step), each node's parameter table (the
launch's resolved arguments, in the kernel's parameter order) and the
counters.  :meth:`PersistentDecode.step` launches it once (``epoch`` one
more than the last: the counters are never reset), doing what one replay
of the greedy graph does.  Each GEMV instruction's weight rows are asked
into L2 (``cp.async.bulk.prefetch.L2``) before it waits on the nodes
before it, so its weights stream while those finish.
"""

from __future__ import annotations

import numpy as np

from ptxgen.kernels import megakernel as mk

from .generation import GREEDY
from .tape import build_tape, fused_kernel

__all__ = ["PersistentDecode", "decode_path", "PATHS"]

#: the ways a batch-1 decode step runs
PATHS = ("graph", "persistent")


def decode_path(file, target: str) -> str:
    """``"graph"`` or ``"persistent"``: what the ``decode_path`` tuning table
    (``kernels/tuning/decode_path.json``) says for ``file``'s shape on
    ``target`` (``qtype``: the attention output projection's, a weight
    every family has)."""
    from ptxgen.kernels.tuning import cascade
    from ptxgen.target import TARGETS
    hp = file.hparams
    call = dict(sm=TARGETS[target].sm, target=target, n_layers=hp.n_layers, hidden=hp.hidden,
                qtype=file.qtype("blk.0.attn_output.weight"))
    path = cascade("decode_path", call).get("path", "graph")
    if path not in PATHS:
        raise ValueError(f"the decode_path table gives path {path!r} for {call}; "
                         f"it must be one of {', '.join(PATHS)}")
    return path


def _word(ty: str, value) -> int:
    """A parameter of PTX type ``ty`` as the 64-bit table word whose low
    bytes the body loads."""
    if ty in ("f32",):
        return int(np.float32(value).view(np.uint32))
    if ty in ("f64",):
        return int(np.float64(value).view(np.uint64))
    if ty.startswith(("u", "b", "s")):
        bits = int(ty[1:])
        return int(value) & ((1 << bits) - 1)
    raise ValueError(f"a kernel parameter of type .{ty} cannot go in the persistent kernel's table")


def _prefetch(ex, L, ins) -> tuple:
    """The weight bytes of a GEMV instruction's rows (``w``, and ``wu`` of a
    gate/up pair) as 16-byte-aligned ``(address, bytes)`` ranges inside
    their buffers; none for other kernels."""
    if ins.row0 is None or ins.row1 <= ins.row0:
        return ()
    out = []
    for name in ("w", "wu"):
        b = L.args.get(name)
        if b is None:
            continue
        base = ex.ptr(b)
        rb = b.nbytes // b.shape[0]
        lo = (base + ins.row0 * rb) & ~15
        hi = min(-(-(base + ins.row1 * rb) // 16) * 16, (base + b.nbytes) & ~15)
        if hi > lo:
            out.append((lo, hi - lo))
    return tuple(out)


class PersistentDecode:
    """The greedy decode step of ``model`` as one persistent launch of
    ``grid`` CTAs (default: the device's SMs).

    With ``timeline`` the kernel stamps every instruction of the step
    (:meth:`timeline`, :func:`timeline_summary`): where a step's time goes,
    per node, waiting on its inputs or working."""

    def __init__(self, model, grid: int | None = None, timeline: bool = False):
        ex, g, be = model.executor, model.graph, model.backend
        self.backend = be
        self.grid = int(grid or model.sm_count)
        self.tape = build_tape(g, self.grid, GREEDY)
        pairs = [L for op in g.ops_of(GREEDY) for L in op.launches]
        resolved = ex.launches(GREEDY)
        fk, index = fused_kernel(g, model.target, timeline=timeline)
        self.kernel = fk
        table = np.zeros((len(self.tape.nodes), fk.table_words), np.uint64)
        grids = []
        for node, L, (fn, grid, block, args, shared, _) in zip(self.tape.nodes, pairs, resolved):
            body = fk.bodies[index[L.kernel]]
            if len(args) != len(body.params):
                raise ValueError(f"{node.op}: {len(args)} arguments for {L.kernel}'s "
                                 f"{len(body.params)} parameters")
            for j, ((_, ty), v) in enumerate(zip(body.params, args)):
                table[node.index, j] = _word(ty, v)
            grids.append(tuple(grid))
        self.shared = max(r[4] for r in resolved)
        records = mk.encode_fused([(index[pairs[i.node].kernel], i.node, i.cta0, i.cta1, i.waits,
                                    grids[i.node], _prefetch(ex, pairs[i.node], i))
                                   for i in self.tape.instructions])
        self._records = be.from_numpy(records)
        self._table = be.from_numpy(table)
        self._counters = be.from_numpy(np.zeros(self.tape.n_counters, np.uint32))
        self._stamps = (be.from_numpy(np.zeros((len(self.tape.instructions), mk.STAMP_WORDS),
                                               np.uint64)) if timeline else None)
        self.fn = be.load(fk.ptx).function(fk.name)
        self.fn.require_dynamic_shared(self.shared)
        self.epoch = 0

    def step(self, stream=None):
        """One decode step (greedy): one launch of the persistent kernel."""
        self.epoch += 1
        stamps = () if self._stamps is None else (self._stamps,)
        self.backend.launch_positional(self.fn, self.grid, self.kernel.threads, self._records,
                                       len(self.tape.instructions), self._table,
                                       self._counters, self.epoch, *stamps, shared=self.shared,
                                       stream=stream)

    def timeline(self) -> np.ndarray:
        """The last step's stamps, ``uint64[instructions, 4]``: when each
        instruction took its record, ended its waits and finished its work
        (``%globaltimer``, ns), and its SM."""
        if self._stamps is None:
            raise ValueError("this persistent step was built without timeline=True")
        return self.backend.to_numpy(self._stamps)


def timeline_summary(tape, stamps) -> list:
    """Per node of ``tape``, from one step's ``stamps``
    (:meth:`PersistentDecode.timeline`): ``(node, instructions, wait_us,
    work_us, span_us)``: the node's instructions' summed waits and work,
    and the time from its first instruction taking its record to its last
    finishing; times from the step's first stamp."""
    st = np.asarray(stamps, np.int64)
    rows = []
    for node in tape.nodes:
        idx = [j for j, ins in enumerate(tape.instructions) if ins.node == node.index]
        s = st[idx]
        rows.append((node, len(idx), float((s[:, 1] - s[:, 0]).sum()) / 1e3,
                     float((s[:, 2] - s[:, 1]).sum()) / 1e3,
                     float(s[:, 2].max() - s[:, 0].min()) / 1e3))
    return rows
