"""Chat templates: a conversation rendered into a model's prompt format, and its tokens.

A GGUF file carries its model's chat template as ``tokenizer.chat_template``:
a Jinja2 template over ``messages`` (a list of ``{"role", "content"}``
dicts), ``add_generation_prompt``, ``bos_token`` and ``eos_token``.  It is
rendered here the way Hugging Face transformers renders it, so that the same
template gives the same text:

* a sandboxed, immutable environment: a template cannot reach Python
  internals or change its inputs;
* ``trim_blocks`` and ``lstrip_blocks`` on, the ``loopcontrols`` extension
  (``{% break %}``, ``{% continue %}``) and ``{% generation %}``;
* ``raise_exception(message)`` to reject a conversation, ``strftime_now(fmt)``
  for the current date, and a ``tojson`` filter that is ``json.dumps``
  (``ensure_ascii``, ``indent``, ``separators``, ``sort_keys``) without
  Jinja's HTML escaping.

The template is untrusted, so it runs under limits of size, memory, output
and time (:mod:`.template_sandbox`, :class:`RenderLimits`); breaking one is
a :class:`ChatTemplateLimitError`.  A file's own template that cannot be
used at all -- it does not compile, or breaks the limits on a small probe
conversation -- is replaced by ChatML (:data:`CHATML`) with a
:class:`ChatTemplateWarning`, so that the model still chats
(:func:`file_template`).

The messages are untrusted too.  :func:`encode_chat` and
:func:`incremental_chat_tokens` make control tokens (``<|im_end|>``,
``<|eot_id|>``, ...) only of the template's own text: the same text inside
a message (its content, name, tool calls, or the tools) stays plain text,
so a message cannot forge a turn.  How: when some string of the
conversation holds the text of a token that only ``parse_special`` makes (a
CONTROL or UNKNOWN token), the conversation is rendered a second time with
the first character of each such text in those strings replaced by a
private-use character, and special tokens are taken only where that second
rendering still has them; the text between them is the first rendering's.
The two renderings must differ only at those characters -- a template that
treats such a message differently (tests for ``'<|im_end|>' in content``,
say) is refused with a :class:`ChatTemplateError`.  Conversations without
such text are tokenized exactly as before (the rendering, special tokens
parsed).  ``parse_special_in_content=True`` restores the old behaviour for
callers whose messages are trusted.

For multi-turn chat, :func:`incremental_chat_tokens` gives the tokens a new
turn adds to what an earlier rendering already put in the model's cache.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping, Sequence

from ptxgen.llm.text.template_sandbox import (ChatTemplateError, ChatTemplateLimitError,
                                              RenderLimits, compile_template)

__all__ = ["ChatTemplateError", "ChatTemplateLimitError", "ChatTemplateWarning", "RenderLimits",
           "CHATML", "render_chat", "file_template", "encode_chat", "incremental_chat_tokens"]

#: the built-in template used when a file's own cannot be (ChatML)
CHATML = ("{%- for message in messages %}"
          "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# what a file's template must render within the limits to be used
_PROBE = ({"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "Hello!"},
          {"role": "assistant", "content": "Hello. How can I help?"},
          {"role": "user", "content": "What is 2 + 2?"})


class ChatTemplateWarning(UserWarning):
    """A file's chat template that cannot be used, replaced by :data:`CHATML`."""


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
                eos_token: str = "", limits: RenderLimits | None = None, **extra) -> str:
    """Render a conversation with a chat template, in the sandbox.

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
    limits : RenderLimits, optional
        The sandbox's limits (the defaults: :class:`RenderLimits`).
    **extra
        Further template variables (``tools``, ``documents``, ...).

    Returns
    -------
    str

    Raises
    ------
    ChatTemplateLimitError
        If the template breaks the sandbox's limits.
    ChatTemplateError
        If the template is missing or malformed, ``messages`` is not a list
        of role dicts, or the template calls ``raise_exception``.
    """
    if template is None or (isinstance(template, str) and not template.strip()):
        raise ChatTemplateError("no chat template: the GGUF file has no "
                                "'tokenizer.chat_template'; pass a template explicitly")
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be a str, got {type(template).__name__}")
    if limits is not None and not isinstance(limits, RenderLimits):
        raise TypeError(f"limits must be a RenderLimits, got {type(limits).__name__}")
    _check_messages(messages)
    compiled = compile_template(template, limits)
    return compiled.render(dict(extra, messages=messages,
                                add_generation_prompt=add_generation_prompt,
                                bos_token=bos_token, eos_token=eos_token), limits)


