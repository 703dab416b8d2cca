"""Structure-aware mutations of GGUF files for scripts/fuzz_gguf.py.

Each mutator takes (rng, data, seed) and edits `data` (a bytearray copy of the seed file) in place,
using the seed's header layout from `validate_header` to hit real fields: lengths, counts, type
ids, dims, offsets, metadata values, tokenizer strings and tensor bytes. `make_case` picks one to
three of them; case i of a run depends only on (run seed, i).
"""
from __future__ import annotations

import random
import struct
from dataclasses import dataclass

from mtp_engine.gguf.validate import Header

__all__ = ["Seed", "MUTATORS", "make_case"]

BIG = [0, 1, 2, 3, 255, 256, 65535, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40, 1 << 60, (1 << 63) - 1,
       1 << 63, (1 << 64) - 1]


@dataclass
class Seed:
    name: str
    data: bytes
    header: Header


def _put(data: bytearray, off: int, fmt: str, value) -> None:
    if 0 <= off and off + struct.calcsize("<" + fmt) <= len(data):
        struct.pack_into("<" + fmt, data, off, value)


def _interesting(rng: random.Random, current: int, size: int) -> int:
    return rng.choice(BIG + [current + 1, current - 1 if current else 0, current * 2, size, size - 1,
                             size // 2, rng.randrange(1 << 64)]) % (1 << 64)


def _kv_layout(kv) -> dict[str, int]:
    key_len = len(kv.key.encode())
    return {"key_len": kv.offset, "type": kv.offset + 8 + key_len, "value": kv.value_offset}


def _tensor_layout(t) -> dict[str, int]:
    name_len = len(t.name.encode())
    n_dims_at = t.record_offset + 8 + name_len
    dims_at = n_dims_at + 4
    type_at = dims_at + 8 * len(t.dims)
    return {"name_len": t.record_offset, "n_dims": n_dims_at, "dims": dims_at, "type": type_at,
            "offset": type_at + 4}


def m_bit_flips(rng, data, s):
    end = s.header.data_offset if rng.random() < 0.8 else len(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(end)
        data[i] ^= 1 << rng.randrange(8)
    return "bit flips"


def m_byte_stores(rng, data, s):
    end = s.header.data_offset if rng.random() < 0.8 else len(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(end)
        data[i] = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0x20, rng.randrange(256)])
    return "byte stores"


def m_truncate(rng, data, s):
    h = s.header
    cut = rng.choice([rng.randrange(len(data)), rng.randrange(h.data_offset + 1),
                      rng.choice(h.tensors).start + rng.randrange(64), len(data) - rng.randint(1, 64)])
    del data[max(cut, 0):]
    return f"truncate at {cut}"


def m_header_counts(rng, data, s):
    which = rng.choice(["tensor_count", "kv_count"])
    off = 8 if which == "tensor_count" else 16
    cur = struct.unpack_from("<Q", data, off)[0]
    v = _interesting(rng, cur, len(data))
    _put(data, off, "Q", v)
    return f"{which} = {v}"


def m_version(rng, data, s):
    v = rng.choice([0, 1, 2, 4, 99, 1 << 16, 0x03000000, (1 << 32) - 1])
    _put(data, 4, "I", v)
    return f"version = {v}"


def m_kv_lengths(rng, data, s):
    kv = rng.choice(list(s.header.kvs.values()))
    lay = _kv_layout(kv)
    if kv.elem_type is not None and rng.random() < 0.6:
        v = _interesting(rng, kv.count, len(data))
        _put(data, lay["value"] + 4, "Q", v)
        return f"array length of {kv.key} = {v}"
    if kv.type.name == "STRING" and rng.random() < 0.5:
        v = _interesting(rng, struct.unpack_from("<Q", data, lay["value"])[0], len(data))
        _put(data, lay["value"], "Q", v)
        return f"string length of {kv.key} = {v}"
    v = _interesting(rng, len(kv.key), len(data))
    _put(data, lay["key_len"], "Q", v)
    return f"key length of {kv.key} = {v}"


def m_string_elements(rng, data, s):
    """A length inside a string array (tokens, merges), or its bytes."""
    arrays = [kv for kv in s.header.kvs.values() if kv.elem_type is not None and kv.elem_type.name == "STRING"
              and kv.count]
    kv = rng.choice(arrays)
    off = kv.value_offset + 12
    j = rng.randrange(kv.count)
    for _ in range(j):
        off += 8 + struct.unpack_from("<Q", data, off)[0]
    n = struct.unpack_from("<Q", data, off)[0]
    r = rng.random()
    if r < 0.4:
        v = _interesting(rng, n, len(data))
        _put(data, off, "Q", v)
        return f"{kv.key}[{j}] length = {v}"
    if n == 0:
        return f"{kv.key}[{j}] empty, unchanged"
    i = off + 8 + rng.randrange(n)
    data[i] = rng.choice([0x80, 0xC0, 0xFF, 0x20, 0x00, ord("<"), rng.randrange(256)])
    return f"{kv.key}[{j}] byte {i - off - 8} = {data[i]:#x}"


def m_value_types(rng, data, s):
    kv = rng.choice(list(s.header.kvs.values()))
    lay = _kv_layout(kv)
    v = rng.choice(list(range(14)) + [99, (1 << 32) - 1])
    if kv.elem_type is not None and rng.random() < 0.5:
        _put(data, lay["value"], "I", v)
        return f"array element type of {kv.key} = {v}"
    _put(data, lay["type"], "I", v)
    return f"value type of {kv.key} = {v}"


def m_scalar_values(rng, data, s):
    scalars = [kv for kv in s.header.kvs.values() if kv.elem_type is None and kv.type.name != "STRING"]
    kv = rng.choice(scalars)
    t = kv.type.name
    off = kv.value_offset
    if t in ("FLOAT32", "FLOAT64"):
        v = rng.choice([0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e-30, 1e30, 3.4e38])
        _put(data, off, "f" if t == "FLOAT32" else "d", v)
    else:
        fmt = {"UINT8": "B", "INT8": "b", "UINT16": "H", "INT16": "h", "UINT32": "I", "INT32": "i",
               "UINT64": "Q", "INT64": "q", "BOOL": "B"}[t]
        bits = struct.calcsize(fmt) * 8
        raw = rng.choice([0, 1, 2, 3, 7, 64, 513, 4095, 4097, (1 << bits) - 1, 1 << (bits - 1), kv.value * 2
                          if isinstance(kv.value, int) else 0, rng.randrange(1 << bits)]) % (1 << bits)
        v = raw - (1 << bits) if fmt.islower() and raw >= 1 << (bits - 1) else raw
        _put(data, off, fmt, v)
    return f"{kv.key} = {v}"


def m_numeric_arrays(rng, data, s):
    arrays = [kv for kv in s.header.kvs.values() if kv.elem_type is not None and kv.elem_type.name != "STRING"
              and kv.count]
    kv = rng.choice(arrays)
    size = struct.calcsize("<" + {"BOOL": "B", "INT32": "i", "UINT32": "I", "FLOAT32": "f"}.get(kv.elem_type.name, "Q"))
    j = rng.randrange(kv.count)
    off = kv.value_offset + 12 + j * size
    for k in range(size):
        data[off + k] = rng.choice([0x00, 0xFF, 0x7F, 0x80, rng.randrange(256)])
    return f"{kv.key}[{j}] bytes"


def m_tensor_type(rng, data, s):
    t = rng.choice(s.header.tensors)
    v = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 13, 14, 16, 24, 26, 28, 30, 31, 34, 39, 40, 41, 42, 99,
                    (1 << 32) - 1])
    _put(data, _tensor_layout(t)["type"], "I", v)
    return f"type of {t.name} = {v}"


