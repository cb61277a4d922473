"""Python entry points that build (cached per spec) and launch one kernel.

They accept ``ptxgen.driver.DeviceArray``, torch or cupy CUDA tensors
(through ``__cuda_array_interface__``), ``ptxgen.emu.DeviceArray`` (run on the
CPU emulator) and numpy arrays (copied; numpy in, numpy out, on the GPU when
there is one and on the emulator otherwise).  :mod:`.ops_backend` decides
where a call runs and converts its arguments (docs/driver.md).

GEMV: :func:`gemv`, :func:`gemv_swiglu` (``driver/ops_gemv.py``).  GEMM (a chunk of
tokens on tensor cores): :func:`gemm` (``driver/ops_gemm.py``).
Decode step: :func:`rmsnorm`, :func:`rope`, :func:`swiglu`,
:func:`flash_decode`, :func:`embedding`, :func:`kv_append`, :func:`argmax`
(``driver/ops_decode.py``).  Sampling: :func:`sample`, :func:`sample_rows`,
:func:`sampling_params` (``driver/ops_sampling.py``).  Prefill:
:func:`flash_prefill`, :func:`flash_prefill_paged` (``driver/ops_prefill.py``).
Batched decode: :func:`paged_attention` (``driver/ops_paged.py``).
"""

from .ops_decode import (argmax, embedding, flash_decode, kv_append, rmsnorm, rope,
                         swiglu)
from .ops_gemm import gemm, gemm_plan
from .ops_paged import paged_attention
from .ops_prefill import flash_prefill, flash_prefill_paged
from .ops_gemv import gemv, gemv_spec, gemv_swiglu
from .ops_sampling import sample, sample_rows, sampling_params

__all__ = ["gemm", "gemm_plan", "gemv", "gemv_swiglu", "gemv_spec", "rmsnorm", "rope",
           "swiglu", "flash_decode", "embedding", "kv_append", "argmax", "sample", "sample_rows",
           "sampling_params", "flash_prefill", "flash_prefill_paged", "paged_attention"]
