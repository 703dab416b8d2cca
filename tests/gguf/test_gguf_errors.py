"""Bad GGUF input gives `MTPEngineError` naming the file, the key or tensor, and expected vs found.

Bad files are written into a temporary folder with `gguf.GGUFWriter`: a copy of the tiny f32 fixture
(metadata and tensors read back with `gguf.GGUFReader`) with one thing altered, or the fixture cut
short at various byte offsets. Also the CLI: a bad model file gives exit code 2 and one
`mtp-engine: error:` line on stderr, no traceback.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType as VT, GGUFWriter

from tests.conftest import ROOT, TINY, copy_metadata, need
from mtp_engine.api import load
from mtp_engine.cli.main import main as cli_main
from mtp_engine.errors import MTPEngineError
from mtp_engine.model.config import Qwen35Config
from mtp_engine.gguf.reader import GGUFFile
from mtp_engine.model.loader import load_gguf

SRC_NAME = "qwen35-mtp-tiny-f32.gguf"


@pytest.fixture(scope="module")
def src() -> GGUFReader:
    return GGUFReader(need(TINY / SRC_NAME))


@pytest.fixture
def make_gguf(src, tmp_path):
    """make_gguf(name, arch=..., set_keys={key: (value, vtype, subtype)}, drop_keys=..., drop_tensors=...,
    tensors={name: (array, raw_dtype)}) writes an altered copy of the fixture; files go away after the test."""
    made: list[Path] = []

    def make(name: str, *, arch: str = "qwen35", set_keys=None, drop_keys=(), drop_tensors=(), tensors=None,
             no_arch: bool = False) -> Path:
        path = tmp_path / f"{name}.gguf"
        w = GGUFWriter(path, arch)
        if no_arch:
            del w.kv_data[0]["general.architecture"]
        for key, args in copy_metadata(src, w, set_keys, drop_keys).items():  # keys the fixture does not have
            w.add_key_value(key, *args)
        tensors = dict(tensors or {})
        for t in src.tensors:
            if t.name in drop_tensors:
                continue
            if t.name in tensors:
                arr, raw_dtype = tensors.pop(t.name)
                w.add_tensor(t.name, arr, raw_dtype=raw_dtype)
            else:
                w.add_tensor(t.name, np.asarray(t.data))
        assert not tensors, f"no such tensors in the fixture: {list(tensors)}"
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        made.append(path)
        return path

    yield make
    for p in made:
        p.unlink(missing_ok=True)


def expect_error(path, *needles: str, loader=load_gguf) -> str:
    """Loads `path`, expecting MTPEngineError whose message names the file and contains every needle."""
    with pytest.raises(MTPEngineError) as info:
        loader(path)
    msg = str(info.value)
    assert str(path) in msg, f"message does not name the file: {msg}"
    for n in needles:
        assert n in msg, f"message lacks {n!r}: {msg}"
    return msg


def test_unaltered_copy_loads(make_gguf):
    """The copy helper itself yields a loadable model (so every failure below is the alteration's)."""
    model, gf, _ = load_gguf(make_gguf("copy"))
    assert model.mtp is not None and gf.has_tensor("blk.4.nextn.eh_proj.weight")


# ---- metadata -------------------------------------------------------------------------------------

def test_wrong_architecture(make_gguf):
    msg = expect_error(make_gguf("llama", arch="llama"), "general.architecture", "'llama'", "qwen35")
    assert "unsupported" in msg


def test_missing_architecture(make_gguf):
    expect_error(make_gguf("noarch", no_arch=True), "general.architecture", "missing")


def test_architecture_of_wrong_kind(make_gguf):
    p = make_gguf("arch_int", no_arch=True, set_keys={"general.architecture": (35, VT.UINT32, None)})
    expect_error(p, "general.architecture", "expected str", "int")


@pytest.mark.parametrize("key", ["qwen35.ssm.conv_kernel", "qwen35.block_count", "qwen35.embedding_length",
                                 "qwen35.attention.head_count", "qwen35.ssm.state_size",
                                 "qwen35.feed_forward_length"])
def test_missing_required_key(make_gguf, key):
    expect_error(make_gguf("missing_key", drop_keys=(key,)), key, "missing")


def test_required_key_of_wrong_kind(make_gguf):
    p = make_gguf("conv_str", set_keys={"qwen35.ssm.conv_kernel": ("four", VT.STRING, None)})
    expect_error(p, "qwen35.ssm.conv_kernel", "expected int", "four")


def test_required_key_of_float_kind(make_gguf):
    p = make_gguf("conv_float", set_keys={"qwen35.ssm.conv_kernel": (4.0, VT.FLOAT32, None)})
    expect_error(p, "qwen35.ssm.conv_kernel", "expected int", "float")


# Absurd values: Qwen35Config.from_gguf / validate. The message must name the GGUF key (the part after
# "qwen35." is enough) and the value found.
ABSURD = [
    ("kv_not_dividing", {"qwen35.attention.head_count_kv": (3, VT.UINT32, None)}, "attention.head_count_kv", "3"),
    ("kv_zero", {"qwen35.attention.head_count_kv": (0, VT.UINT32, None)}, "attention.head_count_kv", "0"),
    ("heads_zero", {"qwen35.attention.head_count": (0, VT.UINT32, None)}, "attention.head_count", "0"),
    ("hidden_zero", {"qwen35.embedding_length": (0, VT.UINT32, None)}, "embedding_length", "0"),
    ("hidden_huge", {"qwen35.embedding_length": (1 << 30, VT.UINT32, None)}, "embedding_length", str(1 << 30)),
    ("state_zero", {"qwen35.ssm.state_size": (0, VT.UINT32, None)}, "ssm.state_size", "0"),
    ("conv_zero", {"qwen35.ssm.conv_kernel": (0, VT.UINT32, None)}, "ssm.conv_kernel", "0"),
    ("vheads_not_multiple", {"qwen35.ssm.time_step_rank": (3, VT.UINT32, None)}, "ssm.time_step_rank", "3"),
    ("inner_not_multiple", {"qwen35.ssm.inner_size": (250, VT.UINT32, None)}, "ssm.inner_size", "250"),
    ("rot_odd", {"qwen35.rope.dimension_count": (31, VT.UINT32, None)}, "rope.dimension_count", "31"),
    ("rot_too_big", {"qwen35.rope.dimension_count": (256, VT.UINT32, None)}, "rope.dimension_count", "256"),
    ("eps_zero", {"qwen35.attention.layer_norm_rms_epsilon": (0.0, VT.FLOAT32, None)},
     "attention.layer_norm_rms_epsilon", "0"),
    ("eps_nan", {"qwen35.attention.layer_norm_rms_epsilon": (float("nan"), VT.FLOAT32, None)},
     "attention.layer_norm_rms_epsilon", "nan"),
    ("rope_base_small", {"qwen35.rope.freq_base": (0.5, VT.FLOAT32, None)}, "rope.freq_base", "0.5"),
    ("blocks_zero", {"qwen35.block_count": (0, VT.UINT32, None)}, "block_count", "0"),
    ("all_blocks_mtp", {"qwen35.nextn_predict_layers": (5, VT.UINT32, None)}, "nextn_predict_layers", "5"),
    ("ffn_wrong_len", {"qwen35.feed_forward_length": ([512] * 3, VT.ARRAY, VT.UINT32)}, "feed_forward_length", "3"),
    ("ffn_zero", {"qwen35.feed_forward_length": (0, VT.UINT32, None)}, "feed_forward_length", "0"),
    ("flags_short", {"qwen35.attention.recurrent_layers": ([True, False], VT.ARRAY, VT.BOOL)},
     "attention.recurrent_layers", "False"),
    ("value_len_differs", {"qwen35.attention.value_length": (64, VT.UINT32, None)}, "attention.value_length", "64"),
    ("key_len_zero", {"qwen35.attention.key_length": (0, VT.UINT32, None), "qwen35.attention.value_length":
                      (0, VT.UINT32, None)}, "attention.key_length", "0"),
]


@pytest.mark.parametrize("name,keys,key,found", ABSURD, ids=[a[0] for a in ABSURD])
def test_config_rejects_absurd_values(make_gguf, name, keys, key, found):
    expect_error(make_gguf(name, set_keys=keys), key, found)


def test_config_interval_zero_without_flags(make_gguf):
    p = make_gguf("interval0", drop_keys=("qwen35.attention.recurrent_layers",),
                  set_keys={"qwen35.full_attention_interval": (0, VT.UINT32, None)})
    expect_error(p, "qwen35.full_attention_interval", "0")


# Malformed optional keys: a value of the wrong kind must also be an MTPEngineError naming the key, not
# a bare ValueError/TypeError/ZeroDivisionError from int()/float()/`//` (which the CLI would print as a
# traceback).
MALFORMED = [
    ("rope_base_str", {"qwen35.rope.freq_base": ("big", VT.STRING, None)}, "rope.freq_base"),
    ("rot_str", {"qwen35.rope.dimension_count": ("x", VT.STRING, None)}, "rope.dimension_count"),
    ("eps_array", {"qwen35.attention.layer_norm_rms_epsilon": ([1e-6, 1e-6], VT.ARRAY, VT.FLOAT32)},
     "attention.layer_norm_rms_epsilon"),
    ("context_str", {"qwen35.context_length": ("long", VT.STRING, None)}, "context_length"),
    ("vocab_str", {"qwen35.vocab_size": ("x", VT.STRING, None)}, "vocab_size"),
    ("ffn_str_array", {"qwen35.feed_forward_length": (["a"] * 5, VT.ARRAY, VT.STRING)}, "feed_forward_length"),
    ("kv_str_array", {"qwen35.attention.head_count_kv": (["a"], VT.ARRAY, VT.STRING)}, "attention.head_count_kv"),
    ("kv_fraction", {"qwen35.attention.head_count_kv": (1.5, VT.FLOAT32, None)}, "attention.head_count_kv"),
    ("key_len_str", {"qwen35.attention.key_length": ("128", VT.STRING, None)}, "attention.key_length"),
    ("nextn_str", {"qwen35.nextn_predict_layers": ("one", VT.STRING, None)}, "nextn_predict_layers"),
    ("ffn_str", {"qwen35.feed_forward_length": ("x", VT.STRING, None)}, "feed_forward_length"),
]


@pytest.mark.parametrize("name,keys,key", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_config_rejects_malformed_optional_keys(make_gguf, name, keys, key):
    expect_error(make_gguf(name, set_keys=keys), key)


def test_config_heads_zero_without_key_length(make_gguf):
    """head_dim defaults to embedding_length // head_count: head_count 0 must not divide by zero."""
    p = make_gguf("heads0_nokeylen", drop_keys=("qwen35.attention.key_length", "qwen35.attention.value_length"),
                  set_keys={"qwen35.attention.head_count": (0, VT.UINT32, None)})
    expect_error(p, "attention.head_count", "0")


def test_from_gguf_directly(make_gguf):
    """Qwen35Config.from_gguf on a GGUFFile raises the same error as the loader."""
    p = make_gguf("kv3", set_keys={"qwen35.attention.head_count_kv": (3, VT.UINT32, None)})
    gf = GGUFFile(p)
    with pytest.raises(MTPEngineError) as info:
        Qwen35Config.from_gguf(gf)
    assert info.value.file == str(p) and "head_count_kv" in (info.value.field or "")
    cfg = Qwen35Config.from_gguf(GGUFFile(need(TINY / SRC_NAME)))
    assert (cfg.n_layer, cfg.n_mtp, cfg.n_head, cfg.n_head_kv) == (4, 1, 2, 1)


def test_missing_tokenizer_key_via_api_load(make_gguf):
    p = make_gguf("nomerges", drop_keys=("tokenizer.ggml.merges",))
    expect_error(p, "tokenizer.ggml.merges", loader=load)


def test_vocabulary_larger_than_embedding(src, make_gguf):
    """A token id past token_embd.weight's rows would be looked up out of bounds (silently): refused."""
    tokens = src.fields["tokenizer.ggml.tokens"].contents() + ["<|extra|>"]
    types = src.fields["tokenizer.ggml.token_type"].contents() + [3]
    p = make_gguf("vocab513", set_keys={"tokenizer.ggml.tokens": (tokens, VT.ARRAY, VT.STRING),
                                        "tokenizer.ggml.token_type": (types, VT.ARRAY, VT.INT32)})
    expect_error(p, "tokenizer.ggml.tokens", "513 tokens", "512 rows", loader=load)


# ---- tensors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,shape", [("blk.3.attn_q.weight", (256, 256)),  # expected [512, 256]
                                        ("blk.0.ssm_conv1d.weight", (512, 3)),  # expected [512, 4]
                                        ("blk.1.ssm_norm.weight", (32,)),  # expected [64]
                                        ("blk.4.nextn.eh_proj.weight", (256, 256))])  # expected [256, 512]