_file_choice: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def file_template(tokenizer):
    """The template to render the tokenizer's file with: its own, or
    :data:`CHATML` when its own cannot be used.

    A template cannot be used when it does not compile in the sandbox or
    breaks its limits on a small conversation (system, user, assistant,
    user).  Then a :class:`ChatTemplateWarning` says why, once per
    tokenizer and template.  A template that only rejects that conversation
    (``raise_exception``, or fails on it otherwise) is used.

    Returns
    -------
    str or None
        None when the file has no template.
    """
    own = tokenizer.chat_template
    if not isinstance(own, str) or not own.strip():
        return own
    known = _file_choice.get(tokenizer)
    if known is not None and known[0] is own:
        return known[1]
    chosen, reason = own, ""
    try:
        compile_template(own)
    except ChatTemplateError as e:
        chosen, reason = CHATML, str(e)
    else:
        try:
            tokenizer.apply_chat_template(list(_PROBE), template=own)
        except ChatTemplateLimitError as e:
            chosen, reason = CHATML, str(e)
        except ChatTemplateError:
            pass                     # it rejects this conversation, not every one
    if chosen is not own:
        warnings.warn(f"the GGUF file's chat template cannot be used ({reason}); chatting with "
                      "the built-in ChatML template instead", ChatTemplateWarning, stacklevel=2)
    _file_choice[tokenizer] = (own, chosen)
    return chosen


# -- messages whose text holds control tokens ------------------------------------------

class _Controls:
    """A tokenizer's control-token texts, grouped by their first characters
    so that one search rules out a group, and a mark character none holds."""

    def __init__(self, tokenizer):
        self.texts = tokenizer.control_texts
        groups: dict = {}
        for t in self.texts:
            groups.setdefault(t[:4], []).append(t)
        self.groups = list(groups.items())
        joined = "".join(self.texts)
        self.mark = next((chr(c) for c in range(0xE000, 0xF900) if chr(c) not in joined), None)

    def found(self, text: str) -> list:
        """The control texts in ``text``."""
        return [t for prefix, group in self.groups if prefix in text for t in group if t in text]


_controls_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _controls(tokenizer) -> _Controls:
    c = _controls_of.get(tokenizer)
    if c is None or c.texts is not tokenizer.control_texts:
        c = _controls_of[tokenizer] = _Controls(tokenizer)
    return c


def _defang(value, controls: _Controls, memo: dict):
    """``value`` with the first character of each control text in its strings
    replaced by the mark; the same object where nothing changed."""
    if isinstance(value, str):
        for t in sorted(controls.found(value), key=len, reverse=True):
            while t in value:
                value = value.replace(t, controls.mark + t[1:])
        return value
    if not isinstance(value, (Mapping, list, tuple)):
        return value
    if id(value) in memo:
        return memo[id(value)]
    memo[id(value)] = value         # a cycle is left as it is
    if isinstance(value, Mapping):
        pairs = [(_defang(k, controls, memo), _defang(v, controls, memo))
                 for k, v in value.items()]
        if any(a is not k or b is not v for (a, b), (k, v) in zip(pairs, value.items())):
            memo[id(value)] = dict(pairs)
    else:
        items = [_defang(v, controls, memo) for v in value]
        if any(a is not b for a, b in zip(items, value)):
            memo[id(value)] = tuple(items) if isinstance(value, tuple) else items
    return memo[id(value)]


