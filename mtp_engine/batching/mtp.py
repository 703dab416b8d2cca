"""Continuous batching with MTP: the head drafts for every sequence in one batched call, one
batched verify checks every sequence's k+1 rows, and each sequence accepts and rolls back alone.

A batched round (`MTPBatchScheduler._decode`), for B running sequences and a draft length k
chosen for the batch (`draft_length`):
  draft     k head steps over [B, 1] rows: step 1 reads (last token, trunk hidden before it) and
            writes the head's exact row for that position; step i > 1 reads (draft i-1, the head's
            own output), its rows are guesses, dropped after the round;
  verify    one trunk forward over [B, k+1] rows (last token, d1..dk), recurrent states captured;
  accept    per row: greedy prefix match for a drafting sequence (n_b accepted + the bonus token);
            a sequence that does not draft (plain, sampled, penalised, constrained) takes row 0's
            token from its own sampler, as a plain step would;
  rollback  per row: attention lengths move to n_b + 1 tokens, recurrent layers keep the captured
            state after them (`BatchCache.rollback_rows`: a kept count per row, no kernel);
  catch_up  the head's rows for the accepted drafts (each with the verify's trunk hidden before
            it) in one head forward; the next round starts from (bonus, trunk hidden at n_b).
k = 0 is a plain batched step (plus the head's one exact row). Every sequence here prefills its
prompt but the last token and runs it through the head (llama.cpp's draft-mtp scheme), so the
first round emits its first token; sequences that join together prefill together (trunk, then
head, each one padded forward per chunk, as `BatchScheduler` does).
"""
from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ..errors import MTPEngineError
from ..generation.sampling import check_finite
from ..model.batch_cache import BatchCache
from ..model.cache import TrunkCache, capture_at_width
from ..model.loaded import Model
from ..speculative.mtp_drafter import HeadPrefix
from ..speculative.scheduler import AUTO_MAX, MARGIN
from .scheduler import BatchScheduler, Sequence, _Step

