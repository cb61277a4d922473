"""A sandbox for untrusted chat templates: Jinja2 under limits of size, time and output.

A GGUF file's chat template is a program from a stranger.  Jinja2's
``ImmutableSandboxedEnvironment`` keeps it from Python's internals and from
changing its inputs, but not from exhausting memory or time: ``'a' *
10**9``, a string doubled forty times, ``'x'.center(10**9)``, nested loops
or a macro that calls itself twice per level all pass it.  Here a template
is compiled and rendered so that each of those fails fast with
:class:`ChatTemplateLimitError`:

* **sizes** -- every value the template makes is measured as the length of
  its text form (a container counts its items in full, shared or not, as
  ``str()`` or ``tojson`` would write them).  No value may exceed the *size
  limit*: :attr:`RenderLimits.max_chars` plus 8 times the size of the
  inputs (messages, tools, ...).  Operations whose result size is known in
  advance -- ``*``, ``+``, ``%``, ``str.format``, ``center``/``ljust``/
  ``rjust``/``zfill``/``indent`` widths, ``replace``, ``join``, ``tojson``,
  ``batch`` -- are refused before they run; all other calls, operators,
  filters and literals are measured right after;
* **memory** -- the values a template makes add up against
  :attr:`RenderLimits.max_bytes` (plus 32 bytes per input character);
* **output** -- everything written, inside macros and blocks included,
  adds up against the size limit;
* **time** -- every operator, call, filter, attribute lookup, loop
  iteration and output checks a deadline, :attr:`RenderLimits.seconds`
  plus :attr:`RenderLimits.seconds_per_message` per message away (from the
  rendering thread itself: no signals, no threads killed);
* **integers** -- at most :data:`MAX_INT_BITS` bits;
* **nesting** -- recursion too deep for Python, in compiling or rendering,
  is reported as such;
* **what a chat template never needs** is absent: ``lipsum``, ``cycler``,
  ``joiner``; the ``random``, ``wordwrap``, ``urlize`` and ``pprint``
  filters; ``{% include %}``, ``{% import %}`` and ``{% extends %}``; a
  source longer than :attr:`RenderLimits.max_source`.

The rendering itself is Hugging Face transformers' (``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, ``{% generation %}``, a ``tojson``
without HTML escaping, ``raise_exception``, ``strftime_now``), so a
template within the limits renders the same text.

How it is done: the template's syntax tree is rewritten before it is
compiled -- each loop's iterable goes through a counting iterator, list,
tuple and dict literals, slices and ``~`` through a measuring call, and
constant text through the output counter -- and the environment's hooks
(``call``, ``call_binop``, ``getattr``, ``getitem``, ``finalize``, the
filters) do the rest.  The limits of the rendering in progress live in a
thread-local, so renderings in different threads do not interfere.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import re
import sys
import threading
import time
import types
from collections.abc import ItemsView, KeysView, ValuesView

import attrs
import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace, pass_context
from jinja2.visitor import NodeTransformer

__all__ = ["ChatTemplateError", "ChatTemplateLimitError", "RenderLimits", "LimitedTemplate",
           "compile_template", "MAX_INT_BITS"]

#: the most bits an integer a template makes may have
MAX_INT_BITS = 8192


class ChatTemplateError(ValueError):
    """A chat template that is missing, malformed, or rejects the conversation."""


class ChatTemplateLimitError(ChatTemplateError):
    """A chat template that broke the sandbox's limits (size, memory, time,
    nesting) or used what the sandbox does not offer."""


def _positive(inst, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise ValueError(f"RenderLimits.{attribute.name} must be a positive number, "
                         f"got {value!r}")


def _positive_int(inst, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"RenderLimits.{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen
class RenderLimits:
    """Limits of one chat-template rendering (see the module docstring).

    Attributes
    ----------
    seconds : float
        Wall-clock time for one rendering of an empty conversation.
    seconds_per_message : float
        Time added to ``seconds`` per message.
    max_chars : int
        Size limit (characters) of any one value and of all output together,
        beyond 8 times the size of the inputs.
    max_bytes : int
        Memory for the values a rendering makes, beyond 32 bytes per
        character of the inputs.
    max_source : int
        The longest template source (characters) that is compiled.
    """

    seconds: float = attrs.field(default=0.25, validator=_positive)
    seconds_per_message: float = attrs.field(default=0.001, validator=_positive)
    max_chars: int = attrs.field(default=1 << 18, validator=_positive_int)
    max_bytes: int = attrs.field(default=32 << 20, validator=_positive_int)
    max_source: int = attrs.field(default=1 << 16, validator=_positive_int)


# -- the budget of the rendering in progress -------------------------------------

_local = threading.local()
_VIEWS = (KeysView, ValuesView, ItemsView)
_CONTAINERS = (list, tuple, dict, set, frozenset) + _VIEWS


class _Budget:
    """Sizes, memory, output and time left to one rendering."""

    def __init__(self, limits: RenderLimits, inputs, n_messages: int):
        self._weights: dict = {}
        self.max_value = None
        size = self.weight(inputs)
        self.max_value = limits.max_chars + 8 * size
        self.output_left = self.max_value
        self.max_bytes = self.bytes_left = limits.max_bytes + 32 * size
        self.seconds = limits.seconds + limits.seconds_per_message * n_messages
        self.deadline = time.monotonic() + self.seconds

    def tick(self):
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitError(
                f"the chat template ran for more than {self.seconds:g} s")

    def weight(self, x) -> int:
        """The length of ``x``'s text form, about (capped just above the size limit)."""
        if type(x) is str or isinstance(x, (str, bytes)):
            return len(x)
        if type(x) is int:
            return x.bit_length() // 3 + 1
        if not isinstance(x, _CONTAINERS):
            return 1
        key = id(x)
        hit = self._weights.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        cap = self.max_value
        total = len(x) + 2
        items = x.items() if isinstance(x, dict) else x
        for item in items:
            if isinstance(item, tuple) and isinstance(x, (dict, ItemsView)):
                total += self.weight(item[0]) + self.weight(item[1]) + 2
            else:
                total += self.weight(item)
            if cap is not None and total > cap:
                break
        self._weights[key] = (x, total)
        return total

    def need(self, size: int, what: str):
        """Refuse an operation whose result would have ``size`` characters."""
        if size > self.max_value:
            raise ChatTemplateLimitError(
                f"the chat template would make a value of {size} characters ({what}); the "
                f"limit is {self.max_value}")

    def new(self, value, what: str = "a value", count: bool = True):
        """Measure a value the template just made; returns it."""
        if type(value) is str and len(value) <= self.max_value:
            if count:
                self.bytes_left -= sys.getsizeof(value)
                if self.bytes_left < 0:
                    self._over_bytes()
            return value
        w = self.weight(value)
        if w > self.max_value:
            raise ChatTemplateLimitError(
                f"the chat template made {what} of more than {self.max_value} characters "
                f"(the limit)")
        if type(value) is int and value.bit_length() > MAX_INT_BITS:
            raise ChatTemplateLimitError(
                f"the chat template made an integer of {value.bit_length()} bits; the limit "
                f"is {MAX_INT_BITS}")
        if count:
            self.bytes_left -= sys.getsizeof(value)
            if self.bytes_left < 0:
                self._over_bytes()
        if isinstance(value, (types.GeneratorType, map, filter, zip, reversed)) \
                or type(value).__name__.endswith("iterator"):
            return _measured_items(self, value)
        return value

    def _over_bytes(self):
        raise ChatTemplateLimitError(f"the chat template made more than {self.max_bytes} bytes "
                                     "of values")

    def output(self, text: str) -> str:
        self.output_left -= len(text)
        if self.output_left < 0:
            raise ChatTemplateLimitError(
                f"the chat template wrote more than {self.max_value} characters")
        return text


