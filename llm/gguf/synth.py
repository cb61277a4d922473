"""Write a synthetic decoder GGUF with random, quantized weights.

The file has the metadata, tensor names and conventions llama.cpp's
converter writes for ``llama`` (Llama 2/3; Llama 3.1+ with
``rope_freqs.weight``; Mistral 7B / Nemo, which are written as ``llama``
with an explicit head size), ``qwen2`` (Qwen2.5: q/k/v biases),
``qwen3`` (per-head q/k norms, explicit head size), ``qwen3moe`` (qwen3's
attention, a router and 3-D expert tensors for the FFN) and ``gemma3`` (q/k
norms, post-attention and post-FFN norms, sliding-window layers, a
Gemma-3-style SentencePiece vocabulary: :func:`gemma3_vocab`), optionally with
llama.cpp's Q4_K_M / Q5_K_M quant mix (:func:`quant_mix`); weights are
Gaussian (std 1/sqrt(fan_in)),
norm weights near 1, quantized with :mod:`ptxgen.kernels.quants` and stored in
GGUF's conventions (a numpy [out, in] weight is a GGUF tensor with
ne = [in, out]), so that ``gguf.GGUFReader`` and ``gguf.quants.dequantize``
read it back. Tensors are generated and written one at a time.

Large tensors (more than ``pool_weights`` weights) are assembled from blocks
drawn at random from a pool of quantized Gaussian blocks of the same format,
row length and scale: every block is a real quantizer output, but a
Llama-3-8B-shaped file takes minutes instead of an hour of quantizing.
Expert tensors (3-D) that large are assembled from whole rows of such a
pool, drawn at random (a Qwen3-30B-A3B-shaped file holds 18 GB of them).

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

    python -m ptxgen.llm.gguf.synth OUT.gguf --preset tiny|llama3-8b|gemma3-4b|qwen3-30b-a3b|... [--arch qwen2]
        [--qtype Q4_K] [--mix Q4_K_M] [--rope-freqs] [--head-dim N] [--tied] [--vocab-size N]
        [--vocab VOCAB.gguf [--vocab-limit N]] [--tokenizer gemma3 [--vocab-pieces SPM.gguf]]
        [--sliding-window N] [--seed N]
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

__all__ = ["PRESETS", "ARCHS", "MIXES", "SynthInfo", "write_synthetic_llama", "quant_mix",
           "llama31_rope_factors", "vocab_metadata", "gemma3_vocab", "GEMMA3_CHAT_TEMPLATE",
           "main"]

#: model shapes (the 8B-class ones as their Hugging Face configs give them)
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=512,
                 context_length=2048, rope_theta=10000.0),
    "llama3-8b": dict(n_layers=32, hidden=4096, ffn=14336, n_heads=32, n_kv_heads=8,
                      vocab=128256, context_length=8192, rope_theta=500000.0),
    "llama3.1-8b": dict(n_layers=32, hidden=4096, ffn=14336, n_heads=32, n_kv_heads=8,
                        vocab=128256, context_length=131072, rope_theta=500000.0,
                        rope_freqs=True),
    "mistral-nemo-12b": dict(arch="mistral", n_layers=40, hidden=5120, ffn=14336, n_heads=32,
                             n_kv_heads=8, head_dim=128, vocab=131072, context_length=1024000,
                             rope_theta=1000000.0),
    "qwen2.5-7b": dict(arch="qwen2", n_layers=28, hidden=3584, ffn=18944, n_heads=28,
                       n_kv_heads=4, vocab=152064, context_length=32768, rope_theta=1000000.0,
                       rms_eps=1e-6),
    "qwen3-8b": dict(arch="qwen3", n_layers=36, hidden=4096, ffn=12288, n_heads=32,
                     n_kv_heads=8, head_dim=128, vocab=151936, context_length=40960,
                     rope_theta=1000000.0, rms_eps=1e-6),
    "gemma3-1b": dict(arch="gemma3", n_layers=26, hidden=1152, ffn=6912, n_heads=4,
                      n_kv_heads=1, head_dim=256, vocab=262144, context_length=32768,
                      rope_theta=1000000.0, rms_eps=1e-6, sliding_window=512,
                      tie_embeddings=True, tokenizer="gemma3"),
    "gemma3-4b": dict(arch="gemma3", n_layers=34, hidden=2560, ffn=10240, n_heads=8,
                      n_kv_heads=4, head_dim=256, vocab=262144, context_length=131072,
                      rope_theta=1000000.0, rms_eps=1e-6, sliding_window=1024,
                      rope_scale_linear=8.0, tie_embeddings=True, tokenizer="gemma3"),
    "tiny-moe": dict(arch="qwen3moe", n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                     head_dim=64, vocab=512, context_length=2048, rope_theta=10000.0,
                     n_expert=8, n_expert_used=2, expert_ffn=256),
    # Qwen3-30B-A3B's config.json (moe_intermediate_size 768, intermediate_size 6144)
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layers=48, hidden=2048, ffn=6144, n_heads=32,
                          n_kv_heads=4, head_dim=128, vocab=151936, context_length=40960,
                          rope_theta=1000000.0, rms_eps=1e-6, n_expert=128, n_expert_used=8,
                          expert_ffn=768),
}

#: --arch -> general.architecture written (llama.cpp's converter writes
#: Mistral 7B and Mistral-Nemo as llama)
ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
         "gemma3": "gemma3", "qwen3moe": "qwen3moe"}
#: quant mixes -> (base type, llama.cpp's LLAMA_FTYPE_MOSTLY_* value)
MIXES = {"Q4_K_M": ("Q4_K", 15), "Q5_K_M": ("Q5_K", 17)}

#: general.file_type (llama.cpp's LLAMA_FTYPE) of a file whose matrices are all one type
_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
              "Q4_K": 14, "Q5_K": 16, "Q6_K": 18, "BF16": 32}
_FLOAT_TYPES = {"F32": (np.float32,), "F16": (np.float16,)}
# llama.cpp's fallback when a row is not whole blocks of the chosen type
# (tensor_type_fallback in llama-quant.cpp)
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


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
    from ptxgen.llm.gguf.metadata import read_gguf_metadata
    from ptxgen.llm.text import vocab as V

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


#: Gemma 3's chat template (its ``tokenizer_config.json``, as its GGUF files carry it)
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n")

#: llama.cpp's token types
_NORMAL, _UNKNOWN, _CONTROL, _USER, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def gemma3_vocab(n_vocab: int, pieces_from=None) -> dict:
    """The ``tokenizer.*`` metadata of a Gemma-3-style SentencePiece
    vocabulary of ``n_vocab`` tokens (at least 640), as Gemma 3's GGUF files
    lay it out: ``<pad> <eos> <bos> <unk>`` at ids 0..3 (control, control,
    control, unknown), user-defined ``<mask>``, ``[@BOS@]`` and
    ``<unused0>``..``<unused98>``, the control turn markers
    ``<start_of_turn>`` (105) and ``<end_of_turn>`` (106), ``"\n"`` (107),
    user-defined runs of 2..31 newlines and of 2..31 ``▁``, runs of tabs,
    the 256 byte tokens ``<0xXX>``; then the normal pieces with their
    scores, highest first: those of ``pieces_from`` (a SentencePiece GGUF
    vocabulary, e.g. llama.cpp's ``ggml-vocab-llama-spm.gguf``) or, without
    one, ``▁`` and every printable ASCII character with and without a
    leading ``▁``; the rest ``<unusedN>`` placeholders (unused).  No space
    prefix, BOS added, Gemma 3's chat template."""
    from ptxgen.llm.gguf.metadata import read_gguf_metadata
    if n_vocab < 640:
        raise ValueError(f"a Gemma 3 vocabulary needs at least 640 tokens, got {n_vocab}")
    toks = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[@BOS@]"]
    types = [_CONTROL, _CONTROL, _CONTROL, _UNKNOWN, _USER, _USER]
    toks += [f"<unused{i}>" for i in range(99)]
    types += [_USER] * 99
    toks += ["<start_of_turn>", "<end_of_turn>", "\n"]
    types += [_CONTROL, _CONTROL, _NORMAL]
    for run in (["\n" * n for n in range(2, 32)], ["\u2581" * n for n in range(2, 32)],
                ["\t" * n for n in range(1, 32)]):
        toks += run
        types += [_USER] * len(run)
    toks += [f"<0x{b:02X}>" for b in range(256)]
    types += [_BYTE] * 256
    scores = [0.0] * len(toks)
    have = set(toks)
    if pieces_from is not None:
        meta = read_gguf_metadata(pieces_from)
        if meta.get("tokenizer.ggml.model") != "llama":
            raise ValueError(f"{os.fspath(pieces_from)}: not a SentencePiece (llama) vocabulary")
        src = list(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                       meta["tokenizer.ggml.token_type"]))
        pieces = [(t, float(sc)) for t, sc, ty in src if int(ty) == _NORMAL]
    else:
        chars = ["\u2581"] + [chr(c) for c in range(33, 127)]
        pieces = [(t, -float(i)) for i, t in
                  enumerate(chars + ["\u2581" + c for c in chars[1:]])]
    for t, sc in pieces:
        if len(toks) >= n_vocab:
            break
        if t not in have:
            have.add(t)
            toks.append(t)
            types.append(_NORMAL)
            scores.append(sc)
    low = min(scores) - 1.0
    n = 99
    while len(toks) < n_vocab:
        toks.append(f"<unused{n}>")
        types.append(_UNUSED)
        scores.append(low)
        n += 1
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": toks,
            "tokenizer.ggml.scores": np.asarray(scores, np.float32),
            "tokenizer.ggml.token_type": np.asarray(types, np.int32),
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
            "tokenizer.ggml.add_space_prefix": False,
            "tokenizer.chat_template": GEMMA3_CHAT_TEMPLATE,
            "general.name": "gemma3-style"}


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


