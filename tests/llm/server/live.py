"""A real server for the tests: the app under uvicorn, in a thread of the
test process, on a free port of 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time

import uvicorn

import fake_engine
from ptxgen.llm.server import create_app
from ptxgen.llm.text.tokenizer import Tokenizer

PHI3 = os.path.join(os.path.dirname(__file__), "..", "..", "data", "vocab",
                    "ggml-vocab-phi-3.gguf")

__all__ = ["LiveServer", "serve", "phi3_tokenizer", "PHI3"]


def phi3_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(PHI3)


class LiveServer:
    """uvicorn serving ``app`` on a free port until :meth:`stop`."""

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="uvicorn")

    def start(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()


@contextlib.contextmanager
def serve(engine=None, **kw):
    """A started :class:`LiveServer` of ``create_app(engine, api=fake_engine, **kw)``."""
    kw.setdefault("api", fake_engine)
    live = LiveServer(create_app(engine, **kw)).start()
    try:
        yield live
    finally:
        live.stop()


def wait_until(predicate, timeout: float = 10.0, every: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def log(*a):
    print(*a, file=sys.stderr)
