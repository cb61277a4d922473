"""Byte-level BPE tokenization of a GGUF ``gpt2`` vocabulary.

Text is cut into words by the pre-tokenizer (:mod:`.pretokenize`), each word
is mapped to GPT-2's byte alphabet, and the merges run on each word: of all
adjacent symbol pairs listed in ``tokenizer.ggml.merges``, the pair of lowest
rank merges first (ties: the leftmost), until no listed pair is left.  With
``ignore_merges`` a word that is itself a token is taken whole.  This is
llama.cpp's ``llm_tokenizer_bpe_session``; the merging itself is done by the
Hugging Face ``tokenizers`` BPE model, whose rule is the same, and results
are cached per word.

A merge whose parts or result are not tokens of the vocabulary is dropped
when the model is built (``tokenizers`` refuses such merges; llama.cpp would
still merge); well-formed vocabularies have none.  A byte character missing
from the vocabulary blocks merges across it and is then dropped, as in
llama.cpp.
"""

from __future__ import annotations

import copy
import itertools

from tokenizers import models

from ptxgen.llm.text.pretokenize import PRE_TOKENIZERS, byte_encode, split_words
from ptxgen.llm.text.vocab import TokenizerError, Vocab

__all__ = ["BpeEncoder"]

_CACHE_LIMIT = 1 << 18


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
        other._model = self._build(vocab.ignore_merges)
        other._cache = {}
        return other

    def words(self, text: str) -> list[str]:
        """The pre-tokenizer's words of ``text`` (before byte mapping)."""
        return split_words(text, self._patterns)

    def encode(self, text: str) -> list[int]:
        """Token ids of one text fragment (no special tokens inside)."""
        cache = self._cache
        # the first two expressions cut the text into words; any further ones
        # only cut within a word, so they run once per distinct word
        eager, lazy = self._patterns[:2], self._patterns[2:]
        words = split_words(text, eager)
        found = list(map(cache.get, words))
        if None in found:
            if len(cache) >= _CACHE_LIMIT:
                cache.clear()
            for k, ids in enumerate(found):
                if ids is None:
                    word = words[k]
                    ids = cache.get(word)
                    if ids is None:
                        ids = []
                        for w in (split_words(word, lazy) if lazy else (word,)):
                            ids.extend(self._merge(w))
                        cache[word] = ids
                    found[k] = ids
        return list(itertools.chain.from_iterable(found))

    def _merge(self, word: str) -> list[int]:
        ids = [t.id for t in self._model.tokenize(byte_encode(word))]
        if self._unk in ids:
            ids = [i for i in ids if i != self._unk]
        return ids
