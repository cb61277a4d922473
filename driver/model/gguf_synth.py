"""Write a synthetic Llama-architecture GGUF with random, quantized weights.

The file has the metadata and tensor names llama.cpp uses for
``general.architecture = llama``; weights are Gaussian (std 1/sqrt(fan_in)),
norm weights near 1, quantized with :mod:`ptxgen.kernels.quants` and stored in
GGUF's conventions (a numpy [out, in] weight is a GGUF tensor with
ne = [in, out]), so that ``gguf.GGUFReader`` and ``gguf.quants.dequantize``
read it back. Tensors are generated and written one at a time.

Large tensors (more than ``pool_weights`` weights) are assembled from blocks
drawn at random from a pool of quantized Gaussian blocks of the same format,
row length and scale: every block is a real quantizer output, but a
Llama-3-8B-shaped file takes minutes instead of an hour of quantizing.

``vocab_from`` copies a real vocabulary (the ``tokenizer.*`` metadata of
another GGUF file: tokens, scores, types, merges, pre-tokenizer, special ids
and flags, chat template) into the model, whose vocabulary size becomes the
copy's, so the whole text path runs on it (random weights make gibberish
text).  ``vocab_limit`` keeps only the first ``vocab_limit`` tokens of the
vocabulary, plus every special, byte and single-character token (renumbered
in order, merges and special ids to match): a small real vocabulary for the
CPU emulator, where the logits GEMV and the sampler of a 32,000-token
vocabulary take seconds per step.

CLI::

    python -m ptxgen.driver.model.gguf_synth OUT.gguf --preset tiny|llama3-8b [--qtype Q4_K] [--seed N]
        [--vocab VOCAB.gguf [--vocab-limit N]]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import attrs
import numpy as np

from ptxgen.kernels import quants

__all__ = ["PRESETS", "SynthInfo", "write_synthetic_llama", "vocab_metadata", "main"]

PRESETS: dict[str, dict] = {
    "tiny": dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
                 context_length=2048, rope_theta=10000.0),
    "llama3-8b": dict(n_layers=32, hidden=4096, ffn=14336, n_heads=32, n_kv_heads=8,
                      vocab=128256, context_length=8192, rope_theta=500000.0),
}

#: general.file_type (llama.cpp's LLAMA_FTYPE) of a file whose matrices are all one type
_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
              "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "BF16": 32}
_FLOAT_TYPES = {"F32": (np.float32,), "F16": (np.float16,)}


@attrs.frozen
class SynthInfo:
    """What :func:`write_synthetic_llama` wrote.

    ``tensors`` holds (name, type name, numpy shape [out, in]) in file order.
    """

    path: Path
    seed: int
    n_bytes: int
    seconds: float
    tensors: tuple


def vocab_metadata(path, limit: Optional[int] = None) -> dict:
    """The ``tokenizer.*`` metadata of a GGUF file, optionally cut down.

    Parameters
    ----------
    path : str or os.PathLike
        A GGUF model or vocabulary file with ``tokenizer.ggml.model``.
    limit : int, optional
        Keep the first ``limit`` tokens, every token that is not NORMAL
        (control, user-defined, byte, unknown, unused), the special ids,
        the end-of-turn texts the tokenizer looks up, and the one-character
        tokens (byte-level BPE: all, the byte alphabet; SPM: ``▁`` and
        ASCII); ids are renumbered in order and merges whose parts or
        result are gone are dropped.

    Returns
    -------
    dict
        Key -> value, as :func:`~.gguf_metadata.read_gguf_metadata` gives.
    """
    from .gguf_metadata import read_gguf_metadata
    from . import vocab as V

    meta = read_gguf_metadata(path)
    out = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    if "tokenizer.ggml.model" not in out or "tokenizer.ggml.tokens" not in out:
        raise ValueError(f"{os.fspath(path)}: no tokenizer (tokenizer.ggml.model / .tokens) "
                         "to copy")
    out["general.name"] = meta.get("general.name", "")
    tokens = list(out["tokenizer.ggml.tokens"])
    n = len(tokens)
    if limit is None or limit >= n:
        return out
    if limit < 1:
        raise ValueError(f"vocab_limit must be positive, got {limit}")
    types = np.asarray(out.get("tokenizer.ggml.token_type", np.ones(n, np.int32)))
    id_keys = [k for k in out if k.endswith("_token_id")]
    keep = np.zeros(n, bool)
    keep[:limit] = True
    keep |= types[:n] != V.TOKEN_TYPE.NORMAL
    for k in id_keys:
        if 0 <= int(out[k]) < n:
            keep[int(out[k])] = True
    named = set(V._EOG_TEXTS) | set(V._EOT_TEXTS) | set(V._EOM_TEXTS)
    for texts in V._FIM_TEXTS.values():
        named |= set(texts)
    # byte-level BPE: the byte alphabet; SPM: the space mark and ASCII
    bpe = out["tokenizer.ggml.model"] == "gpt2"
    for i, t in enumerate(tokens):
        if t in named or (len(t) == 1 and (bpe or t == "\u2581" or t.isascii())):
            keep[i] = True
    new_id = np.cumsum(keep) - 1
    kept = [t for t, k in zip(tokens, keep) if k]
    out["tokenizer.ggml.tokens"] = kept
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if key in out:
            out[key] = np.asarray(out[key])[:n][keep]
    for k in id_keys:
        i = int(out[k])
        if 0 <= i < n:
            out[k] = int(new_id[i])
    if "tokenizer.ggml.merges" in out:
        have = set(kept)
        merges = []
        for m in out["tokenizer.ggml.merges"]:
            a, _, b = m.partition(" ")
            if a in have and b in have and a + b in have:
                merges.append(m)
        out["tokenizer.ggml.merges"] = merges
    return out


def _write_vocab(w, meta: dict) -> None:
    """Add the ``tokenizer.*`` keys of :func:`vocab_metadata` to a GGUFWriter."""
    import gguf

    for key, value in meta.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, (bool, np.bool_)):
            w.add_bool(key, bool(value))
        elif isinstance(value, (int, np.integer)):
            w.add_uint32(key, int(value))
        elif isinstance(value, (float, np.floating)):
            w.add_float32(key, float(value))
        elif key == "tokenizer.ggml.token_type":
            w.add_key_value(key, [int(t) for t in value], gguf.GGUFValueType.ARRAY,
                            sub_type=gguf.GGUFValueType.INT32)
        elif key == "tokenizer.ggml.scores":
            w.add_key_value(key, [float(t) for t in value], gguf.GGUFValueType.ARRAY,
                            sub_type=gguf.GGUFValueType.FLOAT32)
        else:
            w.add_array(key, list(value))


def _type_name(t) -> str:
    if isinstance(t, str) and t.upper() in _FLOAT_TYPES:
        return t.upper()
    return quants.qtype_of(t).name


def _tensor_plan(*, n_layers, hidden, ffn, n_heads, n_kv_heads, vocab, head_dim,
                 qtype, output_qtype, embd_qtype, tie_embeddings):
    """(name, type, shape [out, in] or [n], kind) in llama.cpp's file order."""
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    plan = [("token_embd.weight", embd_qtype, (vocab, hidden), "embd")]
    for i in range(n_layers):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", "F32", (hidden,), "norm"),
            (b + "attn_q.weight", qtype, (q_dim, hidden), "w"),
            (b + "attn_k.weight", qtype, (kv_dim, hidden), "w"),
            (b + "attn_v.weight", qtype, (kv_dim, hidden), "w"),
            (b + "attn_output.weight", qtype, (hidden, q_dim), "w"),
            (b + "ffn_norm.weight", "F32", (hidden,), "norm"),
            (b + "ffn_gate.weight", qtype, (ffn, hidden), "w"),
            (b + "ffn_up.weight", qtype, (ffn, hidden), "w"),
            (b + "ffn_down.weight", qtype, (hidden, ffn), "w"),
        ]
    plan.append(("output_norm.weight", "F32", (hidden,), "norm"))
    if not tie_embeddings:
        plan.append(("output.weight", output_qtype, (vocab, hidden), "w"))
    return plan


