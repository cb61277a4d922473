"""The HTTP routes of ``python -m ptxgen serve``: OpenAI's API over the batched
engine (:class:`ptxgen.llm.engine.Engine`).

========================== =====================================================
``POST /v1/chat/completions`` a conversation through the model's chat template
``POST /v1/completions``   text (or token ids) in, text out
``GET /v1/models``         the one model served (``/v1/models/{id}`` too)
``GET /health``            200 once the model is loaded, 503 while it loads
``GET /metrics``           Prometheus metrics (:mod:`.metrics`)
========================== =====================================================

Each choice of a request is one engine request (``n`` choices of a prompt
share its prompt blocks through the engine's prefix cache, as do the turns
of a conversation).  Tokens stream as server-sent events when ``stream`` is
true.  A client that goes away, before or during its reply, has its engine
requests cancelled at once (the engine frees their blocks within a step).

Errors are OpenAI's error object (:class:`.protocol.APIError`): 400 for a
malformed or out-of-range request (one longer than the context is refused
before it reaches the engine), 401 without the ``--api-key``, 503 while
loading or when the engine's queue is full, 500 for a failure inside one
request, which ends that request only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib
import json
import logging
import threading
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ptxgen.llm.generation import SamplingSettings

from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request

__all__ = ["create_app", "ServerState"]

log = logging.getLogger("ptxgen.server")

_FINISH = {"stop": "stop", "length": "length", "cancelled": "cancelled"}


class ServerState:
    """What the routes share: the engine (None while it loads), the names
    the model answers to, the API key, the chat template and the metrics.

    ``api`` is the module holding ``RequestSettings`` and
    ``EngineOverloaded`` (``ptxgen.llm.engine``; a test's fake engine
    module for tests)."""

    def __init__(self, engine=None, *, model_name=None, aliases=(), api_key=None,
                 chat_template=None, api=None):
        self.engine = engine
        self.error: str | None = None
        self.model_name = model_name
        self.aliases = tuple(aliases)
        self.api_key = api_key
        self.chat_template = chat_template
        self._api = api
        self.created = int(time.time())
        self.metrics = ServerMetrics(self)

    @property
    def api(self):
        if self._api is None:
            self._api = importlib.import_module("ptxgen.llm.engine")
        return self._api

    def set_engine(self, engine):
        self.engine = engine
        if self.model_name is None:
            self.model_name = engine.model_name

    @property
    def names(self) -> tuple:
        """The ``model`` values requests may name: the served name first."""
        return tuple(dict.fromkeys(n for n in (self.model_name,) + self.aliases if n))


# ---------------------------------------------------------------- the app

def create_app(engine=None, *, load=None, model_name=None, aliases=(), api_key=None,
               chat_template=None, api=None, on_load_error=None) -> Starlette:
    """The ASGI app serving ``engine``.

    Parameters
    ----------
    engine : Engine, optional
        A loaded engine; or give ``load``.
    load : callable, optional
        Returns the engine; run in a thread when the app starts (``/health``
        answers 503 until it returns).  ``on_load_error(exc)`` is called if
        it raises.
    model_name : str, optional
        The name ``/v1/models`` lists (default: the engine's
        ``model_name``); ``aliases`` are further names requests may use.
    api_key : str, optional
        Required as ``Authorization: Bearer KEY`` on ``/v1/*``.
    chat_template : str, optional
        Overrides the model file's chat template.
    api : module, optional
        Where ``RequestSettings`` and ``EngineOverloaded`` live (default
        ``ptxgen.llm.engine``).
    """
    state = ServerState(engine, model_name=model_name, aliases=aliases, api_key=api_key,
                        chat_template=chat_template, api=api)
    if engine is not None:
        state.set_engine(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        thread = None
        if load is not None and state.engine is None:
            def run():
                try:
                    state.set_engine(load())
                except BaseException as e:  # noqa: BLE001 - reported, the server stops
                    state.error = f"{type(e).__name__}: {e}"
                    log.error("loading the model failed: %s", state.error)
                    if on_load_error is not None:
                        on_load_error(e)
            thread = threading.Thread(target=run, name="ptxgen-load", daemon=True)
            thread.start()
        yield
        if state.engine is not None:
            state.engine.close()

    routes = [
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/v1/models/{model:path}", _model, methods=["GET"]),
        Route("/v1/chat/completions", _chat_completions, methods=["POST"]),
        Route("/v1/completions", _completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, HTTPException: _http_error,
                                        Exception: _internal_error})
    app.state.server = state
    return _Counted(app, state)


class _Counted:
    """ASGI middleware: counts each HTTP response by path and status."""

    _PATHS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")

    def __init__(self, app, state):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = next((p for p in self._PATHS if path == p or path.startswith(p + "/")),
                        "other")

        async def counted_send(message):
            if message["type"] == "http.response.start":
                self.state.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted_send)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _api_error(request, exc: APIError):
    return _error_response(exc)


async def _http_error(request, exc: HTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                                     f"{exc.detail}", type=kind))


async def _internal_error(request, exc: Exception):
    log.exception("request %s %s failed", request.method, request.url.path, exc_info=exc)
    return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                    type="server_error"))


def _state(request) -> ServerState:
    return request.app.state.server


def _authorize(request, state: ServerState):
    if state.api_key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                             state.api_key.encode()):
        raise APIError(401, "invalid or missing API key: send Authorization: Bearer KEY",
                       type="authentication_error", code="invalid_api_key")


def _ready(request) -> ServerState:
    """The state of a ``/v1`` request: authorized, with the engine loaded."""
    state = _state(request)
    _authorize(request, state)
    if state.engine is None:
        if state.error is not None:
            raise APIError(503, f"the model failed to load: {state.error}",
                           type="server_error", code="model_load_failed")
        raise APIError(503, "the model is loading; try again shortly", type="server_error",
                       code="model_loading", headers={"Retry-After": "2"})
    return state


# ---------------------------------------------------------------- plain routes

async def _health(request):
    state = _state(request)
    if state.engine is not None:
        return JSONResponse({"status": "ok"})
    if state.error is not None:
        return JSONResponse({"status": "error", "error": state.error}, status_code=503)
    return JSONResponse({"status": "loading"}, status_code=503)


async def _metrics(request):
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "ptxgen",
            "max_model_len": state.engine.n_ctx}


async def _models(request):
    state = _ready(request)
    return JSONResponse({"object": "list", "data": [_model_card(state, state.names[0])]})


async def _model(request):
    state = _ready(request)
    name = request.path_params["model"]
    if name not in state.names:
        raise APIError(404, f"the model {name!r} does not exist; this server has "
                            f"{state.names[0]!r}", type="not_found_error", param="model",
                       code="model_not_found")
    return JSONResponse(_model_card(state, name))


# ---------------------------------------------------------------- generation routes

def _check_model(state: ServerState, name: str):
    if name not in state.names:
        raise APIError(400, f"the model {name!r} is not served here; this server has "
                            f"{state.names[0]!r} (GET /v1/models)", param="model",
                       code="model_not_found")


def _tokenizer(state: ServerState, what: str):
    tok = state.engine.tokenizer
    if tok is None:
        raise APIError(400, f"the model file has no tokenizer: {what}")
    return tok


async def _chat_completions(request):
    state = _ready(request)
    req = parse_request(ChatCompletionRequest, await request.body())
    _check_model(state, req.model)
    tok = _tokenizer(state, "chat needs one")
    template = state.chat_template
    if template is None and not tok.chat_template:
        raise APIError(400, "the model file has no chat template; start the server with "
                            "--chat-template NAME or FILE")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
                for i, m in enumerate(req.messages)]
    ids = await asyncio.to_thread(_encode_chat, tok, messages, template)
    return await _generate(request, state, req, [ids], chat=True)


def _encode_chat(tok, messages, template):
    from ptxgen.llm.text.chat_template import ChatTemplateError, encode_chat
    try:
        return encode_chat(tok, messages, add_generation_prompt=True, template=template)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None


async def _completions(request):
    state = _ready(request)
    req = parse_request(CompletionRequest, await request.body())
    _check_model(state, req.model)
    prompts = req.prompts()
    if any(isinstance(p, str) for p in prompts):
        tok = _tokenizer(state, "give the prompt as token ids")
        prompts = await asyncio.to_thread(_encode_prompts, tok, prompts)
    n_vocab = _vocab_size(state)
    for i, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        bad = next((t for t in ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary "
                                f"(0..{n_vocab - 1})", param="prompt")
    return await _generate(request, state, req, prompts, chat=False)


def _encode_prompts(tok, prompts) -> list:
    return [tok.encode(p, add_special=True, parse_special=True) if isinstance(p, str)
            else list(p) for p in prompts]


def _vocab_size(state: ServerState) -> int:
    """The vocabulary's size (the engine's ``n_vocab`` or its tokenizer's;
    without either, ids are left to the engine to check)."""
    tok = state.engine.tokenizer
    n = getattr(state.engine, "n_vocab", None) or (tok.n_vocab if tok is not None else None)
    return int(n) if n else 1 << 31


def _sampling(req, seed) -> SamplingSettings:
    """OpenAI's defaults (temperature 1, top-p 1, no top-k or min-p) where
    the request does not say."""
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    try:
        return SamplingSettings(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=top_k, top_p=1.0 if req.top_p is None else req.top_p,
            min_p=0.0 if req.min_p is None else req.min_p,
            repeat_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            repeat_last_n=64 if req.repeat_last_n is None else req.repeat_last_n,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0, seed=seed)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e)) from None


class _Choice:
    """One engine request answering one choice of an HTTP request."""

    def __init__(self, index: int, prompt_index: int, request):
        self.index = index
        self.prompt_index = prompt_index
        self.request = request
        self.text: list = []
        self.chars = 0
        self.tokens = 0
        self.logprobs: list = []
        self.finish: str | None = None
        self.error: str | None = None
        self.last_token_at: float | None = None


async def _generate(request, state: ServerState, req, prompts, *, chat: bool):
    engine = state.engine
    n_ctx = engine.n_ctx
    budget = req.token_budget()
    budget_param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) \
        is not None else "max_tokens"
    for ids in prompts:
        _check_context(len(ids), budget, n_ctx, chat, budget_param)
    api = state.api
    stops = req.stop_strings()
    want_lp = req.logprobs_wanted()
    choices = []
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    arrived = time.perf_counter()
    try:
        for p, ids in enumerate(prompts):
            for j in range(req.n):
                seed = None if req.seed is None else (req.seed + j) % (1 << 64)
                settings = api.RequestSettings(
                    max_tokens=budget or n_ctx - len(ids), sampling=_sampling(req, seed),
                    stop=stops, ignore_eos=req.ignore_eos,
                    # chosen tokens' log-probabilities come with any top-N asked for
                    logprobs=0 if want_lp is None else max(want_lp, 1))
                r = engine.add_request(list(ids), settings,
                                       request_id=f"{rid}-{len(choices)}")
                choices.append(_Choice(len(choices), p, r))
    except BaseException as e:
        for c in choices:
            engine.cancel(c.request.id)
        if isinstance(e, ValueError):       # the engine refused the prompt
            raise APIError(400, str(e), param="messages" if chat else "prompt") from None
        if _is_overloaded(e, api):
            raise APIError(503, f"the server is overloaded: {e}; try again shortly",
                           type="server_error", code="overloaded",
                           headers={"Retry-After": "1"}) from None
        raise
    state.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
    job = _Job(state, req, rid, choices, prompts, chat, want_lp, arrived)
    if req.stream:
        return StreamingResponse(job.stream(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})
    return await job.respond(request)


def _is_overloaded(e, api) -> bool:
    cls = getattr(api, "EngineOverloaded", None)
    return cls is not None and isinstance(e, cls)


def _check_context(n_prompt: int, budget, n_ctx: int, chat: bool, budget_param: str):
    """Refuse, before it runs, a request that cannot fit the context."""
    where = "messages" if chat else "prompt"
    if n_prompt >= n_ctx:
        raise APIError(400, f"This model's maximum context length is {n_ctx} tokens. However, "
                            f"your {where} resulted in {n_prompt} tokens, which leaves no room "
                            "for a completion.", param=where, code="context_length_exceeded")
    if budget is not None and n_prompt + budget > n_ctx:
        raise APIError(400, f"This model's maximum context length is {n_ctx} tokens. However, "
                            f"you requested {n_prompt + budget} tokens ({n_prompt} in the "
                            f"{where}, {budget} in the completion). Please reduce the length "
                            f"of the {where} or the completion.",
                       param=budget_param, code="context_length_exceeded")


class _Job:
    """The choices of one HTTP request, collected or streamed."""

    def __init__(self, state, req, rid, choices, prompts, chat, want_lp, arrived):
        self.state = state
        self.engine = state.engine
        self.req = req
        self.id = rid
        self.choices = choices
        self.prompts = prompts
        self.chat = chat
        self.want_lp = want_lp
        self.arrived = arrived
        self.created = int(time.time())
        self.model = req.model
        self._template = None

    # ---------------------------------------------------------- engine events
    def cancel_unfinished(self):
        for c in self.choices:
            if c.finish is None:
                self.engine.cancel(c.request.id)

    async def batches(self):
        """Lists of ``(choice, event)``: each one what has come since the
        last (a stream that falls behind the engine sends several tokens in
        one write instead of lagging further)."""
        if len(self.choices) == 1:            # the common case: no task, no queue
            c = self.choices[0]
            async for evs in _guarded(c.request):
                yield [(c, ev) for ev in evs]
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c):
            try:
                async for evs in _guarded(c.request):
                    for ev in evs:
                        queue.put_nowait((c, ev))
            finally:
                queue.put_nowait((c, None))

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            left = len(tasks)
            while left:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                left -= sum(ev is None for _, ev in items)
                batch = [(c, ev) for c, ev in items if ev is not None]
                if batch:
                    yield batch
        finally:
            for t in tasks:
                t.cancel()

    def take(self, c: _Choice, ev):
        """Account an event to its choice (text, tokens, metrics)."""
        n = len(ev.token_ids)
        now = time.perf_counter()
        m = self.state.metrics
        if n:
            if c.last_token_at is None:
                m.ttft.observe(now - self.arrived)
            else:
                gap = (now - c.last_token_at) / n
                for _ in range(n):
                    m.inter_token.observe(gap)
            c.last_token_at = now
            c.tokens += n
            m.generation_tokens.inc(n)
        if ev.text:
            c.text.append(ev.text)
            c.chars += len(ev.text)
        if self.want_lp is not None:
            c.logprobs.extend(ev.logprobs)
        if ev.finish_reason is not None:
            c.finish = ev.finish_reason
            c.error = ev.error
            m.request_seconds.observe(now - self.arrived)

    def usage(self) -> dict:
        prompt = sum(len(ids) for ids in self.prompts)
        done = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    # ---------------------------------------------------------- whole responses
    async def respond(self, request):
        self.state.metrics.in_flight.inc()
        watch = asyncio.create_task(_wait_disconnect(request, self.cancel_unfinished))
        try:
            async for batch in self.batches():
                for c, ev in batch:
                    self.take(c, ev)
        finally:
            watch.cancel()
            self.cancel_unfinished()
            self.state.metrics.in_flight.dec()
        failed = next((c for c in self.choices if c.finish == "error"), None)
        if failed is not None:
            raise APIError(500, f"generation failed: {failed.error or 'engine error'}",
                           type="server_error")
        choices = [self.whole_choice(c) for c in self.choices]
        obj = "chat.completion" if self.chat else "text_completion"
        return JSONResponse({"id": self.id, "object": obj, "created": self.created,
                             "model": self.model, "choices": choices, "usage": self.usage()})

    def whole_choice(self, c: _Choice) -> dict:
        text = "".join(c.text)
        finish = _FINISH.get(c.finish, c.finish)
        if self.chat:
            lp = None if self.want_lp is None else {"content": self.chat_logprobs(c.logprobs)}
            return {"index": c.index, "message": {"role": "assistant", "content": text},
                    "logprobs": lp, "finish_reason": finish}
        if self.req.echo:
            text = self.echo_text(c) + text
        lp = None if self.want_lp is None else self.completion_logprobs(c.logprobs, 0)
        return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}

    def echo_text(self, c: _Choice) -> str:
        p = self.req.prompts()[c.prompt_index]
        return p if isinstance(p, str) else self.engine.tokenizer.decode(p)

    # ---------------------------------------------------------- streaming
    async def stream(self, request):
        """The server-sent events of the reply; a client that goes away
        cancels the engine requests (here or through Starlette's own
        disconnect listener, which cancels this generator)."""
        self.state.metrics.in_flight.inc()
        watch = asyncio.create_task(_wait_disconnect(request, self.cancel_unfinished))
        usage = self.req.stream_options is not None and self.req.stream_options.include_usage
        try:
            for c in self.choices:
                first = self.first_chunk(c)
                if first is not None:
                    yield _sse(self.chunk([first], usage))
            async for batch in self.batches():
                out = []
                for c, ev in batch:
                    self.take(c, ev)
                    if c.finish == "error":
                        self.cancel_unfinished()
                        err = APIError(500, f"generation failed: {c.error or 'engine error'}",
                                       type="server_error")
                        yield b"".join(out) + _sse(err.body())
                        return
                    out.append(self.delta_event(c, ev, usage))
                if any(out):
                    yield b"".join(out)
            if usage:
                yield _sse({**self.chunk([], False), "usage": self.usage()})
            yield b"data: [DONE]\n\n"
        finally:
            watch.cancel()
            self.cancel_unfinished()
            self.state.metrics.in_flight.dec()

    def chunk(self, choices, with_usage: bool) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": choices}
        if with_usage:
            out["usage"] = None
        return out

    def first_chunk(self, c: _Choice):
        if self.chat:
            return {"index": c.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}
        if self.req.echo:
            return {"index": c.index, "text": self.echo_text(c), "logprobs": None,
                    "finish_reason": None}
        return None

    def delta_event(self, c: _Choice, ev, usage: bool) -> bytes:
        """The server-sent event of ``ev`` (b"" when it has nothing to send).
        The common event, text alone, is written from a template."""
        finish = None if ev.finish_reason is None else _FINISH.get(ev.finish_reason,
                                                                  ev.finish_reason)
        lps = list(ev.logprobs) if self.want_lp is not None else []
        if not ev.text and not lps and finish is None:
            return b""
        if finish is None and not lps:
            if self._template is None:
                head = json.dumps(self.chunk([], usage), separators=(",", ":"),
                                  ensure_ascii=False).replace("%", "%%")
                at = head.index('"choices":[') + len('"choices":[')
                field = '"delta":{"content":' if self.chat else '"text":'
                close = "}" if self.chat else ""
                self._template = (head[:at] + '{"index":%d,' + field + "%s" + close +
                                  ',"logprobs":null,"finish_reason":null}' + head[at:])
            text = json.dumps(ev.text, ensure_ascii=False)
            return b"data: " + (self._template % (c.index, text)).encode() + b"\n\n"
        if self.chat:
            lp = {"content": self.chat_logprobs(lps)} if lps else None
            delta = {"content": ev.text} if ev.text or lps else {}
            body = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            offset = c.chars - len(ev.text)
            lp = self.completion_logprobs(lps, offset) if lps else None
            body = {"index": c.index, "text": ev.text, "logprobs": lp, "finish_reason": finish}
        return _sse(self.chunk([body], usage))

    # ---------------------------------------------------------- log-probabilities
    def token_text(self, token: int) -> tuple:
        """``(text, bytes)`` of a token as the logprobs show it."""
        tok = self.engine.tokenizer
        raw = tok.token_to_piece(int(token), special=True) if tok is not None else b""
        return raw.decode("utf-8", errors="backslashreplace"), list(raw)

    def chat_logprobs(self, entries) -> list:
        out = []
        for entry in entries:
            token, lp, top = _logprob_entry(entry)
            text, raw = self.token_text(token)
            tops = []
            for t, tlp in list(top)[:self.want_lp or 0]:
                ttext, traw = self.token_text(t)
                tops.append({"token": ttext, "logprob": float(tlp), "bytes": traw})
            out.append({"token": text, "logprob": float(lp), "bytes": raw, "top_logprobs": tops})
        return out

    def completion_logprobs(self, entries, offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for entry in entries:
            token, lp, top = _logprob_entry(entry)
            text, _ = self.token_text(token)
            tokens.append(text)
            lps.append(float(lp))
            tops.append({self.token_text(t)[0]: float(tlp)
                         for t, tlp in list(top)[:self.want_lp or 0]})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}


def _logprob_entry(entry) -> tuple:
    """``(token, logprob, top)`` of an event's log-probability entry (a
    :class:`RowOutput` or a tuple)."""
    if hasattr(entry, "token"):
        return entry.token, entry.logprob, entry.top
    return tuple(entry)


async def _guarded(request):
    """An engine request's events, in lists (``Request.event_lists``); an
    exception while iterating ends it with an "error" event instead of
    reaching the route."""
    lists = request.event_lists()
    try:
        async for evs in lists:
            yield evs
            if evs[-1].finish_reason is not None:
                return
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - one request's failure stays in it
        log.exception("engine request %s failed", getattr(request, "id", "?"))
        yield [_ErrorEvent(f"{type(e).__name__}: {e}")]
    finally:
        await lists.aclose()


class _ErrorEvent:
    token_ids = ()
    text = ""
    logprobs = ()
    finish_reason = "error"

    def __init__(self, error: str):
        self.error = error


async def _wait_disconnect(request: Request, on_disconnect):
    """Call ``on_disconnect()`` when the client goes away."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return
    except asyncio.CancelledError:
        pass


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + \
        b"\n\n"
