"""Chunked prefill for :class:`~.llama.LlamaModel`: the prompt's tokens but
the last run through the layers a chunk at a time on tensor cores, their K
and V rows written to the model's cache, then the decode step takes over.

Per chunk of ``T <= chunk`` tokens at positions ``L .. L + T - 1``: the
embedding rows (one gather launch), then per layer RMSNorm over the rows,
the QKV GEMM (``ops.gemm``; one over the stacked weight, or where q, k and v
differ in type, as in llama.cpp's Q4_K_M mix, one each writing its column
block of the QKV rows; a weight type the GEMM does not take, or a BF16
matrix with a weight past f16's range, falls back to one GEMV per row; the
activations a GEMM reads are f16, rounded by the kernel that writes them,
where every layer's GEMM of that input takes f16 X), RoPE with the KV append over the rows
(``RopeSpec(rows=True)``: the chunk's K/V rows land in the cache before the
attention reads them), causal attention (``ops.flash_prefill``, reading q
from the QKV rows), the O GEMM with the residual, RMSNorm, gate and up
GEMMs, SwiGLU, the down GEMM with the residual.  The chunk's token ids and
the int32 pair ``(L, T)`` live in device buffers the kernels read (the GEMMs
with ``n_tokens``: tiles past ``T`` exit), so the launch sequence depends
only on the *bucket*: the smallest of :attr:`Prefill.buckets` that holds
``T``, every launch sized for it.  The sequence of each bucket is recorded
once (:func:`~ptxgen.driver.backend.recording`) and, on the GPU,
captured into a CUDA graph replayed for every chunk of that bucket
(programmatic dependent launch where the specs have it, as in the decode
graph); ``mode="eager"`` (and the emulator) issues the recorded launches
one by one.  The last prompt token is left to the decode step, which
computes its logits and the first new token, so generation continues
exactly as after a token-by-token prompt.
"""

from __future__ import annotations

import numpy as np

from ptxgen.kernels import decode_state, gemm as _gemm, rope

from ptxgen.driver import ops
from ptxgen.driver.backend import get_backend, recording
from ptxgen.driver.ops_gemm import gemm_target

__all__ = ["Prefill", "DEFAULT_CHUNK", "BUCKETS", "refusal", "gemm_ready"]

DEFAULT_CHUNK = 512
#: chunk sizes a graph is captured for (those below the chunk, and the chunk)
BUCKETS = (64, 128, 256)


