"""Hostile GGUF files: every one ends in a load or a one-line GGUF error,
quickly and in little memory, never another exception, a hang or a
memory blow-up.

Each case runs in a child process under an address-space limit and a
deadline (tests/limits.py), through every reader: the metadata reader, the
whole-file reader, the model file with its tokenizer (what the API, ``run``
and ``chat`` load) and ``info``'s report; the CLI commands run in the child
too, and a few as real ``python -m ptxgen`` processes.

- the corpus (hostile_gguf.py): issue 53's cases and their relatives, each
  refused at the right stage with the right message;
- generated files (hypothesis): headers, metadata and tensor infos drawn
  from interesting counts, lengths, types and offsets;
- mutated files (hypothesis): valid small files with their count, length,
  type, dimension and offset fields overwritten, bytes changed, cut or
  spliced; a file the project's reader accepts is read again with the
  ``gguf`` package's reader, and the two must agree;
- valid files (hypothesis): drawn shapes, alignments and hyperparameters
  load, every tensor a read-only view of the bytes at its offset.

``PTXGEN_FUZZ_EXAMPLES`` sets the examples per hypothesis test (CI's
default is small; ``make fuzz`` runs many).  The hypothesis seed derives
from the session seed (``pytest --seed N`` repeats a run).
"""

import os
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

import gguf_image as G
import gguf_probe
import seeding
from hostile_gguf import corpus
from limits import Pool

from ptxgen.llm.gguf.synth import write_synthetic_llama

EXAMPLES = int(os.environ.get("PTXGEN_FUZZ_EXAMPLES") or 200)
#: per case: seconds for one reader, resident megabytes gained, the child's address space
SECONDS, PEAK_MB, LIMIT_MB = 1.0, 200, 768
VOCAB_DIR = os.path.join(os.path.dirname(__file__), "..", "data", "vocab")
TINY = dict(n_layers=1, hidden=32, ffn=32, n_heads=2, n_kv_heads=1, qtype="Q8_0",
            output_qtype="Q8_0", context_length=64)


def _fuzz_settings(name):
    """Hypothesis settings and a seed derived from the session's."""
    def wrap(fn):
        fn = settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))(fn)
        return hypothesis_seed(seeding.seed_for(f"tests/fuzz/test_fuzz_gguf.py::{name}"))(fn)
    return wrap


@pytest.fixture(scope="module")
def bases(tmp_path_factory, module_seed):
    """Two valid tiny llama files: an SPM vocabulary and a byte-level BPE one."""
    d = tmp_path_factory.mktemp("fuzz-gguf")
    write_synthetic_llama(d / "spm.gguf", seed=module_seed, vocab=260, tokenizer="llama", **TINY)
    bpe = os.path.join(VOCAB_DIR, "ggml-vocab-gpt-2.gguf")
    write_synthetic_llama(d / "bpe.gguf", seed=module_seed, vocab_from=bpe, vocab_limit=300,
                          **TINY)
    return {"spm": (d / "spm.gguf").read_bytes(), "bpe": (d / "bpe.gguf").read_bytes()}


@pytest.fixture(scope="module")
def pool(bases):
    """A limited child, warmed by loading a valid file (imports, first maps)."""
    with Pool(mem_mb=LIMIT_MB) as p:
        out = p.run(gguf_probe.probe, bases["spm"], timeout=60)
        assert out.kind == "ok", out.error
        assert out.value["model"][:2] == ("ok", (1, 260)), out.value
        yield p


@pytest.fixture(scope="module")
def hostile(bases):
    return corpus(bases["spm"], bases["bpe"])


def _check(out, what):
    """The child returned (no other exception, hang or crash) and every
    reader either read the file or refused it; returns the stages."""
    assert out.kind == "ok", f"{what}: {out.kind}: {out.error}"
    res = out.value
    for stage in ("metadata", "file", "model", "info"):
        assert res[stage][0] in ("ok", "refused"), (what, stage, res[stage])
    # one file, one verdict: a file whose structure is refused is refused
    # everywhere past the metadata, and a loadable file reads everywhere
    if res["file"][0] == "refused":
        assert res["model"][0] == res["info"][0] == "refused", (what, res)
    if res["model"][0] == "ok":
        assert res["metadata"][0] == res["file"][0] == res["info"][0] == "ok", (what, res)
    return res


