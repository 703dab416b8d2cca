"""The speculative decoder: any drafter proposes, one trunk forward verifies, in rounds that stay
on the device.

A round is `round.draft_round` (draft, verify, accept, commit: every decision a lazy MLX value)
over the sequence's one row; this module is the pipelining layer around it:

  - the host queues round r+1 before it reads round r (from r's device values: the next round's
    first input is `emitted[n]`, KV offsets are `base + n + 1`, gated-delta-net states the masked
    `state_after` of n + 1 tokens), then reads r's (emitted, n), detokenizes and checks stops
    while the device runs r+1;
  - k comes from the scheduler (`n-max auto`, speculative/scheduler.py) or n-max; only k changes
    the graphs, accepted lengths never do; k = 0 is `PlainDecoder`'s round (`round.plain_round`,
    the drafter kept in step);
  - where the next round needs this one on the host it is launched after the read: a drafter
    whose drafts come from the host's history (n-gram lookup), a grammar (its masks follow the
    emitted tokens), a precise profile (each stage evaluated at its end). Penalties go on through
    the queued round's tokens on the device (`Sampler.reading_ahead`).

The pipelining, the host's read and the plain round are `PlainDecoder`'s, which this extends with
drafting rounds: a run that will not draft (n-max 0, or auto where even fully accepted drafts
cannot pay on this device: MLX's CPU backend) is `PlainDecoder`'s run, round for round. Output is plain
decoding's: greedy token-identical, sampling lossless (`round.accept_sampling_device`).
"""
from __future__ import annotations

from collections import Counter

import mlx.core as mx

from ..errors import MTPEngineError
from ..generation.decode import PlainDecoder, Progress, Queued, kv_capacity
from ..generation.profiler import Profiler
from ..generation.prompt_cache import PromptCache
from ..generation.sampling import Sampler, distribution
from ..model.cache import capture_at_width
from ..model.qwen35 import Qwen35Model
from . import calibration
from .config import DraftParams
from .drafter import DraftContext, Drafter, DrafterFactory
from .round import accept_greedy_device, accept_sampling_device, draft_round
from .scheduler import DraftLengthScheduler
from .stats import RoundCounts