def _tensor_plan(*, arch, n_layers, hidden, ffn, n_heads, n_kv_heads, vocab, head_dim,
                 qtype, output_qtype, embd_qtype, tie_embeddings, rope_freqs, n_expert=0,
                 expert_ffn=0):
    """(name, type, shape [out, in] or [n], kind) in llama.cpp's file order."""
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    plan = []
    if rope_freqs:
        plan.append(("rope_freqs.weight", "F32", (head_dim // 2,), "rope_freqs"))
    plan.append(("token_embd.weight", embd_qtype, (vocab, hidden), "embd"))
    for i in range(n_layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", "F32", (hidden,), "norm")]
        for name, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
            plan.append((b + name + ".weight", qtype, (rows, hidden), "w"))
            if arch == "qwen2":
                plan.append((b + name + ".bias", "F32", (rows,), "bias"))
        if arch in ("qwen3", "gemma3", "qwen3moe"):
            plan += [(b + "attn_k_norm.weight", "F32", (head_dim,), "norm"),
                     (b + "attn_q_norm.weight", "F32", (head_dim,), "norm")]
        plan += [(b + "attn_output.weight", qtype, (hidden, q_dim), "w"),
                 (b + "ffn_norm.weight", "F32", (hidden,), "norm")]
        if n_expert:
            # the router stays F32 (llama.cpp's converter and quantizer keep it so)
            E, F = n_expert, expert_ffn
            plan += [(b + "ffn_gate_inp.weight", "F32", (E, hidden), "w"),
                     (b + "ffn_gate_exps.weight", qtype, (E, F, hidden), "w"),
                     (b + "ffn_down_exps.weight", qtype, (E, hidden, F), "w"),
                     (b + "ffn_up_exps.weight", qtype, (E, F, hidden), "w")]
            continue
        plan += [
            (b + "ffn_gate.weight", qtype, (ffn, hidden), "w"),
            (b + "ffn_up.weight", qtype, (ffn, hidden), "w"),
            (b + "ffn_down.weight", qtype, (hidden, ffn), "w"),
        ]
        if arch == "gemma3":
            plan += [(b + "post_attention_norm.weight", "F32", (hidden,), "norm"),
                     (b + "post_ffw_norm.weight", "F32", (hidden,), "norm")]
    plan.append(("output_norm.weight", "F32", (hidden,), "norm"))
    if not tie_embeddings:
        plan.append(("output.weight", output_qtype, (vocab, hidden), "w"))
    return plan


def _use_more_bits(i: int, n: int) -> bool:
    # llama-quant.cpp: the first and last eighth of the layers, and every
    # third layer between them, get more bits
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quant_mix(mix: str, names_shapes, n_layers: int, tied: bool) -> dict:
    """Tensor name -> type under llama.cpp's ``mix`` ("Q4_K_M" or "Q5_K_M",
    ``llama_tensor_get_type`` in llama-quant.cpp for a dense model):

    - ``output.weight``, or ``token_embd.weight`` when it is tied: Q6_K
      (Q8_0 when its rows are not whole 256-weight blocks);
    - ``attn_v`` and ``ffn_down`` (``ffn_down_exps`` too) of the layers
      :func:`_use_more_bits` picks (the first and last eighth, and every
      third layer from the first eighth on): Q6_K;
    - a mixture of experts' router (``ffn_gate_inp``): F32, never quantized;
    - every other matrix: the base type (Q4_K, Q5_K);
    - a row that is not whole blocks of the chosen type falls back as
      llama.cpp does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then F16);
    - vectors (norms, biases, rope_freqs) stay F32.

    ``names_shapes``: (name, shape [out, in], [experts, out, in] or [n]) pairs.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown quant mix {mix!r}; known: {', '.join(MIXES)}")
    base = MIXES[mix][0]
    out = {}
    for name, shape in names_shapes:
        short = name.split(".")[-2] if name.startswith("blk.") else ""
        if len(shape) < 2 or short == "ffn_gate_inp":
            out[name] = "F32"
            continue
        cols = shape[-1]
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            t = "Q6_K" if cols % 256 == 0 else "Q8_0"
        elif short in ("attn_v", "ffn_down", "ffn_down_exps") and _use_more_bits(layer, n_layers):
            t = "Q6_K"
        else:
            t = base
        bs = quants.qtype_of(t).block_size
        if cols % bs:
            t = _FALLBACK.get(t, t)
            if cols % quants.qtype_of(t).block_size:
                t = "F16"
        out[name] = t
    return out


def llama31_rope_factors(head_dim: int, theta: float, factor: float = 8.0,
                         low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                         original_context: int = 8192) -> np.ndarray:
    """The f32 ``rope_freqs.weight`` a Llama 3.1 converter writes: per
    frequency, the divisor that Llama 3's rope scaling applies (1 for short
    wavelengths, ``factor`` for long ones, a smooth blend between)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    lo_wl = original_context / low_freq_factor
    hi_wl = original_context / high_freq_factor
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < hi_wl, 1.0, np.where(wavelen > lo_wl, factor, blended))
    return out.astype(np.float32)


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
        if kind == "bias":
            # Qwen2's projection biases are of the order of the projections
            return (0.5 * self.rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        std = 1.0 / np.sqrt(shape[-1])
        if tname in _FLOAT_TYPES:
            return self.gaussian(shape, std).astype(_FLOAT_TYPES[tname][0])
        q = quants.qtype_of(tname)
        k = shape[-1]
        rows = int(np.prod(shape[:-1]))
        if rows * k <= self.pool_weights:
            return quants.quantize(self.gaussian((rows, k), std), q)
        key = (q.name, k)
        pool = self.pools.get(key)
        if pool is None:
            n_rows = max(1, self.pool_weights // k)
            raw = quants.quantize(self.gaussian((n_rows, k), std), q)
            # one record per block so that a gather copies whole blocks
            pool = raw.reshape(-1, q.type_size).view(f"V{q.type_size}").ravel()
            self.pools[key] = pool
        rb = quants.row_bytes(q, k)
        if len(shape) == 3:
            # experts: whole pool rows drawn at random (a gather of rows, not blocks)
            prow = pool.view(np.uint8).reshape(-1, rb)
            return prow[self.rng.integers(0, prow.shape[0], size=rows)]
        idx = self.rng.integers(0, pool.size, size=rows * (k // q.block_size))
        return pool[idx].view(np.uint8).reshape(rows, rb)


def write_synthetic_llama(
    path, *, n_layers: int, hidden: int, ffn: int, n_heads: int, n_kv_heads: int,
    vocab: Optional[int] = None, context_length: int = 2048, rope_theta: float = 10000.0,
    rms_eps: float = 1e-5, qtype="Q4_K", output_qtype="Q6_K", embd_qtype=None,
    tie_embeddings: bool = False, seed: Optional[int] = None,
    pool_weights: int = 1 << 21, name: str = "synthetic-llama",
    progress: Optional[Callable[[int, int, str], None]] = None,
    type_overrides: Optional[dict] = None, arch: str = "llama",
    head_dim: Optional[int] = None, rope_freqs=None, mix: Optional[str] = None,
    tokenizer: str = "none", alignment: Optional[int] = None,
    vocab_from=None, vocab_limit: Optional[int] = None, chat_template: Optional[str] = None,
    sliding_window: Optional[int] = None, swa_pattern=None, rope_theta_swa: Optional[float] = None,
    rope_scale_linear: Optional[float] = None, vocab_pieces=None,
    n_expert: int = 0, n_expert_used: int = 0, expert_ffn: Optional[int] = None,
) -> SynthInfo:
    """Write a random decoder GGUF to ``path``.

    Parameters
    ----------
    n_layers, hidden, ffn, n_heads, n_kv_heads, vocab : int
        Model shape; ``vocab`` is the embedding's (and output's) rows, and
        may be left out with ``vocab_from`` (the copied vocabulary's size).
    context_length, rope_theta, rms_eps
        Written as {arch}.context_length, rope.freq_base and
        attention.layer_norm_rms_epsilon.
    qtype : str
        Type of the layer weights ("Q4_K", "Q6_K", "Q8_0", "F16", "F32", ...).
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
        Tensor name -> type for tensors that differ from ``qtype`` (applied
        after ``mix``; real Q4_K_M files keep some attn_v / ffn_down weights
        in Q6_K).
    arch : {"llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3moe"}
        The conventions (:data:`ARCHS`): qwen2 adds f32 attn_q/k/v biases,
        qwen3 per-head attn_q_norm/attn_k_norm weights and always writes
        the head size; gemma3 those and ``post_attention_norm`` /
        ``post_ffw_norm`` (norm weights near 1: the converter stores
        Gemma's ``1 + w``); mistral is written as llama; qwen3moe is qwen3
        with a mixture of experts for every FFN (needs ``n_expert``).
    head_dim : int, optional
        Head size, written as attention.key_length/value_length (default
        ``hidden / n_heads``; q has ``n_heads * head_dim`` rows).
    rope_freqs : bool or array, optional
        Write ``rope_freqs.weight`` (llama only): True for Llama 3.1's
        factors (:func:`llama31_rope_factors`), or ``head_dim / 2`` factors.
    mix : {"Q4_K_M", "Q5_K_M"}, optional
        llama.cpp's quant mix (:func:`quant_mix`); replaces ``qtype``,
        ``output_qtype`` and ``embd_qtype``.
    tokenizer : {"none", "llama", "gemma3"}
        tokenizer.ggml.model; "llama" also writes a token list of ``vocab``
        entries (<unk>, <s>, </s>, the 256 byte tokens, then placeholders),
        their scores and types; "gemma3" a Gemma-3-style SentencePiece
        vocabulary of ``vocab`` tokens and Gemma 3's chat template
        (:func:`gemma3_vocab`, its pieces from ``vocab_pieces``).
    alignment : int, optional
        general.alignment (a power of two; GGUF's default is 32).
    vocab_from : str or os.PathLike or dict, optional
        A GGUF file whose vocabulary is copied (or :func:`vocab_metadata`'s
        result), over ``tokenizer``.
    vocab_limit : int, optional
        Cut the copied vocabulary down (see :func:`vocab_metadata`).
    chat_template : str, optional
        Written as ``tokenizer.chat_template`` (over a copied one).
    sliding_window : int, optional
        gemma3: ``attention.sliding_window`` (local layers' keys; absent:
        every layer global).
    swa_pattern : int or sequence of bool, optional
        gemma3: ``attention.sliding_window_pattern`` (absent: llama.cpp's
        period of 6).
    rope_theta_swa : float, optional
        gemma3: ``rope.freq_base_swa``, the local layers' RoPE base.
    rope_scale_linear : float, optional
        ``rope.scaling.type`` linear with this ``rope.scaling.factor``.
    vocab_pieces : str or os.PathLike, optional
        With ``tokenizer="gemma3"``: the SentencePiece vocabulary whose
        pieces it takes (:func:`gemma3_vocab`).
    n_expert, n_expert_used, expert_ffn : int
        qwen3moe: experts per layer, experts run per token, an expert's FFN
        size (``expert_count``, ``expert_used_count``,
        ``expert_feed_forward_length``; the default ``ffn / n_expert_used``);
        each layer gets an F32 router ``ffn_gate_inp`` ``[n_expert, hidden]``
        and ``ffn_gate_exps``/``ffn_up_exps`` ``[n_expert, F, hidden]``,
        ``ffn_down_exps`` ``[n_expert, hidden, F]`` in place of the dense FFN.

    Returns
    -------
    SynthInfo
    """
    import gguf

    t0 = time.perf_counter()
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
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
    elif tokenizer == "gemma3":
        vmeta = gemma3_vocab(int(vocab), vocab_pieces)
    if chat_template is not None:
        vmeta = dict(vmeta or {})
        vmeta["tokenizer.chat_template"] = chat_template
    for k, v in dict(n_layers=n_layers, hidden=hidden, ffn=ffn, n_heads=n_heads,
                     n_kv_heads=n_kv_heads, vocab=vocab, context_length=context_length).items():
        if int(v) <= 0:
            raise ValueError(f"{k} must be positive, got {v}")
    if head_dim is None:
        if hidden % n_heads:
            raise ValueError(f"hidden={hidden} is not divisible by n_heads={n_heads}")
        head_dim = hidden // n_heads
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    if head_dim % 2 or head_dim <= 0:
        raise ValueError(f"head_dim={head_dim} must be even for RoPE")
    if arch == "qwen2" and n_heads * head_dim != hidden:
        raise ValueError(f"qwen2 needs n_heads * head_dim == hidden, got {n_heads} x {head_dim}")
    if rope_freqs is not None and rope_freqs is not False and arch not in ("llama", "mistral"):
        raise ValueError(f"rope_freqs is a llama convention; {arch} applies no frequency factors")
    if tokenizer not in ("none", "llama", "gemma3"):
        raise ValueError(f"tokenizer must be 'none', 'llama' or 'gemma3', got {tokenizer!r}")
    gemma_keys = dict(sliding_window=sliding_window, swa_pattern=swa_pattern,
                      rope_theta_swa=rope_theta_swa)
    given = [k for k, v in gemma_keys.items() if v is not None]
    if given and arch != "gemma3":
        raise ValueError(f"{given[0]} is a gemma3 convention, not {arch}'s")
    if (arch == "qwen3moe") != bool(n_expert):
        raise ValueError("n_expert (experts per layer) is for arch='qwen3moe', which needs it; "
                         f"got arch={arch!r}, n_expert={n_expert}")
    if n_expert:
        if not 1 <= n_expert_used <= n_expert:
            raise ValueError(f"n_expert_used must be 1..{n_expert}, got {n_expert_used}")
        expert_ffn = int(expert_ffn or ffn // n_expert_used)
        if expert_ffn <= 0:
            raise ValueError(f"expert_ffn must be positive, got {expert_ffn}")
    if tokenizer == "llama" and vocab < 259:
        raise ValueError(f"a llama token list needs at least 259 tokens, vocab={vocab}")
    factors = None
    if rope_freqs is True:
        factors = llama31_rope_factors(head_dim, rope_theta)
    elif rope_freqs is not None and rope_freqs is not False:
        factors = np.asarray(rope_freqs, dtype=np.float32)
        if factors.shape != (head_dim // 2,):
            raise ValueError(f"rope_freqs needs {head_dim // 2} factors, got shape {factors.shape}")
    if mix is not None:
        if mix not in MIXES:
            raise ValueError(f"unknown quant mix {mix!r}; known: {', '.join(MIXES)}")
        qtype = output_qtype = MIXES[mix][0]
        embd_qtype = None
    qtype, output_qtype = _type_name(qtype), _type_name(output_qtype)
    embd_qtype = qtype if embd_qtype is None else _type_name(embd_qtype)
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    rng = np.random.default_rng(seed)

    plan = _tensor_plan(arch=arch, n_layers=n_layers, hidden=hidden, ffn=ffn, n_heads=n_heads,
                        n_kv_heads=n_kv_heads, vocab=vocab, head_dim=head_dim, qtype=qtype,
                        output_qtype=output_qtype, embd_qtype=embd_qtype,
                        tie_embeddings=tie_embeddings, rope_freqs=factors is not None,
                        n_expert=n_expert, expert_ffn=expert_ffn)
    if mix is not None:
        types = quant_mix(mix, [(n, shape) for n, _, shape, _ in plan], n_layers, tie_embeddings)
        plan = [(n, types[n], shape, kind) for n, _, shape, kind in plan]
    if type_overrides:   # e.g. {"blk.0.attn_v.weight": "Q6_K"}
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
    w = gguf.GGUFWriter(path, ARCHS[arch])
    if alignment is not None:
        w.add_custom_alignment(int(alignment))
    w.add_name(name)
    w.add_file_type(MIXES[mix][1] if mix else _FILE_TYPE.get(qtype, 0))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(vocab)
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_rope_dimension_count(head_dim)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(expert_ffn)
    if arch in ("qwen3", "gemma3", "qwen3moe") or head_dim != hidden // n_heads \
            or hidden % n_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_theta)
    if rope_scale_linear is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope_scale_linear))
    if sliding_window is not None:
        w.add_sliding_window(int(sliding_window))
    if swa_pattern is not None:
        w.add_sliding_window_pattern(swa_pattern if isinstance(swa_pattern, int)
                                     else [bool(b) for b in swa_pattern])
    if rope_theta_swa is not None:
        w.add_rope_freq_base_swa(float(rope_theta_swa))
    if vmeta:
        _write_vocab(w, vmeta)
    else:
        w.add_tokenizer_model(tokenizer)
        if tokenizer == "llama":
            toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
            toks += [f"tok{i}" for i in range(len(toks), vocab)]
            w.add_token_list(toks)
            w.add_token_scores([-float(i) for i in range(vocab)])
            # llama.cpp's token types: 2 unknown, 3 control, 6 byte, 1 normal
            w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))

    n_bytes = 0
    for tname_, tq, shape, _ in plan:
        nb = _nbytes(tq, shape)
        n_bytes += nb
        if tq in _FLOAT_TYPES:
            w.add_tensor_info(tname_, shape, np.dtype(_FLOAT_TYPES[tq][0]), nb)
        else:
            raw_shape = tuple(shape[:-1]) + (quants.row_bytes(tq, shape[-1]),)
            w.add_tensor_info(tname_, raw_shape, np.dtype(np.uint8), nb,
                              raw_dtype=gguf.GGMLQuantizationType[tq])
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        gen = _Generator(rng, int(pool_weights))
        for i, (tname_, tq, shape, kind) in enumerate(plan):
            data = factors if kind == "rope_freqs" else gen.tensor(tq, shape, kind)
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
    """Command line: ``python -m ptxgen.llm.gguf.synth OUT.gguf --preset tiny``."""
    ap = argparse.ArgumentParser(prog="python -m ptxgen.llm.gguf.synth",
                                 description="Write a synthetic decoder GGUF with random "
                                             "quantized weights.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--arch", choices=sorted(ARCHS), default=None,
                    help="conventions (default: the preset's, else llama)")
    ap.add_argument("--qtype", default="Q4_K",
                    help="layer weight type (Q4_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q5_K, "
                         "F16, BF16, F32)")
    ap.add_argument("--output-qtype", default="Q6_K", help="type of output.weight")
    ap.add_argument("--mix", choices=sorted(MIXES), default=None,
                    help="llama.cpp's quant mix (replaces --qtype and --output-qtype)")
    ap.add_argument("--rope-freqs", action="store_true",
                    help="write Llama 3.1's rope_freqs.weight (llama only)")
    ap.add_argument("--head-dim", type=int, default=None, help="head size (key_length)")
    ap.add_argument("--tied", action="store_true", help="no output.weight (tied embeddings)")
    ap.add_argument("--vocab-size", type=int, default=None, help="embedding rows")
    ap.add_argument("--tokenizer", choices=("none", "llama", "gemma3"), default=None,
                    help="vocabulary written (default: the preset's, else none)")
    ap.add_argument("--vocab-pieces", metavar="SPM.gguf", default=None,
                    help="with --tokenizer gemma3: take the normal pieces of this "
                         "SentencePiece vocabulary")
    ap.add_argument("--sliding-window", type=int, default=None,
                    help="gemma3: the local layers' window (default: the preset's)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--experts", type=int, default=None, metavar="N",
                    help="qwen3moe: experts per layer (override the preset's)")
    ap.add_argument("--experts-used", type=int, default=None, metavar="K",
                    help="qwen3moe: experts run per token")
    ap.add_argument("--expert-ffn", type=int, default=None, metavar="F",
                    help="qwen3moe: an expert's FFN size")
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
    for key, val in (("n_layers", a.layers), ("arch", a.arch), ("head_dim", a.head_dim),
                     ("vocab", a.vocab_size), ("mix", a.mix), ("tokenizer", a.tokenizer),
                     ("sliding_window", a.sliding_window), ("vocab_pieces", a.vocab_pieces),
                     ("n_expert", a.experts), ("n_expert_used", a.experts_used),
                     ("expert_ffn", a.expert_ffn)):
        if val is not None:
            kw[key] = val
    if a.rope_freqs:
        kw["rope_freqs"] = True
    if a.tied:
        kw["tie_embeddings"] = True
    if a.vocab_limit is not None and a.vocab is None:
        ap.error("--vocab-limit needs --vocab")
    if a.vocab is not None:
        kw.pop("vocab", None)
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
