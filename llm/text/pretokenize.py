"""Byte-level BPE pre-tokenizers: how text is cut into words before merging.

Each pre-tokenizer named by ``tokenizer.ggml.pre`` is a list of regular
expressions applied in turn, as llama.cpp does it (``llm_tokenizer_bpe`` and
``unicode_regex_split`` in ``src/llama-vocab.cpp`` and ``src/unicode.cpp``):
the first expression cuts the text into pieces -- each match is a piece and
so is each run of text between matches -- and every further expression cuts
each of those pieces the same way, never across a piece's edges.  A
lookahead therefore sees the end of its piece as the end of the text.

The expressions are the ones the model families' own ``tokenizer.json``
files define, in the forms llama.cpp runs (its case-sensitive contractions
``'[sS]`` for ``(?i:'s)``, and its lookahead forms of the upper/lower-case
letter classes for the Tekken and GPT-4o families, which treat every letter
outside ASCII as both upper and lower case).  They run on the ``regex``
package with one deliberate change: ``\\s`` is spelled out as the Unicode
White_Space set, which is what llama.cpp's ``\\s`` matches (Python's ``\\s``
also takes U+001C..U+001F).

A word is then mapped to the GPT-2 byte alphabet (each UTF-8 byte to one
printable character) before the merges run on it.
"""

from __future__ import annotations

import attrs
import regex

__all__ = ["PreTokenizer", "PRE_TOKENIZERS", "byte_encode", "byte_decode_table",
           "split_words", "iter_words"]

# the Unicode White_Space property, as characters for a class
_WS = "\\t\\n\\x0b\\x0c\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"
_S = f"[{_WS}]"          # \s
_NS = f"[^{_WS}]"        # \S

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

# GPT-2:  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
_GPT2 = (f"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{{L}}+| ?\\p{{N}}+| ?[^{_WS}\\p{{L}}\\p{{N}}]+"
         f"|{_S}+(?!{_NS})")


def _llama3_like(numbers: str, letters: str = "\\p{L}", other: str = "\\p{L}\\p{N}") -> str:
    # (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|<numbers>| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
    return (f"{_CONTRACTIONS}|[^\\r\\n\\p{{L}}\\p{{N}}]?{letters}+|{numbers}"
            f"| ?[^{_WS}{other}]+[\\r\\n]*|{_S}*[\\r\\n]+|{_S}+(?!{_NS})|{_S}+")


_LLAMA3 = _llama3_like("\\p{N}{1,3}")
_QWEN2 = _llama3_like("\\p{N}")
_QWEN35 = _llama3_like("\\p{N}", letters="[\\p{L}\\p{M}]", other="\\p{L}\\p{M}\\p{N}")

# a letter that is not a-z ("upper"), a letter that is not A-Z ("lower")
_UP = "(?:(?=\\p{L})[^a-z])"
_LO = "(?:(?=\\p{L})[^A-Z])"
_TEKKEN = (f"[^\\r\\n\\p{{L}}\\p{{N}}]?{_UP}*{_LO}+|[^\\r\\n\\p{{L}}\\p{{N}}]?{_UP}+{_LO}*"
           f"|\\p{{N}}| ?[^{_WS}\\p{{L}}\\p{{N}}]+[\\r\\n/]*|{_S}*[\\r\\n]+|{_S}+(?!{_NS})|{_S}+")
_GPT4O = (f"[^\\r\\n\\p{{L}}\\p{{N}}]?{_UP}*{_LO}+{_CONTRACTIONS}?"
          f"|[^\\r\\n\\p{{L}}\\p{{N}}]?{_UP}+{_LO}*{_CONTRACTIONS}?"
          f"|\\p{{N}}{{1,3}}| ?[^{_WS}\\p{{L}}\\p{{N}}]+[\\r\\n/]*|{_S}*[\\r\\n]+|{_S}+(?!{_NS})|{_S}+")


# White_Space code points above ASCII
_WIDE_SPACES = (0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000)


def _ranges(pairs) -> str:
    """A character-class body from (first, last) code point pairs.

    llama.cpp matches expressions without ``\\p{..}`` classes on a copy of
    the text in which every non-ASCII space is U+000B, so a range that spans
    such a space does not match it there; it is left out here too.
    """
    out = []
    for a, b in pairs:
        cut = [a - 1, *(c for c in _WIDE_SPACES if a <= c <= b), b + 1]
        for lo, hi in zip(cut, cut[1:]):
            lo, hi = lo + 1, hi - 1
            if lo <= hi:
                out.append(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}")
    return "".join(out)


