"""A bounded pre-parser of the GGUF header that refuses hostile or broken files before
`gguf.GGUFReader` (which trusts every count, length and offset it reads) touches them.

Every count, length, offset, type id and shape is read with `struct` from a read-only memory map
and checked against the bytes that remain in the file *before* anything proportional to it is
allocated or looped over, so the work is O(header size) whatever the file claims: an array that
claims 2^60 elements in a 10 MB file is refused at its count. The rules follow llama.cpp's
`gguf_init_from_file` (ggml/src/gguf.cpp): versions 2 and 3, little-endian, no nested arrays,
tensor names shorter than 64 bytes, at most 4 dimensions, row length a multiple of the type's
block size, offsets aligned to `general.alignment` (a power of two, default 32) and tensor data
inside the file without overlaps.
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from ..errors import MTPEngineError

__all__ = ["Header", "KVInfo", "TensorHeader", "validate_header", "MAX_DIMS", "MAX_NAME_BYTES"]

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 including the terminating NUL
MAX_KEY_BYTES = 1 << 16  # no real key comes close; bounds the error messages and the dict
DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)

# Values kept for `Header.value`: enough for config numbers and the architecture name, while a
# vocabulary of 150k strings is only walked, never copied.
_KEEP_STRING_BYTES = 4096
_KEEP_ARRAY_ITEMS = 4096

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "B", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
# Smallest encodings, used to refuse counts that cannot fit in what is left of the file.
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, 1-byte key, type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, 1-byte name, n_dims, one dim, type, offset
_U64 = struct.Struct("<Q")
_RESERVED_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # GGUFReader's own fields


@dataclass(frozen=True)
class KVInfo:
    """One metadata key: its type, element type and count (arrays), where it sits in the file,
    and its value when small (scalars, strings up to 4 KiB, numeric arrays up to 4096 items)."""

    key: str
    type: GGUFValueType
    elem_type: GGUFValueType | None
    count: int
    value: Any
    offset: int  # start of the key-length field
    value_offset: int  # start of the value (for arrays: of the element-type field)


@dataclass(frozen=True)
class TensorHeader:
    """One tensor info: name, GGUF `ne` dims, type, byte range in the file."""

    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the row length
    qtype: GGMLQuantizationType
    offset: int  # relative to the data section, as stored
    start: int  # absolute file offset of the data
    n_bytes: int
    record_offset: int  # start of the tensor info (its name-length field)

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy shape (reversed `ne`)."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


@dataclass(frozen=True)
class Header:
    """What `validate_header` checked: every key and tensor info of a GGUF file."""

    path: str
    file_size: int
    version: int
    alignment: int
    kvs: dict[str, KVInfo]
    tensors: tuple[TensorHeader, ...]
    tensor_info_offset: int
    data_offset: int

    def value(self, key: str, default: Any = None) -> Any:
        """The kept value of `key` (None when too large to keep), or `default` when absent."""
        kv = self.kvs.get(key)
        return default if kv is None else kv.value


def _show(name: str | None) -> str | None:
    """A key or tensor name as it may appear in a one-line message: names come from the file, so
    control characters are escaped and the length is capped."""
    if name is None or (name.isprintable() and len(name) <= 120):
        return name
    shown = repr(name)[1:-1]
    return shown if len(shown) <= 120 else shown[:117] + "..."


class _Cursor:
    """Reads little-endian fields from the map, refusing any read past the end of the file."""

    def __init__(self, buf: Any, size: int, path: str):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def fail(self, message: str, field: str | None) -> MTPEngineError:
        return MTPEngineError(message, file=self.path, field=_show(field))

    @property
    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str, field: str | None) -> int:
        """Advances past `n` bytes (checked against the file end); returns where they start."""
        if n > self.left:
            raise self.fail(f"file truncated: {what} needs {n} bytes at offset {self.pos}, "
                            f"only {self.left} remain (file size {self.size})", field)
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str, field: str | None) -> Any:
        start = self.need(struct.calcsize("<" + fmt), what, field)
        return struct.unpack_from("<" + fmt, self.buf, start)[0]

    def string(self, what: str, field: str | None, limit: int | None = None) -> tuple[int, int]:
        """A GGUF string (u64 length + bytes): returns (start, length) once both are in range."""
        n = self.unpack("Q", f"{what} length", field)
        if limit is not None and n > limit:
            raise self.fail(f"{what} length {n} exceeds the limit of {limit} bytes", field)
        if n > self.left:
            raise self.fail(f"file truncated: {what} claims {n} bytes at offset {self.pos}, "
                            f"only {self.left} remain (file size {self.size})", field)
        return self.need(n, what, field), n

    def text(self, start: int, n: int, what: str, field: str | None) -> str:
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})", field) from None


def validate_header(path: str | os.PathLike) -> Header:
    """Checks the header of the GGUF file at `path` (magic, version, every key and tensor info,
    the tensor data layout) and returns what it read; raises `MTPEngineError` naming the file,
    the key or tensor, and the problem."""
    path = str(path)
    try:
        # a FIFO or a device would block the open or never end; only a regular file can be mapped
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise MTPEngineError("expected a regular GGUF file, found a special file", file=path)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                magic = f.read(4)
                raise MTPEngineError(f"not a GGUF file (magic {magic!r}, expected b'GGUF')", file=path)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _parse(_Cursor(mm, size, path))
    except OSError as e:
        raise MTPEngineError(f"cannot read file: {e}", file=path) from None


def _parse(c: _Cursor) -> Header:
    magic = c.buf[0:4]
    if magic != b"GGUF":
        raise c.fail(f"not a GGUF file (magic {magic!r}, expected b'GGUF')", None)
    c.pos = 4
    version = c.unpack("I", "version", "version")
    if version & 0xFFFF == 0 and version:
        raise c.fail(f"big-endian GGUF files are not supported (version field {version:#x})", "version")
    if version not in SUPPORTED_VERSIONS:
        raise c.fail(f"unsupported GGUF version {version}: expected one of {list(SUPPORTED_VERSIONS)}",
                     "version")
    n_tensors = c.unpack("Q", "tensor count", "tensor_count")
    n_kv = c.unpack("Q", "key/value count", "kv_count")
    if n_kv > c.left // _MIN_KV_BYTES:
        raise c.fail(f"kv_count {n_kv} cannot fit in the {c.left} bytes left in the file "
                     f"(each key/value takes at least {_MIN_KV_BYTES})", "kv_count")
    kvs: dict[str, KVInfo] = {}
    for i in range(n_kv):
        kv = _read_kv(c, i)
        if kv.key in kvs:
            raise c.fail(f"duplicate key (first at offset {kvs[kv.key].offset}, again at {kv.offset})", kv.key)
        kvs[kv.key] = kv
    alignment = _alignment(c, kvs.get("general.alignment"))
    if n_tensors > c.left // _MIN_TENSOR_INFO_BYTES:
        raise c.fail(f"tensor_count {n_tensors} cannot fit in the {c.left} bytes left in the file "
                     f"(each tensor info takes at least {_MIN_TENSOR_INFO_BYTES})", "tensor_count")
    info_offset = c.pos
    raw = [_read_tensor_info(c, i) for i in range(n_tensors)]
    data_offset = -(-c.pos // alignment) * alignment
    tensors = _check_tensors(c, raw, alignment, data_offset)
    return Header(c.path, c.size, version, alignment, kvs, tensors, info_offset, data_offset)


def _value_type(c: _Cursor, raw: int, what: str, field: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise c.fail(f"unknown {what} {raw} (expected 0..{max(GGUFValueType)})", field) from None


def _read_kv(c: _Cursor, index: int) -> KVInfo:
    offset = c.pos
    where = f"key/value #{index}"
    start, n = c.string(f"{where} key", where, limit=MAX_KEY_BYTES)
    if n == 0:
        raise c.fail("empty key", where)
    key = c.text(start, n, "key", where)
    if key in _RESERVED_KEYS:
        raise c.fail("reserved key name", key)
    vtype = _value_type(c, c.unpack("I", "value type", key), "value type", key)
    value_offset = c.pos
    if vtype == GGUFValueType.ARRAY:
        etype = _value_type(c, c.unpack("I", "array element type", key), "array element type", key)
        if etype == GGUFValueType.ARRAY:
            raise c.fail("nested arrays are not supported", key)
        count = c.unpack("Q", "array length", key)
        value = _read_array(c, key, etype, count)
        return KVInfo(key, vtype, etype, count, value, offset, value_offset)
    if vtype == GGUFValueType.STRING:
        s, n = c.string("string value", key)
        value = c.buf[s:s + n].decode("utf-8", errors="replace") if n <= _KEEP_STRING_BYTES else None
        return KVInfo(key, vtype, None, 1, value, offset, value_offset)
    value = c.unpack(_SCALARS[vtype], f"{vtype.name} value", key)
    if vtype == GGUFValueType.BOOL:
        value = bool(value)
    return KVInfo(key, vtype, None, 1, value, offset, value_offset)


def _read_array(c: _Cursor, key: str, etype: GGUFValueType, count: int) -> Any:
    if etype == GGUFValueType.STRING:
        # each element needs at least its 8-byte length: refuse an impossible count before looping
        if count > c.left // 8:
            raise c.fail(f"array of {count} strings cannot fit in the {c.left} bytes left in the file", key)
        _skip_strings(c, key, count)
        return None
    fmt = _SCALARS[etype]
    item = struct.calcsize("<" + fmt)
    if count > c.left // item:
        raise c.fail(f"array of {count} {etype.name} ({item} bytes each) cannot fit in the {c.left} bytes "
                     f"left in the file: truncated or corrupt length", key)
    start = c.need(count * item, "array data", key)
    if count > _KEEP_ARRAY_ITEMS:
        return None
    values = list(struct.unpack_from(f"<{count}{fmt}", c.buf, start))
    return [bool(v) for v in values] if etype == GGUFValueType.BOOL else values


def _skip_strings(c: _Cursor, key: str, count: int) -> None:
    """Walks `count` strings (a vocabulary: 10^5 and more) with the checks of `_Cursor.string`
    inlined, about 4x faster than calling it per element."""
    unpack, buf, size, pos = _U64.unpack_from, c.buf, c.size, c.pos
    for j in range(count):
        if size - pos < 8:
            c.pos = pos
            c.need(8, f"string element {j} length", key)
        n = unpack(buf, pos)[0]
        pos += 8
        if n > size - pos:
            raise c.fail(f"file truncated: string element {j} claims {n} bytes at offset {pos}, "
                         f"only {size - pos} remain (file size {size})", key)
        pos += n
    c.pos = pos


def _alignment(c: _Cursor, kv: KVInfo | None) -> int:
    if kv is None:
        return DEFAULT_ALIGNMENT
    if kv.type != GGUFValueType.UINT32:
        raise c.fail(f"expected UINT32, found {kv.type.name}", "general.alignment")
    a = kv.value
    if a == 0 or a & (a - 1):
        raise c.fail(f"expected a power of two, found {a}", "general.alignment")
    return a


def _read_tensor_info(c: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int, int]:
    record = c.pos
    where = f"tensor info #{index}"
    start, n = c.string(f"{where} name", where)
    if n == 0:
        raise c.fail("empty tensor name", where)
    if n > MAX_NAME_BYTES:
        raise c.fail(f"tensor name of {n} bytes exceeds the limit of {MAX_NAME_BYTES}", where)
    name = c.text(start, n, "tensor name", where)
    n_dims = c.unpack("I", "n_dims", name)
    if not 1 <= n_dims <= MAX_DIMS:
        raise c.fail(f"expected 1..{MAX_DIMS} dimensions, found {n_dims}", name)
    s = c.need(8 * n_dims, "dimensions", name)
    dims = struct.unpack_from(f"<{n_dims}Q", c.buf, s)
    type_id = c.unpack("I", "tensor type", name)
    offset = c.unpack("Q", "data offset", name)
    return name, dims, type_id, offset, record


def _check_tensors(c: _Cursor, raw: list, alignment: int, data_offset: int) -> tuple[TensorHeader, ...]:
    out: list[TensorHeader] = []
    seen: set[str] = set()
    for name, dims, type_id, offset, record in raw:
        if name in seen:
            raise c.fail("duplicate tensor name", name)
        seen.add(name)
        for j, d in enumerate(dims):
            if d == 0 or d >= 1 << 62:
                raise c.fail(f"dimension {j} is {d}: expected 1..2^62 (dims {list(dims)})", name)
        try:
            qtype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise c.fail(f"unknown tensor type id {type_id}", name) from None
        if dims[0] % block:
            raise c.fail(f"row length {dims[0]} is not a multiple of the {qtype.name} block size {block}", name)
        n_elements = 1
        for d in dims:
            n_elements *= d  # Python ints: no overflow; bounded by the file-size check below
        if n_elements >= 1 << 63:
            raise c.fail(f"{n_elements} elements (dims {list(dims)}) overflow int64", name)
        n_bytes = n_elements // block * type_size
        if offset % alignment:
            raise c.fail(f"data offset {offset} is not a multiple of the alignment {alignment}", name)
        start = data_offset + offset
        if start + n_bytes > c.size:
            raise c.fail(f"data of {n_bytes} bytes ({qtype.name} {list(reversed(dims))}) at file offset "
                         f"{start} ends past the end of the file ({c.size} bytes): truncated file or "
                         f"corrupt offset/shape", name)
        out.append(TensorHeader(name, tuple(dims), qtype, offset, start, n_bytes, record))
    by_start = sorted(out, key=lambda t: (t.start, t.n_bytes))
    for prev, t in zip(by_start, by_start[1:]):
        if t.start < prev.start + prev.n_bytes:
            raise c.fail(f"data at bytes {t.start}..{t.start + t.n_bytes} overlaps tensor {prev.name!r} "
                         f"at {prev.start}..{prev.start + prev.n_bytes}", t.name)
    return tuple(out)
