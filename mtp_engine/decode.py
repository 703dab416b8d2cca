"""Plain autoregressive decoding: chunked prefill, then one trunk step per token.

A decoder turns a prompt into a stream of token lists (one list per round: a plain step emits one
token, a speculative round one or more); the generation loop above handles stopping and text.
"""
from __future__ import annotations

import mlx.core as mx

from .model.qwen35 import Qwen35Model
from .profiler import Profiler
from .sampling import Sampler


class PlainDecoder:
    """Decodes one token per trunk forward."""

    prefill_chunk = 512

    def __init__(self, model: Qwen35Model, sampler: Sampler, profiler: Profiler | None = None):
        self.model = model
        self.sampler = sampler
        self.prof = profiler or Profiler("off")
        self.cache = model.make_cache()
        self.last_token: int | None = None
        self.moe_experts: dict[str, tuple[int, float]] = {}  # kind -> (forwards, sum of per-layer means)
        # what the last prefill/step emitted, for the generation loop: per token whether it was an
        # accepted draft, its logprobs (when asked for), and how many drafts the round proposed
        self.round_drafted: list[bool] = []
        self.round_logprobs: list[dict] | None = None
        self.round_n_drafted = 0

    def _emitted(self, tokens: list[int], n_accepted: int, n_drafted: int, logits: mx.array | None) -> list[int]:
        """Records a round's provenance and logprobs (rows of `logits` score `tokens`) and adds
        the tokens to the sampler's penalty history."""
        self.round_drafted = [True] * n_accepted + [False] * (len(tokens) - n_accepted)
        self.round_n_drafted = n_drafted
        self.round_logprobs = self.sampler.token_logprobs(logits, tokens) if logits is not None else None
        self.sampler.accept(tokens)
        return tokens

    def _prefill_trunk(self, ids: list[int], prenorm: bool = False) -> mx.array:
        """Runs the prompt through the trunk in chunks; returns the post-norm (or, for the
        ablation, pre-norm) hidden state of every row."""
        if not ids:
            return mx.zeros((1, 0, self.model.cfg.hidden_size))
        hiddens = []
        for s in range(0, len(ids), self.prefill_chunk):
            post, pre = self.model.forward(mx.array([ids[s:s + self.prefill_chunk]]), self.cache,
                                           return_prenorm=True)
            h = pre if prenorm else post
            mx.eval(h, *self.cache.arrays())
            hiddens.append(h)
        return mx.concatenate(hiddens, axis=1) if len(hiddens) > 1 else hiddens[0]

    def prefill(self, ids: list[int]) -> list[int]:
        """Processes the prompt; returns the tokens it already produces (here the first one)."""
        self.sampler.begin(ids)
        with self.prof.stage("prefill"):
            h = self._prefill_trunk(ids)
            logits = self.model.logits(h[0, -1])
            self.last_token = self.sampler.sample(logits)
        return self._emitted([self.last_token], 0, 0, logits)

    def _count_experts(self, kind: str) -> None:
        """MoE models, when profiling: distinct experts each layer read in the last forward
        (verify batches read up to (k+1) x top-k experts, a single step top-k)."""
        if not self.prof.enabled or not self.model.is_moe:
            return
        from .model.moe import experts_touched

        counts = experts_touched(self.model)["trunk"]
        if counts:
            n, total = self.moe_experts.get(kind, (0, 0.0))
            self.moe_experts[kind] = (n + 1, total + sum(counts) / len(counts))

    def step(self) -> list[int]:
        """Feeds the last token; returns the next one."""
        with self.prof.stage("decode") as out:
            h = self.model.forward(mx.array([[self.last_token]]), self.cache)
            logits = self.model.logits(h[0, -1])
            out.append(logits)
        with self.prof.stage("sync"):
            self.last_token = self.sampler.sample(logits)
        self._count_experts("step")
        return self._emitted([self.last_token], 0, 0, logits)

    def stats(self) -> dict:
        return self._moe_stats()

    def _moe_stats(self) -> dict:
        if not self.moe_experts:
            return {}
        return {"moe_distinct_experts_per_layer": {k: t / n for k, (n, t) in self.moe_experts.items()}}
