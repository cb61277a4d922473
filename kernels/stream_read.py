"""Stream read: read a buffer once and fold it with XOR, ``out[b]`` = the XOR
of every 32-bit word block ``b`` read.

This kernel does no useful work; it is the yardstick for the ones that do.
A decode step is a chain of launches that each stream weights from DRAM and
wait for the launch before them.  Timing this kernel in the same chain (the
same bytes per launch, the same programmatic dependent launch, the same
graph replay; ``driver/bench_ceiling.py``) measures what any kernel in that
position could reach, so the gap between it and a GEMV is the GEMV's own.

Each thread issues ``loads`` 16-byte ``ld.global.nc.L1::no_allocate.v4``
loads per step, all before the first use; load ``j`` of step ``s`` reads
16-byte unit ``s * block * loads + j * block + tid`` (a warp's load is 512
contiguous bytes).  ``persistent=False``: block ``b`` reads step ``b`` only
(grid = steps, many waves, the hardware scheduler balances them, as the
direct GEMV's grid does); ``persistent=True``: block ``b`` reads steps ``b,
b + grid, ...`` (one resident wave, as the ring GEMV's grid is).  With
``pdl`` the first step's loads go out before ``griddepcontrol.wait``, as a
GEMV's weight loads do; the reads never depend on an earlier launch, but the
block still waits, so a chain of launches is ordered as a real one is.  Units
past ``n16`` are not read (any size).

Launch: ``block`` threads, any grid (``launch_geometry`` gives the
one-step-per-block grid); ``out`` holds ``grid`` words.
"""

from __future__ import annotations

import attrs
import numpy as np

import ptxgen
from ptxgen import registry
from ptxgen.types import u32

from .plan import LaunchGeometry
from .spec_fields import block_field, pdl_field, pdl_prologue, pdl_wait, target_field


def _check_loads(inst, attr, v):
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 16:
        raise ValueError(f"loads must be an int in 1..16, got {v!r}")


@attrs.frozen
class StreamReadSpec:
    block: int = block_field(256)
    loads: int = attrs.field(default=4, validator=_check_loads)
    persistent: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    pdl: bool = pdl_field()
    target: str = target_field()

    @property
    def step_units(self) -> int:
        """16-byte units one block reads per step."""
        return self.block * self.loads

    @property
    def kernel_name(self) -> str:
        mode = "p" if self.persistent else "c"
        return f"stream_read_{mode}{self.block}x{self.loads}" + ("_pdl" if self.pdl else "")


def _xor_words(v):
    return (v[0] ^ v[1]) ^ (v[2] ^ v[3])


def build(spec: StreamReadSpec) -> ptxgen.Module:
    warps = spec.block // 32
    step = spec.step_units
    m = ptxgen.Module(spec.target)
    with m.kernel(spec.kernel_name, reqntid=spec.block) as k:
        src = k.param_ptr("src", u32)
        out = k.param_ptr("out", u32)
        n16 = k.param("n16", u32)
        part = k.shared_array("warp_xor", u32, warps, align=16)
        pdl_prologue(k, spec, wait=False)
        tid = k.tid.x
        acc = k.var(u32, 0)

        def issue(s):
            base = s * step + tid
            loads = []
            for j in range(spec.loads):
                u = base + j * spec.block
                ok = u < n16
                v = k.ld(src[u << 2], u32, vec=4, nc=True, evict="L1::no_allocate", guard=ok)
                loads.append((ok, v))
            return loads

        def fold(loads):
            for ok, v in loads:
                with k.guarded(ok):   # a unit past n16 was not loaded: fold nothing
                    k.xor(acc, _xor_words(v), out=acc)

        first = issue(k.ctaid.x)
        pdl_wait(k, spec)
        fold(first)
        if spec.persistent:
            steps = (n16 + (step - 1)) // step
            with k.for_range(k.ctaid.x + k.nctaid.x, steps, k.nctaid.x) as s:
                fold(issue(s))

        v = acc
        for off in (16, 8, 4, 2, 1):
            v = v ^ k.shfl_xor(v, off)
        lane, warp = tid & 31, tid >> 5
        with k.if_(lane.eq(0)):
            k.st(part[warp], v)
        k.bar_sync(0)
        with k.if_(tid.eq(0)):
            t = k.ld(part[0])
            for w in range(1, warps):
                t = t ^ k.ld(part[w])
            k.st(out[k.ctaid.x], t)
    return m


def launch_geometry(spec: StreamReadSpec, nbytes: int):
    """The launch reading ``nbytes`` (a multiple of 16) with one step per
    block; a persistent launch takes any smaller grid."""
    if nbytes <= 0 or nbytes % 16:
        raise ValueError(f"stream_read reads whole 16-byte units; nbytes = {nbytes}")
    n16 = nbytes // 16
    return LaunchGeometry(spec.kernel_name, (n16 + spec.step_units - 1) // spec.step_units,
                          spec.block)


def reference(words: np.ndarray, spec: StreamReadSpec, grid: int) -> np.ndarray:
    """The ``out`` words a launch of ``grid`` blocks writes over ``words`` (u32)."""
    w = np.asarray(words, dtype=np.uint32)
    if w.size % 4:
        raise ValueError("stream_read reads whole 16-byte units (4 words)")
    units = np.bitwise_xor.reduce(w.reshape(-1, 4), axis=1)
    step = spec.step_units
    steps = -(-units.size // step)
    pad = np.zeros(steps * step, dtype=np.uint32)
    pad[:units.size] = units
    per_step = np.bitwise_xor.reduce(pad.reshape(steps, step), axis=1)
    out = np.zeros(grid, dtype=np.uint32)
    for s in range(steps if spec.persistent else min(steps, grid)):
        out[s % grid] ^= per_step[s]
    return out


CANONICAL = {
    "stream_read": StreamReadSpec(),
    "stream_read_persistent": StreamReadSpec(block=512, loads=4, persistent=True),
}

registry.register("stream_read", StreamReadSpec, build, CANONICAL, doc=__doc__.splitlines()[0],
                  launch_geometry=launch_geometry)
