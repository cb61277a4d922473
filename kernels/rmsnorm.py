"""RMSNorm and fused residual-add + RMSNorm over the rows of an f32 matrix.

``out[r] = x[r] / sqrt(mean(x[r]**2) + eps) * w`` for every row ``r``; the
fused form first adds a residual row, ``s = x + res``, writes ``s`` to
``sum_out`` and normalises ``s``.  With ``accumulate`` the normed row is
added to ``out`` in place, ``out[r] += x[r] / sqrt(...) * w`` (Gemma's
post-norms: an attention or FFN output normed into the residual stream).

Layout: ``x``, ``res``, ``sum_out``, ``out`` are row-major ``[rows, n]`` f32
(``out`` f16 with ``out_type="f16"``), ``w`` is ``[n]`` f32; ``n`` (any positive length) and ``eps`` are launch
parameters.  Launch: one block of ``spec.block`` threads per row,
``grid = rows``.  With ``grouped``, rows come in groups (the q heads of
each token of a chunk): ``grid = (rows per group, groups)`` and row ``r``
of group ``g`` starts at element ``g * stride + r * n`` of ``x`` and of
``out`` (``stride``: a u32 parameter after ``eps``).  A row whose pointers are all 16-byte aligned is read with
``ld.global.nc.v4`` (a scalar tail covers ``n % 4``); other rows go scalar.
An aligned row of at most ``4 * cache_vec * block`` values (``n % 4 == 0``)
is kept in registers (one read of x and w); otherwise a second pass
re-reads it (from L1/L2).  The sum of squares is folded with
``shfl.sync.bfly`` and shared memory.

Accuracy: ``precise=True`` (default) scales by ``1 / sqrt.rn(...)`` with
``div.rn``: relative error within 1e-5 of float64.  ``precise=False`` uses
``rsqrt.approx`` (relative error within 1e-4).  An f16 ``out`` adds its
rounding (relative ``2^-11``).
"""

from __future__ import annotations

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import f16, f32, u32

from .plan import LaunchGeometry
from .reduce import warp_sum
from .spec_fields import block_field, pdl_field, pdl_prologue, target_field


@attrs.frozen
class RmsNormSpec:
    """An RMSNorm kernel.

    Parameters
    ----------
    residual : bool
        Fused residual add (``s = x + res`` written to ``sum_out``).
    block : int
        Threads per block (one block per row).
    precise : bool
        ``sqrt.rn`` + ``div.rn`` (1e-5) instead of ``rsqrt.approx`` (1e-4).
    cache_vec : {0, 1, 2, 4, 8}
        Rows of at most ``4 * cache_vec * block`` values (aligned, ``n % 4 ==
        0``) are read once into registers; longer rows take two passes.
    out_type : {"f32", "f16"}
        ``out``'s element type; f16 is rounded to nearest (``cvt.rn``) from
        the f32 result, for a GEMM that takes f16 X.  ``sum_out`` stays f32.
    grouped : bool
        Rows in groups ``stride`` elements apart (see the module docstring);
        not with ``residual``.
    target : str
    accumulate : bool
        ``out += `` the normed row (f32 ``out``, read with a plain ``ld``);
        not with ``residual`` or ``grouped``.
    """

    residual: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    block: int = block_field(256)
    precise: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    cache_vec: int = attrs.field(default=4, validator=attrs.validators.in_((0, 1, 2, 4, 8)))
    out_type: str = attrs.field(default="f32", validator=attrs.validators.in_(("f32", "f16")))
    grouped: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    target: str = target_field()
    pdl: bool = pdl_field()
    accumulate: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @property
    def kernel_name(self) -> str:
        name = "add_rmsnorm_f32" if self.residual else "rmsnorm_f32"
        return (name + ("" if self.precise else "_approx") + f"_b{self.block}"
                + (f"_c{self.cache_vec}" if self.cache_vec != 4 else "")
                + ("_out_f16" if self.out_type == "f16" else "")
                + ("_grouped" if self.grouped else "") + ("_acc" if self.accumulate else ""))

    def __attrs_post_init__(self):
        if self.grouped and self.residual:
            raise ValueError("a grouped RMSNorm has no residual form")
        if self.accumulate and (self.residual or self.grouped or self.out_type != "f32"):
            raise ValueError("accumulate adds into an f32 out, row by row: not with residual, "
                             "grouped or an f16 out")

    @property
    def tolerance(self) -> float:
        return 1e-5 if self.precise else 1e-4


