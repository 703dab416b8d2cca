"""How an HF Qwen3.5 checkpoint's tensors map onto the engine's (GGUF-convention) tensors, both ways.

llama.cpp's converter bakes four conventions into a GGUF, and the engine runs on them:
* every (1+w) RMSNorm weight has the 1 added (the gated-delta-net `linear_attn.norm` is a plain
  multiplier and is not touched);
* `ssm_a = -exp(A_log)`;
* the conv weight [C, 1, K] is squeezed to [C, K];
* value heads go from HF's grouped order (value head h reads key head h // (Vh/Kh)) to tiled
  order (h reads key head h % Kh): rows of the V part of `in_proj_qkv`/conv, of `in_proj_z`,
  `in_proj_a`/`in_proj_b`, `dt_bias`, `A_log`, and column blocks of `out_proj`.

`to_engine` applies them to one tensor held either as floats or as MLX affine-quantized arrays
(the reordering is a permutation of rows, or of whole column groups, so quantized tensors are
permuted without being re-rounded). `to_hf` is the inverse on float NumPy arrays (used to write a
GGUF's weights as an HF folder). mlx-lm's own layout (`mlx_lm.convert` output: conv [C, K, 1],
norms already +1, names under `language_model.`) is read too.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .config import Qwen35Config

# (1+w) norms, by GGUF suffix; `ssm_norm` is deliberately absent
OFFSET_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "q_norm.weight", "k_norm.weight",
                "output_norm.weight", "enorm.weight", "hnorm.weight", "shared_head_norm.weight")


def canonical_key(key: str) -> str | None:
    """A stored tensor name as the HF text model names it (`model.layers.…`, `lm_head.weight`,
    `mtp.…`), whatever wrapper the file uses (VLM `model.language_model.`, mlx-lm `language_model.`);
    None for tensors the engine never reads (vision tower)."""
    for prefix in ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.", "language_model.vision_tower."):
        if key.startswith(prefix):
            return None
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("language_model.mtp.", "mtp.")):
        if key.startswith(old):
            return new + key[len(old):]
    return key


@dataclass
class Quantized:
    """MLX affine-quantized tensor: w = q * scale + bias per `group_size` values of the last axis."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    def dense(self) -> mx.array:
        return mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits)

    def take_rows(self, idx: mx.array, axis: int = 0) -> "Quantized":
        return Quantized(mx.take(self.weight, idx, axis), mx.take(self.scales, idx, axis),
                         mx.take(self.biases, idx, axis), self.bits, self.group_size)

    @property
    def nbytes(self) -> int:
        return int(self.weight.nbytes + self.scales.nbytes + self.biases.nbytes)


QUANTIZE_CHUNK_BYTES = 16 << 20  # float32 rows converted at a time while quantizing (at most)


