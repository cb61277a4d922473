"""Reading decoder GGUF files as llama.cpp reads them: hyperparameters,
conventions and raw tensors.

Architectures: ``llama`` (Llama 2/3/3.1/3.2/3.3, and the Mistral 7B / Nemo
files llama.cpp's converter writes under that name), ``mistral`` (an alias
of ``llama``; llama.cpp has no such name), ``qwen2`` (Qwen2 / Qwen2.5),
``qwen3`` (dense Qwen3), ``qwen3moe`` (Qwen3's layers with a mixture of
experts for the FFN: :mod:`.experts`) and ``gemma3`` (Gemma 3 text).  What
llama.cpp's ``load_hparams`` and each architecture's tensor loader and graph
do, and so what this module reads:

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
  ``head_count``; a mixture of experts (``expert_count`` > 0) outside
  ``qwen3moe`` or non-causal attention is refused.
- ``general.alignment``: a power of two (default 32); every tensor's data
  offset must be a multiple of it.
- ``gemma3`` (Gemma 3): NeoX RoPE, per-head q/k RMSNorms, an RMSNorm of
  the attention and of the FFN output (``post_attention_norm``,
  ``post_ffw_norm``) before each residual add, the norm weights used as
  stored (the converter has added Gemma's +1); interleaved sliding-window
  (local) and global layers (:meth:`LlamaFile._gemma3_hparams`: window,
  pattern, the local layers' RoPE base, the attention scale); a
  ``final_logit_softcapping`` other than 0 is refused, as are sliding-window
  layers of another head size (``key_length_swa``...).
- Any tensor llama.cpp's loader would not expect for the architecture
  (llama.cpp refuses a file with tensors left over), and those it would
  use but the decode step does not (``attn_output.bias``, FFN biases,
  ``output.bias``, a fused ``attn_qkv``), are refused by name.

Tensors stay in their own format: :meth:`LlamaFile.tensor` returns the raw
bytes as ``uint8 [rows, row_bytes]`` (float arrays for F16/F32), read-only
views of the file's one map.  With ``check_kernels`` (the default) every
tensor's type must be one the decode step has a kernel for in its role
(:func:`kernel_types`), else it is refused by name; without it (the float64
reference, ``ptxgen info``) any float or block-quantized GGML type is
accepted.  Problems raise
:class:`GGUFError` naming the file and the key or tensor.

The file is untrusted input: :func:`~.reader.read_gguf` reads it once and
checks its structure (every count, length and tensor extent against the
file's size, key types); this module then bounds the hyperparameters,
generously but finitely, before any of them sizes a loop or a table:

- ``block_count`` 1 to :data:`MAX_LAYERS`; ``embedding_length``,
  ``feed_forward_length``, the head size and heads x head size 1 to
  :data:`MAX_WIDTH`; ``head_count`` 1 to :data:`MAX_HEADS`, ``head_count_kv``
  1 to ``head_count``, dividing it; a per-layer array has one value per layer;
- the vocabulary 1 to :data:`MAX_VOCAB`; ``context_length``
  :data:`MIN_CONTEXT` to :data:`MAX_CONTEXT`;
- ``layer_norm_rms_epsilon`` and ``rope.freq_base`` finite and positive,
  ``rope.scaling.factor`` finite and not negative.

Every expected tensor must then have the shape these give (embedding and
output rows the vocabulary), and its bytes lie inside the file: no product
of hyperparameters is taken on trust.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from ptxgen.llm.gguf.errors import GGUFError, GGUFMetadataError
from ptxgen.llm.gguf.experts import (EXPERT_TENSORS, MOE_ARCHS, expert_shapes, expert_slice,
                                     read_experts)
from ptxgen.llm.gguf.metadata import shown
from ptxgen.llm.gguf.reader import GGUFContents, read_gguf

__all__ = ["GGUFError", "GGUFMetadataError", "LlamaHParams", "LlamaFile", "SUPPORTED_ARCHS",
           "ROPE_LAYOUT", "layer_tensor_names", "kernel_types",
           "tensor_role", "MAX_LAYERS", "MAX_WIDTH", "MAX_HEADS", "MAX_VOCAB", "MIN_CONTEXT",
           "MAX_CONTEXT"]

#: architectures this module reads (``mistral`` is read as ``llama``)
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3") + MOE_ARCHS
#: RoPE pairing per architecture (llama.cpp's ``llama_model_rope_type``)
ROPE_LAYOUT = {"llama": "interleaved", "mistral": "interleaved", "qwen2": "neox",
               "qwen3": "neox", "gemma3": "neox", "qwen3moe": "neox"}
#: architectures with per-head q/k RMSNorms
_QK_NORM_ARCHS = ("qwen3", "gemma3", "qwen3moe")
#: GGML types that never hold these models' weights
_NOT_WEIGHTS = ("I8", "I16", "I32", "I64", "F64")
#: GGML types read as NumPy float arrays
_FLOATS = {"F32": np.float32, "F16": np.float16}

# Hyperparameter bounds: far above the largest models (126 layers, a hidden
# size of 16K, 128 heads, vocabularies of 256K), finite so that no number in
# a file sizes a loop or an allocation without end.
#: most layers (``block_count``)
MAX_LAYERS = 1024
#: widest hidden, feed-forward, head and query sizes
MAX_WIDTH = 1 << 20
#: most attention heads
MAX_HEADS = 1 << 14
#: largest vocabulary
MAX_VOCAB = 1 << 24
#: shortest training context: the decode step needs a prompt token and a reply
MIN_CONTEXT = 2
#: longest training context (llama.cpp keeps it in a uint32)
MAX_CONTEXT = (1 << 32) - 1

_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
             "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_BIASES = ("attn_q", "attn_k", "attn_v")
_QK_NORMS = ("attn_q_norm", "attn_k_norm")
#: gemma3's RMSNorms of the attention and FFN outputs, before the residual add
_POST_NORMS = ("post_attention_norm", "post_ffw_norm")
#: gemma3: the layers of one period of the sliding-window pattern when the
#: file gives none (llama.cpp's ``load_swa_pattern(ml, 6)``)
GEMMA3_SWA_PERIOD = 6


def layer_tensor_names(i: int) -> list[str]:
    """The weights every layer of every supported architecture has."""
    return [f"blk.{i}.{t}.weight" for t in _LAYER_TENSORS]


def kernel_types() -> dict:
    """Role -> the GGML types the decode step has kernels for: ``matrix``
    (a GEMV's weights, the experts' included), ``embedding`` (the row
    gather), ``vector`` (norm weights, biases, RoPE factors: f32) and
    ``router`` (a mixture of experts' ``ffn_gate_inp``: f32, as llama.cpp
    keeps it)."""
    from ptxgen.kernels.quants.qtypes import names_for
    return {"matrix": tuple(names_for("gemv")), "embedding": tuple(names_for("embedding")),
            "vector": ("F32",), "router": ("F32",)}


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
    if short == "ffn_gate_inp":
        return ("router",)
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
    #: gemma3: keys a sliding-window layer's query sees, its own included
    #: (0: every layer attends to the whole sequence)
    sliding_window: int = 0
    #: gemma3: per layer, whether it is a sliding-window (local) layer
    swa_layers: tuple = ()
    #: gemma3: the RoPE base of the local layers (they take no frequency scaling)
    rope_theta_swa: float = 10000.0
    #: the scale of q.k before the softmax (None: 1 / sqrt(head_dim))
    attn_scale: float | None = None

    @property
    def sm_scale(self) -> float:
        """The attention's score scale."""
        return 1.0 / math.sqrt(self.head_dim) if self.attn_scale is None else self.attn_scale

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: none)."""
        return self.sliding_window if self.swa_layers and self.swa_layers[layer] else 0
    #: a mixture of experts (:mod:`.experts`): experts per layer (0: a dense FFN),
    #: experts run per token, an expert's FFN size
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn: int = 0

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
        The file is missing, not a GGUF, truncated or malformed (a
        :class:`GGUFMetadataError`), of an unsupported architecture or
        convention, has a hyperparameter out of range, lacks a tensor, holds
        one it should not, or holds an unsupported tensor type.
    """

    def __init__(self, path, *, check_kernels: bool = True):
        self._setup(read_gguf(path), check_kernels)

    @classmethod
    def from_contents(cls, contents: GGUFContents, *, check_kernels: bool = True) -> "LlamaFile":
        """Validate a file already read by :func:`~.reader.read_gguf`."""
        self = cls.__new__(cls)
        self._setup(contents, check_kernels)
        return self

    def _setup(self, contents: GGUFContents, check_kernels: bool):
        self.contents = contents
        self.path = contents.path
        #: key -> value of the file's metadata (:func:`~.metadata.read_gguf_metadata`'s)
        self.metadata = contents.metadata
        self._tensors = contents.tensors
        self._in_f16 = {}
        self._reader = None
        self.hparams = self._read_hparams()
        self._check_tensors()
        if check_kernels:
            self.check_kernel_types()

    @property
    def reader(self):
        """The ``gguf`` package's reader of this (validated) file, made on
        first use: for the float64 reference and tests, never for loading."""
        if self._reader is None:
            import gguf
            self._reader = gguf.GGUFReader(self.path, "r")
        return self._reader

    # ------------------------------------------------------------ metadata
    def _error(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    def _field(self, key, default=None, required=True):
        v = self.metadata.get(key)
        if v is None:
            if required and default is None:
                raise self._error(f"metadata key {key!r} is missing")
            return default
        return v

    def _uniform(self, key, default=None, required=True):
        """A per-model value that llama.cpp also accepts as one per layer."""
        v = self._field(key, default, required)
        if isinstance(v, np.ndarray):
            n = getattr(self, "_n_layers", None)
            if n is not None and v.size != n:
                raise self._error(f"metadata key {key!r} has {v.size} values for {n} layers")
            if not v.size or np.any(v != v[0]):
                raise self._error(f"metadata key {key!r} differs between layers "
                                  f"({v[:4].tolist()}...); per-layer shapes are not supported")
            v = v[0]
        return v

    def _int(self, key, lo, hi, default=None, *, per_layer=False, why=""):
        """An integer key in ``[lo, hi]``."""
        v = self._uniform(key, default) if per_layer else self._field(key, default)
        v = int(v)
        if not lo <= v <= hi:
            raise self._error(f"metadata key {key!r} is {v:,}; it must be {lo:,} to {hi:,}{why}")
        return v

    def _float(self, key, default=None):
        """A finite positive number key."""
        v = float(self._field(key, default))
        if not (math.isfinite(v) and v > 0):
            raise self._error(f"metadata key {key!r} is {v}; it must be a finite positive "
                              "number")
        return v

    @property
    def arch(self) -> str:
        return self.hparams.arch

    @property
    def alignment(self) -> int:
        return self.contents.alignment

    @property
    def tokenizer_model(self) -> str | None:
        return self._field("tokenizer.ggml.model", required=False)

    def _n_tokens(self) -> int | None:
        toks = self.metadata.get("tokenizer.ggml.tokens")
        return None if toks is None else len(toks)

    def _read_hparams(self) -> LlamaHParams:
        arch = self._field("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise self._error(f"architecture {shown(arch)} is not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        a = arch
        n_layers = self._int(f"{a}.block_count", 1, MAX_LAYERS)
        self._n_layers = n_layers
        experts = None
        if arch in MOE_ARCHS:
            experts = read_experts(self, a, MAX_WIDTH)
        elif int(self._uniform(f"{a}.expert_count", default=0, required=False)) > 0:
            raise self._error(f"metadata key '{a}.expert_count' > 0: mixtures of experts are "
                              f"not supported in a {arch} model (supported: "
                              f"{', '.join(MOE_ARCHS)})")
        if not self._field(f"{a}.attention.causal", default=True, required=False):
            raise self._error(f"metadata key '{a}.attention.causal' is false: non-causal "
                              "attention is not supported")
        hidden = self._int(f"{a}.embedding_length", 1, MAX_WIDTH)
        n_heads = self._int(f"{a}.attention.head_count", 1, MAX_HEADS, per_layer=True)
        n_kv = self._int(f"{a}.attention.head_count_kv", 1, n_heads, default=n_heads,
                         per_layer=True, why=" (attention.head_count)")
        if n_heads % n_kv:
            raise self._error(f"head counts {n_heads}/{n_kv} (keys '{a}.attention.head_count', "
                              f"'{a}.attention.head_count_kv') do not form whole groups")
        head_k = self._int(f"{a}.attention.key_length", 0, MAX_WIDTH, default=hidden // n_heads)
        head_v = self._int(f"{a}.attention.value_length", 0, MAX_WIDTH,
                           default=hidden // n_heads)
        if head_v != head_k:
            raise self._error(f"metadata key '{a}.attention.value_length' ({head_v}) differs "
                              f"from '{a}.attention.key_length' ({head_k}); llama.cpp's {a} "
                              "graph needs one head size")
        rope_dim = self._int(f"{a}.rope.dimension_count", 0, MAX_WIDTH, default=head_k)
        if rope_dim != head_k:
            raise self._error(f"metadata key '{a}.rope.dimension_count' is {rope_dim} of head "
                              f"size {head_k}: partial rotary embeddings are not supported")
        if head_k % 2 or head_k <= 0:
            raise self._error(f"metadata key '{a}.attention.key_length': head size {head_k} is "
                              "not a positive even number")
        if n_heads * head_k > MAX_WIDTH:
            raise self._error(f"{n_heads} heads of size {head_k} (keys "
                              f"'{a}.attention.head_count', '{a}.attention.key_length') make "
                              f"queries wider than {MAX_WIDTH:,}")
        if arch == "qwen2" and n_heads * head_k != hidden:
            raise self._error(f"metadata key 'qwen2.attention.key_length' ({head_k}) x "
                              f"{n_heads} heads is not the hidden size {hidden}, which qwen2's "
                              "query projection has")
        if experts is not None and self._field(f"{a}.feed_forward_length",
                                               required=False) is None:
            ffn = experts.ffn            # llama.cpp reads the dense size of none but a dense FFN
        else:
            ffn = self._int(f"{a}.feed_forward_length", 1, MAX_WIDTH, per_layer=True)
        context = self._int(f"{a}.context_length", MIN_CONTEXT, MAX_CONTEXT,
                            why=" (the decode step needs a prompt token and a reply)")
        eps = self._float(f"{a}.attention.layer_norm_rms_epsilon")
        theta = self._float(f"{a}.rope.freq_base", default=10000.0)
        freq_scale = self._rope_freq_scale(a)
        vocab = self._vocab(a)
        has = self._tensors.__contains__
        extra = self._gemma3_hparams(n_layers, hidden, n_heads, head_k) if arch == "gemma3" else {}
        return LlamaHParams(
            arch=arch, n_layers=n_layers, hidden=hidden, ffn=ffn, n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_k, vocab=vocab, context_length=context, eps=eps,
            rope_theta=theta, rope_dim=rope_dim, rope_layout=ROPE_LAYOUT[arch],
            rope_freq_scale=freq_scale,
            rope_freqs=arch in ("llama", "mistral") and has("rope_freqs.weight"),
            qk_norm=arch in _QK_NORM_ARCHS,
            qkv_bias=any(has(f"blk.{i}.{b}.bias") for i in range(n_layers) for b in _BIASES),
            tied=not has("output.weight"),
            **({} if experts is None else dict(n_expert=experts.n_expert,
                                               n_expert_used=experts.n_used,
                                               expert_ffn=experts.ffn)), **extra)

    def _gemma3_hparams(self, n_layers, hidden, n_heads, head_dim) -> dict:
        """gemma3's own keys, as llama.cpp's ``llama_model_gemma3`` reads them:
        the sliding window (``attention.sliding_window``; absent or 0: every
        layer global), which layers are local (``sliding_window_pattern``: a
        period ``n``, local where ``il % n < n - 1``, default 6; or one bool
        per layer), their RoPE base (``rope.freq_base_swa``, default 10000,
        unscaled) and the attention scale (``1 / sqrt(key_length)``; for
        62 layers, Gemma 3 27B, ``1 / sqrt(embedding_length / head_count)``)."""
        a = "gemma3"
        soft = float(self._field(f"{a}.final_logit_softcapping", default=0.0, required=False))
        if soft != 0.0:
            raise self._error(f"metadata key '{a}.final_logit_softcapping' is {soft}: "
                              "soft-capped logits are not supported")
        for key, full in ((f"{a}.attention.key_length_swa", head_dim),
                          (f"{a}.attention.value_length_swa", head_dim),
                          (f"{a}.rope.dimension_count_swa", head_dim)):
            v = self._field(key, required=False)
            if v is not None and int(v) != full:
                raise self._error(f"metadata key {key!r} is {int(v)}, not the head size "
                                  f"{full}: sliding-window layers of another head size are "
                                  "not supported")
        window = self._int(f"{a}.attention.sliding_window", 0, MAX_CONTEXT, default=0)
        scale = 1.0 / math.sqrt(hidden // n_heads if n_layers == 62 else head_dim)
        if window == 0:
            return dict(attn_scale=scale)
        key = f"{a}.attention.sliding_window_pattern"
        pat = self._field(key, default=GEMMA3_SWA_PERIOD, required=False)
        if isinstance(pat, np.ndarray):
            if pat.size != n_layers or pat.dtype.kind not in "bui":
                raise self._error(f"metadata key {key!r} holds {pat.size} values of type "
                                  f"{pat.dtype}; it needs one bool per layer ({n_layers})")
            local = tuple(bool(b) for b in pat)
        else:
            n = int(pat)
            if not 0 <= n <= MAX_LAYERS:
                raise self._error(f"metadata key {key!r} is {n}; it must be 0 to {MAX_LAYERS} "
                                  "(a period of layers)")
            local = tuple(n == 0 or il % n < n - 1 for il in range(n_layers))
        return dict(sliding_window=window, swa_layers=local, attn_scale=scale,
                    rope_theta_swa=self._float(f"{a}.rope.freq_base_swa", default=10000.0))

    def _rope_freq_scale(self, a) -> float:
        kind = self._field(f"{a}.rope.scaling.type", default="linear", required=False)
        if kind not in ("none", "linear"):
            known = kind in ("yarn", "longrope")
            raise self._error(f"metadata key '{a}.rope.scaling.type' is {shown(kind)}: "
                              + ("this RoPE scaling is not supported" if known else
                                 "not a type llama.cpp knows (none, linear, yarn, longrope)")
                              + "; supported: none, linear")
        attn = float(self._field(f"{a}.rope.scaling.attn_factor", default=1.0, required=False))
        if attn != 1.0:
            raise self._error(f"metadata key '{a}.rope.scaling.attn_factor' is {attn}: scaled "
                              "RoPE magnitudes are not supported")
        key = f"{a}.rope.scaling.factor"
        factor = self._field(key, required=False)
        if factor is None:
            key = f"{a}.rope.scale_linear"
            factor = self._field(key, required=False)
        factor = float(factor or 0.0)
        if not (math.isfinite(factor) and factor >= 0):
            raise self._error(f"metadata key {key!r} is {factor}; it must be a finite "
                              "non-negative number")
        if kind == "none" or factor == 0.0:
            return 1.0
        return 1.0 / factor

    def _vocab(self, a) -> int:
        emb = self._tensors.get("token_embd.weight")
        if emb is None:
            raise self._error("tensor 'token_embd.weight' is missing")
        rows = emb.dims[1] if len(emb.dims) > 1 else 0
        n_tok = self._n_tokens()
        if n_tok is not None:
            vocab, src = n_tok, "the tokenizer's token list (tokenizer.ggml.tokens)"
        else:
            vocab = self._field(f"{a}.vocab_size", required=False)
            src = f"metadata key '{a}.vocab_size'"
            if vocab is None:
                vocab, src = rows, "the embedding"
        vocab = int(vocab)
        if not 1 <= vocab <= MAX_VOCAB:
            raise self._error(f"{src} gives a vocabulary of {vocab:,}; it must be 1 to "
                              f"{MAX_VOCAB:,}")
        if rows != vocab:
            raise self._error(f"tensor 'token_embd.weight' has {rows} rows but {src} gives a "
                              f"vocabulary of {vocab}")
        return vocab

    # ------------------------------------------------------------- tensors
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
                  "attn_output": (H, q), "ffn_norm": (H,)}
        if hp.n_expert:
            shapes.update(expert_shapes(hp))
        else:
            shapes.update(ffn_gate=(hp.ffn, H), ffn_up=(hp.ffn, H), ffn_down=(H, hp.ffn))
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
            if hp.arch == "gemma3":
                for short in _POST_NORMS:
                    out[p + short + ".weight"] = (H,)
        return out

    def _check_tensors(self):
        """Every expected tensor present, of a weight type and its shape; no other."""
        hp = self.hparams
        need = self.expected_tensors()
        missing = [n for n in need if n not in self._tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise self._error(f"tensor {missing[0]!r} is missing{more}")
        extra = [n for n in self._tensors if n not in need]
        if extra:
            raise self._error(f"tensor {shown(extra[0])} is not supported in a {hp.arch} "
                              f"model{_why_extra(extra[0], hp.arch)}")
        for name, shape in need.items():
            qt = self.qtype(name)
            if qt in _NOT_WEIGHTS:
                raise self._error(f"tensor {name!r} has type {qt}, which is not supported "
                                  "(not a weight type)")
            got = self.shape(name)
            if got != shape:
                raise self._error(f"tensor {name!r} has shape {got}, expected {shape}"
                                  f"{self._shape_why(name)}")

    def _shape_why(self, name) -> str:
        """Where an expert tensor's expected shape comes from."""
        short = name.split(".")[-2] if name.startswith("blk.") else ""
        if short not in EXPERT_TENSORS:
            return ""
        a, hp = self.hparams.arch, self.hparams
        what = ("experts x embedding" if short == "ffn_gate_inp" else
                "experts x expert FFN x embedding" if short != "ffn_down_exps" else
                "experts x embedding x expert FFN")
        return (f" ({what}: {hp.n_expert} from '{a}.expert_count', {hp.expert_ffn} from "
                f"'{a}.expert_feed_forward_length', {hp.hidden} from '{a}.embedding_length')")

    def check_kernel_types(self) -> None:
        """Refuse (GGUFError) a tensor whose type has no decode kernel in its
        role (:func:`kernel_types`)."""
        roles = kernel_types()
        tied = self.hparams.tied
        for name in self.expected_tensors():
            qt = self.qtype(name)
            for role in tensor_role(name, tied):
                if qt not in roles[role]:
                    what = {"matrix": "a matrix" + (" (the tied output)" if name ==
                                                    "token_embd.weight" else ""),
                            "embedding": "the embedding", "vector": "a vector",
                            "router": "a mixture of experts' router"}[role]
                    raise self._error(f"tensor {name!r} has type {qt}, which is not supported "
                                      f"for {what} (supported: {', '.join(roles[role])})")

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def qtype(self, name: str) -> str:
        return self._tensors[name].qtype

    def shape(self, name: str) -> tuple:
        """Logical ``(rows, cols)``; GGUF stores dims innermost-first."""
        return self._tensors[name].shape

    def tensor(self, name: str) -> RawTensor:
        """The tensor's stored bytes/values, unconverted: read-only views of
        the file's map."""
        try:
            t = self._tensors[name]
        except KeyError:
            raise self._error(f"tensor {name!r} is missing") from None
        raw = self.contents.data(name)
        shape = t.shape
        if t.qtype in _FLOATS:
            data = raw.view(_FLOATS[t.qtype]).reshape(shape)
        else:
            rows = 1
            for d in shape[:-1]:
                rows *= d
            data = raw.reshape(rows, t.type.row_bytes(shape[-1]))
        return RawTensor(name, t.qtype, shape, data)

    def expert(self, name: str, e: int) -> RawTensor:
        """Expert ``e``'s matrix of the 3-D expert tensor ``name``
        (``[rows, cols]``; its bytes as :meth:`tensor` gives them): a view
        of the file's map."""
        t = self.tensor(name)
        if len(t.shape) != 3:
            raise ValueError(f"tensor {name!r} of shape {t.shape} holds no experts")
        return RawTensor(f"{name}[{e}]", t.qtype, t.shape[1:],
                         expert_slice(t.data, t.shape, e))

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
        no vocabulary).  Built from the metadata already read.

        Raises
        ------
        GGUFError
            The vocabulary cannot be used, or its size is not the model's
            (``token_embd`` rows).
        """
        from ptxgen.llm.text.tokenizer import Tokenizer, TokenizerError
        if self.tokenizer_model in (None, "none"):
            return None
        try:
            tok = Tokenizer.from_metadata(self.metadata)
        except TokenizerError as e:
            raise self._error(str(e)) from None
        if tok.n_vocab != self.hparams.vocab:
            raise self._error(f"the vocabulary has {tok.n_vocab} tokens but the model "
                              f"{self.hparams.vocab} logits")
        return tok

    def dequantized(self, name: str) -> np.ndarray:
        """The tensor in float32 through ``gguf.quants.dequantize``."""
        import gguf
        t = self._tensors[name]
        raw = self.tensor(name).data.view(np.uint8)
        try:
            out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.type.id))
        except NotImplementedError:
            raise self._error(f"tensor {name!r}: the gguf package cannot decode "
                              f"{t.qtype}") from None
        return np.asarray(out, dtype=np.float32).reshape(t.shape)

    def rope_inv_freq(self, local: bool = False) -> np.ndarray:
        """float64 ``[head_dim / 2]``: the angle per position of each
        frequency, ``freq_scale * base^(-2i/d) / factor_i`` (factors from
        ``rope_freqs.weight`` where the architecture applies them); with
        ``local``, a sliding-window layer's: ``rope_theta_swa^(-2i/d)``,
        unscaled (gemma3)."""
        hp = self.hparams
        d = hp.rope_dim
        if local:
            return 1.0 / hp.rope_theta_swa ** (np.arange(0, d, 2, dtype=np.float64) / d)
        f = 1.0 / hp.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
        if hp.rope_freqs:
            fac = self.tensor("rope_freqs.weight").data.astype(np.float64)
            if not np.all(fac > 0) or not np.all(np.isfinite(fac)):
                raise self._error("tensor 'rope_freqs.weight' holds a factor that is not a "
                                  "positive number")
            f = f / fac
        if hp.rope_freq_scale != 1.0:
            f = f * hp.rope_freq_scale
        return f

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())


def _why_extra(name: str, arch: str) -> str:
    short = name.split(".")[-2] if name.count(".") >= 2 else name.split(".")[0]
    if name == "rope_freqs.weight":
        return f" (llama.cpp's {arch} graph applies no RoPE frequency factors)"
    if name.endswith(".bias"):
        return " (only attn_q, attn_k and attn_v biases are)"
    if short == "attn_qkv":
        return " (fused Q/K/V weights are not; separate attn_q, attn_k, attn_v are)"
    if short in _QK_NORMS:
        return " (per-head q/k norms belong to qwen3, qwen3moe and gemma3)"
    if short in _POST_NORMS:
        return " (post-attention and post-FFN norms belong to gemma3)"
    if short in EXPERT_TENSORS or short.endswith(("_exps", "_shexp")):
        return (" (a mixture of experts' router and experts belong to "
                f"{', '.join(MOE_ARCHS)}; shared experts to none)")
    if arch in MOE_ARCHS and short in ("ffn_gate", "ffn_up", "ffn_down"):
        return f" (a {arch} FFN is its experts: ffn_gate_exps, ffn_up_exps, ffn_down_exps)"
    return ""
