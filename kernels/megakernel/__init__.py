"""A persistent kernel that runs an instruction tape: one CTA per SM, each
taking its instructions in tape order, ordered by counters in global
memory (no grid barrier).

The tape is ``n`` records of :data:`RECORD_WORDS` u32 words (see
:func:`encode`): the instruction's op (an index into ``spec.ops``), its
node, the CTA range ``[cta0, cta1)`` of the node's launch it runs, up to
:data:`MAX_WAITS` ``(counter, count)`` pairs, two op words and (fused
kernels, sm_90) up to :data:`MAX_PREFETCH` byte ranges asked into L2
before the waits (``cp.async.bulk.prefetch.L2``).  CTA ``c``
of a grid of ``G`` runs instructions ``c, c + G, c + 2G ...``; each
instruction's thread 0 spins (``ld.acquire.gpu`` in a ``nanosleep`` loop)
until every counter it waits on holds ``epoch * count`` (``epoch``: the
step, from 1; counters are never reset), the CTA runs the op, then thread 0
adds 1 to the node's counter with ``red.release.gpu`` after a barrier.
Every wait names an earlier instruction, so the lowest unfinished
instruction can always run: with the grid resident at once (a CTA per SM,
or the emulator's one batch) the kernel cannot deadlock.

Each node has :data:`NODE_ARGS` u64 words in ``node_args``: the device
addresses of the buffers its op reads and writes.  Data other instructions
write while the kernel runs is read with coherent loads (``ld.global``);
weights with ``ld.global.nc``.

The ops (:data:`OPS`) a tape may use:

``rmsnorm``
    ``y = x / sqrt(mean(x**2) + eps) * w`` over ``n`` values (one
    instruction, CTA range ``[0, 1)``); addresses ``x, w, y``; words ``n``
    and the bits of the f32 ``eps``.
``gemv_f32``
    rows ``[cta0, cta1)`` of ``y = W x (+ r)`` for a row-major f32 ``W`` of
    ``k`` columns, a warp a row; addresses ``W, x, y, r`` (``r`` may be
    ``y``: each row reads its own residual before writing it); words ``k``
    and 1 with the residual, 0 without.
``noop``
    nothing: a tape of them times the scheduling (the waits and the
    counters) alone.

:func:`build_fused` makes the same loop over other kernels' bodies
(:mod:`.inline`): op ``i`` runs one CTA of kernel ``i`` per ``ctaid`` of
the record's range, its parameters read from a per-node table.
"""

from __future__ import annotations

import re

import attrs
import numpy as np

import ptxgen
from ptxgen.target import TARGETS
from ptxgen.types import f32, u32, u64

from ..reduce import warp_sum
from ..spec_fields import target_field

__all__ = ["MegakernelSpec", "OPS", "RECORD_WORDS", "MAX_WAITS", "MAX_PREFETCH", "NODE_ARGS",
           "STAMP_WORDS", "build", "encode", "FusedKernel", "build_fused", "encode_fused"]

RECORD_WORDS = 24
MAX_WAITS = 4
#: byte ranges a fused record asks brought into L2 before its waits
MAX_PREFETCH = 2
NODE_ARGS = 8
# record layout: op, node, cta0, cta1, number of waits, word0, word1, (pad), waits
_OP, _NODE, _CTA0, _CTA1, _NW, _W0, _W1, _WAITS = 0, 1, 2, 3, 4, 5, 6, 8
# fused records: (address low, address high, bytes) of each prefetch range
_PREFETCH = 16

#: the ops the kernel knows, in the order their indices are encoded
OPS = ("rmsnorm", "gemv_f32", "noop")


@attrs.frozen
class MegakernelSpec:
    """The persistent kernel of ``ops`` (names of :data:`OPS`) with
    ``threads`` threads a CTA."""

    ops: tuple = attrs.field(default=OPS, converter=tuple)
    threads: int = attrs.field(default=128)
    target: str = target_field()

    @ops.validator
    def _check_ops(self, _, ops):
        bad = [o for o in ops if o not in OPS]
        if bad or not ops:
            raise ValueError(f"MegakernelSpec.ops: {bad[0] if bad else 'none'!r} is not an op "
                             f"of the persistent kernel; it knows {', '.join(OPS)}")

    @threads.validator
    def _check_threads(self, _, t):
        if t % 32 or not 32 <= t <= 1024:
            raise ValueError(f"MegakernelSpec.threads must be a multiple of 32 in 32..1024, "
                             f"got {t}")

    @property
    def kernel_name(self) -> str:
        return "megakernel_" + "_".join(self.ops) + f"_t{self.threads}"