def _nbytes(tname: str, shape) -> int:
    if tname in _FLOAT_TYPES:
        return int(np.prod(shape)) * np.dtype(_FLOAT_TYPES[tname][0]).itemsize
    return int(np.prod(shape[:-1])) * quants.row_bytes(tname, shape[-1])


class _Generator:
    """Makes each tensor's bytes; keeps block pools for large quantized tensors."""

    def __init__(self, rng: np.random.Generator, pool_weights: int):
        self.rng = rng
        self.pool_weights = pool_weights
        self.pools: dict = {}

    def gaussian(self, shape, std) -> np.ndarray:
        x = self.rng.standard_normal(shape, dtype=np.float32)
        x *= np.float32(std)
        return x

    def tensor(self, tname: str, shape, kind: str) -> np.ndarray:
        if kind == "norm":
            x = 1.0 + 0.05 * self.rng.standard_normal(shape, dtype=np.float32)
            return x.astype(_FLOAT_TYPES[tname][0])
        std = 1.0 / np.sqrt(shape[-1])
        if tname in _FLOAT_TYPES:
            return self.gaussian(shape, std).astype(_FLOAT_TYPES[tname][0])
        q = quants.qtype_of(tname)
        rows, k = shape
        if rows * k <= self.pool_weights:
            return quants.quantize(self.gaussian(shape, std), q)
        key = (q.name, k)
        pool = self.pools.get(key)
        if pool is None:
            n_rows = max(1, self.pool_weights // k)
            raw = quants.quantize(self.gaussian((n_rows, k), std), q)
            # one record per block so that a gather copies whole blocks
            pool = raw.reshape(-1, q.type_size).view(f"V{q.type_size}").ravel()
            self.pools[key] = pool
        idx = self.rng.integers(0, pool.size, size=rows * (k // q.block_size))
        return pool[idx].view(np.uint8).reshape(rows, quants.row_bytes(q, k))


def write_synthetic_llama(
    path, *, n_layers: int, hidden: int, ffn: int, n_heads: int, n_kv_heads: int,
    vocab: Optional[int] = None, context_length: int = 2048, rope_theta: float = 10000.0,
    rms_eps: float = 1e-5, qtype="Q4_K", output_qtype="Q6_K", embd_qtype=None,
    tie_embeddings: bool = False, seed: Optional[int] = None,
    pool_weights: int = 1 << 21, name: str = "synthetic-llama",
    progress: Optional[Callable[[int, int, str], None]] = None,
    type_overrides: Optional[dict] = None, vocab_from=None, vocab_limit: Optional[int] = None,
    chat_template: Optional[str] = None,
) -> SynthInfo:
    """Write a random Llama GGUF to ``path``.

    Parameters
    ----------
    n_layers, hidden, ffn, n_heads, n_kv_heads, vocab : int
        Model shape; head_dim = hidden / n_heads.  ``vocab`` may be left
        out with ``vocab_from`` (it is the copied vocabulary's size).
    context_length, rope_theta, rms_eps
        Written as llama.context_length, llama.rope.freq_base and
        llama.attention.layer_norm_rms_epsilon.
    qtype : str
        Type of the layer weights ("Q4_K", "Q6_K", "Q8_0", "F16", "F32").
    output_qtype, embd_qtype : str
        Types of output.weight and token_embd.weight (embd defaults to ``qtype``).
    tie_embeddings : bool
        Leave out output.weight (readers fall back to token_embd).
    seed : int, optional
        Random seed; drawn from the OS when None (the one used is returned).
    pool_weights : int
        Quantized tensors with more weights than this are assembled from a
        pool of this many quantized weights (see the module docstring).
    progress : callable(done, total, tensor_name), optional
        Called after each tensor is written.
    type_overrides : dict, optional
        Tensor name -> type for tensors that differ from ``qtype`` (real
        Q4_K_M files keep some attn_v / ffn_down weights in Q6_K).
    vocab_from : str or os.PathLike or dict, optional
        A GGUF file whose vocabulary is copied (or :func:`vocab_metadata`'s
        result); without it the file has no tokenizer.
    vocab_limit : int, optional
        Cut the copied vocabulary down (see :func:`vocab_metadata`).
    chat_template : str, optional
        Written as ``tokenizer.chat_template`` (over a copied one).

    Returns
    -------
    SynthInfo
    """
    import gguf

    t0 = time.perf_counter()
    vmeta = None
    if vocab_from is not None:
        vmeta = (dict(vocab_from) if isinstance(vocab_from, dict)
                 else vocab_metadata(vocab_from, vocab_limit))
        n_tok = len(vmeta["tokenizer.ggml.tokens"])
        if vocab is not None and int(vocab) != n_tok:
            raise ValueError(f"vocab={vocab} but the copied vocabulary has {n_tok} tokens")
        vocab = n_tok
        name = f"{name} ({vmeta.get('general.name') or 'copied'} vocabulary)"
    elif vocab is None:
        raise ValueError("give vocab (the vocabulary size) or vocab_from")
    if chat_template is not None:
        vmeta = dict(vmeta or {})
        vmeta["tokenizer.chat_template"] = chat_template
    for k, v in dict(n_layers=n_layers, hidden=hidden, ffn=ffn, n_heads=n_heads,
                     n_kv_heads=n_kv_heads, vocab=vocab, context_length=context_length).items():
        if int(v) <= 0:
            raise ValueError(f"{k} must be positive, got {v}")
    if hidden % n_heads:
        raise ValueError(f"hidden={hidden} is not divisible by n_heads={n_heads}")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    head_dim = hidden // n_heads
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for RoPE")
    qtype, output_qtype = _type_name(qtype), _type_name(output_qtype)
    embd_qtype = qtype if embd_qtype is None else _type_name(embd_qtype)
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    rng = np.random.default_rng(seed)

    plan = _tensor_plan(n_layers=n_layers, hidden=hidden, ffn=ffn, n_heads=n_heads,
                        n_kv_heads=n_kv_heads, vocab=vocab, head_dim=head_dim, qtype=qtype,
                        output_qtype=output_qtype, embd_qtype=embd_qtype,
                        tie_embeddings=tie_embeddings)
    if type_overrides:   # e.g. {"blk.0.attn_v.weight": "Q6_K"}, as Q4_K_M files mix types
        names = {n for n, *_ in plan}
        unknown = sorted(set(type_overrides) - names)
        if unknown:
            raise ValueError(f"type_overrides names unknown tensors: {', '.join(unknown)}")
        plan = [(n, _type_name(type_overrides.get(n, tq)), shape, kind)
                for n, tq, shape, kind in plan]
    for tname_, tq, shape, _ in plan:       # refuse bad row lengths before writing anything
        try:
            _nbytes(tq, shape)
        except ValueError as e:
            raise ValueError(f"{tname_} {shape} cannot be stored as {tq}: {e}") from None

    path = Path(path)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_file_type(_FILE_TYPE[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(vocab)
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_rope_dimension_count(head_dim)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_theta)
    if vmeta:
        _write_vocab(w, vmeta)

    n_bytes = 0
    for tname_, tq, shape, _ in plan:
        nb = _nbytes(tq, shape)
        n_bytes += nb
        if tq in _FLOAT_TYPES:
            w.add_tensor_info(tname_, shape, np.dtype(_FLOAT_TYPES[tq][0]), nb)
        else:
            raw_shape = (shape[0], quants.row_bytes(tq, shape[1]))
            w.add_tensor_info(tname_, raw_shape, np.dtype(np.uint8), nb,
                              raw_dtype=gguf.GGMLQuantizationType[tq])
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        gen = _Generator(rng, int(pool_weights))
        for i, (tname_, tq, shape, kind) in enumerate(plan):
            data = gen.tensor(tq, shape, kind)
            w.write_tensor_data(data)
            del data
            if progress is not None:
                progress(i + 1, len(plan), tname_)
    finally:
        w.close()
    info = tuple((n, t, s) for n, t, s, _ in plan)
    return SynthInfo(path=path, seed=seed, n_bytes=n_bytes,
                     seconds=time.perf_counter() - t0, tensors=info)


def main(argv=None) -> int:
    """Command line: ``python -m ptxgen.driver.model.gguf_synth OUT.gguf --preset tiny``."""
    ap = argparse.ArgumentParser(prog="python -m ptxgen.driver.model.gguf_synth",
                                 description="Write a synthetic Llama GGUF with random quantized weights.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--qtype", default="Q4_K", help="layer weight type (Q4_K, Q6_K, Q8_0, F16, F32)")
    ap.add_argument("--output-qtype", default="Q6_K", help="type of output.weight")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--vocab", metavar="VOCAB.gguf", default=None,
                    help="copy this GGUF file's vocabulary (tokenizer and chat template); the "
                         "model's vocabulary size becomes its")
    ap.add_argument("--vocab-limit", type=int, default=None, metavar="N",
                    help="with --vocab: keep its first N tokens and the special ones")
    ap.add_argument("--chat-template", metavar="FILE", default=None,
                    help="a Jinja chat template to store (tokenizer.chat_template)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    kw = dict(PRESETS[a.preset])
    if a.layers is not None:
        kw["n_layers"] = a.layers
    if a.vocab_limit is not None and a.vocab is None:
        ap.error("--vocab-limit needs --vocab")
    if a.vocab is not None:
        kw.pop("vocab")
        kw.update(vocab_from=a.vocab, vocab_limit=a.vocab_limit)
    if a.chat_template is not None:
        try:
            with open(a.chat_template, encoding="utf-8") as f:
                kw["chat_template"] = f.read()
        except OSError as e:
            print(f"error: --chat-template: {e.strerror}: {a.chat_template}", file=sys.stderr)
            return 2

    def report(done, total, tname):
        if not a.quiet:
            print(f"\r[{done}/{total}] {tname:<28}", end="", file=sys.stderr, flush=True)

    try:
        info = write_synthetic_llama(a.out, qtype=a.qtype, output_qtype=a.output_qtype,
                                     seed=a.seed, progress=report, **kw)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not a.quiet:
        print(file=sys.stderr)
    print(f"wrote {info.path} ({info.n_bytes / 1e6:.1f} MB of tensors, {len(info.tensors)} tensors, "
          f"seed {info.seed}) in {info.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