def _budget() -> _Budget:
    b = getattr(_local, "budget", None)
    if b is None:
        raise RuntimeError("a limited template operation outside a rendering")
    return b


def _ticked() -> _Budget:
    """The rendering's budget, after a deadline check."""
    b = getattr(_local, "budget", None)
    if b is None:
        raise RuntimeError("a limited template operation outside a rendering")
    if time.monotonic() > b.deadline:
        b.tick()
    return b


def _measured_items(b: _Budget, it):
    for item in it:
        b.tick()
        yield b.new(item, "an item", count=False)


# -- functions the rewritten syntax tree calls ---------------------------------------
# (reached through ImportedName nodes, which a template cannot name or rebind)

def _loop_items(iterable):
    """A loop's iterable, one deadline check per iteration."""
    b = _budget()
    for item in iterable:
        b.tick()
        yield item


def _made(value):
    """A literal or slice the template made: measured."""
    b = _ticked()
    return b.new(value, "a literal or slice")


def _concat(*parts):
    """``a ~ b ~ ...``: each part's text, their total refused when too long."""
    b = _ticked()
    b.need(sum(map(b.weight, parts)), "a ~ concatenation")
    return b.new("".join(map(str, parts)), "a ~ concatenation")


_INTERNAL = frozenset((_loop_items, _made, _concat))
_MODULE = __name__


