"""Reading decoder GGUF files as llama.cpp reads them: hyperparameters,
conventions and raw tensors.

Architectures: ``llama`` (Llama 2/3/3.1/3.2/3.3, and the Mistral 7B / Nemo
files llama.cpp's converter writes under that name), ``mistral`` (an alias
of ``llama``; llama.cpp has no such name), ``qwen2`` (Qwen2 / Qwen2.5) and
``qwen3`` (dense Qwen3).  What llama.cpp's ``load_hparams`` and each
architecture's tensor loader and graph do, and so what this module reads:

- ``{arch}.attention.key_length`` / ``value_length``: the head size
  (default ``embedding_length / head_count``); q has ``head_count *
  key_length`` rows, which need not be the hidden size (Mistral-Nemo,
  Qwen3).  The two must be equal, and equal to ``rope.dimension_count``
  (default the head size): llama.cpp refuses partial rotary for these
  architectures, and so does this loader.
- ``{arch}.rope.freq_base`` (default 10000); ``rope.scaling.type``
  (default ``linear``) with ``rope.scaling.factor`` (or the older
  ``rope.scale_linear``) scaling every position by ``1 / factor``;
  ``none`` ignores the factor; ``yarn`` and ``longrope`` are refused, as
  is a ``rope.scaling.attn_factor`` other than 1.
- ``rope_freqs.weight`` (llama only; Llama 3.1 and later): one f32 factor
  per frequency that divides it, ``theta_i = pos * freq_scale *
  base^(-2i/d) / factor_i`` (ggml's ``rope_ext`` with ``freq_factors``).
  qwen2 and qwen3 pass no factors to RoPE, so the tensor is refused there.
- RoPE pairs: consecutive values ``(2i, 2i+1)`` for llama (llama.cpp's
  ``LLAMA_ROPE_TYPE_NORM``), halves ``(i, i + d/2)`` for qwen2 and qwen3
  (``LLAMA_ROPE_TYPE_NEOX``).
- Optional ``blk.N.attn_{q,k,v}.bias`` (every architecture: Qwen2 files
  have them), added before RoPE; qwen3's required per-head RMSNorms
  ``blk.N.attn_q_norm`` / ``attn_k_norm`` (over ``head_dim``, before RoPE,
  with the model's eps).
- The output projection is ``output.weight``, or ``token_embd.weight`` when
  the file has none (tied embeddings).
- The vocabulary: the length of ``tokenizer.ggml.tokens`` where the file
  has a token list (llama.cpp's ``n_vocab``), else ``{arch}.vocab_size``,
  else the embedding's rows; ``token_embd`` (and ``output``) must have that
  many rows.
- ``{arch}.context_length``, ``block_count``, ``embedding_length``,
  ``attention.head_count`` and ``attention.layer_norm_rms_epsilon`` are
  required (as llama.cpp requires them); ``head_count_kv`` defaults to
  ``head_count``; a mixture of experts (``expert_count`` > 0) or
  non-causal attention is refused.
- ``general.alignment``: a power-of-two uint32 (default 32); every
  tensor's data offset must be a multiple of it.
- Any tensor llama.cpp's loader would not expect for the architecture
  (llama.cpp refuses a file with tensors left over), and those it would
  use but the decode step does not (``attn_output.bias``, FFN biases,
  ``output.bias``, a fused ``attn_qkv``), are refused by name.

Tensors stay in their own format: :meth:`LlamaFile.tensor` returns the raw
bytes as ``uint8 [rows, row_bytes]`` (float arrays for F16/F32).  With
``check_kernels`` (the default) every tensor's type must be one the decode
step has a kernel for in its role (:func:`kernel_types`), else it is
refused by name; without it (the float64 reference, ``ptxgen info``) any
float or block-quantized GGML type is accepted.  Problems raise
:class:`GGUFError` naming the file and the key or tensor.
"""

from __future__ import annotations

import os

import attrs
import numpy as np

