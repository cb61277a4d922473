"""``python -m ptxgen run``, ``chat`` and ``demo``.

``run MODEL.gguf -p TEXT [--prompt-file FILE] [-n N] [sampling flags] [--stop S]``
    streams the text the model generates after ``TEXT`` (tokenized with the
    file's own tokenizer), then prints the prompt and generation speeds.
    ``--tokens 1,2,3`` feeds token ids instead and prints ids.
``chat MODEL.gguf [--system S]``
    an interactive chat with the file's chat template: one user message a
    line on stdin, ``/exit`` or end of input ends it; the conversation stays
    in the KV cache, so each turn feeds only its own tokens.
``demo [--backend ...] [-n N] [--keep DIR] [--vocab FILE.gguf]``
    writes a tiny synthetic Llama GGUF, decodes it on the GPU (or the CPU
    emulator when there is none), checks every step's logits against a
    float64 numpy forward pass, then runs the text path on a tiny model with
    a real vocabulary.

Sampling flags have llama.cpp's names (``--temp``, ``--top-k``, ``--top-p``,
``--min-p``, ``--repeat-penalty``, ``--repeat-last-n``,
``--presence-penalty``, ``--frequency-penalty``, ``--seed``); ``--temp 0``,
the default, decodes greedily.  A bad argument, a missing file or GPU is one
``error:`` line and exit code 2.

The commands are registered under the ``ptxgen.commands`` entry point, so
the DSL package itself never imports the driver.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["run_command", "chat_command", "positive", "get_backend_for_cli", "run_guarded"]

from ptxgen.cli import HelpFormatter as _HELP


class CliError(Exception):
    """A problem to report as one ``error:`` line (exit code 2)."""


def _tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes comma-separated integers, got {text!r}")


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _add_model_args(p, n_default):
    p.add_argument("model", help="a llama-architecture .gguf file")
    p.add_argument("-n", "--max-new-tokens", type=positive, default=n_default,
                   help="tokens to generate at most (per reply)")
    p.add_argument("--backend", choices=("auto", "cuda", "emu"), default="auto",
                   help="the GPU, the CPU emulator, or the GPU when there is one")
    p.add_argument("--capacity", type=positive, default=None,
                   help="KV cache length in tokens (default: the model's context, at most 4096)")
    p.add_argument("--eager", action="store_true",
                   help="one launch per op from Python instead of a CUDA graph per token")


def _add_sampling_args(p):
    g = p.add_argument_group("sampling (llama.cpp's flags)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 decodes greedily")
    g.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0: all")
    g.add_argument("--top-p", type=float, default=0.95,
                   help="keep the most likely tokens up to this probability mass; 1: all")
    g.add_argument("--min-p", type=float, default=0.05,
                   help="keep tokens at least this fraction as likely as the top one; 0: all")
    g.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="divide the logits of recent tokens (multiply if negative); 1: off")
    g.add_argument("--repeat-last-n", type=int, default=64,
                   help="the penalties' window of recent tokens; -1: all, 0: off")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract from the logits of tokens in the window")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times a token's count in the window")
    g.add_argument("--seed", type=int, default=None,
                   help="the sampler's seed (0 .. 2**64-1); default: a random one, reported")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the text contains TEXT (repeatable)")
    p.add_argument("--no-escape", action="store_true",
                   help="take backslashes in -p and --stop literally (by default \\n, \\t, "
                        "\\r, \\\\ and quotes are escapes, as in llama.cpp)")


def _sampling(a):
    from ptxgen.llm.generation import SamplingSettings
    if not a.no_escape:
        a.stop = [_unescape(x) for x in a.stop]
    try:
        return SamplingSettings(
            temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
            repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n,
            presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
            seed=a.seed)
    except (TypeError, ValueError) as e:
        raise CliError(str(e)) from None


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}


def _unescape(text: str) -> str:
    """``\\n``, ``\\r``, ``\\t``, ``\\'``, ``\\"`` and ``\\\\`` turned into the
    characters (as llama.cpp's tools read ``-p`` and stop strings); any other
    backslash stays."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPES:
            out.append(_ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _tty(stream) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


def get_backend_for_cli(name: str):
    """The backend, with a note on stderr when ``auto`` falls back to the emulator."""
    from ptxgen.driver.backend import get_backend
    from ptxgen.driver.errors import CUDAError
    try:
        be = get_backend(name)
    except CUDAError as e:
        raise CliError(f"--backend {name}: {str(e).rstrip('.')}; --backend emu (or auto) runs "
                       "on the CPU emulator") from None
    if name == "auto" and be.name == "emu":
        print("no GPU found: using the CPU emulator (slow: seconds per token even for a "
              "tiny model)", file=sys.stderr, flush=True)
    return be


def _load(a, be, need: str = ""):
    """The model of ``a.model`` on ``be``; ``need`` "tokenizer" or "chat"
    refuses a file without a tokenizer (or chat template) before loading."""
    from ptxgen.llm.gguf.file import LlamaFile
    from ptxgen.llm import Model
    f = LlamaFile(a.model)
    tok = f.tokenizer()
    if need and tok is None:
        what = "give --tokens ids" if need == "tokenizer" else "nothing to chat with"
        raise CliError(f"{a.model} has no tokenizer (tokenizer.ggml.*): {what}")
    if need == "chat" and not tok.chat_template and getattr(a, "template", None) is None:
        raise CliError(f"{a.model} has no chat template (tokenizer.chat_template): give "
                       "--chat-template FILE")
    if need == "chat" and getattr(a, "template", None) is None:
        _check_file_template(tok)
    if be.name == "emu":
        print(f"loading {a.model} and building its kernels for the emulator ...",
              file=sys.stderr, flush=True)
    return Model(f, be, capacity=a.capacity, tokenizer=tok)


def _check_file_template(tok):
    """Warn on stderr, before loading, when the file's chat template cannot be
    used and the built-in ChatML one stands in."""
    import warnings
    from ptxgen.llm.text.chat_template import file_template
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        file_template(tok)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr, flush=True)


def _prompt_progress(be):
    """A progress callback for the prompt steps on the emulator (a tty only)."""
    if be.name != "emu" or not _tty(sys.stderr):
        return None

    def show(done, total):
        end = "\n" if done == total else ""
        print(f"\rprompt: {done}/{total} tokens", end=end, file=sys.stderr, flush=True)
    return show


def run_guarded(body) -> int:
    """Run ``body()``; known failures become one ``error:`` line and exit 2."""
    from ptxgen.llm.text.chat_template import ChatTemplateError
    from ptxgen.llm.generation import ContextOverflowError
    from ptxgen.llm.gguf.file import GGUFError
    from ptxgen.llm.gguf.metadata import GGUFMetadataError
    from ptxgen.llm.text.tokenizer import TokenizerError
    try:
        return body()
    except (CliError, GGUFError, GGUFMetadataError, TokenizerError, ChatTemplateError,
            ContextOverflowError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def run_command(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m ptxgen run", formatter_class=_HELP,
                                description="generate text (or token ids) from a Llama GGUF model")
    _add_model_args(p, 64)
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None, help="the prompt text")
    src.add_argument("--prompt-file", default=None, metavar="FILE",
                     help="read the prompt text from FILE")
    src.add_argument("--tokens", type=_tokens, default=None,
                     help="prompt token ids, e.g. 1,2,3 (prints ids; default without a "
                          "prompt: 1)")
    p.add_argument("--no-display-prompt", action="store_true",
                   help="print only the generated text, not the prompt before it")
    p.add_argument("--summary", action="store_true", help="print the decode graph summary")
    _add_sampling_args(p)
    a = p.parse_args(argv)

    def body():
        settings = _sampling(a)
        prompt = a.prompt if a.prompt is None or a.no_escape else _unescape(a.prompt)
        if a.prompt_file is not None:
            if os.path.isdir(a.prompt_file):
                raise CliError(f"--prompt-file {a.prompt_file}: is a directory")
            with open(a.prompt_file, encoding="utf-8") as f:
                prompt = f.read()
        be = get_backend_for_cli(a.backend)
        model = _load(a, be, "" if prompt is None else "tokenizer")
        if a.summary:
            print(model.summary())
        mode = "eager" if a.eager else "graph"
        if prompt is None:
            return _run_ids(model, a, settings, mode, a.tokens or [1])
        stream = model.stream(prompt, max_new_tokens=a.max_new_tokens, sampling=settings,
                              stop=a.stop, mode=mode, progress=_prompt_progress(be))
        if not a.no_display_prompt:
            sys.stdout.write(prompt)
            sys.stdout.flush()
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        res = stream.result
        print(_stats_line(res, stream, model), file=sys.stderr)
        return 0

    return run_guarded(body)


def _stats_line(res, stream, model) -> str:
    seed = "" if res.seed is None else f", seed {res.seed}"
    return (f"prompt: {res.prompt_tokens} tokens, {res.prompt_tokens_per_second:.1f} tokens/s; "
            f"generation: {res.generated_tokens} tokens, {res.decode_tokens_per_second:.1f} "
            f"tokens/s; stop: {res.stop_reason} ({stream.mode}, backend "
            f"{model.backend.name}{seed})")


def _run_ids(model, a, settings, mode, tokens) -> int:
    res = model.generate(tokens, a.max_new_tokens, mode=mode, sampling=settings)
    print("tokens:", ",".join(map(str, res.tokens)))
    print(f"prompt: {len(tokens)} tokens, {res.prompt_tokens_per_second:.1f} tokens/s "
          f"({res.prompt_seconds:.3f} s)")
    seed = "" if res.seed is None else f", seed {res.seed}"
    print(f"{res.tokens_per_second:.1f} tokens/s ({res.mode}, {res.launches_per_token} "
          f"launches per token, backend {model.backend.name}{seed})")
    return 0


def chat_command(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m ptxgen chat", formatter_class=_HELP,
                                description="chat with a Llama GGUF model (one message a line "
                                            "on stdin; /exit or end of input ends)")
    _add_model_args(p, 256)
    p.add_argument("--system", default=None, help="a system message opening the conversation")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the file's")
    p.add_argument("--parse-special", action="store_true",
                   help="turn special-token texts typed in a message (<|im_end|>, ...) into "
                        "control tokens; without it they stay text")
    _add_sampling_args(p)
    a = p.parse_args(argv)

    def body():
        from ptxgen.llm.text.template_sandbox import compile_template
        settings = _sampling(a)
        a.template = None
        if a.chat_template is not None:
            with open(a.chat_template, encoding="utf-8") as f:
                a.template = f.read()
            compile_template(a.template)         # its errors before the model loads
        be = get_backend_for_cli(a.backend)
        model = _load(a, be, "chat")
        session = model.chat_session(
            a.system, template=a.template, parse_special_in_content=a.parse_special,
            max_new_tokens=a.max_new_tokens, sampling=settings,
            stop=a.stop, mode="eager" if a.eager else "graph", progress=_prompt_progress(be))
        interactive = _tty(sys.stdin)
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            text = line.rstrip("\r\n")
            if text.strip() == "/exit":
                break
            if not text.strip():
                continue
            stream = session.stream(text)
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(_stats_line(stream.result, stream, model), file=sys.stderr, flush=True)
        return 0

    return run_guarded(body)
