"""Indented JSON for a chat template's ``tojson(indent=...)``, under the render's budget.

Indented JSON can be far larger than the value it encodes (an indent of 10^6 on a nested value),
so its size is counted while it is built and the encoding stops as soon as it passes the budget.
The json module's own indented encoder is pure Python and yields one small piece at a time;
counting those pieces as they come costs a fifth of the encoding again (Llama 3.x and Granite
templates print every tool this way). This encoder writes the same text (the json module's rules
for scalars, keys, separators, ``sort_keys``, circular references and errors; tests hold it to
``json.dumps``), counts it item by item, and is faster than the json module's.
"""
from __future__ import annotations

from collections.abc import Callable
from json.encoder import encode_basestring, encode_basestring_ascii
from typing import Any

__all__ = ["indented_json"]

_INF = float("inf")


def _float(o: float) -> str:
    if o != o:
        return "NaN"
    if o == _INF:
        return "Infinity"
    if o == -_INF:
        return "-Infinity"
    return float.__repr__(o)


def indented_json(value: Any, *, ensure_ascii: bool, indent: int | str, item_separator: str,
                  key_separator: str, sort_keys: bool, limit: int, over: Callable[[int], int]) -> str:
    """``json.dumps(value, indent=indent, ...)`` (allow_nan and check_circular on, no default).

    ``over(size)`` is called whenever the text built so far passes ``limit``; it raises, or
    returns the new limit (the budget widened by the input's share)."""
    encode = encode_basestring_ascii if ensure_ascii else encode_basestring
    unit = indent if isinstance(indent, str) else " " * indent
    out: list[str] = []
    append = out.append
    markers: dict[int, Any] = {}
    size = 0

    def scalar(o: Any) -> str | None:
        # the json module's order: str, None, True, False, int, float
        if isinstance(o, str):
            return encode(o)
        if o is None:
            return "null"
        if o is True:
            return "true"
        if o is False:
            return "false"
        if isinstance(o, int):
            return int.__repr__(o)
        if isinstance(o, float):
            return _float(o)
        return None

    def key_text(k: Any) -> str:
        if isinstance(k, str):
            return k
        if isinstance(k, float):
            return _float(k)
        if k is True:
            return "true"
        if k is False:
            return "false"
        if k is None:
            return "null"
        if isinstance(k, int):
            return int.__repr__(k)
        raise TypeError(f"keys must be str, int, float, bool or None, not {k.__class__.__name__}")

    def walk(o: Any, level: int) -> None:
        nonlocal size, limit
        text = scalar(o)
        if text is not None:
            append(text)
            size += len(text)
            return
        is_list = isinstance(o, (list, tuple))
        if not is_list and not isinstance(o, dict):
            raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")
        if not o:
            append("[]" if is_list else "{}")
            size += 2
            return
        mark = id(o)
        if mark in markers:
            raise ValueError("Circular reference detected")
        markers[mark] = o
        newline = "\n" + unit * (level + 1)
        separator = item_separator + newline
        opening = ("[" if is_list else "{") + newline
        append(opening)
        size += len(opening)
        first = True
        for item in (o if is_list else sorted(o.items()) if sort_keys else o.items()):
            if first:
                first = False
            else:
                append(separator)
                size += len(separator)
            if not is_list:
                key = encode(key_text(item[0])) + key_separator
                append(key)
                size += len(key)
                item = item[1]
            if size > limit:  # before the item: a nested value's indentation grows with its depth
                limit = over(size)
            walk(item, level + 1)
        closing = "\n" + unit * level + ("]" if is_list else "}")
        append(closing)
        size += len(closing)
        del markers[mark]

    walk(value, 0)
    if size > limit:
        over(size)
    return "".join(out)