def _verdict(res) -> str:
    """Where a file was refused, for hypothesis's statistics."""
    for stage in ("metadata", "file", "model"):
        if res[stage][0] == "refused":
            return f"refused by the {stage} reader"
    return "loaded"


# ---------------------------------------------------------------- the corpus
def test_corpus_through_the_api(pool, hostile):
    """Every listed case is refused at its stage with its message, each
    reader within a second, the child gaining under 200 MB (the cases run
    in one child, warmed on a small file: each case's rise over the peak
    so far)."""
    bad = []
    for name, (data, stage, message) in hostile.items():
        out = pool.run(gguf_probe.probe, data, timeout=10)
        res = _check(out, name)
        model, info, file = res["model"], res["info"], res["file"]
        if model[0] != "refused" or message not in model[1]:
            bad.append(f"{name}: model {model}")
        if stage == "file" and (file[0] != "refused" or message not in file[1]
                                or info[0] != "refused" or message not in info[1]):
            bad.append(f"{name}: file {file}, info {info}")
        if stage == "model" and (file[0] != "ok" or info[0] != "ok"
                                 or "ptxgen decode: no: " not in info[1]
                                 or message not in info[1]):
            bad.append(f"{name}: file {file}, info {info}")
        slow = {k: v[2] for k, v in res.items() if v[2] > SECONDS}
        if slow or out.peak_mb > PEAK_MB:
            bad.append(f"{name}: seconds {slow}, {out.peak_mb:.0f} MB")
        assert "\n" not in model[1], (name, model[1])
    assert not bad, "\n".join(bad)


def _one_error_line(err: str) -> list:
    return [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize("command", ["info", "run", "chat", "serve"])
def test_corpus_through_the_cli(pool, hostile, command):
    """``python -m ptxgen info|run|chat|serve FILE`` (in the child): one
    ``error:`` line naming the file and the problem, exit code 2, no
    traceback (``serve`` refuses the file before it listens); info describes
    a file whose structure is sound and says why it cannot run."""
    argv = {"info": ["info"], "run": ["run", "-p", "hi", "-n", "1", "--backend", "emu"],
            "chat": ["chat", "-n", "1", "--backend", "emu"],
            "serve": ["serve", "--backend", "emu", "--port", "0"]}[command]
    bad = []
    for name, (data, stage, message) in hostile.items():
        out = pool.run(gguf_probe.cli, data, argv, timeout=10)
        assert out.kind == "ok", f"{name}: {out.kind}: {out.error}"
        rc, stdout, err, secs = out.value
        lines = _one_error_line(err)
        if command == "info" and stage == "model":
            ok = rc == 0 and not lines and "ptxgen decode: no: " in stdout and message in stdout
        else:
            ok = (rc == 2 and len(lines) == 1 and lines[0].startswith("error: FILE: ")
                  and message in lines[0])
        if not ok or "Traceback" in err or secs > 2 * SECONDS:
            bad.append(f"{name}: rc {rc}, {secs:.2f} s, stderr {err!r}, stdout {stdout[-300:]!r}")
    assert not bad, "\n".join(bad)


def test_process_stays_usable(pool, hostile, bases):
    """After every hostile case, the same process still loads a valid file."""
    for data, _, _ in hostile.values():
        pool.run(gguf_probe.probe, data, timeout=10)
    out = pool.run(gguf_probe.probe, bases["bpe"], timeout=10)
    res = _check(out, "bpe")
    tokens = G.walk(bases["bpe"])[0].kv("tokenizer.ggml.tokens").value
    assert res["model"][:2] == ("ok", (1, int.from_bytes(tokens[4:12], "little"))), res


@pytest.mark.parametrize("case, command", [
    ("string-array-2^62", ["info"]), ("string-array-2^62", ["run", "-p", "hi"]),
    ("llama.block_count:1e9", ["chat"]), ("tokenizer.ggml.tokens:integers", ["run", "-p", "hi"]),
])
def test_corpus_as_a_command(hostile, tmp_path, case, command):
    """A real ``python -m ptxgen`` process: one error line, exit code 2."""
    data, _, message = hostile[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "ptxgen", command[0], str(path), *command[1:]],
                       input="hi\n", capture_output=True, text=True, timeout=60)
    secs = time.perf_counter() - t0
    lines = [ln for ln in p.stderr.splitlines() if not ln.startswith("no GPU found")]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ") and message in lines[0], \
        p.stderr
    assert secs < 30, secs                       # interpreter start and imports included