def _internal(fn) -> nodes.ImportedName:
    return nodes.ImportedName(f"{_MODULE}.{fn.__name__}")


class _Guard(NodeTransformer):
    """Rewrites a template's syntax tree so that the sandbox sees every step."""

    def _call(self, fn, args, lineno):
        return nodes.Call(_internal(fn), list(args), [], None, None, lineno=lineno)

    def visit_Output(self, node):
        self.generic_visit(node)
        # constant text goes through finalize too, so that it is counted
        node.nodes = [nodes.Const(n.data, lineno=n.lineno) if isinstance(n, nodes.TemplateData)
                      else n for n in node.nodes]
        return node

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = self._call(_loop_items, [node.iter], node.lineno)
        return node

    def _made(self, node):
        self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load":
            return node
        return self._call(_made, [node], node.lineno)

    visit_List = visit_Tuple = visit_Dict = _made

    def visit_Getitem(self, node):
        if isinstance(node.arg, nodes.Slice):
            return self._made(node)
        self.generic_visit(node)
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return self._call(_concat, node.nodes, node.lineno)


# -- size checks made before an operation runs ----------------------------------------

_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[+\- ]?z?#?0?(\d*)[_,]?(?:\.(\d+))?")


def _percent_size(b: _Budget, fmt: str, args) -> int:
    """A bound on the length of ``fmt % args``."""
    size = len(fmt)
    starred = False
    for m in _PERCENT.finditer(fmt):
        for g in m.group(1, 2):
            if g == "*":
                starred = True
            elif g:
                size += int(g)
    values = args if isinstance(args, tuple) else (args,)
    if starred:
        size += sum(abs(v) for v in values if isinstance(v, int))
    return size + sum(map(b.weight, values))


def _check_binop(b: _Budget, op: str, left, right):
    if op == "*":
        if isinstance(left, int) and not isinstance(right, (int, float)):
            left, right = right, left
        if isinstance(right, int) and isinstance(left, (str, bytes, list, tuple)):
            b.need(b.weight(left) * max(right, 0), "a repetition with *")
        elif isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
                raise ChatTemplateLimitError(f"the chat template would make an integer of "
                                             f"more than {MAX_INT_BITS} bits (with *)")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > MAX_INT_BITS:
                raise ChatTemplateLimitError(f"the chat template would make an integer of "
                                             f"more than {MAX_INT_BITS} bits (with **)")
    elif op == "+":
        if isinstance(left, (str, bytes, list, tuple)):
            b.need(b.weight(left) + b.weight(right), "a concatenation with +")
    elif op == "%":
        if isinstance(left, str):
            b.need(_percent_size(b, left, right), "a % format")


def _check_width(b: _Budget, s, width, *args):
    """``center``/``ljust``/``rjust``/``zfill``: a result of ``width``."""
    if isinstance(width, int):
        b.need(max(len(s) if isinstance(s, (str, bytes)) else 0, width), f"a width of {width}")


def _check_replace(b: _Budget, s, old, new, count=-1):
    if isinstance(s, (str, bytes)) and isinstance(old, type(s)) and isinstance(new, type(s)):
        n = s.count(old)
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        b.need(len(s) + n * (len(new) - len(old)), "a replace()")