class DraftLengthChooser:
    """n-max auto for a batch: the k that maximises the batch's expected tokens per second, from
    round times measured here per (batch size, k) and the acceptance seen so far. Verify rows stop
    being free as the batch grows (each sequence's k+1 rows compete with the others' for the same
    products), so the best k falls with B, and on a device where rows cost what they compute (a
    CPU) it is 0. Each (B, k) is tried `explore` times after a first, uncounted use (it may compile)."""

    def __init__(self, k_max: int = 4, explore: int = 2, prior_acceptance: float = 0.6):
        self.k_max, self.explore, self.prior = k_max, explore, prior_acceptance
        self.seconds: dict[tuple[int, int], list[float]] = {}
        self.drafted = self.accepted = 0

    def acceptance(self) -> float:
        """Per-draft acceptance (pooled; the prior until 20 drafts were seen)."""
        return self.accepted / self.drafted if self.drafted >= 20 else self.prior

    @staticmethod
    def bucket(batch: int) -> int:
        """Batch sizes measured together (1, 2, 4, 8, ...): B changes as sequences come and go,
        and each size measured apart would pay its exploration again."""
        return 1 << (batch - 1).bit_length()

    def choose(self, batch: int, k_cap: int) -> int:
        batch = self.bucket(batch)
        cap = min(self.k_max, k_cap)
        for k in range(cap + 1):  # what is not yet measured is tried first ...
            if not self._measured(batch, k):
                if k >= 2 and self._hopeless(batch, cap):
                    break  # ... unless no longer draft could pay
                return k
        a = self.acceptance()

        def rate(k: int) -> float:
            per_row = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1  # tokens a row emits per round
            return per_row / self._median(batch, k)

        return max((k for k in range(cap + 1) if self._measured(batch, k)), key=rate)

    def _measured(self, batch: int, k: int) -> bool:
        return len(self.seconds.get((batch, k), [])) >= self.explore + 1

    def _median(self, batch: int, k: int) -> float:
        times = sorted(self.seconds[(batch, k)][1:])
        return times[len(times) // 2]

    def _hopeless(self, batch: int, cap: int) -> bool:
        """Whether, with rounds growing by what k = 1 added to a plain step per draft, no k up to
        the cap beats plain steps even with every draft accepted: on a CPU a verify row costs what
        it computes, and exploring k = 2..4 at each batch size cost 12 slow rounds of a 38-round
        run (0.77x of plain batching, docs/benchmarks.md)."""
        t0, t1 = self._median(batch, 0), self._median(batch, 1)
        per_draft = max(t1 - t0, 0.0)
        return all((k + 1) / (t0 + k * per_draft) <= (1.0 + MARGIN[0]) / t0 for k in range(1, cap + 1))

    def observe(self, batch: int, k: int, seconds: float, drafted: int, accepted: int) -> None:
        times = self.seconds.setdefault((self.bucket(batch), k), [])
        times.append(seconds)
        del times[1:-16]  # the first (uncounted) and the 16 latest
        self.drafted += drafted
        self.accepted += accepted


def _auto(rows: list[Sequence]) -> bool:
    """Whether the batch's draft length is the chooser's: some row drafts, none fixes an n-max
    (only then are its rounds the chooser's samples)."""
    drafting = [s for s in rows if s.draft]
    return bool(drafting) and all(s.n_max is None for s in drafting)


def draft_length(rows: list[Sequence], chooser: DraftLengthChooser, cap: int = AUTO_MAX) -> int:
    """The batch's k: 0 when no sequence drafts, else the smallest n-max the drafting sequences
    fix, or the chooser's for this batch size (n-max auto); never more than `cap` (a row's own
    n-max of 64 would otherwise make every row of the batch verify 65 rows a round)."""
    drafting = [s for s in rows if s.draft]
    if not drafting:
        return 0
    fixed = [s.n_max for s in drafting if s.n_max is not None]
    return min(min(fixed) if fixed else chooser.choose(len(rows), chooser.k_max), cap)


class MTPBatchScheduler(BatchScheduler):
    """`BatchScheduler` whose rounds draft with the model's MTP head (see the module docstring)."""

    def __init__(self, model: Model, max_batch: int = 8, own_thread: bool = True, max_draft: int = AUTO_MAX):
        """`max_draft`: the longest draft any round runs, whatever its rows ask for."""
        if model.model.mtp is None:
            raise MTPEngineError("draft-mtp batches need a model with an MTP head", field="spec")
        super().__init__(model, max_batch, own_thread)
        self.max_draft = max_draft
        self._head = BatchCache(model.model)
        self._head_group = BatchCache(model.model)  # the joining sequences' head rows
        self._h_last: mx.array | None = None  # [B, 1, H]: the trunk hidden each row's head step reads
        self.rounds_by_k: dict[int, int] = {}
        self.chooser = DraftLengthChooser()
        self._k0_done: tuple[list[Sequence], float] | None = None  # the last k = 0 step read: (rows, when)

    def _end_all(self, error: BaseException) -> None:
        super()._end_all(error)
        self._head, self._h_last = BatchCache(self.model.model), None
        self._head_group = BatchCache(self.model.model)

    def _keep_rows(self, keep: list[int]) -> None:
        super()._keep_rows(keep)
        self._head.keep(keep)
        self._h_last = self._h_last[mx.array(keep, mx.int32)] if keep else None

    # ---- prefill: the joining sequences together -------------------------------------------------
    def _keep_joining_rows(self, keep: list[int]) -> None:
        super()._keep_joining_rows(keep)
        if len(self._head_group):
            self._head_group.keep(keep)

    def _start_prefill(self, s: Sequence) -> None:
        """Its trunk and head caches (a kept prompt state's, or empty) become rows of the joining
        group; `s.h_prev` is the trunk hidden state its next head row reads."""
        m = self.model.model
        kept = s.prompt_cache.take(m, s.prompt_ids[:-1], "draft-mtp") if s.prompt_cache is not None else None
        if kept is None:
            trunk, head = m.make_cache(), m.mtp.make_cache()
            s.h_prev = mx.zeros((1, 1, m.cfg.hidden_size))
        else:
            trunk = kept.trunk
            trunk.restore(kept.snapshot)
            head, rows, s.h_prev = kept.drafter_state
            head.truncate(rows)
            s.prefilled = s.cached = len(kept.tokens)
        self._group.add(trunk)
        head_trunk = TrunkCache([head])
        head_trunk.offset = head.offset
        self._head_group.add(head_trunk)
        if kept is not None:  # its rows are copied: the kept state is never written again
            s.prompt_cache.release(trunk)

    def _prefill_step(self) -> None:
        """One chunk of every joining prompt but its last token (the first round's), trunk then
        head, in one padded forward each; sequences whose prompt is done join the batch."""
        m = self.model.model
        ends = [len(s.prompt_ids) - 1 for s in self._joining]
        ready = [b for b, (s, e) in enumerate(zip(self._joining, ends)) if s.prefilled == e]
        if not ready:
            ids, valid = self._next_chunks(ends)
            post = m.forward_batch(ids, self._group, valid=valid)
            carried = mx.concatenate([s.h_prev for s in self._joining], axis=0)
            h_prev = mx.concatenate([carried, post[:, :-1]], axis=1) if ids.shape[1] > 1 else carried
            m.mtp.forward_batch(m.embed_tokens(ids), h_prev, self._head_group, valid=valid)
            for b, s in enumerate(self._joining):
                s.h_prev = post[b:b + 1, valid[b] - 1:valid[b]]
            mx.eval(*[s.h_prev for s in self._joining], *self._group.arrays(), *self._head_group.arrays())
            for b, s in enumerate(self._joining):
                s.prefilled += valid[b]
                if s.prefilled < len(s.prompt_ids) - 1:
                    continue
                ready.append(b)
                if s.prompt_cache is not None:  # the trunk and head after all but the last token
                    trunk, head = self._group.row(b), self._head_group.row(b).layers[0]
                    # the hidden state copied: a slice would hold the whole chunk's hidden states
                    s.prompt_cache.keep(m, s.prompt_ids[:-1], trunk, "draft-mtp",
                                        HeadPrefix(head, head.offset, mx.array(np.array(s.h_prev))))
                    s.prompt_cache.release(trunk)
        if not ready:  # every joining prompt has chunks left: the running rows step meanwhile
            return
        self._batch.extend(self._group, ready)
        self._head.extend(self._head_group, ready)
        joined = [self._joining[b] for b in ready]
        h = mx.concatenate([s.h_prev for s in joined], axis=0)
        self._h_last = h if self._h_last is None else mx.concatenate([self._h_last, h], axis=0)
        for s in joined:
            s.last_token = s.prompt_ids[-1]
            s.h_prev = None
        self._rows += joined
        self._drop_joining(ready)

    # ---- k = 0: the plain batched step, pipelined, keeping the head in step ------------------------
    def _may_queue(self, rows: list[Sequence]) -> bool:
        return draft_length(rows, self.chooser, self.max_draft) == 0

    def _forward(self, rows: list[Sequence], ids: mx.array) -> tuple[mx.array, list[mx.array]]:
        """The plain batched step's forward; where a row drafts, the head's row for each row's last
        token (read with the trunk hidden state before it) runs in the same queued work, so the head
        is current when a later round drafts. Rows that never draft skip the head (`_h_last` may go
        stale: it is never read for them)."""
        if not any(s.draft for s in rows):
            return super()._forward(rows, ids)
        m = self.model.model
        m.mtp.forward_batch(m.embed_tokens(ids), self._h_last, self._head)
        post = self._h_last = m.forward_batch(ids, self._batch)  # [B, 1, H]
        return post, [post, *self._head.arrays()]

    def _complete(self, step: _Step) -> None:
        if not step.head:
            super()._complete(step)
            return
        for s in step.rows:
            if s.draft and not s.done:
                s.counts.record(0, 0)
        self.rounds_by_k[0] = self.rounds_by_k.get(0, 0) + 1
        super()._complete(step)
        # a pipelined step's time is the interval between two reads of steps of the same rows
        now = time.perf_counter()
        if self._k0_done is not None and self._k0_done[0] == step.rows and _auto(step.rows):
            self.chooser.observe(len(step.rows), 0, now - self._k0_done[1], 0, 0)
        self._k0_done = (step.rows, now)

    # ---- a batched round ------------------------------------------------------------------------
    def _accepted(self, drafts: list[int], target: list[int]) -> int:
        """How many drafts the target agrees with: the greedy prefix match (a benchmark's oracle
        replaces it, `batching.ablations`)."""
        n = 0
        while n < len(drafts) and drafts[n] == target[n]:
            n += 1
        return n

    def _decode(self) -> None:
        rows = list(self._rows)
        if not rows:
            return
        k = draft_length(rows, self.chooser, self.max_draft)
        if self._queued is not None or k == 0:
            # k = 0 rounds are the plain batched step, pipelined (`BatchScheduler._decode`), with the
            # head's row for each token queued with it where a row drafts (`_launch`): auto picks
            # k = 0 for large batches, where a synchronous round cost 0.74-0.78x of plain batching
            # on this CPU. A step still queued when a round must draft is read first.
            super()._decode()
            return
        self._k0_done = None
        m, mtp = self.model.model, self.model.model.mtp
        t0 = time.perf_counter()
        last = mx.array([[s.last_token] for s in rows], dtype=mx.int32)
        tok, h, drafts = last, self._h_last, []
        for i in range(max(k, 1)):  # step 1 also when k = 0: the head's row for the last token
            h = mtp.forward_batch(m.embed_tokens(tok), h, self._head)
            if i < k:
                d = mx.argmax(m.draft_logits(h[:, -1]), axis=-1).astype(mx.int32)
                drafts.append(d)
                tok = d[:, None]
        ids = mx.concatenate([last, mx.stack(drafts, axis=1)], axis=1) if k else last  # [B, k+1]
        if k:
            if m.compile_steps:  # one verify graph per width, whatever the round before drafted
                capture_at_width(self._batch.layers, max(k, self.chooser.k_max) + 1)
            self._batch.begin_capture()
        post = m.forward_batch(ids, self._batch)  # [B, k+1, H]
        logits = m.logits(post)
        target = mx.argmax(logits, axis=-1)
        finite = mx.all(mx.isfinite(logits), axis=(1, 2))
        mx.eval(target, finite, ids)
        self.steps += 1
        self.rounds_by_k[k] = self.rounds_by_k.get(k, 0) + 1
        host_ids, host_target, ok = ids.tolist(), target.tolist(), finite.tolist()
        keep, emitted = [], []
        for b, s in enumerate(rows):
            n = self._accepted(host_ids[b][1:], host_target[b][:k]) if s.draft and k else 0
            try:
                check_finite(ok[b])
                token = host_target[b][n] if s.sampler.argmax_on_device else s.sampler.sample(logits[b, 0])
            except MTPEngineError as e:
                s.fail(e)
                token = host_target[b][0]
            keep.append(n + 1)
            emitted.append((host_ids[b][1:n + 1] + [token], n))
        if k:
            self._batch.rollback_rows(keep, k + 1)
            self._head.set_lengths([x - (k - 1) for x in self._head.host_lengths])  # steps 2..k were guesses
        most = max(keep) - 1
        if most:  # the head's rows for the accepted drafts, with the trunk hidden before each
            before = self._head.host_lengths
            mtp.forward_batch(m.embed_tokens(ids[:, 1:most + 1]), post[:, :most], self._head)
            self._head.set_lengths([x + n - 1 for x, n in zip(before, keep)])
        pick = mx.array([n - 1 for n in keep], mx.int32)[:, None, None]
        self._h_last = mx.take_along_axis(post, mx.broadcast_to(pick, (len(rows), 1, post.shape[2])), axis=1)
        mx.eval(self._h_last, *self._batch.arrays(), *self._head.arrays())
        drafting = [b for b, s in enumerate(rows) if s.draft]
        if _auto(rows):
            self.chooser.observe(len(rows), k, time.perf_counter() - t0, k * len(drafting),
                                 sum(keep[b] - 1 for b in drafting))
        for b, s in enumerate(rows):
            if s.done:
                continue
            tokens, n = emitted[b]
            s.batch_sizes.append(len(rows))
            if s.draft:
                s.counts.record(k, n)
            lps = s.sampler.token_logprobs(logits[b, :len(tokens)], tokens)
            s.deliver(tokens, lps, n, k if s.draft else 0)
