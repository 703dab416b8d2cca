"""Plain autoregressive decoding: chunked prefill, then one trunk step per token.

A decoder turns a prompt into a stream of token lists (one list per round: a plain step emits one
token, a speculative round one or more); the generation loop above handles stopping and text.

Pipelining (`pipeline = True`, set by the generation loop): greedy plain steps queue the next step
on the device (`mx.async_eval`) before the host reads the current token, as mlx-lm's
`generate_step` does, so the device never waits for the host's detokenization and stop checks.
Sampling at temperature > 0 draws on the host and is not pipelined.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import mlx.core as mx
import numpy as np

from ..model.qwen35 import Qwen35Model
from ..model.step import Pass
from .profiler import Profiler
from .prompt_cache import PromptCache
from .sampling import Sampler, check_finite, logprob_arrays, logprob_dicts

Progress = Callable[[int, int], None]  # (prompt tokens prefilled, of total)


class RoundClock:
    """Wall time between consecutive rounds' host reads (what a round costs the caller, host work
    included), and whether a round first used a shape: a forward of a new row count or cache
    capacity is traced (`mx.compile`) and its kernels JIT-compiled on a GPU, so its time is not a
    sample of the round's cost. The shapes seen are kept on the model, for the whole process."""

    def __init__(self, model: Qwen35Model):
        self.seen: set = model.graphs.seen
        # the MLX CPU backend compiles nothing unless steps are compiled: no first use to exclude
        self.costly = bool(getattr(model, "compile_steps", False)) or mx.default_device() == mx.gpu
        self._t: float | None = None
        self.rounds: list[tuple[int, float, bool]] = []  # (k, seconds, first use)

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, k: int, shapes: list, shift: float = 0.0) -> tuple[float, bool]:
        """This round's seconds since the last lap (plus `shift`, a pipelined round's correction
        for work of another round inside its interval) and whether it first used a shape."""
        now = time.perf_counter()
        seconds = max(now - (self._t if self._t is not None else now) + shift, 0.0)
        self._t = now
        first = self.costly and any(s not in self.seen for s in shapes)
        self.seen.update(shapes)
        self.rounds.append((k, seconds, first))
        return seconds, first

    def compile_seconds(self) -> float:
        """First-use rounds' time beyond the median of the warm rounds of the same k (or of all)."""
        warm: dict[int, list[float]] = {}
        for k, s, first in self.rounds:
            if not first:
                warm.setdefault(k, []).append(s)
        every = [s for v in warm.values() for s in v]
        total = 0.0
        for k, s, first in self.rounds:
            if first:
                ref = warm.get(k) or every
                total += max(s - statistics.median(ref), 0.0) if ref else 0.0
        return total


def kv_capacity(cache) -> int:
    """Capacity of a cache's first attention buffer (compiled graphs are specialised to it)."""
    for c in getattr(cache, "layers", [cache]):
        cap = getattr(c, "capacity", None)
        if cap is not None:
            return int(cap)
    return 0


