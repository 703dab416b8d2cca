"""One speculative round as device values over B >= 1 rows, in the four stages of the loop
(gpt-fast's shape):

    draft    the drafter proposes k tokens per row (the MTP head's k chained steps) [B, k]
    verify   one trunk forward over [last token, d1..dk] per row, capturing what a rollback needs
    accept   how many drafts each row's target agrees with (greedy prefix match, or the rejection
             sampler), and the token after them: n [B], emitted [B, k+1]
    commit   each row keeps last token + its accepted drafts; the drafter is told what was emitted

A sequence decoded alone is a round of one row; a batch (`batching`) runs the same round over its
rows, each at its own length. It returns the record a plain round returns (`generation.round`):
nothing here reads a value on the host, accepted lengths stay device values, so the caller can
queue the next round before it reads this one (`decoder.SpeculativeDecoder` alone,
`batching.scheduler` for a batch); statistics are the callers', from what the host reads one
round late.
"""
from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ..generation.round import Round, no_stage
from ..generation.sampling import logprob_arrays
from ..model.fused import fused
from ..model.step import Pass


def draft_round(model, cache, drafter, last: mx.array, k: int, accept: Callable, fed: Callable,
                p_min: float = 0.0, n_min: int = 0, drafting: mx.array | None = None,
                score: Callable | None = None, draft_pick: Callable | None = None,
                logprobs: int | None = None, stage: Callable = no_stage, hold: mx.array | None = None) -> Round:
    """Draft, verify, accept, commit (module docstring). `last` [B]: the tokens the round starts
    from (device values); `cache`: a sequence's `TrunkCache` (B = 1) or a `BatchCache`;
    `score(drafts, logits) -> scored`: what the rule compares (penalties, or the distributions a
    sampling rule draws from; None: the logits); `accept(drafts, scored, q, live) -> (n,
    emitted)`: the acceptance rule over rows; `fed(post, pre)`: the trunk state the drafter reads;
    `drafting` [B] bool: the rows whose drafts count (None: all). `stage(name)`: the profiler's
    stage, whose list takes what a precise profile evaluates at the stage's end. `p_min`, `n_min`:
    one for every row, or each row's [B] (a batch's requests set their own). `draft_pick(logits
    [B, V], drafts so far) -> (tokens [B], distributions [B, V] or None, scored logits)`: how a batch's drafter draws each row's
    drafts (`row_sampling.RowSampling.draft_pick`; None: a drafter alone follows its sampler).
    `logprobs` n (None: none asked for): the emitted tokens' log-probabilities and n alternatives
    per row, computed with the round (`sampling.logprob_arrays`). `hold` [B] bool: rows that sit the
    round out (their input is not known yet: a grammar's row while its last token is being chosen
    on the host): they keep none of its tokens, in the trunk or the drafter (None: none does)."""
    drafts, q, confident = drafter.draft(k, p_min) if draft_pick is None else drafter.draft(k, p_min, draft_pick)
    live = live_drafts(confident, k, n_min, drafts.shape[0])
    if drafting is not None:
        live = live & drafting[:, None]
    with stage("verify") as out:
        post, pre = model.forward_states(mx.concatenate([last[:, None], drafts], axis=1), cache,
                                         Pass.ROUND_VERIFY)
        logits = model.logits(post)
        out.append(logits)
    with stage("sample") as out:
        scored = score(drafts, logits) if score is not None else logits
        out.append(scored)
    with stage("accept") as out:
        n, emitted = accept(drafts, scored, q, live)
        out.extend([n, emitted])
    with stage("rollback"):
        if hold is None:
            cache.rollback_lazy(n + 1)
            drafter.commit(emitted, n, fed(post, pre))
        else:  # (only a batch's drafter, `MTPRowsDrafter`, has rows that hold)
            cache.rollback_lazy(mx.where(hold, 0, n + 1))
            drafter.commit(emitted, n, fed(post, pre), hold)
    last = mx.take_along_axis(emitted, n[:, None], axis=1)[:, 0]
    return Round(k, emitted, n, mx.sum(live, axis=1), drafts, mx.all(mx.isfinite(logits), axis=(1, 2)), logits,
                 last, logprob_arrays(logits, emitted, logprobs) if logprobs is not None else None)


def live_drafts(confident: mx.array | None, k: int, n_min: "int | mx.array" = 0, rows: int = 1) -> mx.array:
    """[B, k]: which of each row's k drafts count: a prefix of those that passed p-min
    (`confident` [B, k]), none if fewer than n-min (llama.cpp's rules, decided on the device;
    `n_min` one for every row, or each row's [B])."""
    if confident is None:
        return mx.ones((rows, k), mx.bool_)
    per_row = isinstance(n_min, mx.array)
    count = mx.sum(mx.cumprod(confident.astype(mx.int32), axis=1), axis=1, keepdims=True)
    if per_row or n_min > 1:
        count = mx.where(count < (n_min.reshape(-1, 1) if per_row else n_min), 0, count)
    return mx.arange(k)[None, :] < count


def _emit(drafts: mx.array, n: mx.array, token: mx.array) -> mx.array:
    """[B, k+1]: each row's first n drafts, then its token, then padding (the token again)."""
    padded = mx.concatenate([drafts, mx.zeros((drafts.shape[0], 1), mx.int32)], axis=1)
    return mx.where(mx.arange(padded.shape[1])[None, :] < n[:, None], padded, token[:, None])


