"""The split kernel of paged decode attention, on tensor cores
(``mma.sync.m16n8k16``): flash decode's tensor-core split reading its keys
through a block table, one grid for a batch of sequences."""

from __future__ import annotations

from ptxgen.types import b32, f16, f32, s32, u32

from ..flash_decode.common import LOG2E, merge_parts
from ..flash_decode.split_mma import LO_WEIGHT, _a_halves, _as_vars, _leaves, mma_trip
from ..spec_fields import pdl_prologue, pdl_wait
from .spec import NEG

__all__ = ["build_split"]

CH = 16                 # keys per chunk (one mma n-extent of two 8-key tiles)


def build_split(m, plan):
    """The split kernel: ``grid = (n_splits, n_kv_heads, batch)``, ``block =
    32 * warps``; block ``(s, h, b)`` takes split ``s`` of sequence ``b``'s
    keys for KV head ``h`` and its ``group`` query heads.

    The math is flash decode's tensor-core split (``split_mma``): a warp
    takes ``unroll`` chunks of 16 keys a trip; q and the probabilities enter
    the mma as two f16 halves (22 bits), K and V as stored, f32
    accumulation; online softmax in base 2 with ``sm_scale * log2 e``
    folded into q.  What differs is where a key's row is:

    * A chunk starts at a multiple of 16 keys and a pool block holds a
      multiple of 16, so the chunk lies in one block: one block-table entry
      per chunk, read by the whole warp (one broadcast load), clamped to
      ``num_blocks - 1`` so a bad entry reads inside the pool.  The entries
      of a warp's next trip are loaded during this trip's math, so the table
      adds no round trip to the K/V loads.
    * Rows past the split's last key are clamped to it (their scores are
      masked), and a chunk past it to the chunk holding it, so nothing past
      the sequence's length is read, not even its table entries.
    * With a sliding window the keys start at the chunk holding the
      window's first key ``lo``; the keys of that chunk before ``lo`` are
      masked.
    * ``n_splits = 1`` (a launch whose grid has one split) divides by the
      softmax sum and writes ``out`` itself; with more, the block writes its
      partial ``(m, l, o)`` for the combine (a neutral one where the split
      has no keys).
    * With ``early_kv`` the first trip's table entries and K/V words are
      loaded before ``griddepcontrol.wait`` (``.cg``: the grid before may
      be writing the sequence's newest row), then q, and a lane whose row
      is the newest loads it again (flash decode's ``early_kv``); a split
      with no keys waits before it writes its empty partial.
    """
    d, G, U, NW, BS = plan.head_dim, plan.group, plan.unroll, plan.warps, plan.block_size
    lg = BS.bit_length() - 1
    KT = d // 16            # k-tiles of q . k
    KC = d // 32            # 16-byte chunks of a K row per lane
    VC = d // 64            # 16-byte chunks of a V row per lane
    l2 = "L2::256B" if plan.l2_prefetch else None
    l1 = "L1::no_allocate" if plan.l1_bypass else None
    early = plan.early_kv
    with m.kernel(plan.split_name, reqntid=32 * NW, minnctapersm=None) as k:
        pdl_prologue(k, plan, wait=not early)
        q = k.param_ptr("q", f32, align=16)
        kp = k.param_ptr("k_pool", f16, align=16)
        vp = k.param_ptr("v_pool", f16, align=16)
        table = k.param_ptr("block_table", s32)
        lens = k.param_ptr("seq_lens", s32)
        part_o = k.param_ptr("part_o", f32, align=16)
        part_ml = k.param_ptr("part_ml", f32, align=8)
        out = k.param_ptr("out", f16 if plan.out_type == "f16" else f32, align=16)
        q_stride = k.param("q_stride", u32)
        max_blocks = k.param("max_blocks", u32)
        num_blocks = k.param("num_blocks", u32)
        sm_scale = k.param("sm_scale", f32)
        sm_o = k.shared_array("sm_o", f32, NW * G * d, align=16)
        sm_m = k.shared_array("sm_m", f32, NW * G, align=16)
        sm_l = k.shared_array("sm_l", f32, NW * G, align=16)

        tid = k.tid.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        split = k.ctaid.x
        nsplit = k.nctaid.x
        h = k.ctaid.y
        b = k.ctaid.z
        hh = b * k.nctaid.y + h                  # (sequence, KV head): partials' row / G
        direct = nsplit.eq(1)

        # the sequence's length, clamped to its table's blocks; its 16-key
        # chunks from ``first`` (0, or with a window the chunk holding its
        # first key ``lo``) dealt evenly over the first ceil((L - first) /
        # min_keys) splits
        L = k.min(k.max(k.ld(lens[b]), 0).bitcast(u32), max_blocks << lg)
        lo = first = None
        n = L
        if plan.window:
            lo = k.select(L > plan.window, L - plan.window, k.mov(0, u32))
            first = lo & (0xFFFFFFFF - (CH - 1))
            n = L - first
        nch = (n + (CH - 1)) >> 4
        nact = k.max(k.min(nsplit, (n + (plan.min_keys - 1)) >> (plan.min_keys.bit_length() - 1)),
                     1)
        start = (split * nch) // nact * CH
        end = ((split + 1) * nch) // nact * CH
        if first is not None:
            start, end = start + first, end + first
        end = k.min(end, L)
        with k.if_(start >= L):
            if early:
                pdl_wait(k, plan)
            _write_empty(k, plan, part_o, part_ml, out, hh, split, nsplit, tid, direct)

        def load_q():
            """q's A fragments per k-tile: head g's values at dimensions 8 (t +
            4 i) .., prescaled (by 0 for a row past the group), in halves."""
            c = k.mul(sm_scale, LOG2E, rnd="rn")
            cg = k.select(g < G, c, k.mov(0.0, f32))
            qrow = b * q_stride + (h * G + k.min(g, G - 1)) * d + 8 * t
            qv = []
            for i in range(KC):
                vals = list(k.ld(q[qrow + 32 * i], vec=4, nc=True))
                vals += list(k.ld(q[qrow + 32 * i + 4], vec=4, nc=True))
                qv.append([k.mul(x, cg, rnd="rn") for x in vals])
            return [_a_halves(k, qv[kt // 2][4 * (kt % 2):4 * (kt % 2) + 4]) for kt in range(KT)]

        qa = None if early else load_q()

        stride = CH * U * NW                     # keys of a block trip
        lastc = end - 1                          # the split's last key
        last_chunk = lastc & (0xFFFFFFFF - (CH - 1))
        tab_row = b * max_blocks
        last_block = num_blocks - 1
        blk_elems = k.nctaid.y * (BS * d)        # elements of a pool block
        head_elems = h * (BS * d)
        wofs = warp * (CH * U)                   # the warp's first key in a trip

        def chunk_at(kb):
            """The chunk at key ``kb``, clamped to the split's last chunk."""
            return k.min(kb, last_chunk)

        def block_base(kb):
            """Element of row 0 of head ``h`` in the pool block holding the
            chunk at ``kb`` (its table entry clamped into the pool)."""
            ent = k.ld(table[tab_row + (chunk_at(kb) >> lg)])
            return k.min(ent.bitcast(u32), last_block) * blk_elems + head_elems

        def row_words(n, base, row, cg=False):
            """The lane's words of the chunk's row ``row`` (a key index) in the
            block at element ``base``: of K (``n < 2``: 16-byte chunks ``t + 4
            i``) or of V (chunks ``8 g + 64 c``); ``cg``: ``ld.global.cg``
            rather than the non-coherent path."""
            ptr, first, nchunk, step = (kp, 8 * t, KC, 32) if n < 2 else (vp, 8 * g, VC, 64)
            idx = base + (row & (BS - 1)) * d + first
            return [list(k.ld(ptr[idx + step * c_], ty=b32, vec=4, nc=not cg,
                              cache="cg" if cg else None, prefetch=l2,
                              evict=None if cg else l1)) for c_ in range(nchunk)]

        def chunk_rows(kb0, u):
            """Chunk ``u``'s rows a lane loads: K ``kb + 8 j + g``, j = 0, 1; V
            ``kb + 2 t + (0, 1, 8, 9)``, clamped to the last key."""
            kb = chunk_at(kb0 + CH * u)
            return ([k.min(kb + 8 * j + g, lastc) for j in range(2)]
                    + [k.min(kb + 2 * t + r, lastc) for r in (0, 1, 8, 9)])

        def trip_loads(kb0, bases, cg=False):
            """Per chunk ``u``: the words of its 6 rows (:func:`chunk_rows`)."""
            return [[row_words(n, bases[u], row, cg) for n, row in enumerate(chunk_rows(kb0, u))]
                    for u in range(U)]

        m_run = k.var(f32, NEG)
        l_run = k.var(f32, 0.0)
        o_acc = [[k.var(f32, 0.0) for _ in range(4)] for _ in range(8 * VC)]
        zero = k.mov(0.0, f32)
        ninf = k.mov(float("-inf"), f32)

        def trip(kb0, words):
            mma_trip(k, kb0, words, end=end, t=t, qa=qa, zero=zero, ninf=ninf, m_run=m_run,
                     l_run=l_run, o_acc=o_acc, lo=lo)

        # the table entries of the warp's first trip; in the loop those of
        # the next trip are loaded after this trip's K/V words
        bases = [k.var(u32, block_base(start + wofs + CH * u)) for u in range(U)]
        loop_from = start
        if early:
            # the first trip in flight before the wait; then q, and the row
            # the grid before may have appended, loaded again
            kb0 = start + wofs
            first = _as_vars(k, trip_loads(kb0, bases, cg=True))
            pdl_wait(k, plan)
            qa = load_q()
            newest = L - 1
            for u in range(U):
                for n, row in enumerate(chunk_rows(kb0, u)):
                    with k.if_(row.eq(newest)):
                        for cw, nw in zip(_leaves(first[u][n]),
                                          _leaves(row_words(n, bases[u], row, cg=True))):
                            k.assign(cw, nw)
            for u in range(U):
                k.assign(bases[u], block_base(kb0 + (stride + CH * u)))
            with k.if_(kb0 < end):
                trip(kb0, first)
            loop_from = start + stride
        with k.for_range(loop_from, end, stride) as kb:
            kb0 = kb + wofs
            words = trip_loads(kb0, bases)
            for u in range(U):
                k.assign(bases[u], block_base(kb0 + (stride + CH * u)))
            trip(kb0, words)

        # the warp's partial: the head's sum over its 4 lanes; o = hi + lo 2^-11
        l_run = l_run + k.shfl_xor(l_run, 1)
        l_run = l_run + k.shfl_xor(l_run, 2)
        slot = warp * G + g
        with k.if_(g < G):
            for ci in range(VC):
                vals = [None] * 16
                for n in range(8):
                    acc = o_acc[8 * ci + n]
                    vals[n] = k.fma(acc[2], LO_WEIGHT, acc[0])
                    vals[8 + n] = k.fma(acc[3], LO_WEIGHT, acc[1])
                for v4 in range(4):
                    k.st(sm_o[slot * d + 64 * ci + 16 * t + 4 * v4],
                         tuple(vals[4 * v4:4 * v4 + 4]))
            with k.if_(t.eq(0)):
                k.st(sm_m[slot], m_run)
                k.st(sm_l[slot], l_run)
        _merge_warps(k, plan, (sm_m, sm_l, sm_o), part_o, part_ml, out, hh, split, nsplit,
                     tid, direct)


def _write_empty(k, plan, part_o, part_ml, out, hh, split, nsplit, tid, direct):
    """A split with no keys, then exit: with one split (the sequence is
    empty) zero outputs, else the neutral partial ``(m, l, o) = (-1e30, 0,
    0)`` for every head of the group (the combine weighs its ``o`` by 0)."""
    d, G = plan.head_dim, plan.group
    nthreads = 32 * plan.warps
    z = k.mov(0.0, f32)
    zo = k.cvt(f16, z, rnd="rn") if plan.out_type == "f16" else z
    with k.if_else(direct, uniform=True) as (one, many):
        with one:
            for col in k.strided(tid, d // 4, nthreads):       # 16- (f16: 8-) byte stores
                for gi in range(G):
                    k.st(out[(hh * G + gi) * d + 4 * col], (zo, zo, zo, zo))
        with many:
            with k.if_(tid < G):
                pidx = (hh * G + tid) * nsplit + split
                k.st(part_ml[pidx << 1], (k.mov(NEG, f32), z))
            for col in k.strided(tid, d // 4, nthreads):
                for gi in range(G):
                    k.st(part_o[((hh * G + gi) * nsplit + split) * d + 4 * col], (z, z, z, z))
    k.exit()


def _merge_warps(k, plan, shared, part_o, part_ml, out, hh, split, nsplit, tid, direct):
    """After a barrier, merge the warps' partials in shared memory (slot
    ``warp * G + g``) into the split's: thread ``i`` takes items ``i, i +
    threads, ...`` of ``(head g, column j)``; with one split it stores
    ``o / l`` to ``out`` (``l >= 1``: the warp holding the maximum adds
    ``2^0`` for it), else ``part_o``/``part_ml``."""
    d, G, NW = plan.head_dim, plan.group, plan.warps
    sm_m, sm_l, sm_o = shared
    k.bar_sync(0)
    with k.for_range(tid, G * d, 32 * NW) as idx:
        gi = idx // d
        j = idx - gi * d
        mx, lsum, o = merge_parts(k, [(sm_m[gi + r * G], sm_l[gi + r * G],
                                        sm_o[(gi + r * G) * d + j]) for r in range(NW)])
        row = hh * G + gi
        with k.if_else(direct, uniform=True) as (one, many):
            with one:
                dst = out[row * d + j]
                res = k.div(o, lsum)
                k.st(dst, k.cvt(f16, res, rnd="rn") if plan.out_type == "f16" else res)
            with many:
                pidx = row * nsplit + split
                k.st(part_o[pidx * d + j], o)
                with k.if_(j.eq(0)):
                    k.st(part_ml[pidx << 1], (mx, lsum))
