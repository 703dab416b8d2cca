"""The budget of one chat-template render (`RenderLimits`) and the hooks that enforce it.

`chat_template` builds the sandbox that calls these: `instrument` rewrites a parsed template so
that every loop, every ``+`` chain and ``~``, and every output inside a capture (macro, call,
filter and set blocks, recursive loops) goes through the hook filters; `render_counted` counts the
top level's output as it is produced; the sandbox's operator and call overrides and the guarded
filters check sizes before values are built.

Cost matters as much as coverage: a chat template renders on every request, so the hooks are
placed where they are cheapest. A loop over a list, tuple, dict, string or range is charged its
length once, up front (the original object is iterated: no wrapper per item); only iterators are
counted item by item. The top level's output is counted per chunk of the render's generator, not
per expression. Attribute and item lookups are not hooked: a template's own lookups are bounded by
its size per step (loop iteration or call), and the filters that walk items through lookups
(``selectattr``, ``map``, ``sort``...) are charged one step per item of what they walk. The
input's size, which widens the character allowance, is measured only the first time a character
limit is reached.

The budget of the render in progress lives in a context variable, so renders in several threads
each have their own. Nothing here imports jinja2 at module level.
"""
from __future__ import annotations

import contextvars
import functools
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["RenderLimits", "OverBudget", "Budget", "CURRENT", "instrument", "guard_filter", "HOOKS",
           "input_chars", "check_ints", "check_format_string", "joined_size", "replaced_size", "SIZED",
           "render_counted", "check_str_call", "INFLATING_METHODS", "NON_GROWING_METHODS", "PLAIN_OWNERS", "WALKING_FILTERS", "PLAIN_FILTERS"]


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
            raise OverBudget(f"more than {self.limits.max_steps} steps (loop iterations, calls and lookups)")
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
_COUNTABLE = frozenset({list, tuple, dict, str, range})


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


# Filters that cannot build more than a small multiple of their input and run in linear time:
# left unwrapped, so the common ones (trim, length, tojson...) cost nothing extra. tojson checks
# its own size while encoding.
# (Not string: the text of a list escapes its backslashes, so applied again and again it doubles a
# value; its results are checked. Nor escape / forceescape, whose results grow up to 6x.)
PLAIN_FILTERS = frozenset({
    "abs", "bool", "capitalize", "count", "d", "default", "first", "float", "int", "items", "last",
    "length", "list", "lower", "reverse", "round", "safe", "striptags", "title", "tojson", "trim",
    "upper", "wordcount",
})
# Filters that walk their input item by item in Python (attribute lookups, calls): charged one
# step per item before they run.
WALKING_FILTERS = frozenset({
    "batch", "dictsort", "groupby", "join", "map", "max", "min", "reject", "rejectattr", "select",
    "selectattr", "slice", "sort", "sum", "unique", "xmlattr",
})


def _counted(b: Budget, iterable: Any) -> Iterator[Any]:
    for x in iterable:
        b.steps_left -= 1
        if b.steps_left & 63 == 0 or b.steps_left < 0:
            b.check()
        yield x


def guard_filter(name: str, f: Any) -> Any:
    """`f` as the sandbox calls it: unchanged for PLAIN_FILTERS, else with its size checks."""
    if name in PLAIN_FILTERS:
        return f
    # the arguments Jinja passes before the value (context, eval context or environment)
    lead = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0
    walks = name in WALKING_FILTERS
    what = f"the filter {name}"

    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        b = CURRENT.get()
        if b is None:
            return f(*args, **kwargs)
        value = args[lead] if len(args) > lead else None
        if walks and type(value) in _COUNTABLE:
            b.step(len(value) + 1)
        elif walks and isinstance(value, Iterator):
            args = args[:lead] + (_counted(b, value),) + args[lead + 1:]
        else:
            b.step()
        params = args[lead + 1:]
        if params or kwargs:
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
        if type(out) in SIZED and len(out) > b.max_chars:
            b.size(len(out), what)
        return out

    return guarded


_UPFRONT_ITEMS = 64


def _loop(_context: Any, iterable: Any) -> Any:
    b = CURRENT.get()
    if b is None:
        return iterable
    # A short loop (most of a chat template's) is charged up front, with a look at the clock, and
    # then runs on the object itself. A long one is counted item by item, so that the clock is
    # read every 64 iterations and a loop past the budget runs up to the point where it goes over.
    if type(iterable) in _COUNTABLE and len(iterable) <= _UPFRONT_ITEMS:
        b.step(len(iterable))
        return iterable
    return _counted(b, iterable)


def _out(_context: Any, value: Any) -> Any:
    b = CURRENT.get()
    if b is not None:
        b.chars_left -= len(value) if type(value) is str else len(str(value))
        if b.chars_left < 0:
            b.emit(0)
    return value


def _emit(_context: Any, _value: Any, n: int) -> str:
    b = CURRENT.get()
    if b is not None:
        b.emit(n)
    return ""


def _concat(_context: Any, *parts: Any) -> str:
    strings = [p if isinstance(p, str) else str(p) for p in parts]
    b = CURRENT.get()
    if b is not None:
        b.size(sum(map(len, strings)), "the operator ~")
    return "".join(strings)


# A chain of + with at most this many operands, all plain strings, is checked once built (it is
# at most this many times its largest operand, which exists already); a longer one before.
_SHORT_CHAIN = 8


def _add(_context: Any, *parts: Any) -> Any:
    """``parts[0] + parts[1] + ...``: one hook per chain of ``+``."""
    for p in parts:
        if type(p) is not str:
            return _fold(parts)
    b = CURRENT.get()
    if b is not None and len(parts) > _SHORT_CHAIN:
        b.size(sum(map(len, parts)), "the operator +")
    out = "".join(parts)  # the same text as the left fold, built once
    if b is not None and len(out) > b.max_chars:
        b.size(len(out), "the operator +")
    return out