def encode(instructions, op_names=OPS) -> np.ndarray:
    """The tape of ``instructions`` as ``uint32[n, RECORD_WORDS]``.

    Each instruction is ``(op, node, cta0, cta1, waits, words)``: ``op`` a
    name of ``op_names``, ``waits`` a sequence of ``(counter, count)`` per
    step naming only counters of earlier instructions' nodes, ``words`` the
    op's two words (ints, or a float for ``rmsnorm``'s eps)."""
    out = np.zeros((len(instructions), RECORD_WORDS), np.uint32)
    done_nodes: set = set()
    for i, (op, node, c0, c1, waits, words) in enumerate(instructions):
        if op not in op_names:
            raise ValueError(f"instruction {i}: op {op!r} is not one of {', '.join(op_names)}")
        if not 0 <= c0 < c1:
            raise ValueError(f"instruction {i}: CTA range [{c0}, {c1}) is empty or negative")
        if len(waits) > MAX_WAITS:
            raise ValueError(f"instruction {i} waits on {len(waits)} counters; a record holds "
                             f"at most {MAX_WAITS}")
        for c, _ in waits:
            if c not in done_nodes:
                raise ValueError(f"instruction {i} waits on counter {c}, which no earlier "
                                 "instruction raises: the tape could deadlock")
        w = [int(np.float32(v).view(np.uint32)) if isinstance(v, float) else int(v)
             for v in words]
        rec = [op_names.index(op), node, c0, c1, len(waits), *w, 0]
        for c, n in waits:
            rec += [c, n]
        out[i, :len(rec)] = rec
        done_nodes.add(node)
    return out


def build(spec: MegakernelSpec) -> ptxgen.Module:
    """The persistent kernel: ``(tape, n_instr, node_args, counters, epoch)``."""
    T = spec.threads
    warps = T // 32
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, reqntid=T) as k:
        tape = k.param_ptr("tape", u32)
        n_instr = k.param("n_instr", u32)
        node_args = k.param_ptr("node_args", u64)
        counters = k.param_ptr("counters", u32)
        epoch = k.param("epoch", u32)
        red = k.shared_array("red", f32, warps, align=16)
        tid = k.tid.x
        with k.for_range(k.ctaid.x, n_instr, k.nctaid.x) as i:
            rec = tape + i * RECORD_WORDS
            words = [k.ld(rec[j], nc=True) for j in range(RECORD_WORDS)]
            with k.if_(tid.eq(0)):
                nw = words[_NW]
                for w in range(MAX_WAITS):
                    with k.if_(nw > w):
                        ctr = k.ptr_add(counters, words[_WAITS + 2 * w])
                        want = words[_WAITS + 2 * w + 1] * epoch
                        with k.while_(lambda: k.ld(ctr[0], sem="acquire", scope="gpu") < want):
                            k.nanosleep(64)
            k.bar_sync(0)
            node = words[_NODE]
            args = k.ptr_add(node_args, node * NODE_ARGS)
            ctx = _Ctx(k, tid, T, warps, red, words, args)
            for oi, name in enumerate(spec.ops):
                with k.if_(words[_OP].eq(oi)):
                    _BODIES[name](ctx)
            k.bar_sync(0)
            with k.if_(tid.eq(0)):
                k.red("add", counters[node], 1, sem="release", scope="gpu")
    return m


@attrs.define
class _Ctx:
    """What an op body gets: the builder, the thread, the record and the node's addresses."""

    k: object
    tid: object
    threads: int
    warps: int
    red: object
    words: list
    args: object

    def ptr(self, j, elem=f32):
        p = self.k.ptr_reg(elem)
        self.k.mov(self.k.ld(self.args[j], nc=True), u64, out=p)
        return p


def _rmsnorm(c: _Ctx):
    k, tid, T = c.k, c.tid, c.threads
    x, w, y = c.ptr(0), c.ptr(1), c.ptr(2)
    n = c.words[_W0]
    eps = k.bitcast(f32, c.words[_W1])
    sq = k.var(f32, 0.0)
    with k.for_range(tid, n, T) as j:
        v = k.ld(x[j])
        sq.set(k.fma(v, v, sq))
    s = warp_sum(k, sq)
    lane, warp = tid & 31, tid >> 5
    with k.if_(lane.eq(0)):
        k.st(c.red[warp], s)
    k.bar_sync(0)
    tot = k.ld(c.red[0])
    for wi in range(1, c.warps):
        tot = tot + k.ld(c.red[wi])
    mean = tot / k.cvt(f32, n)
    scale = k.rsqrt(mean + eps)
    with k.for_range(tid, n, T) as j:
        k.st(y[j], k.ld(x[j]) * scale * k.ld(w[j], nc=True))


