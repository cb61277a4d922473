"""The router of a mixture of experts: a token's expert logits, their softmax,
the top-k experts and their renormalised weights, written to device memory
for the expert kernels to read (so a decode step stays one graph replay).

As llama.cpp's ``build_moe_ffn`` with softmax gating and ``norm_w``
(qwen3moe): ``logits = W x`` (``W`` f32 ``[n_expert, K]``, ``x`` f32),
``p = softmax(logits)``, the ``n_used`` experts of largest ``p`` in
descending order, ties to the lower expert id (llama.cpp's fused CUDA
top-k kernel's rule; its CPU argsort leaves equal values' order
unspecified), a NaN probability counted as ``-FLT_MAX`` (as there), and
weights ``p_e / max(sum_sel p, 2^-14)`` (``p_e`` as it is without ``norm_w``).

Launch: ``grid = (ceil(n_expert / warps), ceil(T / tokens))`` CTAs of
``block`` threads, one launch.  Warp ``w`` of CTA ``c`` computes the logits
of expert ``c * warps + w`` for the ``tokens`` tokens from ``ctaid.y
tokens`` (lanes stride over K in 16-byte loads, each W load used for every
token, one fixed reduction order a token, so the logits do not depend on
``tokens``) and stores them to ``logits``; the CTA that finishes a group of
tokens last (an ``atom.add`` on ``counter[ctaid.y]``, release/acquire
fences, as :mod:`ptxgen.kernels.argmax`) reads their logits back, warp
``j`` token ``j``, and selects: softmax (``ex2.approx``, ``div.rn``), then ``n_used``
rounds of a warp-wide maximum of 64-bit keys ``(order(p) << 32) | ~e``
(largest ``p``, ties to the lower id), the chosen slot cleared each round.
It writes ``ids`` (s32) and ``weights`` (f32), ``n_used`` per token, and
resets the counter to 0 so the launch replays from a CUDA graph.

With ``norm`` the router also does the FFN's RMSNorm before it (so the
decode step has no RMSNorm launch there): every warp sums the squares of
``x`` (the same lanes' order in every warp, so every CTA gets the same
bits), scales by ``1/sqrt.rn(mean + eps)`` (``div.rn``) and the norm weight
``nw`` as :mod:`ptxgen.kernels.rmsnorm` does (``(x s) nw``, ``mul.rn``) and
dots the expert's row with those values; the warp of expert 0 stores them
to ``h``, the normed row the experts' GEMV reads, so the logits are those
of exactly that ``h``.

Parameters: ``w``, ``x`` (``[T, K]`` with ``rows``), with ``norm`` ``nw``
(f32 ``[K]``), ``eps`` (f32) and ``h`` (f32, ``x``'s shape), ``logits`` (f32
scratch ``[T, n_expert]``), ``counter`` (u32 ``[ceil(T / tokens)]``, zero before the first
launch), ``ids``, ``weights`` (``[T, n_used]``) and with ``rows``
``t_ptr`` (u32: the tokens in use; CTAs of tokens at or past it exit).
"""

from __future__ import annotations

import math

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import f32, s32, u32, u64

from ..plan import LaunchGeometry
from ..reduce import warp_sum
from ..spec_fields import block_field, pdl_field, pdl_prologue, target_field

__all__ = ["MoeRouterSpec", "build", "launch_geometry", "route", "reference", "CLAMP"]

LOG2E = 1.4426950408889634
#: the least weight sum a token's selected experts divide by (llama.cpp's
#: clamp: the smallest normal f16)
CLAMP = 6.103515625e-5
_MAX_EXPERTS = 1024
_FLT_MAX = float(np.finfo(np.float32).max)


def _int(lo, hi):
    def check(inst, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi):
            raise ValueError(f"{attr.name} must be an int in {lo}..{hi}, got {v!r}")
    return check


