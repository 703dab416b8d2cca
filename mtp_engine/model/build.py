"""Assembles a `Qwen35Model` from tensors named as in GGUF, whatever file they came from.

The source is a function `fetch(name, shape, matrix)` that returns a `Linear` for matrices and a
float32 `mx.array` for vectors, after checking the shape; GGUF and HF loaders each provide one. A
3-D matrix shape ([n_expert, out, in], the stacked MoE experts) gives a `Linear` whose arrays carry
the expert axis first. A vector may be stored with leading unit axes ([1, H]); fetch returns it as
asked ([H]).
"""
from __future__ import annotations

from typing import Callable, Union

import mlx.core as mx

from ..options import EngineOptions
from .config import Qwen35Config
from .expert_use import ExpertUse
from .layers import Linear
from .moe import ExpertLinear, MoE, SwitchGLU
from .blocks import MLP, DecoderLayer, GatedAttention, GatedDeltaNet
from .mtp_head import MTPHead
from .qwen35 import Qwen35Model

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
    ).fuse()


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
    ).fuse()


def _mlp(fetch: Fetch, p: str, h: int, f: int, suffix: str = "") -> MLP:
    return MLP(gate=fetch(f"{p}ffn_gate{suffix}.weight", (f, h), True),
               up=fetch(f"{p}ffn_up{suffix}.weight", (f, h), True),
               down=fetch(f"{p}ffn_down{suffix}.weight", (h, f), True)).fuse()


def _moe(fetch: Fetch, p: str, cfg: Qwen35Config, use: ExpertUse, slot) -> MoE:
    h, e, f = cfg.hidden_size, cfg.n_expert, cfg.expert_ffn_size

    def experts(name: str, shape: tuple) -> ExpertLinear:
        return ExpertLinear.from_linear(fetch(p + name, shape, True))

    return MoE(
        router=fetch(p + "ffn_gate_inp.weight", (e, h), True),
        experts=SwitchGLU(gate=experts("ffn_gate_exps.weight", (e, f, h)),
                          up=experts("ffn_up_exps.weight", (e, f, h)),
                          down=experts("ffn_down_exps.weight", (e, h, f))),
        shared=_mlp(fetch, p, h, cfg.shared_ffn_size, "_shexp"),
        shared_gate=fetch(p + "ffn_gate_inp_shexp.weight", (h,), False),
        n_used=cfg.n_expert_used,
        observer=use,
        slot=use.register(slot),
    )


def _layer(fetch: Fetch, i: int, cfg: Qwen35Config, recurrent: bool, use: ExpertUse | None = None,
           slot=None) -> DecoderLayer:
    p = f"blk.{i}."
    h = cfg.hidden_size
    mixer = _delta_net(fetch, p, cfg) if recurrent else _attention(fetch, p, cfg)
    return DecoderLayer(
        attn_norm=fetch(p + "attn_norm.weight", (h,), False),
        mixer=mixer,
        post_norm=fetch(p + "post_attention_norm.weight", (h,), False),
        mlp=_moe(fetch, p, cfg, use, slot) if cfg.is_moe else _mlp(fetch, p, h, cfg.ffn_size[i]),
        eps=cfg.eps,
    )


def build_model(cfg: Qwen35Config, fetch: Fetch, has_tensor: Callable[[str], bool],
                load_mtp: bool = True, progress: Callable[[int, int], None] | None = None,
                options: EngineOptions | None = None,
                make: Callable[..., Qwen35Model] = Qwen35Model) -> Qwen35Model:
    """The model `cfg` describes from the tensors `fetch` reads. `make(cfg, embed, layers,
    output_norm, lm_head, mtp, options, expert_use=...)` constructs it from the parts (a sharded
    model wraps them first)."""
    h = cfg.hidden_size
    embed = fetch("token_embd.weight", (cfg.vocab_size, h), True)
    use = ExpertUse() if cfg.is_moe else None  # the MoE blocks report their routing to it
    layers = []
    total = cfg.n_layer + (cfg.n_mtp if load_mtp else 0)
    for i, rec in enumerate(cfg.recurrent):
        layers.append(_layer(fetch, i, cfg, rec, use, ("trunk", i)))
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
            layer=_layer(fetch, i, cfg, False, use, ("mtp", 0)),
            shared_head_norm=fetch(p + "shared_head_norm.weight", (h,), False),
            cfg=cfg,
            expert_use=use,
        )
        if progress:
            progress(total, total)
    return make(cfg, embed, layers, output_norm, lm_head, mtp, options, expert_use=use)