def m_tensor_shape(rng, data, s):
    t = rng.choice(s.header.tensors)
    lay = _tensor_layout(t)
    r = rng.random()
    if r < 0.2:
        v = rng.choice([0, 1, 2, 3, 5, 8, (1 << 32) - 1])
        _put(data, lay["n_dims"], "I", v)
        return f"n_dims of {t.name} = {v}"
    if r < 0.4 and len(t.dims) > 1:
        dims = list(reversed(t.dims))
        for j, d in enumerate(dims):
            _put(data, lay["dims"] + 8 * j, "Q", d)
        return f"dims of {t.name} swapped"
    j = rng.randrange(len(t.dims))
    v = rng.choice([0, 1, t.dims[j] * 2, t.dims[j] // 2, t.dims[j] + 1, t.dims[j] + 32, t.dims[j] + 256,
                    1 << 31, 1 << 32, 1 << 62, (1 << 64) - 1])
    _put(data, lay["dims"] + 8 * j, "Q", v)
    return f"dim {j} of {t.name} = {v}"


def m_tensor_offset(rng, data, s):
    h = s.header
    t = rng.choice(h.tensors)
    other = rng.choice(h.tensors)
    v = rng.choice([t.offset + 1, t.offset + 32, other.offset, other.offset + 32, len(data) - h.data_offset,
                    len(data), 0, 1 << 40, 1 << 63, (1 << 64) - 1, _interesting(rng, t.offset, len(data))])
    _put(data, _tensor_layout(t)["offset"], "Q", v % (1 << 64))
    return f"offset of {t.name} = {v}"