__all__ = ["GGUFError", "LlamaHParams", "LlamaFile", "SUPPORTED_ARCHS", "SUPPORTED_TYPES",
           "ROPE_LAYOUT", "layer_tensor_names", "kernel_types", "tensor_role"]

#: architectures this module reads (``mistral`` is read as ``llama``)
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
#: RoPE pairing per architecture (llama.cpp's ``llama_model_rope_type``)
ROPE_LAYOUT = {"llama": "interleaved", "mistral": "interleaved", "qwen2": "neox",
               "qwen3": "neox"}
#: GGML type name -> (weights per block, bytes per block): the types some
#: kernel of the decode step reads (see :func:`kernel_types` for the roles)
SUPPORTED_TYPES = {"F32": (1, 4), "F16": (1, 2), "Q8_0": (32, 34), "Q4_K": (256, 144),
                   "Q6_K": (256, 210)}
#: GGML types that never hold these models' weights
_NOT_WEIGHTS = ("I8", "I16", "I32", "I64", "F64")

_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_BIASES = ("attn_q", "attn_k", "attn_v")
_QK_NORMS = ("attn_q_norm", "attn_k_norm")


class GGUFError(ValueError):
    """A GGUF file that cannot be used, and why."""


def layer_tensor_names(i: int) -> list[str]:
    """The weights every layer of every supported architecture has."""
    return [f"blk.{i}.{t}.weight" for t in _LAYER_TENSORS]


def kernel_types() -> dict:
    """Role -> the GGML types the decode step has kernels for: ``matrix``
    (a GEMV's weights), ``embedding`` (the row gather) and ``vector``
    (norm weights, biases, RoPE factors: f32)."""
    from ptxgen.kernels import embedding, gemv
    return {"matrix": tuple(gemv.QTYPE_INFO),
            "embedding": tuple(q.upper() for q in embedding.QTYPES),
            "vector": ("F32",)}


def tensor_role(name: str, tied: bool) -> tuple:
    """The roles (:func:`kernel_types` keys) a tensor plays in the decode
    step: ``token_embd`` is also the output matrix when ``tied``."""
    if name == "token_embd.weight":
        return ("embedding", "matrix") if tied else ("embedding",)
    if name == "output.weight":
        return ("matrix",)
    short = name.split(".")[-2] if name.startswith("blk.") else ""
    if name.endswith(".weight") and short in _MATRICES:
        return ("matrix",)
    return ("vector",)


