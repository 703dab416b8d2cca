"""A dense Qwen3.5 GGUF's (dequantized) weights written as an HF checkpoint folder: the inverse of
llama.cpp's converter (`hf_layout.to_hf`). Used to get HF checkpoints of models that exist only as
GGUF (the shipped trained model), for the quantize-on-load accuracy measurements and the tests.
The HF config.json and tokenizer files come from a folder given alongside.
"""
from __future__ import annotations

import json
import os

import mlx.core as mx
from gguf import GGUFReader
from gguf import quants as gq

from ..errors import MTPEngineError
from ..model.config import Qwen35Config
from ..model.hf_layout import hf_to_gguf_names, to_hf
from .to_mlx import copy_tokenizer

_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def gguf_to_hf(gguf_path: str | os.PathLike, out: str | os.PathLike, config_dir: str | os.PathLike,
               dtype: str = "bfloat16") -> list[str]:
    """Writes `out/model.safetensors` (tensors in `dtype`) plus config.json and tokenizer files
    copied from `config_dir`; returns the tensor names written."""
    if dtype not in _DTYPES:
        raise MTPEngineError(f"expected one of {list(_DTYPES)}, found {dtype!r}", field="dtype")
    config_path = os.path.join(str(config_dir), "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise MTPEngineError(f"cannot read config: {e}", file=config_path) from None
    cfg = Qwen35Config.from_hf(raw, config_path)
    if cfg.is_moe:
        raise MTPEngineError("only dense (qwen35) models are written back to HF", file=config_path)
    to_hf_name = {g: h for h, g in hf_to_gguf_names(cfg).items()}
    reader = GGUFReader(str(gguf_path))
    tensors = {}
    for t in reader.tensors:
        if t.name not in to_hf_name:
            raise MTPEngineError("tensor has no HF counterpart in this config", file=str(gguf_path), field=t.name)
        shape = [int(n) for n in reversed(list(t.shape))]
        values = gq.dequantize(t.data, t.tensor_type).reshape(shape)
        tensors[to_hf_name[t.name]] = mx.array(to_hf(t.name, values, cfg)).astype(_DTYPES[dtype])
    os.makedirs(str(out), exist_ok=True)
    mx.save_safetensors(os.path.join(str(out), "model.safetensors"), tensors, metadata={"format": "pt"})
    with open(os.path.join(str(out), "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    copy_tokenizer(str(config_dir), str(out))
    return sorted(tensors)
