"""Writing an HF Qwen3.5 checkpoint (or an MLX folder from `mtp-engine convert`) as one GGUF file,
with llama.cpp's converter conventions (see `model/hf_layout.py`), the MTP head as block
`n_layer`, and the tokenizer in `tokenizer.ggml.*`.

Tensors are streamed: the header and tensor table are written from the shapes alone, then each
tensor is read, converted, encoded by `gguf.quants.quantize` and written before the next is read.
"""
from __future__ import annotations

import json
import os
from typing import Callable

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf import quants as gq

from ..errors import MTPEngineError
from ..gguf.writer import _KEEP_F32, WRITABLE
from ..model.hf import TensorSource, expected_tensors, require_output_head
from ..model.hf_checkpoint import HFCheckpoint
from ..output_files import staging_path
from ..tokenizer.tokenizer import Tokenizer
from .to_mlx import ConvertReport

_FILE_TYPES = {"F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
               "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0,
               "Q4_1": LlamaFileType.MOSTLY_Q4_1, "Q5_0": LlamaFileType.MOSTLY_Q5_0,
               "Q5_1": LlamaFileType.MOSTLY_Q5_1}


def _tensor_type(name: str, shape: tuple, target: GGMLQuantizationType) -> GGMLQuantizationType:
    """llama.cpp's rule: vectors, norms, conv, ssm_a and dt bias stay F32, as does a matrix whose
    rows do not fill whole blocks."""
    block = gq.GGML_QUANT_SIZES[target][0]
    if len(shape) < 2 or name.endswith(_KEEP_F32) or shape[-1] % block:
        return GGMLQuantizationType.F32
    return target


def _nbytes(shape: tuple, qtype: GGMLQuantizationType) -> int:
    block, type_size = gq.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * type_size


