"""`mtp_engine.gguf.validate`: hostile GGUF headers, written byte by byte, are refused with an
MTPEngineError naming the file, the key or tensor and the problem, in time and memory bounded by
the header, never by what the header claims."""
from __future__ import annotations

import struct
import time
import tracemalloc
from pathlib import Path

import pytest
from gguf import GGUFReader

from tests.conftest import TINY, need
from mtp_engine.errors import MTPEngineError
from mtp_engine.gguf.reader import GGUFFile
from mtp_engine.gguf.validate import validate_header

U8, U32, F32, BOOL, STR, ARR, U64 = 0, 4, 6, 7, 8, 9, 10
T_F32, T_Q4_K = 0, 12


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def tinfo(name: str | bytes, dims: list[int], ttype: int, offset: int) -> bytes:
    return s(name) + u32(len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + u32(ttype) + \
        struct.pack("<Q", offset)


def gguf(kvs: list[bytes] = (), tensors: list[bytes] = (), data: bytes = b"", version: int = 3,
         n_tensors: int | None = None, n_kv: int | None = None, alignment: int = 32) -> bytes:
    head = b"GGUF" + u32(version) + struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors,
                                                len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(tensors)
    head += bytes(-len(head) % alignment)
    return head + data


def one_tensor(name="w", dims=(8, 2), ttype=T_F32, offset=0, data_bytes=None, kvs=()) -> bytes:
    n = 4 * dims[0] * dims[1] if data_bytes is None else data_bytes
    return gguf(list(kvs), [tinfo(name, list(dims), ttype, offset)], bytes(n))


@pytest.fixture
def write(tmp_path):
    def w(content: bytes) -> Path:
        p = tmp_path / "m.gguf"
        p.write_bytes(content)
        return p
    return w


def refused(path: Path, *needles: str, field: str | None = None) -> str:
    with pytest.raises(MTPEngineError) as info:
        validate_header(path)
    e = info.value
    msg = str(e)
    assert e.file == str(path) and str(path) in msg, msg
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    if field is not None:
        assert e.field == field, (e.field, msg)
    return msg


def test_minimal_file_is_accepted(write):
    h = validate_header(write(one_tensor(kvs=[kv("general.architecture", STR, s("qwen35"))])))
    assert h.version == 3 and h.alignment == 32 and h.value("general.architecture") == "qwen35"
    (t,) = h.tensors
    assert (t.name, t.shape, t.n_bytes, t.start) == ("w", (2, 8), 64, h.data_offset)


@pytest.mark.parametrize("name", ["qwen35-mtp-tiny-Q4_K_M.gguf", "qwen35-mtp-tiny-Q6_K.gguf",
                                  "qwen35-mtp-tiny-f16.gguf"])
def test_agrees_with_gguf_reader_on_fixtures(name):
    path = need(TINY / name)
    h, r = validate_header(path), GGUFReader(path)
    assert h.data_offset == r.data_offset
    assert [(t.name, t.dims, t.qtype, t.start, t.n_bytes) for t in h.tensors] == \
        [(t.name, tuple(int(d) for d in t.shape), t.tensor_type, t.data_offset, t.n_bytes) for t in r.tensors]
    assert set(h.kvs) == {k for k in r.fields if not k.startswith("GGUF.")}


# ---- claims that cannot fit: refused at the count, in bounded time and memory --------------------

HUGE = [
    ("numeric array 2^60", [kv("a.b", ARR, u32(U64) + struct.pack("<Q", 1 << 60))], "a.b", "1152921504606846976"),
    ("string array 2^62", [kv("tok", ARR, u32(STR) + struct.pack("<Q", 1 << 62))], "tok", "strings"),
    ("string 2^63", [kv("k", STR, struct.pack("<Q", 1 << 63))], "k", "truncated"),
    ("array elem string 2^40", [kv("tok", ARR, u32(STR) + struct.pack("<Q", 2) + s("a") + struct.pack("<Q", 1 << 40))],
     "tok", "string element 1"),
    ("key length 2^64-1", [struct.pack("<Q", (1 << 64) - 1)], "key/value #0", "limit"),
]


@pytest.mark.parametrize("kvs,field,needle", [h[1:] for h in HUGE], ids=[h[0] for h in HUGE])
def test_impossible_lengths_refused_fast(write, kvs, field, needle):
    path = write(gguf(kvs) + bytes(10_000_000))  # a 10 MB file claiming far more
    tracemalloc.start()
    t0 = time.perf_counter()
    refused(path, needle, field=field)
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 0.5 and peak < 1 << 20, (elapsed, peak)


@pytest.mark.parametrize("which,field", [("tensors", "tensor_count"), ("kvs", "kv_count")])
@pytest.mark.parametrize("count", [1 << 32, 1 << 60, (1 << 64) - 1])
def test_impossible_counts(write, which, field, count):
    kw = {"n_tensors": count} if which == "tensors" else {"n_kv": count}
    refused(write(gguf(**kw) + bytes(4096)), str(count), "cannot fit", field=field)


# ---- header -------------------------------------------------------------------------------------

@pytest.mark.parametrize("version,needle", [(1, "unsupported GGUF version 1"), (4, "version 4"),
                                            (0x03000000, "big-endian"), (0, "version 0")])
def test_versions(write, version, needle):
    refused(write(gguf(version=version)), needle, field="version")


def test_version_2_accepted(write):
    assert validate_header(write(gguf(version=2))).version == 2


@pytest.mark.parametrize("cut", [5, 8, 12, 20, 23])
def test_header_cut_short(write, cut):
    refused(write(gguf()[:cut]), "truncated")


# ---- key/values ---------------------------------------------------------------------------------

def test_unknown_value_type(write):
    refused(write(gguf([kv("x.y", 13, u32(0))])), "unknown value type 13", field="x.y")


def test_nested_array(write):
    refused(write(gguf([kv("x.y", ARR, u32(ARR) + struct.pack("<Q", 1))])), "nested", field="x.y")


def test_unknown_array_element_type(write):
    refused(write(gguf([kv("x.y", ARR, u32(99) + struct.pack("<Q", 1))])), "element type 99", field="x.y")


def test_duplicate_key(write):
    refused(write(gguf([kv("x.y", U32, u32(1)), kv("x.y", U32, u32(2))])), "duplicate", field="x.y")


def test_reserved_key(write):
    refused(write(gguf([kv("GGUF.version", U32, u32(1))])), "reserved", field="GGUF.version")


def test_empty_and_non_utf8_keys(write):
    refused(write(gguf([kv(b"", U32, u32(1))])), "empty key")
    refused(write(gguf([kv(b"bad\xff", U32, u32(1))])), "UTF-8")


def test_key_with_control_characters_stays_one_line(write):
    msg = refused(write(gguf([kv("a\nb", U32, u32(1)), kv("a\nb", U32, u32(1))])), "duplicate")
    assert "a\\nb" in msg


@pytest.mark.parametrize("payload,needle", [(kv("general.alignment", U64, struct.pack("<Q", 32)), "UINT32"),
                                            (kv("general.alignment", U32, u32(0)), "power of two"),
                                            (kv("general.alignment", U32, u32(48)), "power of two")])
def test_bad_alignment(write, payload, needle):
    refused(write(gguf([payload])), needle, field="general.alignment")


# ---- tensor infos -------------------------------------------------------------------------------

def test_unknown_tensor_type_names_the_tensor(write):
    refused(write(one_tensor("output.weight", ttype=99)), "unknown tensor type id 99", field="output.weight")
    refused(write(one_tensor("output.weight", ttype=4)), "unknown tensor type id 4", field="output.weight")


@pytest.mark.parametrize("dims,needle", [([8, 0], "dimension 1 is 0"), ([1 << 62, 1 << 62], "dimension 0"),
                                         ([1 << 40, 1 << 40, 1 << 40], "overflow int64"),
                                         ([8, 2, 1, 1, 1], "1..4 dimensions"), ([], "1..4 dimensions")])
def test_bad_dims(write, dims, needle):
    refused(write(gguf([], [tinfo("w", dims, T_F32, 0)], bytes(64))), needle, field="w")


def test_row_not_multiple_of_block(write):
    refused(write(one_tensor(dims=(100, 2), ttype=T_Q4_K, data_bytes=288)), "block size 256", field="w")


def test_data_past_end_of_file(write):
    refused(write(one_tensor(dims=(8, 2), data_bytes=63)), "past the end of the file", "truncated", field="w")
    refused(write(one_tensor(offset=1 << 63)), "past the end", field="w")


def test_unaligned_offset(write):
    refused(write(one_tensor(offset=4, data_bytes=128)), "alignment 32", field="w")


def test_overlapping_tensors(write):
    ts = [tinfo("a", [16], T_F32, 0), tinfo("b", [16], T_F32, 32)]
    refused(write(gguf([], ts, bytes(128))), "overlaps tensor 'a'", field="b")


def test_tensor_names(write):
    refused(write(one_tensor("x" * 64)), "64 bytes", "limit of 63")
    refused(write(one_tensor("")), "empty tensor name")
    ts = [tinfo("a", [8], T_F32, 0), tinfo("a", [8], T_F32, 32)]
    refused(write(gguf([], ts, bytes(64))), "duplicate tensor name", field="a")


def test_gguf_file_runs_validation_first(write):
    """GGUFFile refuses through validate_header before GGUFReader sees the file."""
    path = write(gguf([kv("a.b", ARR, u32(U64) + struct.pack("<Q", 1 << 60))]) + bytes(1000))
    with pytest.raises(MTPEngineError) as info:
        GGUFFile(path)
    assert info.value.field == "a.b" and "corrupt or truncated GGUF (" not in str(info.value)


def test_special_files_are_refused(tmp_path):
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)  # opening it for reading would block until a writer appears
    refused(fifo, "regular")