def block_sum(k, v, block: int, scratch, reuse: bool = False):
    """Sum ``v`` over a block of ``block`` threads; every thread gets the total.

    ``scratch`` is a shared f32 array of at least ``block // 32`` entries;
    with ``reuse`` a final ``bar.sync`` lets the caller write it again.
    """
    warps = block // 32
    tid = k.tid.x
    lane = tid & 31
    warp = tid >> 5
    total = warp_sum(k, v)
    if warps == 1:
        return total
    with k.if_(lane.eq(0)):
        k.st(scratch[warp], total)
    k.bar_sync(0)
    part = k.var(f32, 0.0)
    with k.if_(lane < warps):
        part.set(k.ld(scratch[lane]))
    out = warp_sum(k, part)
    if reuse:
        k.bar_sync(0)
    return out


def _row_ptr(k, p, row, n):
    return k.ptr_add(p, k.mul_wide(row, n))


def build(spec: RmsNormSpec) -> ptxgen.Module:
    """PTX for ``spec``: kernel ``spec.kernel_name``.

    Parameters (in order): ``x, [res, sum_out,] w, out, n: u32, eps: f32[,
    stride: u32]``.
    """
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, maxntid=spec.block) as k:
        pdl_prologue(k, spec)
        x = k.param_ptr("x", f32, align=16)
        if spec.residual:
            res = k.param_ptr("res", f32, align=16)
            sum_out = k.param_ptr("sum_out", f32, align=16)
        w = k.param_ptr("w", f32, align=16)
        half = spec.out_type == "f16"
        out = k.param_ptr("out", f16 if half else f32, align=16)
        n = k.param("n", u32)
        eps = k.param("eps", f32)
        stride = k.param("stride", u32) if spec.grouped else None
        scratch = k.shared_array("warp_sums", f32, max(1, spec.block // 32), align=16)

        row = k.ctaid.x
        tid = k.tid.x
        if spec.grouped:
            off = k.mul_wide(k.ctaid.y, stride) + k.mul_wide(row, n)
            xr, outr = k.ptr_add(x, off), k.ptr_add(out, off)
        else:
            xr = _row_ptr(k, x, row, n)
            outr = _row_ptr(k, out, row, n)
        ptrs = [xr, w, outr]
        if spec.residual:
            rr = _row_ptr(k, res, row, n)
            sr = _row_ptr(k, sum_out, row, n)
            ptrs += [rr, sr]
        anyp = ptrs[0]
        for p in ptrs[1:]:
            anyp = anyp | p
        aligned = (anyp & 15).eq(0)
        n4 = k.select(aligned, n >> 2, k.mov(0, u32))
        tail0 = n4 << 2

        def load_row(i, vec):
            """Load (and for the fused form add and store) ``vec`` values at i."""
            if not spec.residual:
                v = k.ld(xr[i], vec=vec, nc=True)
                return v if vec > 1 else (v,)
            a = k.ld(xr[i], vec=vec, nc=True)
            b = k.ld(rr[i], vec=vec, nc=True)
            a = a if vec > 1 else (a,)
            b = b if vec > 1 else (b,)
            s = tuple(k.add(p, q, rnd="rn") for p, q in zip(a, b))
            k.st(sr[i], s if vec > 1 else s[0])
            return s

        def reload_row(i, vec):
            # the fused form re-reads its own stores (plain ld, not .nc)
            v = k.ld(sr[i], vec=vec) if spec.residual else k.ld(xr[i], vec=vec, nc=True)
            return v if vec > 1 else (v,)

        def put(dst, vals, guard=None):
            """Store f32 ``vals`` (one or four) at ``dst`` (in ``out``; with
            ``accumulate`` added to what it holds)."""
            if spec.accumulate:
                old = k.ld(dst, vec=len(vals)) if len(vals) > 1 else (k.ld(dst),)
                vals = tuple(k.add(a, b, rnd="rn") for a, b in zip(old, vals))
            if half:
                vals = tuple(k.cvt(f16, v, rnd="rn") for v in vals)
            k.st(dst, vals if len(vals) > 1 else vals[0], guard=guard)

        def scale_of(total):
            mean = k.div(total, n.to(f32))
            if spec.precise:
                return k.div(k.mov(1.0, f32), k.sqrt(mean + eps))
            return k.rsqrt(mean + eps)

        def two_pass():
            # pass 1: sum of squares
            ss = k.var(f32, 0.0)
            with k.for_range(tid, n4, spec.block) as j:
                for v in load_row(j << 2, 4):
                    k.fma(v, v, ss, out=ss)
            with k.for_range(tail0 + tid, n, spec.block) as i:
                (v,) = load_row(i, 1)
                k.fma(v, v, ss, out=ss)
            scale = scale_of(block_sum(k, ss, spec.block, scratch))
            # pass 2: normalise (the row is in L1/L2 from pass 1)
            with k.for_range(tid, n4, spec.block) as j:
                i = j << 2
                xs = reload_row(i, 4)
                ws = k.ld(w[i], vec=4, nc=True)
                put(outr[i], tuple(k.mul(k.mul(a, scale, rnd="rn"), b, rnd="rn")
                             for a, b in zip(xs, ws)))
            with k.for_range(tail0 + tid, n, spec.block) as i:
                (a,) = reload_row(i, 1)
                put(outr[i], (k.mul(k.mul(a, scale, rnd="rn"), k.ld(w[i], nc=True), rnd="rn"),))

        def one_pass():
            # the row (and w) held in registers: vec4 j = tid + r * block
            R = spec.cache_vec
            ss = k.mov(0.0, f32)
            held = []
            for r in range(R):
                j = tid + r * spec.block
                ok = j < n4
                jc = k.min(j, n4 - 1)
                i = jc << 2
                if spec.residual:
                    xs = [k.add(p, q, rnd="rn") for p, q in
                          zip(k.ld(xr[i], vec=4, nc=True), k.ld(rr[i], vec=4, nc=True))]
                    k.st(sr[i], tuple(xs), guard=ok)
                else:
                    xs = k.ld(xr[i], vec=4, nc=True)
                ws = k.ld(w[i], vec=4, nc=True)
                part = k.mul(xs[0], xs[0], rnd="rn")
                for v in xs[1:]:
                    part = k.fma(v, v, part)
                ss = ss + k.select(ok, part, k.mov(0.0, f32))
                held.append((ok, i, xs, ws))
            scale = scale_of(block_sum(k, ss, spec.block, scratch))
            for ok, i, xs, ws in held:
                put(outr[i], tuple(k.mul(k.mul(a, scale, rnd="rn"), b, rnd="rn")
                             for a, b in zip(xs, ws)), guard=ok)

        if spec.cache_vec:
            fits = k.setp("le", n4, spec.cache_vec * spec.block,
                          combine=("and", tail0.eq(n)))
            fits = k.setp("gt", n4, k.mov(0, u32), combine=("and", fits))
            with k.if_else(fits) as (fast, slow):
                with fast:
                    one_pass()
                with slow:
                    two_pass()
        else:
            two_pass()
    return m


def launch_geometry(spec: RmsNormSpec, rows: int, groups: int = 1):
    """One block per row (``rows`` per group of a grouped kernel: ``grid.y``
    counts the groups)."""
    if groups != 1 and not spec.grouped:
        raise ValueError("groups of rows need a grouped RMSNorm spec")
    return LaunchGeometry(spec.kernel_name, (rows, groups, 1), spec.block)


def reference(x, w, eps, residual=None):
    """float64 RMSNorm; returns ``out`` or ``(out, sum)`` with a residual."""
    x = np.asarray(x, dtype=np.float64)
    if residual is not None:
        x = x + np.asarray(residual, dtype=np.float64)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    out = x / np.sqrt(ms + eps) * np.asarray(w, dtype=np.float64)
    return out if residual is None else (out, x)


CANONICAL = {
    "rmsnorm": RmsNormSpec(),
    "add_rmsnorm": RmsNormSpec(residual=True),
    "rmsnorm_grouped": RmsNormSpec(grouped=True, pdl=True, target="sm_90"),
    "rmsnorm_acc": RmsNormSpec(accumulate=True),
}

registry.register("rmsnorm", RmsNormSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)

