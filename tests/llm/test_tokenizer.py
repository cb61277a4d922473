"""The GGUF tokenizer against llama.cpp.

Reference data in tests/data/vocab/:

* ``ggml-vocab-*.gguf`` with ``.inp``/``.out``: vocabulary-only GGUF files
  and test cases from llama.cpp's own source tree (``models/``), read as its
  ``tests/test-tokenizer-0.cpp`` reads them: cases split on
  ``"\\n__ggml_vocab_test__\\n"``, one line of ids per case, tokenized with
  ``add_special=false, parse_special=false``;
* ``ref-*.json``: llama.cpp's answers (written by
  scripts/gen_tokenizer_ref.py through llama.cpp's C API) for the texts of
  ``ref_cases.json``: ids for add/parse special both ways, the detokenized
  bytes with and without special tokens, the special ids, the
  end-of-generation set and a digest of the per-token table; and, on the
  GPT-2 vocabulary, the ids and text under every supported pre-tokenizer.
"""

import functools
import hashlib
import json
import os

import numpy as np
import pytest

from ptxgen.llm.gguf.metadata import GGUFMetadataError, read_gguf_metadata
from ptxgen.llm.text.tokenizer import (SUPPORTED_PRE_TOKENIZERS, TokenLimitError, Tokenizer,
                                           TokenizerError)
from ptxgen.llm.text.vocab import ATTR

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "vocab")
SEP = "\n__ggml_vocab_test__\n"
VOCABS = sorted(f[len("ggml-vocab-"):-len(".gguf")] for f in os.listdir(DATA)
                if f.startswith("ggml-vocab-") and f.endswith(".gguf"))


def vocab_path(name):
    return os.path.join(DATA, f"ggml-vocab-{name}.gguf")


@functools.lru_cache(maxsize=None)
def tok(name) -> Tokenizer:
    return Tokenizer.from_gguf(vocab_path(name))


@functools.lru_cache(maxsize=None)
def ref(name) -> dict:
    with open(os.path.join(DATA, f"ref-{name}.json")) as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def ref_cases() -> list:
    with open(os.path.join(DATA, "ref_cases.json"), encoding="utf-8") as f:
        return json.load(f)


def llamacpp_cases(name):
    """(text, ids) pairs of a .inp/.out pair, as test-tokenizer-0 reads them."""
    with open(vocab_path(name) + ".inp", "rb") as f:
        raw = f.read().decode("utf-8")
    texts = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    with open(vocab_path(name) + ".out", "rb") as f:
        lines = f.read().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # getline() sees no line after the final newline
    assert len(texts) == len(lines), f"{name}: {len(texts)} inputs, {len(lines)} outputs"
    return [(t, [int(x) for x in line.strip().split(" ") if x]) for t, line in zip(texts, lines)]


def test_every_vocab_file_has_its_reference():
    assert {"llama-bpe", "llama-spm"} <= set(VOCABS)
    for name in VOCABS:
        assert os.path.exists(vocab_path(name) + ".inp")
        assert os.path.exists(os.path.join(DATA, f"ref-{name}.json"))


@pytest.mark.parametrize("name", VOCABS)
def test_llamacpp_test_cases(name):
    cases = llamacpp_cases(name)
    assert len(cases) >= 40
    t = tok(name)
    bad = [(text, want, got) for text, want in cases
           if (got := t.encode(text, add_special=False, parse_special=False)) != want]
    assert not bad, f"{name}: {len(bad)} of {len(cases)} differ; first: {bad[0]!r}"


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_tables_match_llamacpp(name):
    t, r = tok(name), ref(name)
    assert (t.bos_id, t.eos_id, t.eot_id, t.add_bos, t.add_eos, t.n_vocab) == \
        (r["bos"], r["eos"], r["eot"], r["add_bos"], r["add_eos"], r["n_vocab"])
    assert sorted(t.eog_ids) == r["eog"]
    # each token's attribute bits, EOG flag and pieces, as the reference
    # program prints them, hashed
    lines = []
    for i in range(t.n_vocab):
        lines.append(f"{i} {t.token_attr(i)} {int(t.is_eog(i))} "
                     f"{t.token_to_piece(i, special=False).hex()} "
                     f"{t.token_to_piece(i, special=True).hex()}\n")
    assert hashlib.sha256("".join(lines).encode()).hexdigest() == r["table_sha256"]