class DecoderBase:
    """What plain and speculative decoders share: the trunk's cache and chunked prefill, the
    sampler, the round clock, per-round provenance for the generation loop, and (MoE models, when
    profiling) expert counts. A decoder turns a prompt into a stream of token lists: `prefill`,
    then `step` per round, then `finish`; `stats` at the end."""

    prefill_chunk: int | None = None  # prompt tokens per prefill forward; None: the model's options'

    def __init__(self, model: Qwen35Model, sampler: Sampler, profiler: Profiler | None = None, *,
                 prompt_cache: PromptCache | None = None, progress: Progress | None = None,
                 pipeline: bool = True):
        """`pipeline`: queue the next round before the host reads the current one, where the
        caller wants more tokens than a round gives (`prefill`'s budget) and nothing needs the
        host in between (sampling on the host, precise profiling)."""
        self.model = model
        self.pipeline = pipeline
        self.budget: int | None = None  # tokens the caller still wants (`prefill`): none queued past them
        self.progress = progress  # told (tokens done, total) after each prefill chunk
        self.sampler = sampler
        self.prof = profiler or Profiler("off")
        self.cache = model.make_cache()
        self.last_token: int | None = None
        self.moe_experts: dict[str, tuple[int, float]] = {}  # kind -> (forwards, sum of per-layer means)
        self.clock = RoundClock(model)
        # what the last prefill/step emitted, for the generation loop: per token whether it was an
        # accepted draft, its logprobs (when asked for), and how many drafts the round proposed
        self.round_drafted: list[bool] = []
        self.round_logprobs: list[dict] | None = None
        self.round_n_drafted = 0
        self.prompt_cache = prompt_cache  # where prompt state is reused from and kept
        self.cached_tokens = 0  # prompt tokens the last prefill took from the prompt cache

    def prefill(self, ids: list[int], budget: int | None = None) -> list[int]:
        """Processes the prompt; returns the tokens it already produces. `budget`: the most tokens
        the caller will take (the generation loop's max_tokens; None: it reads one round at a time,
        so no round is queued ahead)."""
        raise NotImplementedError

    def step(self) -> list[int]:
        """One round; returns the tokens it emits (at least one)."""
        raise NotImplementedError

    def _pipelined(self) -> bool:
        # precise profiling must see each stage's own work; a grammar's masks need the host's
        # tokens (`Sampler.on_device`)
        return bool(self.pipeline) and self.sampler.on_device and not self.prof.enabled

    def _wanted(self) -> int:
        return self.budget if self.budget is not None else 1

    def _emitted(self, tokens: list[int], n_accepted: int, n_drafted: int,
                 logprobs: list[dict] | None) -> list[int]:
        """Records a round's provenance and `logprobs` (one per token, or None) and adds the tokens
        to the sampler's penalty history."""
        self.round_drafted = [True] * n_accepted + [False] * (len(tokens) - n_accepted)
        self.round_n_drafted = n_drafted
        self.round_logprobs = logprobs
        self.sampler.accept(tokens)
        if self.budget is not None:
            self.budget -= len(tokens)
        return tokens

    def _prefill_trunk(self, ids: list[int], pick: Callable[[mx.array, mx.array], mx.array] | None = None,
                       start: int = 0, whole: int | None = None) -> mx.array:
        """Runs the prompt through the trunk in chunks; returns every row's post-norm hidden state,
        or `pick(post, pre)` of it (what a drafter is fed). `ids` sit at `start` of a prompt of
        `whole` tokens: `progress` is told the prompt's tokens handled of all of them, once before
        the first chunk (those reused from a prompt cache) and after each chunk."""
        if not ids:
            return mx.zeros((1, 0, self.model.cfg.hidden_size))
        whole = start + len(ids) if whole is None else whole
        if self.progress is not None:
            self.progress(start, whole)
        hiddens = []
        chunk = self.prefill_chunk or self.model.options.prefill_chunk
        for s in range(0, len(ids), chunk):
            post, pre = self.model.forward_states(mx.array([ids[s:s + chunk]]), self.cache, Pass.PREFILL)
            h = pick(post, pre) if pick else post
            mx.eval(h, *self.cache.arrays())
            hiddens.append(h)
            if self.progress is not None:
                self.progress(start + min(s + chunk, len(ids)), whole)
        return mx.concatenate(hiddens, axis=1) if len(hiddens) > 1 else hiddens[0]

    def _reuse_prefix(self, prefix: list[int], drafter: str | None = None):
        """With a prompt cache: takes over the kept state when `prefix` starts with its tokens
        (returns it, and `self.cache` now holds it); None otherwise."""
        self.cached_tokens = 0
        kept = self.prompt_cache.take(self.model, prefix, drafter) if self.prompt_cache is not None else None
        if kept is None:
            return None
        self.cache = kept.trunk
        self.cache.restore(kept.snapshot)
        self.cached_tokens = len(kept.tokens)
        return kept

    def _count_experts(self, kind: str) -> None:
        """MoE models, when profiling: distinct experts each layer read in the last forward
        (verify batches read up to (k+1) x top-k experts, a single step top-k)."""
        use = self.model.expert_use
        if not self.prof.enabled or use is None:
            return
        counts = [use.distinct(s) for s in use.slots("trunk")]
        if counts:
            n, total = self.moe_experts.get(kind, (0, 0.0))
            self.moe_experts[kind] = (n + 1, total + sum(counts) / len(counts))

    def finish(self) -> None:
        """The generation is over."""

    def stats(self) -> dict:
        return {"compile_seconds": self.clock.compile_seconds(), **self._moe_stats()}

    def _moe_stats(self) -> dict:
        if not self.moe_experts:
            return {}
        return {"moe_distinct_experts_per_layer": {k: t / n for k, (n, t) in self.moe_experts.items()}}


