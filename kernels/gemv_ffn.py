"""A Llama FFN in one persistent kernel: ``y = Wd (silu(Wg x) * (Wu x)) + r``, Q4_K.

Two GEMVs in a row pay a kernel boundary: the first one's last rows drain
from DRAM, the second waits for all of it, then ramps its loads up again
(about 3 µs per launch on an H100, docs/gemv.md).  Here one grid of
persistent CTAs (``ctas_per_sm`` per SM, all resident at once) runs both
GEMVs, and the down projection's weights are already streaming while the
gate/up phase finishes.  **Measured slower** than the two GEMVs it replaces
(H100: 55-58 µs against 50 µs, docs/gemv.md "Sixth pass"), so the model
uses it only when asked (``LlamaModel(fuse_ffn=True)``).

* **Work items.**  Phase 1 items are groups of ``R1 = slices * rows_up``
  rows of Wg and Wu (the FFN's rows); phase 2 items are groups of
  ``rows_down`` rows of Wd (the model's rows).  Item ids ``0 .. n1 - 1`` are
  phase 1, ``n1 .. n1 + n2 - 1`` phase 2, larger ids are "done".  CTA ``b``
  takes items ``b, b + G, ...`` for its first ``S - 1`` (G CTAs, S ring
  stages), then ids from ``atom.add`` on a grid counter, grabbed by thread
  0 ``lookahead`` items early, so faster SMs take more rows.  Every row is
  computed whole by one CTA in a fixed order, so the result does not depend
  on who took it: eager and replayed runs give the same bits (and with one
  piece per thread, the bits of the two GEMV kernels).
* **Weights through a ring.**  As in :mod:`gemv_stream`, an item's rows
  (one contiguous run per matrix) travel by 16-byte ``cp.async`` into one
  of S stages of dynamic shared memory; S - 1 items are in flight while one
  is computed.  The ring does not care which phase an item belongs to, so
  a CTA near the end of phase 1 is already copying its first phase 2 rows.
* **One barrier per item.**  Each warp's row sums go to one half of a
  double-buffered shared array; the item's rows are summed over warps and
  stored (epilogue) after the next item's barrier.
* **Phase 1** (K = hidden): the CTA is ``slices`` groups of threads, each
  as wide as a Q4_K row of ``hidden`` needs (one 32-weight piece per
  thread, x in registers); slice ``s`` computes rows ``s * rows_up ..`` of
  the item and stores ``h = silu(g) * u`` to the global scratch ``h``.
* **Grid barrier.**  A CTA whose next item is not phase 1 adds the number of
  phase 1 items it finished to ``counters[1]`` (thread 0, after the CTA's
  barrier, ``fence.acq_rel.gpu`` then ``red.add``); if it has phase 2 work
  it spins (``ld.relaxed.gpu``) until the sum is ``n1``, fences, and after a
  CTA barrier every thread loads its pieces of ``h`` with ``ld.global.cg``
  (``h`` was written in this launch: not ``.nc``).  Its ring keeps filling
  meanwhile.  Every CTA of the grid must be resident at once
  (``ops_gemv.ffn_geometry`` checks the driver's occupancy).  The CPU
  emulator runs the CTAs of a launch in lockstep, so it cannot show a
  missing barrier; the GPU test does (checked by disabling the spin).
* **Phase 2** (K = ffn): thread ``t`` owns pieces ``t`` (and ``t + threads``)
  of the down rows (warps without a piece skip the math and add zeros),
  ``y[row] = sum + r[row]`` (``y`` may be ``r``).
* **Reset.**  The last CTA to finish (``counters[2]``) zeroes the three
  counters, so the next launch (or graph replay) starts from zero; they
  must be zero before the first launch.

Parameters: ``wg, wu, wd: u8*, x: f32* [hidden], r: f32* [hidden], h: f32*
[ffn] (scratch), y: f32* [hidden], counters: u32* [3]``.  Launch
:func:`launch_geometry`.  With ``pdl``, the first ``S - 1`` items' copies go
out before ``griddepcontrol.wait``; nothing touches the counters before it
(back-to-back launches share them: an early grab would take an item from
the launch still running, which would then wait at its barrier forever).
"""

from __future__ import annotations

import attrs

import ptxgen
from ptxgen import registry
from ptxgen.types import f32, u8, u32