def _check_join(b: _Budget, sep, items) -> list:
    items = list(items)
    b.need(sum(map(b.weight, items)) + b.weight(sep) * max(len(items) - 1, 0), "a join")
    return items


def _run_check(check, *args, **kwargs):
    # arguments the checked function would refuse are left for it to refuse
    try:
        check(*args, **kwargs)
    except TypeError:
        pass


def _check_translate(b: _Budget, s, table):
    longest = 1
    if isinstance(table, dict):
        longest = max([len(v) for v in table.values() if isinstance(v, str)] + [1])
    b.need(len(s) * longest, "a translate()")


def _check_expandtabs(b: _Budget, s, tabsize=8):
    if isinstance(tabsize, int):
        b.need(len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(tabsize, 0),
               "an expandtabs()")


def _check_to_bytes(b: _Budget, n, length=1, *args, **kw):
    if isinstance(length, int):
        b.need(length, "an int.to_bytes()")


# builtin method name -> check(budget, self, *args, **kwargs)
_METHOD_CHECKS = {
    "center": _check_width, "ljust": _check_width, "rjust": _check_width, "zfill": _check_width,
    "expandtabs": _check_expandtabs, "replace": _check_replace, "translate": _check_translate,
    "to_bytes": _check_to_bytes,
}


class _LimitedFormatter(SandboxedFormatter):
    """``str.format`` with its fields' widths and total size measured."""

    def __init__(self, env, budget):
        super().__init__(env)
        self._budget = budget
        self._size = 0

    def format_field(self, value, format_spec):
        b = self._budget
        b.tick()
        m = _FORMAT_SPEC.match(format_spec)
        width = int(m.group(1) or 0)
        precision = int(m.group(2) or 0)
        self._size += width + precision + b.weight(value)
        b.need(self._size, "a str.format()")
        return super().format_field(value, format_spec)


# -- filters ---------------------------------------------------------------------------

def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson (json.dumps without HTML escaping), written out
    # piece by piece so that its length is counted as it grows
    b = _budget()
    if isinstance(indent, int) and not isinstance(indent, bool) and indent > 64:
        raise ChatTemplateLimitError(f"tojson indent {indent} is over the limit of 64")
    if isinstance(indent, str) and len(indent) > 64:
        raise ChatTemplateLimitError(f"a tojson indent of {len(indent)} characters is over "
                                     "the limit of 64")
    enc = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                           sort_keys=sort_keys)
    parts, size = [], 0
    for i, chunk in enumerate(enc.iterencode(value)):
        size += len(chunk)
        if size > b.max_value:
            b.need(size, "a tojson")
        if not i & 1023:
            b.tick()
        parts.append(chunk)
    return "".join(parts)


def _check_filter_indent(b, s, width=4, first=False, blank=False):
    if isinstance(s, str):
        per_line = width if isinstance(width, int) else len(width) if isinstance(width, str) else 0
        b.need(len(s) + (s.count("\n") + 1) * max(per_line, 0), "an indent")


def _check_filter_format(b, value, *args, **kwargs):
    if isinstance(value, str):
        b.need(_percent_size(b, value, tuple(args) if args else kwargs), "a format")


def _check_filter_batch(b, value, linecount, fill_with=None):
    if isinstance(linecount, int):
        b.need(linecount, "a batch")


def _check_filter_slice(b, value, slices, fill_with=None):
    if isinstance(slices, int):
        b.need(slices, "a slice")


def _check_filter_sum(b, iterable, attribute=None, start=0):
    if not isinstance(start, (int, float)):
        raise ChatTemplateLimitError(f"sum() starts from numbers only, got "
                                     f"{type(start).__name__}")


def _check_filter_int(b, value, default=0, base=10):
    if isinstance(value, str) and len(value) > 5000:
        raise ChatTemplateLimitError(f"int() of a string of {len(value)} characters")


def _check_filter_center(b, s, width=80):
    _check_width(b, s, width)


def _check_filter_replace(b, s, old, new, count=None):
    _check_replace(b, s, old, new, -1 if count is None else count)


