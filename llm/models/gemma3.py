"""Gemma 3 (text), as llama.cpp's converter writes it and its
``llama_model_gemma3`` graph runs it: the token embeddings times
``sqrt(embedding_length)``; per-head q/k RMSNorms and NeoX RoPE; the
attention and FFN outputs each RMS-normed (``post_attention_norm``,
``post_ffw_norm``) before they join the residual stream, every norm weight
used as stored (the converter has added Gemma's +1); a GELU-tanh gated FFN
(GeGLU); sliding-window (local) layers, with their own RoPE base, between
the global ones (the file's window and pattern); the file's attention
scale (:attr:`~ptxgen.llm.gguf.file.LlamaHParams.sm_scale`); the output
tied to the embedding."""

import math

from ptxgen.llm.lowering.common import QKV

from .base import Architecture

__all__ = ["Gemma3"]


class Gemma3(Architecture):
    gguf_names = ("gemma3",)
    rope_layout = "neox"
    qk_norm = True

    def qkv(self, i: int) -> QKV:
        return QKV.of_layer(self.file, i, self.qk_norm, local=self.hp.window(i) > 0)

    def forward(self, s):
        x = s.embed("token_embd.weight", scale=math.sqrt(self.hp.hidden))
        for i in range(self.hp.n_layers):
            x = self.layer(s, i, x)
        s.output(s.norm(x, "output_norm.weight", "output"), self.output_weight)

    def layer(self, s, i: int, x):
        p = f"blk.{i}."
        h = s.norm(x, p + "attn_norm.weight", "attn")
        q = s.qkv(h, self.qkv(i))
        a = s.linear(s.attention(i, q, window=self.hp.window(i)), p + "attn_output.weight")
        x = s.add_normed(x, a, p + "post_attention_norm.weight")
        h = s.norm(x, p + "ffn_norm.weight", "ffn")
        f = s.gated_ffn(h, p + "ffn_gate.weight", p + "ffn_up.weight", p + "ffn_down.weight",
                        act="gelu_tanh")
        return s.add_normed(x, f, p + "post_ffw_norm.weight")