def _gemv_f32(c: _Ctx):
    k, tid = c.k, c.tid
    wt, x, y, r = c.ptr(0), c.ptr(1), c.ptr(2), c.ptr(3)
    kk = c.words[_W0]
    has_r = c.words[_W1]
    lane, warp = tid & 31, tid >> 5
    with k.for_range(c.words[_CTA0] + warp, c.words[_CTA1], c.warps) as row:
        base = k.mul_wide(row, kk)
        acc = k.var(f32, 0.0)
        with k.for_range(lane, kk, 32) as j:
            acc.set(k.fma(k.ld(wt[base + k.cvt(u64, j)], nc=True), k.ld(x[j]), acc))
        tot = warp_sum(k, acc)
        with k.if_(lane.eq(0)):
            out = k.var(f32, 0.0)
            out.set(tot)
            with k.if_(has_r.ne(0)):
                out.set(tot + k.ld(r[row]))
            k.st(y[row], out)


def _noop(c: _Ctx):
    pass


_BODIES = {"rmsnorm": _rmsnorm, "gemv_f32": _gemv_f32, "noop": _noop}


# --------------------------------------------------------------------------
# the persistent kernel over other kernels' bodies


@attrs.frozen
class FusedKernel:
    """The persistent kernel over inlined bodies: its PTX text, entry name,
    threads a CTA, the parameter-table words a node takes, the dynamic
    shared bytes to launch it with, and the bodies in op-index order."""

    ptx: str
    name: str
    threads: int
    table_words: int
    bodies: tuple


#: u64 words a timeline keeps per instruction (:func:`build_fused`)
STAMP_WORDS = 4


