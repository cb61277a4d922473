"""A GGUF vocabulary as llama.cpp reads it: tokens, attributes, special ids, flags.

:class:`Vocab` turns the ``tokenizer.*`` metadata of a GGUF file into the
tables the tokenizer works from, following the rules llama.cpp applies when
it loads a model (``llama_vocab::impl::load`` in ``src/llama-vocab.cpp``):

* token attributes come from ``tokenizer.ggml.token_type`` (NORMAL,
  UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE);
* default special ids depend on the tokenizer model (SPM: BOS 1, EOS 2,
  UNK 0; byte-level BPE: BOS = EOS = 11) and are replaced by the
  ``tokenizer.ggml.*_token_id`` keys when present and in range;
* ``add_bos``/``add_space_prefix``/``clean_spaces``/``ignore_merges`` have
  per-model and per-pre-tokenizer defaults that the ``add_*`` keys override;
* end-of-turn and fill-in-the-middle tokens missing from the metadata are
  found by their text, and such tokens become CONTROL tokens;
* the end-of-generation set is EOS, EOT, EOM, the FIM pad/repo/separator
  tokens and every token whose text is one of the well-known end markers;
* the special tokens split out of text before tokenizing are the CONTROL,
  USER_DEFINED and UNKNOWN tokens, longest text first.
"""

from __future__ import annotations

import copy

import numpy as np

__all__ = ["Vocab", "TokenizerError", "TokenLimitError", "ATTR", "TOKEN_TYPE", "LongWords"]


class TokenizerError(ValueError):
    """A vocabulary or tokenizer setting that cannot be used, and why."""


class TokenLimitError(TokenizerError):
    """Text that needs more tokens than allowed.

    Attributes
    ----------
    limit : int
        The most tokens allowed.
    at_least : int
        How many tokens the text needs at least (found before tokenizing
        all of it).
    """

    def __init__(self, message: str, limit: int, at_least: int):
        super().__init__(message)
        self.limit = limit
        self.at_least = at_least


class LongWords:
    """How many characters of long words a tokenization under a token limit
    may still merge.

    Merging a word costs about a microsecond per character in ``tokenizers``
    (byte-level BPE) and several in the SentencePiece merge here, however
    few tokens it makes: ten megabytes of spaces are 78k tokens of a Llama 3
    vocabulary and ten seconds of merging.  Under a token limit (untrusted
    text, a KV cache's room) the long words of one text may hold at most
    ``chars`` characters together; more is refused.
    """

    def __init__(self, chars: int, longer_than: int):
        self.left = chars
        self.chars = chars
        self.longer_than = longer_than

    def take(self, word: str) -> None:
        """Count a word; refuse it when the long words are too many characters."""
        if len(word) > self.longer_than:
            self.left -= len(word)
            if self.left < 0:
                raise TokenizerError(
                    f"the text's words of more than {self.longer_than} characters (one of "
                    f"{len(word)}) add up to more than {self.chars} characters, more than a "
                    "tokenization under a token limit merges (merging costs time per "
                    "character however few tokens it makes); split such runs of characters")


class TOKEN_TYPE:
    """Values of ``tokenizer.ggml.token_type``."""

    UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)


