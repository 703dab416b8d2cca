"""Strict reads of GGUF metadata fields for the tokenizer: a key that is present but of the
wrong type, or a string that is not UTF-8, is an error naming the file and key rather than
something to coerce (unlike :class:`mtp_engine.gguf.reader.GGUFFile`, which is lenient)."""
from __future__ import annotations

from typing import Any

import gguf

from ..errors import MTPEngineError

__all__ = ["read_string", "read_string_array", "read_int_array", "read_scalar"]


def _field_types(field: Any) -> list:
    return list(getattr(field, "types", []) or [])


def read_string(reader: Any, key: str, path: str, *, required: bool) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise MTPEngineError("required key is missing", file=path or None, field=key)
        return None
    types = _field_types(field)
    if types[:1] != [gguf.GGUFValueType.STRING]:
        raise MTPEngineError(
            f"expected a string, found type {[t.name for t in types]}", file=path or None, field=key
        )
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise MTPEngineError(f"string is not valid UTF-8 ({e})", file=path or None, field=key) from e


def read_string_array(reader: Any, key: str, path: str) -> list[str]:
    field = reader.fields.get(key)
    if field is None:
        raise MTPEngineError("required key is missing", file=path or None, field=key)
    types = _field_types(field)
    if types[:2] != [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]:
        raise MTPEngineError(
            f"expected an array of strings, found type {[t.name for t in types]}",
            file=path or None,
            field=key,
        )
    strings = getattr(field.parts, "strings", None)  # reader.BulkArrayParts: read in bulk
    raw = strings() if strings else [bytes(field.parts[i]) for i in field.data]
    out = []
    for n, b in enumerate(raw):
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise MTPEngineError(
                f"element {n} is not valid UTF-8 ({e})", file=path or None, field=key
            ) from e
    return out


_INT_TYPES = {
    gguf.GGUFValueType.UINT8, gguf.GGUFValueType.INT8, gguf.GGUFValueType.UINT16,
    gguf.GGUFValueType.INT16, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
    gguf.GGUFValueType.UINT64, gguf.GGUFValueType.INT64,
}


def read_int_array(reader: Any, key: str, path: str) -> list[int]:
    field = reader.fields.get(key)
    if field is None:
        raise MTPEngineError("required key is missing", file=path or None, field=key)
    types = _field_types(field)
    if len(types) < 2 or types[0] != gguf.GGUFValueType.ARRAY or types[1] not in _INT_TYPES:
        raise MTPEngineError(
            f"expected an array of integers, found type {[t.name for t in types]}",
            file=path or None,
            field=key,
        )
    values = getattr(field.parts, "values", None)  # reader.BulkArrayParts: read in bulk
    if values is not None:
        return [int(v) for v in values.tolist()]
    return [int(field.parts[i][0]) for i in field.data]


def read_scalar(reader: Any, key: str, path: str, kind: str) -> int | bool | None:
    """An optional integer (kind 'int') or boolean (kind 'bool') scalar; None when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    types = _field_types(field)
    if kind == "bool":
        ok = types == [gguf.GGUFValueType.BOOL]
    else:
        ok = len(types) == 1 and types[0] in _INT_TYPES
    if not ok:
        raise MTPEngineError(
            f"expected a scalar {kind}, found type {[t.name for t in types]}",
            file=path or None,
            field=key,
        )
    value = field.parts[field.data[0]][0]
    return bool(value) if kind == "bool" else int(value)
