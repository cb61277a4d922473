"""What a model definition is: a decoder family's conventions and its step,
written once over the blocks every lowering implements.

A definition's :meth:`Architecture.forward` calls blocks on a lowering
``s`` (:mod:`ptxgen.llm.lowering`); it says what the step computes for the
tokens the lowering stands for (one token of one sequence, the rows of a
prompt chunk), never how: which kernels run, what is fused, where the
positions and the KV cache live are the lowering's.

The blocks:

``s.embed(weight, scale=None) -> x``
    the token embeddings of the step's tokens (times ``scale``);
``s.norm(x, weight, kind) -> h``
    RMSNorm with the file's eps (``kind``: ``"attn"``, ``"ffn"``,
    ``"output"``, for lowerings that fold norms into what reads them);
``s.qkv(h, w: QKV) -> q``
    the layer's Q/K/V projections with their optional biases, optional
    per-head q/k RMSNorms, RoPE in the architecture's layout, and K/V
    stored to the layer's cache at the tokens' positions (``w.local``: at
    the sliding-window layers' RoPE base); returns q;
``s.attention(layer, q, window=0) -> a``
    causal attention of q over the layer's cache (GQA), scores scaled by
    the file's attention scale; with a ``window``, each query sees only the
    last ``window`` keys, its own included;
``s.linear(a, weight, residual=None) -> y``
    ``a W^T`` (``+ residual``);
``s.gated_ffn(h, gate, up, down, residual=None, act="silu") -> y``
    ``down(act(gate h) * up h)`` (``+ residual``); ``act``: ``"silu"``
    (SwiGLU) or ``"gelu_tanh"`` (GeGLU);
``s.add_normed(x, y, weight) -> x``
    ``x + RMSNorm(y) weight``, into the residual stream ``x``;
``s.moe_ffn(h, e: Experts, residual) -> y``
    a mixture of experts' FFN (:class:`~ptxgen.llm.lowering.moe.Experts`):
    the router's top-k experts of ``h``, their SwiGLU FFNs, the weighted
    sum added to ``residual``;
``s.output(h, weight)``
    the logits (and, where the lowering has one, the next token's choice).
"""

from __future__ import annotations

from ptxgen.llm.lowering.common import QKV

__all__ = ["Architecture"]


class Architecture:
    """A decoder family: its GGUF names, conventions and step.

    Subclasses set :attr:`gguf_names`, :attr:`rope_layout` and
    :attr:`qk_norm`, and may override :meth:`forward` or :meth:`layer`.
    """

    #: ``general.architecture`` values this definition runs
    gguf_names: tuple = ()
    #: RoPE pairs: ``"interleaved"`` (2i, 2i+1) or ``"neox"`` (i, i + d/2)
    rope_layout: str = "interleaved"
    #: per-head RMSNorm of q and k before RoPE (``attn_q_norm``, ``attn_k_norm``)
    qk_norm: bool = False

    def __init__(self, file):
        self.file = file
        self.hp = file.hparams

    def qkv(self, i: int) -> QKV:
        """Layer ``i``'s attention-input tensors (biases where the file has them)."""
        return QKV.of_layer(self.file, i, self.qk_norm)

    @property
    def output_weight(self) -> str:
        """``output.weight``, or the embedding when the file ties them."""
        return "output.weight" if self.file.has("output.weight") else "token_embd.weight"

    def forward(self, s):
        """The step: embeddings, the layers, the output."""
        x = s.embed("token_embd.weight")
        for i in range(self.hp.n_layers):
            x = self.layer(s, i, x)
        s.output(s.norm(x, "output_norm.weight", "output"), self.output_weight)

    def layer(self, s, i: int, x):
        """A pre-norm decoder layer: attention, then a gated FFN, each added
        to the residual stream."""
        p = f"blk.{i}."
        h = s.norm(x, p + "attn_norm.weight", "attn")
        q = s.qkv(h, self.qkv(i))
        x = s.linear(s.attention(i, q), p + "attn_output.weight", residual=x)
        h = s.norm(x, p + "ffn_norm.weight", "ffn")
        return s.gated_ffn(h, p + "ffn_gate.weight", p + "ffn_up.weight", p + "ffn_down.weight",
                           residual=x)
