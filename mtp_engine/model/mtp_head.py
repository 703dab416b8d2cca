"""Qwen3.5's MTP head: one extra decoder layer that, from (token t, trunk hidden at t-1), predicts
token t+1 (the drafter of draft-mtp, `speculative.mtp_drafter` and `speculative.mtp_rows`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from . import step as compiled
from .blocks import DecoderLayer, compilable_ffn, run_layers
from .config import Qwen35Config
from .expert_use import ExpertUse
from .kv_cache import KVCache
from .layers import Linear, rms_norm

@dataclass
class MTPHead:
    """One extra decoder layer that, from (token t, trunk hidden at t-1), predicts token t+1.

    Shares the trunk's embedding and output head; has its own attention KV cache."""

    eh_proj: Linear
    enorm: mx.array
    hnorm: mx.array
    layer: DecoderLayer
    shared_head_norm: mx.array
    cfg: Qwen35Config
    compile_steps: bool = True  # run forwards of <= step.MAX_TOKENS rows as one compiled graph
    fused_norm: bool = False  # the fused add + RMSNorm kernel, from the model's options
    expert_use: ExpertUse | None = None  # the model's MoE routing observer (None: a dense head)
    kv_dtype: mx.Dtype = mx.float32  # its KV cache's element type, from the model's options
    graphs: compiled.StepGraphs = field(default_factory=compiled.StepGraphs)  # its traced forwards

    def make_cache(self) -> KVCache:
        return KVCache(self.cfg.n_head_kv, self.cfg.head_dim, dtype=self.kv_dtype)

    def __call__(self, embeds: mx.array, h_prev: mx.array, cache: KVCache, resident: bool = False,
                 one_off: bool = False) -> mx.array:
        """embeds [1, S, H] (embedding of token t), h_prev [1, S, H] (post-norm hidden at t-1);
        returns the head's normed hidden state [1, S, H] (feed it back for the next draft step).
        `resident`: the cache's offset may be a device value (compiled or not, the graph form).
        `one_off`: a shape that may not recur (the prompt's rows): compiled only if already traced."""
        s = int(embeds.shape[1])
        fits = s <= compiled.MAX_TOKENS and compilable_ffn(self.layer.mlp) and \
            (not one_off or compiled.traced(self.graphs, [cache], s))
        if (self.compile_steps and fits) or resident:
            side, set_side = self.expert_use.graph_outputs(self.expert_use.slots("mtp")) if self.expert_use \
                else (None, None)
            return compiled.run(self.graphs, self._body, [embeds, h_prev], [cache], s, side=side, set_side=set_side,
                                compiled=self.compile_steps and fits)[0]
        return self._body(embeds, h_prev, [cache])[0]

    def forward_batch(self, embeds: mx.array, h_prev: mx.array, batch, valid: list[int] | None = None) -> mx.array:
        """The head over a batch (`batch_cache.BatchCache`, advanced here): embeds, h_prev [B, S, H];
        `valid` as the trunk's `forward_batch` takes it (a padded prefill)."""
        s = int(embeds.shape[1])
        if valid is not None:
            with batch.padded(valid):
                return self._body(embeds, h_prev, batch.layers)[0]
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

