"""Decode from a GGUF file: the decode-step graph and greedy generation.

Architectures ``llama`` (and ``mistral``), ``qwen2`` and ``qwen3``, read as
llama.cpp reads them (:mod:`.gguf_loader`: head size, RoPE layout and
frequencies, q/k/v biases, q/k norms, tied output).
:meth:`LlamaModel.from_gguf` validates the file (:mod:`.gguf_loader`),
uploads every tensor in its own format, and builds the decode step as a
:class:`~.executor.ComputeGraph`:

    Embedding -> per layer [RmsNorm, MulMat q|k|v (stacked) + Rope +
    KvAppend, Attention (split + combine), MulMat+Add (o-proj), RmsNorm,
    MulMat gate/up + SwiGLU, MulMat+Add (down)] -> RmsNorm -> MulMat
    (logits) -> Argmax | Sample -> StateAdvance

The next token is chosen by one of two variants of the step (one CUDA graph
each): ``"greedy"`` (the default) launches the argmax, ``"sample"`` the
sampler kernel (penalties, top-k, top-p, min-p, temperature and a seeded
draw, its settings read from the ``sampling_params`` buffer); both write the
token to the same state word.  A greedy step is exactly the launches it was
without a sampler.

The stacked Q/K/V GEMV rotates q and k and appends k and v to the cache in
its epilogue (``fuse_rope``, the default); with ``fuse_rope=False``, when
the three projections differ in type, or for files with q/k/v biases (added
by the GEMV's residual epilogue), q/k norms (one RMSNorm launch each for q
and k) or neox RoPE (qwen2, qwen3), a separate RoPE + KV-append launch
follows the projections (:mod:`.qkv`).  The attention RMSNorm is folded into the Q4_K
Q/K/V GEMV that reads it (``fuse_norm``, default ``("attn",)``: the GEMV
scales by the norm itself, no separate launch); ``fuse_norm=True`` folds the
FFN and output norms too.

Per-token state (token id, position, KV length, prompt length, the chosen
token and an overflow flag) is an ``int32[8]`` device buffer (see
``kernels/decode_state.py``); the last launch of the step advances it, so
the captured CUDA graph is replayed unchanged for every token.  The
``prompt`` buffer holds the tokens to feed by position and ``history`` the
whole sequence (the sampler's penalty window), so a later call can append
tokens to the sequence in the cache and go on from there
(``keep_cache=True``): a chat keeps its earlier turns.
"""

from __future__ import annotations

import math
import sys
import time

import attrs
import numpy as np

from ptxgen.kernels import (argmax, decode_state, embedding, flash_decode, rmsnorm, rope,
                            sampling, swiglu)
from ptxgen.kernels.spec_fields import has_griddepcontrol

from ptxgen.driver.executor import ComputeGraph, Executor, Launch
from ptxgen.llm.generation import (GREEDY, SAMPLE, ContextOverflowError, Decoding, SamplingSettings,
                         sampler_spec)
from ptxgen.llm.gguf.file import GGUFError, LlamaFile
from ptxgen.llm import lowering
from ptxgen.llm import qkv as qkv_mod
from ptxgen.llm.textgen import TextGeneration

__all__ = ["LlamaModel", "GenerateResult", "ContextOverflowError", "SamplingSettings"]