@fused
def accept_greedy_device(drafts: mx.array, scored: mx.array, live: mx.array) -> tuple[mx.array, mx.array]:
    """drafts [B, k] int32, scored [B, k+1, V], live [B, k] bool (drafts that count): (n accepted
    [B], emitted [B, k+1]: the accepted drafts, the target's argmax at row n, then padding)."""
    target = mx.argmax(scored, axis=-1).astype(mx.int32)
    n = mx.sum(mx.cumprod(_agreeing(drafts, target, live), axis=1), axis=1)
    return n, _emit(drafts, n, mx.take_along_axis(target, n[:, None], axis=1)[:, 0])


def _agreeing(drafts: mx.array, target: mx.array, live: mx.array) -> mx.array:
    """[B, k] int32: 1 where a live draft equals the target's token at its position."""
    return ((drafts == target[:, :-1]) & live).astype(mx.int32)


@fused
def accept_sampling_device(drafts: mx.array, p: mx.array, q: mx.array, live: mx.array,
                           key: mx.array) -> tuple[mx.array, mx.array]:
    """Speculative sampling (Leviathan et al.) on the device, per row: draft i (drawn from q
    [B, k, V]) is kept with probability min(1, p_i(d)/q_i(d)); the first rejected row draws from
    normalise(max(0, p - q)); past the last live draft, from p (the bonus token). p [B, k+1, V].
    `key`: the round's draws [2], or each row's own [B, 2] (a row's draws are then what its round
    alone draws with that key)."""
    b, k = drafts.shape
    keys = [mx.random.split(key)] if key.ndim == 1 else [mx.random.split(key[i]) for i in range(b)]
    u = mx.concatenate([mx.random.uniform(shape=(b // len(keys), k), key=uk) for uk, _ in keys])
    pd = mx.take_along_axis(p[:, :k], drafts[:, :, None], axis=-1)[..., 0]
    qd = mx.take_along_axis(q, drafts[:, :, None], axis=-1)[..., 0]
    ok = live & (qd > 0) & (u * qd < pd)
    n = mx.sum(mx.cumprod(ok.astype(mx.int32), axis=1), axis=1)
    q_live = mx.concatenate([mx.where(live[..., None], q, 0.0), mx.zeros((b, 1, q.shape[-1]), q.dtype)], axis=1)
    residual = mx.maximum(p - q_live, 0.0)
    residual = mx.where(mx.sum(residual, axis=-1, keepdims=True) > 0, residual, p)  # p == q to rounding
    at_n = mx.log(mx.take_along_axis(residual, n[:, None, None], axis=1)[:, 0])  # [B, V]
    token = mx.random.categorical(at_n, key=keys[0][1]) if len(keys) == 1 else \
        mx.concatenate([mx.random.categorical(at_n[i:i + 1], key=ck) for i, (_, ck) in enumerate(keys)])
    return n, _emit(drafts, n, token.astype(mx.int32))


# ---- MLX's modules a first round needs, compiled ahead at load (`model.kernels.mlx_jit`): each runs
# this module's compiled graphs on tiny inputs of the real dtypes (a module's name depends on the
# graph and dtypes, not on sizes; a batch's rows broadcast where one row does not, so both counts).
# The greedy accept graph comes in its pieces (each fused part alone, its gathers in `mlx_jit`'s
# generic recipes), so that they compile in parallel.
def _tiny(rows: str) -> tuple[mx.array, mx.array, mx.array]:
    b = int(rows)
    return mx.zeros((b, 3), mx.int32), mx.ones((b, 3), mx.bool_), mx.zeros((b, 4, 16))


def jit_accept_sampling(rows: str) -> tuple[mx.array, mx.array]:
    drafts, live, scored = _tiny(rows)
    p = mx.softmax(scored, axis=-1)
    return mx.compile(accept_sampling_device.__wrapped__)(drafts, p, p[:, :-1], live, mx.random.key(0))


def jit_accept_sampling_rows(rows: str) -> tuple[mx.array, mx.array]:
    """The rejection sampler with a key per row (a batch's sampling rows, `RowSampling`)."""
    drafts, live, scored = _tiny(rows)
    p = mx.softmax(scored, axis=-1)
    keys = mx.stack([mx.random.key(b) for b in range(drafts.shape[0])])
    return mx.compile(accept_sampling_device.__wrapped__)(drafts, p, p[:, :-1], live, keys)


def jit_agreeing(rows: str) -> mx.array:
    drafts, live, _ = _tiny(rows)
    return mx.compile(_agreeing)(drafts, mx.zeros((drafts.shape[0], 4), mx.int32), live)


def jit_emit(rows: str) -> mx.array:
    drafts, _, _ = _tiny(rows)
    b = drafts.shape[0]
    return mx.compile(_emit)(drafts, mx.zeros((b,), mx.int32), mx.zeros((b,), mx.int32))


# (phase, recipe): the greedy round's pieces (2), a batch's (3), the sampler's, one key per round
# or per row (4: after a long prompt's and a batch's, `batching.warm`)
JIT_RECIPES = [(2, f"{__name__}:jit_agreeing:1"), (2, f"{__name__}:jit_emit:1"), (3, f"{__name__}:jit_emit:2"),
               (3, f"{__name__}:jit_agreeing:2"), (4, f"{__name__}:jit_accept_sampling:1"),
               (4, f"{__name__}:jit_accept_sampling:2"), (4, f"{__name__}:jit_accept_sampling_rows:2")]
