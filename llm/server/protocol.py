"""The OpenAI API's request bodies (pydantic models) and errors.

The request models take what OpenAI's ``/v1/chat/completions`` and
``/v1/completions`` take, in JSON's own types (strict: ``"1"`` is not a
number, ``true`` is not an integer), plus the sampling fields local runners
add (``top_k``, ``min_p``, ``repetition_penalty``, ``repeat_last_n``,
``ignore_eos``).  Fields OpenAI defines that this server cannot honour
(tools, logit bias, JSON response formats, ``suffix``, ``best_of`` other
than ``n``) are refused with a 400 naming them; fields it does not know are
ignored, as vLLM and llama.cpp's server do.

Every error is an :class:`APIError`, answered as OpenAI's error object::

    {"error": {"message": "...", "type": "invalid_request_error",
               "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "ChatMessage",
           "StreamOptions", "parse_request", "MAX_LOGPROBS"]

#: the most top log-probabilities a token may ask for (the engine's limit)
MAX_LOGPROBS = 20


class APIError(Exception):
    """An error answered with ``status`` and OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One message; ``content`` is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None
    name: str | None = None

    def text(self, index: int) -> str:
        """The content as one string (text parts joined); other part types
        are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind != "text":
                raise APIError(400, f"messages[{index}].content[{j}]: only text content parts "
                                    f"are supported, got type {kind!r}",
                               param=f"messages.{index}.content")
            try:
                out.append(TextPart.model_validate(part).text)
            except pydantic.ValidationError as e:
                raise _validation_error(e, prefix=f"messages.{index}.content.{j}") from None
        return "".join(out)


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: Probability | None = None
    top_k: int | None = Field(default=None, ge=-1)
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0, allow_inf_nan=False)
    repeat_last_n: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    logit_bias: dict | None = None
    user: str | None = None

    def stop_strings(self) -> tuple:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 16:
            raise APIError(400, f"stop takes at most 16 strings, got {len(stops)}", param="stop")
        return tuple(s for s in stops if s)

    def check_supported(self):
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           param="stream_options")


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    response_format: dict | None = None

    def check_supported(self):
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools are not supported by this server", param="tools")
        if self.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice is not supported by this server",
                           param="tool_choice")
        fmt = (self.response_format or {}).get("type", "text")
        if fmt != "text":
            raise APIError(400, f"response_format type {fmt!r} is not supported by this "
                                "server (only 'text')", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")

    def token_budget(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name) or ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def logprobs_wanted(self) -> int | None:
        """None: no log-probabilities; else how many top ones per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids,
    or a list of either (several prompts)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def check_supported(self):
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by this server",
                           param="best_of")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs (the prompt's log-probabilities) is not "
                                "supported by this server", param="echo")

    def prompts(self) -> list:
        """The prompts: strings or lists of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if isinstance(p[0], int):
            return [p]
        return list(p)

    def token_budget(self) -> int | None:
        return self.max_tokens

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


def _validation_error(e: pydantic.ValidationError, prefix: str = "") -> APIError:
    """The first problem pydantic found, as a 400 naming the field."""
    err = e.errors(include_url=False)[0]
    # union members add their type to the location: keep the field path only
    loc = [str(x) for x in err["loc"] if not (isinstance(x, str) and ("[" in x or x in (
        "str", "int", "list", "dict", "none", "function-after", "literal")))]
    param = ".".join(([prefix] if prefix else []) + loc) or None
    if err["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err['msg']}")
    if err["type"] == "missing":
        return APIError(400, f"{param} is required", param=param)
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    shown = repr(err.get("input"))
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return APIError(400, f"{param}: {msg} (got {shown})" if param else msg, param=param)


def parse_request(cls, body: bytes):
    """``cls`` (a request model) from a JSON body; a 400 :class:`APIError`
    for invalid JSON, a body that is not an object, a missing or mistyped
    field, a value out of range or a field this server cannot honour."""
    if not body.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    if not body.lstrip().startswith(b"{"):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = cls.model_validate_json(body)
    except pydantic.ValidationError as e:
        raise _validation_error(e) from None
    req.check_supported()
    return req
