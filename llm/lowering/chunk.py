"""A prompt chunk: a model definition lowered for the rows of up to
``rows`` consecutive tokens of one sequence, on tensor cores.

The chunk's token ids (``chunk_tokens``) and the int32 pair ``(L, T)``
(``chunk_info``: its first position and its length) live in device buffers
the kernels read (the GEMMs with ``t_device``: tiles past ``T`` exit), so
the launches depend only on ``rows``, the *bucket*: every launch is sized
for it and one captured CUDA graph serves every chunk of up to ``rows``
tokens.  The K and V rows land in the model's cache (shared with the decode
step) before the chunk's attention reads them.

The blocks lower to:

- ``embed``: one row-gather launch over the chunk's tokens (scaled in it);
- ``norm``: an RMSNorm launch over the rows (f16 out where every GEMM
  that reads it takes f16 X);
- ``qkv``: one GEMM over the stacked ``[Wq; Wk; Wv]`` (or one per weight
  writing its column block, where their types differ) with the biases
  added in its epilogue, then RoPE + the K/V append over the rows, which
  also applies the per-head q/k RMSNorms where the file has them
  (``RopeSpec.qk_norm``);
- ``attention``: causal chunk attention reading q from the QKV rows (a
  sliding window: the kernel of that window);
- ``linear``: a GEMM with the residual added in its epilogue (over several
  tensor-parallel ranks, rank 0's alone, then an all-reduce of the rows);
- ``gated_ffn``: the gate and up GEMMs, a SwiGLU (GeGLU) launch, the down
  GEMM;
- ``add_normed``: an RMSNorm launch over the rows adding into the stream;
- ``moe_ffn``: the RMSNorm into f32 rows of its own, then the router and
  the experts' GEMVs over the rows, each token its own experts (:mod:`.moe`);
- ``output``: nothing: the last prompt token is the decode step's, which
  computes its logits and chooses the first new token.

A weight type with no GEMM on the device runs a GEMV per row instead
(correct, but no faster than decoding the prompt).
"""

from __future__ import annotations

import numpy as np

from ptxgen.driver.executor import TensorMapOf
from ptxgen.kernels import embedding, flash_prefill, rmsnorm, rope, swiglu
from ptxgen.kernels.spec_fields import has_griddepcontrol

from ptxgen.llm.parallel import SINGLE

from . import matmul, moe
from .common import QKV, Lowering, Normed, Tuning

__all__ = ["ChunkLowering", "gemm_ready"]


_ATTN = ("attn_q", "attn_k", "attn_v", "attn_output")
_FFN = ("ffn_gate", "ffn_up", "ffn_down")


def gemm_ready(file, target, names=None) -> bool:
    """Whether every layer's weights ``names`` (default: the attention's and,
    where the file has a dense FFN, the FFN's) exist and have a GEMM on
    ``target``."""
    if names is None:
        names = _ATTN + (_FFN if file.has("blk.0.ffn_gate.weight") else ())
    return all(file.has(f"blk.{i}.{n}.weight")
               and matmul.has_gemm(file, f"blk.{i}.{n}.weight", target)
               for i in range(file.hparams.n_layers) for n in names)


