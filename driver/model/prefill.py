"""Chunked prefill for :class:`~.llama.LlamaModel`: the prompt's tokens but
the last run through the layers a chunk at a time on tensor cores, their K
and V rows written to the model's cache, then the decode step takes over.

Per chunk of ``T <= chunk`` tokens at positions ``L .. L + T - 1``: the
embedding rows (one gather launch per token), then per layer RMSNorm over
the rows, the QKV GEMM (``ops.gemm``; a weight type the GEMM does not take
falls back to one GEMV per row), RoPE with the KV append over the rows
(``RopeSpec(rows=True)``: the chunk's K/V rows land in the cache before the
attention reads them), causal attention (``ops.flash_prefill``, reading q
from the QKV rows), the O GEMM with the residual, RMSNorm, gate and up
GEMMs, SwiGLU, the down GEMM with the residual.  ``L`` and ``T`` live in a
device int32 pair the kernels read, and every launch covers the chunk size,
so the sequence is the same for every chunk.  The last prompt token is left
to the decode step, which computes its logits and the first new token, so
generation continues exactly as after a token-by-token prompt.

The launches are issued from the host on the model's stream (no CUDA graph
yet).
"""

from __future__ import annotations

import numpy as np

from ptxgen.kernels import decode_state, rope

from .. import ops
from ..ops_backend import get_backend

__all__ = ["Prefill", "DEFAULT_CHUNK"]

DEFAULT_CHUNK = 512