# ---------------------------------------------------------------- generated files
INTERESTING = [0, 1, 2, 3, 7, 8, 31, 32, 33, 63, 64, 255, 256, 1023, 1024, 1025, 1 << 16,
               (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 62, (1 << 63) - 1, 1 << 63,
               (1 << 64) - 1]
KEYS = ["general.architecture", "general.alignment", "general.name", "llama.block_count",
        "llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
        "llama.attention.head_count", "llama.attention.head_count_kv",
        "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base",
        "llama.rope.dimension_count", "llama.vocab_size", "llama.attention.key_length",
        "llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.expert_count",
        "llama.attention.causal", "tokenizer.ggml.model", "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token",
        "tokenizer.chat_template", "x", ""]
TENSORS = ["token_embd.weight", "output.weight", "output_norm.weight", "blk.0.attn_q.weight",
           "blk.0.attn_norm.weight", "blk.1.ffn_up.weight", "rope_freqs.weight"]
GGML_IDS = [0, 1, 2, 8, 12, 14, 24, 28, 30, 4, 5, 31, 41, 42]
_BITS = {G.U8: 8, G.U16: 16, G.U32: 32, G.U64: 64}
_SIGNED = {G.I8: 8, G.I16: 16, G.I32: 32, G.I64: 64}

counts = st.one_of(st.integers(0, 6), st.sampled_from(INTERESTING))


def _scalar(vtype):
    """Any value of a numeric GGUF type, edge values first (hypothesis
    favours the first choices)."""
    if vtype in _BITS:
        top = 1 << _BITS[vtype]
        return st.one_of(st.sampled_from([v for v in reversed(INTERESTING) if v < top]),
                         st.integers(0, top - 1))
    if vtype in _SIGNED:
        b = _SIGNED[vtype] - 1
        edge = [v for v in reversed(INTERESTING) if v < 1 << b]
        return st.one_of(st.sampled_from(edge + [-v for v in edge] + [-(1 << b)]),
                         st.integers(-(1 << b), (1 << b) - 1))
    if vtype == G.BOOL:
        return st.booleans()
    return st.floats(width=32 if vtype == G.F32 else 64)


def _texts():
    return st.one_of(st.sampled_from(["llama", "gpt2", "none", "default", "", "<s>", "a b"]),
                     st.text(max_size=12), st.binary(max_size=12))


def _sometimes(draw, n=8) -> bool:
    """True about once in ``n`` draws (hypothesis favours small numbers:
    the largest is the rare one)."""
    return draw(st.integers(0, n - 1)) == n - 1


@st.composite
def values(draw, depth=0):
    """``(type word, encoded value)``: mostly well-formed, sometimes lying."""
    vtype = draw(st.integers(13, (1 << 32) - 1) if _sometimes(draw) else st.integers(0, 12))
    if vtype in G.FORMATS:
        raw = G.scalar(vtype, draw(_scalar(vtype)))
        if _sometimes(draw):                               # cut short
            raw = raw[:draw(st.integers(0, len(raw) - 1))]
        return vtype, raw
    if vtype == G.STR:
        if _sometimes(draw):                               # a length that lies
            return vtype, draw(counts).to_bytes(8, "little") + draw(st.binary(max_size=16))
        return vtype, G.string(draw(_texts()))
    if vtype == G.ARR and depth < 3:
        etype = draw(st.integers(13, 99) if _sometimes(draw) else st.integers(0, 12))
        if etype in G.FORMATS:
            items = [G.scalar(etype, x) for x in draw(st.lists(_scalar(etype), max_size=8))]
        elif etype == G.STR:
            items = [G.string(x) for x in draw(st.lists(_texts(), max_size=8))]
        elif etype == G.ARR:
            items = [v[1] for v in draw(st.lists(values(depth + 1), max_size=3))]
        else:
            items = [draw(st.binary(max_size=16))]
        n, items = len(items), b"".join(items)
        declared = draw(counts) if _sometimes(draw, 4) else n
        return vtype, etype.to_bytes(4, "little") + declared.to_bytes(8, "little") + items
    return vtype, draw(st.binary(max_size=24))


@st.composite
def tensor_infos(draw):
    name = draw(st.one_of(st.sampled_from(TENSORS), st.text(max_size=8))).encode(
        "utf-8", "surrogatepass")
    dims = draw(st.lists(st.one_of(st.sampled_from(INTERESTING), st.integers(0, 300)),
                         max_size=5))
    n_dims = draw(st.one_of(st.none(), st.none(), st.sampled_from([0, 5, 1 << 31])))
    return G.Tensor(name, dims, draw(st.one_of(st.sampled_from(GGML_IDS), st.integers(0, 99))),
                    draw(st.one_of(st.sampled_from([0, 32, 64, 96, 4096]),
                                   st.sampled_from(INTERESTING))), n_dims)


@st.composite
def models(draw):
    n_heads = draw(st.sampled_from([1, 2, 4]))
    hidden = draw(st.sampled_from([32, 64]))
    return dict(n_layers=draw(st.integers(1, 3)), hidden=hidden,
                ffn=draw(st.sampled_from([32, 64, 96])), n_heads=n_heads,
                n_kv_heads=draw(st.sampled_from([k for k in (1, 2, 4) if n_heads % k == 0])),
                vocab=draw(st.integers(1, 40)),
                context_length=draw(st.integers(2, 1 << 20)),
                eps=draw(st.floats(2.0 ** -24, 2.0 ** -10, width=32)),
                theta=draw(st.floats(1.0, 2.0 ** 20, width=32)),
                alignment=draw(st.sampled_from([1, 2, 8, 32, 64, 256])),
                seed_bytes=draw(st.binary(min_size=1, max_size=64)))


def _names():
    return st.one_of(st.sampled_from(KEYS), st.text(max_size=6)).map(
        lambda k: k.encode("utf-8", "surrogatepass"))


@st.composite
def images(draw):
    """A file from drawn parts, or a valid model with drawn parts put in."""
    if draw(st.booleans()):
        img = G.model_image(tokens=None, **draw(models()))
        for _ in range(draw(st.integers(1, 3))):
            edit = draw(st.sampled_from(["key", "key", "tensor", "tensor", "count", "data"]))
            if edit == "key":
                at = draw(st.integers(0, len(img.kvs)))
                kv = G.Kv(img.kvs[at].key if at < len(img.kvs) else draw(_names()),
                          *draw(values()))
                img.kvs[at:at + 1] = [kv]
            elif edit == "tensor":
                t = img.tensors[draw(st.integers(0, len(img.tensors) - 1))]
                new = draw(tensor_infos())
                part = draw(st.sampled_from(["name", "dims", "ggml_type", "offset", "n_dims"]))
                setattr(t, part, getattr(new, part))
            elif edit == "count":
                setattr(img, draw(st.sampled_from(["n_kv", "n_tensors"])), draw(counts))
            else:
                img.data = img.data[:draw(st.integers(0, len(img.data)))]
        return img.to_bytes()
    img = G.Image(kvs=[G.Kv(draw(_names()), *draw(values()))
                       for _ in range(draw(st.integers(0, 8)))],
                  tensors=draw(st.lists(tensor_infos(), max_size=5)),
                  version=draw(st.sampled_from([3, 3, 3, 2, 1, 0, 4, 0x03000000])),
                  n_kv=draw(st.one_of(st.none(), st.none(), counts)),
                  n_tensors=draw(st.one_of(st.none(), st.none(), counts)),
                  alignment=draw(st.sampled_from([32, 32, 1, 64, 48])))
    img.data = draw(st.one_of(st.binary(max_size=512), st.integers(0, 1 << 14).map(bytes)))
    return img.to_bytes()


@_fuzz_settings("generated")
@given(data=images())
def test_generated_files(pool, data):
    res = _check(pool.run(gguf_probe.probe, data, True, timeout=10), data[:64])
    assert res.get("gguf", []) == [], res["gguf"]
    event(_verdict(res))


HPARAMS = [k for k in KEYS if k.startswith("llama.")]
_REAL_KEYS = ("llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base",
              "llama.rope.scaling.factor")


@st.composite
def hyperparameters(draw):
    """A valid model with one to three hyperparameters set to any number:
    mostly of the type the key has (any value of it), else of any numeric
    type or a per-layer array."""
    img = G.model_image(tokens=None, **draw(models()))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(HPARAMS))
        natural = [G.F32, G.F64] if key in _REAL_KEYS else [G.U32, G.I32, G.U64]
        vtype = draw(st.sampled_from(natural + sorted(G.FORMATS)))
        if draw(st.integers(0, 3).map(lambda i: i == 3)):
            v = G.array(vtype, draw(st.lists(_scalar(vtype), max_size=4)))
            vtype = G.ARR
        else:
            v = G.scalar(vtype, draw(_scalar(vtype)))
        img.set(key, vtype, v)
    return img.to_bytes()


