"""SentencePiece-style tokenization of a GGUF ``llama`` vocabulary.

The algorithm is the one llama.cpp runs (``llm_tokenizer_spm_session`` in
``src/llama-vocab.cpp``), which differs from SentencePiece's own trainer-side
rules in ways that change ids, so it is implemented here rather than taken
from a library:

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
and the chunks' results are exactly the whole text's.
"""

from __future__ import annotations

import heapq

import regex

from .vocab import ATTR, TokenizerError, Vocab

__all__ = ["SpmEncoder"]

_SPACE = "\u2581"
_CACHE_LIMIT = 1 << 18


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
        self._score = {t: scores[i] for t, i in vocab.token_to_id.items()}
        self._vocab = vocab
        self._cache: dict = {}
        # tokens with a "▁" after another character could join two chunks
        crossing = [t for t in vocab.token_to_id
                    if any(t[k] == _SPACE and t[k - 1] != _SPACE for k in range(1, len(t)))]
        self._crossing = crossing
        self._cut = regex.compile(f"(?<=[^{_SPACE}])(?={_SPACE})")

    def encode(self, text: str) -> list[int]:
        """Token ids of one fragment whose spaces are already ``▁``."""
        out: list[int] = []
        cache = self._cache
        for chunk in self._chunks(text):
            ids = cache.get(chunk)
            if ids is None:
                ids = self._merge(chunk)
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[chunk] = ids
            out.extend(ids)
        return out

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
        n = len(text)
        if n == 0:
            return []
        ids, score = self._ids, self._score
        start = list(range(n))          # first character of each symbol
        length = [1] * n                # characters in each symbol (0: merged away)
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        heap = []

        def push(left, right):
            if left < 0 or right < 0:
                return
            piece = text[start[left]:start[right] + length[right]]
            s = score.get(piece)
            if s is not None:
                heapq.heappush(heap, (-s, left, right, len(piece)))

        for i in range(1, n):
            push(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
                continue
            length[left] += length[right]
            length[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])

        out = []
        i = 0
        while i != -1:
            piece = text[start[i]:start[i] + length[i]]
            tok = ids.get(piece)
            if tok is not None:
                out.append(tok)
            else:
                out.extend(self._vocab.byte_token(b) for b in piece.encode("utf-8"))
            i = nxt[i]
        return out


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
