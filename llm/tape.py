"""The decode step as an instruction tape: the launches of the lowered
T = 1 step (:class:`~.lowering.decode.DecodeLowering`) cut into pieces of
work a persistent kernel executes, with the counters that order them.

Each launch of the step is a *node*: one op's kernel (a GEMV with its
epilogue, an attention split or its combine, a norm, the argmax ...) over
its whole grid.  A node's grid is cut into at most ``sm_count``
*instructions*, each a contiguous range of the launch's CTAs (for a GEMV a
range of rows, ``rpc`` rows a CTA), so one CTA per SM taking instructions
in tape order covers every node in about one round.

Ordering is one counter per node, in global memory: every instruction
adds 1 to its node's counter when its work is stored (a release), and an
instruction starts once each counter it waits on holds the node's
instruction count (acquires).  A node waits on the nodes whose memory it
must see or must not overwrite early:

- the nodes before it in its own op (an op's launches run in order);
- for the op's first node, the last node of each earlier op it conflicts
  with: it reads what that op writes (read after write), or writes what
  that op reads or writes (write after read, write after write).

Memory is what the executor gives the buffers: a weight or state buffer
is its own, activations share an arena (:func:`~ptxgen.driver.executor.
plan_activations`), so two activations whose bytes overlap conflict even
under different names.  An op reads its declared inputs and every buffer
its launches take that it does not declare, and writes its declared
outputs and every undeclared non-weight buffer its launches take (scratch
and counters) -- more than it may touch, never less.  The waits are then
reduced to those no other wait implies (a node waited on through another
is dropped), and every wait names an earlier node, so the tape is
acyclic and instructions taken in order never wait on one not yet taken.

Counters count per step: with counters left from earlier steps, an
instruction of step ``s`` (from 1) waits for ``s`` times the count.

``python -m ptxgen tape MODEL.gguf [--sm-count N] [--variant V] [--ptx]``
(or ``python -m ptxgen dump MODEL.gguf``, tape and kernel) prints a file's tape (:meth:`Tape.dump`) and with ``--ptx`` the persistent
kernel that runs it (:mod:`.persistent`).
"""

from __future__ import annotations

import sys

import attrs

from ptxgen import registry
from ptxgen.driver.executor import Buffer, BufRef, ComputeGraph, TensorMapOf, plan_activations
from ptxgen.kernels import gemv, megakernel
from ptxgen.kernels.gemv import layout as gemv_layout

from .generation import GREEDY

__all__ = ["Node", "Instruction", "Tape", "build_tape", "decode_tape", "decode_graph",
           "fused_kernel", "conflicts"]


@attrs.frozen
class Node:
    """One launch of the step and the counter its instructions raise.

    Attributes
    ----------
    index : int
        Its place in the tape, also its counter's index.
    op, kind : str
        The op's name and kind (``MulMat``, ``Attention`` ...).
    launch : int
        Which of the op's launches (0 for most ops; attention has its split
        and its combine).
    family, kernel : str
        The kernel family and the PTX entry whose CTAs the instructions run.
    grid, threads : int
        CTAs of the launch (its grid flattened) and threads a CTA.
    reads, writes : tuple of str
        Buffers its op may read and write (see the module docstring).
    waits : tuple of int
        Nodes whose counters must hold their full count before any
        instruction of this node starts.
    first, count : int
        Its instructions: ``tape.instructions[first:first + count]``.
    rows_per_cta : int or None
        A GEMV's rows a CTA (``rpc``), None for other kernels.
    rows : int or None
        A GEMV's rows ``m``.
    """

    index: int
    op: str
    kind: str
    launch: int
    family: str
    kernel: str
    grid: int
    threads: int
    reads: tuple
    writes: tuple
    waits: tuple
    first: int
    count: int
    rows_per_cta: int | None = None
    rows: int | None = None


@attrs.frozen
class Instruction:
    """A piece of one node: CTAs ``[cta0, cta1)`` of its launch.

    Attributes
    ----------
    index : int
        Its place in the tape (the order instructions are taken in).
    node : int
        The node it belongs to; it adds 1 to that node's counter when done.
    cta0, cta1 : int
        The launch's CTAs it runs (``blockIdx`` as the kernel's, flattened).
    row0, row1 : int or None
        A GEMV's rows ``[row0, row1)`` (None for other kernels).
    waits : tuple of (int, int)
        ``(counter, count)``: the counters to reach before it starts and the
        count each must hold (per step).
    """

    index: int
    node: int
    cta0: int
    cta1: int
    row0: int | None
    row1: int | None
    waits: tuple


