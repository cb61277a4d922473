"""Kernel families written with the ptxgen DSL.

Each module holds one family: a frozen spec, ``build(spec)`` returning a
:class:`ptxgen.Module`, its launch geometry, a numpy reference, and the
canonical specs it registers for the CLI and the golden tests.
"""

from . import (argmax, decode_state, embedding, flash_decode, flash_prefill,  # noqa: F401
               gemm, gemv, kv_append, moe, paged_attention, reduce, rmsnorm, rope, sampling,
               stream_read, swiglu, vector_add)

__all__ = ["argmax", "decode_state", "embedding", "flash_decode", "flash_prefill", "gemm", "gemv",
           "kv_append", "moe", "paged_attention", "reduce", "rmsnorm", "rope", "sampling",
           "stream_read", "swiglu", "vector_add"]
