"""The budget of one chat-template render (`RenderLimits`, `Budget`) and the size rules the
hooks apply: what a value would be before it is built (``check_ints``, ``joined_size``,
``replaced_size``, ``check_str_call``...), and the character count of a render's input.

`template_hooks` puts the checks into templates; `chat_template` builds the sandbox. The budget of
the render in progress lives in a context variable, so renders in several threads each have their
own. Nothing here imports jinja2.
"""
from __future__ import annotations

import contextvars
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RenderLimits", "OverBudget", "Budget", "CURRENT", "input_chars", "check_ints", "check_format_string",
           "joined_size", "replaced_size", "SIZED", "check_str_call", "INFLATING_METHODS", "NON_GROWING_METHODS",
           "PLAIN_OWNERS"]


@dataclass(frozen=True)
class RenderLimits:
    """The budget of one render. Real templates use a tiny part of it (Qwen3's: ~200 steps and
    ~2 KB for a short chat): the limits only stop templates that would hang or fill memory.

    * ``max_steps``: loop iterations, calls (filters, methods, macros, functions) and the items
      that filters such as ``selectattr``, ``map`` or ``sort`` walk;
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
    """What is left of one render's RenderLimits.

    `input_chars` (a count, or a function that measures it) widens the character allowance by
    ``chars_per_input_char`` per character of input. A function is called only the first time a
    character limit is reached, so renders that stay under the base limit never walk their input.
    """

    __slots__ = ("steps_left", "max_chars", "chars_left", "limits", "deadline", "_pending")

    def __init__(self, limits: RenderLimits, input_chars: int | Callable[[], int]):
        self.steps_left = limits.max_steps
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self._pending: Callable[[], int] | None = None
        self.max_chars = limits.max_chars
        if callable(input_chars):
            self._pending = input_chars
        else:
            self.max_chars += limits.chars_per_input_char * input_chars
        self.chars_left = self.max_chars

    def _widen(self) -> bool:
        """Adds the input's share to the character allowance, once; True if it grew."""
        if self._pending is None:
            return False
        measure, self._pending = self._pending, None
        extra = self.limits.chars_per_input_char * measure()
        self.max_chars += extra
        self.chars_left += extra
        return extra > 0

    def _clock(self) -> None:
        if time.monotonic() > self.deadline:
            raise OverBudget(f"rendering took longer than the limit of {self.limits.timeout_s:g} s")

    def check(self) -> None:
        """Raises if the steps are spent, else checks the clock (hooks call it every 64 steps)."""
        if self.steps_left < 0:
            raise OverBudget(f"more than {self.limits.max_steps} steps (loop iterations, calls and items walked by filters)")
        self._clock()

    def step(self, n: int = 1) -> None:
        self.steps_left -= n
        # the clock every 64 single steps (a step is ~0.1 us), and at every bulk charge
        if n > 1 or self.steps_left & 63 == 0 or self.steps_left < 0:
            self.check()

    def emit(self, n: int) -> None:
        self.chars_left -= n
        if self.chars_left < 0 and not (self._widen() and self.chars_left >= 0):
            raise OverBudget(f"more than {self.max_chars} characters of output")

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars and not (self._widen() and n <= self.max_chars):
            raise OverBudget(f"{what} would build a value of {n} characters or items, more than the limit of {self.max_chars}")


CURRENT: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("mtp_template_budget", default=None)


def current() -> Budget | None:
    """The budget of the render in progress in this thread / context, or None."""
    return CURRENT.get()


SIZED = (str, list, tuple, dict, bytes)
# iterated as they are, their length charged once: the types real templates loop over
# (and the views of a dict's items, keys and values: a loop over ``d.items()``)
_COUNTABLE = frozenset({list, tuple, dict, str, range, type({}.items()), type({}.keys()), type({}.values())})


def _len(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple, dict, bytes)) else 0


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
        return sum(_len(x) if isinstance(x, (str, bytes)) else 1 for x in items) + _len(sep) * max(len(items) - 1, 0)
    return 0


def replaced_size(s: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(s, (str, bytes)) and type(old) is type(s) and type(new) is type(s)):
        return 0
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


def _translated_size(s: str, table: Any) -> int:
    values = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else ()
    longest = max((len(v) for v in values if isinstance(v, (str, bytes))), default=1)
    return len(s) * max(longest, 1)


# str / bytes / int methods that can build a value larger than their inputs, checked before the call
INFLATING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "format", "format_map",
                                "join", "replace", "translate", "to_bytes"})
# Builtin methods of plain values (str, list, tuple, dict) that return at most their owner's size,
# a part of it, a number or a bool: the sandbox's call adds nothing for them, so they are called
# directly, unchecked and uncounted (a template's method calls are bounded by its size per step).
NON_GROWING_METHODS = frozenset({
    "count", "endswith", "find", "get", "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit",
    "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle", "isupper", "items", "keys",
    "lstrip", "partition", "removeprefix", "removesuffix", "rfind", "rindex", "rpartition", "rsplit",
    "rstrip", "split", "splitlines", "startswith", "strip", "values",
})
PLAIN_OWNERS = frozenset({str, list, tuple, dict})


def check_str_call(b: Budget, owner: Any, name: str, args: tuple, kwargs: dict) -> None:
    """Size checks before ``owner.name(*args, **kwargs)`` (owner a str, bytes or int), for the
    methods that inflate."""
    if name not in INFLATING_METHODS:
        return
    what = f"{type(owner).__name__}.{name}"
    check_ints(b, list(args) + list(kwargs.values()), what)
    if name in ("format", "format_map"):
        check_format_string(b, owner, what)
    elif name == "join" and args:
        b.size(joined_size(owner, args[0]), what)
    elif name == "replace" and len(args) >= 2:
        b.size(replaced_size(owner, *args[:3]), what)
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        tab = "\t" if isinstance(owner, str) else b"\t"
        b.size(len(owner) + owner.count(tab) * (size if isinstance(size, int) else 8), what)
    elif name == "translate" and args:
        b.size(_translated_size(owner, args[0]), what)


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
