"""Block sum: ``out[b] = sum of the elements block b visits``.

Each thread adds up ``x[i]`` over a grid-stride loop, the warp folds its 32
partial sums with ``shfl.sync.bfly``, warp leaders meet in shared memory
behind ``bar.sync``, and warp 0 folds those.  Thread 0 writes the block's
sum to ``out[ctaid.x]``; with ``grid = 1`` that is the sum of the vector.

Launch: ``block`` threads (a multiple of 32), any grid; ``out`` holds
``grid`` values.
"""

from __future__ import annotations

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import f32, u32

from .plan import LaunchGeometry
from .spec_fields import block_field, target_field


@attrs.frozen
class BlockReduceSpec:
    block: int = block_field(256)
    target: str = target_field()


    @property
    def kernel_name(self) -> str:
        return "block_reduce_sum_f32"


def warp_sum(k, v):
    """Sum ``v`` across the 32 lanes of a warp (every lane gets the total)."""
    for offset in (16, 8, 4, 2, 1):
        v = v + k.shfl_xor(v, offset)
    return v


def build(spec: BlockReduceSpec) -> ptxgen.Module:
    warps = spec.block // 32
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, reqntid=spec.block) as k:
        x = k.param_ptr("x", f32)
        out = k.param_ptr("out", f32)
        n = k.param("n", u32)
        partial = k.shared_array("warp_sums", f32, warps, align=16)

        tid = k.tid.x
        stride = k.ntid.x * k.nctaid.x
        acc = k.var(f32, 0.0)
        with k.for_range(k.global_id(), n, stride) as i:
            acc += k.ld(x[i], nc=True)
        total = warp_sum(k, acc)

        lane = tid & 31
        warp = tid >> 5
        with k.if_(lane.eq(0)):
            k.st(partial[warp], total)
        k.bar_sync(0)
        with k.if_(warp.eq(0)):
            v = k.var(f32, 0.0)
            with k.if_(lane < warps):
                v.set(k.ld(partial[lane]))
            block_total = warp_sum(k, v)
            with k.if_(lane.eq(0)):
                k.st(out[k.ctaid.x], block_total)
    return m


def launch_geometry(spec: BlockReduceSpec, n: int, grid: int = 1):
    return LaunchGeometry(spec.kernel_name, grid, spec.block)


def reference(x: np.ndarray, grid: int = 1, block: int = 256) -> np.ndarray:
    """float64 sums of the elements each block visits."""
    x = np.asarray(x, dtype=np.float64)
    idx = np.arange(x.size)
    owner = (idx % (grid * block)) // block
    return np.bincount(owner, weights=x, minlength=grid)


CANONICAL = {
    "block_reduce": BlockReduceSpec(),
    "block_reduce_1024": BlockReduceSpec(block=1024),
}

registry.register("block_reduce", BlockReduceSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
