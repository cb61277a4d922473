"""Text in, text out: prompts and chats through a model's own tokenizer.

:class:`TextGeneration` gives :class:`~.model.Model` its text methods:

* ``generate_text(prompt, ...)`` returns a :class:`TextResult` (the text and
  its statistics);
* ``stream(prompt, ...)`` returns a :class:`TextStream`, an iterator of text
  pieces as they are produced (incomplete UTF-8 sequences are held back
  until complete) whose ``result`` is the :class:`TextResult` once it ends;
* ``chat(messages, ...)`` renders a conversation with the GGUF's chat
  template and answers it;
* ``chat_session(system=...)`` returns a :class:`ChatSession`, a
  conversation whose earlier turns stay in the KV cache: each new turn feeds
  only the tokens it adds.

Generation stops at the first of: an end-of-generation token
(``Tokenizer.eog_ids``; it is not part of the text), a stop string (matched
on the decoded text, across token boundaries; the text ends before it),
``max_new_tokens`` tokens, or a full KV cache.  :attr:`TextResult.stop_reason`
says which: :data:`STOP_EOG`, :data:`STOP_STRING`, :data:`STOP_LENGTH`,
:data:`STOP_CAPACITY`.
"""

from __future__ import annotations

import attrs

from ptxgen.llm.text.chat_template import ChatTemplateError, encode_chat, incremental_chat_tokens
from ptxgen.llm.text.tokenizer import TokenLimitError
from ptxgen.llm.generation import ContextOverflowError, SamplingSettings

__all__ = ["TextGeneration", "TextResult", "TextStream", "ChatSession", "STOP_EOG",
           "STOP_STRING", "STOP_LENGTH", "STOP_CAPACITY", "sampling_settings"]

#: the stop reasons of a :class:`TextResult`
STOP_EOG, STOP_STRING, STOP_LENGTH, STOP_CAPACITY = (
    "eog", "stop_string", "max_new_tokens", "kv_capacity")

_SAMPLING_KEYS = tuple(f.name for f in attrs.fields(SamplingSettings))


def sampling_settings(sampling=None, **kw) -> SamplingSettings:
    """A :class:`SamplingSettings` from keyword arguments (``temperature``,
    ``top_k``, ``top_p``, ``min_p``, ``repeat_penalty``, ``repeat_last_n``,
    ``presence_penalty``, ``frequency_penalty``, ``seed``), over ``sampling``
    when given."""
    unknown = sorted(set(kw) - set(_SAMPLING_KEYS))
    if unknown:
        raise TypeError(f"unknown sampling setting {unknown[0]!r}; valid: "
                        f"{', '.join(_SAMPLING_KEYS)}")
    base = SamplingSettings() if sampling is None else sampling
    return attrs.evolve(base, **kw) if kw else base


