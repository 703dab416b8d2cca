"""Assembles a `Qwen35Model` from tensors named as in GGUF, whatever file they came from.

The source is a function `fetch(name, shape, matrix)` that returns a `Linear` for matrices and a
float32 `mx.array` for vectors, after checking the shape; GGUF and HF loaders each provide one.
"""
from __future__ import annotations

from typing import Callable, Union

import mlx.core as mx

from .config import Qwen35Config
from .layers import Linear
from .qwen35 import MLP, DecoderLayer, GatedAttention, GatedDeltaNet, MTPHead, Qwen35Model

Fetch = Callable[[str, tuple, bool], Union[Linear, mx.array]]


def _attention(fetch: Fetch, p: str, cfg: Qwen35Config) -> GatedAttention:
    h, d, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.n_head, cfg.n_head_kv
    return GatedAttention(
        q=fetch(p + "attn_q.weight", (nh * 2 * d, h), True),
        k=fetch(p + "attn_k.weight", (nkv * d, h), True),
        v=fetch(p + "attn_v.weight", (nkv * d, h), True),
        o=fetch(p + "attn_output.weight", (h, nh * d), True),
        q_norm=fetch(p + "attn_q_norm.weight", (d,), False),
        k_norm=fetch(p + "attn_k_norm.weight", (d,), False),
        cfg=cfg,
    )


def _delta_net(fetch: Fetch, p: str, cfg: Qwen35Config) -> GatedDeltaNet:
    h, vh = cfg.hidden_size, cfg.ssm_value_heads
    return GatedDeltaNet(
        qkv=fetch(p + "attn_qkv.weight", (cfg.conv_channels, h), True),
        z=fetch(p + "attn_gate.weight", (cfg.ssm_inner, h), True),
        alpha=fetch(p + "ssm_alpha.weight", (vh, h), True),
        beta=fetch(p + "ssm_beta.weight", (vh, h), True),
        conv_w=fetch(p + "ssm_conv1d.weight", (cfg.conv_channels, cfg.conv_kernel), False),
        a=fetch(p + "ssm_a", (vh,), False),
        dt_bias=fetch(p + "ssm_dt.bias", (vh,), False),
        norm=fetch(p + "ssm_norm.weight", (cfg.ssm_value_dim,), False),
        out=fetch(p + "ssm_out.weight", (h, cfg.ssm_inner), True),
        cfg=cfg,
    )


def _layer(fetch: Fetch, i: int, cfg: Qwen35Config, recurrent: bool) -> DecoderLayer:
    p = f"blk.{i}."
    h, f = cfg.hidden_size, cfg.ffn_size[i]
    mixer = _delta_net(fetch, p, cfg) if recurrent else _attention(fetch, p, cfg)
    return DecoderLayer(
        attn_norm=fetch(p + "attn_norm.weight", (h,), False),
        mixer=mixer,
        post_norm=fetch(p + "post_attention_norm.weight", (h,), False),
        mlp=MLP(gate=fetch(p + "ffn_gate.weight", (f, h), True), up=fetch(p + "ffn_up.weight", (f, h), True),
                down=fetch(p + "ffn_down.weight", (h, f), True)),
        eps=cfg.eps,
    )


def build_model(cfg: Qwen35Config, fetch: Fetch, has_tensor: Callable[[str], bool],
                load_mtp: bool = True, progress: Callable[[int, int], None] | None = None) -> Qwen35Model:
    h = cfg.hidden_size
    embed = fetch("token_embd.weight", (cfg.vocab_size, h), True)
    layers = []
    total = cfg.n_layer + (cfg.n_mtp if load_mtp else 0)
    for i, rec in enumerate(cfg.recurrent):
        layers.append(_layer(fetch, i, cfg, rec))
        if progress:
            progress(i + 1, total)
    output_norm = fetch("output_norm.weight", (h,), False)
    lm_head = fetch("output.weight", (cfg.vocab_size, h), True) if has_tensor("output.weight") else embed
    mtp = None
    if load_mtp and cfg.n_mtp > 0:
        i = cfg.n_layer  # the first MTP block; further ones (none in Qwen3.5) are not used for drafting
        p = f"blk.{i}.nextn."
        mtp = MTPHead(
            eh_proj=fetch(p + "eh_proj.weight", (h, 2 * h), True),
            enorm=fetch(p + "enorm.weight", (h,), False),
            hnorm=fetch(p + "hnorm.weight", (h,), False),
            layer=_layer(fetch, i, cfg, recurrent=False),
            shared_head_norm=fetch(p + "shared_head_norm.weight", (h,), False),
            cfg=cfg,
        )
        if progress:
            progress(total, total)
    return Qwen35Model(cfg, embed, layers, output_norm, lm_head, mtp)