def test_tensor_with_unexpected_shape(make_gguf, name, shape):
    p = make_gguf("shape", tensors={name: (np.zeros(shape, np.float32), None)})
    msg = expect_error(p, name, "unexpected shape", str(list(shape)))
    assert "expected" in msg


@pytest.mark.parametrize("name", ["blk.2.ssm_a", "token_embd.weight", "output_norm.weight",
                                  "blk.3.attn_k_norm.weight", "blk.4.nextn.shared_head_norm.weight"])
def test_missing_tensor(make_gguf, name):
    expect_error(make_gguf("missing_tensor", drop_tensors=(name,)), name, "missing")


def test_missing_output_weight_means_tied_embeddings(make_gguf):
    model, _, _ = load_gguf(make_gguf("tied", drop_tensors=("output.weight",)))
    assert model.lm_head is model.embed and model.cfg.tied_embeddings


def _q_bytes(shape: tuple[int, int], qtype: QT) -> np.ndarray:
    from gguf.constants import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[qtype]
    return np.zeros((shape[0], shape[1] // block * size), np.uint8)


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.IQ4_NL, QT.IQ2_XXS, QT.TQ1_0])
def test_unsupported_quant_type(make_gguf, qtype):
    name = "blk.0.ffn_gate.weight"  # [512, 256]
    p = make_gguf("unsupported", tensors={name: (_q_bytes((512, 256), qtype), qtype)})
    expect_error(p, name, "unsupported tensor type", qtype.name, "Q4_K")


