"""SwiGLU: ``out[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i]``
(and GeGLU, ``act="gelu_tanh"``: ``gelu(g[i]) * u[i]``).

GELU is its tanh form (GGML's and Gemma's), ``gelu(x) = x/2 (1 + tanh(z))``,
``z = sqrt(2/pi) (x + 0.044715 x^3)``, computed as the logistic it equals:
``x / (1 + exp(-2 z))`` (:func:`gelu_mul`), the same ``ex2`` and ``div.rn``
as silu.

Layout: ``g``, ``u``, ``out`` are f32 vectors of any length ``n`` (a launch
parameter; ``out`` f16 with ``out_type="f16"``, rounded to nearest).  Launch: each thread handles 4 consecutive elements,
``grid = ceil(n / (4 * block))``; with all three pointers 16-byte aligned a
full group of 4 is one ``ld.global.nc.v4`` per input, otherwise (and for
the last ``n % 4`` elements) scalar loads.

Accuracy: ``exp(-g)`` is ``ex2.approx(-g * log2(e))`` and the quotient is
``div.rn``; relative error within 1e-5 of float64 for ``|g| < 50``
(the rounding of ``g * log2 e`` grows with ``|g|``); GELU's within 1e-5
for ``|g| < 10`` (past -10 its value is below 2^-100 of |g|).
"""

from __future__ import annotations

import math

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import f16, f32, u32

from .plan import LaunchGeometry
from .spec_fields import block_field, pdl_field, pdl_prologue, target_field

LOG2E = 1.0 / math.log(2.0)
#: GELU (tanh) as a logistic: ``gelu(x) = x / (1 + exp(-x (GELU_A + GELU_B x^2)))``
GELU_A = 2.0 * math.sqrt(2.0 / math.pi)
GELU_B = 0.044715 * GELU_A
#: the gated activations: SwiGLU's silu, GeGLU's GELU (tanh)
ACTS = ("silu", "gelu_tanh")


@attrs.frozen
class SwiGluSpec:
    """A SwiGLU kernel.

    Parameters
    ----------
    block : int
        Threads per block (a multiple of 32, at most 1024).
    out_type : {"f32", "f16"}
        ``out``'s element type (f16: rounded to nearest from the f32 result,
        for a GEMM that takes f16 X).
    target : str
    act : {"silu", "gelu_tanh"}
        The activation of ``g``: SwiGLU, or GeGLU (Gemma's FFN).
    """

    block: int = block_field(256)
    out_type: str = attrs.field(default="f32", validator=attrs.validators.in_(("f32", "f16")))
    target: str = target_field()
    pdl: bool = pdl_field()
    act: str = attrs.field(default="silu", validator=attrs.validators.in_(ACTS))

    @property
    def kernel_name(self) -> str:
        name = "geglu" if self.act == "gelu_tanh" else "swiglu"
        return f"{name}_f32_b{self.block}" + ("_out_f16" if self.out_type == "f16" else "")


def silu_mul(k, g, u, full: bool = False):
    """``g / (1 + 2**(-g log2 e)) * u`` in f32 (``div.rn``, ``mul.rn``);
    with ``full`` the quotient is ``div.full`` (within 2 ulp), for kernels
    where ``div.rn``'s slow path, a subroutine call, must not appear (a
    call makes ptxas serialize a kernel's wgmma)."""
    e = k.ex2(k.mul(g, -LOG2E, rnd="rn"))
    s = k.div(g, k.add(e, 1.0, rnd="rn"), full=full)
    return k.mul(s, u, rnd="rn")


def gelu_exp(k, g):
    """``exp(-2 z) = 2**(-g (GELU_A + GELU_B g^2) log2 e)`` of GELU's tanh form."""
    t = k.fma(k.mul(g, g, rnd="rn"), -GELU_B * LOG2E, -GELU_A * LOG2E)
    return k.ex2(k.mul(g, t, rnd="rn"))


def gelu_mul(k, g, u):
    """``gelu(g) * u = g / (1 + exp(-2 z)) * u`` in f32 (``div.rn``, ``mul.rn``)."""
    s = k.div(g, k.add(gelu_exp(k, g), 1.0, rnd="rn"))
    return k.mul(s, u, rnd="rn")


def build(spec: SwiGluSpec) -> ptxgen.Module:
    """PTX for ``spec``; parameters ``g, u, out, n: u32``."""
    m = ptxgen.Module(spec.target)
    gate = gelu_mul if spec.act == "gelu_tanh" else silu_mul
    with m.kernel(spec.kernel_name, maxntid=spec.block) as k:
        pdl_prologue(k, spec)
        g = k.param_ptr("g", f32, align=16)
        u = k.param_ptr("u", f32, align=16)
        half = spec.out_type == "f16"
        out = k.param_ptr("out", f16 if half else f32, align=16)
        n = k.param("n", u32)

        def put(dst, vals):
            if half:
                vals = tuple(k.cvt(f16, v, rnd="rn") for v in vals)
            k.st(dst, vals if len(vals) > 1 else vals[0])

        i0 = k.global_id() << 2
        aligned = ((g | u | out) & 15).eq(0)
        full = k.setp("le", i0 + 4, n, combine=("and", aligned))
        with k.if_else(full) as (vec, scalar):
            with vec:
                gs = k.ld(g[i0], vec=4, nc=True)
                us = k.ld(u[i0], vec=4, nc=True)
                put(out[i0], tuple(gate(k, a, b) for a, b in zip(gs, us)))
            with scalar:
                for j in range(4):
                    i = i0 + j
                    with k.if_(i < n):
                        put(out[i], (gate(k, k.ld(g[i], nc=True), k.ld(u[i], nc=True)),))
    return m


def launch_geometry(spec: SwiGluSpec, n: int):
    """The launch for ``n`` elements."""
    per = 4 * spec.block
    return LaunchGeometry(spec.kernel_name, max(1, (n + per - 1) // per), spec.block)


def reference(g, u, act: str = "silu"):
    """float64 ``silu(g) * u`` (``act="gelu_tanh"``: ``gelu(g) * u``, GELU's
    tanh form as ``g / (1 + exp(-2 z))``)."""
    g = np.asarray(g, dtype=np.float64)
    u = np.asarray(u, dtype=np.float64)
    if act == "gelu_tanh":
        with np.errstate(over="ignore"):
            return g / (1.0 + np.exp(-2.0 * math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * u
    return g / (1.0 + np.exp(-g)) * u


CANONICAL = {"swiglu": SwiGluSpec(), "geglu": SwiGluSpec(act="gelu_tanh")}

registry.register("swiglu", SwiGluSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
