"""HF checkpoints at full size: quantize-on-load, the MLX/GGUF converter that keeps the MTP head,
and refusals of bad folders, on the tiny Qwen3.5+MTP fixture.

References are independent of the code under test: llama.cpp's converter output (the f32 GGUF)
and llama-quantize's Q8_0 file for the layout and the GGUF writer, mlx-lm's own Qwen3.5 model for
the converted folder, and `mx.quantize`'s error bound for the quantized weights.
"""
from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader
from gguf import quants as gq

from tests.conftest import MODELS, TINY, need
from mtp_engine import api
from mtp_engine.cli.main import main as cli_main
from mtp_engine.convert import convert
from mtp_engine.errors import MTPEngineError
from mtp_engine.convert.to_hf import gguf_to_hf
from mtp_engine.model.hf import QuantSpec, TensorSource, expected_tensors, load_checkpoint
from mtp_engine.model.hf_checkpoint import HFCheckpoint
from mtp_engine.model.loader import load_gguf


HF = TINY / "hf" / "qwen35-mtp-tiny"
F32_GGUF = TINY / "qwen35-mtp-tiny-f32.gguf"
FORMATS = [None] + [f"{b}g{g}" for b in (4, 8) for g in (32, 64, 128)]


def _tokens() -> mx.array:
    return mx.array(np.load(need(TINY / "qwen35-mtp-tiny-f32.logits.npz"))["tokens_p2"][None])


def _logits(model) -> np.ndarray:
    return np.array(model.logits(model.forward(_tokens(), model.make_cache()))[0])


def _gguf_tensors(path) -> dict[str, np.ndarray]:
    return {t.name: gq.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(list(t.shape))])
            for t in GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: s or "bf16")
def test_loaded_tensors_match_llamacpp_conversion(spec):
    """Every tensor the engine holds equals llama.cpp's converted f32 tensor: exactly (up to one
    float32 rounding of 1+w and -exp) when not quantized, within half a quantization step when
    quantized, with the codes kept packed."""
    ref = _gguf_tensors(need(F32_GGUF))
    ckpt = HFCheckpoint(need(HF))
    src = TensorSource(ckpt, QuantSpec.parse(spec))
    n_quantized = 0
    for name, (shape, matrix) in expected_tensors(ckpt.cfg, True, src.has).items():
        out = src.fetch(name, shape, matrix)
        want = ref[name].reshape(shape)
        if not matrix:
            assert out.dtype == mx.float32
            np.testing.assert_allclose(np.array(out), want, rtol=1e-6, atol=1e-7, err_msg=name)
            continue
        got = np.array(out.dense().astype(mx.float32))
        if out.quantized:
            # quantizing llama.cpp's (reordered) tensor gives the very same codes, scales and biases
            n_quantized += 1
            assert (out.bits, out.group_size) == QuantSpec.parse(spec).for_tensor(name, ckpt.cfg.n_layer)
            q = mx.quantize(mx.array(want), group_size=out.group_size, bits=out.bits)
            for mine, theirs in zip((out.weight, out.scales, out.biases), q):
                assert mx.array_equal(mine, theirs).item(), name
        elif spec is None:
            assert out.weight.dtype == mx.bfloat16  # bf16 stays bf16
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            # ssm_out's value-head blocks (64) are narrower than a 128-group: quantized in HF order,
            # then dequantized to be reordered; within one quantization step (MLX's affine error bound)
            assert name.endswith("ssm_out.weight") and spec.endswith("g128")
            step = np.abs(want).max() * 2 / (2 ** int(spec[0]) - 1)
            assert np.abs(got - want).max() <= step, name
    expected = 0 if spec is None else 41 - (3 if spec.endswith("g128") else 0)
    assert n_quantized == expected


def _api_model(spec):
    return MODELS(HF, quantize=spec)  # loaded once per session (conftest)