class Prefill:
    """The prefill launches of one model, with activations for ``chunk`` rows."""

    def __init__(self, model, chunk: int = DEFAULT_CHUNK):
        if chunk < 1:
            raise ValueError(f"prefill chunk must be at least 1, got {chunk}")
        self.model, self.chunk = model, int(chunk)
        hp = model.hp
        ex = model.executor
        self._arrays = {b.name: ex.arrays[id(b)] for b in model.graph.buffers
                        if b.kind != "activation"}
        be = ex.backend
        self.stream = model._stream
        self.ops_backend = "cuda" if type(be).__name__.startswith("Cuda") else "emu"
        C, H, D = self.chunk, hp.hidden, hp.head_dim
        self.qkv_dim = hp.q_dim + 2 * hp.kv_dim

        def buf(shape, dtype=np.float32):
            return be.from_numpy(np.zeros(shape, dtype))
        self.x, self.h = buf((C, H)), buf((C, H))
        self.qkv, self.att = buf((C, self.qkv_dim)), buf((C, hp.q_dim))
        self.gate, self.up, self.act = buf((C, hp.ffn)), buf((C, hp.ffn)), buf((C, hp.ffn))
        self.tokens = buf((C,), np.int32)
        self.info = buf((2,), np.int32)           # [start, n_tokens]
        self.rope_spec = rope.RopeSpec(head_dim=D, layout="interleaved", theta=hp.rope_theta,
                                       **_rope_scaling(hp), append="f16", rows=True,
                                       target=get_backend(self.ops_backend).target)
        self.freqs = be.from_numpy(rope.freq_table(self.rope_spec))
        self.caches = [tuple(ex.arrays[id(c)].view(np.float16, (hp.n_kv_heads, model.capacity, D))
                             for c in pair) for pair in model.kv_caches]

    # ------------------------------------------------------------ pieces
    def _w(self, name):
        """The weight's device array and its type (the stacked QKV weight has
        the type of attn_q)."""
        src = name.replace("attn_qkv", "attn_q")
        return self._arrays[name], self.model.file.tensor(src)

    def _kw(self):
        return dict(stream=self.stream, backend=self.ops_backend)

    def _matmul(self, name, x, out, residual=None):
        """``out = x W^T (+ residual)`` over the chunk's rows."""
        w, t = self._w(name)
        q = t.qtype.upper()
        rows = out.shape[1]
        w2 = w.view(np.uint8, (rows, w.nbytes // rows))
        if q == "Q4_K":
            ops.gemm(w2, x, q, out=out, residual=residual, **self._kw())
            return
        for r in range(self.chunk):                   # fallback: a GEMV per row
            xr = x.view(offset=4 * r * x.shape[1], shape=(x.shape[1],))
            yr = out.view(offset=4 * r * out.shape[1], shape=(out.shape[1],))
            ops.gemv(w2, xr, q, out=yr, residual=None if residual is None else yr,
                     **self._kw())

    def _layer(self, i):
        hp, m = self.model.hp, self.model
        p = f"blk.{i}."
        kw = self._kw()
        ops.rmsnorm(self.x, self._w(p + "attn_norm.weight")[0], hp.eps, out=self.h, **kw)
        if p + "attn_qkv.weight" in self._arrays:
            self._matmul(p + "attn_qkv.weight", self.h, self.qkv)
        else:
            raise ValueError(f"{p}attn_q/k/v differ in type; chunked prefill needs one "
                             "stacked QKV weight (use prefill_chunk=0)")
        kc, vc = self.caches[i]
        D = hp.head_dim
        rs = self.rope_spec
        fn = get_backend(self.ops_backend).function(rope.build, rs)
        grid, block, _ = rope.launch_geometry(rs, hp.n_heads, hp.n_kv_heads)
        q = self.qkv
        get_backend(self.ops_backend).launch(
            fn, (grid[0], self.chunk, 1), block, q, q.view(offset=4 * hp.q_dim), self.freqs,
            self.info, hp.n_heads, hp.n_kv_heads, q.view(offset=4 * (hp.q_dim + hp.kv_dim)),
            kc, vc, m.capacity, self.qkv_dim, self.info.view(offset=4), stream=self.stream)
        ops.flash_prefill(self.qkv, kc, vc, self.info.view(shape=(1,)), self.info.view(offset=4),
                          out=self.att.view(shape=(self.chunk, hp.n_heads, D)),
                          n_q_heads=hp.n_heads, **kw)
        self._matmul(p + "attn_output.weight", self.att, self.x, residual=self.x)
        ops.rmsnorm(self.x, self._w(p + "ffn_norm.weight")[0], hp.eps, out=self.h, **kw)
        self._matmul(p + "ffn_gate.weight", self.h, self.gate)
        self._matmul(p + "ffn_up.weight", self.h, self.up)
        ops.swiglu(self.gate, self.up, out=self.act, **kw)
        self._matmul(p + "ffn_down.weight", self.act, self.x, residual=self.x)

    def _embed(self):
        emb, t = self._w("token_embd.weight")
        q = t.qtype.replace("F32", "f32").replace("F16", "f16")
        H = self.model.hp.hidden
        for r in range(self.chunk):
            ops.embedding(emb, q, self.tokens.view(offset=4 * r, shape=(1,)),
                          out=self.x.view(offset=4 * r * H, shape=(H,)), n=H, **self._kw())

    # ------------------------------------------------------------ running
    def run_chunk(self, tokens, start: int):
        """Run ``tokens`` (at most ``chunk``) at positions ``start ..``."""
        be = self.model.executor.backend
        T = len(tokens)
        buf = np.zeros(self.chunk, np.int32)
        buf[:T] = tokens
        be.copy_from_host(self.tokens, buf)
        be.copy_from_host(self.info, np.array([start, T], np.int32))
        self._embed()
        for i in range(self.model.hp.n_layers):
            self._layer(i)

    def run(self, prompt):
        """Prefill every prompt token but the last, then set the decode state
        to the last one (position ``n - 1``, attention length ``n``)."""
        prompt = [int(t) for t in prompt]
        n = len(prompt)
        for s in range(0, n - 1, self.chunk):
            self.run_chunk(prompt[s:min(s + self.chunk, n - 1)], s)
        m = self.model
        state = decode_state.initial_state(prompt[-1], n)
        state[decode_state.POS] = n - 1
        state[decode_state.KV_LEN] = n
        m.executor.write(m.state, state)
        hist = np.zeros(m.capacity, np.int32)
        hist[:n] = prompt
        m.executor.write(m.history, hist)
        m.backend.synchronize(self.stream)
        return n - 1


def _rope_scaling(hp) -> dict:
    from .llama import _rope_scaling as f
    return f(hp)
