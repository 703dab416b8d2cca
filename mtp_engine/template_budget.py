"""The budget of one chat-template render (`RenderLimits`) and the hooks that enforce it.

`chat_template._jinja_env` builds the sandbox that calls these: `instrument` rewrites a parsed
template so that every loop, output and ``~`` goes through the hook filters, and the sandbox's
operator, call and lookup overrides and the guarded filters check sizes before values are built.
The budget of the render in progress lives in a context variable, so renders in several threads
each have their own. Nothing here imports jinja2 at module level.
"""
from __future__ import annotations

import contextvars
import functools
import re
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["RenderLimits", "OverBudget", "Budget", "CURRENT", "instrument", "guard_filter", "HOOKS",
           "input_chars", "check_ints", "check_format_string", "joined_size", "replaced_size", "SIZED"]


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


class OverBudget(Exception):
    """A render went past its RenderLimits."""


class Budget:
    """What is left of one render's RenderLimits; `input_chars` widens the character allowance."""

    def __init__(self, limits: RenderLimits, input_chars: int):
        self.steps_left = limits.max_steps
        self.max_chars = limits.max_chars + limits.chars_per_input_char * input_chars
        self.chars_left = self.max_chars
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s

    def _clock(self) -> None:
        if time.monotonic() > self.deadline:
            raise OverBudget(f"rendering took longer than the limit of {self.limits.timeout_s:g} s")

    def step(self, n: int = 1) -> None:
        self.steps_left -= n
        if self.steps_left & 63 == 0 or self.steps_left < 0:  # the clock every 64 steps: a step is ~0.1 us
            if self.steps_left < 0:
                raise OverBudget(f"more than {self.limits.max_steps} steps (loop iterations, calls and lookups)")
            self._clock()

    def emit(self, n: int) -> None:
        self.chars_left -= n
        if self.chars_left < 0:
            raise OverBudget(f"more than {self.max_chars} characters of output")

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise OverBudget(f"{what} would build a value of {n} characters or items, more than the limit of {self.max_chars}")


CURRENT: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("mtp_template_budget", default=None)


def current() -> Budget | None:
    """The budget of the render in progress in this thread / context, or None."""
    return CURRENT.get()


SIZED = (str, list, tuple, dict)


def _len(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple, dict)) else 0


_DIGITS = re.compile(r"\d+")


def check_ints(b: Budget, args: Any, what: str) -> None:
    """A width, count or padding argument above the size limit would build a value that large
    (``ljust``, ``center``, ``zfill``, ``indent``, ``batch``...): refused before the call."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and a > b.max_chars:
            b.size(a, what)


def check_format_string(b: Budget, fmt: Any, what: str) -> None:
    # widths and precisions written into a format string ('%9999999999s', '{:>9999999999}')
    if isinstance(fmt, str) and len(fmt) < 1 << 16:
        for d in _DIGITS.findall(fmt):
            if len(d) > 7 or int(d) > b.max_chars:
                b.size(int(d[:30]), what)


def joined_size(sep: Any, items: Any) -> int:
    if isinstance(items, (list, tuple)):
        return sum(_len(x) if isinstance(x, str) else 1 for x in items) + _len(sep) * max(len(items) - 1, 0)
    return 0


def replaced_size(s: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


def guard_filter(name: str, f: Any) -> Any:
    from jinja2.environment import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    special = (Context, EvalContext, Environment)

    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        b = CURRENT.get()
        if b is not None and (len(args) > 1 or kwargs):  # a filter without parameters cannot inflate
            b.step()
            rest = [a for a in args if not isinstance(a, special)]
            value, params = (rest[0], rest[1:]) if rest else (None, [])
            what = f"the filter {name}"
            check_ints(b, list(params) + list(kwargs.values()), what)
            if name == "join":
                b.size(joined_size(params[0] if params else kwargs.get("d", ""),
                                    value if isinstance(value, (list, tuple)) else []), what)
            elif name == "replace" and len(params) >= 2:
                b.size(replaced_size(value, params[0], params[1], params[2] if len(params) > 2 else -1), what)
            elif name == "indent" and isinstance(value, str):
                width = params[0] if params else kwargs.get("width", 4)
                b.size(len(value) + (value.count("\n") + 1) * (_len(width) or (width if isinstance(width, int) else 0)),
                       what)
            elif name == "format":
                check_format_string(b, value, what)
        out = f(*args, **kwargs)
        if b is not None:
            b.step()
            if type(out) in SIZED and len(out) > b.max_chars:
                b.size(len(out), f"the filter {name}")
        return out

    return guarded


def _loop(_context: Any, iterable: Any) -> Any:
    b = CURRENT.get()
    if b is None:
        yield from iterable
        return
    for x in iterable:
        b.step()
        yield x


def _out(_context: Any, value: Any) -> Any:
    b = CURRENT.get()
    if b is not None:
        b.chars_left -= len(value) if type(value) is str else len(str(value))
        if b.chars_left < 0:
            b.emit(0)
    return value


def _emit(_context: Any, _value: Any, n: int) -> str:
    b = current()
    if b is not None:
        b.emit(n)
    return ""


def _concat(_context: Any, *parts: Any) -> str:
    strings = [p if isinstance(p, str) else str(p) for p in parts]
    b = current()
    if b is not None:
        b.size(sum(map(len, strings)), "the operator ~")
    return "".join(strings)


def instrument(tree: Any, nodes: Any) -> Any:
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


def input_chars(messages: Any, variables: dict, max_nodes: int = 100_000) -> int:
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


# the hook filters `instrument` puts into templates, by name
HOOKS = {"mtp_loop": _loop, "mtp_out": _out, "mtp_emit": _emit, "mtp_concat": _concat}