@pytest.mark.parametrize("arr,raw,found", [
    (np.zeros((256,), np.float64), None, "F64"),
    (np.zeros((256 // 32 * 34,), np.uint8), QT.Q8_0, "Q8_0"),
])
def test_vector_of_non_float_type(make_gguf, arr, raw, found):
    name = "blk.0.attn_norm.weight"
    expect_error(make_gguf("vector_type", tensors={name: (arr, raw)}), name, "expected a float tensor", found)


def test_integer_matrix(make_gguf):
    name = "blk.0.ffn_up.weight"
    expect_error(make_gguf("i32", tensors={name: (np.zeros((512, 256), np.int32), None)}), name, "I32")


def _patched_type(tmp_path: Path, src: GGUFReader, index: int, type_id: int) -> tuple[Path, str]:
    t = src.tensors[index]
    off = t.field.offset + sum(part.nbytes for part in t.field.parts[:4])  # name len, name, n_dims, dims
    data = bytearray(Path(src.data.filename).read_bytes())
    assert int(np.frombuffer(bytes(data[off:off + 4]), "<u4")[0]) == int(t.tensor_type)
    data[off:off + 4] = np.array([type_id], "<u4").tobytes()
    p = tmp_path / f"type{type_id}.gguf"
    p.write_bytes(bytes(data))
    return p, t.name


def test_unknown_tensor_type_id(src, tmp_path):
    """A type id GGML does not define (99): a clean MTPEngineError naming the file, the tensor and the id
    (found by our own header parser, before gguf.GGUFReader fails without naming the tensor)."""
    p, name = _patched_type(tmp_path, src, 0, 99)
    try:
        expect_error(p, "unknown tensor type id 99", name)
    finally:
        p.unlink()


def test_removed_tensor_type_id(src, tmp_path):
    """Type id 4 (the removed Q4_2): a clean MTPEngineError naming the file, the tensor and the id."""
    p, name = _patched_type(tmp_path, src, 0, 4)
    try:
        expect_error(p, "unknown tensor type id 4", name)
    finally:
        p.unlink()


# ---- damaged files ------------------------------------------------------------------------------

def _cut_points(src: GGUFReader) -> dict[str, int]:
    size = int(src.data.shape[0])
    ti = int(src.tensors[0].field.offset)  # start of the tensor infos
    do = int(src.data_offset)  # start of the tensor data
    tok = int(src.fields["tokenizer.ggml.tokens"].offset)
    return {"magic_only": 4, "in_version": 6, "version": 8, "in_counts": 20, "counts": 24, "first_key": 30,
            "in_tokens": tok + 100, "tensor_infos_start": ti, "in_tensor_info": ti + 10,
            "tensor_infos_mid": (ti + do) // 2, "data_start": do, "in_first_tensor": do + 1000,
            "data_mid": (do + size) // 2, "last_byte_missing": size - 1, "last_4_bytes_missing": size - 4}


CUTS = ["magic_only", "in_version", "version", "in_counts", "counts", "first_key", "in_tokens",
        "tensor_infos_start", "in_tensor_info", "tensor_infos_mid", "data_start", "in_first_tensor", "data_mid",
        "last_byte_missing", "last_4_bytes_missing"]


@pytest.mark.parametrize("where", CUTS)
def test_truncated_file(src, tmp_path, where):
    n = _cut_points(src)[where]
    p = tmp_path / f"cut_{where}.gguf"
    with open(src.data.filename, "rb") as f:
        p.write_bytes(f.read(n))
    try:
        msg = expect_error(p)
        assert "truncated" in msg or "corrupt" in msg, msg
    finally:
        p.unlink()


@pytest.mark.parametrize("content,found", [(b"", "b''"), (b"GGU", "b'GGU'"), (b"hello world, not a model\n", "b'hell'"),
                                           (b"PK\x03\x04" + bytes(100), "PK")])
def test_not_a_gguf_file(tmp_path, content, found):
    p = tmp_path / "model.gguf"
    p.write_bytes(content)
    expect_error(p, "not a GGUF file", found, "GGUF")


def test_unsupported_gguf_version(src, tmp_path):
    data = bytearray(Path(src.data.filename).read_bytes()[:4096])
    data[4:8] = np.array([99], "<u4").tobytes()
    p = tmp_path / "v99.gguf"
    p.write_bytes(bytes(data))
    expect_error(p, "99")


def test_directory(tmp_path):
    expect_error(tmp_path, "directory")


def test_missing_path(tmp_path):
    expect_error(tmp_path / "nope.gguf", "no such file")
    expect_error(tmp_path / "nope.gguf", "no such file", loader=load)


# ---- CLI ------------------------------------------------------------------------------------------

def _cli_inprocess(capsys, model_path) -> tuple[int, str]:
    rc = cli_main(["generate", "-m", str(model_path), "-p", "x"])
    return rc, capsys.readouterr().err


def _assert_one_error_line(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, f"exit code {rc}, stderr: {err}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, found {len(lines)}: {err}"
    assert lines[0].startswith("mtp-engine: error:"), lines[0]
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"


@pytest.mark.parametrize("kind", ["missing", "directory", "text", "truncated"])
def test_cli_bad_model_file(capsys, tmp_path, src, kind):
    p = tmp_path / "bad.gguf"
    if kind == "directory":
        p = tmp_path
    elif kind == "text":
        p.write_text("not a model")
    elif kind == "truncated":
        with open(src.data.filename, "rb") as f:
            p.write_bytes(f.read(_cut_points(src)["data_mid"]))
    rc, err = _cli_inprocess(capsys, p)
    _assert_one_error_line(rc, err, str(p))


def test_cli_missing_tensor_and_bad_key(capsys, make_gguf):
    p = make_gguf("cli_missing", drop_tensors=("blk.1.ssm_out.weight",))
    _assert_one_error_line(*_cli_inprocess(capsys, p), str(p), "blk.1.ssm_out.weight")
    p = make_gguf("cli_arch", arch="llama")
    _assert_one_error_line(*_cli_inprocess(capsys, p), str(p), "general.architecture", "llama")


def test_cli_malformed_optional_key(capsys, make_gguf):
    """Same root cause as test_config_rejects_malformed_optional_keys, seen from the CLI."""
    p = make_gguf("cli_rope", set_keys={"qwen35.rope.freq_base": ("big", VT.STRING, None)})
    _assert_one_error_line(*_cli_inprocess(capsys, p), str(p), "rope.freq_base")


def test_cli_missing_prompt_file(capsys, tmp_path):
    rc = cli_main(["generate", "-m", str(tmp_path / "m.gguf"), "-f", str(tmp_path / "prompt.txt")])
    _assert_one_error_line(rc, capsys.readouterr().err, "prompt.txt")


@pytest.mark.parametrize("kind", ["missing", "llama"])
def test_cli_subprocess(tmp_path, make_gguf, kind):
    """`python -m mtp_engine.cli generate -m BAD -p x` as a user runs it."""
    p = tmp_path / "nope.gguf" if kind == "missing" else make_gguf("sub_llama", arch="llama")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "mtp_engine.cli", "generate", "-m", str(p), "-p", "x"],
                       capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=120)
    _assert_one_error_line(r.returncode, r.stderr, str(p))
    assert r.stdout == ""
