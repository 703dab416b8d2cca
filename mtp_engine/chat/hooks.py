"""The hooks that enforce a chat-template render's budget (`template_budget`).

`sandbox` builds the environment that calls these: its `Instrument` rewrites a parsed template so
that every loop, every ``+`` chain and ``~``, and every output inside a capture (macro, call,
filter and set blocks, recursive loops) goes through the hook filters; `render_counted` counts the
top level's output as it is produced; the sandbox's operator and call overrides and the guarded
filters check sizes before values are built.

Cost matters as much as coverage: a chat template renders on every request, so the hooks are
placed where they are cheapest. A loop over a list, tuple, dict, string or range of up to 64
items is charged its length once, up front (the original object is iterated: no wrapper per item);
longer loops and iterators are counted item by item, so the clock is read while they run. The
top level's output is counted per chunk of the render's generator, not
per expression. Attribute and item lookups are not hooked: a template's own lookups are bounded by
its size per step (loop iteration or call), and the filters that walk items through lookups
(``selectattr``, ``map``, ``sort``...) are charged one step per item of what they walk. The
input's size, which widens the character allowance, is measured only the first time a character
limit is reached.

Nothing here imports jinja2 at module level.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from .budget import (
    _COUNTABLE, CURRENT, SIZED, Budget, _len, check_format_string, check_ints, joined_size, replaced_size,
)

__all__ = ["guard_filter", "HOOKS", "render_counted", "WALKING_FILTERS", "PLAIN_FILTERS", "NATIVE_ADD",
           "SHORT_CHAIN", "TemplateRaised", "raise_exception", "strftime_now"]


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
# step per item before they run. join and sum walk in Python only when given an attribute.
WALKING_FILTERS = frozenset({
    "batch", "dictsort", "groupby", "join", "map", "max", "min", "reject", "rejectattr", "select",
    "selectattr", "slice", "sort", "sum", "unique", "xmlattr",
})
_ATTRIBUTE_ARG = {"join": 1, "sum": 0}  # where the attribute parameter is among the positional ones


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
    always_walks = name in WALKING_FILTERS and name not in _ATTRIBUTE_ARG
    what = f"the filter {name}"

    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        b = CURRENT.get()
        if b is None:
            return f(*args, **kwargs)
        value = args[lead] if len(args) > lead else None
        walks = always_walks
        if name in _ATTRIBUTE_ARG:
            at = lead + 1 + _ATTRIBUTE_ARG[name]
            walks = kwargs.get("attribute") is not None or (len(args) > at and args[at] is not None)
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
    # A short loop (most of a chat template's) is charged up front and then runs on the object
    # itself. A long one is counted item by item, so that the clock is
    # read every 64 iterations and a loop past the budget runs up to the point where it goes over.
    if type(iterable) in _COUNTABLE:
        n = len(iterable)
        if n <= _UPFRONT_ITEMS:
            left = b.steps_left
            b.steps_left = left - n
            # the clock when the count passes a multiple of 64, as often as single steps read it
            if (left - n) >> 6 != left >> 6 or left < n:
                b.check()
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


# A + chain written straight into the top level's output, led by a string literal and of at most
# SHORT_CHAIN operands, is compiled to Python's + (the nodes carry this attribute; see
# chat_template's code generator): its value is a plain string at most SHORT_CHAIN times its
# largest operand, which exists already, and it is counted by `render_counted` as soon as it is
# yielded, which is the check the hook would make once it is built. Anything else is hooked.
NATIVE_ADD = "mtp_native_add"

# A chain of + with at most this many operands, all plain strings, is checked once built (it is
# at most this many times its largest operand, which exists already); a longer one before.
SHORT_CHAIN = 8


def _add(_context: Any, *parts: Any) -> Any:
    """``parts[0] + parts[1] + ...``: one hook per chain of ``+``."""
    for p in parts:
        if type(p) is not str:
            return _fold(parts)
    b = CURRENT.get()
    if b is not None and len(parts) > SHORT_CHAIN:
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


# Chains of 2-6 operands (most of a real template's +) get a hook of their own: the operands'
# types tested inline and the size checked inline make the hook cost about one plain call.
def _add2(_context: Any, a: Any, b: Any) -> Any:
    if type(a) is str and type(b) is str:
        out = a + b
        bud = CURRENT.get()
        if bud is not None and len(out) > bud.max_chars:
            bud.size(len(out), "the operator +")
        return out
    if type(a) is int and type(b) is int:  # ns.index + 1: one bit longer at most
        return a + b
    return _fold((a, b))


def _add3(_context: Any, a: Any, b: Any, c: Any) -> Any:
    if type(a) is str and type(b) is str and type(c) is str:
        out = a + b + c
        bud = CURRENT.get()
        if bud is not None and len(out) > bud.max_chars:
            bud.size(len(out), "the operator +")
        return out
    return _fold((a, b, c))


def _add4(_context: Any, a: Any, b: Any, c: Any, d: Any) -> Any:
    if type(a) is str and type(b) is str and type(c) is str and type(d) is str:
        out = a + b + c + d
        bud = CURRENT.get()
        if bud is not None and len(out) > bud.max_chars:
            bud.size(len(out), "the operator +")
        return out
    return _fold((a, b, c, d))


def _add5(_context: Any, a: Any, b: Any, c: Any, d: Any, e: Any) -> Any:
    if type(a) is str and type(b) is str and type(c) is str and type(d) is str and type(e) is str:
        out = a + b + c + d + e
        bud = CURRENT.get()
        if bud is not None and len(out) > bud.max_chars:
            bud.size(len(out), "the operator +")
        return out
    return _fold((a, b, c, d, e))


def _add6(_context: Any, a: Any, b: Any, c: Any, d: Any, e: Any, f: Any) -> Any:
    if type(a) is str and type(b) is str and type(c) is str and type(d) is str and type(e) is str and type(f) is str:
        out = a + b + c + d + e + f
        bud = CURRENT.get()
        if bud is not None and len(out) > bud.max_chars:
            bud.size(len(out), "the operator +")
        return out
    return _fold((a, b, c, d, e, f))


class TemplateRaised(Exception):
    """raise_exception() called from a chat template."""


def raise_exception(message: str) -> None:
    """The templates' `raise_exception` global (transformers'): refuses the input."""
    raise TemplateRaised(message)


def strftime_now(fmt: str) -> str:
    """The templates' `strftime_now` global (transformers'): the local time, formatted."""
    import datetime

    return datetime.datetime.now().strftime(fmt)


def render_counted(template: Any, b: Budget, context: dict) -> str:
    """``template.render(**context)``, counting the top level's output chunk by chunk as the
    render's generator produces it (captured output is counted by the hooks)."""
    parts: list[str] = []
    append = parts.append
    for chunk in template.root_render_func(template.new_context(context)):
        append(chunk)
        # read again at every chunk: the hooks count captured output into it while the render runs
        left = b.chars_left - len(chunk)
        b.chars_left = left
        if left < 0:
            b.emit(0)
    return "".join(parts)


# the hook filters `instrument` puts into templates, by name
HOOKS = {"mtp_loop": _loop, "mtp_out": _out, "mtp_emit": _emit, "mtp_concat": _concat, "mtp_add": _add,
         "mtp_add2": _add2, "mtp_add3": _add3, "mtp_add4": _add4, "mtp_add5": _add5, "mtp_add6": _add6}
