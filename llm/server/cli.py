"""``python -m ptxgen serve MODEL.gguf``: the command that starts the server.

The flags follow llama.cpp's ``llama-server`` where the meaning is the
same (``-m``, ``-c/--ctx-size``, ``--host``, ``--port``, ``-np/--parallel``,
``--api-key``, ``--chat-template``, ``-a/--alias``; ``-ngl`` is accepted and
ignored).  The server listens at once; ``/health`` answers 503 until the
model is loaded (in a thread), then 200.  The file's structure and
vocabulary are checked first: a file that cannot be served is refused with
one ``error:`` line and exit code 2 before the server listens.  A model
that fails to load after that (the weights, the device) stops the server
with one ``error:`` line and exit code 1.  Ctrl-C (or SIGTERM)
stops it, cancelling the requests in flight.
"""

from __future__ import annotations

import logging
import os
import sys

from ptxgen.cli import ArgumentParser
from ptxgen.cli import HelpFormatter as _HELP
from ptxgen.llm.cli import (CliError, add_model_args, chat_template_arg, model_path,
                            note_ignored, positive, run_guarded, template_of)

__all__ = ["serve_command", "run_server"]


def _port(text: str) -> int:
    import argparse
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 .. 65535, got {n}")
    return n


def _fraction(text: str) -> float:
    import argparse
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {x}")
    return x


def serve_command(argv) -> int:
    """Serve a GGUF model over HTTP with OpenAI's API (chat, completions, streaming)."""
    p = ArgumentParser(prog="python -m ptxgen serve", formatter_class=_HELP,
                       description="Serve a GGUF model over HTTP with OpenAI's API: "
                                   "/v1/chat/completions, /v1/completions, /v1/models, "
                                   "/health and /metrics.  Any OpenAI client works with "
                                   "base_url http://HOST:PORT/v1.")
    add_model_args(p, ctx_help="each sequence's context in tokens (default: the model's)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=_port, default=8080, help="the port to listen on")
    p.add_argument("-np", "--parallel", "--max-seqs", dest="parallel", type=positive,
                   default=64, metavar="N", help="most sequences decoded together (the batch)")
    p.add_argument("--max-queue", type=positive, default=256, metavar="N",
                   help="most requests waiting for a place in the batch; more are answered "
                        "503 at once")
    p.add_argument("--api-key", default=os.environ.get("PTXGEN_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                        "$PTXGEN_API_KEY; none: open)")
    p.add_argument("-a", "--alias", default=None, metavar="NAME",
                   help="the model's name in /v1/models (default: the file's general.name "
                        "or its stem)")
    chat_template_arg(p)
    p.add_argument("--prefill-chunk", type=positive, default=512, metavar="N",
                   help="most prompt tokens in one engine step")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, metavar="F",
                   help="share of the GPU's memory the weights and the KV cache may take")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   default="info", help="uvicorn's and the server's log level")
    a = p.parse_args(argv)

    def body():
        note_ignored(a)
        path = model_path(a)
        if not os.path.exists(path):
            raise CliError(f"{path}: no such file")
        if os.path.isdir(path):
            raise CliError(f"{path}: is a directory, not a GGUF file")
        template = template_of(a)
        # the file's structure and vocabulary are checked before the server
        # listens: a file that cannot be served is one error line, exit 2
        from ptxgen.llm.gguf.file import LlamaFile
        f = LlamaFile(path)
        tok = f.tokenizer()
        if tok is None:
            raise CliError(f"{path} has no tokenizer (tokenizer.ggml.*): the server takes "
                           "and returns text")

        def load():
            from ptxgen.llm.engine import Engine
            engine = Engine.from_gguf(f, tokenizer=tok, backend=a.backend,
                                      max_seqs=a.parallel, ctx_size=a.capacity,
                                      chunk=a.prefill_chunk,
                                      gpu_memory_utilization=a.gpu_memory_utilization,
                                      max_queue=a.max_queue, progress=True)
            try:
                engine.warm_up()      # every step graph captured before /health says ready
            except BaseException:
                engine.close()
                raise
            return engine

        names = (os.path.basename(path), os.path.splitext(os.path.basename(path))[0])
        return run_server(load, host=a.host, port=a.port, model_name=a.alias, aliases=names,
                          api_key=a.api_key, chat_template=template, log_level=a.log_level,
                          what=path)

    return run_guarded(body)


def run_server(load, *, host: str, port: int, model_name=None, aliases=(), api_key=None,
               chat_template=None, log_level: str = "info", api=None, what: str = "the model",
               sockets=None) -> int:
    """Serve the engine ``load()`` returns until SIGINT/SIGTERM; 0 then, or
    1 if loading failed.  ``sockets``: already-bound sockets to serve on
    (instead of ``host``/``port``)."""
    import uvicorn

    from .app import create_app

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(message)s")
    failed = []
    server = None

    def on_load_error(e):
        failed.append(e)
        if server is not None:
            server.should_exit = True

    def loaded():
        engine = load()
        print(f"loaded {what}: serving {engine.model_name!r} with a context of "
              f"{engine.n_ctx} tokens", file=sys.stderr, flush=True)
        return engine

    app = create_app(load=loaded, model_name=model_name, aliases=aliases, api_key=api_key,
                     chat_template=chat_template, api=api, on_load_error=on_load_error)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    where = f"http://{host}:{port}" if sockets is None else "the given sockets"
    print(f"loading {what}; listening on {where} (GET /health says when it is ready)",
          file=sys.stderr, flush=True)
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:       # uvicorn raises the signal again once it has stopped
        pass
    if failed:
        e = failed[0]
        print(f"error: loading {what} failed: {e}", file=sys.stderr)
        return 1
    return 0