@_fuzz_settings("hyperparameters")
@given(data=hyperparameters())
def test_hyperparameters_any_value(pool, data):
    res = _check(pool.run(gguf_probe.probe, data, timeout=10), "hyperparameters")
    event(_verdict(res))


# ---------------------------------------------------------------- mutated files
@st.composite
def mutations(draw, bases):
    """A valid file with 1 to 4 mutations: a structural field overwritten,
    a header byte changed, the file cut, or bytes inserted or removed."""
    which = draw(st.sampled_from(sorted(bases)))
    data = bases[which]
    img, fields = G.walk(data)
    header_end = len(data) - len(img.data)
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["field", "field", "field", "byte", "cut", "splice"]))
        if op == "field":                       # a kind of field, then one of that kind
            kind = draw(st.sampled_from(sorted({f.kind for f in fields}) + ["value"] * 3))
            f = draw(st.sampled_from([f for f in fields if f.kind == kind]))
            if f.offset + f.size > len(buf):
                continue
            old = int.from_bytes(buf[f.offset:f.offset + f.size], "little")
            v = draw(st.one_of(st.sampled_from(INTERESTING), st.integers(-3, 3).map(
                lambda d: old + d), st.integers(0, (1 << 8 * f.size) - 1)))
            buf[f.offset:f.offset + f.size] = (v % (1 << 8 * f.size)).to_bytes(f.size, "little")
        elif op == "byte" and buf:
            buf[draw(st.integers(0, min(header_end, len(buf)) - 1))] = draw(st.integers(0, 255))
        elif op == "cut":
            del buf[draw(st.integers(0, len(buf))):]
        elif op == "splice":
            at = draw(st.integers(0, min(header_end, len(buf))))
            if draw(st.booleans()):
                buf[at:at] = draw(st.binary(min_size=1, max_size=16))
            else:
                del buf[at:at + draw(st.integers(1, 16))]
    return which, bytes(buf)


