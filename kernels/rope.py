"""Rotary position embedding (RoPE) applied in place to Q and K (f32).

For each head and each frequency index ``i < head_dim / 2`` a pair
``(a, b)`` is rotated by ``pos * inv_freq[i]``: ``a' = a cos - b sin``,
``b' = a sin + b cos``.  The pair is ``(x[i], x[i + d/2])`` in the
``neox`` layout (halves) and ``(x[2i], x[2i + 1])`` in the ``interleaved``
layout (GPT-J / Meta).  ``inv_freq[i] = theta ** (-2i / d)``, optionally
rescaled as Llama 3 does (``scaling="llama3"``: factor, low/high frequency
factors, original context length).

The position is read from a device int32 (``pos_ptr[0]``).  ``inv_freq``
comes from the host as a ``[d/2, 2]`` f32 table of (hi, lo) pairs whose sum
is the float64 value (:func:`freq_table`).  The angle is formed as an exact
product (``fma`` for the rounding error), reduced modulo 2*pi with a
three-part Cody-Waite constant, and only then given to ``sin.approx`` /
``cos.approx`` (absolute error about 5e-7 on [-pi, pi]).  Result: error
within 1e-5 of float64 relative to the largest element, for positions
below 2**24.

Layout: ``q`` is ``[n_q_heads, head_dim]``, ``k`` ``[n_kv_heads, head_dim]``
(contiguous).  Launch: one thread per pair, ``(n_q_heads + n_kv_heads) *
head_dim / 2`` threads, ``grid = ceil(that / block)``.

Parameters: ``q, k: f32*, freqs: f32[d/2, 2], pos_ptr: s32*, n_q_heads: u32,
n_kv_heads: u32``; with ``append`` set (the fused decode-step form) also
``v: f32*, k_cache, v_cache: f16* or f32*, capacity: u32``; with ``rows``
also ``row_stride: u32, n_rows_ptr: s32*``; with ``qk_norm`` (the per-head
RMSNorm of q and k in front of the rotation) then
``q_norm: f32*, k_norm: f32*, eps: f32``.

Rows (``rows=True``): ``grid.y`` rows of a ``[T_max, ...]`` buffer, row
``y`` (its q, k and v each ``y * row_stride`` elements on) at position
``pos_ptr[0] + y``; rows at or past the device count ``n_rows_ptr[0]`` are
left alone.

Paged (``paged=block_size``, with ``rows`` and ``append``): the rows are
tokens of any sequences, row ``y`` at its own position ``positions[y]``,
its K and V rows appended at slot ``slots[y]`` of a paged KV cache (the
layout of :mod:`~ptxgen.kernels.paged_attention`: pools ``[num_blocks,
n_kv_heads, block_size, head_dim]``, slot ``s`` is block ``s //
block_size``, offset ``s % block_size``; vLLM's ``slot_mapping``).  The
parameters are named ``q, k, freqs, positions, n_q_heads, n_kv_heads, v,
k_pool, v_pool, n_slots, row_stride, n_rows_ptr, slots``: ``n_slots =
num_blocks * block_size``, and a slot outside ``[0, n_slots)`` (-1 for a
padding row) leaves the pools untouched (Q and K are still rotated).

Fused KV-cache append (``append="f16"`` or ``"f32"``): one launch does what
this kernel followed by ``kv_append`` does.  ``v`` is f32 ``[n_kv_heads,
head_dim]``, each cache ``[n_kv_heads, capacity, head_dim]`` (the
flash-decode layout).  Each thread that rotates a K pair still writes it
back to ``k`` in place, and also writes it into ``k_cache[h, pos, :]`` at
the pair's two indices (``cvt.rn.f16.f32`` for an f16 cache) and copies
``v[h, :]`` at the same two indices into ``v_cache[h, pos, :]``.  In the
interleaved layout the two values are adjacent (one packed 32-bit store of
two halves, or one ``st.v2.f32``); in the neox layout two scalar stores.
A position outside ``[0, capacity)`` leaves the caches untouched (Q and K
are still rotated).  ``v`` and the caches must be 8-byte aligned; cache
offsets are 32-bit (``n_kv_heads * capacity * head_dim < 2**32``, as in
``kv_append``).

Per-head q/k RMSNorm (``qk_norm``, Qwen3's attention input): one launch
where a GEMV's output would otherwise take an RMSNorm of the q heads, one
of the k heads and a RoPE launch.  Each q head ``x`` (each k head, with
the k weight) becomes ``x / sqrt(mean(x^2) + eps) * w``, rotated as above
and written back in place; with ``append`` the rotated k rows and the v
rows go to the cache as above.  ``w`` is the head's norm weight
(``q_norm`` or ``k_norm``, f32 ``[head_dim]``), element for element in the
layout of the head's values.

Thread mapping: a head's ``head_dim / 2`` rotation pairs are split over
``G = gcd(head_dim / 2, 32)`` threads (a power of two, so a head's threads
sit in one warp at a multiple of ``G``), each owning ``P = head_dim / (2G)``
pairs ``lane, lane + G, ...`` (coalesced: the group reads ``G`` adjacent
pairs at a time).  A thread adds up the squares of its pairs, ``log2 G``
butterfly shuffles give every thread of the head the sum, and each then
normalises (``div.rn``, ``sqrt.rn``: the RMSNorm kernel's ``precise``
rounding), weights, rotates and stores its pairs.  Every lane of a warp
takes part in the shuffles; lanes past the last head read the last head's
values, and they and the lanes of a row past the device count store
nothing.

Launch: ``(n_q_heads + n_kv_heads) * G`` threads a row, ``grid = (ceil(that
/ block), rows)``.  Accuracy: within 2e-5 of float64 relative to each
head's largest element.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import f16, f32, s32, u32

from .plan import LaunchGeometry
from .spec_fields import block_field, pdl_field, pdl_prologue, target_field

TWO_PI = 2.0 * math.pi
# 2*pi split for Cody-Waite reduction: C1 keeps 13 significant bits, so n * C1
# is exact for n < 2**11 and very nearly so up to the 2**24 positions allowed.
_C1 = float(np.float32(math.ldexp(round(math.ldexp(TWO_PI, 10)), -10)))
_C2 = float(np.float32(TWO_PI - _C1))
_C3 = float(np.float32(TWO_PI - _C1 - _C2))


#: ``RopeSpec.paged`` values: 0 (a contiguous cache) or a paged cache's block size
PAGED_BLOCKS = (0, 16, 32, 64, 128, 256)
#: ``qk_norm``: the most rotation pairs one thread owns
MAX_PAIRS_PER_THREAD = 8


def _positive(_, attr, v):
    if not (isinstance(v, (int, float)) and v > 0):
        raise ValueError(f"{attr.name} must be positive, got {v!r}")


@attrs.frozen
class RopeSpec:
    """A RoPE kernel.

    Parameters
    ----------
    head_dim : int
        Even, 8..512 (64 and 128 are the common ones).
    layout : {"neox", "interleaved"}
    theta : float
        RoPE base (10000 for Llama 2, 500000 for Llama 3).
    scaling : {"none", "llama3"}
    factor, low_freq_factor, high_freq_factor : float
        Llama-3 scaling parameters (used only when ``scaling="llama3"``).
    original_context : int
        Llama-3 ``original_max_position_embeddings``.
    append : {"none", "f16", "f32"}
        Also append this token's K (rotated) and V rows to a KV cache of
        that type at ``pos`` (the fused RoPE + KV-append decode kernel; extra
        parameters ``v, k_cache, v_cache, capacity``).  ``"none"``: RoPE only.
    rows : bool
        ``grid.y`` rows of tokens (see the module's docstring).
    paged : {0, 16, 32, 64, 128, 256}
        0: a contiguous cache; else the block size of a paged cache, each
        row at its own position and slot (needs ``rows`` and ``append``).
    qk_norm : bool
        The RMSNorm of every q and k head (a weight per head element for
        q, one for k, and eps: extra parameters ``q_norm, k_norm, eps``)
        before the rotation, as Qwen3 has it (a small group of threads
        per head; see the module docstring).
    block : int
    target : str
    """

    head_dim: int = attrs.field(default=128)
    layout: str = attrs.field(default="neox",
                              validator=attrs.validators.in_(("neox", "interleaved")))
    theta: float = attrs.field(default=10000.0, validator=_positive)
    scaling: str = attrs.field(default="none", validator=attrs.validators.in_(("none", "llama3")))
    factor: float = attrs.field(default=8.0, validator=_positive)
    low_freq_factor: float = attrs.field(default=1.0, validator=_positive)
    high_freq_factor: float = attrs.field(default=4.0, validator=_positive)
    original_context: int = attrs.field(default=8192, validator=_positive)
    append: str = attrs.field(default="none",
                              validator=attrs.validators.in_(("none", "f16", "f32")))
    rows: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    paged: int = attrs.field(default=0)
    qk_norm: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    block: int = block_field(128)
    target: str = target_field()
    pdl: bool = pdl_field()

    @head_dim.validator
    def _check_hd(self, _, v):
        if not (isinstance(v, int) and 8 <= v <= 512 and v % 2 == 0):
            raise ValueError(f"head_dim must be even in 8..512, got {v!r}")


    def __attrs_post_init__(self):
        if self.scaling == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 scaling needs high_freq_factor > low_freq_factor")
        if self.paged not in PAGED_BLOCKS or isinstance(self.paged, bool):
            raise ValueError(f"paged must be 0 (a contiguous cache) or a block size in "
                             f"{', '.join(map(str, PAGED_BLOCKS[1:]))}, got {self.paged!r}")
        if self.paged and not (self.rows and self.append != "none"):
            raise ValueError("paged (a paged KV cache) needs rows=True and append set")
        if self.qk_norm and self.pairs_per_thread > MAX_PAIRS_PER_THREAD:
            half = self.head_dim // 2
            raise ValueError(f"qk_norm: head_dim {self.head_dim} splits its {half} pairs over "
                             f"{half // self.pairs_per_thread} threads, {self.pairs_per_thread} "
                             f"a thread (at most {MAX_PAIRS_PER_THREAD}); give a head_dim "
                             "whose half has a larger power-of-two factor")

    @property
    def head_threads(self) -> int:
        """Threads per head: one per pair; with ``qk_norm`` ``gcd(head_dim /
        2, 32)``, a power of two within a warp, each owning
        :attr:`pairs_per_thread` pairs."""
        half = self.head_dim // 2
        return math.gcd(half, 32) if self.qk_norm else half

    @property
    def pairs_per_thread(self) -> int:
        return self.head_dim // 2 // self.head_threads

    @property
    def kernel_name(self) -> str:
        app = "" if self.append == "none" else f"_app{self.append[1:]}"
        return (f"rope_{self.layout}_d{self.head_dim}{app}" + ("_rows" if self.rows else "")
                + (f"_paged{self.paged}" if self.paged else "")
                + ("_qknorm" if self.qk_norm else ""))


def inv_freq(spec: RopeSpec) -> np.ndarray:
    """float64 ``inv_freq[d/2]`` with the spec's scaling (as Hugging Face
    ``_compute_llama3_parameters`` does)."""
    d = spec.head_dim
    f = 1.0 / spec.theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if spec.scaling == "llama3":
        lo_wl = spec.original_context / spec.low_freq_factor
        hi_wl = spec.original_context / spec.high_freq_factor
        wl = 2.0 * math.pi / f
        scaled = np.where(wl > lo_wl, f / spec.factor, f)
        smooth = ((spec.original_context / wl - spec.low_freq_factor)
                  / (spec.high_freq_factor - spec.low_freq_factor))
        smoothed = (1.0 - smooth) * scaled / spec.factor + smooth * scaled
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        f = np.where(medium, smoothed, scaled)
    return f


def freq_table(spec: RopeSpec) -> np.ndarray:
    """The ``[d/2, 2]`` f32 (hi, lo) table the kernel reads."""
    return table_of(inv_freq(spec))


def table_of(inv_freq) -> np.ndarray:
    """The ``[d/2, 2]`` f32 (hi, lo) table of any float64 inverse
    frequencies (e.g. a model file's, with its per-frequency factors)."""
    f = np.asarray(inv_freq, dtype=np.float64)
    hi = f.astype(np.float32)
    lo = (f - hi.astype(np.float64)).astype(np.float32)
    return np.ascontiguousarray(np.stack([hi, lo], axis=1))


def angle_sincos(k, pos_f, hi, lo):
    """``(sin, cos)`` of ``pos_f * (hi + lo)`` with reduction modulo 2*pi."""
    p = k.mul(pos_f, hi, rnd="rn")
    e = k.fma(pos_f, hi, -p)                    # exact error of the product
    t = k.fma(pos_f, lo, e)
    nq = k.cvt(f32, k.mul(p, 1.0 / TWO_PI, rnd="rn"), rnd="rni")
    nn = -nq
    r = k.fma(nn, _C1, p)
    r = k.fma(nn, _C2, r)
    r = k.fma(nn, _C3, r)
    r = k.add(r, t, rnd="rn")
    return k.sin(r), k.cos(r)


def rotate_pair(k, a, b, s, c):
    """``(a cos - b sin, a sin + b cos)``: the pair ``(a, b)`` rotated (given
    the angle's ``s``, ``c``); the product pairs are rounded as written."""
    return k.fma(a, c, k.mul(-b, s, rnd="rn")), k.fma(a, s, k.mul(b, c, rnd="rn"))


@attrs.frozen
class RopeParams:
    """A RoPE kernel's parameters as registers (None where the spec has none)."""
    q: object
    k: object
    freqs: object
    pos_ptr: object
    n_q: object
    n_kv: object
    v: object = None
    k_cache: object = None
    v_cache: object = None
    cap: object = None
    row_stride: object = None
    n_rows_ptr: object = None
    slots: object = None


def declare_params(k, spec: RopeSpec) -> RopeParams:
    """Declare the parameters of the module's docstring, in order (with
    ``rows`` and ``paged``, the names given there)."""
    paged = spec.paged
    cty = f16 if spec.append == "f16" else f32
    out = dict(q=k.param_ptr("q", f32, align=8), k=k.param_ptr("k", f32, align=8),
               freqs=k.param_ptr("freqs", f32, align=8),
               pos_ptr=k.param_ptr("positions" if paged else "pos_ptr", s32),
               n_q=k.param("n_q_heads", u32), n_kv=k.param("n_kv_heads", u32))
    if spec.append != "none":
        out.update(v=k.param_ptr("v", f32, align=8),
                   k_cache=k.param_ptr("k_pool" if paged else "k_cache", cty, align=8),
                   v_cache=k.param_ptr("v_pool" if paged else "v_cache", cty, align=8),
                   cap=k.param("n_slots" if paged else "capacity", u32))
    if spec.rows:
        out.update(row_stride=k.param("row_stride", u32),
                   n_rows_ptr=k.param_ptr("n_rows_ptr", s32))
        if paged:
            out.update(slots=k.param_ptr("slots", s32))
    return RopeParams(**out)


def build(spec: RopeSpec) -> ptxgen.Module:
    """PTX for ``spec``; parameters
    ``q, k, freqs: f32[d/2, 2], pos_ptr: s32*, n_q_heads: u32, n_kv_heads: u32``
    and, with ``spec.append`` set, ``v: f32*, k_cache, v_cache, capacity: u32``
    (with ``rows`` and ``paged``, the names of the module's docstring)."""
    if spec.qk_norm:
        return _build_qk_norm(spec)
    d = spec.head_dim
    half = d // 2
    app = spec.append != "none"
    paged = spec.paged
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, maxntid=spec.block) as k:
        pdl_prologue(k, spec)
        P = declare_params(k, spec)
        q, kk, freqs, pos_ptr, n_q, n_kv = P.q, P.k, P.freqs, P.pos_ptr, P.n_q, P.n_kv
        if app:
            vin, kc, vc, cap = P.v, P.k_cache, P.v_cache, P.cap
        if spec.rows:
            rstride, nrows_ptr, slots = P.row_stride, P.n_rows_ptr, P.slots
            yrow = k.ctaid.y
            live = yrow < k.max(k.ld(nrows_ptr[0]), 0).bitcast(u32)
            roff = yrow * rstride
        t = k.global_id()
        inside = t < (n_q + n_kv) * half
        if spec.rows:
            inside = k.setp("lt", t, (n_q + n_kv) * half, combine=("and", live))
        with k.if_(inside):
            head = t // half
            i = t - head * half
            is_q = head < n_q
            row = k.select(is_q, head, head - n_q)
            sel = k.ptr_reg(f32)
            k.select(is_q, q, kk, out=sel)
            rd = row * d
            xp = k.ptr_add(sel, rd + roff if spec.rows else rd)
            hi, lo = k.ld(freqs[i << 1], vec=2, nc=True)
            if paged:
                pos = k.ld(pos_ptr[yrow])
            else:
                pos = k.ld(pos_ptr[0])
            if spec.rows and not paged:
                pos = pos + yrow.bitcast(s32)
            pos_f = pos.to(f32)
            s, c = angle_sincos(k, pos_f, hi, lo)
            if spec.layout == "neox":
                j = i
                a_addr, b_addr = xp[i], xp[i + half]
                a, b = k.ld(a_addr), k.ld(b_addr)
            else:
                j = i << 1
                a_addr = xp[j]
                a, b = k.ld(a_addr, vec=2)
            if app:
                # K threads at a position inside the cache; V's pair is loaded
                # now (predicated) so that its latency overlaps the rotation.
                at = k.ld(slots[yrow]) if paged else pos     # the slot, or the cache row
                pos_u = at.bitcast(u32)
                ok = k.setp("ge", at, 0, combine=("and", ~is_q))
                ok = k.setp("lt", pos_u, cap, combine=("and", ok))
                v_addr = vin[(rd + roff if spec.rows else rd) + j]
                if spec.layout == "neox":
                    va = k.ld(v_addr, nc=True, guard=ok)
                    vb = k.ld(v_addr + half * f32.bytes, nc=True, guard=ok)
                else:
                    va, vb = k.ld(v_addr, vec=2, nc=True, guard=ok)
            a2, b2 = rotate_pair(k, a, b, s, c)
            if spec.layout == "neox":
                k.st(a_addr, a2)
                k.st(b_addr, b2)
            else:
                k.st(a_addr, (a2, b2))
            if app:
                with k.if_(ok):
                    store_kv_pair(k, spec, kc, vc, pos_u, row, n_kv, cap, j, (a2, b2),
                                  (va, vb))
    return m