def _fold(parts: tuple) -> Any:
    """The left fold of ``+`` over anything (lists, numbers, Markup...), each step's size checked
    before it is built."""
    b = CURRENT.get()
    acc = parts[0]
    for p in parts[1:]:
        if b is not None and isinstance(acc, (str, list, tuple, bytes)) and isinstance(p, (str, list, tuple, bytes)):
            b.size(len(acc) + len(p), "the operator +")
        acc = acc + p
        if b is not None and isinstance(acc, (str, list, tuple, bytes)) and len(acc) > b.max_chars:
            b.size(len(acc), "the operator +")  # str + Markup escapes: larger than its parts
    return acc


def _checked_sum(out: str) -> str:
    b = CURRENT.get()
    if b is not None and len(out) > b.max_chars:
        b.size(len(out), "the operator +")
    return out


# Chains of 2-6 operands (most of a real template's +) get a hook of their own: testing each
# operand's type inline instead of in a loop makes the hook cost about one plain function call.
def _add2(_context: Any, a: Any, b: Any) -> Any:
    if type(a) is str and type(b) is str:
        return _checked_sum(a + b)
    if type(a) is int and type(b) is int:  # ns.index + 1: one bit longer at most
        return a + b
    return _fold((a, b))


def _add3(_context: Any, a: Any, b: Any, c: Any) -> Any:
    if type(a) is str and type(b) is str and type(c) is str:
        return _checked_sum(a + b + c)
    return _fold((a, b, c))


def _add4(_context: Any, a: Any, b: Any, c: Any, d: Any) -> Any:
    if type(a) is str and type(b) is str and type(c) is str and type(d) is str:
        return _checked_sum(a + b + c + d)
    return _fold((a, b, c, d))


def _add5(_context: Any, a: Any, b: Any, c: Any, d: Any, e: Any) -> Any:
    if type(a) is str and type(b) is str and type(c) is str and type(d) is str and type(e) is str:
        return _checked_sum(a + b + c + d + e)
    return _fold((a, b, c, d, e))


def _add6(_context: Any, a: Any, b: Any, c: Any, d: Any, e: Any, f: Any) -> Any:
    if type(a) is str and type(b) is str and type(c) is str and type(d) is str and type(e) is str and type(f) is str:
        return _checked_sum(a + b + c + d + e + f)
    return _fold((a, b, c, d, e, f))


def instrument(tree: Any, nodes: Any) -> Any:
    """Routes every loop, ``+`` chain, ``~`` and captured output of the template through the
    budget hooks (the top level's output is counted by `render_counted`)."""
    from jinja2.visitor import NodeTransformer

    def hook(name: str, value: Any, *args: Any, lineno: int) -> Any:
        return nodes.Filter(value, name, list(args), [], None, None, lineno=lineno)

    class Instrument(NodeTransformer):
        # > 0 inside a scope whose output Jinja collects in a list instead of yielding it (macros,
        # call, filter and set blocks, recursive loops; blocks, which self.name() collects)
        captured = 0

        def _scope(self, node: Any) -> Any:
            self.captured += 1
            try:
                return self.generic_visit(node)
            finally:
                self.captured -= 1

        visit_Macro = visit_CallBlock = visit_FilterBlock = visit_AssignBlock = visit_Block = _scope

        def visit_For(self, node: Any) -> Any:
            node = self._scope(node) if node.recursive else self.generic_visit(node)
            node.iter = hook("mtp_loop", node.iter, lineno=node.lineno)
            return node

        def visit_Add(self, node: Any) -> Any:
            operands = []
            while isinstance(node, nodes.Add):  # a + b + c parses as ((a + b) + c)
                operands.append(node.right)
                node = node.left
            operands.append(node)
            operands = [self.visit(o) for o in reversed(operands)]
            name = f"mtp_add{len(operands)}" if len(operands) <= 6 else "mtp_add"
            return hook(name, operands[0], *operands[1:], lineno=operands[0].lineno)

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            return hook("mtp_concat", node.nodes[0], *node.nodes[1:], lineno=node.lineno)

        def visit_Output(self, node: Any) -> Any:
            node = self.generic_visit(node)
            if not self.captured:
                return node
            literal = sum(len(c.data) for c in node.nodes if isinstance(c, nodes.TemplateData))
            wrapped = [c if isinstance(c, nodes.TemplateData) else hook("mtp_out", c, lineno=c.lineno)
                       for c in node.nodes]
            head = [hook("mtp_emit", nodes.Const(""), nodes.Const(literal), lineno=node.lineno)] if literal else []
            node.nodes = head + wrapped
            return node

    return Instrument().visit(tree)


def render_counted(template: Any, b: Budget, context: dict) -> str:
    """``template.render(**context)``, counting the top level's output chunk by chunk as the
    render's generator produces it (captured output is counted by the hooks)."""
    parts: list[str] = []
    append = parts.append
    for chunk in template.root_render_func(template.new_context(context)):
        b.chars_left -= len(chunk)
        if b.chars_left < 0:
            b.emit(0)
        append(chunk)
    return "".join(parts)


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
HOOKS = {"mtp_loop": _loop, "mtp_out": _out, "mtp_emit": _emit, "mtp_concat": _concat, "mtp_add": _add,
         "mtp_add2": _add2, "mtp_add3": _add3, "mtp_add4": _add4, "mtp_add5": _add5, "mtp_add6": _add6}
