"""Pipeline parallel: rank r holds trunk layers [l_r, l_{r+1}) whole (`shard.split` of the layers),
for machines joined by links too slow for an all-reduce per block. A forward passes the hidden
state stage to stage (one [S, H] all-sum per boundary, only the sending stage contributing: see
`PPModel.forward` for why not send/recv), then the last stage's output (post- and pre-norm hidden
states) is all-summed the same way so every rank holds it: the decoders,
the MTP head (held whole by every rank: one block) and acceptance then run identically everywhere.
The output head is split by vocabulary across all ranks, as in tensor parallel.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..model.build import _layer
from ..model.cache import RecurrentCache, TrunkCache
from ..model.kv_cache import KVCache
from ..model.config import Qwen35Config
from ..model.expert_use import ExpertUse
from ..model.layers import Linear
from ..model.blocks import run_layers
from ..model.mtp_head import MTPHead
from ..model.qwen35 import Qwen35Model, TrunkStates
from ..model import step
from ..model.step import Pass
from .runtime import Comm
from .shard import split
from .tp import VocabShardHead


def pp_selection(cfg: Qwen35Config, rank: int, size: int):
    """`selection(name, shape)` for `shard.shard_weight_bytes`: None for tensors of other ranks'
    layers, else (rows, cols) as held (output head rows by vocabulary)."""
    l0, l1 = split(cfg.n_layer, size, rank)
    per = -(-cfg.vocab_size // size)
    v0, v1 = min(rank * per, cfg.vocab_size), min((rank + 1) * per, cfg.vocab_size)

    def selection(name: str, shape: tuple):
        if name.startswith("blk."):
            i = int(name.split(".")[1])
            return (None, None) if l0 <= i < l1 or i >= cfg.n_layer else None
        if name == "output.weight":
            return np.arange(v0, v1), None
        return None, None

    return selection


class PPModel(Qwen35Model):
    """A `Qwen35Model` holding one pipeline stage; `forward` runs the whole pipeline."""


    def __init__(self, cfg: Qwen35Config, embed: Linear, layers: list, output_norm: mx.array, lm_head,
                 mtp: MTPHead | None, *, comm: Comm, first_layer: int, expert_use: ExpertUse | None = None):
        """This stage's `layers` (the model's layers from `first_layer` on) of the model `cfg`."""
        super().__init__(cfg, embed, layers, output_norm, lm_head, mtp, expert_use=expert_use)
        self.comm, self.first_layer, self.global_cfg = comm, first_layer, cfg
        self.compile_steps = False  # stage boundaries depend on the rank: forwards stay uncompiled

    def make_cache(self) -> TrunkCache:
        c = self.cfg
        caches: list = []
        for rec in c.recurrent[self.first_layer:self.first_layer + len(self.layers)]:
            caches.append(RecurrentCache(c.conv_kernel, c.conv_channels, c.ssm_value_heads, c.ssm_key_dim,
                                         c.ssm_value_dim) if rec else KVCache(c.n_head_kv, c.head_dim, dtype=self.kv_dtype))
        return TrunkCache(caches)

    def forward_states(self, ids: mx.array, cache: TrunkCache, how: Pass = Pass.STEP) -> TrunkStates:
        # a prefill runs as a step here: a stage's forward is never compiled; a device round's (its
        # KV offsets device values) runs the same stages through the uncompiled graph runner
        s = int(ids.shape[1])
        if how.capture:
            cache.begin_capture(s)
        if how.resident:
            post, x = step.run(self.graphs, self._stages, [ids], cache.layers, s, capture=how.capture,
                               compiled=False, floor=int(cache.offset))
            return TrunkStates(post, x)
        post, x = self._stages(ids, cache.layers)
        cache.offset += s
        return TrunkStates(post, x)

    def _stages(self, ids: mx.array, caches: list) -> list[mx.array]:
        """The pipeline over `caches` (this stage's layers'): the last stage's output, post- and
        pre-norm hidden states, on every rank."""
        comm, r, n = self.comm, self.comm.rank, self.comm.size
        shape = (1, int(ids.shape[1]), self.cfg.hidden_size)
        # Each stage boundary is an all-sum to which only the sending stage contributes; the others
        # add zeros that depend on the previous boundary. A send/recv pair would leave the recv with
        # no input, and MLX may then schedule it before collectives of independent branches (the
        # drafts' logits) that the sending rank must finish first: a cross-rank deadlock.
        dep = ids
        x = self.embed_tokens(ids) if r == 0 else None
        post = x
        for stage in range(n):
            if stage == r and self.layers:
                post, x = run_layers(self.layers, x, caches, self.output_norm, self.cfg.eps)
            if stage == n - 1:
                break
            part = x if stage == r else mx.depends(mx.zeros(shape), dep)
            dep = comm.all_sum(part)
            if stage + 1 == r:
                x = dep
        part = mx.concatenate([post, x], axis=0) if r == n - 1 else mx.depends(mx.zeros((2, *shape[1:])), dep)
        both = comm.all_sum(part)
        return [both[0:1], both[1:2]]


def build_pp(cfg: Qwen35Config, source, comm: Comm, load_mtp: bool = True) -> PPModel:
    """Builds this rank's pipeline stage of the model whose tensors `source` reads (only this
    stage's layers and its rows of the output head are read)."""
    sel = pp_selection(cfg, comm.rank, comm.size)

    def fetch(name: str, shape: tuple, matrix: bool):
        stored = source.shape(name)
        gshape = tuple(stored[len(stored) - len(shape):])
        rows, cols = sel(name, gshape)
        out = source.read(name, gshape, rows, cols, matrix)
        if matrix and len(shape) == 3:
            out = Linear(*(a.reshape(shape[0], shape[1], -1) for a in (out.weight, out.scales, out.biases)
                           if a is not None), bits=out.bits, group_size=out.group_size)
        mx.eval(out.weight if matrix else out)
        return out

    l0, l1 = split(cfg.n_layer, comm.size, comm.rank)
    h = cfg.hidden_size
    embed = fetch("token_embd.weight", (cfg.vocab_size, h), True)
    use = ExpertUse() if cfg.is_moe else None  # the MoE blocks report their routing to it
    layers = [_layer(fetch, i, cfg, cfg.recurrent[i], use, ("trunk", i - l0)) for i in range(l0, l1)]
    output_norm = fetch("output_norm.weight", (h,), False)
    if source.has_tensor("output.weight"):
        head = fetch("output.weight", (cfg.vocab_size, h), True)
    else:
        per = -(-cfg.vocab_size // comm.size)
        v0, v1 = min(comm.rank * per, cfg.vocab_size), min((comm.rank + 1) * per, cfg.vocab_size)
        head = Linear(*(a[v0:v1] if a is not None else None for a in (embed.weight, embed.scales, embed.biases)),
                      bits=embed.bits, group_size=embed.group_size)
    mtp = None
    if load_mtp and cfg.n_mtp > 0:
        p = f"blk.{cfg.n_layer}.nextn."
        mtp = MTPHead(eh_proj=fetch(p + "eh_proj.weight", (h, 2 * h), True), enorm=fetch(p + "enorm.weight", (h,), False),
                      hnorm=fetch(p + "hnorm.weight", (h,), False),
                      layer=_layer(fetch, cfg.n_layer, cfg, False, use, ("mtp", 0)),
                      shared_head_norm=fetch(p + "shared_head_norm.weight", (h,), False), cfg=cfg, expert_use=use)
    return PPModel(cfg, embed, layers, output_norm, VocabShardHead(head, cfg.vocab_size, comm), mtp, comm=comm,
                   first_layer=l0, expert_use=use)