def store_kv_pair(k, spec: RopeSpec, kc, vc, at, row, n_kv, cap, j, kpair, vpair):
    """Store a rotated K pair ``kpair`` and its V pair ``vpair`` (f32) into
    the caches (converted to their type): head ``row``, element ``j`` of the
    pair's first value, at cache row ``at`` (``[h, at, j]``), or with
    ``spec.paged`` at slot ``at`` of the pools (``[at // bs, h, at % bs,
    j]``).  The pair's second value is at ``j + 1`` (interleaved) or ``j +
    head_dim / 2`` (neox)."""
    d, paged = spec.head_dim, spec.paged
    cty = f16 if spec.append == "f16" else f32
    if paged:                       # [slot // bs, h, slot % bs, j]
        blk = at >> (paged.bit_length() - 1)
        off = at & (paged - 1)
        dst = k.mad(k.mad(k.mad(blk, n_kv, row), paged, off), d, j)
    else:
        dst = k.mad(k.mad(row, cap, at), d, j)   # [h, pos, j]
    for cache, (x0, x1) in ((kc, kpair), (vc, vpair)):
        c_addr = cache[dst]
        if cty is f16:
            x0, x1 = k.cvt(f16, x0, rnd="rn"), k.cvt(f16, x1, rnd="rn")
        if spec.layout == "neox":
            k.st(c_addr, x0)
            k.st(c_addr + d // 2 * cty.bytes, x1)
        elif cty is f16:
            k.st(c_addr, k.pack(u32, x0, x1), ty=u32)
        else:
            k.st(c_addr, (x0, x1))


def _build_qk_norm(spec: RopeSpec) -> ptxgen.Module:
    """PTX for a ``qk_norm`` spec (the module docstring's "Per-head q/k RMSNorm")."""
    d = spec.head_dim
    half = d // 2
    G, P = spec.head_threads, spec.pairs_per_thread
    app = spec.append != "none"
    paged = spec.paged
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, maxntid=spec.block) as k:
        pdl_prologue(k, spec)
        a = declare_params(k, spec)
        qn = k.param_ptr("q_norm", f32, align=8)
        kn = k.param_ptr("k_norm", f32, align=8)
        eps = k.param("eps", f32)
        t = k.global_id()
        total = (a.n_q + a.n_kv) * G
        if spec.rows:
            yrow = k.ctaid.y
            live = yrow < k.max(k.ld(a.n_rows_ptr[0]), 0).bitcast(u32)
            inside = k.setp("lt", t, total, combine=("and", live))
            roff = yrow * a.row_stride
        else:
            inside = k.setp("lt", t, total)
        # lanes past the last head read the last head (and store nothing)
        head = k.min(t >> (G.bit_length() - 1), a.n_q + a.n_kv - 1)
        lane = t & (G - 1)
        is_q = head < a.n_q
        row = k.select(is_q, head, head - a.n_q)
        rd = row * d
        base = rd + roff if spec.rows else rd
        xp = k.ptr_reg(f32)
        k.select(is_q, a.q, a.k, out=xp)
        xp = k.ptr_add(xp, base)
        wp = k.ptr_reg(f32)
        k.select(is_q, qn, kn, out=wp)
        pos = k.ld(a.pos_ptr[yrow]) if paged else k.ld(a.pos_ptr[0])
        if spec.rows and not paged:
            pos = pos + yrow.bitcast(s32)
        if app:
            # K threads of a position (or slot) inside the cache
            at = k.ld(a.slots[yrow]) if paged else pos
            at_u = at.bitcast(u32)
            ok = k.setp("ge", at, 0, combine=("and", ~is_q))
            ok = k.setp("lt", at_u, a.cap, combine=("and", ok))
            ok = ok & inside
        pos_f = pos.to(f32)
        pairs = []
        ss = None
        for p in range(P):
            i = lane + p * G
            hi, lo = k.ld(a.freqs[i << 1], vec=2, nc=True)
            if spec.layout == "neox":
                j = i
                x_addr = xp[i]
                x0 = k.ld(x_addr)
                x1 = k.ld(x_addr + half * f32.bytes)
                w0 = k.ld(wp[i], nc=True)
                w1 = k.ld(wp[i + half], nc=True)
            else:
                j = i << 1
                x_addr = xp[j]
                x0, x1 = k.ld(x_addr, vec=2)
                w0, w1 = k.ld(wp[j], vec=2, nc=True)
            vv = None
            if app:
                v_addr = a.v[base + j]
                if spec.layout == "neox":
                    vv = (k.ld(v_addr, nc=True, guard=ok),
                          k.ld(v_addr + half * f32.bytes, nc=True, guard=ok))
                else:
                    vv = k.ld(v_addr, vec=2, nc=True, guard=ok)
            part = k.fma(x1, x1, k.mul(x0, x0, rnd="rn"))
            ss = part if ss is None else ss + part
            pairs.append((j, x_addr, x0, x1, w0, w1, hi, lo, vv))
        # the head's sum of squares: a butterfly over its G lanes (every lane
        # of the warp takes part)
        off = G // 2
        while off:
            ss = ss + k.shfl_xor(ss, off)
            off //= 2
        mean = k.div(ss, k.mov(float(d), f32))
        scale = k.div(k.mov(1.0, f32), k.sqrt(mean + eps))
        with k.if_(inside):
            for j, x_addr, x0, x1, w0, w1, hi, lo, vv in pairs:
                s, c = angle_sincos(k, pos_f, hi, lo)
                n0 = k.mul(k.mul(x0, scale, rnd="rn"), w0, rnd="rn")
                n1 = k.mul(k.mul(x1, scale, rnd="rn"), w1, rnd="rn")
                r0, r1 = rotate_pair(k, n0, n1, s, c)
                if spec.layout == "neox":
                    k.st(x_addr, r0)
                    k.st(x_addr + half * f32.bytes, r1)
                else:
                    k.st(x_addr, (r0, r1))
                if app:
                    with k.if_(ok):
                        store_kv_pair(k, spec, a.k_cache, a.v_cache, at_u, row, a.n_kv, a.cap,
                                      j, (r0, r1), vv)
    return m


