"""Embedding row gather from F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K
tables (token id on device).

The oracle of a quantized table is gguf's own decoder
(``gguf.quants.dequantize``), of f16/f32 tables numpy's cast; the rows are
compared bit for bit.
"""

import numpy as np
import pytest

from ptxgen.kernels import embedding as E
from ptxgen.kernels import quants


def _table(qtype, n_vocab, n, rng):
    w = rng.standard_normal((n_vocab, n)).astype(np.float32)
    if qtype == "F32":
        return w, w
    if qtype == "F16":
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    raw = quants.quantize(w, qtype)
    gguf = pytest.importorskip("gguf")       # the reference decoder (a test dependency)
    from gguf.quants import dequantize
    deq = dequantize(raw.reshape(n_vocab, -1), gguf.GGMLQuantizationType[qtype.upper()])
    return raw, np.asarray(deq, np.float32).reshape(n_vocab, n)


def _run(run, spec, table, token, n, n_vocab):
    f = run.function(E.build, spec)
    dout = run.poisoned(n)
    raw = np.ascontiguousarray(table).view(np.uint8).reshape(-1)
    run.launch(f, E.launch_geometry(spec, n),
               dict(table=run.array(raw), token_ptr=run.array(np.array([token], np.int32)),
                    out=dout, n=n, n_vocab=n_vocab))
    return run.get(dout)


@pytest.mark.parametrize("qtype,n", [("F32", 37), ("F16", 70), ("Q8_0", 96), ("Q4_K", 512),
                                     ("Q6_K", 256), ("BF16", 70), ("Q4_0", 96), ("Q4_1", 64),
                                     ("Q5_0", 96), ("Q5_1", 160), ("Q5_K", 512)])
def test_embedding(run, qtype, n, rng):
    n_vocab = 5
    table, deq = _table(qtype, n_vocab, n, rng)
    for token in (0, 3):
        out = _run(run, E.EmbeddingSpec(qtype=qtype, block=64), table, token, n, n_vocab)
        # same float32 operations as the reference decoder: exact
        np.testing.assert_array_equal(out, deq[token])


def test_embedding_bad_token_writes_nothing(run, rng):
    table, _ = _table("Q8_0", 4, 64, rng)
    for token in (-1, 4):
        out = _run(run, E.EmbeddingSpec(qtype="Q8_0", block=64), table, token, 64, 4)
        assert np.all(np.isnan(out))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "F16", "BF16", "Q4_0", "Q4_1",
                                   "Q5_0", "Q5_1", "Q5_K"])
def test_embedding_gpu(gpu_run, qtype, rng):
    n_vocab, n = 300, 4096
    table, deq = _table(qtype, n_vocab, n, rng)
    out = _run(gpu_run, E.EmbeddingSpec(qtype=qtype), table, 297, n, n_vocab)
    np.testing.assert_array_equal(out, deq[297])


def test_embedding_refuses():
    with pytest.raises(ValueError):
        E.EmbeddingSpec(qtype="Q3_K")
    with pytest.raises(ValueError):
        E.EmbeddingSpec(qtype="Q5_K").row_bytes(128)
    # GGML's type names, taken in any case
    assert E.EmbeddingSpec(qtype="bf16").qtype == "BF16"
    assert E.EmbeddingSpec(qtype="q5_0").qtype == "Q5_0"
    with pytest.raises(ValueError):
        E.EmbeddingSpec(qtype="Q4_K").row_bytes(100)


def _run_rows(run, spec, table, tokens, n, n_vocab):
    f = run.function(E.build, spec)
    dout = run.poisoned(len(tokens) * n)
    raw = np.ascontiguousarray(table).view(np.uint8).reshape(-1)
    run.launch(f, E.launch_geometry(spec, n, len(tokens)),
               dict(table=run.array(raw), token_ptr=run.array(np.asarray(tokens, np.int32)),
                    out=dout, n=n, n_vocab=n_vocab))
    return run.get(dout).reshape(len(tokens), n)


@pytest.mark.parametrize("qtype,n", [("F32", 37), ("F16", 70), ("Q8_0", 96), ("Q4_K", 256),
                                     ("Q6_K", 256)])
def test_embedding_rows(run, qtype, n, rng):
    """One launch gathers a row per token; an id out of range leaves its
    row untouched (poison)."""
    n_vocab = 6
    table, deq = _table(qtype, n_vocab, n, rng)
    tokens = [int(t) for t in rng.integers(0, n_vocab, 4)] + [n_vocab, -1]
    out = _run_rows(run, E.EmbeddingSpec(qtype=qtype, rows=True, block=64), table, tokens, n,
                    n_vocab)
    for r, t in enumerate(tokens):
        if 0 <= t < n_vocab:
            np.testing.assert_array_equal(out[r], deq[t])
        else:
            assert np.all(np.isnan(out[r])), r


@pytest.mark.parametrize("qtype,n,rows", [("Q6_K", 256, False), ("Q4_K", 512, True),
                                          ("F16", 70, True)])
def test_embedding_scaled(run, qtype, n, rows, rng):
    """``scaled``: the decoded row times ``scale`` (one f32 multiply: exact
    against the decoded row times the f32 scale, rounded once)."""
    n_vocab = 6
    table, deq = _table(qtype, n_vocab, n, rng)
    scale = float(np.float32(np.sqrt(rng.integers(256, 8192))))
    tokens = [int(t) for t in rng.integers(0, n_vocab, 3)]
    spec = E.EmbeddingSpec(qtype=qtype, rows=rows, block=64, scaled=True)
    f = run.function(E.build, spec)
    raw = np.ascontiguousarray(table).view(np.uint8).reshape(-1)
    dout = run.poisoned(len(tokens) * n)
    run.launch(f, E.launch_geometry(spec, n, len(tokens) if rows else 1),
               dict(table=run.array(raw), token_ptr=run.array(np.asarray(tokens, np.int32)),
                    out=dout, n=n, n_vocab=n_vocab, scale=scale))
    out = run.get(dout).reshape(len(tokens), n)
    for r, t in enumerate(tokens[:len(tokens) if rows else 1]):
        np.testing.assert_array_equal(out[r], (deq[t] * np.float32(scale)).astype(np.float32))


def test_embedding_rows_needs_spec():
    with pytest.raises(ValueError, match="rows=True"):
        E.launch_geometry(E.EmbeddingSpec(), 64, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "F16"])
def test_embedding_rows_gpu(gpu_run, qtype, rng):
    n_vocab, n = 300, 4096
    table, deq = _table(qtype, n_vocab, n, rng)
    tokens = [int(t) for t in rng.integers(0, n_vocab, 33)]
    out = _run_rows(gpu_run, E.EmbeddingSpec(qtype=qtype, rows=True), table, tokens, n, n_vocab)
    np.testing.assert_array_equal(out, deq[tokens])