@pytest.mark.parametrize("name", VOCABS)
def test_encode_decode_match_llamacpp(name):
    t, r, cases = tok(name), ref(name), ref_cases()
    assert len(r["results"]) == 4 * len(cases)
    bad = []
    for i, add, parse, ids, dec0, dec1 in r["results"]:
        got = t.encode(cases[i], add_special=bool(add), parse_special=bool(parse))
        if got != ids:
            bad.append(("ids", add, parse, cases[i], ids, got))
        if t.decode_bytes(ids, special=False) != bytes.fromhex(dec0):
            bad.append(("decode", cases[i], ids))
        if t.decode_bytes(ids, special=True) != bytes.fromhex(dec1):
            bad.append(("decode special", cases[i], ids))
    assert not bad, f"{name}: {len(bad)} differences; first: {bad[0]!r}"


@functools.lru_cache(maxsize=None)
def pre_ref() -> dict:
    with open(os.path.join(DATA, "ref-gpt-2-pre.json")) as f:
        return json.load(f)


def test_every_supported_pre_tokenizer_has_reference_data():
    assert sorted(pre_ref()["pre"]) == sorted(SUPPORTED_PRE_TOKENIZERS)
    for must in ("default", "gpt-2", "llama-bpe", "qwen2", "deepseek-llm", "tekken"):
        assert must in SUPPORTED_PRE_TOKENIZERS


@pytest.mark.parametrize("pre", SUPPORTED_PRE_TOKENIZERS)
def test_pre_tokenizer_matches_llamacpp(pre):
    base = tok(pre_ref()["vocab"][len("ggml-vocab-"):-len(".gguf")])
    t = base.with_pre_tokenizer(pre)
    r = pre_ref()["pre"][pre]
    assert t.add_bos == r["add_bos"]
    cases = ref_cases()
    bad = []
    for i, ids, dec0 in r["results"]:
        got = t.encode(cases[i], add_special=False)
        if got != ids or t.decode_bytes(ids) != bytes.fromhex(dec0):
            bad.append((cases[i], ids, got))
    assert not bad, f"{pre}: {len(bad)} differences; first: {bad[0]!r}"


@pytest.mark.parametrize("name", VOCABS)
def test_a_token_limit_changes_nothing_it_admits(name):
    """Every reference case and llama.cpp test text, with ``max_tokens`` its
    llama.cpp count: the same ids (the limit's word-at-a-time path); one
    less: TokenLimitError, whose lower bound never exceeds the count."""
    t = tok(name)
    texts = ref_cases() + [c for c, _ in llamacpp_cases(name)]
    for text in texts:
        for add, parse in ((False, False), (True, True)):
            ids = t.encode(text, add_special=add, parse_special=parse)
            assert t.encode(text, add_special=add, parse_special=parse,
                            max_tokens=len(ids)) == ids, (name, text)
            if not ids:
                continue
            with pytest.raises(TokenLimitError, match=f"more than the limit of {len(ids) - 1}") \
                    as e:
                t.encode(text, add_special=add, parse_special=parse, max_tokens=len(ids) - 1)
            assert len(ids) - 1 < e.value.at_least <= len(ids) and e.value.limit == len(ids) - 1