def _renderings(tokenizer, messages, add_generation_prompt, template, parse_special_in_content,
                limits, extra) -> tuple:
    """``(text, marked)``: the rendering, and the rendering with the control
    texts in the conversation's strings defanged (None when there are none,
    or with ``parse_special_in_content``)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         template=template, limits=limits, **extra)
    if parse_special_in_content:
        return text, None
    controls = _controls(tokenizer)
    if not controls.texts:
        return text, None
    if controls.mark is None:
        raise ChatTemplateError("every private-use character occurs in a control token's text: "
                                "pass parse_special_in_content=True")
    m2, e2 = _defang((messages, extra), controls, {})
    if m2 is messages and e2 is extra:
        return text, None
    try:
        marked = tokenizer.apply_chat_template(m2, add_generation_prompt=add_generation_prompt,
                                               template=template, limits=limits, **e2)
    except ChatTemplateError:
        raise ChatTemplateError(_TELL_APART.format(repr(_first_found(controls, (m2, e2))))) \
            from None
    return text, marked


def _first_found(controls: _Controls, value) -> str:
    """A control text that was defanged in ``value`` (a string or a
    conversation), for messages."""
    strings, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            strings.append(v)
        elif isinstance(v, Mapping):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return next((t for t in controls.texts for x in strings if controls.mark + t[1:] in x), "")


_TELL_APART = ("the chat template renders a message that holds control-token text ({}) "
               "differently from its plain text, so its own control tokens cannot be told "
               "apart from the message's; remove that text from the conversation or pass "
               "parse_special_in_content=True if the conversation is trusted")


def _parts(tokenizer, text: str, marked) -> list:
    """``text`` cut around special tokens: where ``marked`` has them, or
    everywhere (``marked`` None)."""
    if marked is None:
        return tokenizer.split_special(text, parse_special=True)
    controls = _controls(tokenizer)
    same = len(marked) == len(text)
    last, pos = 0, marked.find(controls.mark)
    while same and pos >= 0:
        same = marked[last:pos] == text[last:pos]
        last, pos = pos + 1, marked.find(controls.mark, pos + 1)
    if not same or marked[last:] != text[last:]:
        raise ChatTemplateError(_TELL_APART.format(repr(_first_found(controls, marked))))
    return [text[p[0]:p[1]] if isinstance(p, tuple) else p
            for p in tokenizer.special_spans(marked, parse_special=True)]


def _bos_length(tokenizer, text: str) -> int:
    # the template writes BOS and encode() adds one: keep only encode()'s
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None:
        bos_text = tokenizer.token_text(bos)
        if bos_text and text.startswith(bos_text):
            return len(bos_text)
    return 0


def encode_chat(tokenizer, messages, add_generation_prompt: bool = True,
                template: str | None = None, *, parse_special_in_content: bool = False,
                max_tokens: int | None = None, limits: RenderLimits | None = None,
                **extra) -> list[int]:
    """Render a conversation and tokenize it as a prompt.

    The template's special-token texts (``<|eot_id|>``, ``<|im_start|>``,
    ...) become their tokens, the same texts inside the conversation's
    strings stay text (see the module docstring); BOS is added as the
    vocabulary asks, once (a BOS text the template writes at the start is
    dropped in its favour).

    Parameters
    ----------
    tokenizer : Tokenizer
    messages : list of dict
    add_generation_prompt : bool
    template : str, optional
        Overrides the tokenizer's own ``chat_template``.
    parse_special_in_content : bool
        Make control tokens of special-token texts inside the messages too
        (for a trusted conversation).
    max_tokens : int, optional
        Refuse a conversation that needs more tokens, before tokenizing it
        all (:class:`~.tokenizer.TokenLimitError`).
    limits : RenderLimits, optional
        The template sandbox's limits.
    **extra
        Further template variables.

    Returns
    -------
    list of int

    Raises
    ------
    ChatTemplateError
        The template failed, broke a limit (:class:`ChatTemplateLimitError`)
        or cannot be told apart from the messages' control-token text.
    TokenLimitError
        With ``max_tokens``, for a conversation that needs more.
    """
    text, marked = _renderings(tokenizer, messages, add_generation_prompt, template,
                               parse_special_in_content, limits, extra)
    n = _bos_length(tokenizer, text)
    parts = _parts(tokenizer, text[n:], None if marked is None else marked[n:])
    return tokenizer.encode_parts(parts, add_special=True, max_tokens=max_tokens)


def incremental_chat_tokens(tokenizer, prev_messages, messages, add_generation_prompt: bool = True,
                            prev_add_generation_prompt: bool = False,
                            template: str | None = None, *,
                            parse_special_in_content: bool = False,
                            max_tokens: int | None = None, limits: RenderLimits | None = None,
                            **extra) -> list[int]:
    """Tokens a conversation adds to an earlier rendering of its first turns.

    Renders ``prev_messages`` and ``messages``; the first rendering must be a
    prefix of the second, and the tokens of the rest are returned (the
    template's special tokens parsed as in :func:`encode_chat`, no BOS).
    These are what to feed a model whose cache holds the first rendering.

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
    parse_special_in_content : bool
        As in :func:`encode_chat`.
    max_tokens : int, optional
        Refuse more new tokens than this (:class:`~.tokenizer.TokenLimitError`).
    limits : RenderLimits, optional
        The template sandbox's limits.
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
        reasoning, so the cache cannot be kept), and as :func:`encode_chat`.
    """
    prev, _ = _renderings(tokenizer, prev_messages, prev_add_generation_prompt, template,
                          True, limits, extra)
    new, marked = _renderings(tokenizer, messages, add_generation_prompt, template,
                              parse_special_in_content, limits, extra)
    if not new.startswith(prev):
        at = next((i for i, (a, b) in enumerate(zip(prev, new)) if a != b), min(len(prev), len(new)))
        raise ChatTemplateError(
            "the earlier conversation's rendering is not a prefix of the new one (they differ "
            f"from character {at}: {prev[at:at + 40]!r} vs {new[at:at + 40]!r}); the cached "
            "tokens cannot be kept, re-encode the whole conversation")
    n = len(prev)
    parts = _parts(tokenizer, new[n:], None if marked is None else marked[n:])
    return tokenizer.encode_parts(parts, add_special=False, max_tokens=max_tokens)
