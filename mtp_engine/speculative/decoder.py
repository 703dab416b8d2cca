"""The speculative decoder: any drafter proposes, one trunk forward verifies.

One round, each stage a method named as in the loop that calls it:
  draft     the drafter's proposal, up to k tokens (speculative/drafter.py); k from the scheduler
            (`n-max auto`, speculative/scheduler.py) or n-max.
  verify    one trunk forward over [last token, d1..dk], capturing per-position recurrent states.
  accept    greedy prefix match, or lossless speculative sampling (speculative/accept.py); the one
            host sync of a round.
  rollback  KV caches truncated; gated-delta-net states set to the captured state after the last
            accepted token (no re-decoding); the drafter drops what its rejected drafts left.
  catch_up  the drafter is told what the round emitted, with the trunk's hidden states.
A round with k = 0 is exactly a plain step (no capture, no drafter work).

Pipelining (`pipeline`, and a budget from the caller): a greedy plain round queues the next plain
round from its token still on the device; any round queues the next one right after its host
read, so device work overlaps the caller's detokenization.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..errors import MTPEngineError
from ..generation.decode import DecoderBase, Progress, kv_capacity
from ..generation.profiler import Profiler
from ..generation.prompt_cache import PromptCache
from ..generation.sampling import Sampler, check_finite, distribution
from ..model.cache import capture_at_width
from ..model.qwen35 import Qwen35Model
from ..model.step import Pass
from . import calibration
from .accept import accept_greedy, accept_sampling
from .config import DraftParams
from .drafter import Draft, DraftContext, Drafter, DrafterFactory
from .scheduler import DraftLengthScheduler
from .stats import RoundCounts


@dataclass
class _Round:
    """A round queued on the device, completed (host read, accept, rollback) later."""

    k: int  # drafts asked for (the scheduler's choice, or n-max)
    plain: bool
    shapes: list = field(default_factory=list)  # forward shapes it runs (first use = a compile)
    logits: mx.array | None = None
    token: mx.array | None = None  # greedy plain step: its argmax, on the device
    finite: mx.array | None = None
    fed: mx.array | None = None  # the trunk hidden states the drafter is fed, one per row run
    draft: Draft = field(default_factory=Draft)
    target: mx.array | None = None


class SpeculativeDecoder(DecoderBase):
    """Speculative decoding with any `Drafter`: verify, acceptance, trunk rollback, scheduling and
    statistics. `drafter`: a drafter class (or any `DrafterFactory`), built here with this
    decoder's model, sampler and profiler. `scheduler` is required when `params.n_max` is None
    (auto)."""

    def __init__(self, model: Qwen35Model, sampler: Sampler, params: DraftParams, drafter: DrafterFactory,
                 profiler: Profiler | None = None, scheduler: DraftLengthScheduler | None = None, *,
                 prompt_cache: PromptCache | None = None, calibration_path: str = "",
                 progress: Progress | None = None, pipeline: bool = True):
        if params.auto and scheduler is None:
            raise MTPEngineError("n-max auto needs a scheduler with the device's measured costs", field="n-max")
        super().__init__(model, sampler, profiler, prompt_cache=prompt_cache, progress=progress, pipeline=pipeline)
        self.params = params
        self.scheduler = scheduler if params.auto else None
        self.drafter: Drafter = drafter(DraftContext(model, sampler, self.prof))
        self.counts = RoundCounts()  # statistics
        self.k_histogram: Counter = Counter()  # auto: the draft length chosen, per completed round
        self.trace: list[dict] | None = None  # per-round record, when a caller sets it to []
        self.calibration_path = calibration_path  # model file whose stored costs this run updates
        self._pending: _Round | None = None
        self._held_k: int | None = None
        self._verify_rows = 0  # rows of the last verify forward (1: no drafts, nothing captured)

    # ---- what the drafter is fed (an ablation feeds another state) ---------------------------------
    def _fed(self, post: mx.array, pre: mx.array) -> mx.array:
        """The trunk state a drafter reads: the post-norm hidden state (what the output head reads)."""
        return post

    # ---- prompt -------------------------------------------------------------------------------
    def prefill(self, ids: list[int], budget: int | None = None) -> list[int]:
        """Prefills all but the last prompt token (as llama.cpp's draft-mtp does), so the first
        round drafts from the last prompt token and its verify yields the first new token."""
        self.budget = budget
        self.sampler.begin(ids)
        self._emitted([], 0, 0, None)
        with self.prof.stage("prefill"):
            kept = self._reuse_prefix(ids[:-1], self.drafter.name)
            h = self._prefill_trunk(ids[self.cached_tokens:-1], pick=self._fed, start=self.cached_tokens,
                                    whole=len(ids))
            if self.progress is not None:  # the last token is read by the first round, at once
                self.progress(len(ids), len(ids))
            if self.model.compile_steps:  # one verify graph per width, whatever the round before drafted
                longest = self.scheduler.k_max if self.scheduler is not None else self.params.k_max
                capture_at_width(self.cache.layers, longest + 1)
            self.last_token = ids[-1]
            if kept is None:
                self.drafter.begin(ids, h)
            else:  # the drafter starts from its state after the kept tokens
                self.drafter.begin_from(ids, h, self.cached_tokens, kept.drafter_state)
            if self.prompt_cache is not None:
                self.prompt_cache.keep(self.model, ids[:-1], self.cache, self.drafter.name,
                                       self.drafter.prefix_state())
        self.clock.start()
        return []

    # ---- one round ----------------------------------------------------------------------------
    def step(self) -> list[int]:
        if not self.pipeline:
            return self._complete(self._launch(self._choose_k()))
        cur = self._pending or self._launch(self._choose_k())
        self._pending = None
        wanted = self._wanted()
        if cur.plain and cur.token is not None and wanted > 1:
            # queue the next round before the host reads this one: another plain step can start
            # from the token still on the device; a drafting round needs it on the host first
            k = self._choose_k()
            if k == 0:
                self._pending = self._launch_plain(cur)
            else:
                self._held_k = k
        emitted = self._complete(cur)
        if self._pending is None and wanted > len(emitted):
            # the next round's device work overlaps the caller's detokenization and stop checks
            k, self._held_k = (self._held_k if self._held_k is not None else self._choose_k()), None
            self._pending = self._launch(k)
        return emitted

    def plain_step(self) -> list[int]:
        """A round without drafting: exactly a plain decode step (no capture, no drafter work)."""
        return self._complete_plain(self._launch_plain(None))

    def _choose_k(self) -> int:
        return self.scheduler.next_k(self.cache.offset) if self.scheduler else self.params.k_max

    def _launch(self, k: int) -> _Round:
        return self._launch_plain(None, k) if k == 0 else self._launch_draft(k)

    def _complete(self, r: _Round) -> list[int]:
        return self._complete_plain(r) if r.plain else self._complete_draft(r)

    def _pipelined_rounds(self) -> bool:
        # a queued round would be scored against a penalty history that lacks this round's tokens
        return (self.pipeline and not self.prof.enabled and not self.sampler.cfg.penalties.active
                and self.sampler.grammar is None)

    def _launch_draft(self, k: int) -> _Round:
        draft = self.drafter.draft(k, self.params.p_min)
        if 0 < len(draft) < self.params.n_min:  # too few survived p-min: decode plainly
            draft = Draft([], None, draft.shapes)
        fed, logits = self.verify(draft.tokens)
        cfg = self.sampler.cfg
        with self.prof.stage("sample") as out:
            # row i scores the position after drafts 1..i: its penalties count them as generated
            scored = self.sampler.penalize(logits, draft.tokens if len(draft) else None)
            scored = self.sampler.constrain(scored, draft.tokens if len(draft) else None)
            target = mx.argmax(scored, axis=-1) if cfg.greedy else distribution(scored, cfg)
            finite = mx.all(mx.isfinite(logits))
            out.extend([target, finite])
        if self._pipelined_rounds():
            mx.async_eval(target, finite, *([draft.tokens] if len(draft) else []))
        shapes = draft.shapes + [("trunk", 1 + len(draft), len(draft) > 0, kv_capacity(self.cache))]
        return _Round(k, False, shapes, logits=logits, finite=finite, fed=fed, draft=draft, target=target)

    def _complete_draft(self, r: _Round) -> list[int]:
        n, token, host_drafts = self.accept(r.draft.tokens, r.logits, r.draft.q, r.target, r.finite)
        self._count_experts("verify")
        self.rollback(n)
        self.catch_up(host_drafts[:n], token, r.fed)
        return self._finish_round(host_drafts, n, token, r)

    def _launch_plain(self, prev: _Round | None, k: int = 0) -> _Round:
        """A plain step from the host's last token, or (pipelined) from `prev`'s token on the device."""
        inp = prev.token.reshape(1, 1).astype(mx.int32) if prev is not None else mx.array([[self.last_token]])
        with self.prof.stage("decode") as out:
            post, pre = self.model.forward_states(inp, self.cache)
            logits = self.model.logits(post[0, -1])
            out.append(logits)
        r = _Round(k, True, [("trunk", 1, False, kv_capacity(self.cache))], logits=logits, fed=self._fed(post, pre))
        if self._pipelined():
            r.token, r.finite = mx.argmax(logits, axis=-1), mx.all(mx.isfinite(logits))
            mx.async_eval(r.token, r.finite)
        return r

    def _complete_plain(self, r: _Round) -> list[int]:
        with self.prof.stage("sync"):
            token = self._read((r.token, r.finite)) if r.token is not None else self.sampler.sample(r.logits)
        self._count_experts("step")
        self.drafter.accept([], token, r.fed)
        self.last_token = token
        return self._finish_round([], 0, token, r)

    def _finish_round(self, drafts: list[int], n: int, token: int, r: _Round) -> list[int]:
        """Statistics, the round's time, the scheduler's observation and the trace; its emitted
        tokens (`r.logits`: the rows that scored them, for logprobs)."""
        emitted = self._emitted(drafts[:n] + [token], n, len(drafts), r.logits)
        seconds, first_use = self.clock.lap(r.k, r.shapes, getattr(r, "shift", 0.0))
        self.counts.record(len(drafts), n)
        self.k_histogram[r.k] += 1
        if self.scheduler:
            self.scheduler.observe(len(drafts), n, seconds, self.cache.offset, first_use,
                                   getattr(r, "steady", True))
        if self.trace is not None:
            self.trace.append({"draft": drafts, "n_accepted": n, "emitted": emitted})
        return emitted

    # ---- the stages ---------------------------------------------------------------------------
    def verify(self, drafts) -> tuple[mx.array, mx.array]:
        """One trunk forward over [last token, d1..dk]: (the state the drafter is fed, logits for
        every row)."""
        with self.prof.stage("verify") as out:
            self._verify_rows = 1 + len(drafts)
            post, fed = self._trunk(self._verify_input(drafts)[None], capture=len(drafts) > 0)
            logits = self.model.logits(post[0])
            out.append(logits)
        return fed, logits

    def _verify_input(self, drafts) -> mx.array:
        last = mx.array([self.last_token], dtype=mx.int32)
        return mx.concatenate([last, drafts.astype(mx.int32)]) if len(drafts) else last

    def _trunk(self, ids: mx.array, capture: bool) -> tuple[mx.array, mx.array]:
        """Trunk forward: (post-norm hidden for the logits, the state the drafter is fed). A round
        without drafts is a plain step: nothing to roll back, so nothing to capture."""
        post, pre = self.model.forward_states(ids, self.cache, Pass.VERIFY if capture else Pass.STEP)
        return post, self._fed(post, pre)

    def accept(self, drafts, logits: mx.array, q: mx.array | None, target: mx.array | None = None,
               finite: mx.array | None = None) -> tuple[int, int, list[int]]:
        """How many drafts survive, the token after them, and the drafts on the host. Holds the
        round's one host sync. `target`/`finite`: the argmax (or distribution) and finiteness of
        `logits` when already queued."""
        cfg = self.sampler.cfg
        if target is None:
            with self.prof.stage("sample") as out:
                scored = self.sampler.penalize(logits, drafts if len(drafts) else None)
                scored = self.sampler.constrain(scored, drafts if len(drafts) else None)
                target = mx.argmax(scored, axis=-1) if cfg.greedy else distribution(scored, cfg)
                finite = mx.all(mx.isfinite(logits))
                out.extend([target, finite])
        with self.prof.stage("sync"):
            mx.eval(target, finite)
            check_finite(finite)
            host_target = np.array(target, dtype=np.float64 if not cfg.greedy else None)
            d = np.array(drafts) if len(drafts) else np.zeros(0, dtype=np.int64)
            host_q = np.array(q, dtype=np.float64) if q is not None and len(drafts) else None
        with self.prof.stage("accept"):
            return self._decide(d, host_target, host_q)

    def _decide(self, d: np.ndarray, target: np.ndarray, q: np.ndarray | None) -> tuple[int, int, list[int]]:
        """The acceptance rule on host arrays: (accepted, token after them, the drafts as a list)."""
        if self.sampler.cfg.greedy:
            n, token = accept_greedy(d, target)
        elif len(d):
            n, token = accept_sampling(d, target, q, self.sampler)
        else:
            n, token = 0, self.sampler.categorical(target[0])
        return n, token, d.tolist()

    def rollback(self, n: int) -> None:
        """Keeps last token + n accepted drafts in the trunk (from the states captured in verify;
        a draft-less round captured nothing and has nothing to drop); the drafter forgets the rest."""
        with self.prof.stage("rollback"):
            if self._verify_rows > 1:
                self.cache.rollback(n + 1)
            self.drafter.rollback(n)

    def catch_up(self, accepted: list[int], token: int, fed: mx.array) -> None:
        """The drafter learns what the round emitted (an MTP head queues its owed rows)."""
        with self.prof.stage("catch_up"):
            self.drafter.accept(accepted, token, fed)
        self.last_token = token

    def finish(self) -> None:
        """The generation is over: a queued round is dropped, and what this run measured of its
        rounds' costs is kept for the next run on this model and device."""
        self._pending = None
        if self.scheduler and self.calibration_path:
            t0 = self.scheduler.step_seconds()
            calibration.save(self.calibration_path, self.model, self.scheduler.measured_round_steps(),
                             t0 * 1e3 if t0 else None, self.model.options.cache_path,
                             self.scheduler.measured_acceptance())

    # ---- statistics ---------------------------------------------------------------------------
    def stats(self) -> dict:
        extra: dict = {"compile_seconds": self.clock.compile_seconds()}
        if self.scheduler:
            extra.update({"n_max": "auto", "auto_message": self.scheduler.message(),
                          "draft_length_histogram": {str(k): v for k, v in sorted(self.k_histogram.items())},
                          **self.scheduler.stats()})
        extra.update(self._moe_stats())
        return {**extra, **self.counts.stats(self.params.k_max), **self.drafter.stats()}