@attrs.frozen
class TextResult:
    """A finished generation.

    Attributes
    ----------
    text : str
        The generated text (without an end-of-generation token or a stop
        string).
    tokens : tuple of int
        Every token generated, the end-of-generation token included.
    stop_reason : str
        :data:`STOP_EOG`, :data:`STOP_STRING`, :data:`STOP_LENGTH` or
        :data:`STOP_CAPACITY`.
    prompt_tokens : int
        Tokens fed before the first new one (with a kept cache: the previous
        turn's last token and the new ones).
    generated_tokens : int
    prompt_seconds : float
        Time of the feeding steps, up to and including the first new token.
    decode_seconds : float
        Time of the steps after the first new token.
    seed : int or None
        The sampler's seed (None for greedy decoding).
    """

    text: str
    tokens: tuple
    stop_reason: str
    prompt_tokens: int
    generated_tokens: int
    prompt_seconds: float
    decode_seconds: float
    seed: int | None = None

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of the steps after the first new token."""
        n = self.generated_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else float("nan")

    def stats(self) -> str:
        """A one-line summary (tokens, tokens/s, stop reason)."""
        return (f"prompt: {self.prompt_tokens} tokens, {self.prompt_tokens_per_second:.1f} tokens/s; "
                f"generation: {self.generated_tokens} tokens, "
                f"{self.decode_tokens_per_second:.1f} tokens/s; stop: {self.stop_reason}")


class _StopStrings:
    """Finds stop strings in text that arrives in pieces.

    Text that could still be the start of a stop string is held back, so
    what :meth:`push` releases never contains (the start of) a match."""

    def __init__(self, stops):
        if isinstance(stops, str):
            stops = [stops]
        stops = list(stops or ())
        for s in stops:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}")
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, piece: str) -> tuple:
        """Add ``piece``; returns ``(text to release, whether a stop string
        was found)``.  After a match the text up to it is released and the
        rest dropped."""
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self.pending[:min(hits)]
            self.pending = ""
            return out, True
        # hold back the longest end of the text that begins a stop string
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if s.startswith(self.pending[-n:]):
                    keep = n
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def finish(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextStream:
    """Text pieces of one generation, as they are produced.

    Iterate to run the generation; :attr:`result` is the
    :class:`TextResult` once the iteration has ended (None before).
    """

    def __init__(self, model, prompt_ids, *, max_new_tokens, sampling, stop=(),
                 keep_cache=False, mode="graph", progress=None, on_done=None, session=None):
        tok = _tokenizer_of(model)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        self.model = model
        self._done = _Done(on_done)
        # starts the sequence now (errors surface here, not on the first next())
        run = model if session is None else session
        self._dec = run.decode(prompt_ids, sampling=sampling, keep_cache=keep_cache, mode=mode,
                               progress=progress)
        # the pieces come from a generator that does not refer to this object
        # (a stream and its generator in a cycle would wait for the collector)
        self._it = _pieces(tok, self._dec, _StopStrings(stop), max_new_tokens, self._done)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._it)

    @property
    def mode(self) -> str:
        """``"graph"`` or ``"eager"``: how the steps run."""
        return self._dec.mode

    @property
    def result(self) -> "TextResult | None":
        """The :class:`TextResult` once the iteration has ended (None before)."""
        return self._done.result

    def run(self) -> TextResult:
        """Consume the rest of the stream and return its result."""
        for _ in self:
            pass
        return self.result


class _Done:
    """Where a stream's generator leaves its result (and whom it tells)."""

    def __init__(self, on_done):
        self.result = None
        self.on_done = on_done


def _pieces(tok, dec, stops, max_new, done: _Done):
    """The text pieces of the decoding ``dec``; sets ``done.result`` at the end."""
    utf8 = tok.stream_decoder()
    parts = []
    reason = STOP_CAPACITY
    for t in dec:
        if tok.is_eog(t):
            reason = STOP_EOG
            break
        out, hit = stops.push(utf8.feed(t))
        if out:
            parts.append(out)
            yield out
        if hit:
            reason = STOP_STRING
            break
        if len(dec.tokens) >= max_new:
            reason = STOP_LENGTH
            break
    if reason != STOP_STRING:
        out, hit = stops.push(utf8.flush())
        if hit:
            reason = STOP_STRING
        else:
            out += stops.finish()
        if out:
            parts.append(out)
            yield out
    done.result = TextResult(
        text="".join(parts), tokens=tuple(dec.tokens), stop_reason=reason,
        prompt_tokens=dec.prefilled + dec.n_fed, generated_tokens=len(dec.tokens),
        prompt_seconds=dec.prompt_seconds, decode_seconds=dec.decode_seconds, seed=dec.seed)
    if done.on_done is not None:
        done.on_done(done.result)


def _tokenizer_of(model):
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise ValueError("the model's GGUF file has no tokenizer (tokenizer.ggml.*): generate "
                         "from token ids with generate()")
    return tok