def launch_geometry(spec: RopeSpec, n_q_heads: int, n_kv_heads: int, rows: int = 1):
    """One thread per rotated pair of q and k (with ``qk_norm``,
    :attr:`RopeSpec.head_threads` a head), for ``rows`` rows (``grid.y``;
    ``spec.rows``, else one)."""
    if rows != 1 and not spec.rows:
        raise ValueError(f"{rows} rows need RopeSpec(rows=True)")
    total = (n_q_heads + n_kv_heads) * spec.head_threads
    return LaunchGeometry(spec.kernel_name, ((total + spec.block - 1) // spec.block, rows),
                          spec.block)


def reference(x, pos: int, spec: RopeSpec) -> np.ndarray:
    """float64 RoPE of ``x[..., head_dim]`` at position ``pos``."""
    return rotate(x, pos, inv_freq(spec), spec.layout)


def rotate(x, pos: int, freqs, layout: str) -> np.ndarray:
    """float64 RoPE of ``x[..., head_dim]`` at ``pos`` with inverse frequencies
    ``freqs[head_dim / 2]``, in the ``"neox"`` or ``"interleaved"`` layout."""
    x = np.asarray(x, dtype=np.float64)
    ang = pos * np.asarray(freqs, dtype=np.float64)
    c, s = np.cos(ang), np.sin(ang)
    out = x.copy()
    if layout == "neox":
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        out[..., :h] = a * c - b * s
        out[..., h:] = a * s + b * c
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
    return out


def qk_norm_reference(x, w, eps: float, pos: int, spec: RopeSpec) -> np.ndarray:
    """float64: each head of ``x[..., head_dim]`` RMS-normalised with weight
    ``w[head_dim]``, then rotated at ``pos`` (:func:`reference`)."""
    x = np.asarray(x, dtype=np.float64)
    normed = (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
              * np.asarray(w, dtype=np.float64))
    return reference(normed, pos, spec)


CANONICAL = {
    "rope_neox": RopeSpec(),
    "rope_llama3": RopeSpec(layout="interleaved", theta=500000.0, scaling="llama3"),
    "rope_llama3_append": RopeSpec(layout="interleaved", theta=500000.0, scaling="llama3",
                                   append="f16"),
    "rope_llama3_paged": RopeSpec(layout="interleaved", theta=500000.0, scaling="llama3",
                                  append="f16", rows=True, paged=16),
    # Qwen3's decode step: q/k heads in paired order, normalised, rotated, appended
    "rope_qk_norm": RopeSpec(layout="interleaved", theta=1000000.0, append="f16",
                             qk_norm=True, target="sm_90", pdl=True),
}

registry.register("rope", RopeSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