class ChunkLowering(Lowering):
    """The blocks of a definition as the launches of a prompt chunk of up to
    ``rows`` tokens.

    Parameters
    ----------
    file, store, target, capacity, rope_layout
        As :class:`~.decode.DecodeLowering`'s.
    rows : int
        The bucket: the most tokens a chunk of this graph holds.
    chunk : int
        The largest bucket of the model.
    device : str, optional
        The GPU's name (tuned configs stored for it win).
    pdl : bool
        Programmatic dependent launch where the target has it.
    tp : TensorParallel
        The rank this graph is of (``file`` its shard: :mod:`ptxgen.llm.parallel`).
    """

    def __init__(self, file, store, *, target, capacity, rope_layout, rows: int, chunk: int,
                 device=None, pdl=True, gemm=True, tp=SINGLE):
        super().__init__(file, store, target=target, capacity=capacity, rope_layout=rope_layout,
                         tp=tp)
        if not 1 <= rows <= chunk:
            raise ValueError(f"a chunk bucket of {rows} rows must be in 1..{chunk}")
        g, hp = self.g, self.hp
        self.rows, self.device = int(rows), device
        self.pdl = bool(pdl) and has_griddepcontrol(target)
        #: the weights as GEMMs (else a GEMV per row, as at one token)
        self.gemm = bool(gemm)
        self.tokens, self.info = self._inputs(capacity, chunk)
        self.start_ptr, self.n_ptr = _plus(self.info, 0), _plus(self.info, 4)
        self.qkv_dim = hp.q_dim + 2 * hp.kv_dim
        self._extra = {}
        #: the rows of a linear block's output, by width
        self._outs = {}
        #: the configuration of the GEMVs a weight with no GEMM runs per row
        self.row_tuning = Tuning()
        B, H = self.rows, hp.hidden

        def x_type(*names):
            # f16 where every GEMM reading it takes f16 X (a GEMV reads f32)
            return np.float16 if self._f16_x(names) else np.float32
        self.x = g.buffer("x", (B, H), np.float32)
        # the normed rows the GEMMs read (a mixture of experts' router and
        # experts read f32 rows of their own: moe_ffn)
        dense = file.has("blk.0.ffn_gate.weight")
        self.h = g.buffer("h", (B, H), x_type("attn_q", "attn_k", "attn_v",
                                              *(("ffn_gate", "ffn_up") if dense else ())))
        self.qkv_rows = g.buffer("qkv", (B, self.qkv_dim), np.float32)
        self.att = g.buffer("att", (B, hp.q_dim), x_type("attn_output"))
        self.act = g.buffer("ffn_act", (B, hp.ffn), x_type("ffn_down"))

    def _f16_x(self, names) -> bool:
        """Whether the activations every layer's weights ``names`` read are
        f16: where all of them run as GEMMs that take f16 X."""
        return self.gemm and gemm_ready(self.file, self.target, names)

    def _inputs(self, capacity, chunk) -> tuple:
        """The token ids and the int32 pair ``(start, n_rows)``."""
        g = self.g
        return (g.buffer("chunk_tokens", (max(capacity, chunk),), np.int32, "state"),
                g.buffer("chunk_info", (2,), np.int32, "state"))

    # ------------------------------------------------------------ pieces
    def _matmul(self, name, x, out, *, residual=None, bias=None, rows=None, stride=None,
                weight=None, info=None):
        """``out = x W^T (+ residual | + bias)`` over the bucket's rows; with
        ``stride`` ``out`` is a flat view whose row ``t`` starts at element
        ``t stride``."""
        w, t = (weight, info) if weight is not None else self.weight(name)
        rows = t.shape[0] if rows is None else rows
        stride = stride or rows
        sources = (name,) if "attn_qkv" not in name else tuple(
            name.replace("attn_qkv", n) for n in ("attn_q", "attn_k", "attn_v"))
        if self.gemm and all(matmul.has_gemm(self.file, n, self.target) for n in sources):
            matmul.gemm(self, name.removesuffix(".weight"), w, t, x, out, self.n_ptr,
                        rows_max=self.rows, residual=residual, bias=bias, y_stride=stride,
                        device=self.device, pdl=self.pdl)
            return
        # a GEMV per row (f32 X): no GEMM for the type, or a row or two
        K = t.shape[1]
        for r in range(self.rows):
            extra = bias if residual is None else _row(residual, r, 4 * stride)
            matmul.gemv(self, f"{name.removesuffix('.weight')}.row{r}", w, t, _row(x, r, 4 * K),
                        _row(out, r, 4 * stride), residual=extra, tuning=self.row_tuning)

    def embed(self, weight, scale=None):
        emb, et = self.weight(weight)
        hp = self.hp
        es = embedding.EmbeddingSpec(qtype=et.qtype, rows=True, target=self.target,
                                     scaled=scale is not None)
        geom = embedding.launch_geometry(es, hp.hidden, self.rows)
        extra = {} if scale is None else dict(scale=float(scale))
        self.add("Embedding", "embd", [emb, self.tokens], [self.x],
                 [self.launch("embedding", es, geom, table=emb,
                              token_ptr=self.tokens, out=self.x, n=hp.hidden,
                              n_vocab=hp.vocab, **extra)])
        return self.x

    def norm(self, x, weight, kind):
        return Normed(x, weight, kind)

    def _rmsnorm(self, x, weight, out, name, accumulate=False):
        w, _ = self.weight(weight)
        spec = rmsnorm.RmsNormSpec(residual=False, block=_norm_block(self.hp.hidden),
                                   out_type="f16" if out.dtype == np.float16 else "f32",
                                   target=self.target, pdl=self.pdl, accumulate=accumulate)
        self.add("RmsNorm", name, [x, w] + ([out] if accumulate else []), [out],
                 [self.launch("rmsnorm", spec, rmsnorm.launch_geometry(spec, self.rows), x=x,
                              w=w, out=out, n=self.hp.hidden, eps=self.hp.eps)])

    def _input(self, h):
        if not isinstance(h, Normed):
            return h
        self._rmsnorm(h.x, h.weight, self.h, h.weight.removesuffix(".weight"))
        return self.h

    def qkv(self, h, w: QKV):
        hp, f, p = self.hp, self.file, w.prefix
        x = self._input(h)
        qkv = self.qkv_rows
        if len({f.qtype(n) for n in (w.q, w.k, w.v)}) == 1:
            wb, t = self.stacked_qkv(w)
            self._matmul(p + "attn_qkv.weight", x, qkv, bias=self.qkv_bias(w), weight=wb,
                         info=t)
        else:
            bias = self.qkv_bias(w)
            off = 0
            for n, rows in ((w.q, hp.q_dim), (w.k, hp.kv_dim), (w.v, hp.kv_dim)):
                self._matmul(n, x, qkv.at(4 * off), rows=rows, stride=self.qkv_dim,
                             bias=None if bias is None else bias.at(4 * off))
                off += rows
        kc, vc = self.kv_cache(w.layer)
        self._rope_launch(w, qkv, kc, vc, self.rope_table(w.local))
        return qkv

    def _rope_launch(self, w: QKV, qkv, kc, vc, freqs):
        """RoPE in place over the rows at positions ``start ..`` and their K/V
        rows appended to the caches; where the layer has q/k norms, the q
        and k heads' RMSNorms first, in the same launch (``RopeSpec.qk_norm``)."""
        hp = self.hp
        rs = rope.RopeSpec(head_dim=hp.head_dim, layout=self.rope_layout, theta=hp.rope_theta,
                           append="f16", rows=True, qk_norm=w.q_norm is not None,
                           target=self.target)
        geom = rope.launch_geometry(rs, hp.n_heads, hp.n_kv_heads, self.rows)
        norms, nargs = self.qk_norm_args(w)
        self.add("RopeKvAppend", w.prefix + "rope_kv_append", [qkv, freqs, self.info] + norms,
                 [qkv, kc, vc],
                 [self.launch("rope", rs, geom,
                              q=qkv.at(0), k=qkv.at(4 * hp.q_dim), freqs=freqs,
                              pos_ptr=self.start_ptr, n_q_heads=hp.n_heads,
                              n_kv_heads=hp.n_kv_heads,
                              v=qkv.at(4 * (hp.q_dim + hp.kv_dim)), k_cache=kc, v_cache=vc,
                              capacity=self.capacity, row_stride=self.qkv_dim,
                              n_rows_ptr=self.n_ptr, **nargs)])

    def attention(self, layer, q, window=0):
        hp = self.hp
        D = hp.head_dim
        kc, vc = self.kv_cache(layer)
        target = matmul.gemm_target(self.target)
        spec = flash_prefill.FlashPrefillSpec(
            head_dim=D, group=hp.n_heads // hp.n_kv_heads, target=target,
            out_type="f16" if self.att.dtype == np.float16 else "f32", pdl=self.pdl,
            window=int(window))
        plan = flash_prefill.plan(spec, device=self.device)
        geom = flash_prefill.launch_geometry(plan, hp.n_heads, self.rows)
        args = dict(q=q, k_cache=kc, v_cache=vc, start_ptr=self.start_ptr,
                    n_tokens_ptr=self.n_ptr, out=self.att, capacity=self.capacity,
                    sm_scale=hp.sm_scale, q_stride=self.qkv_dim)
        n_kv, cap = hp.n_kv_heads, self.capacity
        if flash_prefill.cache_maps(plan, 0, 0, n_kv, cap) is not None:
            for name, cache, i in (("k_map", kc, 0), ("v_map", vc, 1)):
                args[name] = TensorMapOf(cache, lambda a, i=i: flash_prefill.cache_maps(
                    plan, a, a, n_kv, cap)[i])
        q_buf = q.buffer if hasattr(q, "buffer") else q
        self.add("Attention", f"blk.{layer}.attention", [q_buf, kc, vc, self.info], [self.att],
                 [self.launch("flash_prefill", plan, geom, **args)])
        return self.att

    def linear(self, a, weight, residual=None):
        # over several ranks: a partial sum (the residual rank 0's alone), all-reduced
        name = weight.removesuffix(".weight")
        if residual is None:
            rows = self.file.shape(weight)[0]
            y = self._outs.get(rows)
            if y is None:
                y = self._outs[rows] = self.g.buffer(f"out{rows}", (self.rows, rows),
                                                      np.float32)
            self._matmul(weight, a, y)
            return self.all_reduce(y, name)
        self._matmul(weight, a, residual, residual=residual if self.tp.adds_residual else None)
        return self.all_reduce(residual, name)

    def add_normed(self, x, y, weight):
        self._rmsnorm(y, weight, x, weight.removesuffix(".weight"), accumulate=True)
        return x

    def gated_ffn(self, h, gate, up, down, residual=None, act="silu"):
        hp = self.hp
        x = self._input(h)
        p = gate.removesuffix("ffn_gate.weight")
        g_out = self.g.buffer(p + "ffn_gate_out", (self.rows, hp.ffn), np.float32)
        u_out = self.g.buffer(p + "ffn_up_out", (self.rows, hp.ffn), np.float32)
        self._matmul(gate, x, g_out)
        self._matmul(up, x, u_out)
        ss = swiglu.SwiGluSpec(out_type="f16" if self.act.dtype == np.float16 else "f32",
                               target=self.target, pdl=self.pdl, act=act)
        n = self.rows * hp.ffn
        self.add("SwiGLU", p + ("geglu" if act == "gelu_tanh" else "swiglu"), [g_out, u_out],
                 [self.act],
                 [self.launch("swiglu", ss, swiglu.launch_geometry(ss, n), g=g_out, u=u_out,
                              out=self.act, n=n)])
        return self.linear(self.act, down, residual=residual)

    def moe_ffn(self, h, e: moe.Experts, residual):
        x = h
        if isinstance(h, Normed):
            x = self._extra.get("moe_h")
            if x is None:
                x = self._extra["moe_h"] = self.g.buffer("moe_h", (self.rows, self.hp.hidden),
                                                         np.float32)
            self._rmsnorm(h.x, h.weight, x, h.weight.removesuffix(".weight"))
        return moe.chunk_ffn(self, x, e, residual, rows=self.rows, n_ptr=self.n_ptr,
                             pdl=self.pdl, tuning=Tuning(device=self.device))

    def output(self, h, weight):
        """Nothing: the decode step computes the last token's logits."""


def _norm_block(n: int) -> int:
    """Threads of an RMSNorm block over rows of ``n``: enough for the row to
    sit in registers (4 x 16 bytes each)."""
    return min(1024, max(256, -(-n // 512) * 32))


def _plus(a, nbytes: int):
    """A reference ``nbytes`` into the buffer (or further on from the reference) ``a``."""
    if hasattr(a, "buffer"):
        return a.buffer.at(a.offset + nbytes)
    return a.at(nbytes)


def _row(a, r: int, row_bytes: int):
    """A reference to row ``r`` of the buffer (or reference) ``a``."""
    if hasattr(a, "buffer"):
        return a.buffer.at(a.offset + r * row_bytes)
    return a.at(r * row_bytes)