class ATTR:
    """Token attribute bits (the same values as llama.cpp's ``llama_token_attr``)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8


_TYPE_TO_ATTR = {
    TOKEN_TYPE.UNDEFINED: ATTR.UNDEFINED, TOKEN_TYPE.NORMAL: ATTR.NORMAL,
    TOKEN_TYPE.UNKNOWN: ATTR.UNKNOWN, TOKEN_TYPE.CONTROL: ATTR.CONTROL,
    TOKEN_TYPE.USER_DEFINED: ATTR.USER_DEFINED, TOKEN_TYPE.UNUSED: ATTR.UNUSED,
    TOKEN_TYPE.BYTE: ATTR.BYTE,
}

# texts by which a missing special id is found (the first present one)
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
                "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
                "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
                "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# every token with one of these texts ends generation
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
))
# tokens always rendered as text (a chat format that shows them)
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# metadata key suffix -> special id field
_SPECIAL_KEYS = (
    ("bos_token_id", "bos"), ("eos_token_id", "eos"), ("eot_token_id", "eot"),
    ("eom_token_id", "eom"), ("unknown_token_id", "unk"), ("seperator_token_id", "sep"),
    ("padding_token_id", "pad"), ("mask_token_id", "mask"),
    ("fim_pre_token_id", "fim_pre"), ("fim_suf_token_id", "fim_suf"),
    ("fim_mid_token_id", "fim_mid"), ("fim_pad_token_id", "fim_pad"),
    ("fim_rep_token_id", "fim_rep"), ("fim_sep_token_id", "fim_sep"),
    ("prefix_token_id", "fim_pre"), ("suffix_token_id", "fim_suf"),
    ("middle_token_id", "fim_mid"),
)

#: tokenizer models this package implements (``tokenizer.ggml.model``)
SUPPORTED_MODELS = ("llama", "gpt2")


def _meta_get(meta, key, default=None):
    value = meta.get(key, default)
    if isinstance(value, np.generic):
        value = value.item()
    return value


class Vocab:
    """The tables of one GGUF vocabulary (see the module docstring).

    Parameters
    ----------
    meta : dict
        GGUF metadata: at least ``tokenizer.ggml.model`` and
        ``tokenizer.ggml.tokens``; the other ``tokenizer.*`` keys as present.
    pre_specs : dict
        Pre-tokenizer name -> an object with ``add_bos``, ``clean_spaces``
        and ``ignore_merges`` (the pre-tokenizer's defaults), for the names
        the caller implements; a BPE vocabulary naming another pre-tokenizer,
        or none, is refused.

    Attributes
    ----------
    model : str
        ``"llama"`` (SentencePiece-style) or ``"gpt2"`` (byte-level BPE).
    pre : str
        The pre-tokenizer name (``"default"`` for SPM).
    tokens : list of str
    scores : numpy.ndarray of float32 or None
    attrs : list of int
        Attribute bits per token (:class:`ATTR`).
    token_to_id : dict
        Text -> id; the last of duplicate texts wins, as in llama.cpp.
    merges : list of tuple(str, str)
        BPE merges in rank order (empty for SPM).
    special : dict
        ``bos``, ``eos``, ``eot``, ``eom``, ``unk``, ``sep``, ``pad``, ``mask``,
        ``fim_*`` -> id or ``None``.
    add_bos, add_eos, add_space_prefix, clean_spaces, ignore_merges : bool
    eog_ids : frozenset of int
    special_tokens : list of int
        Ids split out of text before tokenizing, longest text first.
    """

    def __init__(self, meta: dict, pre_specs=None):
        pre_specs = pre_specs or {}
        model = _meta_get(meta, "tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("GGUF metadata has no 'tokenizer.ggml.model': the file carries "
                                 "no tokenizer")
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(f"tokenizer model {model!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_MODELS)} (SentencePiece-style 'llama' "
                                 "and byte-level BPE 'gpt2')")
        self.model = model
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None or len(tokens) == 0:
            raise TokenizerError("GGUF metadata has no 'tokenizer.ggml.tokens' array")
        if all(tokens):
            self.tokens = list(tokens)
        else:
            self.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(self.tokens)
        self.token_to_id = dict(zip(self.tokens, range(n)))

        scores = meta.get("tokenizer.ggml.scores")
        if scores is not None:
            scores = np.asarray(scores, dtype=np.float32)
            if scores.shape[0] < n:
                raise TokenizerError(f"tokenizer.ggml.scores has {scores.shape[0]} entries for "
                                     f"{n} tokens")
        self.scores = scores
        types = meta.get("tokenizer.ggml.token_type")
        if types is not None:
            types = np.asarray(types)
            if types.shape[0] < n:
                raise TokenizerError(f"tokenizer.ggml.token_type has {types.shape[0]} entries "
                                     f"for {n} tokens")
            table = np.array([_TYPE_TO_ATTR.get(t, ATTR.UNDEFINED) for t in range(8)], np.int64)
            types = types[:n].astype(np.int64)
            types[(types < 0) | (types > 7)] = 7
            self.attrs = table[types].tolist()
        else:
            self.attrs = [ATTR.NORMAL] * n

        self._read_flags(meta, pre_specs)
        self._read_merges(meta)
        self._read_special_ids(meta, n)
        self._meta_add_bos = _meta_get(meta, "tokenizer.ggml.add_bos_token")
        if self._meta_add_bos is not None:
            self.add_bos = bool(self._meta_add_bos)
        self.add_eos = bool(_meta_get(meta, "tokenizer.ggml.add_eos_token", self.add_eos))
        self._find_special_by_text()
        self._mark_unused()
        self._build_eog()
        mask = ATTR.CONTROL | ATTR.USER_DEFINED | ATTR.UNKNOWN
        self.special_tokens = sorted(
            np.flatnonzero(np.asarray(self.attrs) & mask).tolist(),
            key=lambda i: -len(self.tokens[i].encode("utf-8", "surrogateescape")))
        self._strip_attrs(meta)

    # -- flags ---------------------------------------------------------------

    def _read_flags(self, meta, pre_specs):
        pre = _meta_get(meta, "tokenizer.ggml.pre")
        self.add_eos = False
        self.ignore_merges = False
        self.bos_disabled = False
        if self.model == "llama":
            self.pre = "default" if pre is None else pre
            self.add_bos = True
            self.add_space_prefix = True
            self.clean_spaces = False
        else:
            names = ", ".join(sorted(pre_specs))
            if pre is None:
                raise TokenizerError(
                    "GGUF metadata has no 'tokenizer.ggml.pre': the byte-level BPE pre-tokenizer "
                    "is unknown (llama.cpp falls back to 'default' with a warning; this "
                    f"tokenizer refuses to guess). Supported: {names}")
            if pre not in pre_specs:
                raise TokenizerError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not "
                                     f"supported; supported: {names}")
            spec = pre_specs[pre]
            self.pre = pre
            self.add_bos = spec.add_bos
            self.add_space_prefix = False
            self.clean_spaces = spec.clean_spaces
            self.ignore_merges = spec.ignore_merges
        self.add_space_prefix = bool(_meta_get(meta, "tokenizer.ggml.add_space_prefix",
                                               self.add_space_prefix))

    def _read_merges(self, meta):
        self.merges = []
        if self.model != "gpt2":
            return
        raw = meta.get("tokenizer.ggml.merges")
        if raw is None:
            raise TokenizerError("byte-level BPE vocabulary without 'tokenizer.ggml.merges'")
        if len(set(raw)) != len(raw):
            # llama.cpp keeps the first rank of a repeated merge
            raw = list(dict.fromkeys(raw))
        # "a b", split at the first space after the first character
        merges = [tuple(m.split(" ")) for m in raw]
        if not all(len(m) == 2 and m[0] for m in merges):
            merges = []
            for m in raw:
                pos = m.find(" ", 1)
                merges.append((m[:pos], m[pos + 1:]) if pos >= 0 else ("", ""))
        self.merges = merges

    # -- special ids -----------------------------------------------------------

    def _read_special_ids(self, meta, n):
        if self.model == "llama":
            special = {"bos": 1, "eos": 2, "unk": 0}
        else:
            special = {"bos": 11, "eos": 11}
        for _, name in _SPECIAL_KEYS:
            special.setdefault(name, None)
        for key, name in _SPECIAL_KEYS:
            if special[name] is not None and special[name] >= n:
                special[name] = None
            value = _meta_get(meta, "tokenizer.ggml." + key)
            if value is not None and 0 <= int(value) < n:
                special[name] = int(value)
        self.special = special

    def _find_special_by_text(self):
        def find(texts):
            # llama.cpp takes the first match in its hash map's order; the
            # first text of the list that is present is the intended one
            for t in texts:
                i = self.token_to_id.get(t)
                if i is not None:
                    return i
            return None

        for name, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), *_FIM_TEXTS.items()):
            if self.special[name] is None:
                found = find(texts)
                if found is not None:
                    self.special[name] = found
                    self.attrs[found] |= ATTR.CONTROL

    def _mark_unused(self):
        for i in np.flatnonzero(np.asarray(self.attrs) & ATTR.CONTROL).tolist():
            if "unused" in self.tokens[i]:
                self.attrs[i] |= ATTR.UNUSED

    def _build_eog(self):
        eog = set()
        for name in ("fim_pad", "fim_rep", "fim_sep"):
            if self.special[name] is not None:
                eog.add(self.special[name])
        for t in _EOG_TEXTS:
            i = self.token_to_id.get(t)
            if i is not None:
                eog.add(i)
                self.attrs[i] |= ATTR.CONTROL
        for t in _ALWAYS_RENDERED:
            i = self.token_to_id.get(t)
            if i is not None:
                self.attrs[i] = ATTR.USER_DEFINED
        for name in ("eos", "eot", "eom"):
            if self.special[name] is not None:
                eog.add(self.special[name])
        texts = {self.tokens[i]: i for i in eog}
        # a format whose "<|end|>" ends a message but not the generation
        if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts) or
                                   ("<|calls|>" in texts and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])
            self.attrs[texts["<|end|>"]] = ATTR.USER_DEFINED
        # vocabularies where "</s>" is ordinary text
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            self.attrs[texts["</s>"]] = ATTR.NORMAL
        self.eog_ids = frozenset(eog)

    def _strip_attrs(self, meta):
        # llama.cpp sets strip attributes by model name; Phi-3's special
        # tokens swallow the whitespace that follows them
        name = str(_meta_get(meta, "general.name", "") or "").lower()
        if "phi-3" in name or "phi3" in name:
            for i in self.special_tokens:
                self.attrs[i] |= ATTR.RSTRIP
            for t, on in (("</s>", True), ("<unk>", False), ("<s>", False),
                          ("<|endoftext|>", False)):
                i = self.token_to_id.get(t)
                if i is None:
                    continue
                self.attrs[i] = (self.attrs[i] | ATTR.RSTRIP) if on else (self.attrs[i] & ~ATTR.RSTRIP)

    def with_pre(self, pre: str, spec) -> "Vocab":
        """A shallow copy using pre-tokenizer ``pre`` (its defaults, then the metadata's)."""
        other = copy.copy(self)
        other.pre = pre
        other.clean_spaces = spec.clean_spaces
        other.ignore_merges = spec.ignore_merges
        other.add_bos = spec.add_bos if self._meta_add_bos is None else bool(self._meta_add_bos)
        return other

    # -- queries ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.tokens)

    def longest_token_within(self, chars) -> int:
        """The length of the longest token text made only of ``chars`` (a set
        of characters); 1 if none is.

        A text made of those characters is cut into tokens no longer than
        this (or byte tokens, one per byte), which bounds its token count
        from below.
        """
        key = frozenset(chars)
        memo = self.__dict__.setdefault("_longest_within", {})
        found = memo.get(key)
        if found is None:
            by_length = self.__dict__.get("_by_length")
            if by_length is None:
                by_length = self._by_length = sorted(self.tokens, key=len, reverse=True)
            inside = key.__contains__
            # longest first; a token fails at its first character outside
            found = next((len(t) for t in by_length if all(map(inside, t))), 1)
            if len(memo) > 4096:
                memo.clear()
            memo[key] = found
        return found

    def byte_token(self, b: int) -> int:
        """The id of the token for one raw byte (SPM ``<0xXX>`` or the byte itself)."""
        i = self.token_to_id.get(f"<0x{b:02X}>")
        if i is None:
            i = self.token_to_id.get(chr(b)) if b < 0x80 else None
        if i is None:
            raise TokenizerError(f"vocabulary has no token for byte 0x{b:02X} (neither "
                                 f"'<0x{b:02X}>' nor the byte itself)")
        return i
