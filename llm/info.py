"""``python -m ptxgen info MODEL.gguf [--ctx N] [--gpu-memory GIB]``: what a
GGUF file holds and whether it fits a GPU.

Reported from the file alone, read once (metadata and tensor headers; no
tensor data is read): the architecture, the parameter count (every tensor's elements,
as llama.cpp counts them), the quant mix (tensors, parameters and bytes per
GGML type), the tokenizer (``tokenizer.ggml.model`` and the token list's
length) and vocabulary, the training context length, whether ptxgen's
decode step runs the file (else the loader's reason), the memory for the
weights (the tensors' bytes, uploaded as stored) and for the f16 KV cache
at ``--ctx`` tokens (default: the decode step's, ``min(context, 4096)``):
``2 * layers * kv_heads * ctx * head_dim * 2`` bytes.

Fit: against the present GPU's free memory (or ``--gpu-memory``); when the
weights and cache do not fit, the weight types with decode kernels are
listed with the size of the weights re-quantized to each (every matrix in
that type, or llama.cpp's Q4_K_M mix; vectors kept), and which would fit.

The batched engine's KV pool: how many tokens (and ``--ctx``-token
sequences) fit in ``--gpu-memory-utilization`` (default 0.9) of the
memory left after the weights, in blocks of
:data:`~ptxgen.llm.engine.blocks.DEFAULT_BLOCK_SIZE` tokens
(:func:`~ptxgen.llm.engine.blocks.kv_pool_blocks`).
"""

from __future__ import annotations

import sys

import attrs

__all__ = ["ModelInfo", "TypeShare", "read_info", "weight_estimates", "decode_read_bytes",
           "format_info", "info_command"]

GIB = 1 << 30


@attrs.frozen
class TypeShare:
    """The tensors of one GGML type in a file."""

    qtype: str
    tensors: int
    params: int
    nbytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / self.params if self.params else 0.0


@attrs.frozen
class ModelInfo:
    """What :func:`read_info` found in a file."""

    path: str
    arch: str | None
    n_params: int
    types: tuple
    tokenizer: str | None
    n_tokens: int | None
    vocab: int | None
    context_length: int | None
    weight_bytes: int
    ctx: int | None
    kv_bytes: int | None
    #: None when the decode step runs the file, else the loader's reason
    not_runnable: str | None
    hparams: object = attrs.field(default=None, repr=False)
    #: (name, GGML type, logical shape) of every tensor
    tensors: tuple = attrs.field(default=(), repr=False)


def read_info(path, ctx: int | None = None) -> ModelInfo:
    """Read ``path``'s metadata and tensor headers (the file is read once).

    Raises
    ------
    GGUFError
        Not a readable GGUF file.
    """
    from ptxgen.llm.gguf.file import GGUFError, LlamaFile
    from ptxgen.llm.gguf.reader import read_gguf
    g = read_gguf(path)
    meta = g.metadata
    arch = meta.get("general.architecture")
    shares: dict = {}
    tensors = []
    for t in g.tensors.values():
        s = shares.setdefault(t.qtype, [0, 0, 0])
        s[0] += 1
        s[1] += t.n_elements
        s[2] += t.nbytes
        tensors.append((t.name, t.qtype, t.shape))
    types = tuple(sorted((TypeShare(q, *v) for q, v in shares.items()),
                         key=lambda s: -s.nbytes))
    tok = meta.get("tokenizer.ggml.tokens")
    hp, reason = None, None
    try:
        f = LlamaFile.from_contents(g, check_kernels=False)
        hp = f.hparams
        f.check_kernel_types()
    except GGUFError as e:
        reason = str(e).removeprefix(f"{g.path}: ")
    ctx_len = meta.get(f"{arch}.context_length") if arch else None
    kv = None
    if hp is not None:
        ctx = int(ctx or min(hp.context_length, 4096))
        kv = 2 * hp.n_layers * hp.n_kv_heads * ctx * hp.head_dim * 2
    return ModelInfo(path=g.path, arch=arch, n_params=sum(s.params for s in types), types=types,
                     tokenizer=meta.get("tokenizer.ggml.model"),
                     n_tokens=None if tok is None else len(tok),
                     vocab=None if hp is None else hp.vocab, context_length=ctx_len,
                     weight_bytes=sum(s.nbytes for s in types), ctx=ctx if kv else None,
                     kv_bytes=kv, not_runnable=reason, hparams=hp, tensors=tuple(tensors))


