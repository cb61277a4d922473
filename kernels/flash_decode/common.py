"""Pieces both split kernels and the combine share: the kernels' parameters,
the dealing of keys over the splits, the empty split's neutral partial, and
the online-softmax merge of partials."""

from __future__ import annotations

import math

from ptxgen.types import f32, s32, u32

from .spec import NEG

__all__ = ["LOG2E", "deal_keys", "split_params", "write_empty_split", "merge_warps",
           "merge_parts"]

LOG2E = 1.0 / math.log(2.0)


def deal_keys(k, spec, kv_len_ptr, cap, split, nsplit, unit):
    """The current length ``L``, clamped to ``[0, capacity]`` (read with
    ``ld.global.cg`` under ``early_kv``: before the wait it must come from
    L2, not a line an earlier grid left in L1), and this split's keys.  The
    keys are ``[lo, L)``: ``lo = max(L - window, 0)`` with a sliding window,
    else 0.  The first ``ceil((L - lo) / min_keys)`` splits (at most all)
    work; the keys' groups of ``unit`` are dealt out evenly among them:
    split ``s`` takes groups ``[s g / n, (s + 1) g / n)`` from ``lo``, the
    others see ``start >= L``.  Returns ``(L, start, split_end, lo)``
    (``lo`` None without a window); ``split_end()`` emits one past the
    split's last key, where the caller wants it."""
    raw = k.ld(kv_len_ptr[0], cache="cg") if spec.early_kv else k.ld(kv_len_ptr[0])
    L = k.min(k.max(raw, 0).bitcast(u32), cap)
    lo, n = None, L
    if spec.window:
        lo = k.select(L > spec.window, L - spec.window, k.mov(0, u32))
        n = L - lo
    ng = (n + (unit - 1)) // unit
    nact = k.max(k.min(nsplit, (n + (spec.min_keys - 1)) // spec.min_keys), 1)
    start = (split * ng) // nact * unit
    if lo is not None:
        start = start + lo

    def split_end():
        end = ((split + 1) * ng) // nact * unit
        return k.min(end if lo is None else end + lo, L)
    return L, start, split_end, lo


def split_params(k, spec, cty):
    """The parameters both split kernels take and the warps' partials in
    shared memory ``(sm_m, sm_l, sm_o)``."""
    d, G, NW = spec.head_dim, spec.group, spec.warps
    params = (k.param_ptr("q", f32, align=16), k.param_ptr("k_cache", cty, align=16),
              k.param_ptr("v_cache", cty, align=16), k.param_ptr("kv_len_ptr", s32),
              k.param_ptr("part_o", f32, align=16), k.param_ptr("part_ml", f32, align=8),
              k.param("capacity", u32), k.param("sm_scale", f32))
    sm_o = k.shared_array("sm_o", f32, NW * G * d, align=16)
    sm_m = k.shared_array("sm_m", f32, NW * G, align=16)
    sm_l = k.shared_array("sm_l", f32, NW * G, align=16)
    return params + ((sm_m, sm_l, sm_o),)


def write_empty_split(k, spec, part_o, part_ml, h, split, nsplit, tid):
    """A split with no rows: the neutral partial ``(m, l, o) = (-1e30, 0,
    0)`` for every head of the group, then exit."""
    d, G = spec.head_dim, spec.group
    nthreads = 32 * spec.warps
    with k.if_(tid < G):
        pidx = (h * G + tid) * nsplit + split
        k.st(part_ml[pidx << 1], (k.mov(NEG, f32), k.mov(0.0, f32)))
    # and a zero o, so the combine may weigh every split's o (by 0)
    # without a select that would let ptxas predicate its load on l
    z = k.mov(0.0, f32)
    for col in k.strided(tid, d // 4, nthreads):      # 16-byte stores per row
        for g in range(G):
            k.st(part_o[((h * G + g) * nsplit + split) * d + 4 * col], (z, z, z, z))
    k.exit()


def merge_warps(k, spec, shared, part_o, part_ml, h, split, nsplit, tid):
    """After a barrier, merge the warps' partials in shared memory (slot
    ``warp * G + g``: ``sm_m``, ``sm_l``, ``sm_o`` rows of ``head_dim``) and
    store the split's ``part_o``/``part_ml``: thread ``i`` takes items ``i,
    i + threads, ...`` of ``(head g, column j)``."""
    d, G, NW = spec.head_dim, spec.group, spec.warps
    sm_m, sm_l, sm_o = shared
    k.bar_sync(0)
    with k.for_range(tid, G * d, 32 * NW) as idx:
        g = idx // d
        j = idx - g * d
        mx, lsum, o = merge_parts(k, [(sm_m[g + r * G], sm_l[g + r * G],
                                        sm_o[(g + r * G) * d + j]) for r in range(NW)])
        pidx = (h * G + g) * nsplit + split
        k.st(part_o[pidx * d + j], o)
        with k.if_(j.eq(0)):
            k.st(part_ml[pidx << 1], (mx, lsum))


def merge_parts(k, parts):
    """Merge online-softmax partials ``(m, l, o)`` given as shared-memory
    addresses: ``(M, sum w l, sum w o)`` with ``M = max m``, ``w = 2^(m - M)``."""
    ms = [k.ld(pm) for pm, _, _ in parts]
    mx = ms[0]
    for x in ms[1:]:
        mx = k.max(mx, x)
    o = k.mov(0.0, f32)
    lsum = k.mov(0.0, f32)
    for m_, (_, pl, po) in zip(ms, parts):
        w = k.ex2(m_ - mx)
        o = k.fma(w, k.ld(po), o)
        lsum = k.fma(w, k.ld(pl), lsum)
    return mx, lsum, o
