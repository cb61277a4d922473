"""The tokenizer stored in a GGUF file: text to token ids and back, as llama.cpp does it.

:class:`Tokenizer` reads the ``tokenizer.*`` metadata of a GGUF file and
reproduces llama.cpp's ``llama_tokenize`` / ``llama_detokenize`` /
``llama_token_to_piece`` for two tokenizer models:

* ``llama`` -- SentencePiece-style: score-ordered merges, byte fallback to
  ``<0xXX>`` tokens, ``▁`` for spaces and a leading space (:mod:`.spm`);
* ``gpt2`` -- byte-level BPE with the pre-tokenizer ``tokenizer.ggml.pre``
  names (:mod:`.bpe`, :mod:`.pretokenize`).

Special tokens: before tokenizing, the text is split around the texts of
special tokens, longest first.  USER_DEFINED tokens are always split out
(as added tokens are in Hugging Face tokenizers); CONTROL and UNKNOWN tokens
only with ``parse_special=True``, so plain text never produces them.

Other tokenizer models (WordPiece, Unigram, RWKV, ...) and pre-tokenizers
not in :data:`SUPPORTED_PRE_TOKENIZERS` are refused with
:class:`TokenizerError`.
"""

from __future__ import annotations

import codecs
import copy
import os

import numpy as np
import regex

from ptxgen.llm.text.bpe import BpeEncoder
from ptxgen.llm.gguf.metadata import read_gguf_metadata
from ptxgen.llm.text.pretokenize import PRE_TOKENIZERS, byte_decode_table
from ptxgen.llm.text.spm import SpmEncoder, spm_piece
from ptxgen.llm.text.vocab import ATTR, SUPPORTED_MODELS, TokenizerError, Vocab

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerError", "SUPPORTED_MODELS",
           "SUPPORTED_PRE_TOKENIZERS"]

#: ``tokenizer.ggml.pre`` values accepted for byte-level BPE vocabularies
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(PRE_TOKENIZERS))

