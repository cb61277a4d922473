"""Reading Llama-architecture GGUF files: hyperparameters and raw tensors.

Built on the ``gguf`` package's reader.  Tensors stay in their own format
(Q4_K, Q6_K, Q8_0, F16, F32): :meth:`LlamaFile.tensor` returns the raw bytes
as a ``uint8`` array of shape ``[rows, row_bytes]`` (or a float array for
F16/F32) without converting anything.  A file that is not a GGUF, is
truncated, is of another architecture, lacks a tensor or holds an
unsupported tensor type is refused with :class:`GGUFError`, naming the file
and the problem.
"""

from __future__ import annotations

import os

import attrs
import numpy as np

__all__ = ["GGUFError", "LlamaHParams", "LlamaFile", "SUPPORTED_ARCHS", "SUPPORTED_TYPES",
           "layer_tensor_names"]

#: architectures whose tensors and rope layout match llama's
SUPPORTED_ARCHS = ("llama", "mistral")
#: GGML type name -> (weights per block, bytes per block)
SUPPORTED_TYPES = {"F32": (1, 4), "F16": (1, 2), "Q8_0": (32, 34), "Q4_K": (256, 144),
                   "Q6_K": (256, 210)}

_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


class GGUFError(ValueError):
    """A GGUF file that cannot be used, and why."""


def layer_tensor_names(i: int) -> list[str]:
    return [f"blk.{i}.{t}.weight" for t in _LAYER_TENSORS]


@attrs.frozen
class LlamaHParams:
    """Hyperparameters of a Llama-style decoder, from GGUF metadata."""

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
    #: Llama-3 frequency scaling (factor, low_freq_factor, high_freq_factor,
    #: original_context) or None
    rope_scaling: tuple | None = None

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
    """An open, validated Llama GGUF file.

    Parameters
    ----------
    path : str or os.PathLike
        The ``.gguf`` file.

    Raises
    ------
    GGUFError
        The file is missing, not a GGUF, truncated, of an unsupported
        architecture, lacks a tensor, or holds an unsupported tensor type.
    """

    def __init__(self, path):
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
            raise GGUFError(f"{self.path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._check_extents()
        self.hparams = self._read_hparams()
        self._check_tensors()

    # ------------------------------------------------------------ metadata
    def _field(self, key, default=None, required=True):
        f = self.reader.fields.get(key)
        if f is None:
            if required and default is None:
                raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
            return default
        v = f.contents()
        return v

    def _read_hparams(self) -> LlamaHParams:
        arch = self._field("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise GGUFError(f"{self.path}: architecture {arch!r} is not supported "
                            f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        a = arch
        hidden = int(self._field(f"{a}.embedding_length"))
        n_heads = int(self._field(f"{a}.attention.head_count"))
        n_kv = int(self._field(f"{a}.attention.head_count_kv", default=n_heads))
        head_dim = hidden // n_heads
        emb = self._tensors.get("token_embd.weight")
        vocab = self._field(f"{a}.vocab_size", required=False)
        if vocab is None:
            if emb is None:
                raise GGUFError(f"{self.path}: tensor 'token_embd.weight' is missing")
            vocab = int(emb.shape[1])
        scaling = None
        if self._field(f"{a}.rope.scaling.type", required=False) == "llama3":
            scaling = (float(self._field(f"{a}.rope.scaling.factor")),
                       float(self._field(f"{a}.rope.scaling.low_freq_factor", default=1.0)),
                       float(self._field(f"{a}.rope.scaling.high_freq_factor", default=4.0)),
                       int(self._field(f"{a}.rope.scaling.original_context_length", default=8192)))
        hp = LlamaHParams(
            arch=arch,
            n_layers=int(self._field(f"{a}.block_count")),
            hidden=hidden,
            ffn=int(self._field(f"{a}.feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            vocab=int(vocab),
            context_length=int(self._field(f"{a}.context_length", default=4096)),
            eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon", default=1e-5)),
            rope_theta=float(self._field(f"{a}.rope.freq_base", default=10000.0)),
            rope_dim=int(self._field(f"{a}.rope.dimension_count", default=head_dim)),
            rope_scaling=scaling,
        )
        if hidden % n_heads or n_heads % n_kv:
            raise GGUFError(f"{self.path}: head counts {n_heads}/{n_kv} do not divide "
                            f"hidden size {hidden} into whole groups")
        if hp.rope_dim != head_dim:
            raise GGUFError(f"{self.path}: partial rotary embeddings (rope dim {hp.rope_dim} "
                            f"of head dim {head_dim}) are not supported")
        return hp

    # ------------------------------------------------------------- tensors
    def _check_extents(self):
        size = os.path.getsize(self.path)
        for t in self.reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise GGUFError(f"{self.path}: truncated: tensor {t.name!r} ends at byte "
                                f"{end} but the file has {size}")

    def _check_tensors(self):
        hp = self.hparams
        need = ["token_embd.weight", "output_norm.weight"]
        for i in range(hp.n_layers):
            need += layer_tensor_names(i)
        missing = [n for n in need if n not in self._tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise GGUFError(f"{self.path}: tensor {missing[0]!r} is missing{more}")
        for name in need + (["output.weight"] if "output.weight" in self._tensors else []):
            t = self._tensors[name]
            qt = t.tensor_type.name
            if qt not in SUPPORTED_TYPES:
                raise GGUFError(f"{self.path}: tensor {name!r} has type {qt}, which is not "
                                f"supported (supported: {', '.join(SUPPORTED_TYPES)})")
        expect = {
            "attn_q": (hp.q_dim, hp.hidden), "attn_k": (hp.kv_dim, hp.hidden),
            "attn_v": (hp.kv_dim, hp.hidden), "attn_output": (hp.hidden, hp.q_dim),
            "ffn_gate": (hp.ffn, hp.hidden), "ffn_up": (hp.ffn, hp.hidden),
            "ffn_down": (hp.hidden, hp.ffn),
        }
        for i in range(hp.n_layers):
            for short, (rows, cols) in expect.items():
                name = f"blk.{i}.{short}.weight"
                got = self.shape(name)
                if got != (rows, cols):
                    raise GGUFError(f"{self.path}: tensor {name!r} has shape {got}, "
                                    f"expected {(rows, cols)}")

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

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
        if qt not in SUPPORTED_TYPES:
            raise GGUFError(f"{self.path}: tensor {name!r} has unsupported type {qt}")
        shape = self.shape(name)
        data = np.asarray(t.data)
        if qt in ("F32", "F16"):
            data = data.reshape(shape)
        else:
            per, nbytes = SUPPORTED_TYPES[qt]
            rows = 1 if len(shape) == 1 else shape[0]
            data = data.view(np.uint8).reshape(rows, -1)
            if data.shape[1] != shape[-1] // per * nbytes:
                raise GGUFError(f"{self.path}: tensor {name!r} has {data.shape[1]} bytes "
                                f"per row, expected {shape[-1] // per * nbytes}")
        return RawTensor(name, qt, shape, data)

    def tokenizer(self):
        """The file's :class:`~.tokenizer.Tokenizer`, or None when it has no
        ``tokenizer.ggml.model``.

        Raises
        ------
        GGUFError
            The vocabulary cannot be used, or its size is not the model's
            (``token_embd`` rows).
        """
        from .tokenizer import Tokenizer, TokenizerError
        if "tokenizer.ggml.model" not in self.reader.fields:
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
        out = self._gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(out, dtype=np.float32).reshape(self.shape(name))

    @property
    def weight_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.reader.tensors)