def m_tensor_name(rng, data, s):
    h = s.header
    t = rng.choice(h.tensors)
    lay = _tensor_layout(t)
    if rng.random() < 0.5:
        v = _interesting(rng, len(t.name), len(data))
        _put(data, lay["name_len"], "Q", v)
        return f"name length of {t.name} = {v}"
    other = rng.choice(h.tensors)
    raw = other.name.encode()[: len(t.name)].ljust(len(t.name), b"x")
    data[lay["name_len"] + 8: lay["name_len"] + 8 + len(raw)] = raw
    return f"name of {t.name} = {raw!r}"


def m_duplicate_key(rng, data, s):
    kvs = list(s.header.kvs.values())
    a, b = rng.sample(kvs, 2)
    ka, kb = a.key.encode(), b.key.encode()
    if len(ka) != len(kb):
        return "duplicate key: lengths differ, unchanged"
    data[b.offset + 8: b.offset + 8 + len(kb)] = ka
    return f"key {b.key} renamed {a.key}"


def m_tensor_data(rng, data, s):
    t = rng.choice(s.header.tensors)
    kind = rng.choice(["nan16", "inf16", "nan32", "random", "ones", "zeros"])
    n = min(t.n_bytes, rng.choice([2, 4, 64, 4096, t.n_bytes]))
    start = t.start + rng.randrange(max(t.n_bytes - n, 0) + 1) // 2 * 2
    if kind == "random":
        data[start:start + n] = rng.randbytes(n)
    else:
        unit = {"nan16": b"\x00\x7e", "inf16": b"\x00\x7c", "nan32": b"\x00\x00\xc0\x7f", "ones": b"\xff",
                "zeros": b"\x00"}[kind]
        data[start:start + n] = (unit * (n // len(unit) + 1))[:n]
    return f"{kind} data in {t.name} ({n} bytes)"


def m_alignment(rng, data, s):
    kv = s.header.kvs.get("general.alignment")
    if kv is None:
        return "no general.alignment, unchanged"
    v = rng.choice([0, 1, 3, 16, 64, 1 << 31, (1 << 32) - 1])
    _put(data, kv.value_offset, "I", v)
    return f"general.alignment = {v}"


MUTATORS = [(m_bit_flips, 12), (m_byte_stores, 8), (m_truncate, 8), (m_header_counts, 4), (m_version, 2),
            (m_kv_lengths, 8), (m_string_elements, 8), (m_value_types, 6), (m_scalar_values, 12),
            (m_numeric_arrays, 4), (m_tensor_type, 6), (m_tensor_shape, 8), (m_tensor_offset, 6),
            (m_tensor_name, 4), (m_duplicate_key, 2), (m_tensor_data, 8), (m_alignment, 1)]


def make_case(seeds: list[Seed], run_seed: int, index: int) -> tuple[bytes, str]:
    """The bytes of case `index` and a description of its mutations."""
    rng = random.Random(run_seed * 1_000_003 + index)
    s = rng.choice(seeds)
    data = bytearray(s.data)
    fns, weights = zip(*MUTATORS)
    steps = []
    for fn in rng.choices(fns, weights, k=rng.choice([1, 1, 1, 2, 3])):
        try:
            steps.append(fn(rng, data, s))
        except Exception as e:  # noqa: BLE001 - a later step read what an earlier one broke
            steps.append(f"{fn.__name__} skipped ({type(e).__name__})")
    return bytes(data), f"{s.name}: " + "; ".join(steps)
