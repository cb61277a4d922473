"""Llama (1, 2, 3, 3.1) and the files llama.cpp's converter writes as
``llama`` or ``mistral`` (Mistral 7B, Mistral-Nemo): pre-norm layers,
interleaved RoPE (with ``rope_freqs`` factors where the file has them),
grouped-query attention, a SwiGLU FFN, output tied to the embedding when
the file has no ``output.weight``."""

from .base import Architecture

__all__ = ["Llama"]


class Llama(Architecture):
    gguf_names = ("llama", "mistral")
    rope_layout = "interleaved"
