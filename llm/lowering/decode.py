"""The decode step: a model definition lowered for one token of one
sequence, captured once and replayed for every token.

Per-token state (token id, position, KV length, prompt length, the chosen
token and an overflow flag) is an ``int32[8]`` device buffer
(``kernels/decode_state.py``) that every kernel reads; the last launch of
the step advances it, so the same CUDA graph serves every token.  The
``prompt`` buffer holds the tokens to feed by position and ``history`` the
whole sequence (the sampler's penalty window).

The blocks lower to:

- ``embed``: one row-gather launch of the state's token (scaled in it);
- ``norm``: an RMSNorm launch, or nothing where the Q4_K GEMVs that read
  it take it in their prologue (``fuse_norm``: ``"attn"`` by default);
- ``qkv``: one GEMV over the stacked ``[Wq; Wk; Wv]`` that also adds the
  biases (before RoPE, as llama.cpp adds them), rotates q and k and
  appends this token's K/V rows to the f16 caches (one weight type, no q/k
  norms, ``fuse_rope``; for NeoX RoPE the GEMV reads a copy of the stacked
  weight with each q and k head's rows in rotation-pair order); otherwise
  the projections (stacked when the types agree; where only v's type
  differs, q and k stacked with the RMSNorm folded in, that GEMV storing
  the normed row v's GEMV reads), the biases added by the
  GEMV's residual epilogue, then one launch for RoPE + KV append, which
  also applies the q/k RMSNorms where the file has them (``qk_norm``);
- ``attention``: the split-KV flash decode and its combine (a sliding
  window: the kernel of that window);
- ``linear``: a GEMV (its residual epilogue adds the stream);
- ``gated_ffn``: one GEMV computing ``act(Wg h) * (Wu h)`` where gate and
  up share a type (else two GEMVs and a SwiGLU/GeGLU launch), then the
  down GEMV;
- ``add_normed``: one RMSNorm launch adding its output into the stream;
- ``moe_ffn``: the router (which also does the RMSNorm before it and
  writes the normed row), the selected experts' gate/up GEMV and their
  down GEMV, which also adds their weighted sum into the stream
  (:mod:`.moe`): three launches, the experts chosen on the device;
- over several tensor-parallel ranks (:mod:`ptxgen.llm.parallel`): an
  all-reduce after each ``linear`` and the logits shards all-gathered
  before the choice;
- ``output``: the logits GEMV, then the next token's choice in two
  variants of the step, ``"greedy"`` (argmax) and ``"sample"`` (the
  sampler chain reading ``sampling_params``), and the state advance.
"""

from __future__ import annotations

import numpy as np

from ptxgen.kernels import (argmax, decode_state, embedding, flash_decode, rmsnorm, rope,
                            sampling, swiglu)
from ptxgen.driver.collective import Collective
from ptxgen.llm.generation import GREEDY, SAMPLE, SamplingSettings, sampler_spec
from ptxgen.llm.parallel import SINGLE

from . import matmul, moe
from .common import QKV, Lowering, Normed, Tuning

__all__ = ["DecodeLowering", "NORM_KINDS", "norm_kinds"]

NORM_KINDS = ("attn", "ffn", "output")
"""The RMSNorms ``fuse_norm`` can fold into their GEMVs."""


def norm_kinds(fuse_norm) -> tuple:
    """``fuse_norm`` as a sorted tuple of :data:`NORM_KINDS`."""
    if isinstance(fuse_norm, bool):
        return NORM_KINDS if fuse_norm else ()
    kinds = (fuse_norm,) if isinstance(fuse_norm, str) else tuple(fuse_norm)
    bad = [k for k in kinds if k not in NORM_KINDS]
    if bad:
        raise ValueError(f"fuse_norm: unknown RMSNorm {bad[0]!r}; give True, False or "
                         f"some of {', '.join(map(repr, NORM_KINDS))}")
    return tuple(k for k in NORM_KINDS if k in kinds)


