"""Chat templates: compiling and rendering a model's Jinja chat template the way transformers
does (sandboxed, trim_blocks, lstrip_blocks, ``raise_exception``, ``strftime_now``, a
``tojson`` that keeps non-ASCII text), under a budget.

A chat template comes from the model file, so it is untrusted code. Jinja's sandbox already
stops attribute escapes (``__class__``, ``__globals__``); on top of it every render has a budget
(:class:`RenderLimits`): loop iterations plus calls, characters produced (everything output,
including text captured by ``{% set %}`` blocks and macros), the size of any one string or list
built by ``*``, ``+``, ``~``, ``%``, ``format``, ``join``, ``replace``, ``ljust``, ``center``,
``indent``..., checked *before* it is built, and a wall-clock deadline checked at each of those
points. The hooks are put into the compiled template by rewriting its syntax tree (every
``for`` iterates through a counting wrapper, every output goes through a counter), so no
template can skip them, and any exception a template raises becomes MTPEngineError naming the
field the template came from.

jinja2 is imported only when a template is actually used, so that loading a model for plain
text generation does not pay for it.
"""
from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from dataclasses import dataclass
from typing import Any

from .errors import MTPEngineError

__all__ = ["compile_chat_template", "render_chat_template", "RenderLimits", "MAX_TEMPLATE_CHARS"]

# A template source longer than this is refused before compiling: real chat templates are 1-20 KB.
MAX_TEMPLATE_CHARS = 1 << 20


@dataclass(frozen=True)
class RenderLimits:
    """The budget of one render. Real templates use a tiny part of it (Qwen3's: ~200 steps and
    ~2 KB for a short chat): the limits only stop templates that would hang or fill memory.

    * ``max_steps``: loop iterations, calls (filters, methods, macros, functions) and attribute
      or item lookups;
    * ``max_chars``: characters produced in all (output and captured text), and the size of any
      one string or list the template builds; the budget grows by ``chars_per_input_char`` for
      every character of the messages and variables, so long chats always fit;
    * ``timeout_s``: wall-clock seconds.
    """

    max_steps: int = 1_000_000
    max_chars: int = 4_000_000
    chars_per_input_char: int = 8
    timeout_s: float = 5.0


class _TemplateRaised(Exception):
    """raise_exception() called from a chat template."""


class _OverBudget(Exception):
    """A render went past its RenderLimits."""


class _Budget:
    def __init__(self, limits: RenderLimits, input_chars: int):
        self.steps_left = limits.max_steps
        self.max_chars = limits.max_chars + limits.chars_per_input_char * input_chars
        self.chars_left = self.max_chars
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s

    def _clock(self) -> None:
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"rendering took longer than the limit of {self.limits.timeout_s:g} s")

    def step(self, n: int = 1) -> None:
        self.steps_left -= n
        if self.steps_left & 63 == 0 or self.steps_left < 0:  # the clock every 64 steps: a step is ~0.1 us
            if self.steps_left < 0:
                raise _OverBudget(f"more than {self.limits.max_steps} steps (loop iterations, calls and lookups)")
            self._clock()

    def emit(self, n: int) -> None:
        self.chars_left -= n
        if self.chars_left < 0:
            raise _OverBudget(f"more than {self.max_chars} characters of output")

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise _OverBudget(f"{what} would build a value of {n} characters or items, more than the limit of {self.max_chars}")


_CURRENT: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("mtp_template_budget", default=None)


def _budget() -> _Budget | None:
    return _CURRENT.get()


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    b = _budget()
    if b is None:
        return encoder.encode(value)
    # streamed, so that an indent of 10^6 on a nested value is refused before its text exists
    parts, size = [], 0
    for chunk in encoder.iterencode(value):
        size += len(chunk)
        b.size(size, "the filter tojson")
        parts.append(chunk)
    return "".join(parts)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


_SIZED = (str, list, tuple, dict)


def _len(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple, dict)) else 0


_DIGITS = re.compile(r"\d+")