def build_fused(kernels, target: str, name: str = "megakernel",
                timeline: bool = False) -> FusedKernel:
    """The persistent kernel whose op ``i`` runs the body of ``kernels[i]``
    (``(ptx_text, entry)``, made by :mod:`.inline`): records as
    :func:`encode` writes them with the op words ``(nx, ny)`` and word 7
    ``nz``, the node's launch grid, and one CTA of the node's launch per
    ``ctaid`` in the record's range.  Parameters: ``(tape, n_instr, table,
    counters, epoch)``; ``table`` holds :attr:`FusedKernel.table_words` u64
    words a node, the launch's parameters in the kernel's order.

    ``timeline``: a sixth parameter ``stamps``, :data:`STAMP_WORDS` u64
    words per instruction that its thread 0 writes: ``%globaltimer`` when
    it takes the record, when its waits are over, and when its work is done
    (after the CTA's barrier, before it raises the node's counter), then
    the ``%smid`` it ran on."""
    from .inline import DYNAMIC_SHARED, inline_entry

    bodies = tuple(inline_entry(text, entry, f"k{i}_") for i, (text, entry) in enumerate(kernels))
    T = max(b.threads for b in bodies)
    T = -(-T // 32) * 32
    words = max(len(b.params) for b in bodies)
    m = ptxgen.Module(target)
    marks = {}
    with m.kernel(name, reqntid=T) as k:
        tape = k.param_ptr("tape", u32)
        n_instr = k.param("n_instr", u32)
        table = k.param_ptr("table", u64)
        counters = k.param_ptr("counters", u32)
        epoch = k.param("epoch", u32)
        stamps = k.param_ptr("stamps", u64) if timeline else None
        tid = k.tid.x
        with k.for_range(k.ctaid.x, n_instr, k.nctaid.x) as i:
            rec = tape + i * RECORD_WORDS
            w = [k.ld(rec[j], nc=True) for j in range(RECORD_WORDS)]
            stamp = None if stamps is None else stamps + i * STAMP_WORDS
            with k.if_(tid.eq(0)):
                if stamp is not None:
                    k.st(stamp[0], k.globaltimer())
                if TARGETS[target].sm >= 90:
                    # the instruction's weights start for L2 while it waits
                    for r in range(MAX_PREFETCH):
                        lo, hi, nb = w[_PREFETCH + 3 * r:_PREFETCH + 3 * r + 3]
                        with k.if_(nb > 0):
                            src = k.ptr_reg(u32)
                            k.mov(k.cvt(u64, lo) | (k.cvt(u64, hi) << 32), u64, out=src)
                            k.prefetch_l2_bulk(src, nb)
                for wi in range(MAX_WAITS):
                    with k.if_(w[_NW] > wi):
                        ctr = k.ptr_add(counters, w[_WAITS + 2 * wi])
                        want = w[_WAITS + 2 * wi + 1] * epoch
                        with k.while_(lambda: k.ld(ctr[0], sem="acquire", scope="gpu") < want):
                            k.nanosleep(64)
                if stamp is not None:
                    k.st(stamp[1], k.globaltimer())
            k.bar_sync(0)
            node = w[_NODE]
            args = k.ptr_add(table, node * words)
            nx, ny, nz = w[_W0], w[_W1], w[7]
            for oi, b in enumerate(bodies):
                with k.if_(w[_OP].eq(oi)):
                    with k.if_(tid < b.threads):
                        with k.for_range(w[_CTA0], w[_CTA1]) as cta:
                            cx = cta % nx
                            rest = cta / nx
                            cy = rest % ny
                            cz = rest / ny
                            k.comment(f"MK_INLINE {oi}")
                            marks[oi] = ((cx.render(), cy.render(), cz.render()),
                                         (nx.render(), ny.render(), nz.render()), args.render())
                    k.bar_sync(0)
            with k.if_(tid.eq(0)):
                if stamp is not None:
                    k.st(stamp[2], k.globaltimer())
                    k.st(stamp[3], k.cvt(u64, k.smid))
                k.red("add", counters[node], 1, sem="release", scope="gpu")
    text = m.to_ptx()
    lines = text.splitlines()
    out = []
    entry_open = False
    align = max(b.align for b in bodies)
    # the PTX ISA version the newest body needs
    version = max(tuple(map(int, re.search(r"^\.version\s+(\d+)\.(\d+)", t, re.M).groups()))
                  for t, _ in kernels)
    for line in lines:
        s = line.strip()
        if s.startswith(".version "):
            have = tuple(map(int, s.split()[1].split(".")))
            line = ".version {}.{}".format(*max(have, version))
        if s.startswith(".visible .entry") and align:
            out.append(f".extern .shared .align {align} .b8 {DYNAMIC_SHARED}[];")
            out.append("")
        if s.startswith("// MK_INLINE "):
            oi = int(s.split()[-1])
            ctaid, nctaid, tab = marks[oi]
            out.append(f"\t// op {oi}: {bodies[oi].entry}")
            out += ["\t" + x if not x.endswith(":") else x
                    for x in bodies[oi].render(ctaid, nctaid, tab, T)]
            continue
        out.append(line)
        if s == "{" and not entry_open:
            entry_open = True
            for b in bodies:
                out += ["\t" + d for d in b.decls]
    return FusedKernel("\n".join(out) + "\n", name, T, words, bodies)


def encode_fused(instructions) -> np.ndarray:
    """Records of ``(op, node, cta0, cta1, waits, grid, prefetch)``
    instructions (``op`` an index of :func:`build_fused`'s kernels,
    ``grid`` the node's launch grid ``(nx, ny, nz)``, ``prefetch`` up to
    :data:`MAX_PREFETCH` ``(address, bytes)`` ranges, 16-byte aligned, the
    kernel asks brought into L2 before the instruction's waits)."""
    recs = encode([(OPS[0], ins[1], ins[2], ins[3], ins[4], ins[5][:2]) for ins in instructions])
    for r, ins in zip(recs, instructions):
        r[_OP] = ins[0]
        r[7] = ins[5][2]
        ranges = ins[6] if len(ins) > 6 else ()
        if len(ranges) > MAX_PREFETCH:
            raise ValueError(f"instruction {ins}: at most {MAX_PREFETCH} prefetch ranges")
        for j, (addr, nbytes) in enumerate(ranges):
            if addr % 16 or nbytes % 16 or nbytes <= 0:
                raise ValueError(f"prefetch range ({addr:#x}, {nbytes}) is not 16-byte aligned "
                                 "and a positive multiple of 16 bytes")
            r[_PREFETCH + 3 * j:_PREFETCH + 3 * j + 3] = (addr & 0xFFFFFFFF, addr >> 32, nbytes)
    return recs
