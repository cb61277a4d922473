"""Write llama.cpp's answers for the tokenizer tests into tests/data/vocab/.

Needs a llama.cpp build and the reference program built from
``scripts/llama_tokenize_ref.c`` (see its header).  For every vocabulary in
tests/data/vocab/ it writes ``ref-<name>.json`` with llama.cpp's special ids,
flags, end-of-generation set, a SHA-256 of its per-token table (attribute
bits, EOG flag, piece without and with special tokens), and for each text of
``ref_cases.json`` and each (add_special, parse_special) the ids and the
detokenized bytes (without and with special tokens).  For each supported
pre-tokenizer it writes the ids and text (no BOS, no special parsing) on the
GPT-2 vocabulary with ``tokenizer.ggml.pre`` replaced.

Usage::

    python scripts/gen_tokenizer_ref.py PATH/TO/llama_tokenize_ref [--new-cases N]

``--new-cases`` rewrites ref_cases.json with N random texts (seeded) plus a
fixed list; without it the existing cases are kept.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "tests", "data", "vocab")
SEP = "\n__ggml_vocab_test__\n"

# texts every vocabulary is checked on, besides the random ones
FIXED = [
    "", " ", "Hello world", " Hello world", "Hello, y'all! How are you 😁 ?",
    "I'M sure you'LL see we'Ve 'tis", "3333333 1,000,000 3.14159",
    "<s>Hello</s> <unk> [INST] hi [/INST]",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|end|><|user|> x <|assistant|>\n",
    "<|eot_id|><|eot_id|>  <|eot_id|>\n\n<|eot_id|>",
    "tab\tnew\nline\r\ncr\x0bvt\x0cff\x1cfs\x85nel\xa0nbsp\u2003em\u3000ideo",
    "       lots of     spaces      \n\n\n   \t\t  ",
    "Cửa Việt нещо на Български Ελληνικά עברית العربية हिन्दी ไทย 日本語 한국어",
    "🚀 (normal) 😶\u200d🌫️ 👍🏽 🇺🇸 ✅ 🦙🦙",
    "e\u0301 n\u0303 ǅ ﬁ ＡＢＣ １２３ ½ ² Ⅻ ٣",
    "\u0378\ue000\U0010ffff\ufffd\U0001fae8\u0600",
    "camelCaseWord HTTPServer McDonald iPhone XMLHttpRequest",
    "def f(x):\n    return x ** 2  # comment\n",
    "[PAD151646]<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "▁ ▁▁ Ġ Ċ <0x41> ø ÿ",
]

POOL = [
    "Hello", "world", "the", "The", "HELLO", "camelCase", "McDonald", "I'm", "you're", "it'S",
    "we'VE", "'ll", "'d", "'t", "'", "''", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n",
    "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\xa0", "\u2003", "\u3000", "\u2028", "\u200b",
    "0", "7", "42", "123", "1234", "12345678", "3.14", "1,000", "٣", "Ⅻ", "½", "²",
    ".", ",", "!", "?", "...", "!!", "?!", "--", "==", "->", "()", "[", "]", "{", "}", "<", ">",
    "/", "\\", "_", "`", "~", "@", "#", "$", "%", "^", "&", "*", "+", "|", '"', ";", ":",
    "é", "Ä", "ñ", "ß", "Straße", "naïve", "Cửa Việt", "e\u0301", "ǅ", "ﬁ",
    "нещо", "Български", "Ελληνικά", "ΣΊΣΥΦΟΣ", "עברית", "العربية", "हिन्दी", "কাজ", "ไทย",
    "កាន់តែ", "日本語", "我想在", "工作", "한국어", "カタカナ", "ｱｲｳ", "ＡＢＣ", "１２３",
    "🦙", "😁", "🚀", "😶\u200d🌫️", "👍🏽", "✅", "🇺🇸", "\ufe0f",
    "\u0378", "\ue000", "\U0010ffff", "\ufffd", "\U0001fae8", "\u0600", "\U0001e900",
    "<s>", "</s>", "<unk>", "<|eot_id|>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>",
    "<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>", "<|fim_prefix|>", "[PAD151646]",
    "[INST]", "<0x41>", "\u2581", "\u2581\u2581", "Ġ", "Ċ", "ø", "ÿ",
]


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 14)):
        r = rng.random()
        if r < 0.75:
            parts.append(rng.choice(POOL))
        elif r < 0.9:
            cps = [rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FFF),
                               rng.randint(0x3000, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])
                   for _ in range(rng.randint(1, 4))]
            parts.append("".join(map(chr, cps)))
        else:
            parts.append(rng.choice([" ", "  ", "\n", "\t"]) * rng.randint(1, 6))
    return "".join(parts)


def patch_pre(src: str, pre: str, dst: str) -> None:
    """Copy a GGUF file with its tokenizer.ggml.pre string replaced."""
    data = open(src, "rb").read()
    key = b"tokenizer.ggml.pre"
    k = data.index(struct.pack("<Q", len(key)) + key)
    p = k + 8 + len(key)
    assert struct.unpack_from("<I", data, p)[0] == 8  # a string value
    n = struct.unpack_from("<Q", data, p + 4)[0]
    new = pre.encode()
    with open(dst, "wb") as f:
        f.write(data[:p + 4] + struct.pack("<Q", len(new)) + new + data[p + 12 + n:])


def run(ref: str, *args) -> str:
    return subprocess.run([ref, *args], capture_output=True, check=True).stdout.decode()


def vocab_info(ref: str, path: str) -> dict:
    lines = run(ref, path, "vocab").split("\n")
    bos, eos, eot, add_bos, add_eos, n = map(int, lines[0].split())
    table = "".join(line + "\n" for line in lines[1:] if line)
    eog = [int(line.split()[0]) for line in lines[1:] if line and line.split()[2] == "1"]
    none = lambda x: None if x < 0 else x  # noqa: E731
    return {"bos": none(bos), "eos": none(eos), "eot": none(eot), "add_bos": bool(add_bos),
            "add_eos": bool(add_eos), "n_vocab": n, "eog": eog,
            "table_sha256": hashlib.sha256(table.encode()).hexdigest()}


def cases_results(ref: str, path: str, cases: list, modes) -> list:
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(SEP.join(cases).encode("utf-8"))
        name = f.name
    try:
        out = []
        for add, parse in modes:
            lines = run(ref, path, "cases", name, str(add), str(parse)).split("\n")[:-1]
            assert len(lines) == len(cases), (path, len(lines), len(cases))
            for i, line in enumerate(lines):
                ids, d0, d1 = line.split("\t")
                out.append([i, add, parse, [int(x) for x in ids.split()], d0, d1])
        return out
    finally:
        os.unlink(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ref", help="the llama_tokenize_ref program")
    ap.add_argument("--new-cases", type=int, default=0)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(HERE, ".."))
    from ptxgen.llm.text.pretokenize import PRE_TOKENIZERS

    cases_path = os.path.join(DATA, "ref_cases.json")
    if args.new_cases:
        rng = random.Random(20260526)
        cases = FIXED + [random_text(rng) for _ in range(args.new_cases)]
        # the reference program reads texts between separators
        cases = [c for c in cases if SEP not in c]
        with open(cases_path, "w", encoding="utf-8") as f:
            json.dump(cases, f, ensure_ascii=True, indent=0)
    cases = json.load(open(cases_path, encoding="utf-8"))

    modes = [(0, 0), (0, 1), (1, 0), (1, 1)]
    for path in sorted(glob.glob(os.path.join(DATA, "ggml-vocab-*.gguf"))):
        name = os.path.basename(path)[len("ggml-vocab-"):-len(".gguf")]
        doc = {"vocab": os.path.basename(path), **vocab_info(args.ref, path),
               "results": cases_results(args.ref, path, cases, modes)}
        with open(os.path.join(DATA, f"ref-{name}.json"), "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        print("wrote", f"ref-{name}.json")

    # every pre-tokenizer on the GPT-2 vocabulary
    gpt2 = os.path.join(DATA, "ggml-vocab-gpt-2.gguf")
    pres = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in sorted(PRE_TOKENIZERS):
            dst = os.path.join(tmp, f"{pre}.gguf")
            patch_pre(gpt2, pre, dst)
            info = vocab_info(args.ref, dst)
            results = cases_results(args.ref, dst, cases, [(0, 0)])
            pres[pre] = {"add_bos": info["add_bos"],
                         "results": [[r[0], r[3], r[4]] for r in results]}
    with open(os.path.join(DATA, "ref-gpt-2-pre.json"), "w") as f:
        json.dump({"vocab": os.path.basename(gpt2), "pre": pres}, f, separators=(",", ":"))
    print("wrote ref-gpt-2-pre.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
