"""JSON for a chat template's ``tojson`` under the render's budget: the size of compact JSON
before it is built (``compact_json_size``), and indented JSON counted as it is built.

Compact JSON of a value that exists is usually a few times its size, but a template can make
a value whose JSON is enormous from shared parts (``[[s] * 1000] * 1000`` holds one string a
million times in two small lists): its size is worked out per distinct object first, so the text
is refused before it exists.

Indented JSON can be far larger than the value it encodes (an indent of 10^6 on a nested value),
so its size is counted while it is built and the encoding stops as soon as it passes the budget.
The json module's own indented encoder is pure Python and yields one small piece at a time;
counting those pieces as they come costs a fifth of the encoding again (Llama 3.x and Granite
templates print every tool this way). This encoder writes the same text (the json module's rules
for scalars, keys, separators, ``sort_keys``, circular references and errors; tests hold it to
``json.dumps``), counts it item by item, and is faster than the json module's.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import encode_basestring, encode_basestring_ascii
from typing import Any

from .budget import CURRENT

__all__ = ["indented_json", "compact_json_bound", "compact_json_size"]

_INF = float("inf")


def _float(o: float) -> str:
    if o != o:
        return "NaN"
    if o == _INF:
        return "Infinity"
    if o == -_INF:
        return "-Infinity"
    return float.__repr__(o)


def compact_json_bound(value: Any, *, ensure_ascii: bool, item_separator: str, key_separator: str) -> int:
    """An upper bound of ``len(json.dumps(value, separators=...))``, each distinct container
    walked once, strings by their length (every character escaped at its longest), about as fast
    as the encoding itself: when it is within the budget the text is built without counting."""
    per_char = 12 if ensure_ascii else 6  # "\ud83c\udf89" for one astral character, "\u0001" otherwise
    item_sep, key_sep = len(item_separator), len(key_separator)
    sizes: dict[int, int] = {}

    def scalar(o: Any) -> int:
        if isinstance(o, str):
            return per_char * len(o) + 2
        if isinstance(o, int) and o is not True and o is not False:
            return len(int.__repr__(o))
        return 24  # null, true, false, any float ("-1.2345678901234567e-308"), or not JSON: 0 would do

    def measure(o: Any) -> int:
        t = type(o)
        if t is str:
            return per_char * len(o) + 2
        if t is dict or t is list or t is tuple or isinstance(o, (dict, list, tuple)):
            mark = id(o)
            known = sizes.get(mark)
            if known is not None:
                return known
            sizes[mark] = 0  # a cycle counts 0: the encoder refuses it
            size = 2 + (len(o) - 1) * item_sep if o else 2
            if isinstance(o, dict):
                size += len(o) * key_sep
                for k, v in o.items():
                    size += (per_char * len(k) + 2 if type(k) is str else scalar(k) + 2) + measure(v)
            else:
                for v in o:
                    size += measure(v)
            sizes[mark] = size
            return size
        return scalar(o)

    return measure(value)


def compact_json_size(value: Any, *, ensure_ascii: bool, item_separator: str, key_separator: str,
                      limit: int, over: Callable[[int], int]) -> int:
    """The length of ``json.dumps(value, separators=(item_separator, key_separator), ...)`` without
    building it, each distinct container and string measured once (so a value made of shared parts
    costs its distinct parts, not its size). ``over(size)`` as for :func:`indented_json`, called
    as soon as any part passes ``limit``. Values the json module refuses (other types, circular
    references) count 0 here: the encoder raises its own error for them afterwards."""
    encode = encode_basestring_ascii if ensure_ascii else encode_basestring
    item_sep, key_sep = len(item_separator), len(key_separator)
    sizes: dict[int, int] = {}
    walking: set[int] = set()

    def measure(o: Any) -> int:
        nonlocal limit
        if isinstance(o, str):
            known = sizes.get(id(o))
            if known is None:
                known = sizes[id(o)] = len(encode(o))
            return known
        text = _scalar_text(o, encode)
        if text is not None:
            return len(text)
        is_list = isinstance(o, (list, tuple))
        if not is_list and not isinstance(o, dict):
            return 0
        mark = id(o)
        known = sizes.get(mark)
        if known is not None:
            return known
        if mark in walking:
            return 0
        walking.add(mark)
        size = 2 + max(len(o) - 1, 0) * item_sep
        if is_list:
            for item in o:
                size += measure(item)
                if size > limit:
                    limit = over(size)
        else:
            for k, v in o.items():
                try:
                    key = _key_text(k)
                except TypeError:
                    key = ""
                size += len(encode(key)) + key_sep + measure(v)
                if size > limit:
                    limit = over(size)
        walking.discard(mark)
        sizes[mark] = size
        return size

    return measure(value)


def _scalar_text(o: Any, encode: Callable[[str], str]) -> str | None:
    """A scalar's JSON text (the json module's order: str, None, True, False, int, float), None
    for anything else."""
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


def _key_text(k: Any) -> str:
    """A dict key as the json module turns it into a string (before encoding)."""
    if isinstance(k, str):
        return k
    if k is None or isinstance(k, (int, float)):  # bool is an int
        return _scalar_text(k, str)
    raise TypeError(f"keys must be str, int, float, bool or None, not {k.__class__.__name__}")


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

    def walk(o: Any, level: int) -> None:
        nonlocal size, limit
        text = _scalar_text(o, encode)
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
                key = encode(_key_text(item[0])) + key_separator
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


def tojson_filter(value: Any, ensure_ascii: bool = False, indent: Any = None,
                  separators: Any = None, sort_keys: bool = False) -> str:
    """Jinja's `tojson` as transformers gives it (non-ASCII kept), its text counted against the
    render's budget before or while it is built."""
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    b = CURRENT.get()
    if b is None:
        return encoder.encode(value)
    if isinstance(indent, int) and indent > b.max_chars:  # the encoder builds ' ' * indent before anything else
        b.size(indent, "the filter tojson")

    def over(size: int) -> int:
        b.size(size, "the filter tojson")
        return b.max_chars  # widened by the input's share

    if indent is None and (separators is None or sum(map(len, separators)) <= 8):
        # compact: measured first (shared parts once, so a value repeating a large part is refused
        # before its text exists), then encoded at once in C; the exact count only when the quick
        # bound is over the budget
        seps = {"item_separator": encoder.item_separator, "key_separator": encoder.key_separator}
        if compact_json_bound(value, ensure_ascii=ensure_ascii, **seps) > b.max_chars:
            compact_json_size(value, ensure_ascii=ensure_ascii, **seps, limit=b.max_chars, over=over)
        return encoder.encode(value)
    # indented (or with long separators) it can be far larger than the value (an indent of 10^6 on
    # a nested value): counted while it is built, and refused before the text exists
    if (isinstance(indent, (int, str)) and type(encoder.item_separator) is str
            and type(encoder.key_separator) is str):
        return indented_json(value, ensure_ascii=ensure_ascii, indent=indent, item_separator=encoder.item_separator,
                             key_separator=encoder.key_separator, sort_keys=sort_keys, limit=b.max_chars, over=over)
    parts, size, limit = [], 0, b.max_chars
    for chunk in encoder.iterencode(value):
        size += len(chunk)
        if size > limit:
            b.size(size, "the filter tojson")
            limit = b.max_chars  # widened by the input's share
        parts.append(chunk)
    return "".join(parts)