def _check_ints(b: _Budget, args: Any, what: str) -> None:
    """A width, count or padding argument above the size limit would build a value that large
    (``ljust``, ``center``, ``zfill``, ``indent``, ``batch``...): refused before the call."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and a > b.max_chars:
            b.size(a, what)


def _check_format_string(b: _Budget, fmt: Any, what: str) -> None:
    # widths and precisions written into a format string ('%9999999999s', '{:>9999999999}')
    if isinstance(fmt, str) and len(fmt) < 1 << 16:
        for d in _DIGITS.findall(fmt):
            if len(d) > 7 or int(d) > b.max_chars:
                b.size(int(d[:30]), what)


def _joined_size(sep: Any, items: Any) -> int:
    if isinstance(items, (list, tuple)):
        return sum(_len(x) if isinstance(x, str) else 1 for x in items) + _len(sep) * max(len(items) - 1, 0)
    return 0


def _replaced_size(s: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


def _guard_filter(name: str, f: Any) -> Any:
    from jinja2.environment import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    special = (Context, EvalContext, Environment)

    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        b = _CURRENT.get()
        if b is not None and (len(args) > 1 or kwargs):  # a filter without parameters cannot inflate
            b.step()
            rest = [a for a in args if not isinstance(a, special)]
            value, params = (rest[0], rest[1:]) if rest else (None, [])
            what = f"the filter {name}"
            _check_ints(b, list(params) + list(kwargs.values()), what)
            if name == "join":
                b.size(_joined_size(params[0] if params else kwargs.get("d", ""),
                                    value if isinstance(value, (list, tuple)) else []), what)
            elif name == "replace" and len(params) >= 2:
                b.size(_replaced_size(value, params[0], params[1], params[2] if len(params) > 2 else -1), what)
            elif name == "indent" and isinstance(value, str):
                width = params[0] if params else kwargs.get("width", 4)
                b.size(len(value) + (value.count("\n") + 1) * (_len(width) or (width if isinstance(width, int) else 0)),
                       what)
            elif name == "format":
                _check_format_string(b, value, what)
        out = f(*args, **kwargs)
        if b is not None:
            b.step()
            if type(out) in _SIZED and len(out) > b.max_chars:
                b.size(len(out), f"the filter {name}")
        return out

    return guarded


def _jinja_env() -> Any:
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    _getattr, _getitem = ImmutableSandboxedEnvironment.getattr, ImmutableSandboxedEnvironment.getitem

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            tree = super()._parse(source, name, filename)
            return _instrument(tree, nodes)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            b = _CURRENT.get()
            if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept cheap
                if b is not None and len(left) + len(right) > b.max_chars:
                    b.size(len(left) + len(right), "the operator +")
                return left + right
            if b is not None:
                what = f"the operator {operator}"
                if operator == "*":
                    for seq, n in ((left, right), (right, left)):
                        if isinstance(n, int) and isinstance(seq, (str, list, tuple)):
                            b.size(len(seq) * max(n, 0), what)
                    if isinstance(left, int) and isinstance(right, int):
                        b.size((abs(left).bit_length() + abs(right).bit_length()) // 4, what)
                elif operator == "**":
                    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                        b.size(right * abs(left).bit_length() // 4, what)
                elif operator == "+":
                    if isinstance(left, (str, list, tuple)) and type(left) is type(right):
                        b.size(len(left) + len(right), what)
                elif operator == "%" and isinstance(left, str):
                    _check_format_string(b, left, what)
                    _check_ints(b, right if isinstance(right, tuple) else (right,), what)
            out = super().call_binop(context, operator, left, right)
            if b is not None:
                b.size(_len(out), f"the operator {operator}")
            return out

        # attribute and item lookups count as steps too: a filter such as selectattr can walk a
        # million-character string without a loop or a call of the template's own
        def getattr(self, obj: Any, attribute: str) -> Any:
            b = _CURRENT.get()
            if b is not None:
                b.step()
            return _getattr(self, obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            b = _CURRENT.get()
            if b is not None:
                b.step()
            return _getitem(self, obj, argument)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            b = _budget()
            if b is not None:
                b.step()
                target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
                owner = getattr(target, "__self__", None)
                if isinstance(owner, str):
                    what = f"str.{getattr(target, '__name__', '?')}"
                    _check_ints(b, list(args) + list(kwargs.values()), what)
                    name = getattr(target, "__name__", "")
                    if name in ("format", "format_map"):
                        _check_format_string(b, owner, what)
                    elif name == "join" and args:
                        b.size(_joined_size(owner, args[0]), what)
                    elif name == "replace" and len(args) >= 2:
                        b.size(_replaced_size(owner, *args[:3]), what)
                    elif name == "expandtabs":
                        size = args[0] if args else kwargs.get("tabsize", 8)
                        b.size(len(owner) + owner.count("\t") * (size if isinstance(size, int) else 8), what)
            out = super().call(__context, __obj, *args, **kwargs)
            if b is not None:
                b.size(_len(out), "a call")
            return out

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    # the hooks _instrument puts in: filters, because a filter is called directly where a call
    # goes through the sandbox's checks; pass_context keeps Jinja from running them at compile time
    for name, hook in (("mtp_loop", _loop), ("mtp_out", _out), ("mtp_emit", _emit), ("mtp_concat", _concat)):
        env.filters[name] = jinja2.pass_context(hook)
    # lipsum(n) writes n paragraphs in one call: no chat template needs it
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _loop(_context: Any, iterable: Any) -> Any:
    b = _CURRENT.get()
    if b is None:
        yield from iterable
        return
    for x in iterable:
        b.step()
        yield x


def _out(_context: Any, value: Any) -> Any:
    b = _CURRENT.get()
    if b is not None:
        b.chars_left -= len(value) if type(value) is str else len(str(value))
        if b.chars_left < 0:
            b.emit(0)
    return value


def _emit(_context: Any, _value: Any, n: int) -> str:
    b = _budget()
    if b is not None:
        b.emit(n)
    return ""


def _concat(_context: Any, *parts: Any) -> str:
    strings = [p if isinstance(p, str) else str(p) for p in parts]
    b = _budget()
    if b is not None:
        b.size(sum(map(len, strings)), "the operator ~")
    return "".join(strings)


def _instrument(tree: Any, nodes: Any) -> Any:
    """Routes every loop, output and ``~`` of the template through the budget hooks."""
    from jinja2.visitor import NodeTransformer

    def hook(name: str, value: Any, *args: Any, lineno: int) -> Any:
        return nodes.Filter(value, name, list(args), [], None, None, lineno=lineno)

    class Instrument(NodeTransformer):
        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = hook("mtp_loop", node.iter, lineno=node.lineno)
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            return hook("mtp_concat", node.nodes[0], *node.nodes[1:], lineno=node.lineno)

        def visit_Output(self, node: Any) -> Any:
            node = self.generic_visit(node)
            literal = sum(len(c.data) for c in node.nodes if isinstance(c, nodes.TemplateData))
            wrapped = [c if isinstance(c, nodes.TemplateData) else hook("mtp_out", c, lineno=c.lineno)
                       for c in node.nodes]
            head = [hook("mtp_emit", nodes.Const(""), nodes.Const(literal), lineno=node.lineno)] if literal else []
            node.nodes = head + wrapped
            return node

    return Instrument().visit(tree)


def compile_chat_template(source: str, *, file: str | None, field: str) -> Any:
    """The compiled Jinja template of ``source``; MTPEngineError (naming ``file`` and
    ``field``) when it does not compile or is longer than MAX_TEMPLATE_CHARS."""
    if not isinstance(source, str):
        raise MTPEngineError(f"expected a string, found {type(source).__name__}", file=file, field=field)
    if len(source) > MAX_TEMPLATE_CHARS:
        raise MTPEngineError(f"chat template of {len(source)} characters: expected at most {MAX_TEMPLATE_CHARS}",
                             file=file, field=field)
    env = _jinja_env()
    # Jinja folds constant filter calls at compile time ('x'|center(5000000000)): under a budget, a
    # fold that goes past it is left to the render, which refuses it
    token = _CURRENT.set(_Budget(RenderLimits(), 0))
    try:
        return env.from_string(source)
    except Exception as e:  # TemplateSyntaxError, and RecursionError/MemoryError on absurd nesting
        raise MTPEngineError(f"invalid chat template: {_one_line(e)}", file=file, field=field) from None
    finally:
        _CURRENT.reset(token)


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = f"{e}" or type(e).__name__
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit] + "..."


def _input_chars(messages: Any, variables: dict, max_nodes: int = 100_000) -> int:
    """Characters of text in the messages and variables (walked, at most `max_nodes` values)."""
    total, seen = 0, 0
    stack: list = list(variables.values())
    for m in messages if isinstance(messages, (list, tuple)) else [messages]:
        if type(m) is dict and type(m.get("content")) is str and len(m) <= 3:  # most messages: one pass
            total += len(m["content"]) + sum(len(k) + (len(v) if type(v) is str else 8) for k, v in m.items())
            seen += 1
        else:
            stack.append(m)
    while stack and seen < max_nodes:
        o = stack.pop()
        seen += 1
        if isinstance(o, str):
            total += len(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
            stack.extend(k for k in o if isinstance(k, str))
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        else:
            total += 8
    return total


def render_chat_template(
    template: Any,
    messages: list[dict],
    add_generation_prompt: bool,
    variables: dict[str, Any],
    *,
    file: str | None,
    field: str,
    limits: RenderLimits | None = None,
) -> str:
    """Render a template from :func:`compile_chat_template` with ``messages``,
    ``add_generation_prompt`` and the extra ``variables``, within ``limits`` (default
    :class:`RenderLimits`).

    Raises MTPEngineError (naming ``file`` and ``field``) when the template calls
    ``raise_exception``, goes past its budget, or fails in any other way while rendering.
    """
    import jinja2

    budget = _Budget(limits or RenderLimits(), _input_chars(messages, variables))
    token = _CURRENT.set(budget)
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except _TemplateRaised as e:
        raise MTPEngineError(f"chat template refused the input: {_one_line(e)}", file=file, field=field) from None
    except _OverBudget as e:
        raise MTPEngineError(f"chat template stopped: {e}", file=file, field=field) from None
    except jinja2.TemplateError as e:
        raise MTPEngineError(f"chat template failed: {_one_line(e)}", file=file, field=field) from None
    except RecursionError:
        raise MTPEngineError("chat template failed: recursion too deep", file=file, field=field) from None
    except MemoryError:
        raise MTPEngineError("chat template failed: out of memory", file=file, field=field) from None
    except Exception as e:  # ZeroDivisionError, TypeError, OverflowError...: the template's fault
        raise MTPEngineError(f"chat template failed: {type(e).__name__}: {_one_line(e)}",
                             file=file, field=field) from None
    finally:
        _CURRENT.reset(token)
