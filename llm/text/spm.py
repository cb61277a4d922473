"""SentencePiece-style tokenization of a GGUF ``llama`` vocabulary.

The algorithm is the one llama.cpp runs (``llm_tokenizer_spm_session`` in
``src/llama-vocab.cpp``).  It is written out here: the libraries that run
such vocabularies (Hugging Face ``tokenizers`` with merges rebuilt from the
scores) order equal scores by merge rank rather than position and drop
characters that llama.cpp keeps, which changes ids.

1. spaces become U+2581 (``▁``); a space is prepended to the fragment when
   the vocabulary asks for it and the fragment starts the text or follows a
   special token;
2. the text starts as one symbol per character;
3. repeatedly, of all adjacent symbol pairs whose concatenation is a token,
   the one whose token has the highest score is merged (ties: the leftmost);
4. each final symbol becomes its token, or -- a single character missing from
   the vocabulary -- one byte token (``<0xXX>``) per UTF-8 byte.

There is no word splitting, so a merge may cross a ``▁``.  For speed the text
is still cut into chunks at each ``▁`` that follows another character, and
chunks are cached: a cut is made only where no token of the vocabulary that
spans such a position occurs in the text around it, so no merge can cross it
and the chunks' results are exactly the whole text's.  A chunk is cut further
between two characters that no token of the vocabulary holds side by side
(no merge can join them either), and those pieces are cached too.
"""

from __future__ import annotations

import heapq
import itertools
import operator

import numpy as np
import regex

from ptxgen.llm.text.vocab import ATTR, TokenizerError, TokenLimitError, Vocab

__all__ = ["SpmEncoder"]

_SPACE = "\u2581"
_CACHE_LIMIT = 1 << 18
# chunks up to this many characters are merged by scanning, longer ones with a heap
_SHORT = 24
_NO_PAIR = float("-inf")
# chunks up to this many characters are merged whole, longer ones cut first
_PIECE_MIN = 8
# chunks longer than this are not cached and, under a token limit, are first
# bounded by their length
_LONG = 1024