class DecodeLowering(Lowering):
    """The blocks of a definition as the launches of one decode step.

    Parameters
    ----------
    file : LlamaFile
    store : Store
        The model's persistent buffers (shared with its chunk graphs).
    target, sm_count : the device's
    capacity : int
        KV-cache positions.
    rope_layout : str
        The architecture's RoPE pairs.
    tuning : Tuning
    fuse_norm : tuple of str
        :data:`NORM_KINDS` folded into GEMVs.
    fuse_rope : bool
        RoPE and the KV append in the stacked Q/K/V GEMV's epilogue where it applies.
    flash_knobs : dict
        FlashDecodeConfig fields replacing the tuned ones.
    tp : TensorParallel
        The rank this graph is of (``file`` its shard: :mod:`ptxgen.llm.parallel`).
    """

    def __init__(self, file, store, *, target, sm_count, capacity, rope_layout,
                 tuning: Tuning, fuse_norm=("attn",), fuse_rope=True, flash_knobs=None,
                 tp=SINGLE):
        super().__init__(file, store, target=target, capacity=capacity, rope_layout=rope_layout,
                         tp=tp)
        g, hp, cap = self.g, self.hp, capacity
        self.sm_count = sm_count
        self.tuning = tuning
        self.fuse_norm = norm_kinds(fuse_norm)
        self.fuse_rope = bool(fuse_rope)
        self.state = g.buffer("state", (decode_state.STATE_WORDS,), np.int32, "state",
                              decode_state.initial_state(0, 1))
        self.prompt = g.buffer("prompt", (cap,), np.int32, "state", np.zeros(cap, np.int32))
        self.history = g.buffer("history", (cap,), np.int32, "state", np.zeros(cap, np.int32))
        self.pos_ptr = self.state.at(4 * decode_state.POS)
        self.kvlen_ptr = self.state.at(4 * decode_state.KV_LEN)
        self.x = g.buffer("x", (hp.hidden,), np.float32)
        # the length is advanced at the end of the step and the launch just
        # before attention (the QKV GEMV, or the RoPE launch) appends row
        # kv_len - 1: early_kv's contract
        D = hp.head_dim
        fd_spec = flash_decode.FlashDecodeSpec(head_dim=D, group=hp.n_heads // hp.n_kv_heads,
                                               kv_dtype="f16", early_kv=True, target=target)
        self.fds = flash_decode.with_overrides(fd_spec, dict(flash_knobs or {}), tuning.device)
        self.n_splits = flash_decode.choose_splits(self.fds, sm_count, hp.n_kv_heads, cap)
        self._rms = rmsnorm.RmsNormSpec(residual=False, target=target)
        self._scratch = {}

    # ------------------------------------------------------------ buffers
    def _act(self, name, shape, dtype=np.float32):
        """An activation buffer made once and reused by every layer."""
        b = self._scratch.get(name)
        if b is None:
            b = self._scratch[name] = self.g.buffer(name, shape, dtype)
        return b

    # ------------------------------------------------------------- blocks
    def embed(self, weight, scale=None):
        hp = self.hp
        emb, et = self.weight(weight)
        self._embedding = (emb, et)
        es = embedding.EmbeddingSpec(qtype=et.qtype, target=self.target,
                                     scaled=scale is not None)
        extra = {} if scale is None else dict(scale=float(scale))
        self.add("Embedding", "embd", [emb, self.state], [self.x],
                 [self.launch("embedding", es, embedding.launch_geometry(es, hp.hidden), table=emb,
                              token_ptr=self.state.at(4 * decode_state.TOKEN), out=self.x,
                              n=hp.hidden, n_vocab=hp.vocab, **extra)])
        return self.x

    def norm(self, x, weight, kind):
        return Normed(x, weight, kind)

    def _input(self, h, tensors):
        """The buffer a GEMV over ``tensors`` reads for the value ``h`` and its
        ``norm`` argument: ``(x, (weight, eps))`` where the pending RMSNorm
        folds into it, else the RMSNorm launched into ``h`` and ``(h, None)``."""
        if not isinstance(h, Normed):
            return h, None
        if h.kind in self.fuse_norm and matmul.can_fuse_norm(*tensors):
            w, _ = self.weight(h.weight)
            return h.x, (w, self.hp.eps)
        out = self._act("h", (self.hp.hidden,))
        self._rmsnorm(h.x, h.weight, out, self.hp.hidden, 1, h.weight.removesuffix(".weight"))
        return out, None

    def _rmsnorm(self, x, weight, out, n, rows, name, accumulate=False):
        w, _ = self.weight(weight)
        spec = self._rms if not accumulate else rmsnorm.RmsNormSpec(accumulate=True,
                                                                    target=self.target)
        ins = [x, w] + ([out] if accumulate else [])
        self.add("RmsNorm", name, ins, [out],
                 [self.launch("rmsnorm", spec, rmsnorm.launch_geometry(spec, rows), x=x, w=w,
                              out=out, n=n, eps=self.hp.eps)])

    def qkv(self, h, w: QKV):
        hp, f, p = self.hp, self.file, w.prefix
        qkv = self._act("qkv", (hp.q_dim + 2 * hp.kv_dim,))
        q, k, v = qkv.at(0), qkv.at(4 * hp.q_dim), qkv.at(4 * (hp.q_dim + hp.kv_dim))
        kc, vc = self.kv_cache(w.layer)
        freqs = self.rope_table(w.local)
        tun = dict(tuning=self.tuning)
        infos = [f.tensor(n) for n in (w.q, w.k, w.v)]
        if self._splits_v(h, infos):
            self._qk_then_v(h, w, qkv)
            return self._rope_kv(w, qkv, freqs, kc, vc)
        x, norm = self._input(h, infos)
        if self._fuses_rope(w, infos):
            neox = self.rope_layout == "neox"
            wb, t = self.stacked_qkv(w, pair_order=neox)
            matmul.gemv_rope(self, p + "attn_qkv", wb, t, x, qkv, freqs, self.pos_ptr, kc,
                             vc, state=self.state, norm=norm, bias=self.qkv_bias(w),
                             rope_layout=self.rope_layout, **tun)
            return q
        bias = self.qkv_bias(w)
        if len({t.qtype for t in infos}) == 1:
            wb, t = self.stacked_qkv(w)
            matmul.gemv(self, p + "attn_qkv", wb, t, x, qkv, residual=bias, norm=norm, **tun)
        else:
            offsets = (0, 4 * hp.q_dim, 4 * (hp.q_dim + hp.kv_dim))
            for name, out, off in zip((w.q, w.k, w.v), (q, k, v), offsets):
                wb, t = self.weight(name)
                matmul.gemv(self, name.removesuffix(".weight"), wb, t, x, out, norm=norm,
                            residual=None if bias is None else bias.at(off), **tun)
        return self._rope_kv(w, qkv, freqs, kc, vc)

    def _splits_v(self, h, infos) -> bool:
        """Whether q and k (one type, the norm foldable) run as one GEMV
        with the pending RMSNorm folded in and v, of another type, after it
        on the normed row that GEMV stores."""
        tq, tk, tv = infos
        return (isinstance(h, Normed) and h.kind in self.fuse_norm and tq.qtype == tk.qtype
                and tv.qtype != tq.qtype and matmul.can_fuse_norm(tq, tk))

    def _qk_then_v(self, h, w: QKV, qkv):
        """The stacked ``[Wq; Wk]`` GEMV with the RMSNorm folded in, storing
        the normed row to ``h`` (``GemvSpec.norm_out``), then v's GEMV on it:
        two launches where a separate RMSNorm and three GEMVs were four."""
        hp, p = self.hp, w.prefix
        nw, _ = self.weight(h.weight)
        hb = self._act("h", (hp.hidden,))
        bias = self.qkv_bias(w)
        wb, t = self.stacked_qkv(w, with_v=False)
        matmul.gemv(self, p + "attn_qk", wb, t, h.x, qkv, residual=bias,
                    norm=(nw, hp.eps, hb), tuning=self.tuning)
        wv, tv = self.weight(w.v)
        off = 4 * (hp.q_dim + hp.kv_dim)
        matmul.gemv(self, w.v.removesuffix(".weight"), wv, tv, hb, qkv.at(off),
                    residual=None if bias is None else bias.at(off), tuning=self.tuning)

    def _rope_kv(self, w: QKV, qkv, freqs, kc, vc):
        """RoPE and the KV append, after the q and k heads' RMSNorms where
        the layer has them (RopeSpec.qk_norm), in place; returns q."""
        hp, p = self.hp, w.prefix
        q, k, v = qkv.at(0), qkv.at(4 * hp.q_dim), qkv.at(4 * (hp.q_dim + hp.kv_dim))
        rs = self._rope_spec(qk_norm=w.q_norm is not None)
        geom = rope.launch_geometry(rs, hp.n_heads, hp.n_kv_heads)
        norms, nargs = self.qk_norm_args(w)
        self.add("RopeKvAppend", p + "rope_kv_append", [qkv, freqs, self.state] + norms,
                 [qkv, kc, vc],
                 [self.launch("rope", rs, geom, q=q, k=k, freqs=freqs,
                              pos_ptr=self.pos_ptr, n_q_heads=hp.n_heads,
                              n_kv_heads=hp.n_kv_heads, v=v, k_cache=kc, v_cache=vc,
                              capacity=self.capacity, **nargs)])
        return q

    def _fuses_rope(self, w: QKV, infos) -> bool:
        return (self.fuse_rope and w.q_norm is None and len({t.qtype for t in infos}) == 1)

    def _rope_spec(self, qk_norm=False):
        hp = self.hp
        return rope.RopeSpec(head_dim=hp.head_dim, layout=self.rope_layout, theta=hp.rope_theta,
                             append="f16", qk_norm=qk_norm, target=self.target)

    def attention(self, layer, q, window=0):
        hp, fds, ns = self.hp, self.fds, self.n_splits
        if window:
            fds = fds.evolve(window=int(window))
        D = hp.head_dim
        kc, vc = self.kv_cache(layer)
        att = self._act("att", (hp.q_dim,))
        part_o = self._act("part_o", (hp.n_heads, ns, D))
        part_ml = self._act("part_ml", (hp.n_heads, ns, 2))
        split, comb = flash_decode.launch_geometry(fds, hp.n_kv_heads, ns)
        q_buf = q.buffer if hasattr(q, "buffer") else q
        self.add("Attention", f"blk.{layer}.attention", [q_buf, kc, vc, self.state], [att],
                 [self.launch("flash_decode", fds, split, q=q, k_cache=kc, v_cache=vc,
                              kv_len_ptr=self.kvlen_ptr, part_o=part_o, part_ml=part_ml,
                              capacity=self.capacity, sm_scale=hp.sm_scale),
                  self.launch("flash_decode", fds, comb, part_o=part_o, part_ml=part_ml,
                              out=att)])
        return att

    def linear(self, a, weight, residual=None):
        # over several ranks: a partial sum (the residual rank 0's alone), all-reduced
        w, t = self.weight(weight)
        y = residual if residual is not None else self._act(f"out{t.shape[0]}", (t.shape[0],))
        name = weight.removesuffix(".weight")
        matmul.gemv(self, name, w, t, a, y,
                    residual=residual if self.tp.adds_residual else None, tuning=self.tuning)
        return self.all_reduce(y, name)

    def gated_ffn(self, h, gate, up, down, residual=None, act="silu"):
        hp = self.hp
        out = self._act("ffn_act", (hp.ffn,))
        wg, tg = self.weight(gate)
        wu, tu = self.weight(up)
        x, norm = self._input(h, [tg, tu])
        p = gate.removesuffix("ffn_gate.weight")
        if tg.qtype == tu.qtype:
            matmul.gemv_swiglu(self, p + "ffn_gate_up", wg, tg, wu, tu, x, out, norm=norm,
                               tuning=self.tuning, act=act)
        else:
            g_out = self.g.buffer(p + "ffn_gate_out", (hp.ffn,), np.float32)
            u_out = self.g.buffer(p + "ffn_up_out", (hp.ffn,), np.float32)
            matmul.gemv(self, p + "ffn_gate", wg, tg, x, g_out, norm=norm, tuning=self.tuning)
            matmul.gemv(self, p + "ffn_up", wu, tu, x, u_out, norm=norm, tuning=self.tuning)
            ss = swiglu.SwiGluSpec(target=self.target, act=act)
            name = p + ("geglu" if act == "gelu_tanh" else "swiglu")
            self.add("SwiGLU", name, [g_out, u_out], [out],
                     [self.launch("swiglu", ss, swiglu.launch_geometry(ss, hp.ffn), g=g_out,
                                  u=u_out, out=out, n=hp.ffn)])
        return self.linear(out, down, residual=residual)

    def add_normed(self, x, y, weight):
        self._rmsnorm(y, weight, x, self.hp.hidden, 1, weight.removesuffix(".weight"),
                      accumulate=True)
        return x

    def moe_ffn(self, h, e: moe.Experts, residual):
        kw = dict(scratch=self._act, tuning=self.tuning)
        if not isinstance(h, Normed):
            return moe.decode_ffn(self, h, e, residual, **kw)
        # the router does the RMSNorm and writes h for the experts
        nw, _ = self.weight(h.weight)
        return moe.decode_ffn(self, h.x, e, residual, **kw,
                              norm=(nw, self.hp.eps, self._act("h", (self.hp.hidden,))))

    def output(self, h, weight):
        g, hp = self.g, self.hp
        self.logits = g.buffer("logits", (hp.vocab,), np.float32, "state")
        w, t = self._embedding if weight == "token_embd.weight" else self.weight(weight)
        x, norm = self._input(h, [t])
        if self.tp.world == 1:
            matmul.gemv(self, "output", w, t, x, self.logits, norm=norm, tuning=self.tuning)
        else:
            # the rank's rows of the logits, gathered into every rank's whole
            shard = g.buffer("logits_shard", (t.shape[0],), np.float32)
            matmul.gemv(self, "output", w, t, x, shard, norm=norm, tuning=self.tuning)
            g.add_collective("AllGather", "logits.all_gather",
                             Collective("all_gather", shard, self.logits))
        self._choose()
        self._advance()

    # ---------------------------------------------------- the next token
    def _choose(self):
        """The argmax ("greedy") or the sampler ("sample"), both writing the
        state's ARGMAX word, which the advance reads."""
        g, hp, tgt = self.g, self.hp, self.target
        g.default_variant = GREEDY
        next_ptr = self.state.at(4 * decode_state.ARGMAX)
        ams = argmax.ArgmaxSpec(target=tgt)
        geom = argmax.launch_geometry(ams, hp.vocab, self.sm_count)
        scratch = g.buffer("argmax_scratch", (geom.grid[0],), np.uint64, "state")
        counter = g.buffer("argmax_counter", (1,), np.uint32, "state", np.zeros(1, np.uint32))
        self.add("Argmax", "argmax", [self.logits], [self.state],
                 [self.launch("argmax", ams, geom, x=self.logits,
                              n=hp.vocab, out=next_ptr, scratch=scratch, counter=counter)],
                 variant=GREEDY)
        self.sampling_params = g.buffer("sampling_params", (sampling.PARAM_WORDS,), np.uint32,
                                        "state", SamplingSettings().params(0))
        sps = sampler_spec(hp.vocab, tgt)
        geom = sampling.launch_geometry(sps, hp.vocab)
        work = g.buffer("sample_work", (hp.vocab,), np.float32)
        sscratch = g.buffer("sample_scratch", (sampling.scratch_words(sps, hp.vocab),),
                            np.uint64)
        scounter = g.buffer("sample_counter", (1,), np.uint32, "state", np.zeros(1, np.uint32))
        self.add("Sample", "sample", [self.logits, self.history, self.state,
                                      self.sampling_params], [self.state],
                 [self.launch("sampling", sps, geom, logits=self.logits,
                              n=hp.vocab, history=self.history, pos=self.pos_ptr,
                              params=self.sampling_params, out=next_ptr, n_draws=1, work=work,
                              info=0, scratch=sscratch, counter=scounter)],
                 variant=SAMPLE)

    def _advance(self):
        ds = decode_state.DecodeStateSpec(target=self.target)
        self.add("StateAdvance", "advance", [self.state, self.prompt],
                 [self.state, self.history],
                 [self.launch("decode_state", ds, decode_state.launch_geometry(ds),
                              state=self.state, prompt=self.prompt, history=self.history,
                              capacity=self.capacity)])
