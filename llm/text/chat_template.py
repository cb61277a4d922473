"""Chat templates: a conversation rendered into a model's prompt format.

A GGUF file carries its model's chat template as ``tokenizer.chat_template``:
a Jinja2 template over ``messages`` (a list of ``{"role", "content"}``
dicts), ``add_generation_prompt``, ``bos_token`` and ``eos_token``.  It is
rendered here the way Hugging Face transformers renders it, so that the same
template gives the same text:

* a sandboxed, immutable environment (``ImmutableSandboxedEnvironment``):
  a template cannot reach Python internals or change its inputs;
* ``trim_blocks`` and ``lstrip_blocks`` on, and the ``loopcontrols``
  extension (``{% break %}``, ``{% continue %}``);
* ``raise_exception(message)`` to reject a conversation, ``strftime_now(fmt)``
  for the current date, and a ``tojson`` filter that is ``json.dumps``
  (``ensure_ascii``, ``indent``, ``separators``, ``sort_keys``) without
  Jinja's HTML escaping.

For multi-turn chat, :func:`incremental_chat_tokens` gives the tokens a new
turn adds to what an earlier rendering already put in the model's cache.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "render_chat", "encode_chat", "incremental_chat_tokens"]


class ChatTemplateError(ValueError):
    """A chat template that is missing, malformed, or rejects the conversation."""


def _raise_exception(message):
    raise ChatTemplateError(f"the chat template rejected the conversation: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: "
                                f"{e.message}") from None


def _check_messages(messages):
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of dicts, got "
                                f"{type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', "
                                    f"got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] has no 'role' string: {dict(m)!r}")


def render_chat(template, messages, add_generation_prompt: bool = True, bos_token: str = "",
                eos_token: str = "", **extra) -> str:
    """Render a conversation with a chat template.

    Parameters
    ----------
    template : str
        The Jinja2 template (``tokenizer.chat_template``).
    messages : list of dict
        ``{"role": "system" | "user" | "assistant" | ..., "content": ...}``.
    add_generation_prompt : bool
        End with the text that opens the assistant's reply.
    bos_token, eos_token : str
        The texts of the BOS and EOS tokens, for templates that write them.
    **extra
        Further template variables (``tools``, ``documents``, ...).

    Returns
    -------
    str

    Raises
    ------
    ChatTemplateError
        If the template is missing or malformed, ``messages`` is not a list
        of role dicts, or the template calls ``raise_exception``.
    """
    if template is None or (isinstance(template, str) and not template.strip()):
        raise ChatTemplateError("no chat template: the GGUF file has no "
                                "'tokenizer.chat_template'; pass a template explicitly")
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be a str, got {type(template).__name__}")
    _check_messages(messages)
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **extra)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None
    except Exception as e:  # an operation the template applies to the wrong values
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None


def _strip_bos(tokenizer, text: str) -> str:
    # the template writes BOS and encode() adds one: keep only encode()'s
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None:
        bos_text = tokenizer.token_text(bos)
        if bos_text and text.startswith(bos_text):
            return text[len(bos_text):]
    return text


def encode_chat(tokenizer, messages, add_generation_prompt: bool = True,
                template: str | None = None, **extra) -> list[int]:
    """Render a conversation and tokenize it as a prompt.

    Special-token texts in the rendering (``<|eot_id|>``, ``<|im_start|>``,
    ...) become their tokens; BOS is added as the vocabulary asks, once (a
    BOS text the template writes at the start is dropped in its favour).

    Parameters
    ----------
    tokenizer : Tokenizer
    messages : list of dict
    add_generation_prompt : bool
    template : str, optional
        Overrides the tokenizer's own ``chat_template``.
    **extra
        Further template variables.

    Returns
    -------
    list of int
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         template=template, **extra)
    return tokenizer.encode(_strip_bos(tokenizer, text), add_special=True, parse_special=True)


def incremental_chat_tokens(tokenizer, prev_messages, messages, add_generation_prompt: bool = True,
                            prev_add_generation_prompt: bool = False,
                            template: str | None = None, **extra) -> list[int]:
    """Tokens a conversation adds to an earlier rendering of its first turns.

    Renders ``prev_messages`` and ``messages``; the first rendering must be a
    prefix of the second, and the tokens of the rest are returned (special
    tokens parsed, no BOS).  These are what to feed a model whose cache
    holds the first rendering.

    Two ways to use it after the model answered turn ``n-1``:

    * the cache holds the prompt and the generated reply *including* its
      end-of-turn token: pass ``prev_messages`` = the earlier messages plus
      ``{"role": "assistant", "content": reply}`` (rendered without a
      generation prompt, the default);
    * the cache is cut back to the prompt: pass ``prev_messages`` = the
      earlier messages and ``prev_add_generation_prompt=True``; the result
      then starts with the reply's text.

    Parameters
    ----------
    tokenizer : Tokenizer
    prev_messages, messages : list of dict
    add_generation_prompt : bool
        For the rendering of ``messages``.
    prev_add_generation_prompt : bool
        For the rendering of ``prev_messages``.
    template : str, optional
        Overrides the tokenizer's own ``chat_template``.
    **extra
        Further template variables, for both renderings.

    Returns
    -------
    list of int

    Raises
    ------
    ChatTemplateError
        If the earlier rendering is not a prefix of the later one (the
        template rewrites earlier turns, e.g. drops a previous reply's
        reasoning, so the cache cannot be kept).
    """
    prev = tokenizer.apply_chat_template(prev_messages,
                                         add_generation_prompt=prev_add_generation_prompt,
                                         template=template, **extra)
    new = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        template=template, **extra)
    if not new.startswith(prev):
        at = next((i for i, (a, b) in enumerate(zip(prev, new)) if a != b), min(len(prev), len(new)))
        raise ChatTemplateError(
            "the earlier conversation's rendering is not a prefix of the new one (they differ "
            f"from character {at}: {prev[at:at + 40]!r} vs {new[at:at + 40]!r}); the cached "
            "tokens cannot be kept, re-encode the whole conversation")
    return tokenizer.encode(new[len(prev):], add_special=False, parse_special=True)
