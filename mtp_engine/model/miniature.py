"""A model's miniature: its graphs at a few layers and narrow widths, with random weights.

Why: MLX's CUDA backend compiles each fused graph at its first launch (seconds each on a fresh
machine) and keeps it under a name and a hash of its source, which hold the graph's operations,
dtypes and the constants written into it (norm epsilons, attention scales, the key head's
1/sqrt(d)), never its sizes. A model that keeps every such constant and every per-block choice
(its delta-net and attention head sizes, its experts per token, each matrix's bits) but has few
layers, narrow FFNs and a small vocabulary runs the same graphs in a fraction of the memory
and time: `kernels.mlx_jit`'s worker processes run it through a long prompt and a server's batched
steps while the real model loads (`batching.warm`).
"""
from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from ..gguf.quants import loaded_bits
from ..gguf.reader import GGUFFile
from ..options import EngineOptions
from .build import build_model
from .config import Qwen35Config
from .layers import Linear
from .qwen35 import Qwen35Model

GROUP = 32  # the group size every GGUF loader path gives a quantized matrix
FFN = 256  # the FFN's and the experts' widths: multiples of every group size
VOCAB = 512  # token ids the warm-up prompts may use are below this


def miniature_config(cfg: Qwen35Config) -> Qwen35Config:
    """cfg's constants at a few layers (up to and including the first attention layer: both
    mixers) and narrow widths (the FFN, the vocabulary, the experts' count and width); the stream's
    width (a norm's mean divides by it), the head sizes of both mixers, the epsilon, rope and
    experts per token are cfg's."""
    n = next((i + 1 for i, r in enumerate(cfg.recurrent) if not r), len(cfg.recurrent))
    n = max(n, min(2, len(cfg.recurrent)))
    moe = {}
    if cfg.is_moe:
        moe = dict(n_expert=min(cfg.n_expert, max(2 * cfg.n_expert_used, 8)), expert_ffn_size=FFN // 4,
                   shared_ffn_size=FFN // 4 if cfg.shared_ffn_size else 0)
    return replace(cfg, vocab_size=VOCAB, n_layer=n, recurrent=list(cfg.recurrent[:n]),
                   ffn_size=[FFN] * (n + cfg.n_mtp) if cfg.ffn_size else [], **moe)


def random_vector(name: str, shape: tuple) -> mx.array:
    """A non-matrix tensor of a random model: values in each parameter's natural range (decays,
    time-step biases, conv taps, the shared expert's gate), ones for norms."""
    if name.endswith("ssm_a"):
        return -mx.exp(mx.random.uniform(-3, 0, shape))
    if name.endswith("ssm_dt.bias"):
        return mx.random.uniform(-1, 0, shape)
    if name.endswith("ssm_conv1d.weight"):
        return mx.random.normal(shape) * 0.5
    if name.endswith("ffn_gate_inp_shexp.weight"):
        return mx.random.normal(shape) * shape[-1] ** -0.5
    return mx.ones(shape)


def random_linear(name: str, shape: tuple, bits: int | None, group: int = GROUP) -> Linear:
    """A random matrix of `shape` ([out, in] or [experts, out, in]) as the loaders give one:
    quantized at `bits` (None: float32), its leading axes kept; routers stay float32 as llama.cpp
    keeps them."""
    if "ffn_gate_inp" in name or bits is None:
        return Linear(mx.random.normal(shape) * shape[-1] ** -0.5)
    rows = 1
    for d in shape[:-1]:
        rows *= d
    w = mx.random.normal((rows, shape[-1])) * (shape[-1] ** -0.5)
    q = [a.reshape(*shape[:-1], -1) for a in mx.quantize(w, group_size=group, bits=bits)]
    mx.eval(q)
    return Linear(q[0], q[1], q[2], bits, group)


def _file_bits(gf: GGUFFile, cfg: Qwen35Config, mini: Qwen35Config, name: str) -> int | None:
    """The bits the loader gives the real file's tensor of the same role as the miniature's `name`
    (None: a float matrix); the MTP block's index moves with the trunk's length."""
    parts = name.split(".")
    if parts[0] == "blk" and int(parts[1]) >= mini.n_layer:
        parts[1] = str(int(parts[1]) - mini.n_layer + cfg.n_layer)
    real = ".".join(parts)
    if not gf.has_tensor(real):
        return 4
    return loaded_bits(gf.tensor(real).qtype)


@functools.lru_cache(maxsize=2)
def miniature(path: str, options: EngineOptions | None = None) -> Qwen35Model:
    """The miniature (`miniature_config`) of the GGUF model at `path`, each matrix at the bits the
    file's matrix of the same role loads at, random weights, under `options` (default: the
    environment's, custom kernels off: the recipes warm the graphs MLX's own operations make)."""
    gf = GGUFFile(Path(path))
    cfg = Qwen35Config.from_gguf(gf)
    mini = miniature_config(cfg)

    def fetch(name: str, shape: tuple, matrix: bool):
        if matrix:
            return random_linear(name, shape, _file_bits(gf, cfg, mini, name))
        return random_vector(name, shape)

    opts = (options or EngineOptions(kernels="mlx")).resolve()
    model = build_model(mini, fetch, lambda n: n != "output.weight" or gf.has_tensor(n), options=opts)
    mx.eval(model.parameters())
    return model
