"""Reading GGUF files through `gguf.GGUFReader` with every failure turned into `MTPEngineError`.

The header is checked by `validate.validate_header` before GGUFReader parses it.

`mx.load` is never used for GGUF: it returns wrong Q4_K values and crashes on float64 metadata.
GGUFReader memory-maps the file, so raw tensor bytes are views into the page cache until a
repack copies them into their MLX layout.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField
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


class BulkArrayParts(Sequence):
    """The `parts` of a metadata array field, in the layout GGUFReader gives (the field's prefix,
    then one 1-element view per number, or a length view and a bytes view per string), built on
    access instead of up front. GGUFReader builds a numpy view per element: ~700 bytes of memory
    per byte of a UINT8 array, ~1.6 KB per empty string, so an unused 1 MB array cost 690 MB and
    24 s to load. Here an array costs its element offsets (16 bytes per string) and `values` /
    `strings()` read it in bulk."""

    def __init__(self, prefix: list, buf: np.ndarray, etype: GGUFValueType, start: int, count: int,
                 values: np.ndarray | None, str_starts: np.ndarray | None, str_lens: np.ndarray | None):
        self.prefix, self.buf, self.etype, self.count = prefix, buf, etype, count
        self.start = start
        self.values = values  # numeric arrays: a read-only view of all the elements
        self._starts, self._lens = str_starts, str_lens

    def __len__(self) -> int:
        per = 2 if self.etype == GGUFValueType.STRING else 1
        return len(self.prefix) + per * self.count

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        if i < len(self.prefix):
            return self.prefix[i]
        k = i - len(self.prefix)
        if self.etype != GGUFValueType.STRING:
            return self.values[k:k + 1]
        j, is_data = divmod(k, 2)
        s = int(self._starts[j])
        if is_data:
            return self.buf[s:s + int(self._lens[j])]
        return self.buf[s - 8:s].view(np.uint64)

    def data_indices(self) -> range:
        p = len(self.prefix)
        if self.etype == GGUFValueType.STRING:
            return range(p + 1, p + 2 * self.count, 2)
        return range(p, p + self.count)

    def strings(self) -> list[bytes]:
        """Every element of a string array as bytes."""
        buf = memoryview(self.buf)
        return [bytes(buf[s:s + n]) for s, n in zip(self._starts.tolist(), self._lens.tolist())]


class _BulkReader(GGUFReader):
    """GGUFReader with metadata arrays read in bulk (see `BulkArrayParts`); tensors as before."""

    def _build_fields(self, offs: int, count: int) -> int:
        for _ in range(count):
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            parts: list = [kv_klen, kv_kdata, raw_kv_type]
            name = str(bytes(kv_kdata), encoding="utf-8")
            if GGUFValueType(raw_kv_type[0]) == GGUFValueType.ARRAY:
                size, field = self._bulk_array(orig_offs, name, parts, offs)
            else:
                size, field_parts, field_idxs, field_types = self._get_field_parts(offs, raw_kv_type[0])
                field = ReaderField(orig_offs, name, parts + field_parts,
                                    [idx + len(parts) for idx in field_idxs], field_types)
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    def _bulk_array(self, orig_offs: int, name: str, parts: list, offs: int) -> tuple[int, ReaderField]:
        start = offs
        raw_itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        offs += 12
        etype = GGUFValueType(raw_itype[0])
        n = int(alen[0])
        types = [GGUFValueType.ARRAY] + ([etype] if n else [])
        values = starts = lens = None
        if etype == GGUFValueType.STRING:
            starts = np.empty(n, dtype=np.int64)
            lens = np.empty(n, dtype=np.int64)
            unpack, buf = struct.Struct("<Q").unpack_from, self.data
            for j in range(n):  # validate_header has bounded every length against the file
                ln = unpack(buf, offs)[0]
                starts[j] = offs + 8
                lens[j] = ln
                offs += 8 + ln
        else:
            nptype = self.gguf_scalar_to_np.get(etype)
            if nptype is None:
                raise ValueError(f"Unknown/unhandled array element type {etype}")
            values = self._get(offs, nptype, n) if n else np.empty(0, dtype=nptype)
            offs += int(values.nbytes)
        bulk = BulkArrayParts(parts + [raw_itype, alen], self.data, etype, start, n, values, starts, lens)
        return offs - start, ReaderField(orig_offs, name, bulk, bulk.data_indices(), types)


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
            self.reader = _BulkReader(self.path, "r")
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
            bulk = field.parts if isinstance(field.parts, BulkArrayParts) else None
            if types[1] == GGUFValueType.STRING:
                raw = bulk.strings() if bulk else [bytes(field.parts[i]) for i in field.data]
                return [b.decode("utf-8", errors="replace") for b in raw]
            conv = _SCALAR_KINDS.get(types[1])
            if conv is None:
                raise ValueError(f"unsupported array element type {types[1]!r}")
            if bulk is not None:
                return [conv(v) for v in bulk.values.tolist()]
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