# filter name -> check(budget, value, *args, **kwargs) (no context argument)
_FILTER_CHECKS = {
    "center": _check_filter_center, "indent": _check_filter_indent,
    "format": _check_filter_format, "replace": _check_filter_replace,
    "batch": _check_filter_batch, "slice": _check_filter_slice, "sum": _check_filter_sum,
    "int": _check_filter_int,
}
_DROPPED_FILTERS = ("random", "wordwrap", "urlize", "pprint")


def _limited_filter(name, func):
    """``func`` with a deadline check, its check from _FILTER_CHECKS, its
    result measured; passed the context so that it is never run at compile
    time."""
    # what jinja passes first (set by its pass_context & co. decorators)
    pass_arg = getattr(getattr(func, "jinja_pass_arg", None), "name", None)
    check = _FILTER_CHECKS.get(name)
    is_join = name == "join"

    @pass_context
    @functools.wraps(func)
    def limited(context, *args, **kwargs):
        b = _ticked()
        if check is not None:
            _run_check(check, b, *args, **kwargs)
        if is_join and args:
            sep = kwargs.get("d", args[1] if len(args) > 1 else "")
            args = (_check_join(b, sep, args[0]),) + args[1:]
        if pass_arg == "context":
            out = func(context, *args, **kwargs)
        elif pass_arg == "eval_context":
            out = func(context.eval_ctx, *args, **kwargs)
        elif pass_arg == "environment":
            out = func(context.environment, *args, **kwargs)
        else:
            out = func(*args, **kwargs)
        return b.new(out, f"a value (filter {name})")

    return limited


# -- globals ---------------------------------------------------------------------------

class _Namespace(Namespace):
    """``namespace()`` whose text form does not list its attributes (they are
    measured when set; a namespace of namespaces must not print as a tree)."""

    def __repr__(self) -> str:
        return "<namespace>"


def _unavailable(name):
    def refuse(*args, **kwargs):
        raise ChatTemplateLimitError(f"{name}() is not available to chat templates")
    refuse.__name__ = name
    return refuse


def raise_exception(message):
    raise ChatTemplateError(f"the chat template rejected the conversation: {message}")


def strftime_now(fmt):
    if not isinstance(fmt, str) or len(fmt) > 256:
        raise ChatTemplateLimitError("strftime_now() takes a date format of at most 256 "
                                     "characters")
    return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks the
    assistant's text with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


# -- the environment -------------------------------------------------------------------

