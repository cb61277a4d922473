"""Byte-level BPE tokenization of a GGUF ``gpt2`` vocabulary.

Text is cut into words by the pre-tokenizer (:mod:`.pretokenize`), each word
is mapped to GPT-2's byte alphabet, and the merges run on each word: of all
adjacent symbol pairs listed in ``tokenizer.ggml.merges``, the pair of lowest
rank merges first (ties: the leftmost), until no listed pair is left.  With
``ignore_merges`` a word that is itself a token is taken whole.  This is
llama.cpp's ``llm_tokenizer_bpe_session``; the merging itself is done by the
Hugging Face ``tokenizers`` BPE model, whose rule is the same, and results
are cached per word.

A long word is merged in segments: it is cut between two bytes that no token
holds side by side (no merge can join them, so the segments merge alone
exactly as within the word), into segments of at least ``_SEGMENT`` bytes
where it can be.  Under a token limit the count is checked after each
segment.

A merge whose parts or result are not tokens of the vocabulary is dropped
when the model is built (``tokenizers`` refuses such merges; llama.cpp would
still merge); well-formed vocabularies have none.  A byte character missing
from the vocabulary blocks merges across it and is then dropped, as in
llama.cpp.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
from tokenizers import models

from ptxgen.llm.text.pretokenize import (PRE_TOKENIZERS, byte_decode_table, byte_encode,
                                         iter_words, split_words)
from ptxgen.llm.text.vocab import TokenizerError, TokenLimitError, Vocab

__all__ = ["BpeEncoder"]

_CACHE_LIMIT = 1 << 18
# words longer than this are not cached and, under a token limit, are first
# bounded by their length
_LONG = 1024
# a long word is merged in segments of at least this many bytes (where it can be cut)
_SEGMENT = 1024
_BYTE_OF = byte_decode_table()


class BpeEncoder:
    """Encoder for one byte-level BPE vocabulary (see the module docstring).

    Parameters
    ----------
    vocab : Vocab
    """

    def __init__(self, vocab: Vocab):
        spec = PRE_TOKENIZERS.get(vocab.pre)
        if spec is None:
            raise TokenizerError(f"pre-tokenizer {vocab.pre!r} is not supported; supported: "
                                 f"{', '.join(sorted(PRE_TOKENIZERS))}")
        self._patterns = spec.patterns
        self._vocab = vocab
        ids = vocab.token_to_id
        merges = vocab.merges
        # tokenizers refuses (or panics on) merges naming non-tokens
        self.dropped_merges = 0
        if merges:
            keys = ids.keys()
            if not (keys >= set(itertools.chain.from_iterable(merges))
                    and keys >= set(map("".join, merges))):
                kept = [m for m in merges if m[0] in ids and m[1] in ids and (m[0] + m[1]) in ids]
                self.dropped_merges = len(merges) - len(kept)
                merges = kept
        self._ids = ids
        self._merges = merges
        # an id no token has (duplicate texts make the map smaller than the vocabulary)
        self._unk = len(vocab)
        self._models: dict = {}  # ignore_merges -> tokenizers BPE model, shared by copies
        self._model = self._build(vocab.ignore_merges)
        self._cache: dict = {}

    def _build(self, ignore_merges: bool):
        model = self._models.get(ignore_merges)
        if model is not None:
            return model
        ids = self._ids
        # A character missing from the vocabulary stays a symbol in llama.cpp
        # (no merge reaches across it) and is then dropped; tokenizers drops
        # it up front, letting its neighbours merge.  An "unknown" token
        # outside the id range holds its place and is removed afterwards.
        unk_text = "\x00<unknown>\x00"
        while unk_text in ids:
            unk_text += "\x00"
        model_vocab = dict(ids)
        model_vocab[unk_text] = self._unk
        try:
            model = models.BPE(vocab=model_vocab, merges=self._merges, unk_token=unk_text,
                               fuse_unk=False, ignore_merges=ignore_merges)
        except Exception as e:  # tokenizers raises its own exception types
            raise TokenizerError(f"cannot build the BPE model from the vocabulary: {e}") from None
        self._models[ignore_merges] = model
        return model

    def with_pre(self, vocab: Vocab) -> "BpeEncoder":
        """A copy for ``vocab`` (the same tables, another pre-tokenizer)."""
        other = copy.copy(self)
        other._patterns = PRE_TOKENIZERS[vocab.pre].patterns
        other._vocab = vocab
        other._model = self._build(vocab.ignore_merges)
        other._cache = {}
        return other

    def words(self, text: str) -> list[str]:
        """The pre-tokenizer's words of ``text`` (before byte mapping)."""
        return split_words(text, self._patterns)

    def encode(self, text: str, limit: int | None = None, long_words=None) -> list[int]:
        """Token ids of one text fragment (no special tokens inside).

        With ``limit``, the words are taken one at a time and
        :class:`TokenLimitError` is raised as soon as the ids are certain to
        be more than ``limit`` (a long word is first bounded by its length:
        no token is longer than the longest one made of its characters), so
        that the work stops near the limit; ``long_words`` (a
        :class:`~.vocab.LongWords`) counts the long words merged.
        """
        cache = self._cache
        # the first two expressions cut the text into words; any further ones
        # only cut within a word, so they run once per distinct word
        eager = self._patterns[:2]
        if limit is not None:
            out: list[int] = []
            for word in iter_words(text, eager):
                ids = cache.get(word)
                if ids is None:
                    try:
                        ids = self._word(word, limit - len(out), long_words)
                    except TokenLimitError as e:
                        raise TokenLimitError(str(e), limit, len(out) + e.at_least) from None
                out += ids
                if len(out) > limit:
                    raise TokenLimitError("more tokens than the limit", limit, len(out))
            return out
        words = split_words(text, eager)
        found = list(map(cache.get, words))
        if None in found:
            for k, ids in enumerate(found):
                if ids is None:
                    ids = cache.get(words[k])
                    found[k] = self._word(words[k]) if ids is None else ids
        return list(itertools.chain.from_iterable(found))

    def _word(self, word: str, room: int | None = None, long_words=None) -> list[int]:
        """A word's ids (through the further expressions and the merges),
        cached; with ``room``, TokenLimitError as soon as they are sure to
        be more."""
        lazy = self._patterns[2:]
        ids: list[int] = []
        for w in (split_words(word, lazy) if lazy else (word,)):
            if len(w) > _LONG:
                if room is not None:
                    self._check_long(w, room - len(ids))
                if long_words is not None:
                    long_words.take(w)
                self._merge_long(w, ids, room)
            else:
                ids.extend(self._merge(w))
            if room is not None and len(ids) > room:
                raise TokenLimitError("more tokens than the limit", room, len(ids))
        if len(word) <= _LONG:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[word] = ids
        return ids

    def _check_long(self, word: str, room: int) -> None:
        symbols = byte_encode(word)
        chars = set(symbols)
        if not all(c in self._ids for c in chars):
            return  # a byte missing from the vocabulary is dropped: no bound
        at_least = -(-len(symbols) // self._vocab.longest_token_within(chars))
        if at_least > room:
            raise TokenLimitError("more tokens than the limit", room, at_least)

    def _merge(self, word: str) -> list[int]:
        return self._merged(self._model, byte_encode(word))

    def _merged(self, model, symbols: str) -> list[int]:
        ids = [t.id for t in model.tokenize(symbols)]
        if self._unk in ids:
            ids = [i for i in ids if i != self._unk]
        return ids

    def _merge_long(self, word: str, out: list, room: int | None) -> None:
        """Append a long word's ids to ``out``, merged in segments (see the
        module docstring); with ``room``, stop once ``out`` holds more."""
        symbols = byte_encode(word)
        if self._vocab.ignore_merges:
            whole = self._ids.get(symbols)
            if whole is not None:
                out.append(whole)
                return
        model = self._build(False)   # ignore_merges is for whole words only
        data = np.frombuffer(word.encode("utf-8"), np.uint8)
        joinable = self._joinable()
        start = 0
        for block in range(0, len(data) - 1, 1 << 20):
            seg = data[block:block + (1 << 20) + 1]
            for cut in (np.flatnonzero(~joinable[seg[:-1], seg[1:]]) + block + 1).tolist():
                if cut - start >= _SEGMENT:
                    out.extend(self._merged(model, symbols[start:cut]))
                    start = cut
                    if room is not None and len(out) > room:
                        return
        out.extend(self._merged(model, symbols[start:]))

    def _joinable(self) -> np.ndarray:
        """``[a, b]``: whether some token holds bytes ``a``, ``b`` side by side."""
        table = self.__dict__.get("_joinable_table")
        if table is None:
            table = np.zeros((256, 256), bool)
            for t in self._ids:
                codes = [_BYTE_OF.get(c, -1) for c in t]
                for a, b in zip(codes, codes[1:]):
                    if a >= 0 and b >= 0:
                        table[a, b] = True
            self._joinable_table = table
        return table
