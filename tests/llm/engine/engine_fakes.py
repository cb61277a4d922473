"""A fake runner for the engine's tests: a deterministic "model" over a
paged pool of token ids, pure Python, fast.

Each step writes the fed tokens into the pool at the slots their block
tables name, then reads the whole sequence back through the table and
chooses the next token as a hash of it (with the seed when sampling).  So
a block-table mistake (a block shared while written, freed while in use,
missing, or out of order) changes what the model sees and thus the tokens,
and the tokens of a request are those :meth:`FakeRunner.reference` computes
for it alone.  It also checks what the scheduler hands it: rows cover
their positions, no two rows of a step write one slot, the penalty history
is the sequence's last ``repeat_last_n`` tokens, and (when given the block
manager) every block written to is referenced by one table only.
"""

from __future__ import annotations

import zlib

import attrs
import numpy as np

from ptxgen.llm.engine.rows import RowOutput


def hash_next(context: np.ndarray, sampling, seed: int, n_vocab: int) -> int:
    """The fake model: the next token after ``context`` (int64 token ids)."""
    h = zlib.crc32(context.tobytes())
    if not sampling.is_greedy:
        h = zlib.crc32(np.int64(seed % (1 << 63)).tobytes(), h)
    return h % n_vocab


class FakeRunner:
    def __init__(self, *, num_blocks=64, block_size=4, max_batch=8, chunk=16,
                 max_blocks_per_seq=None, n_vocab=1000, next_token=hash_next):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_batch = max_batch
        self.chunk = chunk
        self.max_blocks_per_seq = max_blocks_per_seq or num_blocks
        self.n_vocab = n_vocab
        self.next_token = next_token
        self.pool = np.full((num_blocks, block_size), -1, np.int64)
        self.calls: list = []           # ("prefill", n_tokens, first start, n_chunks) or ("decode", n_rows)
        self.blocks = None              # a BlockManager to check writes against
        self.fail_on = None             # a predicate(tokens of a row or chunk) -> raise

    # ---------------------------------------------------------------- pool
    def _slot(self, table, pos):
        b = pos // self.block_size
        assert b < len(table), f"position {pos} beyond a table of {len(table)} blocks"
        assert len(table) <= self.max_blocks_per_seq
        blk = table[b]
        assert 0 <= blk < self.num_blocks, f"block id {blk}"
        return blk, pos % self.block_size

    def _write(self, table, pos, token, written):
        blk, off = self._slot(table, pos)
        assert (blk, off) not in written, f"two writes to block {blk} slot {off} in one step"
        written.add((blk, off))
        if self.blocks is not None:
            assert self.blocks.ref_count(blk) == 1, \
                f"writing block {blk}, referenced {self.blocks.ref_count(blk)} times"
        self.pool[blk, off] = token

    def _read(self, table, n):
        bs = self.block_size
        nb = -(-n // bs)
        assert nb <= len(table)
        ctx = self.pool[list(table[:nb])].reshape(-1)[:n]
        assert (ctx >= 0).all(), "read a slot never written"
        return ctx

    def _choose(self, ctx, item):
        s = item.sampling
        if s.penalties_on:
            n = s.repeat_last_n
            want = tuple(int(t) for t in (ctx[-n:] if n > 0 else ctx))
            assert tuple(item.history) == want, (item.history, want)
        else:
            assert item.history == ()
        tok = int(self.next_token(ctx, s, item.seed, self.n_vocab))
        lp = -float(tok % 13 + 1) / 8.0
        top = tuple(((tok + k) % self.n_vocab, lp - k) for k in range(item.logprobs))
        return RowOutput(token=tok, logprob=lp, top=top)

    # ---------------------------------------------------------------- the runner API
    def decode(self, rows):
        assert 1 <= len(rows) <= self.max_batch, len(rows)
        self.calls.append(("decode", len(rows)))
        if self.fail_on is not None:
            for r in rows:
                if self.fail_on(r):
                    raise RuntimeError(f"fake failure at token {r.token}")
        written = set()
        for r in rows:
            self._write(r.block_table, r.position, r.token, written)
        return [self._choose(self._read(r.block_table, r.position + 1), r) for r in rows]

    def prefill(self, chunks):
        if not isinstance(chunks, (list, tuple)):
            chunks = [chunks]
        n = sum(len(c.tokens) for c in chunks)
        assert 1 <= n <= self.chunk, n
        assert all(c.tokens for c in chunks), "an empty chunk"
        self.calls.append(("prefill", n, chunks[0].start, len(chunks)))
        if self.fail_on is not None and any(self.fail_on(c) for c in chunks):
            raise RuntimeError("fake prefill failure")
        written = set()
        for c in chunks:
            for i, t in enumerate(c.tokens):
                self._write(c.block_table, c.start + i, t, written)
            assert len(c.block_table) == (c.start + len(c.tokens) - 1) // self.block_size + 1
        return None

    # ---------------------------------------------------------------- the oracle
    def reference(self, prompt, n, sampling, seed, stop_ids=(), n_ctx=None):
        """The tokens a request gets alone: ``n`` at most, ending at a stop
        token or when the sequence holds ``n_ctx`` tokens."""
        toks = list(prompt)
        out = []
        while len(out) < n and (n_ctx is None or len(toks) < n_ctx):
            t = int(self.next_token(np.asarray(toks, np.int64), sampling, seed, self.n_vocab))
            toks.append(t)
            out.append(t)
            if t in stop_ids:
                break
        return out


class OverlapFakeRunner(FakeRunner):
    """:class:`FakeRunner` with the split decode step (``launch`` runs the
    step at once, as a device would in stream order; ``collect`` returns
    its tokens), graph buckets ``1, 2, 4, ...`` and a log of the steps
    launched (``("launch", n_rows, followed)``)."""

    def buckets(self, kind):
        out, b = [], 1
        while b < self.max_batch:
            out.append(b)
            b *= 2
        return tuple(out) + (self.max_batch,)

    _ended_rows_ok = False

    def _write(self, table, pos, token, written):
        # a step launched behind another may hold rows of sequences that
        # ended since: they write their freed last block (ref count 0)
        if self._ended_rows_ok and self.blocks is not None:
            blk, _ = self._slot(table, pos)
            if self.blocks.ref_count(blk) == 0:
                blocks, self.blocks = self.blocks, None
                try:
                    return FakeRunner._write(self, table, pos, token, written)
                finally:
                    self.blocks = blocks
        return FakeRunner._write(self, table, pos, token, written)

    def launch(self, rows, follow=None):
        assert not any(r.logprobs or r.sampling.penalties_on for r in rows)
        if follow is not None:
            assert not follow["collected"] and len(follow["out"]) == len(rows)
            rows = [attrs.evolve(r, token=o.token) for r, o in zip(rows, follow["out"])]
        else:
            assert all(r.token >= 0 for r in rows)
        self._ended_rows_ok = follow is not None
        try:
            out = FakeRunner.decode(self, rows)
        finally:
            self._ended_rows_ok = False
        self.calls[-1] = ("launch", len(rows), follow is not None)
        return {"out": out, "collected": False}

    #: collect() raises this many times (a device fault seen at the read-back)
    collect_faults = 0

    def collect(self, handle):
        assert not handle["collected"], "a step collected twice"
        handle["collected"] = True
        if self.collect_faults > 0:
            self.collect_faults -= 1
            raise RuntimeError("fake fault at collect")
        return handle["out"]