@attrs.frozen
class Tape:
    """The step's nodes and instructions in execution order."""

    nodes: tuple
    instructions: tuple
    variant: str | None = None

    @property
    def n_counters(self) -> int:
        """Counters the tape uses (one a node)."""
        return len(self.nodes)

    def instructions_of(self, node: Node) -> tuple:
        return self.instructions[node.first:node.first + node.count]

    def records(self, op_of, words_of=lambda node: (0, 0)):
        """The tape as the persistent kernel's records
        (:func:`ptxgen.kernels.megakernel.encode`): ``op_of(node)`` names
        the kernel's op for each node, ``words_of(node)`` its two words."""
        return megakernel.encode([(op_of(self.nodes[i.node]), i.node, i.cta0, i.cta1, i.waits,
                                   words_of(self.nodes[i.node])) for i in self.instructions])

    def dump(self, instructions: bool = False) -> str:
        """The tape as text: a line a node (its kernel, CTAs, instructions,
        waits as ``node:count``, what it reads and writes) and with
        ``instructions`` a line for each instruction under its node."""
        v = f" [{self.variant}]" if self.variant else ""
        lines = [f"tape{v}: {len(self.nodes)} nodes, {len(self.instructions)} instructions, "
                 f"{self.n_counters} counters"]
        for n in self.nodes:
            waits = " ".join(f"{w}:{self.nodes[w].count}" for w in n.waits) or "-"
            lines.append(f"{n.index:4d} {n.kind:<14} {n.op:<22} {n.kernel}")
            lines.append(f"     ctas {n.grid} x {n.threads} threads in {n.count} instructions; "
                         f"waits {waits}")
            lines.append(f"     reads {', '.join(n.reads)}")
            lines.append(f"     writes {', '.join(n.writes)}")
            if instructions:
                for ins in self.instructions_of(n):
                    rows = "" if ins.row0 is None else f" rows [{ins.row0}, {ins.row1})"
                    lines.append(f"       #{ins.index} ctas [{ins.cta0}, {ins.cta1}){rows}")
        return "\n".join(lines)


def _region(b):
    """Where buffer ``b``'s bytes live: ``(space, start, end)``."""
    if b.kind == "activation" and b.offset is not None:
        return ("arena", b.offset, b.offset + b.nbytes)
    return (b.name, 0, b.nbytes)


def _overlap(r, s) -> bool:
    return r[0] == s[0] and r[1] < s[2] and s[1] < r[2]


def _buffers_of_launches(op):
    """The buffers ``op``'s launches take (a pointer into one, or its tensor
    map, counts as the buffer)."""
    out = []
    for L in op.launches:
        for a in L.values():
            a = a.source if isinstance(a, TensorMapOf) else a
            a = a.buffer if isinstance(a, BufRef) else a
            if isinstance(a, Buffer):
                out.append(a)
    return out


def _access(op):
    """``(reads, writes)`` of ``op``: lists of buffers, each once."""
    taken = _buffers_of_launches(op)
    declared_in, declared_out = set(map(id, op.inputs)), set(map(id, op.outputs))
    undeclared = [b for b in taken if id(b) not in declared_in | declared_out]
    reads = _unique(list(op.inputs) + undeclared)
    writes = _unique(list(op.outputs) + [b for b in undeclared if b.kind != "weight"])
    return reads, writes


def _unique(bufs):
    seen, out = set(), []
    for b in bufs:
        if id(b) not in seen:
            seen.add(id(b))
            out.append(b)
    return out


def conflicts(a_reads, a_writes, b_reads, b_writes) -> bool:
    """Whether an op with accesses ``b_*`` must wait for one with ``a_*``
    before it: it reads what ``a`` writes, or writes what ``a`` reads or
    writes (buffers compared by the bytes they occupy)."""
    ar = [_region(b) for b in a_reads]
    aw = [_region(b) for b in a_writes]
    br = [_region(b) for b in b_reads]
    bw = [_region(b) for b in b_writes]
    return (any(_overlap(r, w) for r in br for w in aw)
            or any(_overlap(w, x) for w in bw for x in ar + aw))