@attrs.frozen
class LlamaHParams:
    """Hyperparameters and conventions of a Llama-style decoder."""

    arch: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    context_length: int
    eps: float
    rope_theta: float
    rope_dim: int
    #: "interleaved" (pairs 2i, 2i+1) or "neox" (pairs i, i + d/2)
    rope_layout: str = "interleaved"
    #: every position is scaled by this (linear RoPE scaling: 1 / factor)
    rope_freq_scale: float = 1.0
    #: the file's rope_freqs.weight divides the frequencies
    rope_freqs: bool = False
    #: per-head RMSNorm of q and k before RoPE (qwen3)
    qk_norm: bool = False
    #: some layer has attn_q/k/v biases
    qkv_bias: bool = False
    #: no output.weight: the logits read token_embd.weight
    tied: bool = False

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@attrs.frozen
class RawTensor:
    """One tensor as stored: GGML type name, logical shape ``[rows, cols]``
    (cols innermost) and the bytes (``uint8 [rows, row_bytes]``) or values."""

    name: str
    qtype: str
    shape: tuple
    data: np.ndarray = attrs.field(eq=False, repr=False)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class LlamaFile:
    """An open, validated GGUF file of a supported architecture.

    Parameters
    ----------
    path : str or os.PathLike
        The ``.gguf`` file.
    check_kernels : bool
        Refuse a tensor whose type has no decode kernel in its role (the
        default); False accepts any float or block-quantized type.

    Raises
    ------
    GGUFError
        The file is missing, not a GGUF, truncated, of an unsupported
        architecture or convention, lacks a tensor, holds one it should not,
        or holds an unsupported tensor type.
    """

    def __init__(self, path, *, check_kernels: bool = True):
        self.path = os.fspath(path)
        try:
            import gguf
        except ImportError:
            raise GGUFError("reading GGUF files needs the gguf package: pip install gguf") from None
        self._gguf = gguf
        if not os.path.exists(self.path):
            raise GGUFError(f"{self.path}: no such file")
        if os.path.isdir(self.path):
            raise GGUFError(f"{self.path}: is a directory, not a .gguf file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises several kinds on bad bytes
            if "alignment" in str(e):
                raise GGUFError(f"{self.path}: metadata key 'general.alignment' must be a "
                                f"non-zero power of two stored as uint32 ({e})") from None
            raise GGUFError(f"{self.path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._in_f16 = {}
        self._check_extents()
        self.hparams = self._read_hparams()
        self._check_tensors(check_kernels)

    # ------------------------------------------------------------ metadata
    def _field(self, key, default=None, required=True):
        f = self.reader.fields.get(key)
        if f is None:
            if required and default is None:
                raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
            return default
        return f.contents()

    def _uniform(self, key, default=None, required=True):
        """A per-model value that llama.cpp also accepts as one per layer."""
        v = self._field(key, default, required)
        if isinstance(v, list):
            if not v or any(x != v[0] for x in v):
                raise GGUFError(f"{self.path}: metadata key {key!r} differs between layers "
                                f"({v[:4]}...); per-layer shapes are not supported")
            v = v[0]
        return v

    @property
    def arch(self) -> str:
        return self.hparams.arch

    @property
    def alignment(self) -> int:
        return int(self._field("general.alignment", default=32))

    @property
    def tokenizer_model(self) -> str | None:
        return self._field("tokenizer.ggml.model", required=False)

    def _n_tokens(self) -> int | None:
        f = self.reader.fields.get("tokenizer.ggml.tokens")
        return None if f is None else len(f.data)

    def _read_hparams(self) -> LlamaHParams:
        arch = self._field("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise GGUFError(f"{self.path}: architecture {arch!r} is not supported "
                            f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        a = arch
        if int(self._uniform(f"{a}.expert_count", default=0, required=False)) > 0:
            raise GGUFError(f"{self.path}: metadata key '{a}.expert_count' > 0: mixtures of "
                            "experts are not supported")
        if not self._field(f"{a}.attention.causal", default=True, required=False):
            raise GGUFError(f"{self.path}: metadata key '{a}.attention.causal' is false: "
                            "non-causal attention is not supported")
        hidden = int(self._field(f"{a}.embedding_length"))
        n_layers = int(self._field(f"{a}.block_count"))
        n_heads = int(self._uniform(f"{a}.attention.head_count"))
        n_kv = int(self._uniform(f"{a}.attention.head_count_kv", default=n_heads))
        if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv or n_layers <= 0 or hidden <= 0:
            raise GGUFError(f"{self.path}: head counts {n_heads}/{n_kv} (keys "
                            f"'{a}.attention.head_count', '{a}.attention.head_count_kv') do "
                            f"not form whole groups, or a size is not positive")
        head_k = int(self._field(f"{a}.attention.key_length", default=hidden // n_heads))
        head_v = int(self._field(f"{a}.attention.value_length", default=hidden // n_heads))
        if head_v != head_k:
            raise GGUFError(f"{self.path}: metadata key '{a}.attention.value_length' ({head_v}) "
                            f"differs from '{a}.attention.key_length' ({head_k}); llama.cpp's "
                            f"{a} graph needs one head size")
        rope_dim = int(self._field(f"{a}.rope.dimension_count", default=head_k))
        if rope_dim != head_k:
            raise GGUFError(f"{self.path}: metadata key '{a}.rope.dimension_count' is {rope_dim} "
                            f"of head size {head_k}: partial rotary embeddings are not supported")
        if head_k % 2 or head_k <= 0:
            raise GGUFError(f"{self.path}: metadata key '{a}.attention.key_length': head size "
                            f"{head_k} is not a positive even number")
        if arch == "qwen2" and n_heads * head_k != hidden:
            raise GGUFError(f"{self.path}: metadata key 'qwen2.attention.key_length' ({head_k}) "
                            f"x {n_heads} heads is not the hidden size {hidden}, which qwen2's "
                            "query projection has")
        freq_scale = self._rope_freq_scale(a)
        ff = self._uniform(f"{a}.feed_forward_length")
        vocab = self._vocab(a)
        has = self._tensors.__contains__
        hp = LlamaHParams(
            arch=arch, n_layers=n_layers, hidden=hidden, ffn=int(ff), n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_k, vocab=vocab,
            context_length=int(self._field(f"{a}.context_length")),
            eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._field(f"{a}.rope.freq_base", default=10000.0)),
            rope_dim=rope_dim, rope_layout=ROPE_LAYOUT[arch], rope_freq_scale=freq_scale,
            rope_freqs=arch in ("llama", "mistral") and has("rope_freqs.weight"),
            qk_norm=arch == "qwen3",
            qkv_bias=any(has(f"blk.{i}.{b}.bias") for i in range(n_layers) for b in _BIASES),
            tied=not has("output.weight"))
        if not hp.rope_theta > 0:
            raise GGUFError(f"{self.path}: metadata key '{a}.rope.freq_base' must be positive, "
                            f"got {hp.rope_theta}")
        return hp

    def _rope_freq_scale(self, a) -> float:
        kind = self._field(f"{a}.rope.scaling.type", default="linear", required=False)
        if kind not in ("none", "linear"):
            known = kind in ("yarn", "longrope")
            raise GGUFError(f"{self.path}: metadata key '{a}.rope.scaling.type' is {kind!r}: "
                            + ("this RoPE scaling is not supported" if known else
                               "not a type llama.cpp knows (none, linear, yarn, longrope)")
                            + "; supported: none, linear")
        attn = float(self._field(f"{a}.rope.scaling.attn_factor", default=1.0, required=False))
        if attn != 1.0:
            raise GGUFError(f"{self.path}: metadata key '{a}.rope.scaling.attn_factor' is "
                            f"{attn}: scaled RoPE magnitudes are not supported")
        factor = self._field(f"{a}.rope.scaling.factor", required=False)
        if factor is None:
            factor = self._field(f"{a}.rope.scale_linear", required=False)
        factor = float(factor or 0.0)
        if kind == "none" or factor == 0.0:
            return 1.0
        if factor < 0:
            raise GGUFError(f"{self.path}: metadata key '{a}.rope.scaling.factor' is {factor}")
        return 1.0 / factor

    def _vocab(self, a) -> int:
        emb = self._tensors.get("token_embd.weight")
        if emb is None:
            raise GGUFError(f"{self.path}: tensor 'token_embd.weight' is missing")
        rows = int(emb.shape[1]) if len(emb.shape) > 1 else 0
        n_tok = self._n_tokens()
        if n_tok is not None:
            vocab, src = n_tok, "the tokenizer's token list (tokenizer.ggml.tokens)"
        else:
            vocab = self._field(f"{a}.vocab_size", required=False)
            src = f"metadata key '{a}.vocab_size'"
            if vocab is None:
                vocab, src = rows, "the embedding"
        vocab = int(vocab)
        if rows != vocab:
            raise GGUFError(f"{self.path}: tensor 'token_embd.weight' has {rows} rows but "
                            f"{src} gives a vocabulary of {vocab}")
        return vocab

    # ------------------------------------------------------------- tensors
    def _check_extents(self):
        size = os.path.getsize(self.path)
        align = int(self._field("general.alignment", default=32))
        start = int(getattr(self.reader, "data_offset", 0))
        for t in self.reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise GGUFError(f"{self.path}: truncated: tensor {t.name!r} ends at byte "
                                f"{end} but the file has {size}")
            if (int(t.data_offset) - start) % align:
                raise GGUFError(f"{self.path}: tensor {t.name!r} starts at data offset "
                                f"{int(t.data_offset) - start}, not a multiple of "
                                f"general.alignment {align}")

    def expected_tensors(self) -> dict:
        """Name -> expected logical shape of every tensor the decode step
        reads from this file (required ones and the optional ones present)."""
        hp = self.hparams
        H, q, kv = hp.hidden, hp.q_dim, hp.kv_dim
        out = {"token_embd.weight": (hp.vocab, H), "output_norm.weight": (H,)}
        if not hp.tied:
            out["output.weight"] = (hp.vocab, H)
        if hp.rope_freqs:
            out["rope_freqs.weight"] = (hp.rope_dim // 2,)
        shapes = {"attn_norm": (H,), "attn_q": (q, H), "attn_k": (kv, H), "attn_v": (kv, H),
                  "attn_output": (H, q), "ffn_norm": (H,), "ffn_gate": (hp.ffn, H),
                  "ffn_up": (hp.ffn, H), "ffn_down": (H, hp.ffn)}
        bias = {"attn_q": (q,), "attn_k": (kv,), "attn_v": (kv,)}
        for i in range(hp.n_layers):
            p = f"blk.{i}."
            for short, shape in shapes.items():
                out[p + short + ".weight"] = shape
            for short, shape in bias.items():
                if p + short + ".bias" in self._tensors:
                    out[p + short + ".bias"] = shape
            if hp.qk_norm:
                for short in _QK_NORMS:
                    out[p + short + ".weight"] = (hp.head_dim,)
        return out

    def _check_tensors(self, check_kernels: bool):
        hp = self.hparams
        need = self.expected_tensors()
        missing = [n for n in need if n not in self._tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise GGUFError(f"{self.path}: tensor {missing[0]!r} is missing{more}")
        extra = [n for n in self._tensors if n not in need]
        if extra:
            raise GGUFError(f"{self.path}: tensor {extra[0]!r} is not supported in a "
                            f"{hp.arch} model{_why_extra(extra[0], hp.arch)}")
        roles = kernel_types() if check_kernels else None
        for name, shape in need.items():
            t = self._tensors[name]
            qt = t.tensor_type.name
            if roles is None:
                if qt in _NOT_WEIGHTS or qt not in {k.name for k in self._gguf.GGML_QUANT_SIZES}:
                    raise GGUFError(f"{self.path}: tensor {name!r} has type {qt}, which is "
                                    "not supported (not a weight type)")
            else:
                for role in tensor_role(name, hp.tied):
                    if qt not in roles[role]:
                        what = {"matrix": "a matrix" + (" (the tied output)" if name ==
                                                        "token_embd.weight" else ""),
                                "embedding": "the embedding", "vector": "a vector"}[role]
                        raise GGUFError(f"{self.path}: tensor {name!r} has type {qt}, which is "
                                        f"not supported for {what} (supported: "
                                        f"{', '.join(roles[role])})")
            got = self.shape(name)
            if got != shape:
                raise GGUFError(f"{self.path}: tensor {name!r} has shape {got}, "
                                f"expected {shape}")
            if len(shape) == 2:
                bs = self._gguf.GGML_QUANT_SIZES[t.tensor_type][0]
                if shape[1] % bs:
                    raise GGUFError(f"{self.path}: tensor {name!r}: {qt} rows of {shape[1]} are "
                                    f"not whole {bs}-weight blocks")

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def qtype(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple:
        """Logical ``(rows, cols)``; GGUF stores dims innermost-first."""
        t = self._tensors[name]
        dims = [int(d) for d in t.shape]
        if len(dims) == 1:
            return (dims[0],)
        return tuple(reversed(dims))

    def tensor(self, name: str) -> RawTensor:
        """The tensor's stored bytes/values, unconverted."""
        try:
            t = self._tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing") from None
        qt = t.tensor_type.name
        shape = self.shape(name)
        data = np.asarray(t.data)
        if qt in ("F32", "F16"):
            data = data.reshape(shape)
        else:
            per, nbytes = self._gguf.GGML_QUANT_SIZES[t.tensor_type]
            rows = 1 if len(shape) == 1 else shape[0]
            data = data.view(np.uint8).reshape(rows, -1)
            if data.shape[1] != shape[-1] // per * nbytes:
                raise GGUFError(f"{self.path}: tensor {name!r} has {data.shape[1]} bytes "
                                f"per row, expected {shape[-1] // per * nbytes}")
        return RawTensor(name, qt, shape, data)

    def in_f16_range(self, name: str) -> bool:
        """Whether every value of the BF16 tensor ``name`` converts to a finite
        f16 (magnitude at most 65280, the largest bf16 under f16's 65504;
        NaN and infinity do not): what the prefill GEMM's BF16 weights need.
        Read once per tensor and remembered."""
        if name not in self._in_f16:
            t = self.tensor(name)
            if t.qtype != "BF16":
                raise ValueError(f"{name!r} is {t.qtype}, not BF16")
            mag = np.bitwise_and(t.data.view(np.uint16), 0x7FFF)
            self._in_f16[name] = bool(mag.max(initial=0) <= 0x477F)
        return self._in_f16[name]

    def tokenizer(self):
        """The file's :class:`~.tokenizer.Tokenizer`, or None when it has no
        ``tokenizer.ggml.model`` or that is ``"none"`` (as llama.cpp reads it:
        no vocabulary).

        Raises
        ------
        GGUFError
            The vocabulary cannot be used, or its size is not the model's
            (``token_embd`` rows).
        """
        from ptxgen.llm.text.tokenizer import Tokenizer, TokenizerError
        field = self.reader.fields.get("tokenizer.ggml.model")
        if field is None or bytes(field.parts[field.data[0]]).decode(errors="replace") == "none":
            return None
        try:
            tok = Tokenizer.from_gguf(self.path)
        except TokenizerError as e:
            raise GGUFError(str(e)) from None
        if tok.n_vocab != self.hparams.vocab:
            raise GGUFError(f"{self.path}: the vocabulary has {tok.n_vocab} tokens but the "
                            f"model {self.hparams.vocab} logits")
        return tok

    def dequantized(self, name: str) -> np.ndarray:
        """The tensor in float32 through ``gguf.quants.dequantize``."""
        t = self._tensors[name]
        try:
            out = self._gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"{self.path}: tensor {name!r}: the gguf package cannot decode "
                            f"{t.tensor_type.name}") from None
        return np.asarray(out, dtype=np.float32).reshape(self.shape(name))

    def rope_inv_freq(self) -> np.ndarray:
        """float64 ``[head_dim / 2]``: the angle per position of each
        frequency, ``freq_scale * base^(-2i/d) / factor_i`` (factors from
        ``rope_freqs.weight`` where the architecture applies them)."""
        hp = self.hparams
        d = hp.rope_dim
        f = 1.0 / hp.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
        if hp.rope_freqs:
            fac = self.tensor("rope_freqs.weight").data.astype(np.float64)
            if not np.all(fac > 0) or not np.all(np.isfinite(fac)):
                raise GGUFError(f"{self.path}: tensor 'rope_freqs.weight' holds a factor that "
                                "is not a positive number")
            f = f / fac
        if hp.rope_freq_scale != 1.0:
            f = f * hp.rope_freq_scale
        return f

    @property
    def weight_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.reader.tensors)


def _why_extra(name: str, arch: str) -> str:
    short = name.split(".")[-2] if name.count(".") >= 2 else name.split(".")[0]
    if name == "rope_freqs.weight":
        return f" (llama.cpp's {arch} graph applies no RoPE frequency factors)"
    if name.endswith(".bias"):
        return " (only attn_q, attn_k and attn_v biases are)"
    if short == "attn_qkv":
        return " (fused Q/K/V weights are not; separate attn_q, attn_k, attn_v are)"
    if short in _QK_NORMS:
        return " (per-head q/k norms belong to qwen3)"
    return ""
