"""A round as device values over B >= 1 rows, and the round without drafts.

A round is what a decoder queues on the device and the host reads one round later (`Round`): each
row's emitted tokens, how many count, whether its logits were finite, and the row's last token, the
next round's first input. `plain_round` is one trunk step per row; a speculative round
(`speculative.round.draft_round`) drafts, verifies, accepts and commits, and returns the same
record. Nothing here reads a value on the host, so the caller can queue the next round before it
reads this one (the pipelining layers: `decode.PlainDecoder` for a sequence alone, which a
speculative decoder extends, and `batching.scheduler` for a batch); `stage` is the profiling
layer's hook (a context manager per stage name).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from ..model.step import Pass
from .sampling import logprob_arrays, logprob_dicts


@dataclass
class Round:
    """A round's device values over its B rows: what the host reads one round late, and the rows
    behind them."""

    k: int  # drafts asked for (0: a plain round)
    emitted: mx.array  # [B, k+1] int32: the accepted drafts, then the target's token; n+1 count per row
    n: mx.array | None  # [B] accepted drafts (None: a plain round, none)
    drafted: mx.array | None  # [B] drafts that count (p-min, n-min; rows that do not draft: 0)
    drafts: mx.array | None  # [B, k]
    finite: mx.array  # [B]
    logits: mx.array  # [B, k+1, V]: the rows that scored the emitted tokens (logprobs, host sampling)
    last: mx.array  # [B] int32: each row's last emitted token, the next round's first input
    logprobs: list[mx.array] | None = None  # `logprob_arrays` of the emitted tokens [B, k+1, ...], when asked

    def host(self) -> "RoundRead":
        """The round as host values, after `read()`'s arrays were evaluated. Only those arrays are
        read, whole: a slice or any other new operation on them would be queued behind the round
        launched since, and the host would wait for that round too (a round of one draft took 9.2
        ms against 6.9 when the host read `emitted[0]`)."""
        b = int(self.emitted.shape[0])
        return RoundRead(self.emitted.tolist(), self.n.tolist() if self.n is not None else [0] * b,
                         self.drafted.tolist() if self.drafted is not None else [0] * b,
                         self.drafts.tolist() if self.drafts is not None else None, self.finite.tolist(),
                         [np.array(a) for a in self.logprobs] if self.logprobs is not None else None)

    def unread(self, row: int) -> tuple[mx.array, mx.array]:
        """Row `row`'s emitted tokens and how many count (a device count), for the penalties of a
        round queued before the host reads this one (`Sampler.reading_ahead`)."""
        return self.emitted[row], self.n[row] + 1 if self.n is not None else mx.array(1)

    def read(self) -> list[mx.array]:
        """The device values the host reads. Each must be queued with the round: one queued only at
        the read lands behind the next round on the stream, so the read waits for that round too
        and the host cannot queue the one after it while the device works (a k = 3 round took
        13.0 ms in the loop against 9.6 queued back to back)."""
        return [a for a in (self.emitted, self.finite, self.n, self.drafted, self.drafts) if a is not None] + \
            (self.logprobs or [])


@dataclass
class RoundRead:
    """A round's rows as the host reads them (`Round.host`)."""

    emitted: list[list[int]]  # per row: the accepted drafts, then the target's token (n+1 count)
    n: list[int]  # accepted drafts per row
    drafted: list[int]  # drafts that counted per row
    drafts: list[list[int]] | None
    finite: list[bool]
    logprobs: list[np.ndarray] | None  # `logprob_arrays` per row, when the round computed them

    def token_logprobs(self, row: int, tokens: list[int], n: int | None) -> list[dict] | None:
        """Row `row`'s logprobs of its emitted `tokens` (n alternatives; None: not asked for)."""
        if n is None or self.logprobs is None or not tokens:
            return None
        return logprob_dicts([a[row] for a in self.logprobs], tokens, n)


def no_stage(name: str):
    """A profiler's `stage` that times nothing (its list takes what a precise profile would evaluate)."""
    return nullcontext([])



def token_round(logits: mx.array, pick: Callable, logprobs: int | None = None) -> Round:
    """The round a forward's last row per sequence ends with, logits [B, 1, V]: each row's token
    `pick(logits [B, V]) -> [B]` int32 (a plain round's, or a prefill's first token)."""
    token = pick(logits[:, 0])
    return Round(0, token[:, None], None, None, None, mx.all(mx.isfinite(logits), axis=(1, 2)), logits, token,
                 logprob_arrays(logits, token[:, None], logprobs) if logprobs is not None else None)


def plain_round(model, cache, drafter, last: mx.array, pick: Callable, fed: Callable,
                stage: Callable = no_stage, logprobs: int | None = None, hold: mx.array | None = None) -> Round:
    """A round without drafts: one trunk step per row from `last` [B]; `pick(logits [B, V]) -> [B]`
    int32 the tokens; `drafter` (None: none) keeps its head in step (`fed(post, pre)`: the trunk
    state it reads); `logprobs` n: the tokens' log-probabilities and n alternatives (None: none
    asked for); `hold` [B] bool: rows that sit the round out (their input is not known yet: a
    grammar's row in a batch while the host chooses its token): the step is captured and they
    keep none of it."""
    with stage("decode") as out:
        post, pre = model.forward_states(last[:, None], cache, Pass.ROUND_STEP if hold is None else Pass.ROUND_VERIFY)
        r = token_round(model.logits(post), pick, logprobs)
        out.append(r.last)
    if hold is not None:
        cache.rollback_lazy(mx.where(hold, 0, 1))
    if drafter is not None:
        drafter.accept_plain(r.last, fed(post, pre), *([] if hold is None else [hold]))
    return r


def greedy(logits: mx.array) -> mx.array:
    """`plain_round`'s pick where every row's token is its argmax: [B, V] -> [B] int32."""
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def post_norm(post: mx.array, pre: mx.array) -> mx.array:
    """The trunk state an MTP head reads: the post-norm hidden state (what the output head reads)."""
    return post
