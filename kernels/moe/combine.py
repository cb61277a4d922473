"""The weighted sum of a token's experts: ``out[t] = r[t] + sum_j w[t, j]
y[t, j]`` over its ``n_used`` experts' outputs ``y[t, j]`` (the experts'
down projections) and the router's weights ``w`` (:mod:`.router`).

As llama.cpp's ``build_moe_ffn`` sums them: each output scaled by its
weight (``mul.rn``), the scaled outputs added in slot order (the router's
descending order), then the residual added last (the layer's ``ffn_inp``).

Layout: ``y`` f32 ``[T, n_used, m]``, ``weights`` f32 ``[T, n_used]``,
``r`` and ``out`` f32 ``[T, m]`` (``out`` may be ``r``).  Launch: ``grid =
(ceil(m / block), T)``, a thread per element; with ``rows`` the tokens in
use are read from ``t_ptr`` (u32) and the CTAs past them exit.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import f32, u32

from ..plan import LaunchGeometry
from ..spec_fields import block_field, pdl_field, pdl_prologue, target_field

__all__ = ["MoeCombineSpec", "build", "launch_geometry", "reference"]


@attrs.frozen
class MoeCombineSpec:
    """The sum of ``n_used`` experts' outputs weighted, plus the residual.

    Parameters
    ----------
    n_used : int
        Experts per token (1..64).
    rows : bool
        Up to T tokens, T read from ``t_ptr``.
    block : int
        Threads per CTA.
    """

    n_used: int = attrs.field()
    rows: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    block: int = block_field(256)
    target: str = target_field()
    pdl: bool = pdl_field()

    @n_used.validator
    def _check_used(self, attr, v):
        if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 64):
            raise ValueError(f"n_used must be an int in 1..64, got {v!r}")

    @property
    def kernel_name(self) -> str:
        return f"moe_combine_k{self.n_used}{'_rows' if self.rows else ''}_b{self.block}"


def build(spec: MoeCombineSpec) -> ptxgen.Module:
    """PTX for ``spec``; parameters ``y, weights, r, out, m[, t_ptr]``."""
    NU = spec.n_used
    mod = ptxgen.Module(spec.target)
    with mod.kernel(spec.kernel_name, reqntid=spec.block) as k:
        y = k.param_ptr("y", f32)
        wts = k.param_ptr("weights", f32)
        r = k.param_ptr("r", f32)
        out = k.param_ptr("out", f32)
        m = k.param("m", u32)
        t_ptr = k.param_ptr("t_ptr", u32) if spec.rows else None
        pdl_prologue(k, spec)
        t = k.ctaid.y
        if spec.rows:
            k.exit(guard=t >= k.ld(t_ptr[0]))
        i = k.ctaid.x * spec.block + k.tid.x
        k.exit(guard=i >= m)
        row = t * m + i
        base = t * (NU * m) + i
        acc = None
        for j in range(NU):
            v = k.mul(k.ld(y[base + j * m] if j else y[base]), k.ld(wts[t * NU + j]), rnd="rn")
            acc = v if acc is None else k.add(acc, v, rnd="rn")
        k.st(out[row], k.add(acc, k.ld(r[row]), rnd="rn"))
    return mod


def launch_geometry(spec: MoeCombineSpec, m: int, t_rows: int = 1):
    """The launch for ``m`` elements of ``t_rows`` tokens."""
    if not spec.rows and t_rows != 1:
        raise ValueError(f"a combine without rows takes one token, not {t_rows}")
    if not isinstance(t_rows, int) or t_rows < 1:
        raise ValueError(f"t_rows must be a positive int, got {t_rows!r}")
    return LaunchGeometry(spec.kernel_name, (math.ceil(m / spec.block), t_rows), spec.block)


def reference(y, weights, r):
    """float64 ``r + sum_j weights[..., j] y[..., j, :]``."""
    y, w = np.asarray(y, np.float64), np.asarray(weights, np.float64)
    return np.asarray(r, np.float64) + np.einsum("...j,...jm->...m", w, y)


CANONICAL = {
    "moe_combine": MoeCombineSpec(8),
    "moe_combine_rows": MoeCombineSpec(8, rows=True, target="sm_90", pdl=True),
}

registry.register("moe_combine", MoeCombineSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