@attrs.frozen
class GenerateResult:
    tokens: list
    #: seconds per decode step (host-observed, after the first warm-up step)
    step_seconds: list
    launches_per_token: int
    mode: str
    #: seconds spent on the prompt (chunked prefill, or the decode steps
    #: over the prompt) and prompt tokens per second
    prompt_seconds: float = float("nan")
    prompt_tokens_per_second: float = float("nan")
    #: the sampler's seed (None for greedy decoding)
    seed: int | None = None

    @property
    def tokens_per_second(self) -> float:
        s = sorted(self.step_seconds)
        return 1.0 / s[len(s) // 2] if s else float("nan")


NORM_KINDS = ("attn", "ffn", "output")
"""The RMSNorms ``LlamaModel(fuse_norm=...)`` can fold into their GEMVs."""


def _norm_kinds(fuse_norm) -> tuple:
    """``fuse_norm`` as a sorted tuple of :data:`NORM_KINDS`."""
    if isinstance(fuse_norm, bool):
        return NORM_KINDS if fuse_norm else ()
    kinds = (fuse_norm,) if isinstance(fuse_norm, str) else tuple(fuse_norm)
    bad = [k for k in kinds if k not in NORM_KINDS]
    if bad:
        raise ValueError(f"fuse_norm: unknown RMSNorm {bad[0]!r}; give True, False or "
                         f"some of {', '.join(map(repr, NORM_KINDS))}")
    return tuple(k for k in NORM_KINDS if k in kinds)


class LlamaModel(TextGeneration):
    """A Llama-architecture model on a backend, decoding one token per step.

    Use :meth:`from_gguf`.  ``capacity`` is the KV-cache length (tokens).
    Token ids in, token ids out: :meth:`generate` and :meth:`decode`; text
    through the file's tokenizer: :meth:`generate_text`, :meth:`stream`,
    :meth:`chat` and :meth:`chat_session` (:mod:`.text`).
    ``pdl`` (default: on for sm_90 and newer) builds and launches every
    kernel with programmatic dependent launch: each kernel starts while the
    one before it drains, issues its first weight loads, and waits
    (``griddepcontrol.wait``) before it reads activations.  ``fuse_norm``
    names the RMSNorms folded into the Q4_K GEMVs that read their output
    instead of launched on their own (see :func:`lowering.can_fuse_norm`):
    any of ``"attn"`` (into the stacked Q/K/V GEMV), ``"ffn"`` (gate/up) and
    ``"output"`` (the logits GEMV); ``True`` for all, ``False`` for none.
    The default, ``("attn",)``, is the fastest measured on an H100 (``make
    bench`` at b3cce2a: 2.045 / 2.216 ms per token at context 128 / 4096,
    against 2.095 / 2.278 with none and 2.122 / 2.290 with all three; the
    fused gate/up kernel is the loser, docs/notes/gemv.md twelfth pass; the output
    norm is level, docs/executor.md).
    ``gemv_knobs`` replaces GemvConfig fields of the Q4_K GEMVs' tuned
    configs (e.g. ``{"rows": 4}``), for tuning; a function ``(m, k,
    epilogue) -> dict`` gives them per GEMV shape; a field a shape cannot
    take is refused with the shape named.  Ring GEMVs take ``per_sm =
    ceil(grid / SMs)`` (:func:`ptxgen.kernels.gemv.tuning.balanced`).
    ``flash_knobs`` replaces FlashDecodeConfig fields of the attention
    kernels' tuned config (e.g. ``{"warps": 4}``, or ``{"mma": False}`` for
    the CUDA-core split); the split is built with ``early_kv`` (the decode
    step keeps its contract), whose tuned config differs from the op's.
    ``fuse_rope`` (default True) gives RoPE and the KV-cache append to the
    stacked Q/K/V GEMV's epilogue instead of a launch of their own.
    """

    def __init__(self, file: LlamaFile, backend, *, capacity: int | None = None,
                 target: str | None = None, progress: bool = True, sm_count: int | None = None,
                 pdl: bool | None = None, fuse_norm=("attn",),
                 gemv_knobs=None, flash_knobs=None, fuse_rope: bool = True,
                 tokenizer=None):
        self.file = file
        #: the text <-> token ids of the file's vocabulary (None if it has none)
        self.tokenizer = tokenizer
        self.hp = file.hparams
        _check_attention_shape(file)
        self.backend = backend
        self.capacity = int(capacity or min(self.hp.context_length, 4096))
        if self.capacity < 2:
            raise ValueError(f"capacity must be at least 2 tokens, got {self.capacity}")
        self.target = target or backend.target
        self.sm_count = sm_count or backend.sm_count
        self.fuse_norm = _norm_kinds(fuse_norm)
        self.fuse_rope = bool(fuse_rope)
        self.flash_knobs = dict(flash_knobs or {})
        self.graph = ComputeGraph()
        self.tuning = lowering.Tuning(self.sm_count, gemv_knobs or {}, backend.device_name)
        self._build()
        # programmatic dependent launch: on by default where the target has it
        self.pdl = has_griddepcontrol(self.target) if pdl is None else bool(pdl)
        if self.pdl:
            enable_pdl(self.graph)
        bar = _ProgressBar(file.weight_bytes, enabled=progress)
        self.executor = Executor(self.graph, backend, progress=bar.update)
        bar.close()
        self._stream = backend.stream()
        self._prompt_host = np.zeros(self.capacity, np.int32)
        # the position of the sequence's last chosen token (not yet in the
        # cache), or None when the cache holds no sequence to continue
        self._pos = None
        #: bumped whenever a new sequence starts (a chat checks its cache is still its own)
        self.sequence_id = 0

    @classmethod
    def from_gguf(cls, path, *, backend="auto", capacity=None, progress=True,
                  tokenizer: bool = True, **kw):
        """Load a Llama GGUF file onto ``backend`` (``"cuda"``, ``"emu"`` or ``"auto"``).

        With ``tokenizer`` (the default) the file's vocabulary, when it has
        one (``tokenizer.ggml.*``), becomes :attr:`tokenizer`; it must have
        as many tokens as the model has logits.
        """
        from ptxgen.driver.backend import get_backend
        f = LlamaFile(path)
        tok = f.tokenizer() if tokenizer else None
        be = get_backend(backend) if isinstance(backend, str) else backend
        return cls(f, be, capacity=capacity, progress=progress, tokenizer=tok, **kw)

    # ------------------------------------------------------------- the graph
    def _weight(self, name):
        t = self.file.tensor(name)
        return self.graph.buffer(name, t.data.shape, t.data.dtype, "weight", t.data), t

    def _build(self):
        g, hp, tgt, cap = self.graph, self.hp, self.target, self.capacity
        H, D = hp.hidden, hp.head_dim
        self.state = g.buffer("state", (decode_state.STATE_WORDS,), np.int32, "state",
                              decode_state.initial_state(0, 1))
        self.prompt = g.buffer("prompt", (cap,), np.int32, "state", np.zeros(cap, np.int32))
        self.history = g.buffer("history", (cap,), np.int32, "state", np.zeros(cap, np.int32))
        token_ptr = self.state.at(4 * decode_state.TOKEN)
        pos_ptr = self.state.at(4 * decode_state.POS)
        kvlen_ptr = self.state.at(4 * decode_state.KV_LEN)

        x = g.buffer("x", (H,), np.float32)
        emb, et = self._weight("token_embd.weight")
        es = embedding.EmbeddingSpec(qtype=et.qtype.replace("F32", "f32").replace("F16", "f16"),
                                     target=tgt)
        g.add("Embedding", "embd", [emb, self.state], [x],
              [Launch("embedding", es, embedding.launch_geometry(es, H),
                      (emb, token_ptr, x, H, hp.vocab))])

        rs = rmsnorm.RmsNormSpec(residual=False, target=tgt)
        # RoPE on q and k, and this token's K/V rows appended to the f16 cache:
        # the QKV GEMV's epilogue, or one launch of its own (qkv.py).  The
        # table holds the file's frequencies (rope_freqs factors and linear
        # scaling included), so one kernel serves every convention
        ropes = rope.RopeSpec(head_dim=D, layout=hp.rope_layout, theta=hp.rope_theta,
                              append="f16", target=tgt)
        freqs = g.buffer("rope_freqs", (D // 2, 2), np.float32, "weight",
                         rope.table_of(self.file.rope_inv_freq()))
        # the length is advanced at the end of the step and the launch just
        # before attention (the QKV GEMV, or the RoPE launch) appends row
        # kv_len - 1: early_kv's contract
        fd_spec = flash_decode.FlashDecodeSpec(head_dim=D, group=hp.n_heads // hp.n_kv_heads,
                                               kv_dtype="f16", early_kv=True, target=tgt)
        fds = flash_decode.with_overrides(fd_spec, self.flash_knobs, self.tuning.device)
        n_splits = flash_decode.choose_splits(fds, self.sm_count, hp.n_kv_heads, cap)
        split_geo, comb_geo = flash_decode.launch_geometry(fds, hp.n_kv_heads, n_splits)
        sm_scale = 1.0 / math.sqrt(D)

        h = g.buffer("h", (H,), np.float32)
        # q, k and v are consecutive slices of one buffer, so one GEMV over
        # the stacked [Wq; Wk; Wv] can write all three when their types agree
        qkv = g.buffer("qkv", (hp.q_dim + 2 * hp.kv_dim,), np.float32)
        # qwen3: q and k after their per-head RMSNorms
        qk_out = (g.buffer("qk_normed", (hp.q_dim + hp.kv_dim,), np.float32)
                  if hp.qk_norm else None)
        att = g.buffer("att", (hp.q_dim,), np.float32)
        part_o = g.buffer("part_o", (hp.n_heads, n_splits, D), np.float32)
        part_ml = g.buffer("part_ml", (hp.n_heads, n_splits, 2), np.float32)
        act = g.buffer("ffn_act", (hp.ffn,), np.float32)
        self.kv_caches = []
        for i in range(hp.n_layers):
            p = f"blk.{i}."
            kc = g.buffer(p + "k_cache", (hp.n_kv_heads, cap, D), np.float16, "state")
            vc = g.buffer(p + "v_cache", (hp.n_kv_heads, cap, D), np.float16, "state")
            self.kv_caches.append((kc, vc))
            qkv_ts = [self.file.tensor(p + n + ".weight") for n in ("attn_q", "attn_k", "attn_v")]
            inp, norm = self._norm_or_fuse(g, rs, x, h, p + "attn_norm", qkv_ts)
            q_att, q_buf = qkv_mod.lower_qkv(self, g, p, inp, norm, qkv, freqs, pos_ptr,
                                             (kc, vc), ropes, qk_out=qk_out)
            attn = [Launch("flash_decode", fds, split_geo,
                           (q_att, kc, vc, kvlen_ptr, part_o, part_ml, cap, sm_scale)),
                    Launch("flash_decode", fds, comb_geo, (part_o, part_ml, att, n_splits))]
            g.add("Attention", p + "attention", [q_buf, kc, vc, self.state], [att], attn)
            w, t = self._weight(p + "attn_output.weight")
            lowering.mul_mat(g, p + "attn_output", w, t, att, x, residual=x, target=tgt, tuning=self.tuning)
            ffn_ts = [self.file.tensor(p + n + ".weight") for n in ("ffn_gate", "ffn_up")]
            inp, norm = self._norm_or_fuse(g, rs, x, h, p + "ffn_norm", ffn_ts)
            self._gate_up(g, p, inp, act, tgt, norm)
            w, t = self._weight(p + "ffn_down.weight")
            lowering.mul_mat(g, p + "ffn_down", w, t, act, x, residual=x, target=tgt, tuning=self.tuning)
        self.logits = g.buffer("logits", (hp.vocab,), np.float32, "state")
        out_name = "output.weight" if self.file.has("output.weight") else "token_embd.weight"
        w, t = (self._weight(out_name) if out_name == "output.weight" else (emb, et))
        inp, norm = self._norm_or_fuse(g, rs, x, h, "output_norm", [t])
        lowering.mul_mat(g, "output", w, t, inp, self.logits, norm=norm, target=tgt, tuning=self.tuning)
        # the next token: the argmax ("greedy") or the sampler ("sample"),
        # both writing the state's ARGMAX word, which StateAdvance reads
        g.default_variant = GREEDY
        next_ptr = self.state.at(4 * decode_state.ARGMAX)
        ams = argmax.ArgmaxSpec(target=tgt)
        geo = argmax.launch_geometry(ams, hp.vocab, self.sm_count)
        scratch = g.buffer("argmax_scratch", (geo.grid[0],), np.uint64, "state")
        counter = g.buffer("argmax_counter", (1,), np.uint32, "state", np.zeros(1, np.uint32))
        g.add("Argmax", "argmax", [self.logits], [self.state],
              [Launch("argmax", ams, geo,
                      (self.logits, hp.vocab, next_ptr, scratch, counter))],
              variant=GREEDY)
        self.sampling_params = g.buffer("sampling_params", (sampling.PARAM_WORDS,), np.uint32,
                                        "state", SamplingSettings().params(0))
        sps = sampler_spec(hp.vocab, tgt)
        geo = sampling.launch_geometry(sps, hp.vocab)
        work = g.buffer("sample_work", (hp.vocab,), np.float32)
        sscratch = g.buffer("sample_scratch", (sampling.scratch_words(sps, hp.vocab),),
                            np.uint64)
        scounter = g.buffer("sample_counter", (1,), np.uint32, "state", np.zeros(1, np.uint32))
        g.add("Sample", "sample", [self.logits, self.history, self.state, self.sampling_params],
              [self.state],
              [Launch("sampling", sps, geo,
                      (self.logits, hp.vocab, self.history, pos_ptr, self.sampling_params,
                       next_ptr, 1, work, 0, sscratch, scounter))],
              variant=SAMPLE)
        ds = decode_state.DecodeStateSpec(target=tgt)
        g.add("StateAdvance", "advance", [self.state, self.prompt], [self.state, self.history],
              [Launch("decode_state", ds, decode_state.launch_geometry(ds),
                      (self.state, self.prompt, self.history, cap))])

    def _norm_or_fuse(self, g, rs, x, h, name, tensors):
        """The input of the GEMVs over ``tensors`` and their ``norm`` argument:
        ``(x, (weight, eps))`` when the RMSNorm ``name`` fuses into them, else
        an RmsNorm op writing ``h`` and ``(h, None)``."""
        kind = name.rsplit(".", 1)[-1].removesuffix("_norm")
        if kind in self.fuse_norm and lowering.can_fuse_norm(*tensors):
            w, _ = self._weight(name + ".weight")
            return x, (w, self.hp.eps)
        self._norm(g, rs, x, name + ".weight", h, self.hp.hidden, self.hp.eps, name)
        return h, None

    def _gate_up(self, g, p, h, act, tgt, norm=None):
        """silu(Wg h) * (Wu h): the fused GEMV when gate and up share a type,
        else two GEMVs and a SwiGLU launch."""
        wg, tg = self._weight(p + "ffn_gate.weight")
        wu, tu = self._weight(p + "ffn_up.weight")
        if tg.qtype == tu.qtype:
            lowering.mul_mat_swiglu(g, p + "ffn_gate_up", wg, tg, wu, tu, h, act,
                                         norm=norm, target=tgt, tuning=self.tuning)
            return
        gate = g.buffer(p + "ffn_gate_out", (self.hp.ffn,), np.float32)
        up = g.buffer(p + "ffn_up_out", (self.hp.ffn,), np.float32)
        lowering.mul_mat(g, p + "ffn_gate", wg, tg, h, gate, norm=norm, target=tgt, tuning=self.tuning)
        lowering.mul_mat(g, p + "ffn_up", wu, tu, h, up, norm=norm, target=tgt, tuning=self.tuning)
        ss = swiglu.SwiGluSpec(target=tgt)
        g.add("SwiGLU", p + "swiglu", [gate, up], [act],
              [Launch("swiglu", ss, swiglu.launch_geometry(ss, self.hp.ffn),
                      (gate, up, act, self.hp.ffn))])

    def _norm(self, g, spec, x, wname, out, n, eps, name):
        w, _ = self._weight(wname)
        g.add("RmsNorm", name, [x, w], [out],
              [Launch("rmsnorm", spec, rmsnorm.launch_geometry(spec, 1), (x, w, out, n, eps))])

    # ----------------------------------------------------------- generation
    def reset(self, prompt):
        """Start a new sequence: the cache is emptied and ``prompt`` (at
        least one token) is what the next steps feed."""
        prompt = self._check_tokens(prompt)
        if not prompt:
            raise ValueError("generate needs at least one prompt token")
        if len(prompt) > self.capacity:
            raise ContextOverflowError(f"prompt of {len(prompt)} tokens exceeds the KV cache "
                                       f"capacity of {self.capacity}")
        ex = self.executor
        ex.write(self.state, decode_state.initial_state(prompt[0], len(prompt)))
        self._prompt_host[:] = 0
        self._prompt_host[:len(prompt)] = prompt
        ex.write(self.prompt, self._prompt_host)
        hist = np.zeros(self.capacity, np.int32)
        hist[0] = prompt[0]
        ex.write(self.history, hist)
        self.backend.synchronize()
        # set once the prompt is fed (an abandoned prompt leaves nothing to continue)
        self._pos = None
        self.sequence_id += 1

    def _check_tokens(self, tokens) -> list:
        tokens = [int(t) for t in tokens]
        bad = [t for t in tokens if not 0 <= t < self.hp.vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.hp.vocab - 1})")
        return tokens

    @property
    def position(self) -> int | None:
        """Where the sequence in the cache stands: the position of its last
        chosen token, the next one a step feeds (the cache holds the ones
        before it); None when there is no sequence to continue."""
        return self._pos

    def _note_position(self, pos: int):
        self._pos = pos

    def _append(self, tokens) -> tuple:
        """Queue ``tokens`` after the sequence in the cache: the next steps
        feed its last chosen token, then these.  Returns ``(start, n_fed)``."""
        tokens = self._check_tokens(tokens)
        p = self._pos
        end = p + len(tokens)
        if end >= self.capacity:
            raise ContextOverflowError(
                f"the sequence holds {p + 1} tokens; {len(tokens)} more would need {end + 1} "
                f"of the KV cache's {self.capacity} positions (and one for the reply)")
        ex = self.executor
        self.backend.synchronize(self._stream)
        st = ex.read(self.state)
        if int(st[decode_state.POS]) != p or st[decode_state.OVERFLOW]:
            raise RuntimeError(f"the decode state (position {int(st[decode_state.POS])}) does "
                               f"not continue the sequence at {p}")
        self._prompt_host[p + 1:end + 1] = tokens
        ex.write(self.prompt, self._prompt_host)
        st[decode_state.PROMPT_LEN] = end + 1
        ex.write(self.state, st)
        self.backend.synchronize()
        return p, len(tokens) + 1

    def _plan(self, token_ids, keep_cache) -> tuple:
        """``(start, n_fed)`` of feeding ``token_ids``: the first position
        fed and the number of steps up to the first new token."""
        if keep_cache and self._pos is not None:
            return self._pos, len(token_ids) + 1
        return 0, len(token_ids)

    def _prepare(self, token_ids, sampling, keep_cache):
        """Set the state for feeding ``token_ids`` and the sampler's
        parameters; returns ``(start, n_fed, variant, seed)``."""
        settings = SamplingSettings() if sampling is None else sampling
        if not isinstance(settings, SamplingSettings):
            raise TypeError(f"sampling must be a SamplingSettings, got {type(sampling).__name__}")
        if keep_cache and self._pos is not None:
            start, n_fed = self._append(token_ids)
        else:
            self.reset(token_ids)
            start, n_fed = 0, len(token_ids)
        seed = None
        if not settings.is_greedy:
            seed = settings.resolved_seed()
            self.executor.write(self.sampling_params, settings.params(seed))
            self.backend.synchronize()
        return start, n_fed, settings.variant, seed

    def decode(self, token_ids, *, sampling: SamplingSettings | None = None,
               keep_cache: bool = False, mode: str = "graph", progress=None,
               prefill_chunk: int | None = None) -> Decoding:
        """Feed ``token_ids`` and iterate over the tokens the model chooses.

        Parameters
        ----------
        token_ids : list of int
            With ``keep_cache`` these follow the sequence already in the
            cache (whose last chosen token is fed first); otherwise they
            start a new one (at least one token).
        sampling : SamplingSettings, optional
            Greedy when None.
        keep_cache : bool
            Continue the cached sequence (a new one if there is none).
        mode : {"graph", "eager"}
        progress : callable(done, total), optional
            Called after each feeding step (synchronizes each step).
        prefill_chunk : int, optional
            A new sequence's prompt but its last token runs through the
            chunked prefill in chunks of this many tokens (0: through the
            decode step; None: :meth:`default_prefill_chunk`).

        Returns
        -------
        Decoding
            An iterator of token ids; it ends when the KV cache is full.
        """
        start, n_fed = self._plan(token_ids, keep_cache)
        if start + n_fed >= self.capacity:
            raise ContextOverflowError(
                f"{start + n_fed} tokens leave no room for a new one in the KV cache's "
                f"{self.capacity} positions")
        start, n_fed, variant, seed = self._prepare(token_ids, sampling, keep_cache)
        done, t_prefill = self._run_prefill(token_ids, start, n_fed, mode, prefill_chunk)
        return Decoding(self, n_fed - done, start + done, variant, mode, seed, progress,
                        prefill_seconds=t_prefill, prefilled=done)

    def step(self, mode: str = "graph", variant: str | None = None):
        """Run one decode step of ``variant`` (default ``"greedy"``): eager
        launches, or one replay of the variant's CUDA graph."""
        v = self.graph.resolve_variant(variant)
        if mode == "graph" and self.backend.can_capture:
            if not self.executor.is_captured(v):
                self.executor.capture(self._stream, v)
            self.executor.replay(self._stream, v)
        else:
            self.executor.run_eager(self._stream, variant=v)

    def generate(self, token_ids, max_new_tokens: int, *, mode: str = "graph",
                 return_logits: bool = False, sampling: SamplingSettings | None = None,
                 keep_cache: bool = False, prefill_chunk: int | None = None):
        """Feed ``token_ids``, then choose ``max_new_tokens`` more (greedy
        unless ``sampling`` says otherwise); no early stop.

        With ``keep_cache`` the tokens continue the sequence in the cache.
        A new sequence's prompt but its last token runs through
        :class:`~.prefill.Prefill` in chunks of ``prefill_chunk`` tokens
        (0: every prompt token through the decode step; None, the default:
        :meth:`default_prefill_chunk`, or 0 with ``return_logits``).
        Returns a :class:`GenerateResult`; ``return_logits`` also returns the
        logits of every step through the decode step (a host copy per step,
        slower)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        start, n_fed = self._plan(token_ids, keep_cache)
        total = start + n_fed + max_new_tokens
        if total > self.capacity:
            raise ContextOverflowError(
                f"{start + n_fed} prompt + {max_new_tokens} new tokens need {total} positions; "
                f"the KV cache holds {self.capacity}")
        start, n_fed, variant, seed = self._prepare(token_ids, sampling, keep_cache)
        times, logits = [], []
        if prefill_chunk is None and return_logits:
            prefill_chunk = 0       # only the decode step gives every prompt step's logits
        done, t_prefill = self._run_prefill(token_ids, start, n_fed, mode, prefill_chunk)
        for _ in range(n_fed - 1 - done + max_new_tokens):
            t0 = time.perf_counter()
            self.step(mode, variant)
            if return_logits:
                logits.append(self.executor.read(self.logits).astype(np.float64))
            else:
                self.backend.synchronize(self._stream)
            times.append(time.perf_counter() - t0)
        state = self.executor.read(self.state)
        if state[decode_state.OVERFLOW]:
            raise ContextOverflowError("the decode step reported a KV-cache overflow")
        self._pos = int(state[decode_state.POS])
        hist = self.executor.read(self.history)[:total]
        n_steps = n_fed - 1 - done            # feeding steps left to the decode step
        prompt_s = t_prefill + sum(times[:n_steps])
        res = GenerateResult(tokens=[int(t) for t in hist[start + n_fed:]],
                             step_seconds=times[1:] if len(times) > 1 else times,
                             launches_per_token=self.graph.launch_count_of(variant),
                             mode=mode if self.backend.can_capture else "eager",
                             prompt_seconds=prompt_s,
                             prompt_tokens_per_second=(n_fed - 1) / prompt_s
                             if prompt_s > 0 else float("nan"), seed=seed)
        return (res, logits) if return_logits else res

    def _run_prefill(self, token_ids, start, n_fed, mode, chunk) -> tuple:
        """Prefill a new sequence's prompt but its last token in chunks of
        ``chunk`` (None: :meth:`default_prefill_chunk`); returns the tokens
        done and the seconds taken (``(0, 0.0)`` where it does not apply:
        a continued sequence, a one-token prompt, chunk 0)."""
        if chunk is None:
            chunk = self.default_prefill_chunk()
        if not chunk or start != 0 or n_fed < 2:
            return 0, 0.0
        from ptxgen.llm.prefill import Prefill
        t0 = time.perf_counter()
        pre = getattr(self, "_prefiller", None)
        if pre is None or pre.chunk != chunk:
            pre = self._prefiller = Prefill(self, chunk)
        done = pre.run(list(token_ids), mode)
        return done, time.perf_counter() - t0

    def default_prefill_chunk(self) -> int:
        """The prompt chunk :meth:`generate` uses by default: 512 on the GPU
        when the model suits the chunked prefill (no q/k norms or biases, a
        GEMM for every layer weight's type), 0 (token by token) otherwise
        and on the emulator."""
        from ptxgen.llm.prefill import DEFAULT_CHUNK, gemm_ready, refusal
        if not self.backend.can_capture or refusal(self) is not None or not gemm_ready(self):
            return 0
        return DEFAULT_CHUNK

    def summary(self) -> str:
        return self.graph.summary()


def enable_pdl(graph: ComputeGraph) -> int:
    """Rebuild every launch of ``graph`` whose spec has a ``pdl`` field with
    ``pdl=True`` (the kernels start while their predecessor drains and wait
    with ``griddepcontrol.wait``).  Returns the number of launches changed.

    Raises
    ------
    ValueError
        A spec's target has no ``griddepcontrol`` (below sm_90).
    """
    n = 0
    for op in graph.ops:
        launches = []
        for L in op.launches:
            s = L.spec
            if getattr(s, "pdl", None) is False:
                # a plan (spec + config) changes its spec's field through evolve
                s = s.evolve(pdl=True) if hasattr(s, "evolve") else attrs.evolve(s, pdl=True)
                L = attrs.evolve(L, spec=s)
                n += 1
            launches.append(L)
        op.launches = tuple(launches)
    return n


def _check_attention_shape(file):
    """Refuse, at load, head shapes no attention kernel takes."""
    hp = file.hparams
    try:
        flash_decode.FlashDecodeSpec(head_dim=hp.head_dim, group=hp.n_heads // hp.n_kv_heads,
                                     kv_dtype="f16")
    except ValueError as e:
        a = hp.arch
        raise GGUFError(f"{file.path}: {hp.n_heads} query heads on {hp.n_kv_heads} KV heads "
                        f"of size {hp.head_dim} (metadata keys '{a}.attention.key_length', "
                        f"'{a}.attention.head_count', '{a}.attention.head_count_kv') have no "
                        f"attention kernel: {e}") from None


class _ProgressBar:
    """A one-line progress bar on stderr while weights upload."""

    def __init__(self, total: int, enabled: bool = True):
        self.total = max(total, 1)
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def update(self, done, total, name):
        if not self.enabled:
            return
        frac = done / max(total, 1)
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\rloading weights [{bar:<30}] {done / 1e9:6.2f}/{total / 1e9:.2f} GB {name[:24]:<24}")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write(f"\rloaded in {time.perf_counter() - self.t0:.1f} s" + " " * 60 + "\n")