def _pieces(grid: int, sm_count: int):
    """``grid`` CTAs in at most ``sm_count`` contiguous ranges, the longer first."""
    n = max(1, min(grid, sm_count))
    q, r = divmod(grid, n)
    out, c = [], 0
    for i in range(n):
        size = q + (1 if i < r else 0)
        out.append((c, c + size))
        c += size
    return out


def build_tape(graph: ComputeGraph, sm_count: int, variant: str | None = None) -> Tape:
    """The tape of one step of ``graph``'s ``variant`` (default: the
    graph's default variant), its nodes cut for ``sm_count`` SMs.

    Gives the graph's activations their arena offsets
    (:func:`~ptxgen.driver.executor.plan_activations`, as the executor
    does) so that conflicts are over the bytes the buffers occupy.
    """
    if sm_count < 1:
        raise ValueError(f"sm_count must be at least 1, got {sm_count}")
    v = graph.resolve_variant(variant)
    plan_activations(graph)
    ops = graph.ops_of(v)
    if not ops:
        raise ValueError("the graph has no ops to put on a tape")
    access = [_access(op) for op in ops]
    last_node: list[int] = []
    # ancestors of each node as a bit set, to drop waits other waits imply
    ancestors: list[int] = []
    nodes, instructions = [], []
    for i, op in enumerate(ops):
        deps = [last_node[j] for j in range(i) if conflicts(*access[j], *access[i])]
        reads = tuple(b.name for b in access[i][0])
        writes = tuple(b.name for b in access[i][1])
        for li, L in enumerate(op.launches):
            idx = len(nodes)
            want = deps if li == 0 else [idx - 1]
            waits, covered = [], 0
            for d in sorted(set(want), reverse=True):
                if not covered >> d & 1:
                    waits.append(d)
                    covered |= ancestors[d] | (1 << d)
            ancestors.append(covered)
            g = L.geometry
            grid = g.grid[0] * g.grid[1] * g.grid[2]
            rpc = g.args.get("rpc") if L.family == "gemv" else None
            m = L.args.get("m") if rpc is not None else None
            first = len(instructions)
            for c0, c1 in _pieces(grid, sm_count):
                r0 = r1 = None
                if rpc is not None:
                    r0, r1 = min(c0 * rpc, m), min(c1 * rpc, m)
                instructions.append(Instruction(len(instructions), idx, c0, c1, r0, r1, ()))
            nodes.append(Node(idx, op.name, op.kind, li, L.family, g.kernel, grid, g.threads,
                              reads, writes, tuple(sorted(waits)), first,
                              len(instructions) - first, rpc, m))
        last_node.append(len(nodes) - 1)
    counts = [n.count for n in nodes]
    instructions = [attrs.evolve(ins, waits=tuple((w, counts[w])
                                                  for w in nodes[ins.node].waits))
                    for ins in instructions]
    return Tape(tuple(nodes), tuple(instructions), v)


def decode_tape(file, *, sm_count: int, target: str = "sm_90", capacity: int | None = None,
                variant: str | None = None, **lowering) -> Tape:
    """The tape of ``file``'s (a :class:`~.gguf.file.LlamaFile` or a path)
    decode step as :class:`~.model.Model` lowers it for ``target`` and
    ``sm_count`` SMs (``lowering``: more DecodeLowering arguments, e.g.
    ``fuse_norm``)."""
    return build_tape(decode_graph(file, sm_count=sm_count, target=target, capacity=capacity,
                                   **lowering), sm_count, variant)


def decode_graph(file, *, sm_count: int, target: str = "sm_90", capacity: int | None = None,
                 **lowering) -> ComputeGraph:
    """``file``'s decode step lowered as :func:`decode_tape` does, the graph."""
    from ptxgen.driver.executor import Store

    from .gguf.file import LlamaFile
    from .lowering.common import Tuning
    from .lowering.decode import DecodeLowering
    from .models import architecture_of

    f = file if isinstance(file, LlamaFile) else LlamaFile(file)
    arch = architecture_of(f)
    cap = int(capacity or min(f.hparams.context_length, 4096))
    s = DecodeLowering(f, Store(), target=target, sm_count=sm_count, capacity=cap,
                       rope_layout=arch.rope_layout, tuning=Tuning(sm_count),
                       **lowering)
    arch.forward(s)
    return s.g


