"""A decode batch: a model definition lowered for one new token of each of
up to ``rows`` sequences, over a paged KV cache (the batched engine's step).

Row ``r`` of the step is a token of some sequence: its id, position and KV
slot (``block * block_size + offset``, as vLLM's slot mapping), the
sequence's block table and length (its tokens through this one) and its
sampling parameters, all in one int32 device buffer (``batch_io``, laid
out by :class:`BatchIO`) the host rewrites with one copy before each step,
whose ``info`` pair holds the number of rows in use; so one captured CUDA
graph per *bucket* (the row count it is sized for) serves every batch up to
that size.  A step of kind ``"prefill"`` is the same for the rows of the
prompt chunks of one or more sequences (each row attends over its own
sequence up to its own position), and computes no logits: a prompt's
last token is fed by a decode step.

The blocks lower as the chunk lowering's (:mod:`.chunk`) do, except that:

- the weight pass of a decode step is a GEMV per row at ``rows <=
  gemv_rows`` (one row: the single-sequence decode's kernels), with the
  decode step's fusions: the attention RMSNorm in the QKV GEMV's prologue
  (:data:`ROW_FUSE_NORM`), gate and up in one GEMV with the SwiGLU
  (GeGLU), and at one row RoPE and the paged append in the QKV GEMV's
  epilogue (``GemvSpec.paged``; not where the layer has q/k norms); above it,
  each weight the batched GEMV reads (:mod:`ptxgen.kernels.gemv.batched`:
  every weight read once for all the rows) runs through it up to the
  crossover (measured on the device and stored in the user tuning cache,
  else the table's, ``kernels/tuning/gemv_batch.json``; or
  ``batch_gemv_rows``), with the gate and up projections fused with the
  SwiGLU where both do; every other weight, and every weight above the
  crossover, runs as a tensor-core GEMM;
- ``qkv`` rotates q and k at each row's own position and appends k and v
  to the paged pools at each row's slot (:mod:`ptxgen.kernels.rope`,
  ``paged``);
- ``attention`` is the paged decode attention of every row over its own
  sequence (:mod:`ptxgen.kernels.paged_attention`; a sliding window: over
  its last ``window`` keys), at the file's attention scale, written in f16
  where the output projection's GEMM takes f16 X (as the chunk's attention);
  in a step of GEMVs per row its first K/V loads are issued before it waits
  on the launch before (``early_kv``, as the decode step's flash decode;
  heads up to 128);
- ``output`` computes every row's logits, then each row's next token with
  its own sampling settings in one launch of the rows sampler (greedy rows
  included: a temperature of 0 is the argmax, ties to the lowest id), with
  the chosen token's log-probability and the top ``TOP_LOGPROBS`` for the
  rows that ask.  Each row's recent tokens (the penalties' window) are a
  ring of ``history_window`` tokens, token ``p`` at ``p % window``.  The
  bucket of one row of GEMVs has the decode step's two variants: the
  sampler (``"sample"``, the default) and the argmax (``"greedy"``), which
  the runner replays for a greedy row that asks for no log-probabilities.

The KV pools are ``[num_blocks, n_kv_heads, block_size, head_dim]`` f16
per layer (``blk.i.k_pool``, ``blk.i.v_pool``).
"""

from __future__ import annotations

import attrs
import numpy as np

from ptxgen.kernels import argmax, gemv, paged_attention, rope, sampling
from ptxgen.llm.generation import GREEDY, SAMPLE, sampler_spec

from . import matmul
from .chunk import ChunkLowering, _row
from .common import QKV, Normed, Tuning

__all__ = ["BatchLowering", "BatchIO", "TOP_LOGPROBS"]

#: the most top log-probabilities a row can ask for (OpenAI's limit)
TOP_LOGPROBS = 20

#: the RMSNorms a step of GEMVs per row folds into the GEMVs that read them:
#: the single-sequence decode step's default (``Model(fuse_norm=...)``,
#: docs/llm.md "Why these fusions")
ROW_FUSE_NORM = ("attn",)


