"""Qwen3.5: gated-delta-net and gated full-attention trunk, plus its MTP head.

Weights come in GGUF naming and conventions (norms already +1, `ssm_a` = -exp(A_log), value heads
in tiled order); the HF loader converts to the same form, so there is one forward pass. The FFN of
a block is any `FFN`: the dense `MLP` here, or the mixture of experts of `moe.py` (qwen35moe).
"""
from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..options import EngineOptions
from . import delta_rule, gdn, kernels
from . import step as compiled
from .batch_cache import BatchCache
from .blocks import DecoderLayer, GatedAttention, GatedDeltaNet, compilable_ffn, run_layers
from .cache import RecurrentCache, TrunkCache
from .config import Qwen35Config
from .expert_use import ExpertUse
from .kv_cache import KVCache
from .layers import Linear, stored
from .mtp_head import MTPHead


class TrunkStates(NamedTuple):
    """A trunk forward's hidden states: after `output_norm` (what the output head and the MTP head
    read) and before it (what an ablation feeds the head instead)."""

    post: mx.array
    pre: mx.array


class Qwen35Model(nn.Module):
    """The trunk (embedding, decoder layers, output norm, output head) and its optional MTP head."""

    embed, output_norm, lm_head, mtp, _draft_head = stored(5)

    def __init__(self, cfg: Qwen35Config, embed: Linear, layers: list[DecoderLayer], output_norm: mx.array,
                 lm_head: Linear, mtp: MTPHead | None, options: EngineOptions | None = None,
                 expert_use: ExpertUse | None = None):
        super().__init__()
        self.cfg = cfg
        self.expert_use = expert_use  # the MoE blocks' routing observer; None for a dense model
        self.embed = embed
        self.layers = layers
        self.output_norm = output_norm
        self.lm_head = lm_head
        self.mtp = mtp
        self.fused_norm = False
        self.graphs = compiled.StepGraphs()  # the trunk's traced forwards (the head keeps its own)
        self.use(options if options is not None else EngineOptions())

    def use(self, options: EngineOptions) -> None:
        """Runs this model under `options` (None fields resolved from the environment and the
        device; `self.options` keeps the resolved copy): compiled steps, which custom kernels (each
        only where it passed its self-test in this process) and row padding. Graphs traced under
        earlier options are dropped."""
        opts = options.resolve()
        allowed = opts.kernel_set
        c = self.cfg  # self-tested at this model's own shapes (shares the kernels' compiles)
        gdn_dims = gdn.Dims(c.ssm_key_heads, c.ssm_key_dim, c.ssm_value_heads, c.ssm_value_dim, c.conv_kernel,
                            c.eps) if any(c.recurrent) else None
        attn_shape = (c.n_head, c.n_head_kv, c.head_dim, c.n_rot)
        kv_dtype = getattr(mx, opts.kv_dtype)
        shapes = {"qmv": None, "gdn": gdn_dims, "attn": attn_shape + (opts.kv_dtype,), "norm": None}
        parts = self._unique_modules()
        linears = [m for m in parts if isinstance(m, Linear)]
        ok = kernels.check({name: shapes[name] for name in shapes if name in allowed}, opts.cache_path,
                           linears, c.hidden_size)
        ok = {name: ok.get(name, False) for name in shapes}
        qmv, fused_gdn, fused_attn, self.fused_norm = ok["qmv"], ok["gdn"], ok["attn"], ok["norm"]
        for obj in parts:
            if isinstance(obj, Linear):
                obj.custom_kernel, obj.row_pad, obj.dequant_rows = qmv, opts.row_pad, opts.dequant_rows
            elif isinstance(obj, GatedDeltaNet):
                obj.fused_kernel = fused_gdn
            elif isinstance(obj, GatedAttention):
                obj.fused_kernel = fused_attn
        self.kv_dtype = kv_dtype
        n = opts.draft_vocab  # a sharded head (tensor parallel) holds other rows: it drafts over all of them
        # a view of the output head's rows, not weights of its own (the leading "_" keeps it out of
        # `parameters()`)
        self._draft_head = self.lm_head.first_outputs(n) if (isinstance(self.lm_head, Linear)
                                                             and 0 < n < self.lm_head.out_features) else None
        if self.mtp is not None:
            self.mtp.fused_norm, self.mtp.kv_dtype = self.fused_norm, self.kv_dtype
        for owner in (self, self.mtp):
            if owner is not None:
                owner.graphs = compiled.StepGraphs()  # traced under other kernel choices
        self.options = opts
        self.compile_steps = opts.compile_steps

    def _unique_modules(self) -> list[nn.Module]:
        """Every module of the trunk and the MTP head once (a tied output head is the embedding)."""
        unique: dict[int, nn.Module] = {}
        for m in self.modules():
            unique.setdefault(id(m), m)
        return list(unique.values())

    def linears(self) -> list[Linear]:
        """Every product of the trunk and the MTP head, once each."""
        return [m for m in self._unique_modules() if isinstance(m, Linear)]

    @property
    def compile_steps(self) -> bool:
        """Whether forwards of at most `step.MAX_TOKENS` rows (decode, draft, verify, catch-up) run as
        one compiled graph each (default); off, every operation is dispatched on its own."""
        return self._compile_steps

    @compile_steps.setter
    def compile_steps(self, on: bool) -> None:
        self._compile_steps = bool(on)
        self.options = self.options.updated(compile_steps=bool(on))
        if self.mtp is not None:
            self.mtp.compile_steps = bool(on)

    @property
    def is_moe(self) -> bool:
        return self.cfg.n_expert > 0 if hasattr(self.cfg, "n_expert") else False

    @property
    def kv_tail(self) -> int:
        """Positions of an attention cache's tail (`KVCache`): compiled steps write there; 0: none."""
        return self.options.kv_tail if self._compile_steps else 0

    def make_cache(self) -> TrunkCache:
        c = self.cfg
        caches: list[KVCache | RecurrentCache] = []
        for rec in c.recurrent:
            if rec:
                caches.append(RecurrentCache(c.conv_kernel, c.conv_channels, c.ssm_value_heads, c.ssm_key_dim,
                                             c.ssm_value_dim))
            else:
                caches.append(KVCache(c.n_head_kv, c.head_dim, dtype=self.kv_dtype, tail=self.kv_tail))
        return TrunkCache(caches)

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.embed.rows(ids)

    def forward(self, ids: mx.array, cache: "TrunkCache | BatchCache",
                how: compiled.Pass = compiled.Pass.STEP) -> mx.array:
        """Runs ids [B, S] through the trunk, appending to `cache` (a sequence's `TrunkCache`, B =
        1, or a `BatchCache` of B sequences each at its own length: `forward_batch`); returns the
        hidden state after `output_norm` [B, S, H] (what the output head and the MTP head read;
        `forward_states` also gives the state before it). `how` (`step.Pass`) says what the
        forward is for: a step, a prompt's prefill, a verify that keeps rollback states, or either
        inside a device-resident round (there `cache.offset`, the host's count, is left to the
        round)."""
        return self.forward_states(ids, cache, how).post

    def forward_states(self, ids: mx.array, cache: "TrunkCache | BatchCache",
                       how: compiled.Pass = compiled.Pass.STEP) -> TrunkStates:
        """`forward`, returning the hidden states before `output_norm` too."""
        if isinstance(cache, BatchCache):
            return self._batch_states(ids, cache, capture=how.capture)
        s = int(ids.shape[1])
        if how.capture:
            cache.begin_capture(s)
        fits = self._step_fits(s) and \
            (how is not compiled.Pass.PREFILL or compiled.traced(self.graphs, cache.layers, s, how.capture))
        if (self._compile_steps and fits) or how.resident:
            # the MoE blocks' routing leaves the graph as extra outputs (for the profiler's counts)
            side, set_side = self.expert_use.graph_outputs(self.expert_use.slots("trunk")) if self.expert_use \
                else (None, None)
            # no rollback returns below the trunk's host count (committed tokens): KV tails may move there
            post, x = compiled.run(self.graphs, self._body, [ids], cache.layers, s, capture=how.capture,
                                   side=side, set_side=set_side, compiled=self._compile_steps and fits,
                                   floor=int(cache.offset))
        else:
            post, x = self._body(ids, cache.layers)
        if not how.resident:
            cache.offset += s
        return TrunkStates(post, x)

    def reads_compiled(self, cache: "TrunkCache", tokens: int) -> bool:
        """Whether a prompt's read of `tokens` into `cache` runs a compiled graph (one traced already
        for its shape: `forward_states`' PREFILL pass), not the operations one by one."""
        return self._compile_steps and self._step_fits(tokens) and compiled.traced(self.graphs, cache.layers, tokens)

    def _step_fits(self, tokens: int) -> bool:
        """Whether a forward of `tokens` per row can be one compiled graph."""
        return tokens <= compiled.MAX_TOKENS and all(compilable_ffn(l.mlp) for l in self.layers)

    def forward_batch(self, ids: mx.array, batch: BatchCache, capture: bool = False) -> mx.array:
        """ids [B, S]: the next S tokens of each of B sequences, each at its own length in `batch`
        (advanced here); returns the post-norm hidden states [B, S, H]. Up to `step.MAX_TOKENS`
        tokens per row it is one compiled graph, as a single sequence's. `capture`: recurrent layers
        keep every position's state (`BatchCache.rollback_lazy` picks one)."""
        return self._batch_states(ids, batch, capture).post

    def _batch_states(self, ids: mx.array, batch: BatchCache, capture: bool = False) -> TrunkStates:
        s = int(ids.shape[1])
        if capture:
            batch.begin_capture(s)
        # prompts read together (`BatchCache.begin_rows`) run uncompiled, as a prompt alone does: their
        # shapes rarely recur, and each row's lengths are the forward's own
        if self._compile_steps and batch.valid is None and self._step_fits(s):
            post, x = compiled.run_batch(self.graphs, self._body, [ids], batch, s)
        else:
            post, x = self._body(ids, batch.layers)
        batch.advance(s)
        return TrunkStates(post, x)

    def _body(self, ids: mx.array, caches: list) -> list[mx.array]:
        post, x = run_layers(self.layers, self.embed_tokens(ids), caches, self.output_norm, self.cfg.eps,
                             self.fused_norm)
        return [post, x]

    def read_arithmetic(self, tokens: int, rows: int, apart: bool = False) -> tuple | None:
        """What a forward of `rows` rows, `tokens` per sequence, computes each row with: the delta
        rule's form (the fused kernel's token steps, MLX's, or the chunked form's chunking) and each
        product's path (`Linear.product_path`). `apart`: rows of their own lengths in one forward
        (`BatchCache.begin_rows`), which the fused kernel never steps. Prompts padded to a group's
        longest and read in one pass compute as alone where this is the same alone at their own
        length and apart at the group's. None: no row of this model is read beside others (a
        mixture of experts routes the rows together)."""
        if self.is_moe:
            return None
        if tokens > gdn.SEQUENTIAL_MAX:
            rule = delta_rule.chunking(tokens)
        else:  # token steps: the fused kernel's (`GatedDeltaNet.kernel_fits`), or MLX's operations
            mixers = [layer.mixer for layer in self.layers if isinstance(layer.mixer, GatedDeltaNet)]
            rule = "kernel" if not apart and any(m.kernel_fits(rows // tokens, tokens) for m in mixers) else "steps"
        paths = {m.product_path(tokens, rows) for layer in self.layers for m in layer.modules()
                 if isinstance(m, Linear)}
        return rule, tuple(sorted(paths))

    def logits(self, hidden: mx.array) -> mx.array:
        return self.lm_head(hidden)

    def draft_logits(self, hidden: mx.array) -> mx.array:
        """The MTP head's scores for a draft: `logits`, or with `EngineOptions.draft_vocab` N the
        first N tokens' scored and the rest -inf (same shape, so penalties, sampling and the
        acceptance rule read them as they read full logits)."""
        if self._draft_head is None:
            return self.logits(hidden)
        head = self._draft_head(hidden)
        rest = mx.full((*head.shape[:-1], self.lm_head.out_features - head.shape[-1]), -mx.inf, head.dtype)
        return mx.concatenate([head, rest], axis=-1)

    def nbytes(self) -> dict[str, int]:
        """Bytes of weights held by the trunk and by the MTP head's own tensors (an array shared by
        both, as a tied output head's, counted once, in the trunk)."""
        seen: set[int] = set()

        def total(params) -> int:
            arrays = [a for _, a in tree_flatten(params) if isinstance(a, mx.array) and id(a) not in seen]
            seen.update(id(a) for a in arrays)
            return sum(a.nbytes for a in arrays)

        params = self.parameters()
        mtp = params.pop("mtp", None)
        return {"trunk": int(total(params)), "mtp": int(total(mtp) if mtp is not None else 0)}