#: threads the persistent kernel runs the argmax with: its blocks take
#: grid-stride shares, so a smaller block does the launch's work at the
#: launch's grid, and the persistent CTA (as wide as its widest body) keeps
#: the registers a GEMV body needs
ARGMAX_THREADS = 256
#: the widest a batch-1 Q4_K GEMV body may be: a wider one (K = 14336 is 448
#: pieces, a thread each) is built with more pieces a thread instead, the
#: same rows a CTA, so the persistent CTA (as wide as its widest body) stays
#: at 256 threads and ptxas may give every body up to 255 registers, where
#: a wider CTA caps them all lower and the GEMV bodies spill
GEMV_THREADS = 256


def _body_spec(L):
    """The spec launch ``L``'s body is built with inside the persistent
    kernel: the argmax at :data:`ARGMAX_THREADS`, a Q4_K GEMV wider than
    :data:`GEMV_THREADS` with as many pieces a thread as bring it within
    them (its launch arguments unchanged, checked), else the launch's own."""
    if L.family == "argmax" and L.spec.block > ARGMAX_THREADS:
        return attrs.evolve(L.spec, block=ARGMAX_THREADS)
    if L.family == "gemv" and L.spec.qtype == "Q4_K" and L.spec.batch == 1 \
            and gemv.threads(L.spec) > GEMV_THREADS:
        total = gemv_layout.q4k_layout(L.spec)[2]
        spec = attrs.evolve(L.spec, pieces=-(-total // GEMV_THREADS))
        # the tape cuts the launch's grid by its rows a CTA: those must stand
        m = L.args["m"]
        if gemv.launch_geometry(spec, m).args != gemv.launch_geometry(L.spec, m).args:
            raise ValueError(f"{L.kernel}: {spec.pieces} pieces a thread change its launch")
        return spec
    return L.spec


def fused_kernel(graph, target: str, timeline: bool = False):
    """The persistent kernel over the distinct kernels of ``graph``'s
    greedy step (:func:`~ptxgen.kernels.megakernel.build_fused`; the argmax
    and the wide GEMVs narrowed, :func:`_body_spec`), and each launch
    kernel's op index by entry name; ``timeline``: the kernel stamps each
    instruction's times (:func:`~ptxgen.kernels.megakernel.build_fused`)."""
    kernels, index = [], {}
    for op in graph.ops_of(GREEDY):
        for L in op.launches:
            if L.kernel not in index:
                index[L.kernel] = len(kernels)
                spec = _body_spec(L)
                kernels.append((registry.family(L.family).build(spec).to_ptx(),
                                spec.kernel_name if spec is not L.spec else L.kernel))
    return megakernel.build_fused(kernels, target, timeline=timeline), index


def tape_command(argv=None, prog: str = "python -m ptxgen tape") -> int:
    """Print a GGUF file's decode tape and, with --ptx, its persistent kernel."""
    from ptxgen.cli import ArgumentParser

    from .cli import run_guarded
    p = ArgumentParser(prog=prog, description="print a GGUF file's decode step as the "
                                              "instruction tape the persistent kernel runs")
    p.add_argument("model", help="a GGUF file")
    p.add_argument("--sm-count", type=int, default=132, help="SMs to cut the nodes for")
    p.add_argument("--target", default="sm_90")
    p.add_argument("--variant", default=None, help="greedy (default) or sample")
    p.add_argument("--instructions", action="store_true", help="a line for every instruction")
    p.add_argument("--ptx", action="store_true",
                   help="print the persistent kernel's PTX after the tape (greedy step)")
    a = p.parse_args(argv)

    def body():
        g = decode_graph(a.model, sm_count=a.sm_count, target=a.target)
        tape = build_tape(g, a.sm_count, a.variant)
        sys.stdout.write(tape.dump(instructions=a.instructions) + "\n")
        if a.ptx:
            sys.stdout.write(fused_kernel(g, a.target)[0].ptx)
        return 0
    return run_guarded(body)


def main(argv=None) -> int:
    return tape_command(argv, prog="python -m ptxgen.llm.tape")


if __name__ == "__main__":
    sys.exit(main())
