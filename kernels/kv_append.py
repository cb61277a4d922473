"""KV-cache append: write this token's K and V rows into the caches at ``pos``.

``k_cache[h, pos, :] = k[h, :]`` and ``v_cache[h, pos, :] = v[h, :]`` for
every KV head ``h``, converting f32 to the cache's type (``cvt.rn.f16.f32``
for an f16 cache).  ``pos`` is read from a device int32 (``pos_ptr[0]``),
so a replayed CUDA graph appends at the current position; a position
outside ``[0, capacity)`` writes nothing.

Layout: ``k``, ``v`` are f32 ``[n_kv_heads, head_dim]``; each cache is
``[n_kv_heads, capacity, head_dim]`` (the flash-decode layout).  Launch:
each thread moves 4 elements of K and of V (one ``ld.v4.f32`` each, one
8-byte ``st.v2.b32`` of packed halves, or ``st.v4.f32``);
``grid = ceil(n_kv_heads * head_dim / (4 * block))``.  Pointers must be
16-byte aligned (``head_dim`` is a multiple of 4).
"""

from __future__ import annotations

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import f16, f32, s32, u32

from .plan import LaunchGeometry
from .spec_fields import block_field, pdl_field, pdl_prologue, target_field


@attrs.frozen
class KvAppendSpec:
    """A KV-append kernel.

    Parameters
    ----------
    head_dim : int
        A multiple of 4 in 4..512.
    cache_dtype : {"f16", "f32"}
    block : int
    target : str
    """

    head_dim: int = attrs.field(default=128)
    cache_dtype: str = attrs.field(default="f16", validator=attrs.validators.in_(("f16", "f32")))
    block: int = block_field(128)
    target: str = target_field()
    pdl: bool = pdl_field()

    @head_dim.validator
    def _check_hd(self, _, v):
        if not (isinstance(v, int) and 4 <= v <= 512 and v % 4 == 0):
            raise ValueError(f"head_dim must be a multiple of 4 in 4..512, got {v!r}")


    @property
    def kernel_name(self) -> str:
        return f"kv_append_d{self.head_dim}_{self.cache_dtype}"


def build(spec: KvAppendSpec) -> ptxgen.Module:
    """PTX for ``spec``; parameters
    ``k, v, k_cache, v_cache, pos_ptr: s32*, n_kv_heads: u32, capacity: u32``."""
    cty = f16 if spec.cache_dtype == "f16" else f32
    d = spec.head_dim
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, maxntid=spec.block) as k:
        pdl_prologue(k, spec)
        kin = k.param_ptr("k", f32, align=16)
        vin = k.param_ptr("v", f32, align=16)
        kc = k.param_ptr("k_cache", cty, align=16)
        vc = k.param_ptr("v_cache", cty, align=16)
        pos_ptr = k.param_ptr("pos_ptr", s32)
        n_kv = k.param("n_kv_heads", u32)
        cap = k.param("capacity", u32)
        pos = k.ld(pos_ptr[0])
        t = k.global_id()
        i = t << 2                                   # element in [n_kv, d]
        ok = k.setp("lt", i, n_kv * d, combine=("and", pos >= 0))
        ok = k.setp("lt", pos.bitcast(u32), cap, combine=("and", ok))
        with k.if_(ok):
            h = i // d
            j = i - h * d
            dst = k.mad(k.mad(h, cap, pos.bitcast(u32)), d, j)
            for src, cache in ((kin, kc), (vin, vc)):
                vals = k.ld(src[i], vec=4, nc=True)
                if cty is f32:
                    k.st(cache[dst], vals)
                else:
                    hs = [k.cvt(f16, x, rnd="rn") for x in vals]
                    k.st(cache[dst], (k.pack(u32, hs[0], hs[1]), k.pack(u32, hs[2], hs[3])),
                         ty=u32)
    return m


def launch_geometry(spec: KvAppendSpec, n_kv_heads: int):
    per = 4 * spec.block
    total = n_kv_heads * spec.head_dim
    return LaunchGeometry(spec.kernel_name, (total + per - 1) // per, spec.block)


def reference(k, v, k_cache, v_cache, pos):
    """Copies of the caches with row ``pos`` of every head replaced."""
    kc, vc = k_cache.copy(), v_cache.copy()
    if 0 <= pos < kc.shape[1]:
        kc[:, pos, :] = np.asarray(k).reshape(kc.shape[0], -1).astype(kc.dtype)
        vc[:, pos, :] = np.asarray(v).reshape(vc.shape[0], -1).astype(vc.dtype)
    return kc, vc


CANONICAL = {
    "kv_append": KvAppendSpec(),
    "kv_append_d64_f32": KvAppendSpec(head_dim=64, cache_dtype="f32"),
}

registry.register("kv_append", KvAppendSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
