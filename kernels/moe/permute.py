"""A chunk's token rows in the experts' order, as f16: ``xs[r] = x[pairs[r]
/ n_used]`` for the grouped pairs of :mod:`.group`, so the experts'
warpgroup GEMM (:mod:`.expert_wgmma`) reads an expert's rows as one block
of ``xs`` (rows ``offsets[e] ..``) through a tensor map.

``x`` f32 ``[T, K]`` (the normed hidden state), ``pairs`` u32 ``[T
n_used]`` (pair ``p = t n_used + j`` of each expert in turn), ``xs`` f16
``[T n_used, K]``, each element rounded to nearest (``cvt.rn.f16.f32``, as
the ``mma.sync`` experts' GEMM rounds X on its way into shared memory).  T is
read from ``t_ptr``; the rows past ``T n_used`` are left as they are.

Launch: ``grid = (ceil(K / (8 block)), T_max n_used)``: CTA ``(bx, r)``
writes row ``r``, a thread 8 elements (two 16-byte loads of X, one 16-byte
store).
"""

from __future__ import annotations

import math

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import b32, f16, f32, u32
from ptxgen.values import Address

from ..plan import LaunchGeometry
from ..spec_fields import block_field, pdl_field, pdl_prologue, target_field

__all__ = ["MoePermuteSpec", "build", "launch_geometry", "reference"]


@attrs.frozen
class MoePermuteSpec:
    """X's rows gathered into the experts' order and rounded to f16.

    Parameters
    ----------
    n_used : int
        Experts a token (1..64): pair ``p`` reads X's row ``p / n_used``.
    k : int
        Elements of a row, a multiple of 8.
    block : int
        Threads per CTA.
    """

    n_used: int = attrs.field()
    k: int = attrs.field()
    block: int = block_field(256)
    target: str = target_field()
    pdl: bool = pdl_field()

    @n_used.validator
    def _check_used(self, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 64):
            raise ValueError(f"n_used must be an int in 1..64, got {v!r}")

    @k.validator
    def _check_k(self, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0 and v % 8 == 0):
            raise ValueError(f"k must be a positive multiple of 8 (a thread's 8 elements), "
                             f"got {v!r}")

    @property
    def kernel_name(self) -> str:
        return f"moe_permute_k{self.n_used}_n{self.k}_b{self.block}"


def build(spec: MoePermuteSpec) -> ptxgen.Module:
    """PTX for ``spec``; parameters ``x, pairs, t_ptr, xs``."""
    K, NU = spec.k, spec.n_used
    mod = ptxgen.Module(spec.target)
    with mod.kernel(spec.kernel_name, reqntid=spec.block) as k:
        x = k.param_ptr("x", f32, align=16)
        pairs = k.param_ptr("pairs", u32)
        t_ptr = k.param_ptr("t_ptr", u32)
        xs = k.param_ptr("xs", f16, align=16)
        pdl_prologue(k, spec)
        r = k.ctaid.y
        k.exit(guard=r >= k.ld(t_ptr[0]) * NU)
        i = (k.ctaid.x * spec.block + k.tid.x) * 8
        k.exit(guard=i >= K)
        t = k.ld(pairs[r]) // NU
        src = k.mad(t, K, i)
        v = list(k.ld(x[src], f32, vec=4, nc=True)) + list(k.ld(x[src + 4], f32, vec=4,
                                                                 nc=True))
        h = [k.cvt(f16, a, rnd="rn") for a in v]
        dst = xs[k.mad(r, K, i)]
        k.st(Address(dst.base, dst.offset, dst.space, b32),
             tuple(k.pack(b32, h[2 * j], h[2 * j + 1]) for j in range(4)))
    return mod


def launch_geometry(spec: MoePermuteSpec, t_max: int):
    """The launch for up to ``t_max`` tokens (``t_max n_used`` rows)."""
    if not isinstance(t_max, int) or isinstance(t_max, bool) or t_max < 1:
        raise ValueError(f"t_max must be a positive int, got {t_max!r}")
    return LaunchGeometry(spec.kernel_name, (math.ceil(spec.k / (8 * spec.block)),
                                             t_max * spec.n_used), spec.block)


def reference(x, pairs, n_used: int):
    """``x[pairs // n_used]`` rounded to f16."""
    return np.asarray(x, np.float32)[np.asarray(pairs, np.int64) // n_used].astype(np.float16)


CANONICAL = {
    # the family's name dumps the first spec for any target: no PDL in it
    "moe_permute": MoePermuteSpec(8, 2048, target="sm_90"),
    "moe_permute_pdl": MoePermuteSpec(8, 2048, target="sm_90", pdl=True),
}

registry.register("moe_permute", MoePermuteSpec, build, CANONICAL,
                  doc=__doc__.splitlines()[0], launch_geometry=launch_geometry)
