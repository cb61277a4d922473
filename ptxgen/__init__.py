"""ptxgen: a pure-Python PTX assembler and JIT for LLM decode kernels.

The DSL builds PTX text directly::

    import ptxgen
    from ptxgen.types import f32, u32

    m = ptxgen.Module("sm_90")
    with m.kernel("vector_add", maxntid=256) as k:
        a, b, c = (k.param_ptr(n, f32) for n in "abc")
        n = k.param("n", u32)
        i = k.global_id()
        with k.if_(i < n):
            k.st(c[i], k.ld(a[i]) + k.ld(b[i]))
    print(m.to_ptx())

Nothing here needs a GPU; ``ptxgen.driver`` loads and launches the text and
``ptxgen.emu`` runs it on the CPU.
"""

from .version import __version__

from . import types
from .builder import KernelBuilder
from .errors import PtxBuildError, PtxTypeError, PtxVerifyError, TargetError
from .module import Module
from .target import TARGETS, Target, get_target

__all__ = ["Module", "KernelBuilder", "Target", "TARGETS", "get_target", "types",
           "PtxBuildError", "PtxTypeError", "PtxVerifyError", "TargetError",
           "__version__"]