@attrs.frozen
class MoeRouterSpec:
    """A router over ``n_expert`` experts choosing ``n_used`` per token.

    Parameters
    ----------
    n_expert : int
        Experts (1..1024); the router weight is f32 ``[n_expert, k]``.
    n_used : int
        Experts chosen per token (1..n_expert, at most 64).
    k : int
        The token's width (the model's hidden size), a multiple of 4.
    rows : bool
        ``x`` holds up to T tokens' rows, T read from ``t_ptr``.
    norm_w : bool
        The selected experts' weights renormalised to sum to one (qwen3moe,
        and every file whose ``expert_weights_norm`` is true), else their
        probabilities as they are.
    norm : bool
        ``x`` RMSNorm-ed (weight ``nw``) first, the normed row stored to ``h``.
    block : int
        Threads per CTA (a warp per expert logit).
    tokens : int
        Tokens a CTA (``rows`` only; at most the warps): each W row read
        from L2 once for all of them.
    """

    n_expert: int = attrs.field(validator=_int(1, _MAX_EXPERTS))
    n_used: int = attrs.field()
    k: int = attrs.field()
    rows: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    norm_w: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    block: int = block_field(256)
    norm: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    target: str = target_field()
    pdl: bool = pdl_field()
    tokens: int = attrs.field(default=1, validator=_int(1, 32))

    def __attrs_post_init__(self):
        if self.tokens > 1 and not self.rows:
            raise ValueError(f"tokens={self.tokens} needs rows (a router without rows takes "
                             f"one token)")
        if self.tokens > self.warps:
            raise ValueError(f"tokens={self.tokens} is more than the block's {self.warps} "
                             f"warps (a warp selects a token's experts)")
        if self.tokens > 1 and self.norm:
            raise ValueError(f"tokens={self.tokens} with norm: the folded RMSNorm serves one "
                             f"token a CTA")

    @n_used.validator
    def _check_used(self, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= min(64,
                                                                               self.n_expert)):
            raise ValueError(f"n_used must be an int in 1..{min(64, self.n_expert)} (at most "
                             f"the {self.n_expert} experts, and 64), got {v!r}")

    @k.validator
    def _check_k(self, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0 and v % 4 == 0):
            raise ValueError(f"k must be a positive multiple of 4 (rows read 16 bytes at a "
                             f"time), got {v!r}")

    @property
    def warps(self) -> int:
        return self.block // 32

    @property
    def kernel_name(self) -> str:
        return (f"moe_router_e{self.n_expert}_k{self.n_used}_h{self.k}"
                f"{'_rows' if self.rows else ''}{'' if self.norm_w else '_raw'}"
                f"{'_norm' if self.norm else ''}_b{self.block}"
                f"{f'_t{self.tokens}' if self.tokens > 1 else ''}")


def _order(k, p):
    """An unsigned key that orders f32 values as numbers (no NaN here)."""
    b = p.bitcast(u32)
    neg = b.bitcast(s32) < 0
    return k.select(neg, ~b, b | 0x80000000)


def _value(k, o):
    """The f32 value of :func:`_order`'s key ``o``."""
    pos = (o & 0x80000000).ne(0)
    return k.select(pos, o & 0x7FFFFFFF, ~o).bitcast(f32)


def _warp_max_u64(k, key):
    for off in (16, 8, 4, 2, 1):
        lo, hi = k.unpack(key, u32, 2)
        key = k.max(key, k.pack(u64, k.shfl_xor(lo, off), k.shfl_xor(hi, off)))
    return key


def _warp_max_f32(k, v):
    for off in (16, 8, 4, 2, 1):
        v = k.max(v, k.shfl_xor(v, off))
    return v


