"""Reading GGUF files through `gguf.GGUFReader` with every failure turned into `MTPEngineError`.

The header is checked by `validate.validate_header` before GGUFReader parses it.

`mx.load` is never used for GGUF: it returns wrong Q4_K values and crashes on float64 metadata.
GGUFReader memory-maps the file, so raw tensor bytes are views into the page cache until a
repack copies them into their MLX layout.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from ..errors import MTPEngineError
from .validate import Header, validate_header

_SCALAR_KINDS = {
    GGUFValueType.UINT8: int, GGUFValueType.INT8: int, GGUFValueType.UINT16: int,
    GGUFValueType.INT16: int, GGUFValueType.UINT32: int, GGUFValueType.INT32: int,
    GGUFValueType.UINT64: int, GGUFValueType.INT64: int, GGUFValueType.FLOAT32: float,
    GGUFValueType.FLOAT64: float, GGUFValueType.BOOL: bool,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: its name, storage type, numpy shape and raw bytes (a view)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: reversed GGUF `ne`
    data: np.ndarray

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


def open_header(path: str | os.PathLike) -> Header:
    """The checked header of the GGUF file at `path` (see `validate.validate_header`), without
    parsing it with GGUFReader: cheap enough to run before deciding whether to load."""
    path = str(path)
    if not os.path.exists(path):
        raise MTPEngineError("no such file", file=path)
    if os.path.isdir(path):
        raise MTPEngineError("expected a GGUF file, found a directory", file=path)
    return validate_header(path)


class GGUFFile:
    """A validated, memory-mapped GGUF file: typed metadata access and tensors by name."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        # Our own bounded parse first: GGUFReader trusts every count and offset it reads, so a hostile
        # header could make it loop for hours or allocate without limit before failing.
        self.header: Header = open_header(self.path)
        try:
            self.reader = GGUFReader(self.path, "r")
        except MTPEngineError:
            raise
        except Exception as e:  # a corruption validate_header does not know of yet: still a clean error
            raise MTPEngineError(f"corrupt or truncated GGUF ({type(e).__name__}: {e})", file=self.path) from None
        self._tensors = {t.name: t for t in self.reader.tensors}

    # ---- metadata -------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key` as a Python scalar, str or list; `default` when absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return self._decode(field)
        except Exception as e:
            raise MTPEngineError(f"unreadable metadata value ({type(e).__name__}: {e})",
                                 file=self.path, field=key) from None

    def require(self, key: str, kind: type | None = None) -> Any:
        """The value of metadata `key`; raises naming the key when it is missing or of the wrong kind."""
        if key not in self.reader.fields:
            raise MTPEngineError("required metadata key is missing", file=self.path, field=key)
        value = self.get(key)
        if kind is not None and not _is_kind(value, kind):
            raise MTPEngineError(f"expected {kind.__name__}, found {type(value).__name__} {value!r:.80}",
                                 file=self.path, field=key)
        return value

    def _decode(self, field) -> Any:
        types = field.types
        if not types:
            raise ValueError("field has no type")
        if types[0] == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
        if types[0] == GGUFValueType.ARRAY:
            if len(types) < 2:
                return []
            if types[1] == GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
            conv = _SCALAR_KINDS.get(types[1])
            if conv is None:
                raise ValueError(f"unsupported array element type {types[1]!r}")
            return [conv(field.parts[i][0]) for i in field.data]
        conv = _SCALAR_KINDS.get(types[0])
        if conv is None:
            raise ValueError(f"unsupported value type {types[0]!r}")
        return conv(field.parts[field.data[0]][0])

    # ---- tensors --------------------------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def numpy_shape(self, name: str) -> tuple[int, ...]:
        """The numpy shape (reversed GGUF `ne`) of tensor `name`, without reading its data."""
        t = self._tensors.get(name)
        if t is None:
            raise MTPEngineError("required tensor is missing", file=self.path, field=name)
        return tuple(int(n) for n in reversed([int(x) for x in t.shape]))

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        """Tensor `name` with its numpy shape checked against `shape` (when given) and its byte
        count checked against its type and shape."""
        t = self._tensors.get(name)
        if t is None:
            raise MTPEngineError("required tensor is missing", file=self.path, field=name)
        np_shape = tuple(int(x) for x in reversed([int(n) for n in t.shape]))
        while len(np_shape) > 1 and shape is not None and len(np_shape) > len(shape) and np_shape[0] == 1:
            np_shape = np_shape[1:]
        if shape is not None and np_shape != tuple(shape):
            raise MTPEngineError(f"unexpected shape: expected {list(shape)}, found {list(np_shape)}",
                                 file=self.path, field=name)
        try:
            qtype = GGMLQuantizationType(int(t.tensor_type))
        except ValueError:
            raise MTPEngineError(f"unknown tensor type id {int(t.tensor_type)}", file=self.path, field=name) from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(np_shape)) if np_shape else 1
        if np_shape and np_shape[-1] % block:
            raise MTPEngineError(f"row length {np_shape[-1]} is not a multiple of the {qtype.name} block size {block}",
                                 file=self.path, field=name)
        expected = n // block * type_size
        if int(t.data.nbytes) != expected:
            raise MTPEngineError(f"data size mismatch: {qtype.name} {list(np_shape)} needs {expected} bytes, "
                                 f"found {int(t.data.nbytes)}", file=self.path, field=name)
        return TensorInfo(name=name, qtype=qtype, shape=np_shape, data=t.data)

    def file_size(self) -> int:
        return os.path.getsize(self.path)


def _is_kind(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)