@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: s or "bf16")
def test_greedy_draft_mtp_equals_plain_for_every_format(spec):
    m = _api_model(spec)
    assert m.model.mtp is not None
    plain = api.generate("To be, or not to be", m, max_tokens=40, spec="none")
    spec_run = api.generate("To be, or not to be", m, max_tokens=40, spec="draft-mtp", n_max=3)
    assert spec_run.token_ids == plain.token_ids
    assert spec_run.stats["drafted"] > 0


def test_float_load_equals_llamacpp_f32_gguf_and_peak_memory_is_bounded():
    m, _, info = load_checkpoint(need(HF))
    g, _, _ = load_gguf(need(F32_GGUF))
    assert np.abs(_logits(m) - _logits(g)).max() < 1e-4
    for spec in (None, "4g64", "8g128"):
        _, _, info = load_checkpoint(need(HF), quantize=spec)
        # the finished model plus the one tensor being converted (and the float32 chunk of 1/32 of it
        # being quantized, and a few KiB of index arrays), nothing more
        largest = info.largest_tensor_bytes
        assert 0 < info.peak_memory_bytes <= info.weight_bytes + largest + largest // 32 + 4096, (spec, info)


@pytest.mark.parametrize("spec", ["4g128", "8g32,output=float,mtp=8g64"])
def test_converted_folder_keeps_mtp_and_equals_quantize_on_load(tmp_path, spec):
    out = tmp_path / "mlx"
    report = convert(need(HF), out, spec)
    assert report.mtp_tensors == 15
    cfg = json.loads((out / "config.json").read_text())
    q = QuantSpec.parse(spec)
    assert cfg["model_type"] == "qwen3_5" and cfg["quantization"]["bits"] == q.bits
    assert cfg["quantization"]["group_size"] == q.group_size
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("mtp.") and k.endswith(".scales") for k in index)
    assert (out / "tokenizer.json").is_file()
    converted, _, info = load_checkpoint(out)
    on_load, _, _ = load_checkpoint(need(HF), quantize=spec)
    assert info.quantization == "stored" and converted.mtp is not None
    assert np.array_equal(_logits(converted), _logits(on_load))
    with pytest.raises(MTPEngineError, match="already quantized"):
        load_checkpoint(out, quantize=4)


def _f32_copy(directory):
    """The tiny checkpoint with float32 tensors: mlx-lm then computes in float32 like us."""
    weights = mx.load(str(need(HF / "model.safetensors")))
    mx.save_safetensors(str(directory / "model.safetensors"), {k: v.astype(mx.float32) for k, v in weights.items()})
    for fn in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HF / fn, directory / fn)
    return directory


@pytest.mark.parametrize("spec", [None, "4g64", "8g128", "4g32,output=float,mtp=8g64", "4g64,output=8g32"],
                         ids=lambda s: s or "float")
