"""Device-resident speculative rounds: the host queues round r+1 before it reads round r.

A host-driven round waits for the verify, reads the accepted count, rolls back and only then
drafts, so the device idles through every host decision (0.75x of plain at 9B on an
H200 with acceptance 0.8). Here the round is `round.draft_round` (draft, verify, accept, commit:
every decision a lazy MLX value) and this module is the pipelining layer around it:

  - the MTP head's block (owed rows + the last token's row, fixed width k+1 after a drafting
    round) and k chained steps draft; p-min marks which drafts count (`round.live_drafts`);
  - KV offsets become `base + n + 1` (device values), gated-delta-net states the masked
    `state_after` of n + 1 tokens; the emitted row and the verify's hidden states are the head's
    next block; the next round's first input is `emitted[n]`, still on the device.

Only shapes chosen by the host (k) change the graphs; accepted lengths never do. The host reads
a round's (emitted, n) one round late, then detokenizes and checks stops while the device runs the
next. Output is the host round's: greedy token-identical to plain decoding, sampling lossless.
Grammar-constrained generation (host state per token) keeps the host round; a precise profile
times the device round's stages, each evaluated at its end.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from ..generation.decode import kv_capacity
from ..generation.sampling import check_finite, distribution
from .round import Round, accept_greedy_device, accept_sampling_device, draft_round, plain_round


@dataclass
class Queued:
    """A round queued on the device (`round.Round`), read by the host later."""

    round: Round
    rows: int  # trunk rows it runs (its bound on the KV offsets' growth)
    shapes: list = field(default_factory=list)
    launch_s: float = 0.0  # host seconds it took to queue, when queued ahead of another round's read
    shift: float = 0.0  # correction to its timed interval (`step`)
    steady: bool = True  # queued between rounds of its own k: its time is a sample of t(k)

    @property
    def k(self) -> int:
        return self.round.k

    @property
    def logits(self) -> mx.array:
        """The rows that scored its emitted tokens, [k+1, V] (the sequence is row 0)."""
        return self.round.logits[0]

    def read(self) -> list[mx.array]:
        return self.round.read()


class ResidentRounds:
    """Mixin for `SpeculativeDecoder`: rounds as device values (see the module docstring). Its
    drafter (`MTPDrafter`, `NGramDrafter`) also offers `to_device`, `draft_resident`, `commit`,
    `accept_plain`, `pending_arrays`, `round_shapes`, `trunk_committed`, `round_read` and
    `reads_history`. `resident_rounds = False` (a class that must see each round on the host, e.g.
    the re-decoding rollback ablation) keeps the host round."""

    resident_rounds = True

    def prefill(self, ids: list[int], budget: int | None = None) -> list[int]:
        out = super().prefill(ids, budget)
        self._queued: list[Queued] = []
        self._prev_k = -1
        self._resident = (self.resident_rounds and self.model.resident_rounds and self.sampler.grammar is None
                          and self._may_draft())
        if self._resident:
            self._last_dev = mx.array([ids[-1]], dtype=mx.int32)
            self._key = mx.random.key(int(self.sampler.rng.integers(0, 2**63)))
            self.cache.kv_to_device()
            self.drafter.to_device()
        return out

    def _may_draft(self) -> bool:
        """Whether this run is expected to draft: n-max 0 never does, and auto not where its costs
        say that even fully accepted drafts cannot pay (MLX's CPU backend). Such a run keeps the
        host round, whose plain steps are the plain decoder's (host KV offsets, attention over the
        valid positions only): resident plain rounds cost 2-3% more there (docs/benchmarks.md).
        Decided once per run: should its probes find drafting paying after all, the run drafts on
        host rounds; the next run starts from the costs this one stored."""
        if self.scheduler is not None:
            return self.scheduler.can_win
        return self.params.k_max > 0

    def step(self) -> list[int]:
        if not self._resident:
            return super().step()
        cur = self._queued.pop(0) if self._queued else self._launch_resident(self._choose_k())
        if self._ahead() and self._wanted() > 1:
            # queued before the host reads `cur`: it starts from cur's device values
            t = time.perf_counter()
            nxt = self._launch_resident(self._choose_k())
            nxt.launch_s = time.perf_counter() - t
            self._queued.append(nxt)
            # cur's timed interval (host read to host read) holds nxt's queuing, not its own: swap
            # them, or a plain round before a drafting one times like a drafting round and auto
            # sees drafting as free (it kept drafting at acceptance 0.5 and lost 40% on the H200)
            cur.shift = cur.launch_s - nxt.launch_s
            cur.steady = self._prev_k == cur.k == nxt.k
        elif self._ahead():
            cur.steady = False  # the last round: nothing queued behind it
        self._prev_k = cur.k
        return self._complete_resident(cur)

    def _ahead(self) -> bool:
        """Whether the next round is queued before the host reads this one: not for a drafter whose
        drafts come from the tokens the host has read (`reads_history`)."""
        return self._pipelined_rounds() and not self.drafter.reads_history

    def plain_step(self) -> list[int]:
        if not self._resident:
            return super().plain_step()
        return self._complete_resident(self._launch_resident_plain())

    def finish(self) -> None:
        self._queued = []
        super().finish()

    # ---- launch -------------------------------------------------------------------------------
    def _launch_resident(self, k: int) -> Queued:
        if k == 0:
            return self._launch_resident_plain()
        shapes = self._shapes(k)
        r = draft_round(self.model, self.cache, self.drafter, self._last_dev, k,
                        self._accept_device, self._fed, self.params.p_min, self.params.n_min,
                        score=self._score, stage=self.prof.stage)
        self._last_dev = r.last
        return self._queue(Queued(r, k + 1, shapes))

    def _launch_resident_plain(self) -> Queued:
        r = plain_round(self.model, self.cache, self.drafter, self._last_dev, self._pick, self._fed, self.prof.stage)
        self._last_dev = r.last
        return self._queue(Queued(r, 1, [("trunk", 1, False, kv_capacity(self.cache))]))

    def _pick(self, logits: mx.array) -> mx.array:
        """A plain round's token [1] from its logits [1, V] (one row), on the device."""
        cfg = self.sampler.cfg
        scored = self.sampler.penalize(logits)
        if cfg.greedy:
            return mx.argmax(scored, axis=-1).astype(mx.int32)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(mx.log(distribution(scored, cfg)), key=sub).astype(mx.int32)

    def _queue(self, r: Queued) -> Queued:
        if self._ahead():
            mx.async_eval(*r.read(), *self.drafter.pending_arrays())
        return r

    def _score(self, drafts: mx.array, logits: mx.array) -> mx.array:
        """What the rule compares, for the one row's drafts [1, k] and logits [1, k+1, V]: the
        penalised logits (row i's penalties count drafts 1..i as generated), or when sampling the
        distributions drawn from."""
        scored = self.sampler.penalize(logits[0], drafts[0])[None]
        return scored if self.sampler.cfg.greedy else distribution(scored, self.sampler.cfg)

    def _accept_device(self, drafts: mx.array, scored: mx.array, q: mx.array | None,
                       live: mx.array) -> tuple[mx.array, mx.array]:
        """(n accepted [1], emitted [1, k+1]) as device values."""
        if self.sampler.cfg.greedy:
            return accept_greedy_device(drafts, scored, live)
        self._key, sub = mx.random.split(self._key)
        return accept_sampling_device(drafts, scored, q, live, sub)

    def _shapes(self, k: int) -> list:
        return self.drafter.round_shapes(k) + [("trunk", k + 1, True, kv_capacity(self.cache))]

    # ---- the host's read, one round late -------------------------------------------------------
    def _complete_resident(self, r: Queued) -> list[int]:
        with self.prof.stage("sync"):
            # this round's block is evaluated with it; once a later round is queued the block is
            # that round's (its `_queue` evaluates it): waiting for it here would serialise them
            block = [] if self._queued else self.drafter.pending_arrays()
            mx.eval(*r.read(), *block)
            d = r.round.host()
            check_finite(d.finite[0])
            n, drafted, emitted = d.n[0], d.drafted[0], d.emitted[0]
            drafts = d.drafts[0][:drafted] if d.drafts is not None else []
        token = emitted[n]
        self.drafter.round_read(emitted[:n + 1])
        self.cache.offset += n + 1
        self.cache.set_bound(self.cache.offset + sum(q.rows for q in self._queued))
        self.drafter.trunk_committed(self.cache.offset)
        self.last_token = token
        self._count_experts("verify" if r.k else "step")
        return self._finish_round(emitted[:n] + drafts[n:], n, token, r)