def weight_estimates(info: ModelInfo) -> list:
    """``(name, bytes)`` of the file's weights re-quantized to each weight
    type with decode kernels (every matrix whose rows are whole blocks of it;
    other tensors as stored), and to llama.cpp's Q4_K_M mix where all of its
    types have kernels, smallest first."""
    from ptxgen.kernels import quants
    from ptxgen.llm.gguf.file import kernel_types
    from ptxgen.llm.gguf.synth import quant_mix
    mats = kernel_types()["matrix"]

    def size(qt, shape):
        return int(shape[0]) * quants.row_bytes(qt, shape[-1])

    out = []
    for qt in mats:
        bs = quants.qtype_of(qt).block_size
        total = 0
        for name, cur, shape in info.tensors:
            if len(shape) == 2 and shape[-1] % bs == 0:
                total += size(qt, shape)
            else:
                total += _nbytes(cur, shape)
        out.append((qt, total))
    if info.hparams is not None:
        hp = info.hparams
        mix = quant_mix("Q4_K_M", [(n, s) for n, _, s in info.tensors], hp.n_layers, hp.tied)
        if all(mix[n] in mats or len(s) < 2 for n, _, s in info.tensors):
            out.append(("Q4_K_M", sum(_nbytes(mix[n] if len(s) == 2 else cur, s)
                                      for n, cur, s in info.tensors)))
    return sorted(out, key=lambda e: e[1])


def decode_read_bytes(info: ModelInfo) -> int:
    """The weight bytes one decode step reads (the floor a memory-bound step
    is held to): every tensor but the token embedding (one row of it, unless
    the output reads it whole), and of a mixture of experts' 3-D expert
    tensors only the ``n_used / n_expert`` share its router chooses."""
    hp = info.hparams
    sizes = {n: _nbytes(q, s) for n, q, s in info.tensors}
    total = 0
    for name, _, shape in info.tensors:
        nb = sizes[name]
        if name == "token_embd.weight" and "output.weight" in sizes:
            nb //= int(shape[0])
        elif len(shape) == 3 and hp is not None and hp.n_expert:
            nb = nb * hp.n_expert_used // hp.n_expert
        total += nb
    return total


def _nbytes(qt, shape) -> int:
    from ptxgen.llm.gguf.ggml_types import ggml_type_named
    n = 1
    for d in shape:
        n *= int(d)
    return ggml_type_named(qt).row_bytes(n)


def _gib(n) -> str:
    return f"{n:,} bytes ({n / GIB:.2f} GiB)"


def format_info(info: ModelInfo, available: int | None = None, gpu: str | None = None,
                utilization: float = 0.9) -> str:
    """The report :func:`info_command` prints; ``available``: the GPU bytes
    to fit in (None: no GPU), ``gpu``: how to name it, ``utilization``: the
    share of what the weights leave that the batched engine's KV pool takes."""
    lines = [f"file: {info.path}",
             f"architecture: {info.arch}",
             f"parameters: {info.n_params:,} ({info.n_params / 1e9:.2f} B)",
             "tensor types:"]
    for s in info.types:
        lines.append(f"  {s.qtype:<6} {s.tensors:>5} tensors {s.params:>16,} parameters "
                     f"{s.nbytes:>16,} bytes {s.bits_per_weight:6.2f} bits/weight")
    tok = info.tokenizer if info.tokenizer is not None else "none given"
    ntok = (f"{info.n_tokens:,} tokens in its list" if info.n_tokens is not None
            else "no token list")
    lines.append(f"tokenizer: {tok} ({ntok})")
    lines.append("vocabulary: " + (f"{info.vocab:,}" if info.vocab is not None else "unknown"))
    lines.append("context length: " + (f"{info.context_length:,}" if info.context_length
                                       is not None else "unknown"))
    if info.hparams is not None:
        lines.extend(_attention_lines(info.hparams))
    lines.append("ptxgen decode: " + ("yes" if info.not_runnable is None
                                      else f"no: {info.not_runnable}"))
    lines.append(f"weights: {_gib(info.weight_bytes)}")
    hp = info.hparams
    if hp is not None and hp.n_expert:
        lines.append(f"experts: {hp.n_expert} per layer, {hp.n_expert_used} used per token "
                     f"(expert FFN {hp.expert_ffn:,})")
        lines.append(f"weights read per decoded token: {_gib(decode_read_bytes(info))} "
                     f"(the {hp.n_expert_used} of {hp.n_expert} experts chosen)")
    if info.kv_bytes is None:
        return "\n".join(lines)
    need = info.weight_bytes + info.kv_bytes
    lines.append(f"KV cache (f16, {info.ctx:,} tokens): {_gib(info.kv_bytes)}")
    lines.append(f"weights + KV cache: {_gib(need)}")
    if available is None:
        lines.append("GPU: none found")
        return "\n".join(lines)
    fits = need <= available
    lines.append(f"GPU: {gpu or 'given'} with {_gib(available)} free: "
                 + ("fits" if fits else "does not fit"))
    lines.append(_pool_line(info, available, utilization))
    if not fits:
        lines.append("weight types with decode kernels (weights + KV cache):")
        for name, nb in weight_estimates(info):
            ok = nb + info.kv_bytes <= available
            lines.append(f"  {name:<7} {_gib(nb + info.kv_bytes)}: "
                         + ("fits" if ok else "does not fit"))
    return "\n".join(lines)


