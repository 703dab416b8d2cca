"""Loading a Qwen3.5 (dense or MoE) model from a GGUF file or an HF checkpoint directory.

GGUF tensors are repacked one at a time straight from the memory map into MLX arrays, so a
quantized file is never expanded to floats (except Q6_K tensors in exact mode). Stacked MoE
experts ([n_expert, out, in]) are repacked as one matrix of n_expert*out rows, then viewed as
[n_expert, out, packed] for `mx.gather_qmm`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType

from ..errors import MTPEngineError
from ..gguf.quants import QuantizedWeight, repack, repack_float
from ..gguf.reader import GGUFFile
from ..options import EngineOptions
from .build import build_model
from .config import Qwen35Config
from .layers import Linear
from .qwen35 import Qwen35Model

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass
class LoadInfo:
    """What a load did: file, tensor type counts, how each was represented, sizes."""

    path: str
    file_bytes: int = 0
    weight_bytes: int = 0
    tensor_types: dict[str, int] = field(default_factory=dict)
    representation: dict[str, int] = field(default_factory=dict)
    exact: bool = False


def _to_linear(w: QuantizedWeight | np.ndarray, shape: tuple[int, ...]) -> Linear:
    """`shape`: the logical float shape; its leading axes (the expert axis of stacked experts)
    are put back on every array."""
    lead = tuple(shape[:-1])
    if isinstance(w, QuantizedWeight):
        return Linear(mx.array(w.weight.reshape(*lead, -1)), mx.array(w.scales.reshape(*lead, -1)),
                      mx.array(w.biases.reshape(*lead, -1)), w.bits, w.group_size)
    return Linear(mx.array(np.ascontiguousarray(w, dtype=np.float32).reshape(shape)))


def _stored_shape(gf: GGUFFile, name: str, shape: tuple) -> tuple:
    """The shape to ask the reader for: `shape`, or the stored one when that is `shape` with
    leading unit axes. ggml drops trailing 1s of `ne`, so llama.cpp reads e.g. the shared-expert
    gate as [H] whether a file stores it as ne [H] or [H, 1] (numpy [1, H])."""
    if not gf.has_tensor(name):
        return shape
    stored = gf.numpy_shape(name)
    lead = len(stored) - len(shape)
    if lead > 0 and all(n == 1 for n in stored[:lead]) and tuple(stored[lead:]) == tuple(shape):
        return stored
    return shape


def load_gguf(path: str | os.PathLike, exact: bool = False, load_mtp: bool = True,
              progress: Callable[[int, int], None] | None = None,
              options: EngineOptions | None = None) -> tuple[Qwen35Model, GGUFFile, LoadInfo]:
    """Loads a `qwen35` or `qwen35moe` GGUF file. `exact=True` keeps Q6_K tensors as float32 (bit-exact to
    llama.cpp's dequantization) instead of 8-bit group-32 requantization."""
    gf = GGUFFile(path)
    cfg = Qwen35Config.from_gguf(gf)
    info = LoadInfo(path=gf.path, file_bytes=gf.file_size(), exact=exact)

    def fetch(name: str, shape: tuple, matrix: bool):
        t = gf.tensor(name, _stored_shape(gf, name, shape))
        info.tensor_types[t.qtype.name] = info.tensor_types.get(t.qtype.name, 0) + 1
        # repack takes matrices: vectors travel as one row, stacked experts as E*out rows
        rows, cols = int(np.prod(t.shape[:-1], dtype=np.int64)), int(t.shape[-1])
        try:
            if t.qtype in _FLOAT_TYPES:
                arr = repack_float(t.data, t.qtype, (rows, cols))
                rep = "float32"
                out = _to_linear(arr, shape) if matrix else mx.array(arr.reshape(shape))
            elif not matrix:
                raise MTPEngineError(f"expected a float tensor (F32/F16/BF16), found {t.qtype.name}",
                                     file=gf.path, field=name)
            else:
                w = repack(t.data, t.qtype, (rows, cols), q6k_mode="f32" if exact else "q8")
                rep = f"{w.bits}-bit g{w.group_size}" if isinstance(w, QuantizedWeight) else "float32"
                out = _to_linear(w, shape)
        except MTPEngineError as e:
            if e.file:
                raise
            raise MTPEngineError(str(e), file=gf.path, field=name) from None
        info.representation[rep] = info.representation.get(rep, 0) + 1
        mx.eval(out.weight if isinstance(out, Linear) else out)
        return out

    model = build_model(cfg, fetch, gf.has_tensor, load_mtp=load_mtp, progress=progress, options=options)
    sizes = model.nbytes()
    info.weight_bytes = sizes["trunk"] + sizes["mtp"]
    return model, gf, info
