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
from ptxgen.llm.text.vocab import (ATTR, SUPPORTED_MODELS, LongWords, TokenizerError,
                                   TokenLimitError, Vocab)

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerError", "TokenLimitError", "SUPPORTED_MODELS",
           "SUPPORTED_PRE_TOKENIZERS"]

#: ``tokenizer.ggml.pre`` values accepted for byte-level BPE vocabularies
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(PRE_TOKENIZERS))

# under a token limit: the characters of long words (longer than the second
# number) one text may hold, for byte-level BPE and for SentencePiece
_LONG_WORDS = {"gpt2": (1 << 20, 1024), "llama": (1 << 18, 1024)}

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

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False,
               max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``.

        Parameters
        ----------
        text : str
        add_special : bool
            Add BOS/EOS as the vocabulary asks (:attr:`add_bos`, :attr:`add_eos`).
        parse_special : bool
            Turn the texts of CONTROL tokens (``<|eot_id|>``, ``<s>``, ...)
            into those tokens; without it they are tokenized as plain text.
        max_tokens : int, optional
            Refuse text that needs more tokens, before tokenizing it all (see
            :meth:`encode_parts`).

        Returns
        -------
        list of int

        Raises
        ------
        TokenLimitError
            With ``max_tokens``, for text that needs more.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self.encode_parts(self.split_special(text, parse_special) if text else [],
                                 add_special=add_special, max_tokens=max_tokens)

    def encode_parts(self, parts, add_special: bool = True,
                     max_tokens: int | None = None) -> list[int]:
        """Token ids of text already split around its special tokens.

        Parameters
        ----------
        parts : list of (str or int)
            Text, tokenized as plain text (no special token is cut out of
            it: :meth:`split_special` does that), and token ids, kept; in
            order.
        add_special : bool
            Add BOS/EOS as the vocabulary asks.
        max_tokens : int, optional
            The most ids allowed.  Text that needs more is refused before
            it is all tokenized: first by a bound from its length (no token
            stands for more bytes than the vocabulary's longest), then as
            the count passes the limit (a long word bounded by its length
            first), so the work done stays near what ``max_tokens`` tokens
            of text cost.

        Raises
        ------
        TokenLimitError
            With ``max_tokens``, for text that needs more.
        """
        if max_tokens is not None and (isinstance(max_tokens, bool)
                                       or not isinstance(max_tokens, int) or max_tokens < 0):
            raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        v = self._vocab
        parts = list(parts)
        nbytes = 0
        for p in parts:
            if isinstance(p, str):
                nbytes += _utf8_length(p)
            elif isinstance(p, bool) or not isinstance(p, (int, np.integer)):
                raise TypeError(f"a part is a str or a token id, got {type(p).__name__}")
        out: list[int] = []
        if add_special and v.add_bos:
            if v.special["bos"] is None:
                raise TokenizerError("the vocabulary asks for a BOS token but has none")
            out.append(v.special["bos"])
        add_eos = add_special and v.add_eos
        if add_eos and v.special["eos"] is None:
            raise TokenizerError("the vocabulary asks for an EOS token but has none")
        limit = None
        if max_tokens is not None:
            limit = max_tokens - add_eos
            longest = self._longest_piece()
            if longest:
                at_least = (len(out) + sum(not isinstance(p, str) for p in parts)
                            + -(-nbytes // longest))
                if at_least > limit:
                    raise self._over(max_tokens, at_least + add_eos, "by its length")
        encode = self._encoder.encode
        spm = v.model == "llama"
        long_words = None if limit is None else LongWords(*_LONG_WORDS[v.model])
        prev_special = True
        for part in parts:
            if not isinstance(part, str):
                out.append(int(part))
                prev_special = True
                continue
            if spm:
                if v.add_space_prefix and prev_special:
                    part = " " + part
                part = part.replace(" ", "\u2581")
            prev_special = False
            if limit is None:
                out.extend(encode(part))
                continue
            try:
                out.extend(encode(part, limit - len(out), long_words))
            except TokenLimitError as e:
                raise self._over(max_tokens, len(out) + e.at_least + add_eos) from None
        if limit is not None and len(out) > limit:
            raise self._over(max_tokens, len(out) + add_eos)
        if add_eos:
            out.append(v.special["eos"])
        return out

    @staticmethod
    def _over(max_tokens: int, at_least: int, how: str = "") -> TokenLimitError:
        how = f" {how}" if how else ""
        return TokenLimitError(f"the text needs at least {at_least} tokens{how}, more than the "
                               f"limit of {max_tokens}", max_tokens, at_least)

    def _longest_piece(self) -> int:
        """The most bytes one token stands for (0: no length bound holds)."""
        longest = self.__dict__.get("_longest")
        if longest is None:
            v = self._vocab
            longest = max(len(self._piece(i)) for i in range(len(v)))
            if v.model == "gpt2" and not all(c in v.token_to_id for c in _BYTE_OF):
                longest = 0   # a byte without a token is dropped: no bound
            self._longest = longest
        return longest

    def split_special(self, text: str, parse_special: bool = True) -> list:
        """``text`` cut around its special tokens: str pieces and int ids.

        USER_DEFINED tokens are always cut out; CONTROL and UNKNOWN tokens
        only with ``parse_special``.  A token's LSTRIP/RSTRIP attribute drops
        the whitespace before/after it.  :meth:`encode_parts` tokenizes the
        result.
        """
        return [text[p[0]:p[1]] if isinstance(p, tuple) else p
                for p in self.special_spans(text, parse_special)]

    def special_spans(self, text: str, parse_special: bool = True) -> list:
        """:meth:`split_special` as positions: ``(start, end)`` of each text
        piece, and int ids."""
        if not isinstance(text, str):
            raise TypeError(f"expected a str, got {type(text).__name__}")
        v = self._vocab
        frags: list = [(0, len(text))] if text else []
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
                if isinstance(f, int) or text.find(tt, f[0], f[1]) < 0:
                    out.append(f)
                else:
                    _split_at_token(text, f[0], f[1], tt, tid, attr, out)
            frags = out
        return frags

    @property
    def control_texts(self) -> tuple:
        """Texts of the special tokens that only ``parse_special`` turns into
        tokens (CONTROL and UNKNOWN), longest first."""
        texts = self.__dict__.get("_control_texts")
        if texts is None:
            v = self._vocab
            texts = self._control_texts = tuple(
                v.tokens[t] for t in v.special_tokens if v.attrs[t] & (ATTR.CONTROL | ATTR.UNKNOWN))
        return texts

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
        """Render ``messages`` with a chat template (see :func:`.chat_template.render_chat`):
        ``template``, or the file's own (:func:`.chat_template.file_template`:
        ChatML, with a warning, when the file's cannot be used)."""
        from ptxgen.llm.text.chat_template import file_template, render_chat

        v = self._vocab
        bos = v.special["bos"]
        eos = v.special["eos"]
        return render_chat(
            file_template(self) if template is None else template, messages,
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


def _utf8_length(text: str) -> int:
    if text.isascii():
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not encodable as UTF-8 at index {e.start}: "
                         f"{text[e.start:e.end]!r}") from None


def _split_at_token(text: str, base: int, end: int, tt: str, tid: int, attr: int,
                    out: list) -> None:
    """Split ``text[base:end]`` at each occurrence of special token text ``tt``."""
    while True:
        m = text.find(tt, base, end)
        if m < 0:
            if base < end:
                out.append((base, end))
            return
        left_end = m
        if attr & ATTR.LSTRIP:
            while left_end > base and text[left_end - 1] in _C_SPACE:
                left_end -= 1
        if left_end > base:
            out.append((base, left_end))
        out.append(tid)
        base = m + len(tt)
        if base >= end:
            return
        if attr & ATTR.RSTRIP:
            while base < end and text[base] in _C_SPACE:
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