from .gemv_common import MAX_RING_BYTES, _pos_pow2, reference as gemv_reference, silu_times, warp_sum
from .gemv_q4k import _piece_dot, _piece_offsets, _piece_x
from .gemv_stream import copy_rows
from .spec_fields import pdl_field, pdl_prologue, pdl_wait, target_field

__all__ = ["FfnSpec", "build", "launch_geometry", "reference", "CANONICAL"]

_SB = 144               # bytes of a Q4_K super-block (256 weights)
NONE = 0xFFFFFFFF       # "no pending item"


def _pieces(k: int) -> int:
    """32-weight pieces of a Q4_K row of ``k`` weights."""
    return k // 256 * 8


def _check_dim(inst, attr, v):
    if not (isinstance(v, int) and not isinstance(v, bool) and v > 0 and v % 256 == 0):
        raise ValueError(f"{attr.name} must be a positive multiple of 256 (the Q4_K "
                         f"block), got {v!r}")


@attrs.frozen
class FfnSpec:
    """The persistent gate/up + down kernel (all three matrices Q4_K).

    Parameters
    ----------
    hidden : int
        Model width: x, r and y have ``hidden`` values, Wg/Wu rows are
        ``hidden`` long, Wd has ``hidden`` rows.  A multiple of 256.
    ffn : int
        FFN width: Wg/Wu have ``ffn`` rows, Wd rows are ``ffn`` long.  A
        multiple of 256 with at most two pieces per thread:
        ``8 * ffn / 256 <= 2 * threads``.
    rows_up : int
        Phase 1 rows per slice per item (both matrices).
    rows_down : int
        Phase 2 rows per item.
    stages : int
        Ring stages (S - 1 items in flight), 2..8.
    threads : int
        Threads per CTA: a multiple of the phase 1 slice width (the Q4_K
        threads of a ``hidden`` row) and at least ``8 * ffn / 256``.
    lookahead : int
        Item ids thread 0 has grabbed beyond the ring's (1..4): each
        ``atom.add`` has that many items' time to return.
    ctas_per_sm : int
        Resident CTAs per SM the grid is sized for (``.minnctapersm``, so
        ptxas keeps registers low enough; the shared memory must fit too).
    """

    hidden: int = attrs.field(validator=_check_dim)
    ffn: int = attrs.field(validator=_check_dim)
    rows_up: int = attrs.field(default=2, validator=_pos_pow2(1, 16))
    rows_down: int = attrs.field(default=4, validator=_pos_pow2(1, 16))
    stages: int = attrs.field(default=4)
    threads: int = attrs.field(default=512)
    lookahead: int = attrs.field(default=1, validator=attrs.validators.in_((1, 2, 3, 4)))
    ctas_per_sm: int = attrs.field(default=1, validator=attrs.validators.in_((1, 2, 3, 4)))
    target: str = target_field()
    pdl: bool = pdl_field()

    @stages.validator
    def _check_stages(self, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and 2 <= v <= 8):
            raise ValueError(f"stages must be 2..8, got {v!r}")

    @threads.validator
    def _check_threads(self, attr, v):
        if not (isinstance(v, int) and 32 <= v <= 1024 and v % 32 == 0):
            raise ValueError(f"threads must be a multiple of 32 in 32..1024, got {v!r}")

    def __attrs_post_init__(self):
        if self.threads % self.slice_threads:
            raise ValueError(f"threads ({self.threads}) must be a multiple of the "
                             f"{self.slice_threads} threads a hidden={self.hidden} row needs")
        if self.pieces_down > 2:
            raise ValueError(f"ffn={self.ffn} has {_pieces(self.ffn)} pieces per row, at most two "
                             f"per thread: threads must be at least {_pieces(self.ffn) // 2}, "
                             f"got {self.threads}")
        if self.shared_bytes > MAX_RING_BYTES:
            raise ValueError(f"stages={self.stages} x {self.stage_bytes}-byte items need "
                             f"{self.shared_bytes} bytes of shared memory (at most "
                             f"{MAX_RING_BYTES}); use fewer rows or stages")

    @property
    def slice_threads(self) -> int:
        """Threads of one phase 1 slice (one piece of a ``hidden`` row each)."""
        return max(32, -(-_pieces(self.hidden) // 32) * 32)

    @property
    def pieces_down(self) -> int:
        """Pieces of a down row each thread owns (1 or 2)."""
        return -(-_pieces(self.ffn) // self.threads)

    @property
    def slices(self) -> int:
        return self.threads // self.slice_threads

    @property
    def rows1(self) -> int:
        """FFN rows of a phase 1 item."""
        return self.slices * self.rows_up

    @property
    def n1(self) -> int:
        return -(-self.ffn // self.rows1)

    @property
    def n2(self) -> int:
        return -(-self.hidden // self.rows_down)

    @property
    def rb1(self) -> int:
        return self.hidden // 256 * _SB

    @property
    def rb2(self) -> int:
        return self.ffn // 256 * _SB

    @property
    def stage_bytes(self) -> int:
        return max(2 * self.rows1 * self.rb1, self.rows_down * self.rb2)

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory (the ring)."""
        return self.stages * self.stage_bytes

    @property
    def kernel_name(self) -> str:
        return (f"gemv_ffn_q4_k_h{self.hidden}_f{self.ffn}_u{self.rows_up}d{self.rows_down}"
                f"_s{self.stages}_t{self.threads}"
                + (f"_c{self.ctas_per_sm}" if self.ctas_per_sm != 1 else "")
                + (f"_a{self.lookahead}" if self.lookahead != 1 else ""))


def build(spec: FfnSpec) -> ptxgen.Module:
    """The PTX module with the one kernel ``spec.kernel_name``."""
    H, F, S, T = spec.hidden, spec.ffn, spec.stages, spec.threads
    thr1, nsl, ru, R1, R2 = spec.slice_threads, spec.slices, spec.rows_up, spec.rows1, spec.rows_down
    rb1, rb2, n1, n2 = spec.rb1, spec.rb2, spec.n1, spec.n2
    p1, p2 = _pieces(H), _pieces(F)
    stage = spec.stage_bytes
    ring_bytes = S * stage
    warps1, warps = thr1 // 32, T // 32
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, reqntid=T, minnctapersm=spec.ctas_per_sm) as k:
        wg = k.param_ptr("wg", u8, align=16)
        wu = k.param_ptr("wu", u8, align=16)
        wd = k.param_ptr("wd", u8, align=16)
        x = k.param_ptr("x", f32, align=16)
        r = k.param_ptr("r", f32)
        hbuf = k.param_ptr("h", f32, align=16)
        y = k.param_ptr("y", f32)
        ctr = k.param_ptr("counters", u32)
        pdl_prologue(k, spec, wait=False)
        # on a line after the static reduction array (the builder's default
        # alignment, target.SHARED_LINE)
        ring = k.dynamic_shared("ring", u8)
        # warp sums, double-buffered: an item's rows are finished after the
        # next item's barrier (one barrier per item)
        red1 = k.shared_array("red1", f32, 2 * nsl * warps1 * 2 * ru, align=16)
        red2 = k.shared_array("red2", f32, 2 * warps * R2, align=16)
        Q = S + spec.lookahead                       # ids known ahead: the ring's, then grabbed
        gids = k.shared_array("gids", u32, Q, align=16)
        tid = k.tid.x
        b = k.ctaid.x
        G = k.nctaid.x
        my16 = k.mul_wide(tid, 16)

        def copy(ws, row0, nrows, rb, mrows, slot):
            """``nrows`` rows of every matrix in ``ws`` from ``row0`` into the
            stage at ``slot`` (copies clamped to each matrix's last 16 bytes)."""
            src = k.mul_wide(row0, rb) + my16
            copy_rows(k, ring[slot + tid * 16], ws, src, mrows * rb - 16, nrows * rb // 16, T,
                      tid, nrows * rb)

        def issue(item, slot):
            """Copy item ``item``'s rows into the stage at byte ``slot`` and
            commit (an empty group for a "done" id)."""
            with k.if_else(item < n1) as (then, other):
                with then:
                    copy([wg, wu], item * R1, R1, rb1, F, slot)
                with other:
                    with k.if_(item < n1 + n2):
                        copy([wd], (item - n1) * R2, R2, rb2, H, slot)
            k.cp_async_commit()

        # prologue: this CTA's first S - 1 items are b, b + G, ...; later ids
        # come from the grid counter (id = counter + (S - 1) G).  The counters
        # are touched only after the PDL wait: before it, the previous launch
        # of this kernel may still be grabbing from them.  Thread 0 grabs
        # lookahead + 1 items ahead of the ring, so an atomic has a whole
        # item's time to return before its id is needed.
        base_id = G * (S - 1)
        firsts = [b + G * j if j else b for j in range(S - 1)]
        for j, item in enumerate(firsts):
            issue(item, k.mov(j * stage, u32))
        pdl_wait(k, spec)
        pending = [k.var(u32, 0) for _ in range(spec.lookahead)]
        with k.if_(tid.eq(0)):
            for j, item in enumerate(firsts):
                k.st(gids[j], item)
            k.st(gids[S - 1], k.atom("add", ctr[0], 1) + base_id)
            for pv in pending:
                k.assign(pv, k.atom("add", ctr[0], 1) + base_id)

        # phase 1 pieces: slice sl, thread lt of it, piece lt of a hidden row
        sl = tid // thr1 if nsl > 1 else None
        lt = tid - sl * thr1 if nsl > 1 else tid
        pc1 = _piece_offsets(k, lt, 0, thr1, p1)
        _piece_x(k, x, pc1)
        h32 = pc1["sb"] * _SB
        q32 = h32 + (pc1["c"] << 4) + 16
        row_in = (sl * (ru * rb1)) if nsl > 1 else None     # the slice's first row in a stage
        lane, warp = tid & 31, tid >> 5
        lwarp = lt >> 5                                     # warp within the slice

        js = k.var(u32, 0)          # gid slot of the current item (item count mod Q)
        rd = k.var(u32, 0)          # byte offset of its ring stage
        buf = k.var(u32, 0)         # which half of red its partials go to
        pend = k.var(u32, NONE)     # the item whose partials wait in red[buf ^ 1]
        done1 = k.var(u32, 0)       # phase 1 items this CTA finished

        def slot_plus(c):
            t = js + c
            return k.select(t >= Q, t - Q, t)

        def top():
            """Wait for the current item's copies; its id (uniform)."""
            k.cp_async_wait(S - 2)
            k.bar_sync(0)
            return k.ld(gids[js])

        def next_item():
            """Issue item (count + S - 1) into the stage the previous item used."""
            wr = k.select(rd.eq(0), k.mov(ring_bytes - stage, u32), rd - stage)
            issue(k.ld(gids[slot_plus(S - 1)]), wr)

        def advance():
            """After the item: thread 0 publishes the id of item (count + S)
            (grabbed ``lookahead`` items ago) and grabs another; step on."""
            with k.if_(tid.eq(0)):
                k.st(gids[slot_plus(S)], pending[0])
                for a, b_ in zip(pending, pending[1:]):
                    k.assign(a, b_)
                k.assign(pending[-1], k.atom("add", ctr[0], 1) + base_id)
            k.assign(js, slot_plus(1))
            nr = rd + stage
            k.assign(rd, k.select(nr.eq(ring_bytes), k.mov(0, u32), nr))
            k.assign(buf, buf ^ 1)

        def partials(red, per_buf, base, sums):
            """Lane 0 of each warp parks the warp's sums at ``base`` of the
            current half of ``red``."""
            with k.if_(lane.eq(0)):
                off = buf * per_buf + base
                for i, v in enumerate(sums):
                    k.st(red[off + i], v)

        def finish1():
            """Thread i < rows_up of each slice: the pending phase 1 item's
            row (sum over the slice's warps) -> h = silu(g) * u."""
            per_buf = nsl * warps1 * 2 * ru
            row = pend * R1 + (sl * ru + lt if nsl > 1 else lt)
            with k.if_(k.setp("lt", lt, ru, combine=("and", pend.ne(NONE)))):
                with k.if_(row < F):
                    off = (buf ^ 1) * per_buf + (sl * (warps1 * 2 * ru) if nsl > 1 else 0) + lt
                    tot = []
                    for mi in range(2):
                        t = k.ld(red1[off + mi * ru])
                        for w in range(1, warps1):
                            t = t + k.ld(red1[off + (w * 2 * ru + mi * ru)])
                        tot.append(t)
                    k.st(hbuf[row], silu_times(k, tot[0], tot[1]))

        def finish2():
            """Thread i < rows_down: the pending phase 2 row -> y = sum + r."""
            per_buf = warps * R2
            row = (pend - n1) * R2 + tid
            with k.if_(k.setp("lt", tid, R2, combine=("and", pend.ne(NONE)))):
                with k.if_(row < H):
                    off = (buf ^ 1) * per_buf + tid
                    t = k.ld(red2[off])
                    for w in range(1, warps):
                        t = t + k.ld(red2[off + w * R2])
                    # plain ld, not .nc: y may be r
                    k.st(y[row], t + k.ld(r[row]))

        cur = k.var(u32, top())
        with k.while_(lambda: cur < n1):
            finish1()
            next_item()
            hb = ring[rd + h32 + row_in if row_in is not None else rd + h32]
            qb = ring[rd + q32 + row_in if row_in is not None else rd + q32]
            sums = []
            for mi in range(2):
                for i in range(ru):
                    o = mi * R1 * rb1 + i * rb1
                    hdr = k.ld(hb + o, u32, vec=4)
                    qs = k.ld(qb + o, u32, vec=4)
                    sums.append(warp_sum(k, _piece_dot(k, hdr, qs, pc1)))
            slot_base = ((sl * warps1 + lwarp) if nsl > 1 else lwarp) * (2 * ru)
            partials(red1, nsl * warps1 * 2 * ru, slot_base, sums)
            k.assign(pend, cur)
            advance()
            k.assign(done1, done1 + 1)
            k.assign(cur, top())
        finish1()
        k.assign(pend, NONE)
        k.bar_sync(0)

        # grid barrier: every phase 1 item stored before h is read
        with k.if_(tid.eq(0)):
            k.fence("acq_rel", "gpu")
            k.red("add", ctr[1], done1)
        with k.if_(cur < n1 + n2):
            with k.if_(tid.eq(0)):
                with k.while_(lambda: k.ld(ctr[1], sem="relaxed", scope="gpu") < n1):
                    pass
                k.fence("acq_rel", "gpu")
            k.bar_sync(0)
            pcs2 = []
            for i in range(spec.pieces_down):
                pc = _piece_offsets(k, tid, i, T, p2)
                _piece_x(k, hbuf, pc, cache="cg")
                pc["h2"] = pc["sb"] * _SB
                pc["q2"] = pc["h2"] + (pc["c"] << 4) + 16
                pcs2.append(pc)
            live = tid < -(-p2 // 32) * 32          # warps with a piece
            with k.while_(lambda: cur < n1 + n2):
                finish2()
                next_item()
                acc = [k.var(f32, 0.0) for _ in range(R2)]
                with k.if_(live):
                    for pc in pcs2:
                        hb = ring[rd + pc["h2"]]
                        qb = ring[rd + pc["q2"]]
                        for i in range(R2):
                            hdr = k.ld(hb + i * rb2, u32, vec=4)
                            qs = k.ld(qb + i * rb2, u32, vec=4)
                            k.assign(acc[i], acc[i] + _piece_dot(k, hdr, qs, pc))
                partials(red2, warps * R2, warp * R2, [warp_sum(k, a) for a in acc])
                k.assign(pend, cur)
                advance()
                k.assign(cur, top())
            finish2()

        # the last CTA out zeroes the counters for the next launch
        with k.if_(tid.eq(0)):
            k.fence("acq_rel", "gpu")
            old = k.atom("add", ctr[2], 1)
            with k.if_((old + 1).eq(G)):
                k.fence("acq_rel", "gpu")
                for i in range(3):
                    k.st(ctr[i], 0)
    return m


def launch_geometry(spec: FfnSpec, sm_count: int, ctas_per_sm: int | None = None):
    """``(grid, block, shared_bytes)``: one wave of ``sm_count *
    ctas_per_sm`` (default ``spec.ctas_per_sm``) persistent CTAs (every one must be resident at once; use
    at most the driver's occupancy)."""
    if not (isinstance(sm_count, int) and sm_count >= 1):
        raise ValueError(f"sm_count must be a positive int, got {sm_count!r}")
    if ctas_per_sm is None:
        ctas_per_sm = spec.ctas_per_sm
    if not (isinstance(ctas_per_sm, int) and ctas_per_sm >= 1):
        raise ValueError(f"ctas_per_sm must be a positive int, got {ctas_per_sm!r}")
    return (sm_count * ctas_per_sm, 1, 1), (spec.threads, 1, 1), spec.shared_bytes


def reference(wg, wu, wd, x, r):
    """float64 ``Wd (silu(Wg x) * (Wu x)) + r`` from gguf-dequantized
    weights; also returns the float64 ``h``."""
    h = gemv_reference("Q4_K", wg, x, w_up=wu, epilogue="swiglu")
    return gemv_reference("Q4_K", wd, h, residual=r, epilogue="residual"), h


CANONICAL = {
    "gemv_ffn_q4_k": FfnSpec(hidden=512, ffn=768, rows_up=2, rows_down=2, stages=3,
                             threads=256),
}

registry.register("gemv_ffn", FfnSpec, build, CANONICAL, doc=__doc__.splitlines()[0])

