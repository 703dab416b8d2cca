"""One speculative round as device values, in the four stages of the loop (gpt-fast's shape):

    draft    the drafter proposes k tokens (the MTP head's k chained steps)
    verify   one trunk forward over [last token, d1..dk], capturing what a rollback needs
    accept   how many drafts the target agrees with (greedy prefix match, or the rejection
             sampler), and the token after them
    commit   the caches keep last token + the accepted drafts; the drafter is told what was emitted

Nothing here reads a value on the host: accepted lengths stay device values, so the caller can
queue the next round before it reads this one (`resident.ResidentRounds`: the pipelining layer);
`stage` is the profiling layer's hook (a context manager per stage name); statistics are the
decoder's, from what the host reads one round late. `plain_round` is a round without drafts.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..model.fused import fused


@dataclass
class Round:
    """A round's device values: what the host reads one round late, and the rows behind them."""

    k: int  # drafts asked for (0: a plain round)
    emitted: mx.array  # [k+1] int32: the accepted drafts, then the target's token; the first n+1 count
    n: mx.array | int  # accepted drafts
    drafted: mx.array | int  # drafts that count (p-min, n-min)
    drafts: mx.array | None
    finite: mx.array
    logits: mx.array  # the rows that scored the emitted tokens (logprobs)


def _no_stage(name: str):
    return nullcontext()


def draft_round(model, cache, drafter, last: mx.array, k: int, accept: Callable, fed: Callable,
                p_min: float = 0.0, n_min: int = 0, stage: Callable = _no_stage) -> Round:
    """Draft, verify, accept, commit (module docstring). `last` [1]: the token the round starts
    from (a device value); `accept(drafts, logits, q, live) -> (n, emitted)`: the acceptance rule;
    `fed(post, pre)`: the trunk state the drafter reads."""
    drafts, q, confident = drafter.draft_resident(k, p_min)
    live = live_drafts(confident, k, n_min)
    with stage("verify"):
        post, pre = model.forward(mx.concatenate([last, drafts])[None], cache, capture=True, return_prenorm=True,
                                  resident=True)
        logits = model.logits(post[0])
    with stage("accept"):
        n, emitted = accept(drafts, logits, q, live)
    with stage("rollback"):
        cache.rollback_lazy(n + 1)
        drafter.commit(emitted, n, fed(post, pre))
    return Round(k, emitted, n, mx.sum(live), drafts, mx.all(mx.isfinite(logits)), logits)


def plain_round(model, cache, drafter, last: mx.array, pick: Callable, fed: Callable,
                stage: Callable = _no_stage) -> Round:
    """A round without drafts: one trunk step from `last` [1]; `pick(logits [1, V]) -> [1]` the token."""
    with stage("decode"):
        post, pre = model.forward(last.reshape(1, 1), cache, return_prenorm=True, resident=True)
        logits = model.logits(post[0])
        token = pick(logits)
    drafter.accept_plain(token, fed(post, pre))
    return Round(0, token, 0, 0, None, mx.all(mx.isfinite(logits)), logits)


def live_drafts(confident: mx.array | None, k: int, n_min: int = 0) -> mx.array:
    """Which of the k drafts count: a prefix of those that passed p-min, none if fewer than n-min
    (llama.cpp's rules, decided on the device)."""
    count = mx.sum(mx.cumprod(confident.astype(mx.int32))) if confident is not None else mx.array(k)
    if n_min > 1:
        count = mx.where(count < n_min, 0, count)
    return mx.arange(k) < count


@fused
def accept_greedy_device(drafts: mx.array, scored: mx.array, live: mx.array) -> tuple[mx.array, mx.array]:
    """drafts [k] int32, scored [k+1, V], live [k] bool (drafts that count): (n accepted, emitted
    [k+1]: the accepted drafts, the target's argmax at row n, then padding)."""
    target = mx.argmax(scored, axis=-1).astype(mx.int32)
    ok = (drafts == target[:-1]) & live
    n = mx.sum(mx.cumprod(ok.astype(mx.int32)))
    token = mx.take(target, n)
    padded = mx.concatenate([drafts, mx.zeros((1,), mx.int32)])
    return n, mx.where(mx.arange(padded.shape[0]) < n, padded, token)


@fused
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