def build(spec: MoeRouterSpec) -> ptxgen.Module:
    """PTX for ``spec``; parameters ``w, x, [nw, eps, h,] logits, counter, ids,
    weights[, t_ptr]``."""
    E, K, NU = spec.n_expert, spec.k, spec.n_used
    slots = math.ceil(E / 32)
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, reqntid=spec.block) as k:
        w = k.param_ptr("w", f32, align=16)
        x = k.param_ptr("x", f32, align=16)
        if spec.norm:
            nw = k.param_ptr("nw", f32, align=16)
            eps = k.param("eps", f32)
            h = k.param_ptr("h", f32, align=16)
        logits = k.param_ptr("logits", f32)
        counter = k.param_ptr("counter", u32)
        ids = k.param_ptr("ids", s32)
        weights = k.param_ptr("weights", f32)
        t_ptr = k.param_ptr("t_ptr", u32) if spec.rows else None
        last = k.shared_array("is_last", u32, 4, align=16)
        pdl_prologue(k, spec)
        tid = k.tid.x
        lane, warp = tid & 31, tid >> 5
        TP = spec.tokens
        if spec.rows:
            t0 = k.ctaid.y * TP
            n = k.ld(t_ptr[0])
            k.exit(guard=t0 >= n)
            cnt = counter[k.ctaid.y]
        else:
            t0, cnt = None, counter[0]
        # the rows of the CTA's tokens, those past T clamped to the last
        rows_ = [t0 if j == 0 else k.min(t0 + j, n - 1) for j in range(TP)]
        xrows = [k.ptr_add(x, r * K) for r in rows_] if spec.rows else [x]
        e = k.ctaid.x * spec.warps + warp
        wrow = k.ptr_add(w, k.min(e, E - 1) * K)
        if spec.norm:                            # one token a CTA (the spec's check)
            hrow = k.ptr_add(h, t0 * K) if spec.rows else h
            ss = k.var(f32, 0.0)
            with k.for_range(lane, K // 4, 32) as i:
                for v in k.ld(xrows[0][i << 2], vec=4, nc=True):
                    k.fma(v, v, ss, out=ss)
            mean = k.div(warp_sum(k, ss), k.mov(float(K), f32))
            scale = k.div(k.mov(1.0, f32), k.sqrt(mean + eps))
            writes_h = e.eq(0)
        accs = [k.var(f32, 0.0) for _ in range(TP)]
        with k.for_range(lane, K // 4, 32) as i:
            wv = k.ld(wrow[i << 2], vec=4, nc=True)
            for acc, xrow in zip(accs, xrows):
                xv = k.ld(xrow[i << 2], vec=4, nc=True)
                if spec.norm:
                    nv = k.ld(nw[i << 2], vec=4, nc=True)
                    xv = tuple(k.mul(k.mul(a, scale, rnd="rn"), b, rnd="rn")
                               for a, b in zip(xv, nv))
                    k.st(hrow[i << 2], xv, guard=writes_h)
                for a, b in zip(wv, xv):
                    acc.set(k.fma(a, b, acc))
        for j, acc in enumerate(accs):
            s = warp_sum(k, acc)
            ok = k.setp("eq", lane, 0, combine=("and", e < E))
            if j:
                ok = k.pand(ok, t0 + j < n)
            with k.if_(ok):
                k.st((k.ptr_add(logits, rows_[j] * E) if spec.rows else logits)[e], s)
        k.bar_sync(0)
        with k.if_(tid.eq(0)):
            k.fence("acq_rel", "gpu")
            old = k.atom("add", cnt, 1)
            k.st(last[0], k.select((old + 1).eq(k.nctaid.x), k.mov(1, u32), k.mov(0, u32)))
        k.bar_sync(0)
        mine = warp.eq(0) if TP == 1 else k.pand(warp < TP, t0 + warp < n)
        with k.if_(k.setp("eq", k.ld(last[0]), 1, combine=("and", mine))):
            k.fence("acq_rel", "gpu")
            if spec.rows:
                t = t0 + warp if TP > 1 else t0
                out = (k.ptr_add(logits, t * E), k.ptr_add(ids, t * NU),
                       k.ptr_add(weights, t * NU))
            else:
                out = (logits, ids, weights)
            _select(k, spec, *out, lane, slots)
            with k.if_(lane.eq(0) if TP == 1 else k.pand(lane.eq(0), warp.eq(0))):
                k.st(cnt, 0)
    return m


def _select(k, spec, lrow, out_ids, out_w, lane, slots):
    """Warp 0 of the token's last CTA: softmax over the logits, the top
    ``n_used`` and their weights."""
    E, NU = spec.n_expert, spec.n_used
    ninf = k.mov(float("-inf"), f32)
    valid, vals = [], []
    for j in range(slots):
        idx = lane + 32 * j if j else lane
        ok = idx < E
        v = k.var(f32, ninf)
        k.ld(lrow[idx], cache="cg", guard=ok, out=v)
        valid.append(ok)
        vals.append(v)
    mx = vals[0]
    for v in vals[1:]:
        mx = k.max(mx, v)
    mx = _warp_max_f32(k, mx)
    ex = [k.ex2((v - mx) * LOG2E) for v in vals]
    tot = ex[0]
    for v in ex[1:]:
        tot = tot + v
    tot = warp_sum(k, tot)
    keys = []
    for j in range(slots):
        p = k.div(ex[j], tot)
        p = k.select(k.setp("nan", p, p), k.mov(-_FLT_MAX, f32), p)
        idx = lane + 32 * j if j else lane
        key = k.pack(u64, ~idx, _order(k, p))
        keys.append(k.select(valid[j], key, k.mov(0, u64)))
    chosen = []
    for _ in range(NU):
        best = keys[0]
        for key in keys[1:]:
            best = k.max(best, key)
        best = _warp_max_u64(k, best)
        lo, hi = k.unpack(best, u32, 2)
        idx = ~lo
        chosen.append((idx, _value(k, hi)))
        for j in range(slots):
            mine = (lane + 32 * j if j else lane).eq(idx)
            keys[j] = k.select(mine, k.mov(0, u64), keys[j])
    den = None
    if spec.norm_w:
        wsum = chosen[0][1]
        for _, p in chosen[1:]:
            wsum = wsum + p
        den = k.max(wsum, CLAMP)
    with k.if_(lane.eq(0)):
        for j, (idx, p) in enumerate(chosen):
            k.st(out_ids[j], idx.bitcast(s32))
            k.st(out_w[j], k.div(p, den) if den is not None else p)


def launch_geometry(spec: MoeRouterSpec, t_rows: int = 1):
    """The launch for ``t_rows`` tokens (the most a ``rows`` launch serves)."""
    if not spec.rows and t_rows != 1:
        raise ValueError(f"a router without rows takes one token, not {t_rows}")
    if not isinstance(t_rows, int) or t_rows < 1:
        raise ValueError(f"t_rows must be a positive int, got {t_rows!r}")
    return LaunchGeometry(spec.kernel_name, (math.ceil(spec.n_expert / spec.warps),
                                             math.ceil(t_rows / spec.tokens)), spec.block)


def route(logits, n_used: int, norm_w: bool = True):
    """float64 model of the selection: ``(ids, weights)`` of every row of
    ``logits`` (``[..., n_expert]``): softmax, the ``n_used`` largest in
    descending order (ties to the lower id), weights renormalised with
    :data:`CLAMP` (with ``norm_w``)."""
    z = np.asarray(logits, np.float64)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[..., :n_used]
    sel = np.take_along_axis(p, ids, axis=-1)
    if not norm_w:
        return ids.astype(np.int32), sel
    return ids.astype(np.int32), sel / np.maximum(sel.sum(axis=-1, keepdims=True), CLAMP)


def reference(w, x, n_used: int, norm_w: bool = True):
    """float64 router: logits ``x W^T`` (``x`` ``[K]`` or ``[T, K]``) and
    :func:`route` of them: ``(logits, ids, weights)``."""
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    return (z, *route(z, n_used, norm_w))


CANONICAL = {
    "moe_router": MoeRouterSpec(128, 8, 2048),
    "moe_router_rows": MoeRouterSpec(8, 2, 256, rows=True, target="sm_90"),
    "moe_router_norm": MoeRouterSpec(128, 8, 2048, norm=True, target="sm_90", pdl=True),
    "moe_router_rows_t8": MoeRouterSpec(128, 8, 2048, rows=True, tokens=8, target="sm_90"),
}

registry.register("moe_router", MoeRouterSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
