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
from .build import build_model
from ..options import EngineOptions
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


# ---- HF checkpoints -------------------------------------------------------------------------

# transformers' fused in-memory expert layout: gate_up_proj [E, 2F, H] = cat(gate, up) along dim 1
_FUSED_GATE_UP = "ffn_gate_up_exps"


def _hf_to_gguf_names(cfg: Qwen35Config) -> dict[str, str]:
    m = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}
    common = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight":
              "post_attention_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
              "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
              "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight":
              "attn_gate.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
              "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
              "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias",
              "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight",
              # Qwen3_5Moe; the per-expert tensors are stacked by `_stack_experts`
              "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert.gate_proj.weight":
              "ffn_gate_shexp.weight", "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
              "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
              "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
              "mlp.experts.gate_up_proj": _FUSED_GATE_UP, "mlp.experts.down_proj": "ffn_down_exps.weight"}
    for i in range(cfg.n_layer):
        for k, v in common.items():
            m[f"model.layers.{i}.{k}"] = f"blk.{i}.{v}"
    n = cfg.n_layer
    for k, v in common.items():
        m[f"mtp.layers.0.{k}"] = f"blk.{n}.{v}"
    m.update({"mtp.fc.weight": f"blk.{n}.nextn.eh_proj.weight",
              "mtp.pre_fc_norm_embedding.weight": f"blk.{n}.nextn.enorm.weight",
              "mtp.pre_fc_norm_hidden.weight": f"blk.{n}.nextn.hnorm.weight",
              "mtp.norm.weight": f"blk.{n}.nextn.shared_head_norm.weight"})
    return m


def load_hf(directory: str | os.PathLike, load_mtp: bool = True) -> Qwen35Model:
    """Loads an HF `Qwen3_5ForCausalLM` or `Qwen3_5MoeForCausalLM` checkpoint folder unquantized
    (bf16 matrices stay bf16); `mtp_engine.model.hf.load_checkpoint` also quantizes on load."""
    from .hf import load_checkpoint

    return load_checkpoint(directory, None, load_mtp)[0]
