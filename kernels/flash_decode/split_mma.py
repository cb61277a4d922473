"""The split kernel on tensor cores (``mma.sync.m16n8k16``)."""

from __future__ import annotations

from ptxgen.types import b32, f16, f32, s32, u32

from ..spec_fields import pdl_prologue, pdl_wait
from .common import LOG2E, deal_keys, merge_warps, split_params, write_empty_split
from .spec import NEG

__all__ = ["build_split_mma"]

LO_SCALE = 2048.0        # a split value's low f16 half is stored times 2^11
LO_WEIGHT = 1.0 / LO_SCALE


def _split_f16(k, x):
    """``x`` (f32) as ``hi + lo * 2^-11`` with ``hi = f16(x)`` and ``lo =
    f16((x - hi) * 2^11)``: 22 bits of ``x``'s significand in two halves
    (the scaled residual stays clear of f16's subnormals)."""
    hi = k.cvt(f16, x)
    lo = k.cvt(f16, k.mul(x - hi.to(f32), LO_SCALE, rnd="rn"))
    return hi, lo


def _a_halves(k, vals):
    """An ``A`` fragment of ``mma.m16n8k16`` from one lane's 4 f32 values of
    its row ``g`` (columns ``2 t, 2 t + 1, 2 t + 8, 2 t + 9``): registers 0
    and 2 (row ``g``) hold their high f16 halves, 1 and 3 (row ``g + 8``)
    their low halves (:func:`_split_f16`)."""
    hi, lo = zip(*(_split_f16(k, x) for x in vals))
    return (k.pack(b32, hi[0], hi[1]), k.pack(b32, lo[0], lo[1]),
            k.pack(b32, hi[2], hi[3]), k.pack(b32, lo[2], lo[3]))


