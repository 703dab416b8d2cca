"""Qwen3.5's MTP head: one extra decoder layer that, from (token t, trunk hidden at t-1), predicts
token t+1 (the drafter of draft-mtp, `speculative.mtp_drafter` and `speculative.mtp_rows`)."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import step as compiled
from .blocks import DecoderLayer, compilable_ffn, run_layers
from .config import Qwen35Config
from .expert_use import ExpertUse
from .kv_cache import KVCache
from .layers import Linear, rms_norm, stored

class MTPHead(nn.Module):
    """One extra decoder layer that, from (token t, trunk hidden at t-1), predicts token t+1.

    Shares the trunk's embedding and output head; has its own attention KV cache."""

    eh_proj, enorm, hnorm, layer, shared_head_norm = stored(5)

    def __init__(self, eh_proj: Linear, enorm: mx.array, hnorm: mx.array, layer: DecoderLayer,
                 shared_head_norm: mx.array, cfg: Qwen35Config, expert_use: ExpertUse | None = None):
        super().__init__()
        self.eh_proj, self.enorm, self.hnorm, self.layer = eh_proj, enorm, hnorm, layer
        self.shared_head_norm = shared_head_norm
        self.cfg = cfg
        self.expert_use = expert_use  # the model's MoE routing observer (None: a dense head)
        # how it runs, from the model's options (`Qwen35Model.use`): forwards of <= step.MAX_TOKENS
        # rows as one compiled graph, the fused add + RMSNorm kernel, its KV cache's element type
        self.compile_steps, self.fused_norm, self.kv_dtype = True, False, mx.float32
        self.graphs = compiled.StepGraphs()  # its traced forwards

    def make_cache(self) -> KVCache:
        return KVCache(self.cfg.n_head_kv, self.cfg.head_dim, dtype=self.kv_dtype)

    def __call__(self, embeds: mx.array, h_prev: mx.array, cache: KVCache,
                 how: compiled.Pass = compiled.Pass.STEP) -> mx.array:
        """embeds [1, S, H] (embedding of token t), h_prev [1, S, H] (post-norm hidden at t-1);
        returns the head's normed hidden state [1, S, H] (feed it back for the next draft step).
        `how`: STEP (a draft), PREFILL (the prompt's rows) or ROUND_STEP (a device-resident round's
        draft: the cache's offset may be a device value; compiled or not, the graph form)."""
        if how.capture:
            raise ValueError(f"the MTP head keeps no rollback states: {how} is not one of its passes")
        s = int(embeds.shape[1])
        fits = s <= compiled.MAX_TOKENS and compilable_ffn(self.layer.mlp) and \
            (how is not compiled.Pass.PREFILL or compiled.traced(self.graphs, [cache], s))
        if (self.compile_steps and fits) or how.resident:
            side, set_side = self.expert_use.graph_outputs(self.expert_use.slots("mtp")) if self.expert_use \
                else (None, None)
            return compiled.run(self.graphs, self._body, [embeds, h_prev], [cache], s, side=side, set_side=set_side,
                                compiled=self.compile_steps and fits)[0]
        return self._body(embeds, h_prev, [cache])[0]

    def forward_batch(self, embeds: mx.array, h_prev: mx.array, batch) -> mx.array:
        """The head over a batch (`batch_cache.BatchCache`, advanced here): embeds, h_prev [B, S, H]."""
        s = int(embeds.shape[1])
        if self.compile_steps and s <= compiled.MAX_TOKENS and compilable_ffn(self.layer.mlp):
            h = compiled.run_batch(self.graphs, self._body, [embeds, h_prev], batch, s)[0]
        else:
            h = self._body(embeds, h_prev, batch.layers)[0]
        batch.advance(s)
        return h

    def _body(self, embeds: mx.array, h_prev: mx.array, caches: list) -> list[mx.array]:
        eps = self.cfg.eps
        x = self.eh_proj(mx.concatenate([rms_norm(embeds, self.enorm, eps), rms_norm(h_prev, self.hnorm, eps)],
                                        axis=-1))
        return [run_layers([self.layer], x, caches, self.shared_head_norm, eps, self.fused_norm)[0]]