def _room(model, keep_cache: bool):
    """The most prompt tokens the model's KV cache can take (None: unknown),
    so that a prompt too long is refused before it is all tokenized."""
    capacity = getattr(model, "capacity", None)
    if not isinstance(capacity, int):
        return None
    pos = getattr(model, "position", None) if keep_cache else None
    return max(capacity - 1 if pos is None else capacity - pos - 2, 0)


def _fitting(room, encode, *args, **kw) -> list:
    """``encode(*args, max_tokens=room, **kw)``; too many tokens is a ContextOverflowError."""
    try:
        return encode(*args, max_tokens=room, **kw)
    except TokenLimitError as e:
        raise ContextOverflowError(f"the prompt does not fit the KV cache, which has room for "
                                   f"{room} more tokens: {e}") from None


def _prompt_ids(tok, prompt, add_special, parse_special, room=None) -> list:
    if isinstance(prompt, str):
        ids = _fitting(room, tok.encode, prompt, add_special=add_special,
                       parse_special=parse_special)
    else:
        from ptxgen.llm.session import check_tokens
        ids = check_tokens(prompt, tok.n_vocab)
    if not ids:
        raise ValueError("the prompt is empty: give some text (or add_special=True for a BOS)")
    return ids


class TextGeneration:
    """The text methods of :class:`~.model.Model` (a mixin)."""

    def stream(self, prompt, *, max_new_tokens: int = 256, stop=(), add_special: bool = True,
               parse_special: bool = True, sampling: SamplingSettings | None = None,
               keep_cache: bool = False, mode: str = "graph", progress=None,
               **sampling_kw) -> TextStream:
        """Generate from ``prompt``, yielding text pieces as they come.

        Parameters
        ----------
        prompt : str or list of int
            Text (tokenized with the file's tokenizer) or token ids.
        max_new_tokens : int
        stop : str or list of str
            Stop strings.
        add_special : bool
            Add BOS (and EOS) as the vocabulary asks.
        parse_special : bool
            Turn special-token texts in the prompt into their tokens (as
            llama.cpp's tools do with a prompt).
        sampling : SamplingSettings, optional
        keep_cache : bool
            Continue the sequence in the KV cache instead of starting anew.
        mode : {"graph", "eager"}
        progress : callable(done, total), optional
            Called after each prompt step.
        **sampling_kw
            ``temperature``, ``top_k``, ``top_p``, ``min_p``,
            ``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``,
            ``frequency_penalty``, ``seed`` (see :class:`SamplingSettings`);
            greedy by default.

        Returns
        -------
        TextStream
        """
        tok = _tokenizer_of(self)
        ids = _prompt_ids(tok, prompt, add_special, parse_special, _room(self, keep_cache))
        return TextStream(self, ids, max_new_tokens=max_new_tokens,
                          sampling=sampling_settings(sampling, **sampling_kw), stop=stop,
                          keep_cache=keep_cache, mode=mode, progress=progress)

    def generate_text(self, prompt, **kw) -> TextResult:
        """Generate from ``prompt``; the arguments are :meth:`stream`'s.

        Returns
        -------
        TextResult
            The text, the tokens, the stop reason and the timings.
        """
        return self.stream(prompt, **kw).run()

    def chat(self, messages, *, template: str | None = None,
             parse_special_in_content: bool = False, **kw) -> TextResult:
        """Answer a conversation (``[{"role": ..., "content": ...}, ...]``)
        rendered with the file's chat template (or ``template``); special-token
        texts inside the messages stay text unless ``parse_special_in_content``
        (:func:`~.chat_template.encode_chat`); the other arguments are
        :meth:`stream`'s."""
        tok = _tokenizer_of(self)
        ids = _fitting(_room(self, False), encode_chat, tok, messages, add_generation_prompt=True,
                       template=template, parse_special_in_content=parse_special_in_content)
        return self.stream(ids, **kw).run()

    def chat_session(self, system: str | None = None, *, template: str | None = None,
                     parse_special_in_content: bool = False, **defaults) -> "ChatSession":
        """A :class:`ChatSession` on this model; ``defaults`` are
        :meth:`stream` arguments for every turn."""
        return ChatSession(self, system=system, template=template,
                           parse_special_in_content=parse_special_in_content, **defaults)