class SpmEncoder:
    """Encoder for one SPM vocabulary (see the module docstring).

    Parameters
    ----------
    vocab : Vocab
    """

    def __init__(self, vocab: Vocab):
        if vocab.scores is None:
            raise TokenizerError("SentencePiece-style vocabulary without 'tokenizer.ggml.scores'")
        self._ids = vocab.token_to_id
        scores = vocab.scores.tolist()
        # the scanning merge marks "no token" with -inf, below every real score
        self._finite = bool(np.isfinite(vocab.scores).all()) if len(scores) else True
        self._score = {t: scores[i] for t, i in vocab.token_to_id.items()}
        self._vocab = vocab
        self._cache: dict = {}
        # tokens with a "▁" after another character could join two chunks
        crossing = [t for t in vocab.token_to_id
                    if any(t[k] == _SPACE and t[k - 1] != _SPACE for k in range(1, len(t)))]
        self._crossing = crossing
        self._cut = regex.compile(f"(?<=[^{_SPACE}])(?={_SPACE})")
        self._bigrams = {t[i:i + 2] for t in vocab.token_to_id for i in range(len(t) - 1)}

    def encode(self, text: str, limit: int | None = None, long_words=None) -> list[int]:
        """Token ids of one fragment whose spaces are already ``▁``.

        With ``limit``, the chunks are taken one at a time and
        :class:`TokenLimitError` is raised as soon as the ids are certain to
        be more than ``limit`` (a long chunk is first bounded by its length:
        no token is longer than the longest one made of its characters), so
        that the work stops near the limit; ``long_words`` (a
        :class:`~.vocab.LongWords`) counts the long chunks merged.
        """
        cache = self._cache
        if limit is not None:
            out: list[int] = []
            chunks = self._chunks(text) if self._crossing else self._cut.splititer(text)
            for chunk in chunks:
                ids = cache.get(chunk)
                if ids is None:
                    if len(chunk) > _LONG:
                        self._check_long(chunk, limit - len(out))
                        if long_words is not None:
                            long_words.take(chunk)
                    ids = self._chunk(chunk)
                out += ids
                if len(out) > limit:
                    raise TokenLimitError("more tokens than the limit", limit, len(out))
            return out
        chunks = self._chunks(text)
        found = list(map(cache.get, chunks))
        if None in found:
            for k, ids in enumerate(found):
                if ids is None:
                    ids = cache.get(chunks[k])
                    found[k] = self._chunk(chunks[k]) if ids is None else ids
        return list(itertools.chain.from_iterable(found))

    def _chunk(self, chunk: str) -> list[int]:
        """One chunk's ids, cached (with its pieces') unless it is long."""
        cache = self._cache
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        if len(chunk) <= _PIECE_MIN:
            ids = self._merge(chunk)
        else:
            ids = []
            for piece in self._pieces(chunk):
                sub = cache.get(piece)
                if sub is None:
                    sub = self._merge(piece)
                    if len(piece) <= _LONG:
                        cache[piece] = sub
                ids.extend(sub)
        if len(chunk) <= _LONG:
            cache[chunk] = ids
        return ids

    def _check_long(self, chunk: str, room: int) -> None:
        # a character missing from the vocabulary becomes byte tokens, one or
        # more per character: the bound holds for those too
        at_least = -(-len(chunk) // self._vocab.longest_token_within(set(chunk)))
        if at_least > room:
            raise TokenLimitError("more tokens than the limit", room, at_least)

    def _pieces(self, chunk: str) -> list[str]:
        # Cut between two characters that no token holds side by side: a
        # merge across the cut would make a token holding them, so none
        # happens and the pieces merge alone exactly as within the chunk.
        bigrams = self._bigrams
        pieces, last = [], 0
        for i in range(1, len(chunk)):
            if chunk[i - 1:i + 1] not in bigrams:
                pieces.append(chunk[last:i])
                last = i
        pieces.append(chunk[last:])
        return pieces

    def _chunks(self, text: str) -> list[str]:
        pieces = self._cut.split(text)
        if len(pieces) < 2 or not self._crossing:
            return pieces
        blocked = self._blocked_cuts(text)
        if not blocked:
            return pieces
        merged, pos = [], 0
        for p in pieces:
            if merged and pos in blocked:
                merged[-1] += p
            else:
                merged.append(p)
            pos += len(p)
        return merged

    def _blocked_cuts(self, text: str) -> set:
        blocked = set()
        for t in self._crossing:
            start = text.find(t)
            while start >= 0:
                for k in range(1, len(t)):
                    if t[k] == _SPACE and t[k - 1] != _SPACE:
                        blocked.add(start + k)
                start = text.find(t, start + 1)
        return blocked

    def _merge(self, text: str) -> list[int]:
        if len(text) <= _SHORT and self._finite:
            return self._merge_short(text)
        return self._merge_long(text)

    def _finish(self, pieces) -> list[int]:
        out = list(map(self._ids.get, pieces))
        if None not in out:
            return out
        # a character missing from the vocabulary: one byte token per UTF-8 byte
        full = []
        for piece, tok in zip(pieces, out):
            if tok is not None:
                full.append(tok)
            else:
                full.extend(self._vocab.byte_token(b) for b in piece.encode("utf-8"))
        return full

    def _merge_short(self, text: str) -> list[int]:
        # The best pair is found by scanning: the highest score, the leftmost
        # on ties (list.index finds the first maximum) -- the order of the
        # heap in _merge_long.  A pair that is no token scores -inf.
        get = self._score.get
        none = _NO_PAIR
        syms = list(text)
        pairs = list(map(get, map(operator.add, syms, syms[1:]), itertools.repeat(none)))
        while pairs:
            best = max(pairs)
            if best == none:
                break
            at = pairs.index(best)
            merged = syms[at] + syms[at + 1]
            syms[at:at + 2] = [merged]
            del pairs[at]
            if at > 0:
                pairs[at - 1] = get(syms[at - 1] + merged, none)
            if at < len(pairs):
                pairs[at] = get(merged + syms[at + 1], none)
        return self._finish(syms)

    def _merge_long(self, text: str) -> list[int]:
        # The heap holds one int per candidate pair: (rank << 48) | (left <<
        # 16) | length, where rank orders the scores from the highest, so
        # the smallest key is the best pair, the leftmost on ties.  A symbol
        # starts where its first character is (merges absorb the right
        # symbol), so a pair is (left, nxt[left]); it is stale when either
        # symbol has changed, which makes their lengths no longer add up.
        n = len(text)
        rank = self._ranks()
        length = [1] * n                # characters in each symbol (0: merged away)
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            r = rank.get(text[i:i + 2])
            if r is not None:
                heap.append((r << 48) | (i << 16) | 2)
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            key = pop(heap)
            left = (key >> 16) & 0xFFFFFFFF
            right = nxt[left]
            if right < 0 or length[left] + length[right] != key & 0xFFFF or not length[left]:
                continue
            length[left] += length[right]
            length[right] = 0
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0:
                size = length[before] + length[left]
                r = rank.get(text[before:before + size])
                if r is not None:
                    push(heap, (r << 48) | (before << 16) | size)
            if after >= 0:
                size = length[left] + length[after]
                r = rank.get(text[left:left + size])
                if r is not None:
                    push(heap, (r << 48) | (left << 16) | size)
        pieces = []
        i = 0
        while i != -1:
            pieces.append(text[i:i + length[i]])
            i = nxt[i]
        return self._finish(pieces)

    def _ranks(self) -> dict:
        """Token text -> the rank of its score, 0 for the highest (a NaN
        score ranks below all others); for the heap of _merge_long."""
        ranks = self.__dict__.get("_rank")
        if ranks is None:
            order = sorted({s for s in self._score.values() if s == s}, reverse=True)
            of = {s: i for i, s in enumerate(order)}
            ranks = self._rank = {t: of.get(s, len(order)) for t, s in self._score.items()}
        return ranks


def spm_piece(vocab: Vocab, token: int) -> bytes:
    """The bytes a token stands for in an SPM vocabulary (attributes permitting).

    Raises ``KeyError`` for nothing; the caller decides about control tokens.
    """
    text = vocab.tokens[token]
    attr = vocab.attrs[token]
    if attr & (ATTR.UNKNOWN | ATTR.CONTROL | ATTR.USER_DEFINED):
        return text.encode("utf-8", "surrogateescape")
    if attr & ATTR.NORMAL:
        return text.replace(_SPACE, " ").encode("utf-8", "surrogateescape")
    if attr & ATTR.BYTE:
        return bytes([int(text[3:5], 16)])
    return b""