def _attention_lines(hp) -> list:
    """The sliding-window layers and the score scale, where the file has
    them (gemma3); nothing for a file whose every layer sees the whole
    sequence at ``1 / sqrt(head_dim)``."""
    out = []
    if hp.sliding_window:
        n_local = sum(hp.swa_layers)
        out.append(f"sliding-window layers: {n_local} of {hp.n_layers} (the last "
                   f"{hp.sliding_window:,} keys, RoPE base {hp.rope_theta_swa:,.0f}); "
                   f"{hp.n_layers - n_local} global (RoPE base {hp.rope_theta:,.0f})")
    if hp.attn_scale is not None:
        out.append(f"attention score scale: {hp.attn_scale:.6g}")
    return out


def _pool_line(info: ModelInfo, available: int, utilization: float) -> str:
    """How many tokens the batched engine's KV pool holds on ``available`` bytes."""
    from ptxgen.llm.engine.blocks import DEFAULT_BLOCK_SIZE, kv_bytes_per_token, kv_pool_blocks
    hp = info.hparams
    left = max(0, available - info.weight_bytes)
    per = kv_bytes_per_token(hp.n_layers, hp.n_kv_heads, hp.head_dim)
    blocks = kv_pool_blocks(left, utilization, per, DEFAULT_BLOCK_SIZE)
    tokens = blocks * DEFAULT_BLOCK_SIZE
    return (f"batched engine KV pool: {tokens:,} tokens ({blocks:,} blocks of "
            f"{DEFAULT_BLOCK_SIZE}, {tokens // info.ctx:,} sequences of {info.ctx:,} tokens) in "
            f"{utilization:.0%} of the {_gib(left)} left after the weights")


def _present_gpu():
    """``(free bytes, name)`` of GPU 0, or ``(None, None)``."""
    try:
        from ptxgen.driver import get_device, is_available
        if not is_available():
            return None, None
        dev = get_device()
        free, _ = dev.mem_info()
        return free, dev.name
    except Exception:
        return None, None


def info_command(argv) -> int:
    """Describe a GGUF file (architecture, sizes, tokenizer) and whether it fits the GPU.

    ``python -m ptxgen info MODEL.gguf [--ctx N] [--gpu-memory GIB]
    [--gpu-memory-utilization F]``.
    """
    from ptxgen.cli import ArgumentParser, HelpFormatter
    p = ArgumentParser(prog="python -m ptxgen info", formatter_class=HelpFormatter,
                       description="what a GGUF file holds and whether it fits a GPU")
    p.add_argument("model", help="a .gguf file")
    p.add_argument("--ctx", type=int, default=None,
                   help="KV-cache length in tokens (default: min(context length, 4096))")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="fit against this many GiB instead of the present GPU's free memory")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                   help="the share of the memory left after the weights that the batched "
                        "engine's KV pool takes (default: 0.9)")
    a = p.parse_args(argv)
    from ptxgen.llm.gguf.file import GGUFError
    if a.ctx is not None and a.ctx < 1:
        print(f"error: --ctx must be a positive number of tokens, got {a.ctx}", file=sys.stderr)
        return 2
    if not 0.0 < a.gpu_memory_utilization <= 1.0:
        print(f"error: --gpu-memory-utilization must be in (0, 1], got "
              f"{a.gpu_memory_utilization}", file=sys.stderr)
        return 2
    try:
        info = read_info(a.model, a.ctx)
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.gpu_memory is not None:
        available, gpu = int(a.gpu_memory * GIB), "assumed"
    else:
        available, gpu = _present_gpu()
    print(format_info(info, available, gpu, a.gpu_memory_utilization))
    return 0