def quantize(holder: list, bits: int, group_size: int, scales: str = "float32") -> Quantized:
    """MLX affine quantization of the float tensor in `holder` (a one-item list, emptied here so
    that the source is freed before the quantized pieces are joined). `scales="float32"` quantizes
    the float32 values in row chunks (float32 scales and biases: 1.6x less RMS error than bf16
    ones at 8 bits); `scales="source"` quantizes in the tensor's own dtype, as `mlx_lm.convert`
    does (bf16 scales for a bf16 checkpoint)."""
    w = holder.pop()
    if scales == "source" or w.dtype == mx.float32:
        q = Quantized(*mx.quantize(w, group_size=group_size, bits=bits), bits, group_size)
        mx.eval(q.weight, q.scales, q.biases)
        return q
    shape = w.shape
    flat = w.reshape(-1, shape[-1])
    # float32 rows per chunk: at most 16 MiB and 1/32 of the source, so that while a tensor is
    # quantized the load holds little beyond the tensor itself and its (smaller) quantized form
    step = max(1, min(QUANTIZE_CHUNK_BYTES, w.nbytes // 32) // (4 * shape[-1]))
    del w
    pieces = []
    for i in range(0, flat.shape[0], step):
        piece = mx.quantize(flat[i:i + step].astype(mx.float32), group_size=group_size, bits=bits)
        mx.eval(*piece)
        pieces.append(piece)
    del flat
    if len(pieces) == 1:
        parts = pieces[0]
    else:
        parts = [mx.concatenate([p[k] for p in pieces]) for k in range(3)]
        del pieces
        mx.eval(*parts)
    lead = tuple(shape[:-1])
    return Quantized(*(a.reshape(*lead, -1) for a in parts), bits, group_size)


def head_order(kh: int, vh: int) -> np.ndarray:
    """order[h'] = the HF (grouped) value head that tiled head h' holds."""
    r = vh // kh
    h = np.arange(vh)
    return (h % kh) * r + h // kh


def _expand(order: np.ndarray, per_head: int) -> np.ndarray:
    return (order[:, None] * per_head + np.arange(per_head)[None, :]).reshape(-1)


def _tile_rows(w, kh: int, vh: int, per_head: int, start: int = 0):
    """Rows start.. (value heads of `per_head` rows each) from grouped to tiled order."""
    idx = _expand(head_order(kh, vh), per_head) + start
    n = w.weight.shape[0] if isinstance(w, Quantized) else w.shape[0]
    idx = mx.array(np.concatenate([np.arange(start), idx, np.arange(start + vh * per_head, n)]).astype(np.int32))
    return w.take_rows(idx) if isinstance(w, Quantized) else mx.take(w, idx, 0)


def _tile_columns(w, kh: int, vh: int, vd: int):
    """Column blocks of `vd` (one per value head) from grouped to tiled order. A quantized matrix
    whose groups and packed words fit inside one head's block is permuted group-wise (exactly);
    otherwise it is dequantized first (exactly: the stored values, reordered, as float32)."""
    order = head_order(kh, vh)
    if isinstance(w, Quantized):
        g, b = w.group_size, w.bits
        if vd % g == 0 and (vd * b) % 32 == 0:
            words = _expand(order, vd * b // 32)
            groups = _expand(order, vd // g)
            return Quantized(mx.take(w.weight, mx.array(words.astype(np.int32)), 1),
                             mx.take(w.scales, mx.array(groups.astype(np.int32)), 1),
                             mx.take(w.biases, mx.array(groups.astype(np.int32)), 1), b, g)
        w = w.dense().astype(mx.float32)
    return mx.take(w, mx.array(_expand(order, vd).astype(np.int32)), 1)


def to_engine(gguf_name: str, w, cfg: Qwen35Config, norms_offset_applied: bool = False):
    """One tensor from HF conventions to the engine's. `w` is an mx.array (any float dtype) or
    `Quantized`; vectors come back float32, matrices keep their dtype or stay quantized.
    `norms_offset_applied`: the source already holds 1+w (mlx-lm's converted layout)."""
    kh, vh, vd = cfg.ssm_key_heads, cfg.ssm_value_heads, cfg.ssm_value_dim
    nqk = 2 * kh * cfg.ssm_key_dim
    base = gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name
    if base == "ssm_a":
        return _tile_rows(-mx.exp(w.astype(mx.float32)), kh, vh, 1)
    if gguf_name.endswith(OFFSET_NORMS):
        return w.astype(mx.float32) + (0.0 if norms_offset_applied else 1.0)
    if base == "ssm_conv1d.weight":
        if w.ndim == 3 and w.shape[1] != 1:  # mlx-lm's [C, K, 1]
            w = w.reshape(w.shape[0], w.shape[1])
        else:
            w = w.reshape(w.shape[0], -1)
        return _tile_rows(w.astype(mx.float32), kh, vh, vd, start=nqk)
    if base == "attn_qkv.weight":
        return _tile_rows(w, kh, vh, vd, start=nqk)
    if base == "attn_gate.weight":
        return _tile_rows(w, kh, vh, vd)
    if base in ("ssm_alpha.weight", "ssm_beta.weight"):
        return _tile_rows(w, kh, vh, 1)
    if base == "ssm_dt.bias":
        return _tile_rows(w.astype(mx.float32), kh, vh, 1)
    if base == "ssm_out.weight":
        return _tile_columns(w, kh, vh, vd)
    if isinstance(w, Quantized) or w.ndim >= 2:
        return w
    return w.astype(mx.float32)


def _untile(x: np.ndarray, axis: int, per_head: int, kh: int, vh: int) -> np.ndarray:
    inverse = np.argsort(head_order(kh, vh))
    return np.take(x, _expand(inverse, per_head), axis=axis)


def to_hf(gguf_name: str, w: np.ndarray, cfg: Qwen35Config) -> np.ndarray:
    """The inverse of `to_engine` on float arrays: a GGUF/engine tensor back to its HF form."""
    kh, vh, vd = cfg.ssm_key_heads, cfg.ssm_value_heads, cfg.ssm_value_dim
    nqk = 2 * kh * cfg.ssm_key_dim
    base = gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name
    w = np.asarray(w, dtype=np.float32)
    if base == "ssm_a":
        return np.log(-_untile(w, 0, 1, kh, vh))
    if gguf_name.endswith(OFFSET_NORMS):
        return w - 1.0
    if base in ("ssm_conv1d.weight", "attn_qkv.weight"):
        w = np.concatenate([w[:nqk], _untile(w[nqk:], 0, vd, kh, vh)])
        return w[:, None, :] if base == "ssm_conv1d.weight" else w
    if base == "attn_gate.weight":
        return _untile(w, 0, vd, kh, vh)
    if base in ("ssm_alpha.weight", "ssm_beta.weight", "ssm_dt.bias"):
        return _untile(w, 0, 1, kh, vh)
    if base == "ssm_out.weight":
        return _untile(w, 1, vd, kh, vh)
    return w


# transformers' fused in-memory expert layout: gate_up_proj [E, 2F, H] = cat(gate, up) along dim 1
FUSED_GATE_UP = "ffn_gate_up_exps"


def hf_to_gguf_names(cfg: Qwen35Config) -> dict[str, str]:
    """Hugging Face tensor names -> GGUF names (llama.cpp's converter's) for this config."""
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
              "mlp.experts.gate_up_proj": FUSED_GATE_UP, "mlp.experts.down_proj": "ffn_down_exps.weight"}
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