def build_split_mma(m, spec):
    """The split kernel on tensor cores (``mma.sync.m16n8k16``, f16 in, f32
    accumulate); same parameters, partials and key dealing as the CUDA-core
    split.

    A warp takes 16 keys at a time (``unroll`` such chunks per loop trip);
    lane ``4 g + t`` is group ``g``, thread ``t`` of the fragments.

    * Scores ``S = Q K^T``: ``A`` is q, 16 rows: row ``g`` the f16 high part
      of query head ``g`` (prescaled by ``sm_scale * log2 e``; zero for
      ``g >= group``), row ``g + 8`` its low part times 2^11, so one mma
      gives both and ``s = hi + lo * 2^-11`` has q to 22 bits.  ``B`` is two
      n-tiles of 8 keys: lane ``(g, t)`` loads key ``8 j + g`` of the chunk,
      16-byte chunks ``t, t + 4, ...`` of its row, whose words are its ``B``
      registers for the k-tiles in turn (the dot product's dimension order
      is permuted, the same way in q's fragments).
    * Online softmax: lane ``(g, t)`` holds head ``g``'s scores of keys ``8 j
      + 2 t + e``; the head's maximum is taken over its 4 lanes (2
      shuffles); the output is rescaled only when some lane's maximum moved
      (a warp vote), so after the first chunks a trip skips it.
    * ``O += P V``: ``A`` is P, rows ``g`` / ``g + 8`` its high / low f16
      parts as for q, its key order the scores' (``S``'s accumulator
      fragment is ``A``'s layout).  ``B`` is V, 8 dimensions by the 16 keys:
      lane ``(g, t)`` loads keys ``2 t, 2 t + 1, 2 t + 8, 2 t + 9`` at
      dimensions ``64 c + 8 g .. + 8`` and pairs the halves of two keys with
      one ``prmt`` per register; n-tile ``(c, i)`` holds dimensions ``64 c +
      8 n + i`` (n its column), so lane ``(g, t)`` ends with head ``g``'s
      dimensions ``64 c + 16 t .. + 16``.
    * Loads: a trip's K and V words are issued at its top (the first trip's
      with ``early_kv`` before ``griddepcontrol.wait``, as in the CUDA-core
      split: q after the wait, and a lane whose row is ``kv_len - 1`` loads
      it again).  Issuing the next trip's loads before this trip's math
      needs more registers than ptxas's limit of 255 (docs/notes/flash_decode.md).

    The warps' partials meet in shared memory as in the CUDA-core split."""
    d, G, U, NW = spec.head_dim, spec.group, spec.unroll, spec.warps
    KT = d // 16            # k-tiles of q . k
    KC = d // 32            # 16-byte chunks of a K row per lane
    VC = d // 64            # 16-byte chunks of a V row per lane
    CH = 16                 # keys per chunk
    with m.kernel(spec.split_name, reqntid=32 * NW,
                  minnctapersm=None) as k:
        pdl_prologue(k, spec, wait=not spec.early_kv)
        (q, kc, vc, kv_len_ptr, part_o, part_ml, cap, sm_scale,
         (sm_m, sm_l, sm_o)) = split_params(k, spec, f16)

        tid = k.tid.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        split = k.ctaid.x
        nsplit = k.nctaid.x
        h = k.ctaid.y

        def load_q():
            """q's A fragments per k-tile: head g's values at dimensions 8 (t +
            4 i) .., prescaled (by 0 for a row past the group), in halves."""
            c = k.mul(sm_scale, LOG2E, rnd="rn")
            cg = k.select(g < G, c, k.mov(0.0, f32))
            qrow = (h * G + k.min(g, G - 1)) * d + 8 * t
            qv = []
            for i in range(KC):
                vals = list(k.ld(q[qrow + 32 * i], vec=4, nc=True))
                vals += list(k.ld(q[qrow + 32 * i + 4], vec=4, nc=True))
                qv.append([k.mul(x, cg, rnd="rn") for x in vals])
            return [_a_halves(k, qv[kt // 2][4 * (kt % 2):4 * (kt % 2) + 4])
                    for kt in range(KT)]

        early = spec.early_kv
        # a lane reads a quarter (K) or half (V) of a row's 256 bytes per load
        l2 = "L2::256B" if spec.l2_prefetch else None
        l1 = "L1::no_allocate" if spec.l1_bypass else None
        qa = None if early else load_q()
        # this split's keys, dealt in chunks of 16
        L, start, split_end, lo = deal_keys(k, spec, kv_len_ptr, cap, split, nsplit, CH)
        first_key = start                        # the split's first key (empty: >= L)
        end, stride = split_end(), CH * U * NW
        if spec.interleave:
            # long enough: warp trips of CH * U keys dealt round robin, split s
            # taking trips s, s + n, ... of [lo, L), its warps in turn (warp w:
            # s + w n, then NW n further each time); only the last is partial
            rnd = nsplit * (CH * U * NW)         # keys of one round
            il = (L if lo is None else L - lo) >= rnd * spec.interleave
            first = split * (CH * U)
            wfirst = (warp * nsplit + split) * (CH * U)
            if lo is not None:
                first, wfirst = first + lo, wfirst + lo
            first_key = k.select(il, first, start)
            start = k.select(il, wfirst, start)
            end = k.select(il, L, end)
            stride = k.select(il, rnd, k.mov(stride, u32))
        lastc = k.max(end, 1) - 1                # rows clamped to a valid one (0 when empty)
        row0 = h * cap
        wofs = warp * (CH * U)                   # the warp's first key in a trip
        if spec.interleave:
            wofs = k.select(il, k.mov(0, u32), wofs)

        def chunk_rows(kb):
            """The rows a lane loads for the chunk at ``kb``, clamped: K rows
            ``kb + 8 j + g`` (j = 0, 1), then V rows ``kb + 2 t + (0, 1, 8, 9)``."""
            return ([k.min(kb + (8 * j) + g, lastc) for j in range(2)]
                    + [k.min(kb + 2 * t + r, lastc) for r in (0, 1, 8, 9)])

        def row_words(n, row, cg=False, evict=None):
            """The lane's words of row ``row``: of K (``n < 2``: chunks ``t +
            4 i``) or of V (chunks ``8 g + 64 c``); ``evict`` the L1 hint of
            the ``.nc`` loads."""
            ptr, first, nchunk, stride = ((kc, 8 * t, KC, 32) if n < 2 else
                                          (vc, 8 * g, VC, 64))
            idx = (row0 + row) * d + first
            return [list(k.ld(ptr[idx + stride * c_], ty=b32, vec=4, nc=not cg,
                              cache="cg" if cg else None, prefetch=l2,
                              evict=None if cg else evict))
                    for c_ in range(nchunk)]

        def trip_loads(base, cg=False, evict=None):
            """Per chunk ``u``: the words of its 6 rows (K j = 0, 1, V r)."""
            return [[row_words(n, row, cg, evict) for n, row in
                     enumerate(chunk_rows(base + wofs + CH * u))] for u in range(U)]

        if early:
            # the first trip in flight before the wait; then q, and the row
            # the grid before may have appended, loaded again
            first = _as_vars(k, trip_loads(start, cg=True))
            pdl_wait(k, spec)
            qa = load_q()
            newest = L - 1
            # the rows again rather than kept from before the wait: holding
            # them across q's fragments costs registers (at unroll 2 it takes
            # ptxas to its limit of 255)
            for u in range(U):
                for n, row in enumerate(chunk_rows(start + wofs + CH * u)):
                    with k.if_(row.eq(newest)):
                        for cw, nw in zip(_leaves(first[u][n]), _leaves(row_words(n, row, True))):
                            k.assign(cw, nw)
        with k.if_(first_key >= L):
            write_empty_split(k, spec, part_o, part_ml, h, split, nsplit, tid)

        m_run = k.var(f32, NEG)
        l_run = k.var(f32, 0.0)
        o_acc = [[k.var(f32, 0.0) for _ in range(4)] for _ in range(8 * VC)]
        zero = k.mov(0.0, f32)
        ninf = k.mov(float("-inf"), f32)

        def trip(base, words):
            mma_trip(k, base + wofs, words, end=end, t=t, qa=qa, zero=zero, ninf=ninf,
                     m_run=m_run, l_run=l_run, o_acc=o_acc)

        loop_from = start
        if early:
            # the first trip on the words loaded before the wait, the rest
            # loading theirs at the top of the trip, as without early_kv
            with k.if_(start < end):
                trip(start, first)
            loop_from = start + stride

        def loop(evict):
            with k.for_range(loop_from, end, stride) as base:
                trip(base, trip_loads(base, evict=evict))

        if spec.bypass_from:
            # two copies of the loop: the loads bypass L1 only from
            # bypass_from rounds of trips on
            with k.if_else(L >= nsplit * (CH * U * NW * spec.bypass_from)) as (by, plain):
                with by:
                    loop(l1)
                with plain:
                    loop(None)
        else:
            loop(l1)

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
        merge_warps(k, spec, (sm_m, sm_l, sm_o), part_o, part_ml, h, split, nsplit, tid)


def mma_trip(k, kb0, words, *, end, t, qa, zero, ninf, m_run, l_run, o_acc, lo=None):
    """One trip of a warp over ``len(words)`` chunks of 16 keys from ``kb0``
    (flash decode's and paged attention's tensor-core split): the scores
    ``q . k`` by ``mma.m16n8k16`` over ``qa``'s k-tiles (keys from ``end``
    on masked, and, given ``lo``, keys before it: a sliding window whose
    first chunk starts before it), the online softmax of ``m_run``/``l_run``,
    ``O += P V`` into ``o_acc``.  ``words[u]``: chunk ``u``'s K words (two
    8-key tiles) then its V words; ``t`` the lane's thread in its quad."""
    CH = 16
    U, KT, VC = len(words), len(qa), len(words[0][2])
    # key kb0 + 16 u + 8 j + 2 t + e is valid when 16 u + 8 j + e < end - (kb0 + 2 t)
    # (and, with a window, >= lo - (kb0 + 2 t))
    left = (end - (kb0 + 2 * t)).bitcast(s32)
    below = None if lo is None else (lo - (kb0 + 2 * t)).bitcast(s32)
    s = []
    for u in range(U):
        kw = words[u][:2]
        for j in range(2):
            acc = (zero, zero, zero, zero)
            for kt in range(KT):
                i, e = divmod(kt, 2)
                acc = k.mma_m16n8k16(qa[kt], (kw[j][i][2 * e], kw[j][i][2 * e + 1]), acc)
            for e in range(2):
                val = k.fma(acc[2 + e], LO_WEIGHT, acc[e])
                val = k.select(left > CH * u + 8 * j + e, val, ninf)
                if below is not None:
                    val = k.select(below > CH * u + 8 * j + e, ninf, val)
                s.append(val)
    mt = s[0]
    for x in s[1:]:
        mt = k.max(mt, x)
    mt = k.max(mt, k.shfl_xor(mt, 1))
    mt = k.max(mt, k.shfl_xor(mt, 2))
    m_new = k.max(m_run, mt)
    with k.if_(k.vote_sync("any", m_new > m_run)):
        alpha = k.ex2(m_run - m_new)
        k.assign(l_run, k.mul(l_run, alpha, rnd="rn"))
        for acc in o_acc:
            for r in acc:
                k.assign(r, k.mul(r, alpha, rnd="rn"))
    k.assign(m_run, m_new)
    p = [k.ex2(x - m_new) for x in s]
    psum = p[0]
    for x in p[1:]:
        psum = psum + x
    k.assign(l_run, l_run + psum)
    for u in range(U):
        vw = words[u][2:]
        pa = _a_halves(k, p[4 * u:4 * u + 4])
        for ci in range(VC):
            for n in range(8):
                w, e = divmod(n, 2)
                sel = 0x7632 if e else 0x5410
                b = (k.prmt(vw[0][ci][w], vw[1][ci][w], sel),
                     k.prmt(vw[2][ci][w], vw[3][ci][w], sel))
                acc = o_acc[8 * ci + n]
                for r, x in zip(acc, k.mma_m16n8k16(pa, b, tuple(acc))):
                    k.assign(r, x)


def _leaves(tree):
    """The registers of a nested list, in order."""
    if isinstance(tree, (list, tuple)):
        return [x for sub in tree for x in _leaves(sub)]
    return [tree]


def _as_vars(k, words):
    """The loaded words as variables (the pipeline's registers); a module
    function: a nested one calling itself would hold the builder in a cycle."""
    if isinstance(words, (list, tuple)):
        return [_as_vars(k, w) for w in words]
    return k.var(b32, words)