class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every operation measured (see the module docstring)."""

    intercepted_binops = frozenset(("+", "-", "*", "/", "//", "%", "**"))

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=self._finalize,
                         extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        for name in _DROPPED_FILTERS:
            self.filters.pop(name, None)
        self.filters["tojson"] = _tojson
        self.filters = {name: _limited_filter(name, f) for name, f in self.filters.items()}
        for name in ("lipsum", "cycler", "joiner"):
            self.globals[name] = _unavailable(name)
        self.globals["namespace"] = _Namespace
        self.globals["raise_exception"] = raise_exception
        self.globals["strftime_now"] = strftime_now

    @staticmethod
    @pass_context
    def _finalize(context, value):
        b = _ticked()
        if not isinstance(value, str):
            b.need(b.weight(value), "output")
            value = str(value)
        return b.output(value)

    def call_binop(self, context, operator, left, right):
        b = _ticked()
        _check_binop(b, operator, left, right)
        return b.new(self.binop_table[operator](left, right), f"a value (with {operator})")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        b = _ticked()
        if type(__obj) is types.FunctionType and __obj in _INTERNAL:
            return __obj(*args)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes, int)) and not isinstance(owner, bool):
            name = getattr(__obj, "__name__", "")
            check = _METHOD_CHECKS.get(name)
            if check is not None:
                _run_check(check, b, owner, *args, **kwargs)
            elif name == "join" and args and isinstance(owner, (str, bytes)):
                args = (_check_join(b, owner, args[0]),) + args[1:]
        return b.new(super().call(__context, __obj, *args, **kwargs), "a value (a call)")

    def getattr(self, obj, attribute):
        b = getattr(_local, "budget", None)
        if b is not None:
            b.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        b = getattr(_local, "budget", None)
        if b is not None:
            b.tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value):
        # jinja's wrapper for str.format / format_map, with _LimitedFormatter
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) \
                or value.__name__ not in ("format", "format_map"):
            return None
        owner = value.__self__
        if not isinstance(owner, str):
            return None
        if not type(owner) is str:        # Markup: jinja's own escaping formatter
            return super().wrap_str_format(value)
        is_format_map = value.__name__ == "format_map"
        env = self

        def wrapper(*args, **kwargs):
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                kwargs, args = args[0], ()
            return _LimitedFormatter(env, _budget()).vformat(owner, args, kwargs)

        return functools.update_wrapper(wrapper, value)


_FORBIDDEN = {nodes.Extends: "{% extends %}", nodes.Include: "{% include %}",
              nodes.Import: "{% import %}", nodes.FromImport: "{% from ... import %}"}


@attrs.frozen
class LimitedTemplate:
    """A compiled chat template; :meth:`render` it under :class:`RenderLimits`."""

    source: str
    _template: jinja2.Template = attrs.field(repr=False)

    def render(self, variables: dict, limits: RenderLimits | None = None) -> str:
        """Render with ``variables`` (``messages``, ``bos_token``, ...).

        Raises
        ------
        ChatTemplateLimitError
            The template broke a limit.
        ChatTemplateError
            The template failed otherwise, or rejected the conversation.
        """
        limits = RenderLimits() if limits is None else limits
        previous = getattr(_local, "budget", None)
        try:
            messages = variables.get("messages")
            n = len(messages) if isinstance(messages, (list, tuple)) else 0
            _local.budget = _Budget(limits, tuple(variables.values()), n)
            return self._template.render(variables)
        except ChatTemplateError as e:
            raise type(e)(f"{e}{_where(e)}") from None
        except RecursionError:
            raise ChatTemplateLimitError("the chat template nests or recurses too deeply") \
                from None
        except MemoryError:
            raise ChatTemplateLimitError("the chat template ran out of memory") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}{_where(e)}") from None
        except Exception as e:  # an operation the template applies to the wrong values
            raise ChatTemplateError(
                f"chat template failed: {type(e).__name__}: {e}{_where(e)}") from None
        finally:
            _local.budget = previous


def _where(e: BaseException) -> str:
    """`` (template line N)`` from an exception's traceback, if it passed a template line."""
    line = None
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return "" if line is None or "line" in str(e) else f" (template line {line})"


_ENV = _LimitedEnvironment()


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> LimitedTemplate:
    try:
        tree = _ENV.parse(source)
        for kind, tag in _FORBIDDEN.items():
            found = next(tree.find_all(kind), None)
            if found is not None:
                raise ChatTemplateLimitError(
                    f"the chat template uses {tag} (line {found.lineno}), which a chat "
                    "template cannot: it has no other templates")
        tree = _Guard().visit(tree)
        tree.set_environment(_ENV)
        return LimitedTemplate(source, _ENV.from_string(tree))
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: "
                                f"{e.message}") from None
    except (RecursionError, MemoryError, SyntaxError) as e:
        # Python's parser and compiler: "too many statically nested blocks",
        # "too many levels of indentation", a recursion limit
        what = e.msg if isinstance(e, SyntaxError) else type(e).__name__
        raise ChatTemplateLimitError(f"the chat template nests too deeply to compile ({what})") \
            from None


def compile_template(source: str, limits: RenderLimits | None = None) -> LimitedTemplate:
    """Compile a chat template for the sandbox (cached by source).

    Raises
    ------
    ChatTemplateError
        A syntax error.
    ChatTemplateLimitError
        A source longer than ``limits.max_source``, nesting too deep to
        compile, or ``{% include %}``-like tags.
    """
    limits = RenderLimits() if limits is None else limits
    if len(source) > limits.max_source:
        raise ChatTemplateLimitError(f"the chat template has {len(source)} characters; the "
                                     f"limit is {limits.max_source}")
    return _compile(source)