# DeepSeek LLM's cased-letter class (its tokenizer.json), as code point ranges
_DEEPSEEK_CASED = _ranges((
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA),
    (0x1BC, 0x1BF), (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377),
    (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C),
    (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
    (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF),
    (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B),
    (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE),
    (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC),
    (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113),
    (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128),
    (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE),
    (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787),
    (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A),
    (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
))
# CJK ideographs, Samaritan..CJK, Hangul (DeepSeek's tokenizer.json)
_DEEPSEEK_CJK = _ranges(((0x4E00, 0x9FA5), (0x0800, 0x4E00), (0xAC00, 0xD7FF)))
_DEEPSEEK_PUNCT = _ranges(((0x21, 0x2F), (0x3A, 0x7E), (0xFF01, 0xFF0F), (0xFF1A, 0xFF5E),
                           (0x2018, 0x201F), (0x3000, 0x3002)))


@attrs.frozen
class PreTokenizer:
    """One ``tokenizer.ggml.pre`` value: its expressions and tokenizer defaults.

    Attributes
    ----------
    patterns : tuple of str
        Expressions applied in turn (see the module docstring).
    clean_spaces : bool
        Whether decoding removes the space before ``? ! . ,`` and some
        apostrophe contractions (llama.cpp's ``clean_spaces``).
    ignore_merges : bool
        Whether a word that is itself a token skips the merges.
    add_bos : bool
        Whether a BOS token is prepended by default (before the metadata's
        ``tokenizer.ggml.add_bos_token`` overrides it).
    """

    patterns: tuple
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False


_DEFAULT = PreTokenizer((f"[\\p{{P}}\\$\\+<=>\\^~\\|]+", _GPT2, "\\p{N}+", "[0-9][0-9][0-9]"))
_GPT2_PRE = PreTokenizer((_GPT2,))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_STARCODER = (("\\p{N}", _GPT2))

#: tokenizer.ggml.pre -> pre-tokenizer; each group shares llama.cpp's expressions
PRE_TOKENIZERS = {
    "default": _DEFAULT,
    **{name: _GPT2_PRE for name in ("gpt-2", "phi-2", "mpt", "olmo", "exaone4")},
    **{name: _LLAMA3_PRE for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                      "pixtral")},
    "dbrx": PreTokenizer((_LLAMA3,)),
    "smaug-bpe": PreTokenizer((_LLAMA3,)),
    **{name: PreTokenizer((_QWEN2,), clean_spaces=False) for name in ("qwen2",
                                                                       "deepseek-r1-qwen")},
    "stablelm2": PreTokenizer((_QWEN2,)),
    "megrez": PreTokenizer((_QWEN2,)),
    "qwen35": PreTokenizer((_QWEN35,), clean_spaces=False),
    "deepseek-llm": PreTokenizer((
        "[\\r\\n]", f"{_S}?[{_DEEPSEEK_CASED}]+", f"{_S}?[{_DEEPSEEK_PUNCT}]+", f"{_S}+\\Z",
        f"[{_DEEPSEEK_CJK}]+", "\\p{N}+"), clean_spaces=False),
    "deepseek-coder": PreTokenizer((
        "[\\r\\n]", f"{_S}?\\p{{L}}+", f"{_S}?\\p{{P}}+", f"[{_DEEPSEEK_CJK}]+", "\\p{N}"),
        clean_spaces=False),
    "falcon": PreTokenizer(("[\\p{P}\\$\\+<=>\\^~\\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    **{name: PreTokenizer(_STARCODER) for name in ("starcoder", "refact", "codeshell", "exaone",
                                                    "minerva-7b")},
    **{name: PreTokenizer(_STARCODER, clean_spaces=False) for name in ("command-r", "smollm")},
    "tekken": PreTokenizer((_TEKKEN,), clean_spaces=False, ignore_merges=True, add_bos=True),
    **{name: PreTokenizer((_GPT4O,), clean_spaces=False) for name in ("gpt-4o", "llama4")},
}

_compiled: dict = {}


def _compile(pattern: str):
    # one capturing group around the whole expression (the expressions have
    # no groups of their own): split() then returns gaps and matches in turn
    c = _compiled.get(pattern)
    if c is None:
        c = _compiled[pattern] = regex.compile(f"({pattern})", regex.V0)
    return c


def split_words(text: str, patterns) -> list[str]:
    """Cut ``text`` into words with a pre-tokenizer's expressions.

    Parameters
    ----------
    text : str
    patterns : sequence of str
        :attr:`PreTokenizer.patterns`.

    Returns
    -------
    list of str
        The words, in order; their concatenation is ``text``.
    """
    pieces = [text] if text else []
    for pattern in patterns:
        split = _compile(pattern).split
        if len(pieces) == 1:
            pieces = list(filter(None, split(pieces[0])))
            continue
        out: list = []
        extend = out.extend
        for piece in pieces:
            extend(filter(None, split(piece)))
        pieces = out
    return pieces


def iter_words(text: str, patterns):
    """The words of :func:`split_words`, one at a time (for text that may be
    long and need not be cut whole)."""
    if not patterns:
        if text:
            yield text
        return
    rest = patterns[1:]
    for piece in _compile(patterns[0]).splititer(text):
        if piece:
            if rest:
                yield from iter_words(piece, rest)
            else:
                yield piece


def _byte_alphabet() -> list[str]:
    """GPT-2's map from each byte to a printable character."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    for b in keep:
        table[b] = chr(b)
    extra = 0
    for b in range(256):
        if not table[b]:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_ALPHABET = _byte_alphabet()
# latin-1 character (one per byte) -> alphabet character, for str.translate
_TRANSLATE = {b: c for b, c in enumerate(_ALPHABET)}


def byte_encode(word: str) -> str:
    """Map a word's UTF-8 bytes to GPT-2's byte alphabet."""
    return word.encode("utf-8").decode("latin-1").translate(_TRANSLATE)


def byte_decode_table() -> dict:
    """Alphabet character -> byte value (the inverse of :func:`byte_encode`)."""
    return {c: b for b, c in enumerate(_ALPHABET)}