# C isspace(): what a special token's strip attributes remove
_C_SPACE = " \t\n\x0b\x0c\r"
_BYTE_OF = byte_decode_table()
_CLEAN_PUNCT = regex.compile(rb" (?=[?!.,])")
_CLEAN_CONTRACTION = regex.compile(rb" (?='(?:[sm]|re|ve))")


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary.

    Build with :meth:`from_gguf`, :meth:`from_reader` or :meth:`from_metadata`.

    Attributes
    ----------
    model : str
        ``"llama"`` or ``"gpt2"`` (``tokenizer.ggml.model``).
    pre : str
        The pre-tokenizer name (``"default"`` for ``llama``).
    chat_template : str or None
        ``tokenizer.chat_template``, if the file has one.
    """

    def __init__(self, meta: dict):
        self._vocab = Vocab(meta, PRE_TOKENIZERS)
        v = self._vocab
        self.model = v.model
        self.pre = v.pre
        self.chat_template = meta.get("tokenizer.chat_template")
        if v.model == "llama":
            self._encoder = SpmEncoder(v)
        else:
            self._encoder = BpeEncoder(v)
        self._pieces: dict = {}
        # special tokens split out of text, grouped by their first characters
        # so that one search rules out a whole group (e.g. "[PAD...]")
        self._special_groups = {}
        for parse in (False, True):
            groups: dict = {}
            for tid in v.special_tokens:
                if not parse and v.attrs[tid] & (ATTR.CONTROL | ATTR.UNKNOWN):
                    continue
                groups.setdefault(v.tokens[tid][:4], []).append(tid)
            self._special_groups[parse] = list(groups.items())

    # -- construction ------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """Read the tokenizer of a GGUF file (model or vocabulary-only).

        Parameters
        ----------
        path : str or os.PathLike

        Raises
        ------
        GGUFMetadataError
            If the file cannot be read as GGUF.
        TokenizerError
            If it has no tokenizer, or one of an unsupported kind.
        """
        meta = read_gguf_metadata(path)
        try:
            return cls(meta)
        except TokenizerError as e:
            raise TokenizerError(f"{os.fspath(path)}: {e}") from None

    @classmethod
    def from_reader(cls, reader) -> "Tokenizer":
        """Build from an open ``gguf.GGUFReader`` (its ``tokenizer.*``/``general.*`` fields)."""
        meta = {}
        for key, field in reader.fields.items():
            if key.startswith(("tokenizer.", "general.")):
                meta[key] = _field_value(field)
        return cls(meta)

    @classmethod
    def from_metadata(cls, meta: dict) -> "Tokenizer":
        """Build from a dict of GGUF metadata (key -> value, arrays as lists or arrays)."""
        return cls(dict(meta))

    def with_pre_tokenizer(self, pre: str) -> "Tokenizer":
        """This tokenizer with another byte-level BPE pre-tokenizer.

        For a file whose ``tokenizer.ggml.pre`` is missing or wrong (what
        llama.cpp's ``--override-kv tokenizer.ggml.pre=str:NAME`` does).  The
        vocabulary tables and merges are shared with this tokenizer.

        Raises
        ------
        TokenizerError
            For an SPM vocabulary or an unsupported name.
        """
        if self.model != "gpt2":
            raise TokenizerError(f"only byte-level BPE vocabularies have a pre-tokenizer; this "
                                 f"one is {self.model!r}")
        spec = PRE_TOKENIZERS.get(pre)
        if spec is None:
            raise TokenizerError(f"pre-tokenizer {pre!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}")
        other = copy.copy(self)
        other._vocab = self._vocab.with_pre(pre, spec)
        other.pre = pre
        other._encoder = self._encoder.with_pre(other._vocab)
        return other

    # -- properties --------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        """Number of tokens."""
        return len(self._vocab)

    @property
    def bos_id(self):
        """Beginning-of-sequence id, or ``None``."""
        return self._vocab.special["bos"]

    @property
    def eos_id(self):
        """End-of-sequence id, or ``None``."""
        return self._vocab.special["eos"]

    @property
    def eot_id(self):
        """End-of-turn id (``<|eot_id|>``, ``<|im_end|>``, ...), or ``None``."""
        return self._vocab.special["eot"]

    @property
    def eog_ids(self) -> frozenset:
        """Ids that end generation: EOS, EOT, EOM and the vocabulary's end markers."""
        return self._vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        """Whether :meth:`encode` with ``add_special`` prepends BOS."""
        return self._vocab.add_bos

    @property
    def add_eos(self) -> bool:
        """Whether :meth:`encode` with ``add_special`` appends EOS."""
        return self._vocab.add_eos

    @property
    def add_space_prefix(self) -> bool:
        """Whether a space is prepended to text (SPM)."""
        return self._vocab.add_space_prefix

    @property
    def clean_spaces(self) -> bool:
        """Whether :meth:`decode` removes spaces before punctuation and contractions."""
        return self._vocab.clean_spaces

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation."""
        return token in self._vocab.eog_ids

    def token_text(self, token: int) -> str:
        """The token's text as stored in the vocabulary (``▁``/byte alphabet intact)."""
        return self._vocab.tokens[self._check_id(token)]

    def token_attr(self, token: int) -> int:
        """The token's attribute bits (:class:`~.vocab.ATTR`)."""
        return self._vocab.attrs[self._check_id(token)]

    # -- encoding ----------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``.

        Parameters
        ----------
        text : str
        add_special : bool
            Add BOS/EOS as the vocabulary asks (:attr:`add_bos`, :attr:`add_eos`).
        parse_special : bool
            Turn the texts of CONTROL tokens (``<|eot_id|>``, ``<s>``, ...)
            into those tokens; without it they are tokenized as plain text.

        Returns
        -------
        list of int
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"text is not encodable as UTF-8 at index {e.start}: "
                                 f"{text[e.start:e.end]!r}") from None
        v = self._vocab
        out: list[int] = []
        if add_special and v.add_bos:
            if v.special["bos"] is None:
                raise TokenizerError("the vocabulary asks for a BOS token but has none")
            out.append(v.special["bos"])
        fragments = self._partition(text, parse_special) if text else []
        encode = self._encoder.encode
        if v.model == "llama":
            prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if v.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(encode(frag.replace(" ", "\u2581")))
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(encode(frag))
        if add_special and v.add_eos:
            if v.special["eos"] is None:
                raise TokenizerError("the vocabulary asks for an EOS token but has none")
            out.append(v.special["eos"])
        return out

    def _partition(self, text: str, parse_special: bool) -> list:
        """Split text around special tokens: a list of str fragments and int ids."""
        v = self._vocab
        frags: list = [text]
        present = set()
        for prefix, group in self._special_groups[bool(parse_special)]:
            if prefix in text:
                present.update(tid for tid in group if v.tokens[tid] in text)
        if not present:
            return frags
        for tid in v.special_tokens:
            if tid not in present:
                continue
            attr = v.attrs[tid]
            tt = v.tokens[tid]
            out = []
            for f in frags:
                if isinstance(f, int) or tt not in f:
                    out.append(f)
                else:
                    _split_at_token(f, tt, tid, attr, out)
            frags = out
        return frags

    # -- decoding ----------------------------------------------------------------

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes one token stands for.

        Returns ``bytes``, not ``str``: a byte-fallback token or part of a
        byte-level token is a fragment of a UTF-8 sequence.  CONTROL and
        UNKNOWN tokens give ``b""`` unless ``special``; USER_DEFINED tokens
        always give their text.
        """
        attr = self._vocab.attrs[self._check_id(token)]
        if not special and attr & (ATTR.CONTROL | ATTR.UNKNOWN):
            return b""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._piece(token)
        return piece

    def _piece(self, token: int) -> bytes:
        v = self._vocab
        if v.model == "llama":
            return spm_piece(v, token)
        text = v.tokens[token]
        attr = v.attrs[token]
        if attr & (ATTR.UNKNOWN | ATTR.CONTROL | ATTR.USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if attr & ATTR.NORMAL:
            out = bytearray()
            for ch in text:
                b = _BYTE_OF.get(ch)
                if b is None:
                    # not in the byte alphabet: llama.cpp writes a marker
                    code = ch.encode("utf-8", "surrogateescape").hex()
                    out += f"[UNK_BYTE_0x{code}{text}]".encode("utf-8", "surrogateescape")
                else:
                    out.append(b)
            return bytes(out)
        if attr & ATTR.BYTE:
            return bytes([int(text[3:5], 16)])
        return b""

    def decode_bytes(self, ids, special: bool = False) -> bytes:
        """The bytes of a token sequence (see :meth:`decode`)."""
        v = self._vocab
        remove_space = v.add_space_prefix
        out = bytearray()
        for t in ids:
            piece = self.token_to_piece(t, special)
            if remove_space and piece[:1] == b" ":
                piece = piece[1:]
            remove_space = False
            out += piece
        if v.clean_spaces:
            out = _CLEAN_PUNCT.sub(b"", out)
            out = out.replace(b" ' ", b"'")
            out = _CLEAN_CONTRACTION.sub(b"", out)
        return bytes(out)

    def decode(self, ids, special: bool = False) -> str:
        """Text of a token sequence, as llama.cpp's ``llama_detokenize``.

        Parameters
        ----------
        ids : iterable of int
        special : bool
            Render CONTROL tokens (``<|eot_id|>``, ...) as their text.

        Notes
        -----
        With :attr:`add_space_prefix` the first token's leading space is
        dropped (it is the one :meth:`encode` added); with
        :attr:`clean_spaces` a space before ``? ! . ,`` and before ``'s 'm
        're 've`` is dropped and `` ' `` becomes ``'``.  Bytes that do not
        form valid UTF-8 become U+FFFD.
        """
        return self.decode_bytes(ids, special).decode("utf-8", "replace")

    def stream_decoder(self, special: bool = False) -> "StreamDecoder":
        """A decoder for tokens arriving one at a time (see :class:`StreamDecoder`)."""
        return StreamDecoder(self, special)

    # -- chat --------------------------------------------------------------------

    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            template: str | None = None, **extra) -> str:
        """Render ``messages`` with the file's chat template (see :func:`.chat_template.render_chat`)."""
        from ptxgen.llm.text.chat_template import render_chat

        v = self._vocab
        bos = v.special["bos"]
        eos = v.special["eos"]
        return render_chat(
            self.chat_template if template is None else template, messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=v.tokens[bos] if bos is not None else "",
            eos_token=v.tokens[eos] if eos is not None else "", **extra)

    # -- helpers -----------------------------------------------------------------

    def _check_id(self, token) -> int:
        if isinstance(token, np.integer):
            token = int(token)
        elif isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(f"token id must be an int, got {type(token).__name__}")
        if not 0 <= token < len(self._vocab):
            raise ValueError(f"token id {token} is out of range for a vocabulary of "
                             f"{len(self._vocab)} tokens")
        return token

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab})"


