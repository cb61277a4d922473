"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k
RMSNorms, NeoX RoPE, its own head size) and, in every layer, a mixture of
experts for the FFN: a router choosing ``expert_used_count`` of
``expert_count`` SwiGLU experts per token, their outputs summed with the
router's weights renormalised to one (llama.cpp's ``build_moe_ffn`` for
qwen3moe: softmax gating, ``norm_w`` always on)."""

from ptxgen.llm.lowering.moe import Experts

from .qwen3 import Qwen3

__all__ = ["Qwen3Moe"]


class Qwen3Moe(Qwen3):
    gguf_names = ("qwen3moe",)

    def layer(self, s, i: int, x):
        p = f"blk.{i}."
        h = s.norm(x, p + "attn_norm.weight", "attn")
        q = s.qkv(h, self.qkv(i))
        x = s.linear(s.attention(i, q), p + "attn_output.weight", residual=x)
        h = s.norm(x, p + "ffn_norm.weight", "ffn")
        return s.moe_ffn(h, Experts.of_layer(i), residual=x)