@attrs.frozen
class BatchIO:
    """Where each per-step input lives in the ``batch_io`` int32 buffer
    (offsets in words) for up to ``rows`` rows and tables ``max_blocks``
    wide."""

    rows: int
    max_blocks: int

    @property
    def fields(self) -> dict:
        """name -> (word offset, words)."""
        R, W = self.rows, self.max_blocks
        sizes = [("tokens", R), ("positions", R), ("slots", R), ("lens", R), ("info", 2),
                 ("tables", R * W), ("params", R * sampling.PARAM_WORDS)]
        out, off = {}, 0
        for name, n in sizes:
            out[name] = (off, n)
            off += n + (-n % 4)          # 16-byte aligned fields
        return out

    @property
    def words(self) -> int:
        off, n = list(self.fields.values())[-1]
        return off + n

    def view(self, host: np.ndarray, name: str) -> np.ndarray:
        """The field ``name`` of the host image ``host`` (int32[words])."""
        off, n = self.fields[name]
        v = host[off:off + n]
        if name == "tables":
            return v.reshape(self.rows, self.max_blocks)
        if name == "params":
            return v.view(np.uint32).reshape(self.rows, sampling.PARAM_WORDS)
        return v


class BatchLowering(ChunkLowering):
    """The blocks of a definition as the launches of one decode-batch step.

    Parameters
    ----------
    file, store, target, rope_layout, device, pdl
        As :class:`~.chunk.ChunkLowering`'s.
    rows : int
        The bucket: the most sequences a step of this graph holds.
    max_batch : int
        The largest bucket (the input arrays' length).
    num_blocks, block_size, max_blocks : int
        The paged pool and the block-table width.
    n_ctx : int
        The most tokens a sequence holds (the sampler's history rows).
    sm_count : int
    gemv_rows : int
        At most this many rows run the weights as one GEMV per row.
    batch_gemv_rows : int, optional
        At most this many rows of a decode step run a weight through the
        batched GEMV (None: the crossover, :func:`ptxgen.kernels.gemv.batch_crossover`;
        0: never).
    """

    def __init__(self, file, store, *, target, rope_layout, kind: str, rows: int,
                 io: BatchIO, num_blocks: int, block_size: int, n_ctx: int, sm_count: int,
                 device=None, pdl=True, gemv_rows: int = 1, batch_gemv_rows: int | None = None):
        if kind not in ("decode", "prefill"):
            raise ValueError(f"a batch step is 'decode' or 'prefill', not {kind!r}")
        self.kind, self.io_layout = kind, io
        self.num_blocks, self.block_size, self.max_blocks = num_blocks, block_size, io.max_blocks
        self.n_ctx, self.sm_count, self.gemv_rows = n_ctx, sm_count, gemv_rows
        self.batch_gemv_rows = batch_gemv_rows
        super().__init__(file, store, target=target, capacity=n_ctx, rope_layout=rope_layout,
                         rows=rows, chunk=io.rows, device=device, pdl=pdl,
                         gemm=rows > gemv_rows)
        if self.row_gemvs:
            self.row_tuning = Tuning(sm_count, {}, device)
        g = self.g
        f = io.fields
        self.positions = self.io.at(4 * f["positions"][0])
        self.slots = self.io.at(4 * f["slots"][0])
        self.tables = self.io.at(4 * f["tables"][0])
        self.lens = self.io.at(4 * f["lens"][0])
        self.params = self.io.at(4 * f["params"][0])
        self.window = min(n_ctx, 1024)
        self.history = g.buffer("batch_history", (io.rows, self.window), np.int32, "state")
        self.next_tokens = g.buffer("batch_next", (io.rows,), np.int32, "state")
        self.logprob = g.buffer("batch_logprob", (io.rows,), np.float32, "state")
        self.top_ids = g.buffer("batch_top_ids", (io.rows, TOP_LOGPROBS), np.int32, "state")
        self.top_logprobs = g.buffer("batch_top_logprobs", (io.rows, TOP_LOGPROBS), np.float32,
                                     "state")

    @property
    def row_gemvs(self) -> bool:
        """Whether this is a decode step that runs its weights as a GEMV per
        row: they take the single-sequence decode step's fusions."""
        return self.kind == "decode" and not self.gemm

    # ------------------------------------------------ a GEMV per row
    def _row_input(self, h, tensors):
        """The rows a per-row GEMV over ``tensors`` reads for ``h`` and its
        ``norm`` argument: ``(x, (weight, eps))`` where the pending RMSNorm
        folds into the GEMVs' prologue (each row's own RMS), else the RMSNorm
        launched and ``(rows, None)``."""
        if isinstance(h, Normed) and h.kind in ROW_FUSE_NORM \
                and matmul.can_fuse_norm(*tensors):
            w, _ = self.weight(h.weight)
            return h.x, (w, self.hp.eps)
        return self._input(h), None

    def _row_qkv(self, h, w: QKV):
        """The stacked Q/K/V GEMV of each row with the attention RMSNorm in
        its prologue; at one row (where the layer has no q/k norms) with the
        biases, RoPE at the row's position and the append at its slot of the
        paged pools in its epilogue (``GemvSpec.paged``), as the decode
        step's; else the biases added by its residual epilogue, then the
        paged RoPE launch."""
        hp, p = self.hp, w.prefix
        infos = [self.file.tensor(n) for n in (w.q, w.k, w.v)]
        x, norm = self._row_input(h, infos)
        bias = self.qkv_bias(w)
        qkv = self.qkv_rows
        kc, vc = self.kv_cache(w.layer)
        freqs = self.rope_table(w.local)
        if self.rows == 1 and w.q_norm is None:
            # one row: row 0 is always in use, so its slot is always a real one
            wb, t = self.stacked_qkv(w, pair_order=self.rope_layout == "neox")
            matmul.gemv_rope(self, p + "attn_qkv", wb, t, x, qkv, freqs, self.positions, kc,
                             vc, state=self.io, norm=norm, bias=bias,
                             rope_layout=self.rope_layout, tuning=self.row_tuning,
                             paged=(self.block_size, self.slots,
                                    self.num_blocks * self.block_size))
            return qkv
        wb, t = self.stacked_qkv(w)
        for r in range(self.rows):
            matmul.gemv(self, f"{p}attn_qkv.row{r}", wb, t, _row(x, r, 4 * hp.hidden),
                        _row(qkv, r, 4 * self.qkv_dim), residual=bias, norm=norm,
                        tuning=self.row_tuning)
        self._rope_launch(w, qkv, kc, vc, freqs)
        return qkv

    def _row_gated_ffn(self, h, gate, up, down, residual, act):
        """``act(Wg h) * (Wu h)`` in one GEMV launch per row (the FFN norm
        folded in where :data:`ROW_FUSE_NORM` names it), then the down GEMV."""
        (wg, tg), (wu, tu) = self.weight(gate), self.weight(up)
        x, norm = self._row_input(h, [tg, tu])
        name = gate.removesuffix("ffn_gate.weight") + "ffn_gate_up"
        ffn, hidden = self.hp.ffn, self.hp.hidden
        for r in range(self.rows):
            matmul.gemv_swiglu(self, f"{name}.row{r}", wg, tg, wu, tu, _row(x, r, 4 * hidden),
                               _row(self.act, r, 4 * ffn), norm=norm, tuning=self.row_tuning,
                               act=act)
        return self.linear(self.act, down, residual=residual)

    def qkv(self, h, w: QKV):
        f = self.file
        if self.row_gemvs and len({f.qtype(n) for n in (w.q, w.k, w.v)}) == 1:
            return self._row_qkv(h, w)
        return super().qkv(h, w)

    # ------------------------------------------------------ batched GEMV
    def _batch_plan(self, qtype: str, m: int, k: int, epilogue: str = "none"):
        """The batched GEMV's plan for a ``[m, k]`` weight of ``qtype`` in
        this step, or None where the step runs it otherwise (a prefill
        step, rows at or below ``gemv_rows`` or above the crossover, a type
        it does not read, x and the ring too large for shared memory)."""
        pdl = self.pdl
        if self.kind != "decode" or self.rows <= max(1, self.gemv_rows) or \
                qtype not in gemv.BATCH_QTYPES or self.rows > gemv.MAX_BATCH:
            return None
        try:
            plan = gemv.batch_plan(qtype, k, epilogue, batch=self.rows, target=self.target,
                                   m=m, sm_count=self.sm_count, pdl=pdl)
        except ValueError:
            return None
        limit = self.batch_gemv_rows
        if limit is None:
            limit = gemv.batch_crossover(plan.spec, m, self.device)
        return plan if self.rows <= limit else None

    def _batched_weight(self, name: str) -> bool:
        f = self.file
        m, k = f.shape(name)
        return self._batch_plan(f.qtype(name).upper(), int(m), int(k)) is not None

    def _f16_x(self, names) -> bool:
        """f16 where every layer's weights ``names`` run as f16-X GEMMs (none
        through the batched GEMV, which reads f32)."""
        return super()._f16_x(names) and not any(
            self._batched_weight(f"blk.{i}.{n}.weight")
            for i in range(self.hp.n_layers) for n in names)

    def _matmul(self, name, x, out, *, residual=None, bias=None, rows=None, stride=None,
                weight=None, info=None):
        """The batched GEMV where :meth:`_batch_plan` gives one (and x is
        f32), else as a chunk's."""
        w, t = (weight, info) if weight is not None else self.weight(name)
        m, k = t.shape
        xb = x.buffer if hasattr(x, "buffer") else x
        epi = "residual" if residual is not None else "bias" if bias is not None else "none"
        plan = None if xb.dtype != np.float32 else self._batch_plan(t.qtype.upper(), m, k, epi)
        if plan is None:
            return super()._matmul(name, x, out, residual=residual, bias=bias, rows=rows,
                                   stride=stride, weight=w, info=t)
        rows = m if rows is None else rows
        args = dict(w=w, x=x, y=out, m=m, n_ptr=self.n_ptr, ys=stride or rows)
        if residual is not None:
            args["r"] = residual
        if bias is not None:
            args["bias"] = bias
        ins = [w, x] + [a for a in (residual, bias) if a is not None]
        self.add("MulMat", name.removesuffix(".weight"), ins, [out],
                 [self.launch("gemv", plan, gemv.launch_geometry(plan, m), **args)])

    def gated_ffn(self, h, gate, up, down, residual=None, act="silu"):
        """``silu(Wg h) * (Wu h)`` in one batched GEMV launch where both
        weights run through it and the activations it writes are f32, else
        as a chunk's; a GEMV per row with the SwiGLU (GeGLU) epilogue where
        the step runs its weights so and the two share a type."""
        f = self.file
        if self.row_gemvs and (f.qtype(gate), f.shape(gate)) == (f.qtype(up), f.shape(up)) \
                and self.act.dtype == np.float32:
            return self._row_gated_ffn(h, gate, up, down, residual, act)
        m, k = f.shape(gate)
        plan = None
        if act == "silu" and (f.qtype(gate), f.shape(gate)) == (f.qtype(up), f.shape(up)) \
                and self.act.dtype == np.float32:
            plan = self._batch_plan(f.qtype(gate).upper(), int(m), int(k), "swiglu")
        x = self._input(h)
        xb = x.buffer if hasattr(x, "buffer") else x
        if plan is None or xb.dtype != np.float32:
            return super().gated_ffn(x, gate, up, down, residual, act=act)
        (wg, _), (wu, _) = self.weight(gate), self.weight(up)
        self.add("MulMatSwiGLU", gate.removesuffix("ffn_gate.weight") + "ffn_gate_up",
                 [wg, wu, x], [self.act],
                 [self.launch("gemv", plan, gemv.launch_geometry(plan, int(m)), w=wg, wu=wu,
                              x=x, y=self.act, m=int(m), n_ptr=self.n_ptr, ys=int(m))])
        return self.linear(self.act, down, residual=residual)

    def _inputs(self, capacity, chunk):
        """The token ids and the ``(start, n_rows)`` pair: fields of ``batch_io``."""
        io = self.io_layout
        self.io = self.g.buffer("batch_io", (io.words,), np.int32, "state")
        f = io.fields
        return self.io.at(4 * f["tokens"][0]), self.io.at(4 * f["info"][0])

    def kv_cache(self, i: int):
        """Layer ``i``'s paged K and V pools."""
        hp, p = self.hp, f"blk.{i}."
        shape = (self.num_blocks, hp.n_kv_heads, self.block_size, hp.head_dim)
        return (self.g.buffer(p + "k_pool", shape, np.float16, "state"),
                self.g.buffer(p + "v_pool", shape, np.float16, "state"))

    def _rope_launch(self, w: QKV, qkv, kc, vc, freqs):
        hp = self.hp
        rs = rope.RopeSpec(head_dim=hp.head_dim, layout=self.rope_layout, theta=hp.rope_theta,
                           append="f16", rows=True, paged=self.block_size,
                           qk_norm=w.q_norm is not None, target=self.target)
        geom = rope.launch_geometry(rs, hp.n_heads, hp.n_kv_heads, self.rows)
        norms, nargs = self.qk_norm_args(w)
        self.add("RopeKvAppend", w.prefix + "rope_kv_append", [qkv, freqs, self.io] + norms,
                 [qkv, kc, vc],
                 [self.launch("rope", rs, geom,
                              q=qkv.at(0), k=qkv.at(4 * hp.q_dim), freqs=freqs,
                              positions=self.positions, n_q_heads=hp.n_heads,
                              n_kv_heads=hp.n_kv_heads, v=qkv.at(4 * (hp.q_dim + hp.kv_dim)),
                              k_pool=kc, v_pool=vc, n_slots=self.num_blocks * self.block_size,
                              row_stride=self.qkv_dim, n_rows_ptr=self.n_ptr, slots=self.slots,
                              **nargs)])

    def attention(self, layer, q, window=0):
        hp = self.hp
        D = hp.head_dim
        kc, vc = self.kv_cache(layer)
        # early_kv: the QKV GEMV (or the RoPE launch) just before writes each
        # row's newest key and q alone; not at heads of 256, whose split
        # already spills without it
        spec = paged_attention.PagedAttentionSpec(
            head_dim=D, group=hp.n_heads // hp.n_kv_heads, block_size=self.block_size,
            out_type="f16" if self.att.dtype == np.float16 else "f32", window=int(window),
            early_kv=self.row_gemvs and D <= 128, target=self.target, pdl=self.pdl)
        plan = paged_attention.plan(spec, device=self.device, batch=self.rows)
        splits = paged_attention.choose_splits(plan, self.sm_count, self.rows, hp.n_kv_heads,
                                               self.max_blocks * self.block_size)
        geos = paged_attention.launch_geometry(plan, self.rows, hp.n_kv_heads, splits)
        out = self.att
        part_o = self._scratch_buf("pa_part_o", (self.rows, hp.n_heads, splits, D))
        part_ml = self._scratch_buf("pa_part_ml", (self.rows, hp.n_heads, splits, 2))
        q_buf = q.buffer if hasattr(q, "buffer") else q
        launches = [self.launch("paged_attention", plan, geos[0], q=q, k_pool=kc, v_pool=vc,
                                block_table=self.tables, seq_lens=self.lens, part_o=part_o,
                                part_ml=part_ml, out=out, q_stride=self.qkv_dim,
                                max_blocks=self.max_blocks, num_blocks=self.num_blocks,
                                sm_scale=hp.sm_scale)]
        if len(geos) > 1:
            launches.append(self.launch("paged_attention", plan, geos[1], part_o=part_o,
                                        part_ml=part_ml, out=out))
        self.add("Attention", f"blk.{layer}.attention", [q_buf, kc, vc, self.io], [out],
                 launches)
        return out

    def _scratch_buf(self, name, shape):
        b = self._extra.get(name)
        if b is None:
            b = self._extra[name] = self.g.buffer(name, shape, np.float32)
        return b

    def output(self, h, weight):
        """Every row's logits, then each row's next token (nothing in a
        prefill step)."""
        if self.kind == "prefill":
            return
        hp, g = self.hp, self.g
        x = self._input(h)
        self.logits = g.buffer("batch_logits", (self.rows, hp.vocab), np.float32)
        self._matmul(weight, x, self.logits)
        sps = attrs.evolve(sampler_spec(hp.vocab, self.target), rows=True,
                           logprobs=TOP_LOGPROBS)
        B = self.rows
        work = g.buffer("sample_work", (B, hp.vocab), np.float32)
        scratch = g.buffer("sample_scratch", (B, sampling.scratch_words(sps, hp.vocab)),
                           np.uint64)
        counter = g.buffer(f"batch_sample_counter{B}", (B,), np.uint32, "state",
                           np.zeros(B, np.uint32))
        variant = None
        if self.row_gemvs and B == 1:
            self._argmax()
            g.default_variant = variant = SAMPLE
        self.add("Sample", "sample", [self.logits, self.history, self.io],
                 [self.next_tokens, self.logprob, self.top_ids, self.top_logprobs],
                 [self.launch("sampling", sps, sampling.launch_geometry(sps, hp.vocab, B),
                              logits=self.logits, n=hp.vocab, history=self.history,
                              window=self.window, history_len=self.lens, pos=self.positions,
                              params=self.params, out=self.next_tokens, n_draws=1, work=work,
                              info=0, scratch=scratch, counter=counter, logprob=self.logprob,
                              top_ids=self.top_ids, top_logprobs=self.top_logprobs)],
                 variant=variant)

    def _argmax(self):
        """The one row's next token as the decode step's greedy variant
        chooses it: the argmax of its logits (ties to the lowest id, as the
        sampler's greedy rows)."""
        g, hp = self.g, self.hp
        ams = argmax.ArgmaxSpec(target=self.target)
        geom = argmax.launch_geometry(ams, hp.vocab, self.sm_count)
        scratch = g.buffer("batch_argmax_scratch", (geom.grid[0],), np.uint64, "state")
        counter = g.buffer("batch_argmax_counter", (1,), np.uint32, "state",
                           np.zeros(1, np.uint32))
        self.add("Argmax", "argmax", [self.logits], [self.next_tokens],
                 [self.launch("argmax", ams, geom, x=self.logits, n=hp.vocab,
                              out=self.next_tokens, scratch=scratch, counter=counter)],
                 variant=GREEDY)


def _plus(ref, nbytes: int):
    """``ref`` (a buffer reference) ``nbytes`` further on."""
    return ref.buffer.at(ref.offset + nbytes)
