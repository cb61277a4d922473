"""What the fuzz tests of test_fuzz_text.py run in their child processes
(tests/limits.py): module-level functions, so that a spawned child can import
them without the test module (which needs the pytest session)."""

from __future__ import annotations

import os
import resource
import time

import numpy as np

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "vocab")

_CHILD: dict = {}

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello <b>world</b>!"}]


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _cap_memory(extra_mb: int):
    """Lower this child's address-space limit to what it maps now plus
    ``extra_mb`` (once per child, after its set-up)."""
    if "capped" not in _CHILD:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = _vm_bytes() + (extra_mb << 20)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        _CHILD["capped"] = extra_mb


def _tokenizer(name):
    from ptxgen.llm.text.tokenizer import Tokenizer
    tok = _CHILD.get(name)
    if tok is None:
        tok = _CHILD[name] = Tokenizer.from_gguf(os.path.join(DATA, f"ggml-vocab-{name}.gguf"))
    return tok


def _template_setup():
    from ptxgen.llm.text.chat_template import encode_chat
    tok = _tokenizer("qwen2")
    expected = encode_chat(tok, MESSAGES, template=CHATML, parse_special_in_content=True)
    _CHILD["expected"] = expected
    _cap_memory(200)
    return tok


def hostile_case(template):
    """``(kind, message, seconds, usable)``: the template through
    ``encode_chat``; then whether an ordinary conversation still encodes."""
    from ptxgen.llm.text.chat_template import (ChatTemplateError, ChatTemplateLimitError,
                                               encode_chat)
    tok = _template_setup()
    t0 = time.perf_counter()
    try:
        encode_chat(tok, MESSAGES, template=template)
        kind, message = "ok", ""
    except ChatTemplateLimitError as e:
        kind, message = "limit", str(e)
    except ChatTemplateError as e:
        kind, message = "error", str(e)
    seconds = time.perf_counter() - t0
    usable = encode_chat(tok, MESSAGES, template=CHATML) == _CHILD["expected"]
    return kind, message, seconds, usable


def _reference_env():
    env = _CHILD.get("reference")
    if env is None:
        import json

        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda v, ensure_ascii=False, indent=None, separators=None, \
            sort_keys=False: json.dumps(v, ensure_ascii=ensure_ascii, indent=indent,
                                        separators=separators, sort_keys=sort_keys)
        _CHILD["reference"] = env
    return env


def generated_case(template):
    """``(kind, text or message, seconds, reference text or None)``: the
    template in the sandbox, and in plain Jinja2 when the sandbox rendered it."""
    from ptxgen.llm.text.chat_template import (ChatTemplateError, ChatTemplateLimitError,
                                               render_chat)
    _template_setup()
    variables = dict(messages=MESSAGES, add_generation_prompt=True, bos_token="<s>",
                     eos_token="</s>")
    t0 = time.perf_counter()
    try:
        out = render_chat(template, MESSAGES, bos_token="<s>", eos_token="</s>")
        kind = "ok"
    except ChatTemplateLimitError as e:
        kind, out = "limit", str(e)
    except ChatTemplateError as e:
        kind, out = "error", str(e)
    seconds = time.perf_counter() - t0
    reference = None
    if kind == "ok":
        try:
            reference = _reference_env().from_string(template).render(**variables)
        except Exception as e:                     # noqa: BLE001 - reported to the parent
            reference = f"{type(e).__name__}: {e}"
    return kind, out, seconds, reference


def spelled_case(name, text, parse_special):
    """Tokenize ``text``: ``(pieces == text bytes, ids, ids under max_tokens=len,
    refusal message under len - 1)``."""
    from ptxgen.llm.text.tokenizer import TokenLimitError
    tok = _tokenizer(name)
    ids = tok.encode(text, add_special=False, parse_special=parse_special)
    spelled = b"".join(tok.token_to_piece(i, special=True) for i in ids)
    want = text.encode("utf-8")
    if tok.add_space_prefix and text:
        want = b" " + want
    same = tok.encode(text, add_special=False, parse_special=parse_special,
                      max_tokens=len(ids))
    refused = ""
    if ids:
        try:
            tok.encode(text, add_special=False, parse_special=parse_special,
                       max_tokens=len(ids) - 1)
        except TokenLimitError as e:
            refused = str(e)
    return spelled == want, ids, same, refused


