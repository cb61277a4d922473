"""Mixture-of-experts kernels: the router (softmax, top-k, renormalised
weights on the device), the experts' GEMV (the selected experts' rows, the
ids read from device memory) and the weighted sum of the experts'
outputs."""

from . import combine, expert_gemv, router  # noqa: F401

__all__ = ["combine", "expert_gemv", "router"]
