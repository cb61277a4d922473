"""Qwen3 (dense): Llama's layers with an RMSNorm over every q and k head
before RoPE, NeoX RoPE, and a head size of its own (``key_length``, not
hidden / heads)."""

from .base import Architecture

__all__ = ["Qwen3"]


class Qwen3(Architecture):
    gguf_names = ("qwen3",)
    rope_layout = "neox"
    qk_norm = True
