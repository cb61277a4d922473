"""``python -m ptxgen run`` and ``chat``, with llama.cpp's flag names.

``run MODEL.gguf -p TEXT`` (or ``-f FILE``, or the text piped on stdin)
    streams the text the model generates after ``TEXT`` (tokenized with the
    file's own tokenizer), then prints on stderr what was generated and how
    fast.  ``--tokens 1,2,3`` feeds token ids instead and prints ids.
    ``-sys TEXT`` (a system message) sends the prompt through the chat
    template as the user's message.
``chat MODEL.gguf [-sys S]``
    an interactive chat with the file's chat template (or ``--chat-template
    NAME|FILE``): one user message a line on stdin, ``/exit``, end of input
    or Ctrl-C at the prompt ends it; the conversation stays in the KV cache,
    so each turn feeds only its own tokens.

The flags a llama.cpp user types mean the same here: ``-m FILE``, ``-p``,
``-f FILE`` (``-`` for stdin), ``-n N`` (``-1``: until the context is
full), ``-c/--ctx-size N``, ``-s/--seed``, ``-sys``, ``--chat-template``,
the sampling flags (``--temp``, ``--top-k``, ``--top-p``, ``--min-p``,
``--repeat-penalty``, ``--repeat-last-n``, ``--presence-penalty``,
``--frequency-penalty``) and ``--stop``; ``-ngl N`` is accepted and ignored
(every layer runs on the GPU), with a note.  ``--temp 0``, the default,
decodes greedily.

Ctrl-C stops the reply (a second one stops at once) and prints what was
generated; in ``chat`` it ends only the reply.  A reader that goes away
(``| head``) ends the command quietly.  A bad argument, a missing file or
GPU is one ``error:`` line and exit code 2.

The commands are registered under the ``ptxgen.commands`` entry point, so
the DSL package itself never imports the driver.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

__all__ = ["run_command", "chat_command", "positive", "get_backend_for_cli", "run_guarded",
           "add_model_args", "model_path", "note_ignored", "chat_template_arg", "template_of",
           "Status", "CliError"]

from ptxgen.cli import ArgumentParser
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


def _n_predict(text: str) -> int:
    """``-n``: a positive count, or -1 for "until the context is full"."""
    if text.strip() == "-1":
        return -1
    return positive(text)


def add_model_args(p, *, ctx_help: str):
    """The model file (``MODEL.gguf`` or ``-m FILE``), ``-c/--ctx-size``,
    ``--backend`` and llama.cpp's ``-ngl`` (accepted, ignored)."""
    p.add_argument("model", nargs="?", metavar="MODEL.gguf",
                   help="a GGUF model file (llama, mistral, qwen2, qwen3)")
    p.add_argument("-m", "--model", dest="model_option", metavar="FILE", default=None,
                   help="the model file, as llama.cpp's tools take it")
    p.add_argument("-c", "--ctx-size", "--capacity", dest="capacity", type=positive,
                   default=None, metavar="N", help=ctx_help)
    p.add_argument("--backend", choices=("auto", "cuda", "emu"), default="auto",
                   help="the GPU, the CPU emulator, or the GPU when there is one")
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="gpu_layers", default=None,
                   metavar="N", help="accepted for llama.cpp's users and ignored: every layer "
                                     "runs on the GPU")


def model_path(a) -> str:
    """The model file of ``add_model_args``' arguments."""
    if a.model and a.model_option and a.model != a.model_option:
        raise CliError(f"two model files: {a.model} and -m {a.model_option}")
    path = a.model or a.model_option
    if not path:
        raise CliError("no model file: give MODEL.gguf (or -m MODEL.gguf)")
    return path


def note_ignored(a):
    """A note on stderr for the llama.cpp flags that do nothing here."""
    if a.gpu_layers is not None:
        print(f"note: -ngl {a.gpu_layers} is ignored: ptxgen runs every layer on the GPU",
              file=sys.stderr)


def chat_template_arg(p):
    p.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                   help="a chat template instead of the file's: a built-in one (chatml, llama2, "
                        "llama3, mistral, phi3, gemma, zephyr, vicuna) or a Jinja file")
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="a Jinja chat template file instead of the file's")