def test_mlx_lm_loads_the_converted_folder(tmp_path, spec, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # local folders only: never wait on the network
    mlx_lm = pytest.importorskip("mlx_lm")
    src = _f32_copy(tmp_path)
    out = tmp_path / "mlx"
    convert(src, out, spec)
    theirs, tokenizer = mlx_lm.load(str(out))  # drops mtp.* in its sanitize, and loads strictly
    ours, _, _ = load_checkpoint(out)
    assert ours.mtp is not None
    diff = np.abs(np.array(theirs(_tokens())[0]) - _logits(ours)).max()
    assert diff < 1e-3, diff
    text = mlx_lm.generate(theirs, tokenizer, "To be", max_tokens=8, verbose=False)
    assert isinstance(text, str) and text


def test_source_scales_equal_mlx_lm_convert(tmp_path, monkeypatch):
    """`scales="source"` quantizes exactly as `mlx_lm.convert` (bf16 scales for a bf16 checkpoint)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("mlx_lm")
    from mlx_lm import convert as mlx_lm_convert

    src = _copy(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_5"}))  # mlx-lm's name for it
    theirs_dir, ours_dir = tmp_path / "theirs", tmp_path / "ours"
    mlx_lm_convert(str(src), mlx_path=str(theirs_dir), quantize=True, q_group_size=64, q_bits=4)
    convert(need(HF), ours_dir, "4g64", scales="source")
    theirs, ours = {}, {}
    for d, into in ((theirs_dir, theirs), (ours_dir, ours)):
        for f in d.glob("*.safetensors"):
            into.update(mx.load(str(f)))
    packed = {k: v for k, v in theirs.items() if k.endswith((".scales", ".biases")) or v.dtype == mx.uint32}
    assert len(packed) == 3 * 33  # every trunk matrix, embedding and lm_head included
    for k, v in packed.items():
        assert mx.array_equal(v, ours[k.replace("language_model.model.", "model.").replace("language_model.", "")]), k


def test_reads_mlx_lm_conversions(tmp_path, monkeypatch):
    """A folder made by `mlx_lm.convert` (mlx-lm's layout: `language_model.` names, conv [C, K, 1],
    norms with the 1 added, no `mtp.*`) loads for plain decoding, equal to our own conversion."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("mlx_lm")
    from mlx_lm import convert as mlx_lm_convert

    src = _f32_copy(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_5"}))
    mlx_lm_convert(str(src), mlx_path=str(tmp_path / "theirs"), quantize=True, q_group_size=64, q_bits=4,
                   dtype="float32")
    convert(src, tmp_path / "ours", "4g64")
    theirs = api.load(tmp_path / "theirs")
    assert theirs.model.mtp is None and theirs.info.quantization == "stored"
    np.testing.assert_allclose(_logits(theirs.model), _logits(api.load(tmp_path / "ours").model), atol=1e-4)
    with pytest.raises(MTPEngineError, match="no mtp"):
        api.generate("To be", theirs, max_tokens=2, spec="draft-mtp")


def test_gguf_output_matches_llamacpp_converter_and_quantizer(tmp_path):
    ours_f32 = tmp_path / "f32.gguf"
    convert(need(HF), ours_f32, gguf_type="F32")
    ref, got = GGUFReader(str(need(F32_GGUF))), GGUFReader(str(ours_f32))
    a, b = _gguf_tensors(F32_GGUF), _gguf_tensors(ours_f32)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-7, err_msg=k)
    ref_keys = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    our_keys = {k: f.contents() for k, f in got.fields.items() if not k.startswith("GGUF.")}
    differ = {k for k in ref_keys if our_keys.get(k) != ref_keys[k]}
    assert differ <= {"general.name", "general.size_label"}, differ  # tokenizer and hyper-parameters equal
    # Q8_0 matrices byte-identical to llama-quantize's
    ours_q8 = tmp_path / "q8.gguf"
    convert(need(HF), ours_q8, gguf_type="Q8_0")
    theirs = {t.name: t for t in GGUFReader(str(need(TINY / "qwen35-mtp-tiny-Q8_0.gguf"))).tensors}
    q8 = [t for t in GGUFReader(str(ours_q8)).tensors if t.tensor_type.name == "Q8_0"]
    assert len(q8) == 41
    for t in q8:
        assert np.array_equal(np.array(t.data), np.array(theirs[t.name].data)), t.name
    # our own reader on our file: the same logits as the HF load
    hf, _, _ = load_checkpoint(need(HF))
    g, _, _ = load_gguf(ours_f32)
    assert np.abs(_logits(g) - _logits(hf)).max() < 1e-4
    q8 = api.load(ours_q8)
    assert q8.tokenizer.encode("To be, or not") == api.load(need(HF)).tokenizer.encode("To be, or not")
    plain = api.generate("To be, or not to be", q8, max_tokens=32)
    assert api.generate("To be, or not to be", q8, max_tokens=32, spec="draft-mtp", n_max=3).token_ids == \
        plain.token_ids


def test_gguf_to_hf_inverts_the_conversion(tmp_path):
    gguf_to_hf(need(F32_GGUF), tmp_path, need(HF))
    a, b = mx.load(str(HF / "model.safetensors")), mx.load(str(tmp_path / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:  # bf16 values back exactly, but for (1+w)-1 rounding to the neighbouring bf16
        d = np.abs(np.array((a[k] - b[k]).astype(mx.float32)))
        assert d.max() <= 2 ** -7 * np.abs(np.array(a[k].astype(mx.float32))).max(), k


# ---- bad folders: one MTPEngineError naming the file ------------------------------------------

def _copy(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(need(HF), d)
    for p in d.iterdir():
        p.chmod(0o644)
    return d


def _shard(d, tensors: dict, name="model.safetensors"):
    mx.save_safetensors(str(d / name), tensors)


def test_missing_config(tmp_path):
    d = _copy(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(MTPEngineError, match=r"config\.json.*missing config\.json"):
        api.load(d)


def test_unknown_architecture(tmp_path):
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MTPEngineError, match=r"config\.json: model_type: unsupported architecture.*'llama'"):
        api.load(d)


def test_missing_shard_named_by_index(tmp_path):
    d = _copy(tmp_path)
    weights = mx.load(str(d / "model.safetensors"))
    keys = sorted(weights)
    (d / "model.safetensors").unlink()
    _shard(d, {k: weights[k] for k in keys[:30]}, "model-00001-of-00002.safetensors")
    index = {"weight_map": {k: ("model-00001-of-00002.safetensors" if i < 30 else "model-00002-of-00002.safetensors")
                            for i, k in enumerate(keys)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MTPEngineError, match=r"model-00002-of-00002\.safetensors: missing shard"):
        api.load(d)
    _shard(d, {k: weights[k] for k in keys[30:]}, "model-00002-of-00002.safetensors")
    assert api.load(d, quantize=8).model.mtp is not None  # the sharded checkpoint itself is fine


def test_shape_mismatch(tmp_path):
    d = _copy(tmp_path)
    weights = mx.load(str(d / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"] = mx.zeros((500, 256), mx.bfloat16)
    _shard(d, weights)
    with pytest.raises(MTPEngineError, match=r"model\.safetensors: model\.layers\.1\.mlp\.up_proj\.weight: shape "
                                             r"mismatch: expected \[512, 256\].*found \[500, 256\]"):
        api.load(d, quantize=4)


def test_no_mtp_tensors_loads_plain_and_refuses_draft_mtp(tmp_path, capsys):
    d = _copy(tmp_path)
    weights = mx.load(str(d / "model.safetensors"))
    _shard(d, {k: v for k, v in weights.items() if not k.startswith("mtp.")})
    m = api.load(d, quantize="8g64")  # mlx-lm's own conversions look like this
    assert m.model.mtp is None
    assert api.generate("To be", m, max_tokens=4).token_ids
    with pytest.raises(MTPEngineError, match=r"ckpt: spec: draft-mtp needs the MTP head.*no mtp\.\* tensors"):
        api.generate("To be", m, max_tokens=4, spec="draft-mtp", n_max=2)
    assert cli_main(["generate", "-m", str(d), "-p", "x", "--spec-type", "draft-mtp", "--quantize", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(d) in err[0] and "mtp.*" in err[0]


def test_bad_quantize_values():
    for bad in ("3", "4g48", "4g64,output=5", "4g64,head=8", "fast", 16):
        with pytest.raises(MTPEngineError, match="quantize|output|mtp"):
            QuantSpec.parse(bad)
    assert QuantSpec.parse("8g32,output=float,mtp=4").describe() == "8g32,output=float,mtp=4g32"
    with pytest.raises(MTPEngineError, match="quantize= applies to HF checkpoint folders"):
        api.load(need(F32_GGUF), quantize=4)


def test_cli_convert(tmp_path, capsys):
    out = tmp_path / "q"
    assert cli_main(["convert", str(need(HF)), str(out), "--q-bits", "8", "--q-group-size", "32", "--q-output",
                     "float", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quantized"] == 40 and report["mtp_tensors"] == 15
    assert cli_main(["convert", str(need(HF)), str(out)]) == 2  # exists: refused without --force
    assert "not an empty folder" in capsys.readouterr().err
    assert cli_main(["convert", str(need(HF)), str(tmp_path / "x.gguf"), "--gguf", "Q8_0", "--q-bits", "8"]) == 2
    assert "--q-bits" in capsys.readouterr().err
    assert cli_main(["convert", str(need(HF)), str(tmp_path / "x.gguf"), "--gguf", "Q2_K"]) == 2
    assert "cannot write 'Q2_K'" in capsys.readouterr().err


def test_moe_checkpoint_quantized_on_load(tmp_path, monkeypatch):
    """Qwen3.5-MoE: per-expert (save_pretrained) and fused (transformers in-memory) expert layouts
    quantize to the same stacked experts, on load and through the converter (mlx-lm's stacked
    `switch_mlp` layout, which mlx-lm loads); greedy draft-mtp equals plain decoding."""
    from tests.model.test_moe import MOE, _hf_checkpoint
    from tests.model.test_moe import _load as load_moe_gguf

    cfg = load_moe_gguf().model.cfg
    runs = []
    for fused in (False, True):
        d = tmp_path / ("fused" if fused else "per-expert")
        d.mkdir()
        _hf_checkpoint(d, cfg, fused)
        for fn in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(need(MOE / "hf" / "qwen35moe-mtp-tiny" / fn), d / fn)
        m = api.load(d, quantize="8g64")
        assert m.info.representation["8-bit g64"] >= 3 * 5  # the stacked experts of every block, MTP included
        runs.append(m)
    assert np.array_equal(_logits(runs[0].model), _logits(runs[1].model))
    plain = api.generate([5, 6, 7, 8], runs[0], max_tokens=24, ignore_eos=True)
    spec = api.generate([5, 6, 7, 8], runs[0], max_tokens=24, spec="draft-mtp", n_max=3, ignore_eos=True)
    assert spec.token_ids == plain.token_ids
    for layout in ("per-expert", "fused"):
        out = tmp_path / f"mlx-{layout}"
        convert(tmp_path / layout, out, "8g64")
        converted = api.load(out)
        assert converted.model.mtp is not None
        assert np.array_equal(_logits(converted.model), _logits(runs[0].model))
    convert(tmp_path / "fused", tmp_path / "moe.gguf", gguf_type="F32")  # qwen35moe GGUF: same model
    g, _, _ = load_gguf(tmp_path / "moe.gguf")
    f, _, _ = load_checkpoint(tmp_path / "fused")
    assert np.array_equal(_logits(g), _logits(f))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mlx_lm = pytest.importorskip("mlx_lm")
    theirs, _ = mlx_lm.load(str(tmp_path / "mlx-fused"))  # float32 checkpoint: mlx-lm computes in float32
    assert np.abs(np.array(theirs(_tokens())[0]) - _logits(converted.model)).max() < 1e-3


def test_memory_check_refuses_a_checkpoint_that_cannot_fit(monkeypatch):
    from mtp_engine.model.memory import ENV_LIMIT
    from mtp_engine.model.hf import check_checkpoint_fits

    est = check_checkpoint_fits(need(HF), "4g64")
    assert est["weights"] == api.load(need(HF), quantize="4g64").info.weight_bytes  # exact for this model
    monkeypatch.setenv(ENV_LIMIT, str(est["total"] - 1))
    with pytest.raises(MTPEngineError, match=r"qwen35-mtp-tiny: memory: not enough memory"):
        api.load(need(HF), quantize="4g64")
