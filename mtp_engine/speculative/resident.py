"""Device-resident speculative rounds: the host queues round r+1 before it reads round r.

A host-driven round waits for the verify, reads the accepted count, rolls back and only then
drafts, so the device idles through every host decision (issue 23: 0.75x of plain at 9B on an
H200 with acceptance 0.8). Here every decision of a round is a lazy MLX value:

  draft     the MTP head runs its block (owed rows + the last token's row, fixed width k+1 after a
            drafting round) and k chained steps; p-min marks which drafts count (`live`).
  verify    one trunk forward over [last token (device), d1..dk], capturing rollback inputs.
  accept    greedy prefix match, or the rejection sampler with residual max(0, p - q), on the
            device (`accept_greedy_device`, `accept_sampling_device`): n and the emitted row.
  commit    KV offsets become `base + n + 1` (device values), gated-delta-net states the masked
            `state_after` of n + 1 tokens; the emitted row and the verify's hidden states are the
            head's next block; the next round's first input is `emitted[n]`.

Only shapes chosen by the host (k) change the graphs; accepted lengths never do. The host reads
a round's (emitted, n) one round late, then detokenizes and checks stops while the device runs the
next. Output is the host round's: greedy token-identical to plain decoding, sampling lossless.
Grammar-constrained generation (host state per token) and precise profiling keep the host round.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from ..generation.decode import kv_capacity
from ..generation.sampling import check_finite, distribution


@mx.compile
def accept_greedy_device(drafts: mx.array, scored: mx.array, live: mx.array) -> tuple[mx.array, mx.array]:
    """drafts [k] int32, scored [k+1, V], live [k] bool (drafts that count): (n accepted, emitted
    [k+1]: the accepted drafts, the target's argmax at row n, then padding)."""
    target = mx.argmax(scored, axis=-1).astype(mx.int32)
    ok = (drafts == target[:-1]) & live
    n = mx.sum(mx.cumprod(ok.astype(mx.int32)))
    token = mx.take(target, n)
    padded = mx.concatenate([drafts, mx.zeros((1,), mx.int32)])
    return n, mx.where(mx.arange(padded.shape[0]) < n, padded, token)


@mx.compile
def accept_sampling_device(drafts: mx.array, p: mx.array, q: mx.array, live: mx.array,
                           key: mx.array) -> tuple[mx.array, mx.array]:
    """Speculative sampling (Leviathan et al.) on the device: draft i (drawn from q [k, V]) is kept
    with probability min(1, p_i(d)/q_i(d)); the first rejected row draws from normalise(max(0, p - q));
    past the last live draft, from p (the bonus token). p [k+1, V]."""
    k = drafts.shape[0]
    u_key, c_key = mx.random.split(key)
    pd = mx.take_along_axis(p[:k], drafts[:, None], axis=-1)[:, 0]
    qd = mx.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
    u = mx.random.uniform(shape=(k,), key=u_key)
    ok = live & (qd > 0) & (u * qd < pd)
    n = mx.sum(mx.cumprod(ok.astype(mx.int32)))
    q_live = mx.concatenate([mx.where(live[:, None], q, 0.0), mx.zeros((1, q.shape[-1]), q.dtype)])
    residual = mx.maximum(p - q_live, 0.0)
    residual = mx.where(mx.sum(residual, axis=-1, keepdims=True) > 0, residual, p)  # p == q to rounding
    token = mx.random.categorical(mx.log(mx.take(residual, n, axis=0)), key=c_key).astype(mx.int32)
    padded = mx.concatenate([drafts, mx.zeros((1,), mx.int32)])
    return n, mx.where(mx.arange(k + 1) < n, padded, token)


@dataclass
class Queued:
    """A round queued on the device, read by the host later."""

    k: int  # drafts asked for (0: a plain round)
    emitted: mx.array  # [k+1] int32; the first n+1 count
    n: mx.array | int  # accepted drafts
    drafted: mx.array | int  # drafts that count (p-min, n-min)
    drafts: mx.array | None
    finite: mx.array
    logits: mx.array  # the rows that scored the emitted tokens (logprobs)
    rows: int  # trunk rows it runs (its bound on the KV offsets' growth)
    shapes: list = field(default_factory=list)
    launch_s: float = 0.0  # host seconds it took to queue, when queued ahead of another round's read
    shift: float = 0.0  # correction to its timed interval (`step`)
    steady: bool = True  # queued between rounds of its own k: its time is a sample of t(k)

    def read(self) -> list[mx.array]:
        """The device values the host reads one round late. Each must be queued with the round:
        one queued only at the read (it was `drafted`) lands behind the next round on the stream,
        so the read waits for that round too and the host cannot queue the one after it while the
        device works (a k = 3 round took 13.0 ms in the loop against 9.6 queued back to back)."""
        return [a for a in (self.emitted, self.finite, self.n, self.drafted, self.drafts) if isinstance(a, mx.array)]


class ResidentRounds:
    """Mixin for `SpeculativeDecoder` with an `MTPDrafter`: rounds as device values (see the
    module docstring). `resident_rounds = False` (a class that must see each round on the host,
    e.g. the re-decoding rollback ablation) keeps the host round."""

    resident_rounds = True

    def prefill(self, ids: list[int]) -> list[int]:
        out = super().prefill(ids)
        self._queued: list[Queued] = []
        self._prev_k = -1
        self._resident = (self.resident_rounds and self.model.resident_rounds and self.sampler.grammar is None
                          and self.prof.mode != "precise")
        if self._resident:
            self._last_dev = mx.array([ids[-1]], dtype=mx.int32)
            self._key = mx.random.key(int(self.sampler.rng.integers(0, 2**63)))
            self.cache.kv_to_device()
            self.drafter.to_device()
        return out

    def step(self) -> list[int]:
        if not self._resident:
            return super().step()
        cur = self._queued.pop(0) if self._queued else self._launch_resident(self._choose_k())
        if self._pipelined_rounds() and self._wanted() > 1:
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
        elif self._pipelined_rounds():
            cur.steady = False  # the last round: nothing queued behind it
        self._prev_k = cur.k
        return self._complete_resident(cur)

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
        model = self.model
        shapes = self._shapes(k)
        drafts, q, confident = self.drafter.draft_resident(k, self.params.p_min)
        live = self._live(confident, k)
        with self.prof.stage("verify"):
            post, pre = model.forward(mx.concatenate([self._last_dev, drafts])[None], self.cache, capture=True,
                                      return_prenorm=True, resident=True)
            fed, logits = self._fed(post, pre), model.logits(post[0])
        with self.prof.stage("accept"):
            scored = self.sampler.penalize(logits, drafts)
            n, emitted = self._accept_device(drafts, scored, q, live)
        with self.prof.stage("rollback"):
            self.cache.rollback_lazy(n + 1)
            self.drafter.commit(emitted, n, fed)
            self._last_dev = mx.take(emitted, n.reshape(1))
        r = Queued(k, emitted, n, mx.sum(live), drafts, mx.all(mx.isfinite(logits)), logits, k + 1, shapes)
        self._queue(r)
        return r

    def _launch_resident_plain(self) -> Queued:
        model, cfg = self.model, self.sampler.cfg
        with self.prof.stage("decode"):
            post, pre = model.forward(self._last_dev.reshape(1, 1), self.cache, return_prenorm=True, resident=True)
            logits = model.logits(post[0])  # [1, V]
            scored = self.sampler.penalize(logits)
            if cfg.greedy:
                token = mx.argmax(scored, axis=-1).astype(mx.int32)
            else:
                self._key, sub = mx.random.split(self._key)
                token = mx.random.categorical(mx.log(distribution(scored, cfg)), key=sub).astype(mx.int32)
        self.drafter.accept_plain(token, self._fed(post, pre))
        self._last_dev = token
        r = Queued(0, token, 0, 0, None, mx.all(mx.isfinite(logits)), logits, 1,
                   [("trunk", 1, False, kv_capacity(self.cache))])
        self._queue(r)
        return r

    def _queue(self, r: Queued) -> None:
        if self._pipelined_rounds():
            b = self.drafter.block  # evaluated each round: plain rounds would chain its concatenations
            mx.async_eval(*r.read(), b.tokens, b.hidden)

    def _live(self, confident: mx.array | None, k: int) -> mx.array:
        """Which of the k drafts count: a prefix of those that passed p-min, none if fewer than
        n-min (llama.cpp's rules, decided on the device)."""
        count = mx.sum(mx.cumprod(confident.astype(mx.int32))) if confident is not None else mx.array(k)
        if self.params.n_min > 1:
            count = mx.where(count < self.params.n_min, 0, count)
        return mx.arange(k) < count

    def _accept_device(self, drafts: mx.array, scored: mx.array, q: mx.array | None,
                       live: mx.array) -> tuple[mx.array, mx.array]:
        """(n accepted, emitted row [k+1]) as device values."""
        cfg = self.sampler.cfg
        if cfg.greedy:
            return accept_greedy_device(drafts, scored, live)
        self._key, sub = mx.random.split(self._key)
        return accept_sampling_device(drafts, distribution(scored, cfg), q, live, sub)

    def _shapes(self, k: int) -> list:
        w, head_cap = self.drafter.block_width(), kv_capacity(self.drafter.cache)
        head = [("mtp", w, head_cap)] + ([("mtp", 1, head_cap)] if k > 1 else [])
        return head + [("trunk", k + 1, True, kv_capacity(self.cache))]

    # ---- the host's read, one round late -------------------------------------------------------
    def _complete_resident(self, r: Queued) -> list[int]:
        with self.prof.stage("sync"):
            # this round's block is evaluated with it; once a later round is queued the block is
            # that round's (its `_queue` evaluates it): waiting for it here would serialise them
            block = [] if self._queued else [self.drafter.block.tokens, self.drafter.block.hidden]
            mx.eval(*r.read(), *block)
            check_finite(r.finite)
            n, drafted = int(r.n), int(r.drafted)
            emitted = r.emitted.tolist()
            drafts = r.drafts.tolist()[:drafted] if r.drafts is not None else []
        token = emitted[n]
        self.cache.offset += n + 1
        self.cache.set_bound(self.cache.offset + sum(q.rows for q in self._queued))
        # the head holds at most one row past the trunk's (its last token's), whatever is queued
        head = self.drafter.cache
        head.bound = min(head.bound, self.cache.offset + 1)
        self.last_token = token
        self._count_experts("verify" if r.k else "step")
        return self._finish_round(emitted[:n] + drafts[n:], n, token, r)