def template_of(a) -> str | None:
    """The chat template the arguments name (None: the model file's)."""
    from ptxgen.llm.named_templates import resolve_chat_template
    if a.chat_template is not None and a.chat_template_file is not None:
        raise CliError("give --chat-template or --chat-template-file, not both")
    from ptxgen.llm.text.template_sandbox import compile_template
    text = None
    if a.chat_template_file is not None:
        with open(a.chat_template_file, encoding="utf-8") as f:
            text = f.read()
    elif a.chat_template is not None:
        text = resolve_chat_template(a.chat_template)
    if text is not None:
        compile_template(text)          # its errors before the model loads
    return text


def _add_generation_args(p, n_default):
    p.add_argument("-n", "--n-predict", "--max-new-tokens", dest="max_new_tokens",
                   type=_n_predict, default=n_default, metavar="N",
                   help="tokens to generate at most (per reply); -1: until the context is full")
    p.add_argument("--eager", action="store_true",
                   help="one launch per op from Python instead of a CUDA graph per token")


def _add_sampling_args(p):
    g = p.add_argument_group("sampling (llama.cpp's flags)")
    g.add_argument("--temp", metavar="T", type=float, default=0.0,
                   help="temperature; 0 decodes greedily")
    g.add_argument("--top-k", metavar="K", type=int, default=40,
                   help="keep the k most likely tokens; 0: all")
    g.add_argument("--top-p", metavar="P", type=float, default=0.95,
                   help="keep the most likely tokens up to this probability mass; 1: all")
    g.add_argument("--min-p", metavar="P", type=float, default=0.05,
                   help="keep tokens at least this fraction as likely as the top one; 0: all")
    g.add_argument("--repeat-penalty", metavar="X", type=float, default=1.0,
                   help="divide the logits of recent tokens (multiply if negative); 1: off")
    g.add_argument("--repeat-last-n", metavar="N", type=int, default=64,
                   help="the penalties' window of recent tokens; -1: all, 0: off")
    g.add_argument("--presence-penalty", metavar="X", type=float, default=0.0,
                   help="subtract from the logits of tokens in the window")
    g.add_argument("--frequency-penalty", metavar="X", type=float, default=0.0,
                   help="subtract this times a token's count in the window")
    g.add_argument("-s", "--seed", metavar="N", type=int, default=None,
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


class Status:
    """One line of status on stderr, rewritten in place (a terminal only):
    what a long step is doing, from the moment it starts.

    ``show(text)`` replaces the line, ``note(text)`` prints a line of its
    own above it, ``clear()`` removes it.
    """

    def __init__(self, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = _tty(self.stream)
        self.text = ""

    def show(self, text: str):
        self.text = text
        if self.enabled:
            self.stream.write("\r\x1b[K" + text)
            self.stream.flush()

    def note(self, text: str):
        if self.enabled and self.text:
            self.stream.write("\r\x1b[K")
        print(text, file=self.stream, flush=True)
        if self.enabled and self.text:
            self.show(self.text)

    def clear(self):
        if self.enabled and self.text:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        self.text = ""


def get_backend_for_cli(name: str, status: Status | None = None):
    """The backend, with a note on stderr when ``auto`` falls back to the emulator."""
    from ptxgen.driver.backend import get_backend
    from ptxgen.driver.errors import CUDAError
    try:
        be = get_backend(name)
    except CUDAError as e:
        raise CliError(f"--backend {name}: {str(e).rstrip('.')}; --backend emu (or auto) runs "
                       "on the CPU emulator") from None
    if name == "auto" and be.name == "emu":
        text = ("no GPU found: using the CPU emulator (slow: seconds per token even for a "
                "tiny model)")
        if status is None:
            print(text, file=sys.stderr, flush=True)
        else:
            status.note(text)
    return be


def tp_refusal(n: int, backend: str) -> str:
    """Why ``--tp n`` (n > 1) cannot run here: the first of the emulator
    (tensor parallelism there is the tests' in-process group), no nccl4py,
    fewer than ``n`` GPUs, and the one-process-per-GPU launcher, which is
    not built yet (docs/llm.md, "Tensor parallelism")."""
    if backend == "emu":
        return (f"--tp {n}: the emulator runs one process on the CPU; tensor parallelism "
                "needs one GPU a rank (--backend cuda)")
    from ptxgen.driver.nccl import nccl_available
    if not nccl_available():
        return f"--tp {n}: tensor parallelism needs NVIDIA's NCCL bindings: pip install nccl4py"
    from ptxgen.driver.device import device_count
    from ptxgen.driver.errors import CUDAError
    try:
        have = device_count()
    except CUDAError:
        have = 0
    if have < n:
        return f"--tp {n}: this host has {have} GPU{'' if have == 1 else 's'}, {n} needed"
    return (f"--tp {n}: the launcher of one process a GPU is not built yet; the sharded model "
            "runs through ptxgen.llm.Model(tp=..., comm=...) (docs/llm.md, \"Tensor "
            "parallelism\")")


def _load(a, need: str = "", template: str | None = None):
    """``(model, backend)`` of the arguments' model file; ``need``
    "tokenizer" or "chat" refuses a file without a tokenizer (or chat
    template) before loading.  A status line on a terminal says what it
    does from the start; the model's own bar shows the weights' upload."""
    path = model_path(a)
    name = os.path.basename(path)
    status = Status()
    status.show(f"loading {name}: starting ...")
    try:
        be = get_backend_for_cli(a.backend, status)
        from ptxgen.llm import Model
        from ptxgen.llm.gguf.file import LlamaFile
        status.show(f"loading {name}: reading the file ...")
        f = LlamaFile(path)
        status.show(f"loading {name}: reading the vocabulary ...")
        tok = f.tokenizer()
        if need and tok is None:
            what = "give --tokens ids" if need == "tokenizer" else "nothing to chat with"
            raise CliError(f"{path} has no tokenizer (tokenizer.ggml.*): {what}")
        if need == "chat" and not tok.chat_template and template is None:
            raise CliError(f"{path} has no chat template (tokenizer.chat_template): give "
                           "--chat-template NAME or FILE")
        if need == "chat" and template is None:
            _check_file_template(tok)
        if be.name == "emu" and not status.enabled:
            print(f"loading {path} and building its kernels for the emulator ...",
                  file=sys.stderr, flush=True)
        status.show(f"loading {name}: building the kernels ...")
        model = Model(f, be, capacity=a.capacity, tokenizer=tok)
    finally:
        status.clear()
    return model, be


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


def _prompt_progress(be, status: Status):
    """A progress callback for the prompt steps on the emulator (a tty only)."""
    if be.name != "emu" or not status.enabled:
        return None

    def show(done, total):
        status.show(f"prompt: {done}/{total} tokens")
    return show


def run_guarded(body) -> int:
    """Run ``body()``; known failures become one ``error:`` line and exit 2;
    a closed stdout (``| head``) ends quietly."""
    from ptxgen.cli import _quiet_stdout
    from ptxgen.llm.text.chat_template import ChatTemplateError
    from ptxgen.llm.generation import ContextOverflowError
    from ptxgen.llm.gguf.file import GGUFError
    from ptxgen.llm.gguf.metadata import GGUFMetadataError
    from ptxgen.llm.text.tokenizer import TokenizerError
    try:
        return body()
    except BrokenPipeError:
        _quiet_stdout()
        return 0
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


class _Interrupt:
    """Within ``with``: the first Ctrl-C sets :attr:`requested` (the reply
    stops after its next piece); a second raises KeyboardInterrupt at once.
    Outside the main thread it only holds the flag."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def _read_prompt(a) -> str | None:
    """The prompt text of ``-p``, ``-f FILE`` (``-``: stdin) or, with
    neither, stdin when it is not a terminal; None with ``--tokens``.  A
    file's (or stdin's) last newline is dropped, as llama.cpp's ``-f`` does."""
    if a.tokens is not None:
        return None
    if a.prompt is not None:
        return a.prompt if a.no_escape else _unescape(a.prompt)
    if a.file is not None:
        if a.file == "-":
            text = sys.stdin.read()
        else:
            if os.path.isdir(a.file):
                raise CliError(f"-f {a.file}: is a directory")
            with open(a.file, encoding="utf-8") as f:
                text = f.read()
    elif not _tty(sys.stdin):
        text = sys.stdin.read()
    else:
        raise CliError("no prompt: give -p TEXT, -f FILE, pipe the text on stdin, or "
                       "--tokens IDS")
    text = text[:-1] if text.endswith("\n") else text
    if not text:
        raise CliError("the prompt is empty (from " +
                       ("stdin" if a.file in (None, "-") else a.file) + ")")
    return text


def run_command(argv) -> int:
    """Generate text from a GGUF model: a prompt in, the continuation streamed out."""
    p = ArgumentParser(prog="python -m ptxgen run", formatter_class=_HELP,
                       description="Generate text from a GGUF model: the prompt (-p, -f FILE, "
                                   "or stdin) and its continuation on stdout, the speeds on "
                                   "stderr.  Ctrl-C stops the generation.")
    add_model_args(p, ctx_help="the context: KV cache length in tokens (default: the "
                               "model's, at most 4096)")
    _add_generation_args(p, 64)
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None, help="the prompt text")
    src.add_argument("-f", "--file", "--prompt-file", dest="file", default=None, metavar="FILE",
                     help="read the prompt from FILE (-: stdin); without -p or -f a prompt "
                          "piped on stdin is read")
    src.add_argument("--tokens", type=_tokens, default=None,
                     help="prompt token ids, e.g. 1,2,3 (prints ids)")
    p.add_argument("-sys", "--system-prompt", "--system", dest="system", default=None,
                   metavar="TEXT", help="a system message: the prompt goes through the chat "
                                        "template as the user's message")
    chat_template_arg(p)
    p.add_argument("--no-display-prompt", action="store_true",
                   help="print only the generated text, not the prompt before it")
    p.add_argument("--summary", action="store_true", help="print the decode graph summary")
    p.add_argument("--tp", type=positive, default=1, metavar="N",
                   help="tensor parallelism over N GPUs of this host (one process each, "
                        "NCCL through nccl4py); 1: one GPU")
    _add_sampling_args(p)
    a = p.parse_args(argv)

    def body():
        if a.tp > 1:
            raise CliError(tp_refusal(a.tp, a.backend))
        note_ignored(a)
        settings = _sampling(a)
        prompt = _read_prompt(a)
        template = template_of(a)
        chat = prompt is not None and (a.system is not None or template is not None)
        model, be = _load(a, "" if prompt is None else ("chat" if chat else "tokenizer"),
                          template)
        if a.summary:
            print(model.summary())
        mode = "eager" if a.eager else "graph"
        n = model.capacity if a.max_new_tokens == -1 else a.max_new_tokens
        if prompt is None:
            return _run_ids(model, n, settings, mode, a.tokens)
        if chat:
            from ptxgen.llm.text.chat_template import encode_chat
            msgs = ([{"role": "system", "content": a.system}] if a.system is not None else [])
            feed = encode_chat(model.tokenizer, msgs + [{"role": "user", "content": prompt}],
                               template=template)
        else:
            feed = prompt
        status = Status()
        with _Interrupt() as stop:
            stream = model.stream(feed, max_new_tokens=n, sampling=settings, stop=a.stop,
                                  mode=mode, progress=_prompt_progress(be, status))
            echo = "" if a.no_display_prompt else prompt + ("\n" if chat else "")
            text = _write_reply(stream, stop, status, echo)
        sys.stdout.write("\n")
        sys.stdout.flush()
        res = stream.result or _partial_result(stream, text)
        print(_stats_line(res, stream.mode, be), file=sys.stderr)
        return 0 if stream.result is not None else 130

    return run_guarded(body)


