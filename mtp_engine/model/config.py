"""Typed hyper-parameters of a Qwen3.5 model, read from GGUF metadata or an HF config.json."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NoReturn

from ..errors import MTPEngineError

SUPPORTED_ARCHITECTURES = ("qwen35", "qwen35moe")
MOE_ARCHITECTURES = ("qwen35moe",)
# llama.cpp's LLAMA_MAX_EXPERTS is 512; anything far beyond is a corrupt file, not a bigger model
_MAX_EXPERTS = 4096


# The fields read the same way from both sources: (GGUF key after "<arch>.", HF config.json key,
# default where the key may be missing; None: required). The rest are derived (head sizes, flags,
# per-block widths, experts) by `from_gguf` and `from_hf` each.
_SCALARS: dict[str, tuple[str, str, int | float | None]] = {
    "hidden_size": ("embedding_length", "hidden_size", None),
    "n_head": ("attention.head_count", "num_attention_heads", None),
    "conv_kernel": ("ssm.conv_kernel", "linear_conv_kernel_dim", None),
    "ssm_key_dim": ("ssm.state_size", "linear_key_head_dim", None),
    "ssm_key_heads": ("ssm.group_count", "linear_num_key_heads", None),
    "ssm_value_heads": ("ssm.time_step_rank", "linear_num_value_heads", None),
    "rope_base": ("rope.freq_base", "rope_theta", 10000.0),
    "eps": ("attention.layer_norm_rms_epsilon", "rms_norm_eps", 1e-6),
    "context_length": ("context_length", "max_position_embeddings", 4096),
}

# config field -> GGUF key (after the architecture prefix), for error messages
_GGUF_KEYS = {
    **{name: keys[0] for name, keys in _SCALARS.items()},
    "vocab_size": "vocab_size", "n_layer": "block_count", "n_mtp": "nextn_predict_layers",
    "ffn_size": "feed_forward_length", "n_head_kv": "attention.head_count_kv", "head_dim": "attention.key_length",
    "n_rot": "rope.dimension_count", "ssm_inner": "ssm.inner_size", "recurrent": "attention.recurrent_layers",
    "n_expert": "expert_count", "n_expert_used": "expert_used_count", "expert_ffn_size": "expert_feed_forward_length",
    "shared_ffn_size": "expert_shared_feed_forward_length",
}


@dataclass
class Qwen35Config:
    """Everything the forward pass needs, for `qwen35` (dense) and `qwen35moe` (`arch`). `n_layer`
    counts trunk layers only; the MTP layers (`n_mtp`) sit after them in the GGUF block numbering.

    In `qwen35moe` every block, the MTP block included, has the MoE FFN (`n_expert` routed experts
    of width `expert_ffn_size`, `n_expert_used` per token, one shared expert of width
    `shared_ffn_size`) and `ffn_size` is empty."""

    vocab_size: int
    hidden_size: int
    n_layer: int
    n_mtp: int
    ffn_size: list[int]  # per block, trunk then MTP; empty for an MoE model
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    eps: float
    conv_kernel: int
    ssm_key_dim: int  # key head dim (ssm.state_size)
    ssm_key_heads: int  # ssm.group_count
    ssm_value_heads: int  # ssm.time_step_rank
    ssm_inner: int  # value heads x value head dim
    recurrent: list[bool]  # per trunk layer
    context_length: int = 4096
    context_source: str = "the model's"  # what set context_length (errors name it): a cap at load, or the file
    tied_embeddings: bool = False
    rope_sections: list[int] = field(default_factory=list)
    arch: str = "qwen35"
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn_size: int = 0
    shared_ffn_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.arch in MOE_ARCHITECTURES

    @property
    def ssm_value_dim(self) -> int:
        return self.ssm_inner // self.ssm_value_heads

    @property
    def conv_channels(self) -> int:
        return 2 * self.ssm_key_heads * self.ssm_key_dim + self.ssm_inner

    def validate(self, source: str = "", keys: dict[str, str] | None = None) -> None:
        """Cross-checks the numbers so a bad file fails here, not deep inside a matmul. `keys` maps
        field names to the source's own key names, so errors name what the user can look up."""
        keys = keys or {}

        def bad(fld: str, msg: str) -> MTPEngineError:
            return MTPEngineError(msg, file=source or None, field=keys.get(fld, fld))

        for name in ("vocab_size", "hidden_size", "n_head", "n_head_kv", "head_dim", "conv_kernel",
                     "ssm_key_dim", "ssm_key_heads", "ssm_value_heads", "ssm_inner"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0 or v > 1 << 24:
                raise bad(name, f"expected a positive integer below 2^24, found {v!r}")
        if isinstance(self.context_length, bool) or not isinstance(self.context_length, int) \
                or not 1 <= self.context_length <= 1 << 24:
            raise bad("context_length", f"expected 1..2^24 positions, found {self.context_length!r}")
        if self.n_layer <= 0 or self.n_layer > 4096:
            raise bad("n_layer", f"expected 1..4096 trunk layers, found {self.n_layer}")
        if self.n_mtp < 0 or self.n_mtp > 16:
            raise bad("n_mtp", f"expected 0..16, found {self.n_mtp}")
        if self.n_head % self.n_head_kv:
            raise bad("n_head_kv", f"head_count {self.n_head} is not a multiple of {self.n_head_kv}")
        if self.ssm_value_heads % self.ssm_key_heads:
            raise bad("ssm_value_heads",
                      f"value heads {self.ssm_value_heads} not a multiple of key heads {self.ssm_key_heads}")
        if self.ssm_inner % self.ssm_value_heads:
            raise bad("ssm_inner", f"{self.ssm_inner} not a multiple of value heads {self.ssm_value_heads}")
        if not (0 < self.n_rot <= self.head_dim) or self.n_rot % 2:
            raise bad("n_rot", f"expected an even number in 2..{self.head_dim}, found {self.n_rot}")
        if not (math.isfinite(self.eps) and 0 < self.eps < 1):
            raise bad("eps", f"expected a value in (0, 1), found {self.eps}")
        if not (math.isfinite(self.rope_base) and self.rope_base > 1):
            raise bad("rope_base", f"expected a finite value > 1, found {self.rope_base}")
        if len(self.recurrent) != self.n_layer:
            raise bad("recurrent", f"expected {self.n_layer} flags, found {len(self.recurrent)}")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise bad("arch", f"expected one of {list(SUPPORTED_ARCHITECTURES)}, found {self.arch!r}")
        if self.is_moe:
            self._validate_moe(bad)
        elif len(self.ffn_size) != self.n_layer + self.n_mtp or any(f <= 0 for f in self.ffn_size):
            raise bad("ffn_size", f"expected {self.n_layer + self.n_mtp} positive sizes, found {self.ffn_size}")

    def _validate_moe(self, bad) -> None:
        for name in ("n_expert", "n_expert_used", "expert_ffn_size", "shared_ffn_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v > 1 << 24:
                raise bad(name, f"expected a positive integer below 2^24, found {v!r}")
        if self.n_expert > _MAX_EXPERTS:
            raise bad("n_expert", f"expected at most {_MAX_EXPERTS} experts, found {self.n_expert}")
        if self.n_expert_used > self.n_expert:
            raise bad("n_expert_used", f"expected at most expert_count ({self.n_expert}) active experts, "
                                       f"found {self.n_expert_used}")

    @classmethod
    def from_gguf(cls, gf) -> "Qwen35Config":
        """Builds the config from a `GGUFFile`, with llama.cpp's defaults for optional keys."""
        arch = gf.require("general.architecture", str)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise MTPEngineError(f"unsupported architecture {arch!r}: expected one of {list(SUPPORTED_ARCHITECTURES)}",
                                 file=gf.path, field="general.architecture")
        k = _ArchKeys(gf, arch)
        n_block = k.req("block_count")
        if not 0 < n_block <= 4096 + 16:  # bounded before any per-block list is built from it
            k.fail(f"expected 1..{4096 + 16} blocks, found {n_block}", "block_count")
        n_mtp = k.opt("nextn_predict_layers", int, 0)
        if n_mtp < 0 or n_mtp >= n_block:
            k.fail(f"expected 0..{n_block - 1} (block_count {n_block}), found {n_mtp}", "nextn_predict_layers")
        n_layer, moe = n_block - n_mtp, arch in MOE_ARCHITECTURES
        v = {name: k.req(g) if d is None else k.opt(g, type(d), d) for name, (g, _, d) in _SCALARS.items()}
        if v["n_head"] <= 0:
            k.fail(f"expected a positive head count, found {v['n_head']}", "attention.head_count")
        head_dim = k.opt("attention.key_length", int, max(v["hidden_size"] // v["n_head"], 1))
        vdim = k.opt("attention.value_length", int, head_dim)
        if vdim != head_dim:
            k.fail(f"expected value_length == key_length ({head_dim}), found {vdim}", "attention.value_length")
        sections = k.get("rope.dimension_sections", []) or []
        cfg = cls(**v, vocab_size=k.vocab(), n_layer=n_layer, n_mtp=n_mtp, ffn_size=k.ffn_sizes(n_block, moe),
                  n_head_kv=k.kv_heads(v["n_head"]), head_dim=head_dim,
                  n_rot=k.opt("rope.dimension_count", int, head_dim), ssm_inner=k.req("ssm.inner_size"),
                  recurrent=k.recurrent(n_layer), tied_embeddings=not gf.has_tensor("output.weight"),
                  rope_sections=list(sections) if isinstance(sections, list) else [], arch=arch,
                  **(k.experts() if moe else {}))
        cfg.validate(gf.path, {key: k.p + v for key, v in _GGUF_KEYS.items()})
        return cfg

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "Qwen35Config":
        """Builds the config from a transformers `Qwen3_5ForCausalLM` or `Qwen3_5MoeForCausalLM`
        config.json dict."""
        c = cfg.get("text_config", cfg)
        moe = bool(c.get("num_experts"))

        def req(key: str):
            if key not in c:
                raise MTPEngineError("required key is missing", file=source, field=key)
            return c[key]

        n_layer = int(req("num_hidden_layers"))
        n_mtp = int(c.get("mtp_num_hidden_layers", 0))
        layer_types = c.get("layer_types")
        if layer_types:
            recurrent = [t == "linear_attention" for t in layer_types[:n_layer]]
        else:
            interval = int(c.get("full_attention_interval", 4))
            recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
        v = {name: int(req(h)) if d is None else type(d)(c.get(h, d)) for name, (_, h, d) in _SCALARS.items()}
        head_dim = int(c.get("head_dim", v["hidden_size"] // v["n_head"]))
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        prf = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
        v["rope_base"] = float(rope.get("rope_theta", v["rope_base"]))
        experts = {}
        if moe:
            expert_ffn = int(req("moe_intermediate_size"))
            experts = dict(arch="qwen35moe", n_expert=int(req("num_experts")),
                           n_expert_used=int(req("num_experts_per_tok")), expert_ffn_size=expert_ffn,
                           shared_ffn_size=int(c.get("shared_expert_intermediate_size", expert_ffn)))
        cfg_ = cls(**v, vocab_size=int(req("vocab_size")), n_layer=n_layer, n_mtp=n_mtp,
                   ffn_size=[] if moe else [int(req("intermediate_size"))] * (n_layer + n_mtp),
                   n_head_kv=int(c.get("num_key_value_heads", v["n_head"])), head_dim=head_dim,
                   n_rot=int(head_dim * prf), ssm_inner=v["ssm_value_heads"] * int(req("linear_value_head_dim")),
                   recurrent=recurrent, tied_embeddings=bool(c.get("tie_word_embeddings", False)), **experts)
        cfg_.validate(source)
        return cfg_


class _ArchKeys:
    """An architecture's GGUF keys (`<arch>.<key>`), read with llama.cpp's defaults for optional
    ones; every refusal names the key and the file."""

    def __init__(self, gf, arch: str):
        self.gf, self.p = gf, arch + "."

    def fail(self, message: str, key: str) -> NoReturn:
        raise MTPEngineError(message, file=self.gf.path, field=self.p + key)

    def get(self, key: str, default):
        return self.gf.get(self.p + key, default)

    def req(self, key: str) -> int:
        return self.gf.require(self.p + key, int)

    def opt(self, key: str, kind: type, default):
        v = self.get(key, default)
        ok = (isinstance(v, int) and not isinstance(v, bool)) if kind is int else \
            (isinstance(v, (int, float)) and not isinstance(v, bool))
        if not ok:
            self.fail(f"expected {'an integer' if kind is int else 'a number'}, found {v!r:.60}", key)
        return kind(v)

    def ints(self, key: str, v) -> list[int]:
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            self.fail(f"expected integers, found {v!r:.60}", key)
        return [int(x) for x in v]

    def ffn_sizes(self, n_block: int, moe: bool) -> list[int]:
        """Per block: one value for all, or one each (an MoE file has no dense FFN, so llama.cpp's
        converter writes no feed_forward_length)."""
        key = "feed_forward_length"
        ffn = self.get(key, []) if moe else self.gf.require(self.p + key)
        if moe and ffn == []:
            return []
        if isinstance(ffn, list):
            if len(ffn) != n_block:
                self.fail(f"expected {n_block} per-layer values, found {len(ffn)}", key)
            return self.ints(key, ffn)
        if isinstance(ffn, int) and not isinstance(ffn, bool):
            return [ffn] * n_block
        self.fail(f"expected an integer or array, found {ffn!r:.60}", key)

    def kv_heads(self, n_head: int) -> int:
        """One KV head count (a per-layer array must hold one value); the heads' count by default."""
        key = "attention.head_count_kv"
        kv = self.get(key, n_head)
        if isinstance(kv, list):
            kv = self.ints(key, kv)
            if len(set(kv)) > 1:
                self.fail(f"expected one KV head count for all layers, found {kv!r:.60}", key)
            kv = kv[0] if kv else n_head
        return kv if isinstance(kv, int) else self.opt(key, int, kv)

    def recurrent(self, n_layer: int) -> list[bool]:
        """Which layers are gated delta nets: the file's flags, else every layer but each
        `full_attention_interval`-th."""
        flags = self.get("attention.recurrent_layers", None)
        if flags is not None:
            if not isinstance(flags, list) or len(flags) < n_layer:
                self.fail(f"expected at least {n_layer} flags, found {flags!r:.80}", "attention.recurrent_layers")
            return [bool(x) for x in flags[:n_layer]]
        interval = self.opt("full_attention_interval", int, 4)
        if interval <= 0:
            self.fail(f"expected a positive integer, found {interval!r}", "full_attention_interval")
        return [(i + 1) % interval != 0 for i in range(n_layer)]

    def vocab(self) -> int:
        if self.gf.has(self.p + "vocab_size"):
            return int(self.opt("vocab_size", int, 0))
        if self.gf.has_tensor("token_embd.weight"):
            return int(self.gf.numpy_shape("token_embd.weight")[0])
        raise MTPEngineError("cannot determine the vocabulary size", file=self.gf.path, field="token_embd.weight")

    def experts(self) -> dict:
        """An MoE file's expert fields. The shared expert's width is optional in llama.cpp (the
        tensor then says it); expert_gating_func / expert_weights_norm are not read: llama.cpp's
        qwen35moe graph hard-codes softmax routing with renormalised top-k weights."""
        n_expert, used, width = self.req("expert_count"), self.req("expert_used_count"), \
            self.req("expert_feed_forward_length")
        shexp = "blk.0.ffn_gate_shexp.weight"
        default = self.gf.numpy_shape(shexp)[0] if self.gf.has_tensor(shexp) else width
        return {"n_expert": n_expert, "n_expert_used": used, "expert_ffn_size": width,
                "shared_ffn_size": self.opt("expert_shared_feed_forward_length", int, default)}
