"""Byte-level BPE on merge tables with unusual entries, against a reference
written here.

Real vocabularies (tests/llm/test_tokenizer.py) have clean merge tables:
every merge once, its parts and result tokens.  Here seeded random
vocabularies over a few letters (one of them two bytes in UTF-8) carry
merges that repeat an earlier or a later one, merges whose parts or result
are not tokens, merges no text can reach, and one entry of three parts;
texts also hold a letter missing from the vocabulary.  The reference is the
rule of llm/text/bpe.py's docstring, spelled out in Python: GPT-2's byte
alphabet; merges of non-tokens are dropped, a repeated merge keeps its first
rank; the pair of lowest rank merges first, the leftmost of equal pairs; a
character that is not a token blocks merges and is then dropped; with
``ignore_merges`` (llama-bpe) a word that is a token is taken whole.
"""

import re

import pytest

from ptxgen.llm.text.tokenizer import Tokenizer

# letters of the texts: 'z' is never a token; 'é' is two bytes (Ã ©)
LETTERS = "abcdz\u00e9"


def gpt2_bytes_to_unicode():
    """GPT-2's byte alphabet (encoder.py's ``bytes_to_unicode``)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
          + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_CHAR = gpt2_bytes_to_unicode()


def to_symbols(word):
    return [BYTE_CHAR[b] for b in word.encode("utf-8")]


def ref_encode_word(word, ids, merges, ignore_merges):
    """Token ids of one pre-tokenized word by the documented rule."""
    symbols = to_symbols(word)
    if ignore_merges and "".join(symbols) in ids:
        return [ids["".join(symbols)]]
    rank = {}
    for r, entry in enumerate(merges):
        parts = entry.split(" ")
        if len(parts) != 2:
            continue
        a, b = parts
        if a in ids and b in ids and a + b in ids:
            rank.setdefault((a, b), r)
    while True:
        best = None
        for i in range(len(symbols) - 1):
            r = rank.get((symbols[i], symbols[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    return [ids[s] for s in symbols if s in ids]


def ref_encode(text, ids, merges, ignore_merges):
    # texts are letters and single spaces: both pre-tokenizers cut them
    # into " ?letters" words
    out = []
    for word in re.findall(r" ?[^ ]+", text):
        out += ref_encode_word(word, ids, merges, ignore_merges)
    return out


def random_table(rng):
    """Tokens and merge entries (a list of "a b" strings) with unusual entries."""
    tokens = ["\u0120", "a", "b", "c", "d", "\u00c3", "\u00a9", "q"]   # Ġ, Ã, ©; q in no text
    merges = []
    for _ in range(int(rng.integers(25, 45))):
        kind = rng.random()
        a, b = (tokens[int(rng.integers(len(tokens)))] for _ in range(2))
        if kind < 0.55:                        # an ordinary merge
            merges.append(f"{a} {b}")
            if a + b not in tokens:
                tokens.append(a + b)
        elif kind < 0.65:                      # its result is not a token
            if a + b not in tokens:
                merges.append(f"{a} {b}")
        elif kind < 0.72:                      # a part is not a token
            merges.append(f"{a} z{b}" if rng.random() < 0.5 else f"z{a} {b}")
        elif kind < 0.80 and merges:           # a later copy of an earlier entry
            merges.append(merges[int(rng.integers(len(merges)))])
        elif kind < 0.88 and merges:           # an earlier copy of a later entry
            at = int(rng.integers(len(merges)))
            merges.insert(at, merges[int(rng.integers(at, len(merges)))])
        elif kind < 0.94:                      # a merge no text reaches (q)
            merges.append(f"q {a}")
            if "q" + a not in tokens:
                tokens.append("q" + a)
        else:                                  # three parts: never a merge
            merges.append(f"{a} {b} {a}")
    return tokens, merges


def make_tokenizer(tokens, merges, pre):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * len(tokens),
            "tokenizer.ggml.merges": merges}
    return Tokenizer.from_metadata(meta)


def random_text(rng):
    words = []
    for _ in range(int(rng.integers(1, 6))):
        n = int(rng.integers(1, 12))
        words.append("".join(LETTERS[i] for i in rng.choice(len(LETTERS), n,
                                                              p=[.24, .24, .2, .2, .04, .08])))
    return " ".join(words)


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe"])
def test_unusual_merge_tables_follow_the_rule(pre, rng):
    """Twenty random tables, forty texts each: the tokenizer's ids are the
    reference's (llama-bpe: ``ignore_merges``)."""
    ignore = pre == "llama-bpe"
    for _ in range(20):
        tokens, merges = random_table(rng)
        ids = {t: i for i, t in enumerate(tokens)}
        t = make_tokenizer(tokens, merges, pre)
        for _ in range(40):
            text = random_text(rng)
            want = ref_encode(text, ids, merges, ignore)
            got = t.encode(text, add_special=False)
            assert got == want, (text, [tokens[i] for i in got], [tokens[i] for i in want],
                                 merges)


def test_repeated_merge_keeps_its_first_rank():
    """"b c" first, "a b" second, "b c" again last: "abc" is a + bc (its
    first rank), and with the copy listed first instead, ab + c."""
    tokens = ["a", "b", "c", "ab", "bc"]
    t = make_tokenizer(tokens, ["b c", "a b", "b c"], "gpt-2")
    assert [tokens[i] for i in t.encode("abc", add_special=False)] == ["a", "bc"]
    t = make_tokenizer(tokens, ["a b", "b c", "a b"], "gpt-2")
    assert [tokens[i] for i in t.encode("abc", add_special=False)] == ["ab", "c"]


def test_merges_of_non_tokens_are_dropped():
    """A merge whose result is not a token, or whose part is not, never
    applies (and does not hide a later merge of lower priority)."""
    tokens = ["a", "b", "c", "bc", "abc"]
    t = make_tokenizer(tokens, ["a b", "b c", "a bc"], "gpt-2")     # "ab" is no token
    assert [tokens[i] for i in t.encode("abc", add_special=False)] == ["abc"]
    t = make_tokenizer(tokens, ["x b", "b c", "a bc"], "gpt-2")     # "x" is no token
    assert [tokens[i] for i in t.encode("abc", add_special=False)] == ["abc"]


def test_missing_character_blocks_merges_and_is_dropped():
    tokens = ["a", "b", "ab"]
    t = make_tokenizer(tokens, ["a b"], "gpt-2")
    assert [tokens[i] for i in t.encode("azb", add_special=False)] == ["a", "b"]
    assert [tokens[i] for i in t.encode("abz", add_special=False)] == ["ab"]


def test_ignore_merges_takes_a_token_word_whole():
    """"abc" is a token the merges cannot build (b c goes first, then no
    "a bc"): llama-bpe takes the word whole, gpt-2 merges it."""
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    merges = ["b c", "a b", "ab c"]
    assert [tokens[i] for i in make_tokenizer(tokens, merges, "llama-bpe")
            .encode("abc", add_special=False)] == ["abc"]
    assert [tokens[i] for i in make_tokenizer(tokens, merges, "gpt-2")
            .encode("abc", add_special=False)] == ["a", "bc"]
