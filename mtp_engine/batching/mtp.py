"""Continuous batching with MTP: `round.draft_round` over the batch's rows. The head drafts for
every sequence in one batched call (`speculative.mtp_rows`), one batched verify checks every
sequence's k+1 rows, each row accepts and rolls back by its own count, all on the device, and the
next round is queued before the host reads this one, as for a sequence alone.

A round, for B running sequences and a draft length k chosen for the batch (`_draft_length`):
  draft     the head runs each row's block (the rows it is owed: the last round's emitted tokens)
            and k chained steps over [B, 1] rows;
  verify    one trunk forward over [B, k+1] rows (last token, d1..dk), recurrent states captured;
  accept    per row: greedy prefix match for a greedy sequence, the rejection sampler with its own
            key for a sampling one (n_b accepted + the next token: `RowSampling`); a sequence that
            does not draft (spec none, or under a grammar) keeps none of its drafts and takes
            row 0's token from its own sampler on the host, as a plain step would;
  rollback  per row: attention lengths move to n_b + 1 tokens, recurrent layers keep the captured
            state after them (`BatchCache.rollback_lazy`: a kept count per row, no kernel);
  commit    each row's emitted tokens, with the verify's hidden states, are its next head block.
k = 0 is a plain batched round (with the head kept in step where a row drafts). A sequence that
may draft prefills its prompt but the last token and runs it through the head (llama.cpp's
draft-mtp scheme), chunk by chunk on its own caches as `BatchScheduler` prefills, so the first
round emits its first token; one that never drafts prefills as plain decoding does.
"""
from __future__ import annotations

import functools
import time

import mlx.core as mx

from ..errors import MTPEngineError
from ..generation.profiler import Profiler
from ..model.cache import capture_at_width
from ..model.loaded import Model
from ..speculative.mtp_drafter import HeadReader
from ..speculative.mtp_rows import MTPRowsDrafter
from ..generation.round import Round, plain_round, post_norm
from ..speculative.round import draft_round
from ..speculative.row_sampling import RowSampling
from ..speculative.calibration import default_seed
from ..speculative.scheduler import AUTO_MAX, DraftLengthScheduler, auto_k_max
from .scheduler import BatchScheduler, Launched
from .sequence import Sequence, logprobs_asked, sampling

def bucket(batch: int) -> int:
    """Batch sizes that share one draft-length controller (1, 2, 4, 8, ...): B changes as
    sequences come and go, and each size measured apart would pay its exploration again."""
    return 1 << (batch - 1).bit_length()


def batch_prior(prior: dict[int, float], batch: int) -> dict[int, float]:
    """Round costs in plain steps at `batch` rows before any is measured: a sequence alone's
    (`prior`, a fixed part and a little per draft) for 1 and 2 rows; from 4 rows a verify of B (k+1)
    rows costs in proportion to its extra rows, 1 + c k: on an H100 at the 9B shape (oracle 0.8,
    bench_batch) a round of 4 drafts cost ~2.7-2.9 plain steps at 4 and 8 rows (c ~0.45), ~5.7 at
    16 (c ~1.15), never less than the alone prior says. Measured rounds then scale the estimates
    of the lengths not yet measured (`DraftLengthScheduler.round_steps`)."""
    if batch <= 2:
        return dict(prior)
    c = 0.45 if batch <= 8 else 1.15 * batch / 16
    return {k: max(v, 1.0 + c * k) for k, v in prior.items()}


def _auto(rows: list[Sequence]) -> bool:
    """Whether the batch's draft length is n-max auto's: some row drafts, none fixes an n-max
    (only then are its rounds the controller's samples)."""
    drafting = [s for s in rows if s.draft]
    return bool(drafting) and all(s.n_max is None for s in drafting)


