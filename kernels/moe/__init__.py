"""Mixture-of-experts kernels: the router (softmax, top-k, renormalised
weights on the device), the experts' GEMV (the selected experts' rows, the
ids read from device memory), the grouping of a chunk's pairs by expert and
the experts' GEMM over them, and the weighted sum of the experts'
outputs."""

from . import combine, expert_gemm, expert_gemv, expert_wgmma, group, permute, router  # noqa: F401

__all__ = ["combine", "expert_gemm", "expert_gemv", "expert_wgmma", "group", "permute", "router"]