class ChatSession:
    """A conversation whose earlier turns stay in the model's KV cache.

    Each turn renders the conversation with the chat template and feeds only
    what it adds to the previous rendering
    (:func:`~.chat_template.incremental_chat_tokens`): the cache keeps the
    tokens the model generated, up to its end-of-turn token.  A reply that
    stopped without one (a stop string, ``max_new_tokens``) gets the
    vocabulary's end-of-turn token fed before the next turn.  The whole
    conversation is encoded again when the cache no longer holds it (the
    model generated something else in between) or the template rewrites
    earlier turns.

    Parameters
    ----------
    model : Model
    system : str, optional
        A system message opening the conversation.
    template : str, optional
        Overrides the file's chat template.
    parse_special_in_content : bool
        Let special-token texts in the messages become control tokens (for
        trusted input; off, they stay text).
    **defaults
        :meth:`TextGeneration.stream` arguments for every turn.
    """

    def __init__(self, model, system: str | None = None, template: str | None = None,
                 parse_special_in_content: bool = False, **defaults):
        self.model = model
        self.session = model.session()
        self.tokenizer = _tokenizer_of(model)
        self.template = template
        self.parse_special_in_content = parse_special_in_content
        self.defaults = defaults
        self.messages: list = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self._fed = False          # the session's sequence is this conversation so far
        self._close_turn = False   # the last reply ended without an end-of-generation token

    def _ids(self, messages) -> tuple:
        """``(token ids to feed, keep_cache)`` for the conversation ``messages``."""
        tok, m = self.tokenizer, self.model
        kw = dict(template=self.template, parse_special_in_content=self.parse_special_in_content)
        if self._fed and self.session.position is not None:
            try:
                ids = _fitting(_room(m, True), incremental_chat_tokens, tok, self.messages,
                               messages, **kw)
            except ChatTemplateError:
                pass
            else:
                if self._close_turn and tok.eot_id is not None:
                    ids = [tok.eot_id] + ids
                return ids, True
        return _fitting(_room(m, False), encode_chat, tok, messages, add_generation_prompt=True,
                        **kw), False

    def stream(self, text: str, **kw) -> TextStream:
        """Send a user message; returns the reply as a :class:`TextStream`.
        The reply joins the conversation when the stream ends."""
        if not isinstance(text, str):
            raise TypeError(f"a chat message must be a str, got {type(text).__name__}")
        messages = self.messages + [{"role": "user", "content": text}]
        ids, keep = self._ids(messages)
        args = {**self.defaults, **kw}
        self._fed = False

        def done(result):
            self.messages = messages + [{"role": "assistant", "content": result.text}]
            self._fed = True
            self._close_turn = result.stop_reason != STOP_EOG

        return _session_stream(self.model, self.session, ids, keep, done, args)

    def send(self, text: str, **kw) -> TextResult:
        """Send a user message and return the whole reply."""
        return self.stream(text, **kw).run()


def _session_stream(model, session, ids, keep, done, args) -> TextStream:
    """A chat turn's stream: ``args`` are :meth:`TextGeneration.stream`'s
    (the prompt ones do not apply to rendered chat tokens)."""
    args = dict(args)
    sampling = sampling_settings(args.pop("sampling", None),
                                 **{k: args.pop(k) for k in list(args) if k in _SAMPLING_KEYS})
    for k in ("add_special", "parse_special"):
        args.pop(k, None)
    return TextStream(model, ids, sampling=sampling, keep_cache=keep, on_done=done,
                      max_new_tokens=args.pop("max_new_tokens", 256), session=session, **args)
