"""Memory bounded by what the file is: metadata arrays read in bulk (an unused 1M-element array
used to cost 690 MB), vocabulary entries of bounded length, and the metadata values the engine
uses range-checked at load (context length, token types), each error naming the file and key."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType as VT

from tests.conftest import TINY_Q8, need, write_gguf_copy
from mtp_engine.api import load
from mtp_engine.errors import MTPEngineError
from mtp_engine.gguf.reader import GGUFFile
from mtp_engine.tokenizer.tokenizer import MAX_TOKEN_BYTES, Tokenizer

SRC = TINY_Q8  # the full set's Q8_0, else the vendored Q4_K_M


@pytest.fixture(scope="module")
def src() -> GGUFReader:
    return GGUFReader(need(SRC))


def _write(src, path, set_keys=None):
    return write_gguf_copy(src, path, set_keys)


def test_bulk_fields_match_gguf_reader(src):
    ours = GGUFFile(SRC).reader
    assert list(ours.fields) == list(src.fields)
    for key, f in src.fields.items():
        g = ours.fields[key]
        assert g.types == f.types and list(g.data) == list(f.data) and len(g.parts) == len(f.parts), key
        assert g.contents() == f.contents(), key
        for i in sorted({0, 1, 2, len(f.parts) - 1} & set(range(len(f.parts)))):
            assert bytes(g.parts[i]) == bytes(f.parts[i]), (key, i)


def test_big_unused_arrays_cost_little(src, tmp_path):
    path = _write(src, tmp_path / "arrays.gguf", {
        "x.bytes": (np.zeros(400_000, dtype=np.uint8).tolist(), VT.ARRAY, VT.UINT8),
        "x.strings": ([""] * 100_000, VT.ARRAY, VT.STRING),
    })
    tracemalloc.start()
    try:
        gf = GGUFFile(path)
        Tokenizer.from_gguf(gf.reader, gf.path)
        assert gf.get("x.bytes")[:3] == [0, 0, 0] and len(gf.get("x.strings")) == 100_000
        del gf
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # GGUFReader's per-element views take ~690 bytes per UINT8 and ~1.6 KB per empty string: ~430 MB here
    assert peak < 40 << 20, f"{peak / 2**20:.0f} MiB"
    load(path)  # and the model still loads


def _tokens(src):
    return [bytes(src.fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in src.fields["tokenizer.ggml.tokens"].data]


def _types(src):
    return src.fields["tokenizer.ggml.token_type"].contents()


def test_long_vocabulary_entry_refused(src, tmp_path):
    tokens = _tokens(src)
    tokens[5] = "a" * (MAX_TOKEN_BYTES + 1)
    path = _write(src, tmp_path / "long.gguf", {"tokenizer.ggml.tokens": (tokens, VT.ARRAY, VT.STRING)})
    with pytest.raises(MTPEngineError, match=f"token 5 is {MAX_TOKEN_BYTES + 1} bytes long") as ei:
        load(path)
    assert ei.value.field == "tokenizer.ggml.tokens" and str(path) in str(ei.value)


@pytest.mark.parametrize("bad", [99, -7])
def test_token_type_out_of_range(src, tmp_path, bad):
    types = _types(src)
    types[3] = bad
    path = _write(src, tmp_path / "types.gguf", {"tokenizer.ggml.token_type": (types, VT.ARRAY, VT.INT32)})
    with pytest.raises(MTPEngineError, match=f"token 3 has type {bad}") as ei:
        load(path)
    assert ei.value.field == "tokenizer.ggml.token_type" and str(path) in str(ei.value)


@pytest.mark.parametrize("value,vtype", [(0, VT.UINT32), (-1, VT.INT32), (1 << 40, VT.UINT64)])
def test_context_length_range(src, tmp_path, value, vtype):
    path = _write(src, tmp_path / "ctx.gguf", {"qwen35.context_length": (value, vtype)})
    with pytest.raises(MTPEngineError, match="expected 1..2\\^24 positions") as ei:
        load(path)
    assert ei.value.field == "qwen35.context_length" and str(path) in str(ei.value)