def _write_reply(stream, stop: _Interrupt, status: Status, echo: str = "") -> str:
    """Write ``echo`` and then the stream's pieces to stdout as they come,
    until it ends or ``stop`` is requested (a second Ctrl-C raises).  The
    prompt's progress line is cleared before the first write.  Returns the
    text generated."""
    parts = []
    started = False
    for piece in stream:
        if not started:
            status.clear()
            sys.stdout.write(echo)
            started = True
        sys.stdout.write(piece)
        sys.stdout.flush()
        parts.append(piece)
        if stop.requested:
            break
    if not started:
        status.clear()
        sys.stdout.write(echo)
    sys.stdout.flush()
    return "".join(parts)


def _partial_result(stream, text: str):
    """The :class:`~ptxgen.llm.textgen.TextResult` of a stream stopped
    before its end (stop reason ``"interrupted"``), from its decoding."""
    from ptxgen.llm.textgen import TextResult
    dec = stream._dec       # TextStream sets its result only at the end; the counts live here
    return TextResult(text=text, tokens=tuple(dec.tokens), stop_reason="interrupted",
                      prompt_tokens=dec.prefilled + dec.n_fed, generated_tokens=len(dec.tokens),
                      prompt_seconds=dec.prompt_seconds, decode_seconds=dec.decode_seconds,
                      seed=dec.seed)