def test_long_text_is_refused_before_it_is_tokenized():
    """A text whose length alone needs more tokens is refused at once (no
    token stands for more bytes than the longest piece); a long word by the
    longest token made of its characters; the rest as the count passes."""
    t = tok("llama-spm")
    longest = max(len(t.token_to_piece(i, special=True)) for i in range(t.n_vocab))
    n = 1000 * longest
    with pytest.raises(TokenLimitError, match=r"at least 1001 tokens by its length, more "
                                              r"than the limit of 1000"):
        t.encode("x" * (n + 1), add_special=False, max_tokens=1000)
    # "\u2581" + "a" * n passes that bound; its tokens are at most as long as
    # the longest token of those two characters
    within = max(len(x) for x in t._vocab.tokens if set(x) <= {"\u2581", "a"})
    with pytest.raises(TokenLimitError, match="more than the limit of 1000") as e:
        t.encode("a" * n, add_special=False, max_tokens=1000)
    assert e.value.at_least == -(-(n + 1) // within) > 1000
    words = "one two three " * 1000
    assert len(words) // longest < 1000 < len(t.encode(words, add_special=False))
    with pytest.raises(TokenLimitError) as e:
        t.encode(words, add_special=False, max_tokens=1000)
    assert e.value.at_least == 1001          # stopped as the count passed the limit
    q = tok("llama-bpe")
    with pytest.raises(TokenLimitError, match="more than the limit of 1000"):
        q.encode("=" * 200_000, add_special=False, max_tokens=1000)


def test_long_words_under_a_limit_are_bounded_in_total():
    """A run of one character needs few tokens but its merge costs time per
    character: under a token limit the long words of a text hold at most
    1 MiB (BPE) or 256 KiB (SPM) together."""
    q = tok("llama-bpe")
    run = " " * 600_000 + "x"
    assert q.encode(run, add_special=False, max_tokens=10_000) == \
        q.encode(run, add_special=False)                              # 4688 + 1 tokens
    with pytest.raises(TokenizerError, match=r"words of more than 1024 characters \(one of "
                                             r"599999\) add up to more than 1048576"):
        q.encode(run * 2, add_special=False, max_tokens=20_000)
    assert len(q.encode(run * 2, add_special=False)) < 20_000        # without a limit: taken
    s = tok("llama-spm")
    with pytest.raises(TokenizerError, match="add up to more than 262144"):
        s.encode("a" * 300_000, add_special=False, max_tokens=100_000)


def test_split_special_and_encode_parts():
    t = tok("qwen2")
    text = "a<|im_end|> b<|im_start|>"
    parts = t.split_special(text, parse_special=True)
    assert parts == ["a", 151645, " b", 151644]
    assert t.special_spans(text) == [(0, 1), 151645, (11, 13), 151644]
    assert t.split_special(text, parse_special=False) == [text]
    assert t.encode_parts(parts, add_special=False) == t.encode(text, add_special=False,
                                                                parse_special=True)
    # a str part is plain text: its special-token texts are not cut out
    assert t.encode_parts([text], add_special=False) == t.encode(text, add_special=False)
    with pytest.raises(TypeError, match="a part is a str or a token id, got float"):
        t.encode_parts(["a", 1.5])
    with pytest.raises(ValueError, match="max_tokens must be an int >= 0, got -1"):
        t.encode("a", max_tokens=-1)
    with pytest.raises(ValueError, match="not encodable as UTF-8 at index 1"):
        t.encode_parts(["a\ud800"])


# -- behaviour spelled out -------------------------------------------------------

def test_llama3_known_ids_and_specials():
    t = tok("llama-bpe")
    assert t.encode("Hello world", add_special=False) == [9906, 1917]
    assert t.encode("Hello world") == [128000, 9906, 1917]  # add_bos from the pre-tokenizer
    assert t.eog_ids == {128001, 128009}  # <|end_of_text|>, <|eot_id|>
    assert t.eot_id == 128009
    assert t.encode("<|eot_id|>", add_special=False, parse_special=True) == [128009]
    plain = t.encode("<|eot_id|>", add_special=False, parse_special=False)
    assert 128009 not in plain and len(plain) > 1
    assert t.decode(plain) == "<|eot_id|>"


def test_parse_special_only_when_asked():
    # plain text never yields a CONTROL token; with parse_special the
    # control-token texts of the reference cases do
    cases = ref_cases()
    for name in VOCABS:
        t = tok(name)
        control_seen = False
        for text in cases:
            plain = t.encode(text, add_special=False, parse_special=False)
            assert not any(t.token_attr(i) & ATTR.CONTROL for i in plain), (name, text)
            parsed = t.encode(text, add_special=False, parse_special=True)
            control_seen |= any(t.token_attr(i) & ATTR.CONTROL for i in parsed)
        # the cases hold "<s>", "<|eot_id|>", "<|im_end|>", "<|endoftext|>", "<|end|>"
        if name in ("llama-bpe", "llama-spm", "phi-3", "qwen2", "gpt-2"):
            assert control_seen, name


def test_user_defined_tokens_split_without_parse_special():
    # MPT's vocabulary has runs of spaces as USER_DEFINED tokens: they are cut
    # out of plain text, as Hugging Face added tokens are
    t = tok("mpt")
    run = " " * 8
    tid = next(i for i in range(t.n_vocab) if t.token_text(i) == run)
    assert t.token_attr(tid) & ATTR.USER_DEFINED
    assert tid in t.encode(f"a{run}b", add_special=False, parse_special=False)


def test_spm_leading_space_and_byte_fallback():
    t = tok("llama-spm")
    ids = t.encode("Hello", add_special=False)
    assert [t.token_text(i) for i in ids] == ["\u2581Hello"]
    # a character missing from the vocabulary falls back to its UTF-8 bytes
    ids = t.encode("🦙", add_special=False)
    texts = [t.token_text(i) for i in ids]
    assert texts[0] == "\u2581" and texts[1:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert t.decode(ids) == "🦙"
    assert t.token_to_piece(ids[1]) == b"\xf0"


def test_token_to_piece_is_bytes():
    t = tok("llama-bpe")
    ids = t.encode("🦙", add_special=False)
    assert len(ids) > 1
    pieces = [t.token_to_piece(i) for i in ids]
    assert all(isinstance(p, bytes) for p in pieces)
    assert b"".join(pieces) == "🦙".encode()
    assert t.token_to_piece(128009) == b""
    assert t.token_to_piece(128009, special=True) == b"<|eot_id|>"


@pytest.mark.parametrize("name", VOCABS)
def test_decode_round_trip(name):
    # llama.cpp's detokenizer returns the encoded text except where its
    # clean-up rewrites spaces before punctuation/contractions (clean_spaces
    # vocabularies) or a byte has no token (none here): every reference text
    # and every llama.cpp test text without those patterns comes back
    t = tok(name)
    texts = ref_cases() + [c for c, _ in llamacpp_cases(name)]
    cleanup = (" ?", " !", " .", " ,", " '")
    # a user-defined piece comes back as it is (llama.cpp's token_to_piece):
    # where runs of U+2581 are user-defined tokens (Gemma 3), so do runs of spaces
    run = "\u2581\u2581".encode()
    runs = t.model == "llama" and any(
        t.token_attr(i) & ATTR.USER_DEFINED and run in t.token_to_piece(i)
        for i in range(t.n_vocab))
    n = 0
    for text in texts:
        if t.clean_spaces and any(p in text for p in cleanup):
            continue
        if t.model == "llama" and "\u2581" in text:
            continue  # SPM writes spaces as U+2581, and decodes U+2581 as a space
        if runs and "  " in text:
            continue
        assert t.decode(t.encode(text, add_special=False)) == text, (name, text)
        n += 1
    assert n > 50


def test_stream_decoder_holds_partial_utf8():
    t = tok("qwen2")
    text = "naïve 🦙 and 😶\u200d🌫️ 日本語"
    ids = t.encode(text, add_special=False)
    d = t.stream_decoder()
    outs = [d.feed(i) for i in ids]
    assert "".join(outs) + d.flush() == text
    assert all("\ufffd" not in o for o in outs)
    # a character whose four bytes arrive in several tokens: nothing shows
    # until the last
    char = next(c for c in "\U0001fae8\U0001d11e\U00010348\U0001f9ec"
                if len(t.encode(c, add_special=False)) >= 2)
    llama = t.encode(char, add_special=False)
    d = t.stream_decoder()
    assert [d.feed(i) for i in llama] == [""] * (len(llama) - 1) + [char]
    # an incomplete sequence at the end comes out as U+FFFD on flush
    d = t.stream_decoder()
    assert d.feed(llama[0]) == ""
    assert d.flush() == "\ufffd"


@pytest.mark.parametrize("name", ["qwen2", "deepseek-llm", "llama-spm"])
def test_stream_decoder_equals_llamacpp_text(name):
    # no clean-up in these vocabularies: the streamed pieces are llama.cpp's
    # detokenized text (SPM: but for the first token's leading space)
    t, r, cases = tok(name), ref(name), ref_cases()
    for i, add, parse, ids, dec0, _ in r["results"]:
        if add or parse:
            continue
        d = t.stream_decoder()
        streamed = ("".join(d.feed(x) for x in ids) + d.flush()).encode()
        want = bytes.fromhex(dec0)
        if t.add_space_prefix and streamed[:1] == b" ":
            streamed = streamed[1:]
        assert streamed == want.decode("utf-8", "replace").encode(), cases[i]


def test_eog_sets():
    assert {151643, 151645} <= tok("qwen2").eog_ids  # <|endoftext|>, <|im_end|>
    phi = tok("phi-3")
    assert {32000, 32007, 2} <= phi.eog_ids  # <|endoftext|>, <|end|>, </s>
    assert phi.is_eog(32007) and not phi.is_eog(32010)  # <|end|> yes, <|user|> no
    assert tok("llama-spm").eog_ids == {2}


# -- refusals ------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def gpt2_meta():
    return read_gguf_metadata(vocab_path("gpt-2"))


def test_unknown_pre_tokenizer_is_refused():
    meta = dict(gpt2_meta())
    meta["tokenizer.ggml.pre"] = "no-such-pre"
    with pytest.raises(TokenizerError, match=r"'no-such-pre'.*supported:.*llama-bpe"):
        Tokenizer.from_metadata(meta)
    del meta["tokenizer.ggml.pre"]
    with pytest.raises(TokenizerError, match="no 'tokenizer.ggml.pre'"):
        Tokenizer.from_metadata(meta)
    with pytest.raises(TokenizerError, match="'no-such-pre'"):
        tok("gpt-2").with_pre_tokenizer("no-such-pre")


def test_unknown_tokenizer_model_is_refused():
    meta = dict(gpt2_meta())
    meta["tokenizer.ggml.model"] = "bert"
    with pytest.raises(TokenizerError, match=r"'bert'.*supported: llama, gpt2"):
        Tokenizer.from_metadata(meta)
    with pytest.raises(TokenizerError, match="no 'tokenizer.ggml.model'"):
        Tokenizer.from_metadata({"general.name": "x"})


def test_bad_inputs_are_refused(tmp_path):
    t = tok("gpt-2")
    with pytest.raises(TypeError, match="str"):
        t.encode(b"bytes")
    with pytest.raises(ValueError, match="UTF-8"):
        t.encode("a\ud800b")
    with pytest.raises(ValueError, match="out of range"):
        t.decode([t.n_vocab])
    with pytest.raises(GGUFMetadataError, match="not a GGUF"):
        p = tmp_path / "x.gguf"
        p.write_bytes(b"not a gguf file")
        Tokenizer.from_gguf(p)
    with pytest.raises(GGUFMetadataError, match="directory"):
        Tokenizer.from_gguf(tmp_path)
    with pytest.raises(GGUFMetadataError, match="truncated"):
        p = tmp_path / "t.gguf"
        p.write_bytes(open(vocab_path("gpt-2"), "rb").read()[:5000])
        Tokenizer.from_gguf(p)


def test_from_metadata_and_reader_agree(tmp_path):
    meta = read_gguf_metadata(vocab_path("llama-spm"))
    assert isinstance(meta["tokenizer.ggml.scores"], np.ndarray)
    a = Tokenizer.from_metadata(meta)
    text = "The quick brown fox, 3 times! <s>"
    assert a.encode(text, parse_special=True) == tok("llama-spm").encode(text, parse_special=True)
    # gguf's reader, on a small vocabulary written with gguf's writer (the
    # reader takes seconds on a full one)
    gguf = pytest.importorskip("gguf")
    n = 3000
    path = str(tmp_path / "small.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(meta["tokenizer.ggml.tokens"][:n])
    w.add_token_scores(meta["tokenizer.ggml.scores"][:n].tolist())
    w.add_token_types(meta["tokenizer.ggml.token_type"][:n].tolist())
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(path)
    b = Tokenizer.from_reader(reader)
    c = Tokenizer.from_gguf(path)
    assert b.n_vocab == c.n_vocab == n
    ids = c.encode(text, parse_special=True)
    assert b.encode(text, parse_special=True) == ids

    class OldField:  # a reader field without contents(), as older gguf packages have
        def __init__(self, f):
            self.types, self.parts, self.data = f.types, f.parts, f.data

    class OldReader:
        fields = {k: OldField(f) for k, f in reader.fields.items()}

    d = Tokenizer.from_reader(OldReader())
    assert d.encode(text, parse_special=True) == ids and d.eog_ids == c.eog_ids
    assert max(ids) < n and ids.count(1) == 2  # BOS, and "<s>" parsed
    assert b.decode(ids) == c.decode(ids)
