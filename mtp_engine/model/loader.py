"""Loading a Qwen3.5 (dense or MoE) model from a GGUF file or an HF checkpoint directory.

GGUF tensors are repacked one at a time straight from the memory map into MLX arrays, so a
quantized file is never expanded to floats (except Q6_K tensors in exact mode). Stacked MoE
experts ([n_expert, out, in]) are repacked as one matrix of n_expert*out rows, then viewed as
[n_expert, out, packed] for `mx.gather_qmm`.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType

from ..errors import MTPEngineError
from ..gguf.quants import QuantizedWeight, repack, repack_float
from ..gguf.reader import GGUFFile
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
              progress: Callable[[int, int], None] | None = None) -> tuple[Qwen35Model, GGUFFile, LoadInfo]:
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

    model = build_model(cfg, fetch, gf.has_tensor, load_mtp=load_mtp, progress=progress)
    sizes = model.nbytes()
    info.weight_bytes = sizes["trunk"] + sizes["mtp"]
    return model, gf, info


# ---- HF checkpoints -------------------------------------------------------------------------

# transformers' fused in-memory expert layout: gate_up_proj [E, 2F, H] = cat(gate, up) along dim 1
_FUSED_GATE_UP = "ffn_gate_up_exps"
# save_pretrained's per-expert layout
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.|mtp\.layers\.0\.)mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _stack_experts(per_expert: dict[str, dict[int, np.ndarray]], tensors: dict[str, np.ndarray],
                   cfg: Qwen35Config, source: str) -> None:
    """Stacks per-expert HF matrices into GGUF's [n_expert, out, in] tensors (expert index
    outermost, as llama.cpp's converter does) and splits a fused gate_up_proj."""
    for name, experts in per_expert.items():
        if sorted(experts) != list(range(cfg.n_expert)):
            raise MTPEngineError(f"expected experts 0..{cfg.n_expert - 1}, found {sorted(experts)!r:.80}",
                                 file=source, field=name)
        tensors[name] = np.stack([experts[e] for e in range(cfg.n_expert)])
    for name in [n for n in tensors if n.endswith(_FUSED_GATE_UP)]:
        gate_up = tensors.pop(name)
        f = gate_up.shape[1] // 2
        base = name[: -len(_FUSED_GATE_UP)]
        tensors[base + "ffn_gate_exps.weight"], tensors[base + "ffn_up_exps.weight"] = gate_up[:, :f], gate_up[:, f:]


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


def _hf_convert(name: str, w: np.ndarray, cfg: Qwen35Config) -> np.ndarray:
    """Applies the converter's conventions so HF tensors equal their GGUF twins."""
    w = w.astype(np.float32)
    kh, vh = cfg.ssm_key_heads, cfg.ssm_value_heads
    r = vh // kh

    def tile_heads(x: np.ndarray, axis: int, per_head: int) -> np.ndarray:
        # grouped order (head h reads key head h // r) -> tiled order (h reads key head h % kh)
        x = np.moveaxis(x, axis, 0)
        rest = x.shape[1:]
        x = x.reshape(kh, r, per_head, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest)))
        return np.moveaxis(x.reshape(vh * per_head, *rest), 0, axis)

    base = name.rsplit(".", 1)[-1] if name.endswith("ssm_a") else name.split(".", 2)[-1]
    if name.endswith("ssm_a"):
        return tile_heads(-np.exp(w), 0, 1)
    if name.endswith(("attn_norm.weight", "post_attention_norm.weight", "q_norm.weight", "k_norm.weight",
                      "output_norm.weight", "enorm.weight", "hnorm.weight", "shared_head_norm.weight")):
        return w + 1.0
    vd = cfg.ssm_value_dim
    nqk = 2 * kh * cfg.ssm_key_dim
    if base == "ssm_conv1d.weight":
        w = w.reshape(w.shape[0], -1)
        return np.concatenate([w[:nqk], tile_heads(w[nqk:], 0, vd)], axis=0)
    if base == "attn_qkv.weight":
        return np.concatenate([w[:nqk], tile_heads(w[nqk:], 0, vd)], axis=0)
    if base == "attn_gate.weight":
        return tile_heads(w, 0, vd)
    if base in ("ssm_alpha.weight", "ssm_beta.weight", "ssm_dt.bias"):
        return tile_heads(w, 0, 1)
    if base == "ssm_out.weight":
        return tile_heads(w, 1, vd)
    return w


def load_hf(directory: str | os.PathLike, load_mtp: bool = True) -> Qwen35Model:
    """Loads an HF `Qwen3_5ForCausalLM` or `Qwen3_5MoeForCausalLM` checkpoint (config.json +
    *.safetensors with `mtp.*`)."""
    from safetensors.numpy import load_file

    directory = str(directory)
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.isfile(cfg_path):
        raise MTPEngineError("expected a config.json in the checkpoint directory", file=directory)
    try:
        with open(cfg_path) as f:
            raw_cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise MTPEngineError(f"unreadable JSON: {e}", file=cfg_path) from None
    cfg = Qwen35Config.from_hf(raw_cfg, cfg_path)
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise MTPEngineError("no *.safetensors files found", file=directory)
    names = _hf_to_gguf_names(cfg)
    blocks = {f"model.layers.{i}.": f"blk.{i}." for i in range(cfg.n_layer)} | {"mtp.layers.0.": f"blk.{cfg.n_layer}."}
    tensors: dict[str, np.ndarray] = {}
    per_expert: dict[str, dict[int, np.ndarray]] = {}
    for fn in files:
        try:
            data = _load_safetensors(os.path.join(directory, fn))
        except Exception as e:
            raise MTPEngineError(f"unreadable safetensors file ({e})", file=os.path.join(directory, fn)) from None
        for k, v in data.items():
            if k in names:
                tensors[names[k]] = _hf_convert(names[k], v, cfg)
            elif (m := _EXPERT_RE.match(k)) and m.group(1) in blocks:
                name = f"{blocks[m.group(1)]}ffn_{m.group(3)}_exps.weight"
                per_expert.setdefault(name, {})[int(m.group(2))] = v.astype(np.float32)
    _stack_experts(per_expert, tensors, cfg, directory)
    del load_file

    def fetch(name: str, shape: tuple, matrix: bool):
        if name not in tensors:
            raise MTPEngineError("required tensor is missing", file=directory, field=name)
        w = tensors[name]
        lead = w.ndim - len(shape)
        if lead > 0 and all(n == 1 for n in w.shape[:lead]) and tuple(w.shape[lead:]) == tuple(shape):
            w = w.reshape(shape)  # e.g. shared_expert_gate [1, H], read as [H] as llama.cpp does
        if tuple(w.shape) != tuple(shape):
            raise MTPEngineError(f"unexpected shape: expected {list(shape)}, found {list(w.shape)}",
                                 file=directory, field=name)
        return Linear(mx.array(w)) if matrix else mx.array(w)

    return build_model(cfg, fetch, lambda n: n in tensors, load_mtp=load_mtp)


def _load_safetensors(path: str) -> dict[str, np.ndarray]:
    """safetensors' numpy loader cannot hold bf16; read bf16 as its upper-16-bit float32 twin."""
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
    for k, meta in header.items():
        if k == "__metadata__":
            continue
        dt = dtypes.get(meta["dtype"])
        if dt is None:
            raise MTPEngineError(f"unsupported dtype {meta['dtype']}", file=path, field=k)
        s, e = meta["data_offsets"]
        arr = mm[base + s: base + e].view(dt).reshape(meta["shape"])
        if meta["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[k] = np.asarray(arr, dtype=np.float32)
    return out
