"""Argmax over an f32 vector: ``out[0] = index of the largest x[i]`` (int32).

Ties go to the lowest index.  NaN counts as larger than every number (as
``numpy.argmax`` and ``torch.argmax`` do), so the first NaN wins; ``-0.0``
and ``+0.0`` are equal.

Each value becomes a 64-bit key ``(order(x) << 32) | ~i`` where ``order``
maps the float onto an unsigned total order (every NaN to ``0xFFFFFFFF``);
the maximum key holds the answer, so the whole reduction is ``max.u64``.

Launch: ``grid`` blocks of ``spec.block`` threads (any grid, one launch).
Each block reduces a grid-stride share (``ld.global.nc.v4`` when ``x`` is
16-byte aligned, scalar tail), writes its key to ``scratch[block]``, and
the last block to finish (an ``atom.add`` on ``counter``, release/acquire
fences) folds the partial keys, writes ``out`` and resets ``counter`` to 0
so the launch can be replayed from a CUDA graph.  ``scratch`` holds
``grid`` u64, ``counter`` one u32 that must be 0 before the first launch.
"""

from __future__ import annotations

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import f32, s32, u32, u64

from .plan import LaunchGeometry
from .spec_fields import block_field, pdl_field, pdl_prologue, target_field


@attrs.frozen
class ArgmaxSpec:
    """An argmax kernel.

    Parameters
    ----------
    block : int
        Threads per block (a multiple of 32, at most 1024).
    target : str
    """

    block: int = block_field(1024)
    target: str = target_field()
    pdl: bool = pdl_field()


    @property
    def kernel_name(self) -> str:
        return f"argmax_f32_b{self.block}"


def _key(k, x, i):
    """The u64 ordering key of value ``x`` at index ``i`` (u32)."""
    zero = x.eq(0.0)
    b = k.select(zero, k.mov(0, u32), x.bitcast(u32))          # -0 -> +0
    neg = b.bitcast(s32) < 0
    o = k.select(neg, ~b, b | 0x80000000)
    nan = k.setp("nan", x, x)
    o = k.select(nan, k.mov(0xFFFFFFFF, u32), o)
    return k.pack(u64, ~i, o)


def _warp_max(k, key):
    for off in (16, 8, 4, 2, 1):
        lo, hi = k.unpack(key, u32, 2)
        other = k.pack(u64, k.shfl_xor(lo, off), k.shfl_xor(hi, off))
        key = k.max(key, other)
    return key


def build(spec: ArgmaxSpec) -> ptxgen.Module:
    """PTX for ``spec``; parameters ``x, n: u32, out: s32*, scratch: u64*, counter: u32*``."""
    warps = spec.block // 32
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, maxntid=spec.block) as k:
        pdl_prologue(k, spec)
        x = k.param_ptr("x", f32, align=16)
        n = k.param("n", u32)
        out = k.param_ptr("out", s32)
        scratch = k.param_ptr("scratch", u64, align=8)
        counter = k.param_ptr("counter", u32)
        wkeys = k.shared_array("warp_keys", u64, warps, align=8)
        last = k.shared_array("is_last", u32, 4, align=16)   # padded: see report

        tid = k.tid.x
        lane = tid & 31
        warp = tid >> 5
        nthreads = k.ntid.x * k.nctaid.x
        gid = k.global_id()
        best = k.var(u64, 0)
        aligned = (x & 15).eq(0)
        n4 = k.select(aligned, n >> 2, k.mov(0, u32))
        with k.for_range(gid, n4, nthreads) as j:
            vals = k.ld(x[j << 2], vec=4, nc=True)
            base = j << 2
            for e, v in enumerate(vals):
                k.max(best, _key(k, v, base + e), out=best)
        with k.for_range((n4 << 2) + gid, n, nthreads) as i:
            k.max(best, _key(k, k.ld(x[i], nc=True), i), out=best)

        def block_max(v):
            v = _warp_max(k, v)
            with k.if_(lane.eq(0)):
                k.st(wkeys[warp], v)
            k.bar_sync(0)
            r = k.var(u64, 0)
            with k.if_(lane < warps):
                r.set(k.ld(wkeys[lane]))
            return _warp_max(k, r)

        bk = block_max(best)
        with k.if_(tid.eq(0)):
            k.st(scratch[k.ctaid.x], bk)
            k.fence("acq_rel", "gpu")
            old = k.atom("add", counter[0], 1)
            k.st(last[0], k.select((old + 1).eq(k.nctaid.x), k.mov(1, u32), k.mov(0, u32)))
        k.bar_sync(0)
        with k.if_(k.ld(last[0]).eq(1)):
            k.fence("acq_rel", "gpu")
            acc = k.var(u64, 0)
            with k.for_range(tid, k.nctaid.x, spec.block) as b:
                k.max(acc, k.ld(scratch[b], cache="cg"), out=acc)
            k.bar_sync(0)
            total = block_max(acc)
            with k.if_(tid.eq(0)):
                lo, _hi = k.unpack(total, u32, 2)
                k.st(out[0], (~lo).bitcast(s32))
                k.st(counter[0], 0)
    return m


def launch_geometry(spec: ArgmaxSpec, n: int, sm_count: int = 1):
    """Up to one block per SM, at least 8192 elements per block."""
    per = 8 * spec.block
    grid = max(1, min(sm_count, (n + per - 1) // per))
    return LaunchGeometry(spec.kernel_name, grid, spec.block)


def reference(x) -> int:
    """``numpy.argmax`` (first NaN wins, ties to the lowest index)."""
    return int(np.argmax(np.asarray(x)))


CANONICAL = {"argmax": ArgmaxSpec()}

registry.register("argmax", ArgmaxSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