def _encode(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.F32:
        return values
    if qtype == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return gq.quantize(values, qtype)


def _add_metadata(w: GGUFWriter, ckpt: HFCheckpoint, arch: str, n_mtp: int, file_type: int) -> None:
    c, raw = ckpt.cfg, ckpt.raw_config
    text = raw.get("text_config", raw)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    p = arch + "."
    w.add_string("general.type", "model")
    w.add_string("general.name", os.path.basename(os.path.normpath(ckpt.directory)))
    w.add_uint32("general.file_type", int(file_type))
    w.add_uint32("general.quantization_version", GGML_QUANT_VERSION)
    w.add_uint32(p + "block_count", c.n_layer + n_mtp)
    w.add_uint32(p + "context_length", c.context_length)
    w.add_uint32(p + "embedding_length", c.hidden_size)
    if not c.is_moe:
        w.add_uint32(p + "feed_forward_length", c.ffn_size[0])
    w.add_uint32(p + "attention.head_count", c.n_head)
    w.add_uint32(p + "attention.head_count_kv", c.n_head_kv)
    w.add_uint32(p + "attention.key_length", c.head_dim)
    w.add_uint32(p + "attention.value_length", c.head_dim)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", c.eps)
    w.add_float32(p + "rope.freq_base", c.rope_base)
    w.add_uint32(p + "rope.dimension_count", c.n_rot)
    sections = [int(x) for x in rope.get("mrope_section", [])][:4]
    if sections:
        w.add_array(p + "rope.dimension_sections", sections + [0] * (4 - len(sections)))
    w.add_uint32(p + "nextn_predict_layers", n_mtp)
    w.add_uint32(p + "ssm.conv_kernel", c.conv_kernel)
    w.add_uint32(p + "ssm.state_size", c.ssm_key_dim)
    w.add_uint32(p + "ssm.group_count", c.ssm_key_heads)
    w.add_uint32(p + "ssm.time_step_rank", c.ssm_value_heads)
    w.add_uint32(p + "ssm.inner_size", c.ssm_inner)
    w.add_array(p + "attention.recurrent_layers", list(c.recurrent) + [False] * n_mtp)
    w.add_uint32(p + "full_attention_interval", int(text.get("full_attention_interval", 4)))
    if c.is_moe:
        w.add_uint32(p + "expert_count", c.n_expert)
        w.add_uint32(p + "expert_used_count", c.n_expert_used)
        w.add_uint32(p + "expert_feed_forward_length", c.expert_ffn_size)
        w.add_uint32(p + "expert_shared_feed_forward_length", c.shared_ffn_size)


def _add_tokenizer(w: GGUFWriter, directory: str, vocab_size: int) -> None:
    """`tokenizer.ggml.*` as llama.cpp's converter writes them for a byte-level BPE (`gpt2`, pre
    `qwen35`); the token list is padded with `[PADi]` up to the embedding's rows."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        raise MTPEngineError("missing tokenizer.json: a GGUF carries the tokenizer", file=path)
    tok = Tokenizer.from_hf_file(path)
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model = spec["model"]
    added = {a["id"]: a for a in spec.get("added_tokens") or []}
    by_id = {i: t for t, i in model["vocab"].items()}
    n = max(vocab_size, max(list(by_id) + list(added)) + 1)
    tokens, types = [], []
    for i in range(n):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen35")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [int(t) for t in types])
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.eos_token_id", tok.eos_token_id)
    if tok.pad_token_id is not None:
        w.add_uint32("tokenizer.ggml.padding_token_id", tok.pad_token_id)
    if tok.bos_token_id is not None:
        w.add_uint32("tokenizer.ggml.bos_token_id", tok.bos_token_id)
    w.add_bool("tokenizer.ggml.add_bos_token", bool(tok.add_bos_token))
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    if tok.chat_template:
        w.add_string("tokenizer.chat_template", tok.chat_template)


def write_gguf(src: str | os.PathLike, out: str | os.PathLike, qtype: str = "BF16", *, overwrite: bool = False,
               progress: Callable[[int, int], None] | None = None):
    """Writes checkpoint `src` as GGUF file `out`, matrices as `qtype` (one of `writer.WRITABLE`)."""
    if qtype not in WRITABLE:
        raise MTPEngineError(f"cannot write {qtype!r}: expected one of {list(WRITABLE)}", field="gguf type")
    out = str(out)
    if os.path.exists(out) and not overwrite:
        raise MTPEngineError("output file exists (pass overwrite=True / --force)", file=out)
    target = GGMLQuantizationType[qtype]
    ckpt = HFCheckpoint(src)
    src_reader = TensorSource(ckpt, None)
    require_output_head(ckpt, src_reader.has)
    n_mtp = ckpt.cfg.n_mtp if ckpt.has_mtp else 0
    plan = expected_tensors(ckpt.cfg, n_mtp > 0, src_reader.has)
    for name, (shape, matrix) in plan.items():
        if not name.endswith("_exps.weight"):
            if not src_reader.has(name):
                raise MTPEngineError("required tensor is missing", file=ckpt.directory,
                                     field=src_reader.names.get(name, name))
            src_reader.check_shape(name, src_reader.names[name], shape, matrix)
    arch = "qwen35moe" if ckpt.cfg.is_moe else "qwen35"
    # written under a temporary name and renamed when whole: a failed or interrupted conversion
    # leaves no truncated GGUF (and an --force target stays as it was)
    final, out = out, str(staging_path(out))
    writer = GGUFWriter(out, arch)
    _add_metadata(writer, ckpt, arch, n_mtp, _FILE_TYPES[qtype])
    _add_tokenizer(writer, ckpt.directory, ckpt.cfg.vocab_size)
    types = {}
    for name, (shape, _) in plan.items():
        types[name] = _tensor_type(name, shape, target)
        writer.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(shape, types[name]), raw_dtype=types[name])
    report = ConvertReport(out=final)
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, (name, (shape, matrix)) in enumerate(plan.items()):
            obj = src_reader.fetch(name, shape, matrix)
            values = np.array((obj.dense() if matrix else obj).astype(mx.float32)).reshape(shape)
            del obj
            writer.write_tensor_data(_encode(values, types[name]))
            report.tensors += 1
            report.quantized += types[name] != GGMLQuantizationType.F32
            report.mtp_tensors += name.startswith(f"blk.{ckpt.cfg.n_layer}.")
            if progress:
                progress(i + 1, len(plan))
    except BaseException:
        writer.close()
        if os.path.exists(out):
            os.remove(out)
        raise
    writer.close()
    os.replace(out, final)
    report.out = final
    report.bytes_written = os.path.getsize(final)
    report.peak_memory_bytes = int(mx.get_peak_memory() - before)
    return report