@_fuzz_settings("mutated")
@given(draw=st.data())
def test_mutated_files(pool, bases, draw):
    which, data = draw.draw(mutations(bases))
    res = _check(pool.run(gguf_probe.probe, data, True, timeout=10), which)
    assert res.get("gguf", []) == [], (which, res["gguf"])
    event(_verdict(res))


# ---------------------------------------------------------------- valid files
@_fuzz_settings("valid")
@given(shape=models(), with_tokens=st.booleans())
def test_valid_files_load(pool, shape, with_tokens):
    tokens = [f"t{i}" for i in range(shape["vocab"])] if with_tokens else None
    data = G.model_image(tokens=tokens, **shape).to_bytes()
    out = pool.run(gguf_probe.load_valid, data, timeout=10)
    assert out.kind == "ok", out.error
    got = out.value
    s = shape
    assert got["hparams"] == (s["n_layers"], s["hidden"], s["ffn"], s["n_heads"],
                              s["n_kv_heads"], s["vocab"], s["context_length"],
                              pytest.approx(s["eps"], rel=1e-7), pytest.approx(s["theta"],
                                                                              rel=1e-7))
    assert got["tokens"] == (s["vocab"] if with_tokens else None)
    assert got["data_offset"] % s["alignment"] == 0
    assert len(got["views"]) == 3 + 9 * s["n_layers"]
    for name, (qtype, shape_, same, writeable) in got["views"].items():
        assert same and not writeable, name
        assert qtype == ("F32" if len(shape_) == 1 else "Q8_0"), name