class MTPBatchScheduler(BatchScheduler):
    """`BatchScheduler` whose rounds draft with the model's MTP head (see the module docstring)."""

    def __init__(self, model: Model, max_batch: int = 8, own_thread: bool = True, max_draft: int = AUTO_MAX,
                 prior: dict[int, float] | None = None, profile: str = "off"):
        """`max_draft`: the longest draft any round runs, whatever its rows ask for. `prior`: round
        costs in plain steps before any is measured (`calibration.default_seed`, None: this
        device's and model kind's, as a sequence alone starts from). `profile`: "precise" times
        every round's stages (`self.prof`; a benchmark's breakdown, each stage synchronised)."""
        if model.model.mtp is None:
            raise MTPEngineError("draft-mtp batches need a model with an MTP head", field="spec")
        super().__init__(model, max_batch, own_thread)
        self.max_draft = max_draft
        self.prof = Profiler(profile)
        self.drafter = MTPRowsDrafter(model.model, self.prof.stage)
        self.rounds_by_k: dict[int, int] = {}
        self.prior = prior or default_seed(moe=model.model.is_moe)
        self.controllers: dict[int, DraftLengthScheduler] = {}  # n-max auto, per batch-size bucket
        self._last_read: tuple[list[Sequence], int, float] | None = None  # the last round read: (rows, k, when)
        self._shapes: set[tuple[int, int]] = set()  # (rows, k) of rounds run: a first one may compile
        self._k_max = min(auto_k_max(model.model), max_draft)  # the longest draft auto considers here
        self._auto_can_win = DraftLengthScheduler(k_max=self._k_max, prior=self.prior).can_win

    def controller(self, batch: int) -> DraftLengthScheduler:
        """n-max auto for a batch of `batch` rows: the draft-length scheduler a sequence alone
        has (measured round times per k in plain steps, acceptance per draft position, probes),
        one per size bucket, since a verify's rows cost more the more sequences share it: its
        prior is `batch_prior`, and it measures a plain round's time early whatever that says."""
        b = bucket(batch)
        if b not in self.controllers:
            self.controllers[b] = DraftLengthScheduler(k_max=self._k_max, prior=batch_prior(self.prior, b),
                                                       defer_t0=b == 1)
        return self.controllers[b]

    def _may_draft(self, s: Sequence) -> bool:
        """Whether any round may draft for `s`: a drafting sequence (n-max 0 is none: `Sequence.draft`),
        and for n-max auto a device where drafts can pay (the prior)."""
        return s.draft and (s.n_max is not None or self._auto_can_win)

    def _end_all(self, error: BaseException) -> None:
        super()._end_all(error)
        for c in self.controllers.values():
            c.forget_pending()
        self.drafter = MTPRowsDrafter(self.model.model, self.prof.stage)

    def _keep_rows(self, keep: list[int]) -> None:
        super()._keep_rows(keep)
        self.drafter.keep(keep)

    # ---- prefill: each joining sequence on its own caches, trunk then head per chunk -----------------
    def _start_prefill(self, s: Sequence) -> None:
        """A sequence that may draft reads its prompt but the last token with the head beside the
        trunk (`mtp_drafter.HeadReader`), as it does alone; one that never drafts reads it as
        plain decoding alone does (its first token drawn at the end, its head rows never read)."""
        super()._start_prefill(s, HeadReader(self.model.model) if self._may_draft(s) else None)

    def _join(self, joined: list[Sequence]) -> None:
        heads = []
        for s in joined:
            if s.reader.drafter is not None:  # its last prompt token is read by its first round
                s.last_token = s.prompt_ids[-1]
                s.reader.report(whole=True)
            heads.append(s.reader.drafter or HeadReader(self.model.model))
        self.drafter.join([h.cache for h in heads], [s.last_token for s in joined],
                          mx.concatenate([h.h_last for h in heads], axis=0))
        super()._join(joined)

    # ---- a round ---------------------------------------------------------------------------------
    def _accept(self, rule: RowSampling, drafts: mx.array, scored: mx.array, q: mx.array | None,
                live: mx.array) -> tuple[mx.array, mx.array]:
        """The acceptance rule over rows: each row's own (`RowSampling.accept`; a benchmark's oracle
        replaces the greedy rows', `batching.ablations`)."""
        return rule.accept(drafts, scored, q, live)

    def _round(self, rows: list[Sequence], last: mx.array, hold: mx.array | None) -> Round:
        m = self.model.model
        k = self._draft_length(rows)
        self.rounds_by_k[k] = self.rounds_by_k.get(k, 0) + 1
        rule = sampling(rows)
        if k == 0:
            # the head is kept in step only where a later round may draft: rows that never draft,
            # or auto where no draft pays at this size, leave it (its rows go stale: a later draft
            # from them is less often right, never wrong)
            later = any(self._may_draft(s) for s in rows) and \
                not (_auto(rows) and not self.controller(len(rows)).can_win)
            drafter = self.drafter if later else None
            return plain_round(m, self._batch, drafter, last, rule.pick, post_norm, self.prof.stage,
                               logprobs_asked(rows), hold)
        if m.compile_steps:  # one verify graph per width, whatever the round before drafted
            capture_at_width(self._batch.layers, max(k, self._k_max) + 1)
        # each row's own p-min and n-min (a row without one: 0, every draft counts)
        p_min = mx.array([float(s.p_min) for s in rows]) if any(s.p_min > 0 for s in rows) else 0.0
        n_min = mx.array([s.n_min for s in rows]) if any(s.n_min > 1 for s in rows) else 0
        return draft_round(m, self._batch, self.drafter, last, k, functools.partial(self._accept, rule), post_norm,
                           p_min, n_min, drafting=mx.array([s.draft for s in rows]), score=rule.score,
                           draft_pick=rule.draft_pick, logprobs=logprobs_asked(rows), stage=self.prof.stage,
                           hold=hold)

    def _draft_length(self, rows: list[Sequence]) -> int:
        """The round's k: 0 when no sequence drafts, else the smallest n-max the drafting
        sequences fix, or n-max auto's for this batch size; never more than `max_draft` (a row's
        own n-max of 64 would otherwise make every row of the batch verify 65 rows a round)."""
        drafting = [s for s in rows if s.draft]
        if not drafting:
            return 0
        fixed = [s.n_max for s in drafting if s.n_max is not None]
        if fixed:
            return min(min(fixed), self.max_draft)
        return self.controller(len(rows)).next_k(max(s.length for s in rows))

    def _round_arrays(self, rows: list[Sequence]) -> list[mx.array]:
        return self.drafter.arrays() if any(s.draft for s in rows) else []

    def _complete(self, cur: Launched) -> None:
        super()._complete(cur)
        # a pipelined round's time is the interval between two reads of rounds of the same rows:
        # a sample of its k's time only between rounds of its own k (`DraftLengthScheduler.observe`)
        now, rows, r = time.perf_counter(), cur.rows, cur.round
        last, self._last_read = self._last_read, (rows, r.k, now)
        if not _auto(rows):
            return
        timed = last is not None and last[0] == rows
        queued = self._queued.round.k if self._queued is not None else r.k
        first = (len(rows), r.k) not in self._shapes
        self._shapes.add((len(rows), r.k))
        n = r.host().n
        self.controller(len(rows)).observe(r.k, [n[b] for b, s in enumerate(rows) if s.draft] if r.k else 0,
                                           now - last[2] if timed else None, max(s.length for s in rows),
                                           first_use=first, steady=timed and last[1] == r.k == queued)

    def _record(self, s: Sequence, drafted: int, n: int) -> None:
        if s.draft:
            s.counts.record(drafted, n)

    def _bound(self, bounds: list[int], floors: list[int]) -> None:
        super()._bound(bounds, floors)
        self.drafter.bound(bounds)