class SpeculativeDecoder(PlainDecoder):
    """Speculative decoding with any `Drafter`: rounds, acceptance, scheduling and statistics.
    `drafter`: a drafter class (or any `DrafterFactory`), built here with this decoder's model,
    sampler and profiler; it offers the device round's stages (`draft`, `commit`, `accept_plain`,
    ...: speculative/drafter.py). `scheduler` is required when `params.n_max` is None (auto);
    `trace`, a list, gets one record per completed round (drafts, accepted count, emitted tokens)."""

    def __init__(self, model: Qwen35Model, sampler: Sampler, params: DraftParams, drafter: DrafterFactory,
                 profiler: Profiler | None = None, scheduler: DraftLengthScheduler | None = None, *,
                 prompt_cache: PromptCache | None = None, calibration_path: str = "",
                 progress: Progress | None = None, pipeline: bool = True, trace: list[dict] | None = None):
        if params.auto and scheduler is None:
            raise MTPEngineError("n-max auto needs a scheduler with the device's measured costs", field="n-max")
        super().__init__(model, sampler, profiler, prompt_cache=prompt_cache, progress=progress, pipeline=pipeline)
        self.params = params
        self.scheduler = scheduler if params.auto else None
        self.drafter: Drafter = drafter(DraftContext(model, sampler, self.prof))
        self.counts = RoundCounts()  # statistics
        self.k_histogram: Counter = Counter()  # auto: the draft length chosen, per completed round
        self.trace = trace  # per-round records, when the caller asked for them
        self.calibration_path = calibration_path  # model file whose stored costs this run updates
        # decided once per run; a run that does not draft leaves nothing for the next one to learn
        # beyond its plain steps' time (a device's costs, not its acceptance, rule drafting out)
        self.drafting = self.scheduler.can_win if self.scheduler is not None else params.k_max > 0

    # ---- prompt -------------------------------------------------------------------------------
    def prefill(self, ids: list[int], budget: int | None = None) -> list[int]:
        """Prefills all but the last prompt token (as llama.cpp's draft-mtp does), so the first
        round drafts from the last prompt token and its verify yields the first new token."""
        if not self.drafting:
            return super().prefill(ids, budget)
        self.budget = budget
        self.sampler.begin(ids)
        self._emitted([], 0, 0, None)
        with self.prof.stage("prefill"):
            reader = self._reader(ids, end=len(ids) - 1, drafter=self.drafter, fed=self._fed).read_all()
            reader.report(whole=True)  # the last token is read by the first round, at once
            if self.model.compile_steps:  # one verify graph per width, whatever the round before drafted
                longest = self.scheduler.k_max if self.scheduler is not None else self.params.k_max
                capture_at_width(self.cache.layers, longest + 1)
            self.last_token = ids[-1]
        self._start_rounds()
        self._last_dev = mx.array([ids[-1]], dtype=mx.int32)
        self.drafter.to_device()
        self.clock.start()
        return []

    # ---- one round ----------------------------------------------------------------------------
    def plain_step(self) -> list[int]:
        """A round without drafting (the drafter kept in step)."""
        return self._complete(self._launch(0))

    def _choose_k(self) -> int:
        if not self.drafting:
            return 0
        k = self.scheduler.next_k(self.cache.offset) if self.scheduler else self.params.k_max
        return self.drafter.available(k) if k else 0

    def _ahead(self) -> bool:
        """Whether the next round is queued before the host reads this one (module docstring)."""
        return super()._ahead() and not (self.drafting and self.drafter.reads_history)

    # ---- launch -------------------------------------------------------------------------------
    def _launch(self, k: int) -> Queued:
        if k == 0:
            return super()._launch(0)
        shapes = self._shapes(k)
        with self.sampler.reading_ahead(self._unread()):
            r = draft_round(self.model, self.cache, self.drafter, self._last_dev, k, self._accept, self._fed,
                            self.params.p_min, self.params.n_min, score=self._score,
                            logprobs=self.sampler.cfg.logprobs, stage=self.prof.stage)
        return self._queue(Queued(r, k + 1, shapes))

    def _shapes(self, k: int) -> list:
        """The forward shapes a round of k drafts runs (a first use compiles)."""
        return self.drafter.round_shapes(k) + [("trunk", k + 1, True, kv_capacity(self.cache))]

    def _pending(self) -> list[mx.array]:
        return self.drafter.pending_arrays() if self.drafting else []

    def _score(self, drafts: mx.array, logits: mx.array) -> mx.array:
        """What the rule compares, for the one row's drafts [1, k] and logits [1, k+1, V]: the
        penalised (and grammar-masked) logits, row i counting drafts 1..i as generated, or when
        sampling the distributions drawn from."""
        scored = self.sampler.constrain(self.sampler.penalize(logits[0], drafts[0]), drafts[0])[None]
        return scored if self.sampler.cfg.greedy else distribution(scored, self.sampler.cfg)

    def _accept(self, drafts: mx.array, scored: mx.array, q: mx.array | None,
                live: mx.array) -> tuple[mx.array, mx.array]:
        """(n accepted [1], emitted [1, k+1]) as device values."""
        if self.sampler.cfg.greedy:
            return accept_greedy_device(drafts, scored, live)
        return accept_sampling_device(drafts, scored, q, live, self.sampler.draws.next())

    # ---- the host's read, one round late -------------------------------------------------------
    def _committed(self, emitted: list[int], kept: int) -> None:
        if self.drafting:
            self.drafter.round_read(emitted)
        super()._committed(emitted, kept)
        if self.drafting:
            self.drafter.trunk_committed(self.cache.offset)

    def _record_round(self, k: int, drafts: list[int], n: int, emitted: list[int], seconds: float,
                      first_use: bool, steady: bool) -> None:
        """A completed round of k asked (`drafts` counted, n accepted): statistics, the scheduler's
        observation and the trace, for a device round and a non-drafting run's step alike."""
        self.counts.record(len(drafts), n)
        self.k_histogram[k] += 1
        if self.scheduler:
            self.scheduler.observe(len(drafts), n, seconds, self.cache.offset, first_use, steady)
        if self.trace is not None:
            self.trace.append({"draft": drafts, "n_accepted": n, "emitted": emitted})

    def finish(self) -> None:
        """The generation is over: a queued round is dropped, and what this run measured of its
        rounds' costs is kept for the next run on this model and device."""
        super().finish()
        if self.scheduler and self.calibration_path:
            t0 = self.scheduler.step_seconds()
            calibration.save(self.calibration_path, self.model, self.scheduler.measured_round_steps(),
                             t0 * 1e3 if t0 else None, self.model.options.cache_path,
                             self.scheduler.measured_acceptance(), self.scheduler.measured_rounds())

    # ---- statistics ---------------------------------------------------------------------------
    def stats(self) -> dict:
        extra = super().stats()  # compile time, MoE expert counts
        if self.scheduler:
            extra.update({"n_max": "auto", "auto_message": self.scheduler.message(),
                          "draft_length_histogram": {str(k): v for k, v in sorted(self.k_histogram.items())},
                          **self.scheduler.stats()})
        return {**extra, **self.counts.stats(self.params.k_max), **self.drafter.stats()}