def merge_case(name, words):
    """SPM: (heap merge, scan merge) per word; BPE: (segments, whole word) per word."""
    tok = _tokenizer(name)
    enc = tok._encoder
    out = []
    for w in words:
        if tok.model == "llama":
            out.append((enc._merge_long(w), enc._merge_short(w)))
        else:
            segmented: list = []
            enc._merge_long(w, segmented, None)
            out.append((segmented, enc._merge(w)))
    return out


def timing_case(name, texts):
    """Seconds to encode each text (best of two)."""
    tok = _tokenizer(name)
    times = []
    for text in texts:
        best = float("inf")
        for _ in range(2):
            tok._encoder._cache.clear()
            t0 = time.perf_counter()
            tok.encode(text, add_special=False)
            best = min(best, time.perf_counter() - t0)
        times.append(best)
    return times


def big_text(kind: str, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)

    def chars(lo, hi):
        cps = rng.integers(lo, hi, n, dtype=np.uint32)
        cps[(cps >= 0xD800) & (cps < 0xE000)] = 0x41
        return cps.tobytes().decode("utf-32-le")

    if kind == "one long word":
        return "a" * n
    if kind == "random letters":
        return (rng.integers(0, 26, n, dtype=np.uint8) + 97).tobytes().decode()
    if kind == "many words":
        words = np.array(["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy",
                          "dog.", "Tokenizers", "split", "text,"])
        return " ".join(words[rng.integers(0, len(words), n // 5)])[:n]
    if kind == "random unicode":
        return chars(0x20, 0x30000)
    if kind == "emoji":
        return chars(0x1F300, 0x1FAFF)
    if kind == "cjk":
        return chars(0x4E00, 0x9FA5)
    if kind == "digits":
        return (rng.integers(0, 10, n, dtype=np.uint8) + 48).tobytes().decode()
    if kind == "punctuation":
        p = np.frombuffer(b"!?.,;:'\"()[]{}<>-_=+*&^%$#@", np.uint8)
        return p[rng.integers(0, len(p), n)].tobytes().decode()
    if kind == "spaces":
        return " " * n
    if kind == "newlines":
        return "\n" * n
    if kind == "control tokens":
        return ("<|im_end|>\n<|im_start|>system\n" * (n // 30 + 1))[:n]
    raise ValueError(kind)


def big_prompt_case(name, kind, capacity, via, seed):
    """A 10 MB prompt through a model's ``generate_text`` or ``chat``:
    ``(error type, message, seconds)``."""
    from ptxgen.llm.textgen import TextGeneration

    class Model(TextGeneration):
        position = None

        def __init__(self, tokenizer, capacity):
            self.tokenizer, self.capacity = tokenizer, capacity

        def decode(self, *args, **kwargs):
            raise AssertionError("a prompt this long must not reach the model")

    tok = _tokenizer(name)
    model = Model(tok, capacity)
    if "capped" not in _CHILD:
        tok.encode("warm up: ü 😀", max_tokens=64)
        model_warm = Model(tok, capacity)
        try:
            model_warm.generate_text("a b " * 60000, max_new_tokens=1)
        except Exception:                           # noqa: BLE001 - only warming caches
            pass
        _cap_memory(500)
    text = big_text(kind, 10_000_000, seed)
    t0 = time.perf_counter()
    try:
        if via == "chat":
            model.chat([{"role": "user", "content": text}], template=CHATML,
                       max_new_tokens=1)
        else:
            model.generate_text(text, max_new_tokens=1)
        kind_out, message = "ok", ""
    except Exception as e:                         # noqa: BLE001 - reported to the parent
        kind_out, message = type(e).__name__, str(e)
    return kind_out, message, time.perf_counter() - t0
