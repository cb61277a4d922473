"""Vector add: ``c[i] = a[i] + b[i]`` for ``i < n``.

Launch: one thread per element, ``block`` threads per block,
``grid = ceil(n / block)``; any ``n`` (the tail is guarded).
"""

from __future__ import annotations

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import type_by_name, u32

from .plan import LaunchGeometry
from .spec_fields import block_field, target_field

_DTYPES = ("f32", "f64", "u32", "s32")


@attrs.frozen
class VectorAddSpec:
    dtype: str = attrs.field(default="f32", validator=attrs.validators.in_(_DTYPES))
    block: int = block_field(256)
    target: str = target_field()


    @property
    def kernel_name(self) -> str:
        return f"vector_add_{self.dtype}"


def build(spec: VectorAddSpec) -> ptxgen.Module:
    ty = type_by_name(spec.dtype)
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, maxntid=spec.block) as k:
        a = k.param_ptr("a", ty)
        b = k.param_ptr("b", ty)
        c = k.param_ptr("c", ty)
        n = k.param("n", u32)
        i = k.global_id()
        with k.if_(i < n):
            k.st(c[i], k.ld(a[i], nc=True) + k.ld(b[i], nc=True))
    return m


def launch_geometry(spec: VectorAddSpec, n: int):
    """The launch for ``n`` elements."""
    return LaunchGeometry(spec.kernel_name, (n + spec.block - 1) // spec.block, spec.block)


def reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a + b


CANONICAL = {
    "vector_add": VectorAddSpec(),
    "vector_add_u32": VectorAddSpec(dtype="u32", block=128),
}

registry.register("vector_add", VectorAddSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