class PlainDecoder(DecoderBase):
    """Decodes one token per trunk forward."""

    def __init__(self, model: Qwen35Model, sampler: Sampler, profiler: Profiler | None = None, *,
                 prompt_cache: PromptCache | None = None, progress: Progress | None = None,
                 pipeline: bool = True):
        super().__init__(model, sampler, profiler, prompt_cache=prompt_cache, progress=progress, pipeline=pipeline)
        self._next: list[mx.array] | None = None  # a queued step's `_drawn` values

    def _drawn(self, logits: mx.array) -> list[mx.array]:
        """A step's device values from its logits [V], evaluated asynchronously: its token
        (`Sampler.draw` of the penalised logits), whether the logits are finite, and its logprobs
        where asked for."""
        token = self.sampler.draw(self.sampler.penalize(logits))
        out = [token, mx.all(mx.isfinite(logits))]
        if self.sampler.cfg.logprobs is not None:
            out += logprob_arrays(logits[None], token.reshape(1), self.sampler.cfg.logprobs)
        mx.async_eval(*out)
        return out

    def _queue_step(self, token: mx.array, unread: bool) -> list[mx.array]:
        """The next step from `token` on the device (`_drawn`); `unread`: the host has not read it
        yet (its penalties' history goes on through it)."""
        h = self.model.forward(token.reshape(1, 1).astype(mx.int32), self.cache)
        ahead = (token.reshape(1), mx.array(1)) if unread and self.sampler.cfg.penalties.active else None
        with self.sampler.reading_ahead(ahead):
            return self._drawn(self.model.logits(h[0, -1]))

    def _take(self, drawn: list[mx.array]) -> list[int]:
        """The host reads a `_drawn` step: its token becomes the last one, with its logprobs."""
        mx.eval(*drawn)
        check_finite(drawn[1])
        self.last_token = int(drawn[0].item())
        n = self.sampler.cfg.logprobs
        logprobs = logprob_dicts([np.array(a) for a in drawn[2:]], [self.last_token], n) if n is not None else None
        return self._emitted([self.last_token], 0, 0, logprobs)

    def prefill(self, ids: list[int], budget: int | None = None) -> list[int]:
        """Processes the prompt; returns the tokens it already produces (here the first one)."""
        self.budget = budget
        self.sampler.begin(ids)
        with self.prof.stage("prefill"):
            # only each chunk's last row is kept: a 32k-token prompt's every hidden state is 0.5 GB at 9B
            last = lambda post, pre: post[:, -1:]  # noqa: E731
            if self.prompt_cache is None:
                h = self._prefill_trunk(ids, pick=last)
            else:  # all but the last token, kept for the next prompt that starts with them
                self._reuse_prefix(ids[:-1])
                self._prefill_trunk(ids[self.cached_tokens:-1], pick=last, start=self.cached_tokens, whole=len(ids))
                self.prompt_cache.keep(self.model, ids[:-1], self.cache)
                h = self._prefill_trunk(ids[-1:], start=len(ids) - 1, whole=len(ids))
            logits = self.model.logits(h[0, -1])
            if self._pipelined():
                cur = self._drawn(logits)
                if self._wanted() > 1:
                    self._next = self._queue_step(cur[0], unread=True)
                emitted = self._take(cur)
            else:
                self.last_token = self.sampler.sample(logits)
                emitted = self._emitted([self.last_token], 0, 0, self.sampler.token_logprobs(logits, [self.last_token]))
        self.clock.start()
        return emitted

    def step(self) -> list[int]:
        """Feeds the last token; returns the next one."""
        if self._pipelined():
            cur = self._next or self._queue_step(mx.array(self.last_token), unread=False)
            self._next = self._queue_step(cur[0], unread=True) if self._wanted() > 1 else None
            emitted = self._take(cur)
            self.clock.lap(0, [("trunk", 1, False, kv_capacity(self.cache))])
            return emitted
        with self.prof.stage("decode") as out:
            h = self.model.forward(mx.array([[self.last_token]]), self.cache)
            logits = self.model.logits(h[0, -1])
            out.append(logits)
        with self.prof.stage("sync"):
            self.last_token = self.sampler.sample(logits)
        self._count_experts("step")
        self.clock.lap(0, [("trunk", 1, False, kv_capacity(self.cache))])
        return self._emitted([self.last_token], 0, 0, self.sampler.token_logprobs(logits, [self.last_token]))

    def finish(self) -> None:
        """The generation is over (a queued step, if any, is dropped)."""
        self._next = None