def _count(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _stats_line(res, mode: str, backend) -> str:
    """What was generated and how fast: the prompt's tokens per second,
    and the generation's over the steps after the first new token (shown
    only where measured: one new token has no rate)."""
    prompt = f"prompt: {_count(res.prompt_tokens)}"
    if res.prompt_tokens > 0 and res.prompt_seconds > 0:
        prompt += f", {res.prompt_tokens_per_second:.1f} tokens/s"
    gen = f"generation: {_count(res.generated_tokens)}"
    if res.generated_tokens > 1 and res.decode_seconds > 0:
        gen += f", {res.decode_tokens_per_second:.1f} tokens/s"
    seed = "" if res.seed is None else f", seed {res.seed}"
    return f"{prompt}; {gen}; stop: {res.stop_reason} ({mode}, backend {backend.name}{seed})"


def _run_ids(model, n, settings, mode, tokens) -> int:
    res = model.generate(tokens, n, mode=mode, sampling=settings)
    print("tokens:", ",".join(map(str, res.tokens)))
    fed = len(tokens) - 1        # the last prompt token is fed by the first generating step
    line = f"prompt: {_count(fed)}"
    if fed > 0 and res.prompt_seconds > 0:
        line += f", {res.prompt_tokens_per_second:.1f} tokens/s ({res.prompt_seconds:.3f} s)"
    print(line)
    seed = "" if res.seed is None else f", seed {res.seed}"
    speed = f"{res.tokens_per_second:.1f} tokens/s" if len(res.tokens) > 1 else "1 token"
    print(f"{speed} ({res.mode}, {res.launches_per_token} launches per token, backend "
          f"{model.backend.name}{seed})")
    return 0


def chat_command(argv) -> int:
    """Chat with a GGUF model through its chat template (one message a line)."""
    p = ArgumentParser(prog="python -m ptxgen chat", formatter_class=_HELP,
                       description="Chat with a GGUF model through its chat template: one "
                                   "message a line on stdin; /exit, end of input or Ctrl-C at "
                                   "the prompt ends the chat, Ctrl-C during a reply ends the "
                                   "reply.")
    add_model_args(p, ctx_help="the context: KV cache length in tokens, the whole "
                               "conversation's (default: the model's, at most 4096)")
    _add_generation_args(p, 256)
    p.add_argument("-sys", "--system-prompt", "--system", dest="system", default=None,
                   metavar="TEXT", help="a system message opening the conversation")
    chat_template_arg(p)
    p.add_argument("--parse-special", action="store_true",
                   help="turn special-token texts typed in a message (<|im_end|>, ...) into "
                        "control tokens; without it they stay text")
    _add_sampling_args(p)
    a = p.parse_args(argv)

    def body():
        note_ignored(a)
        settings = _sampling(a)
        template = template_of(a)
        model, be = _load(a, "chat", template)
        mode = "eager" if a.eager else "graph"
        n = model.capacity if a.max_new_tokens == -1 else a.max_new_tokens
        session = model.chat_session(a.system, template=template,
                                     parse_special_in_content=a.parse_special,
                                     max_new_tokens=n, sampling=settings, stop=a.stop,
                                     mode=mode)
        interactive = _tty(sys.stdin)
        status = Status()
        try:
            while True:
                if interactive:
                    print("> ", end="", file=sys.stderr, flush=True)
                line = sys.stdin.readline()
                if not line:
                    break
                text = line.rstrip("\r\n")
                if text.strip() == "/exit":
                    break
                if text.strip():
                    _chat_turn(session, text, status, be)
        except KeyboardInterrupt:       # Ctrl-C outside a reply (at the prompt) ends the chat
            print(file=sys.stderr)
        return 0

    return run_guarded(body)


def _chat_turn(session, text: str, status: Status, be):
    """One reply, streamed; Ctrl-C ends the reply only (what it said so far
    stays in the conversation)."""
    before = list(session.messages)
    stream = None
    reply = ""
    with _Interrupt() as stop:
        try:
            stream = session.stream(text, progress=_prompt_progress(be, status))
            reply = _write_reply(stream, stop, status)
        except KeyboardInterrupt:         # a second Ctrl-C, or one before the first piece
            status.clear()
            stop.requested = True
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stream is None:
        return
    res = stream.result
    if res is None:
        # the reply did not reach its end: keep what it said (the next turn
        # encodes the whole conversation again)
        session.messages = before + [{"role": "user", "content": text},
                                     {"role": "assistant", "content": reply}]
        res = _partial_result(stream, reply)
    print(_stats_line(res, stream.mode, be), file=sys.stderr, flush=True)
