"""Qwen2 and Qwen2.5: Llama's layers with biases on the q, k and v
projections and NeoX RoPE (pairs i, i + d/2)."""

from .base import Architecture

__all__ = ["Qwen2"]


class Qwen2(Architecture):
    gguf_names = ("qwen2",)
    rope_layout = "neox"
