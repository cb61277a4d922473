"""What the fuzz tests run in a limited child process (tests/limits.py): a
file's bytes through every way the project reads a GGUF file.

Each function writes the bytes to a fresh temporary file, runs the readers,
and returns what happened; a GGUF refusal (:class:`GGUFError`) is a result,
any other exception escapes to the parent, which fails the test.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import sys
import tempfile
import time

import numpy as np

_DIR = None
_COUNTER = itertools.count()


def _write(data: bytes) -> str:
    global _DIR
    if _DIR is None:
        _DIR = tempfile.mkdtemp(prefix="fuzz-gguf-")
    path = os.path.join(_DIR, f"case{next(_COUNTER)}.gguf")
    with open(path, "wb") as f:
        f.write(data)
    return path


def _attempt(fn):
    """``(outcome, detail, seconds)``: ``"ok"`` or ``"refused"`` (a GGUF error's message)."""
    from ptxgen.llm.gguf.file import GGUFError
    t0 = time.perf_counter()
    try:
        detail = fn()
        kind = "ok"
    except GGUFError as e:
        kind, detail = "refused", str(e)
    return kind, detail, time.perf_counter() - t0


def probe(data: bytes, compare: bool = False) -> dict:
    """Stage -> ``(outcome, detail, seconds)`` for the metadata reader, the
    whole-file reader, the model file with its tokenizer, and ``info``'s
    report.  ``compare``: files the whole-file reader accepts are read
    again with the ``gguf`` package's reader, and the differences (in
    metadata and tensor infos) are returned under ``"gguf"``."""
    from ptxgen.llm.gguf.file import LlamaFile
    from ptxgen.llm.gguf.metadata import read_gguf_metadata
    from ptxgen.llm.gguf.reader import read_gguf
    from ptxgen.llm.info import format_info, read_info

    path = _write(data)
    try:
        out = {"metadata": _attempt(lambda: len(read_gguf_metadata(path))),
               "file": _attempt(lambda: len(read_gguf(path).tensors))}

        def model():
            f = LlamaFile(path)
            tok = f.tokenizer()
            for name in f.names:                 # what loading the weights reads
                f.tensor(name).data.view(np.uint8)[-1:].sum()
            f.rope_inv_freq()
            return f.hparams.n_layers, None if tok is None else tok.n_vocab

        out["model"] = _attempt(model)
        out["info"] = _attempt(lambda: format_info(read_info(path)))
        if compare and out["file"][0] == "ok":
            out["gguf"] = differences(path)
        return out
    finally:
        os.unlink(path)


def cli(data: bytes, argv: list) -> tuple:
    """``(exit code, stdout, stderr, seconds)`` of ``python -m ptxgen
    argv[0] FILE argv[1:]`` run in this process (stdin: one line)."""
    from ptxgen.cli import main
    path = _write(data)
    out, err = io.StringIO(), io.StringIO()
    stdin = sys.stdin
    sys.stdin = io.StringIO("hi\n")
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([argv[0], path, *argv[1:]])
    finally:
        sys.stdin = stdin
        os.unlink(path)
    return rc, out.getvalue(), err.getvalue().replace(path, "FILE"), time.perf_counter() - t0


def load_valid(data: bytes) -> dict:
    """A file that must load: its hyperparameters, and each tensor's bytes
    as the model file gives them against the bytes at its offset."""
    from ptxgen.llm.gguf.file import LlamaFile
    path = _write(data)
    try:
        f = LlamaFile(path)
        hp = f.hparams
        g = f.contents
        views = {}
        for name in f.names:
            t = f.tensor(name)
            info = g.tensors[name]
            start = g.data_offset + info.offset
            same = bytes(t.data.view(np.uint8).reshape(-1)) == data[start:start + info.nbytes]
            views[name] = (t.qtype, t.shape, same, bool(t.data.flags.writeable))
        return {"hparams": (hp.n_layers, hp.hidden, hp.ffn, hp.n_heads, hp.n_kv_heads, hp.vocab,
                            hp.context_length, hp.eps, hp.rope_theta),
                "tokens": None if f.tokenizer_model is None else len(f.metadata[
                    "tokenizer.ggml.tokens"]),
                "views": views, "data_offset": g.data_offset}
    finally:
        os.unlink(path)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        a, b = a.astype(np.float64), b.astype(np.float64)
        return bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))
    return bool(np.array_equal(a, b))


def differences(path: str) -> list:
    """How the project's reader and the ``gguf`` package's differ on a file
    the project's reader accepted (empty when they agree, or when the
    ``gguf`` reader refuses the file)."""
    import gguf
    from ptxgen.llm.gguf.reader import read_gguf
    ours = read_gguf(path)
    try:
        r = gguf.GGUFReader(path, "r")
    except Exception:                        # noqa: BLE001 - a refusal of its own
        return []
    out = []
    theirs = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    keys = [k.encode("utf-8", "surrogateescape") for k in ours.metadata]
    if sorted(keys) != sorted(k.encode("utf-8", "surrogateescape") for k in theirs):
        return [f"keys differ: {sorted(keys)[:5]} vs {sorted(theirs)[:5]}"]
    S = gguf.GGUFValueType
    for key, value in ours.metadata.items():
        f = theirs[key]
        vt = f.types[0]
        if vt == S.STRING:
            ok = value.encode("utf-8", "surrogateescape") == bytes(f.parts[f.data[0]])
        elif vt == S.ARRAY and len(f.types) > 1 and f.types[1] == S.STRING:
            ok = [s.encode("utf-8", "surrogateescape") for s in value] == \
                 [bytes(f.parts[i]) for i in f.data]
        elif vt == S.ARRAY and len(f.types) > 1 and f.types[1] == S.ARRAY:
            ok = isinstance(value, list) and len(value) == len(f.data)
        elif vt == S.ARRAY:
            got = (np.concatenate([f.parts[i] for i in f.data]) if len(f.data)
                   else np.zeros(0))
            ok = _same(value, got)
        else:
            got = f.parts[f.data[0]][0]
            ok = _same(value, got) and (vt != S.BOOL or bool(value) == bool(got))
        if not ok:
            out.append(f"metadata {key!r} differs")
    if [t.name for t in r.tensors] != list(ours.tensors):
        return out + ["tensor names differ"]
    for t in r.tensors:
        o = ours.tensors[t.name]
        if (int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes)) != \
                (o.type.id, list(o.dims), ours.data_offset + o.offset, o.nbytes):
            out.append(f"tensor {t.name!r} differs")
    return out