def gemm_ready(model, names=("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                               "ffn_up", "ffn_down")) -> bool:
    """Whether every layer's weights ``names`` have a GEMM on the model's
    device (else the prefill runs a GEMV per row for them: correct, but no
    faster than decoding the prompt)."""
    target = gemm_target(get_backend(_ops_backend(model)).target)
    return all(_has_gemm(model.file, f"blk.{i}.{n}.weight", target)
               for i in range(model.hp.n_layers) for n in names)


def _ops_backend(model) -> str:
    """The ``ops`` backend name of the model's executor."""
    return "cuda" if model.executor.backend.name == "cuda" else "emu"


def _has_gemm(file, name, target) -> bool:
    """Whether the weight ``name`` of ``file`` (``[rows, K]``) has a GEMM
    built for ``target``; BF16 only where every weight fits f16 (the GEMM
    rounds them to f16, kernels/gemm/wgmma_f16.py)."""
    q, k = file.qtype(name).upper(), int(file.shape(name)[-1])
    return _gemm.supported(q, k, target) and (q != "BF16" or file.in_f16_range(name))


def refusal(model) -> str | None:
    """Why :class:`Prefill` cannot run ``model`` (None when it can)."""
    hp = model.hp
    if hp.qk_norm or hp.qkv_bias:
        return ("the file's q/k norms or q/k/v biases are not in the prefill graph; "
                "its prompt runs through the decode step")
    return None


class Prefill:
    """The prefill launches of one model, with activations for ``chunk`` rows.

    Parameters
    ----------
    model : LlamaModel
    chunk : int
        The most tokens a chunk holds.
    buckets : sequence of int, optional
        Chunk sizes with a launch sequence (and graph) of their own; those
        below ``chunk`` are kept and ``chunk`` is added.  Default
        :data:`BUCKETS`.

    Raises
    ------
    ValueError
        ``chunk < 1``, or the model has a layout the prefill does not take
        (:func:`refusal`).
    """

    def __init__(self, model, chunk: int = DEFAULT_CHUNK, *, buckets=None):
        if chunk < 1:
            raise ValueError(f"prefill chunk must be at least 1, got {chunk}")
        why = refusal(model)
        if why:
            raise ValueError(why + " (use prefill_chunk=0)")
        self.model, self.chunk = model, int(chunk)
        bs = BUCKETS if buckets is None else buckets
        self.buckets = tuple(sorted({int(b) for b in bs if 0 < int(b) < self.chunk})
                             ) + (self.chunk,)
        hp = model.hp
        ex = model.executor
        self._arrays = {b.name: ex.arrays[id(b)] for b in model.graph.buffers
                        if b.kind != "activation"}
        be = self.backend = ex.backend
        self.stream = model._stream
        self.ops_backend = _ops_backend(model)
        self.pdl = bool(model.pdl)
        C, H, D = self.chunk, hp.hidden, hp.head_dim
        self.qkv_dim = hp.q_dim + 2 * hp.kv_dim

        def buf(shape, dtype=np.float32):
            return be.from_numpy(np.zeros(shape, dtype))

        def x_type(*names):
            # f16 where every GEMM reading it takes f16 X (the GEMV fallback reads f32)
            return np.float16 if gemm_ready(model, names) else np.float32
        self.x, self.h = buf((C, H)), buf((C, H), x_type("attn_q", "attn_k", "attn_v",
                                                                  "ffn_gate", "ffn_up"))
        self.qkv = buf((C, self.qkv_dim))
        self.att = buf((C, hp.q_dim), x_type("attn_output"))      # flash_prefill's out
        self.gate, self.up = buf((C, hp.ffn)), buf((C, hp.ffn))
        self.act = buf((C, hp.ffn), x_type("ffn_down"))
        self.tokens = buf((C,), np.int32)
        self.info = buf((2,), np.int32)           # [start, n_tokens]
        # the file's RoPE convention (pairing, frequencies with rope_freqs
        # factors and linear scaling), as the decode step takes it
        self.rope_spec = rope.RopeSpec(head_dim=D, layout=hp.rope_layout, theta=hp.rope_theta,
                                       append="f16", rows=True,
                                       target=get_backend(self.ops_backend).target)
        self.freqs = be.from_numpy(rope.table_of(model.file.rope_inv_freq()))
        self.caches = [tuple(ex.arrays[id(c)].view(np.float16, (hp.n_kv_heads, model.capacity, D))
                             for c in pair) for pair in model.kv_caches]
        self._seq: dict = {}          # bucket -> recorded launches
        self._graphs: dict = {}       # bucket -> captured graph

    # ------------------------------------------------------------ pieces
    def _sources(self, name):
        """The file's tensors behind the weight ``name`` (the stacked QKV
        weight: attn_q, attn_k and attn_v)."""
        if "attn_qkv" not in name:
            return (name,)
        return tuple(name.replace("attn_qkv", n) for n in ("attn_q", "attn_k", "attn_v"))

    def _w(self, name):
        """The weight's device array and its type (the stacked QKV weight has
        the type of attn_q)."""
        src = name.replace("attn_qkv", "attn_q")
        return self._arrays[name], self.model.file.tensor(src)

    def _kw(self):
        return dict(stream=self.stream, backend=self.ops_backend)

    def _n(self):
        """The device int32 ``T`` of the chunk."""
        return self.info.view(offset=4, shape=(1,))

    def _rows(self, a, n):
        """The first ``n`` rows of the 2-D activation ``a``."""
        return a.view(shape=(n, a.shape[1]))

    def _matmul(self, name, x, out, residual=None, rows=None, stride=None):
        """``out = x W^T (+ residual)`` over the rows of ``x``; ``out`` is
        ``[T, rows]``, or with ``stride`` a flat view whose row ``t`` starts
        at element ``t stride``."""
        w, t = self._w(name)
        q = t.qtype.upper()
        rows = out.shape[1] if rows is None else rows
        stride = stride or rows
        w2 = w.view(np.uint8, (rows, w.nbytes // rows))
        if all(_has_gemm(self.model.file, n, gemm_target(get_backend(self.ops_backend).target))
               for n in self._sources(name)):
            ys = dict(y_stride=stride) if stride != rows else {}
            ops.gemm(w2, x, q, out=out, residual=residual, n_tokens=self._n(), pdl=self.pdl,
                     **ys, **self._kw())
            return
        assert x.dtype == np.float32, "the GEMV fallback reads f32 rows"
        for r in range(x.shape[0]):                  # fallback: a GEMV per row
            xr = x.view(offset=4 * r * x.shape[1], shape=(x.shape[1],))
            yr = out.view(offset=4 * r * stride, shape=(rows,))
            ops.gemv(w2, xr, q, out=yr, residual=None if residual is None else yr,
                     **self._kw())

    def _qkv(self, p, h, qkv, B):
        """The QKV rows of layer ``p``: one GEMM over the stacked weight, or
        (q, k, v in different types) one per weight into its column block."""
        if p + "attn_qkv.weight" in self._arrays:
            self._matmul(p + "attn_qkv.weight", h, qkv)
            return
        hp, off = self.model.hp, 0
        for n, rows in (("attn_q", hp.q_dim), ("attn_k", hp.kv_dim), ("attn_v", hp.kv_dim)):
            out = self.qkv.view(offset=4 * off, shape=((B - 1) * self.qkv_dim + rows,))
            self._matmul(p + n + ".weight", h, out, rows=rows, stride=self.qkv_dim)
            off += rows

    def _layer(self, i, B):
        hp, m = self.model.hp, self.model
        p = f"blk.{i}."
        kw = self._kw()
        x, h = self._rows(self.x, B), self._rows(self.h, B)
        qkv, att = self._rows(self.qkv, B), self._rows(self.att, B)
        ops.rmsnorm(x, self._w(p + "attn_norm.weight")[0], hp.eps, out=h, pdl=self.pdl, **kw)
        self._qkv(p, h, qkv, B)
        kc, vc = self.caches[i]
        D = hp.head_dim
        rs = self.rope_spec
        fn = get_backend(self.ops_backend).function(rope.build, rs)
        geo = rope.launch_geometry(rs, hp.n_heads, hp.n_kv_heads)
        get_backend(self.ops_backend).launch_positional(
            fn, (geo.grid[0], B, 1), geo.block, qkv, qkv.view(offset=4 * hp.q_dim), self.freqs,
            self.info, hp.n_heads, hp.n_kv_heads, qkv.view(offset=4 * (hp.q_dim + hp.kv_dim)),
            kc, vc, m.capacity, self.qkv_dim, self._n(), stream=self.stream)
        ops.flash_prefill(qkv, kc, vc, self.info.view(shape=(1,)), self._n(),
                          out=att.view(shape=(B, hp.n_heads, D)), n_q_heads=hp.n_heads,
                          pdl=self.pdl, **kw)
        self._matmul(p + "attn_output.weight", att, x, residual=x)
        ops.rmsnorm(x, self._w(p + "ffn_norm.weight")[0], hp.eps, out=h, pdl=self.pdl, **kw)
        gate, up, act = (self._rows(a, B) for a in (self.gate, self.up, self.act))
        self._matmul(p + "ffn_gate.weight", h, gate)
        self._matmul(p + "ffn_up.weight", h, up)
        ops.swiglu(gate, up, out=act, pdl=self.pdl, **kw)
        self._matmul(p + "ffn_down.weight", act, x, residual=x)

    def _embed(self, B):
        emb, t = self._w("token_embd.weight")
        q = t.qtype.replace("F32", "f32").replace("F16", "f16")
        ops.embedding(emb, q, self.tokens.view(shape=(B,)), out=self._rows(self.x, B),
                      n=self.model.hp.hidden, rows=True, **self._kw())

    def sequence(self, bucket: int) -> list:
        """The launches of a chunk of up to ``bucket`` tokens, recorded once:
        ``(fn, grid, block, args, shared, pdl)`` each."""
        seq = self._seq.get(bucket)
        if seq is None:
            with recording() as seq:
                self._embed(bucket)
                for i in range(self.model.hp.n_layers):
                    self._layer(i, bucket)
            self._seq[bucket] = seq
        return seq

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds ``n`` tokens."""
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"a chunk of {n} tokens exceeds the prefill chunk of {self.chunk}")

    # ------------------------------------------------------------ running
    def _issue(self, seq):
        launch = get_backend(self.ops_backend).launch_positional
        for fn, grid, block, args, shared, pdl in seq:
            launch(fn, grid, block, *args, shared=shared, stream=self.stream, pdl=pdl)

    def run_chunk(self, tokens, start: int, mode: str = "graph"):
        """Run ``tokens`` (at most ``chunk``) at positions ``start ..``:
        one graph replay (``mode="graph"`` on the GPU) or the launches one
        by one."""
        T = len(tokens)
        B = self.bucket(T)
        buf = np.zeros(self.chunk, np.int32)
        buf[:T] = tokens
        self._put(self.tokens, buf)
        self._put(self.info, np.array([start, T], np.int32))
        seq = self.sequence(B)
        be = self.backend
        if mode == "graph" and be.can_capture:
            g = self._graphs.get(B)
            if g is None:
                g = self._graphs[B] = be.capture(self.stream, lambda: self._issue(seq))
            be.replay(g, self.stream)
        else:
            self._issue(seq)

    def _put(self, arr, data):
        """Host -> device copy ordered on the prefill's stream (a chunk's ids
        are not overwritten while the previous chunk still reads them)."""
        if self.backend.name == "cuda":
            arr.view(np.uint8, (data.nbytes,)).copy_from(data.view(np.uint8), stream=self.stream)
        else:
            self.backend.copy_from_host(arr, data)

    def run(self, prompt, mode: str = "graph"):
        """Prefill every prompt token but the last, then set the decode state
        to the last one (position ``n - 1``, attention length ``n``)."""
        prompt = [int(t) for t in prompt]
        n = len(prompt)
        for s in range(0, n - 1, self.chunk):
            self.run_chunk(prompt[s:min(s + self.chunk, n - 1)], s, mode)
        m = self.model
        m.backend.synchronize(self.stream)
        state = decode_state.initial_state(prompt[-1], n)
        state[decode_state.POS] = n - 1
        state[decode_state.KV_LEN] = n
        m.executor.write(m.state, state)
        hist = np.zeros(m.capacity, np.int32)
        hist[:n] = prompt
        m.executor.write(m.history, hist)
        m.backend.synchronize(self.stream)
        return n - 1