def _field_value(field):
    """The value of a ``gguf.ReaderField`` (``contents()`` where the package has it)."""
    if hasattr(field, "contents"):
        return field.contents()
    # older gguf packages: parts indexed by data; type codes 8 = string, 9 = array
    def text(part):
        return bytes(part).decode("utf-8", "surrogateescape")
    types = list(field.types)
    if types[0] == 9:
        if types[-1] == 8:
            return [text(field.parts[i]) for i in field.data]
        return np.concatenate([np.asarray(field.parts[i]).ravel() for i in field.data])
    if types[0] == 8:
        return text(field.parts[field.data[0]])
    return np.asarray(field.parts[field.data[0]]).ravel()[0].item()


def _split_at_token(f: str, tt: str, tid: int, attr: int, out: list) -> None:
    """Split fragment ``f`` at each occurrence of special token text ``tt``."""
    base, end = 0, len(f)
    while True:
        m = f.find(tt, base, end)
        if m < 0:
            if base < end:
                out.append(f[base:end])
            return
        left_end = m
        if attr & ATTR.LSTRIP:
            while left_end > base and f[left_end - 1] in _C_SPACE:
                left_end -= 1
        if left_end > base:
            out.append(f[base:left_end])
        out.append(tid)
        base = m + len(tt)
        if base >= end:
            return
        if attr & ATTR.RSTRIP:
            while base < end and f[base] in _C_SPACE:
                base += 1


class StreamDecoder:
    """Decodes tokens one at a time, holding back incomplete UTF-8 sequences.

    ``feed(id)`` returns the text that is complete so far (possibly ``""``);
    ``flush()`` returns what is left, with any incomplete sequence as U+FFFD.
    The pieces are :meth:`Tokenizer.token_to_piece` joined without the
    first-token space removal or space clean-up of :meth:`Tokenizer.decode`,
    as a generated continuation is shown.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self._tok = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token: int) -> str:
        """Add one token; return the newly completed text."""
        return self._utf8.decode(self._tok.token_to_piece(token, self._special))

    def flush(self) -> str:
        """Return the held-back bytes (as U+FFFD if incomplete) and reset."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out
