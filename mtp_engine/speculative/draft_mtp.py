"""draft-mtp: the model's own MTP head drafts a chain, one trunk forward verifies it.

One round, each stage a method named as in the loop that calls it:
  draft     the MTP head as a chain: step 1 reads (last token, trunk hidden of the previous
            position); step i > 1 reads (draft i-1, the head's own shared_head_norm output).
            The catch-up rows owed from the previous round run in the same forward as step 1.
  verify    one trunk forward over [last token, d1..dk], capturing per-position recurrent states.
  accept    greedy prefix match, or lossless speculative sampling; the one host sync of a round.
  rollback  KV caches truncated; gated-delta-net states set to the captured state after the
            last accepted token (no re-decoding); MTP KV rows written by draft steps 2..k dropped.
  catch_up  queue the accepted rows (token, trunk hidden from the verify pass) for the MTP head;
            they are computed lazily, fused into the next round's first draft step.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..decode import PlainDecoder, kv_capacity
from ..errors import MTPEngineError
from ..model.qwen35 import Qwen35Model
from ..profiler import Profiler
from ..sampling import Sampler, check_finite, distribution
from .accept import accept_greedy, accept_sampling
from . import calibration
from .scheduler import AUTO_MAX, DraftLengthScheduler


@dataclass(frozen=True)
class DraftParams:
    """llama.cpp's knobs. n_max: drafts per round (0 = no drafting). n_min: a round with fewer
    surviving drafts discards them and decodes plainly. p_min: stop drafting when the next draft's
    probability (softmax over the head's top-10 logits at temperature 1) is below it."""

    n_max: int | str = 3  # or "auto": the scheduler picks k each round (speculative/scheduler.py)
    n_min: int = 0
    p_min: float = 0.0

    @property
    def auto(self) -> bool:
        return self.n_max == "auto"

    @property
    def k_max(self) -> int:
        return AUTO_MAX if self.auto else int(self.n_max)

    def __post_init__(self) -> None:
        for name in ("n_max", "n_min"):
            v = getattr(self, name)
            if name == "n_max" and v == "auto":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 64:
                extra = " or 'auto'" if name == "n_max" else ""
                raise MTPEngineError(f"expected an integer in 0..64{extra}, found {v!r}", field=name.replace("_", "-"))
        if self.n_min > self.k_max:
            raise MTPEngineError(f"n-min ({self.n_min}) must not exceed n-max ({self.n_max})", field="n-min")
        p = self.p_min
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0:
            raise MTPEngineError(f"expected a number in [0, 1], found {p!r}", field="p-min")


@dataclass
class _Round:
    """A round queued on the device, completed (host read, accept, rollback) later."""

    k: int  # drafts asked for (the scheduler's choice, or n-max)
    shapes: list = field(default_factory=list)  # forward shapes it runs (first use = a compile)
    logits: mx.array | None = None
    token: mx.array | None = None  # greedy plain step: its argmax, on the device
    finite: mx.array | None = None
    post: mx.array | None = None  # plain step: trunk hidden (post-norm, pre-norm)
    fed: mx.array | None = None
    drafts: mx.array | list = field(default_factory=list)
    q: mx.array | None = None
    steps: int = 0
    hidden: mx.array | None = None
    target: mx.array | None = None

    @property
    def plain(self) -> bool:
        return self.hidden is None


class DraftMTPDecoder(PlainDecoder):
    """Speculative decoding with the model's MTP head as the drafter."""

    catch_up_window = 8  # owed MTP rows kept across plain rounds (see _trim_owed)

    def __init__(self, model: Qwen35Model, sampler: Sampler, params: DraftParams,
                 profiler: Profiler | None = None, rollback: str = "capture", feed: str = "post_norm",
                 scheduler: DraftLengthScheduler | None = None, oracle_acceptance: float | None = None):
        """`rollback`: "capture" (pick the per-position state captured in verify) or "redecode"
        (restore the pre-verify state and run the trunk again over the accepted tokens, as
        llama.cpp's server does when it cannot snapshot; kept for comparison). `feed`: the trunk
        state given to the MTP head, "post_norm" (correct) or "pre_norm" (the known bug, kept
        for the ablation that measures its cost)."""
        if rollback not in ("capture", "redecode"):
            raise MTPEngineError(f"expected capture or redecode, found {rollback!r}", field="rollback")
        if feed not in ("post_norm", "pre_norm"):
            raise MTPEngineError(f"expected post_norm or pre_norm, found {feed!r}", field="feed")
        self.rollback_mode, self.feed = rollback, feed
        # benchmark-only: each draft counts as right with this probability (the drafter still does
        # all its work), so large random-weight models can be timed at a chosen acceptance
        self.oracle = oracle_acceptance
        if params.auto and scheduler is None:
            raise MTPEngineError("n-max auto needs a scheduler with the device's measured costs", field="n-max")
        self.scheduler = scheduler if params.auto else None
        self._snapshot: list | None = None
        self._verify_input: mx.array | None = None
        self._verify_len = 0
        if model.mtp is None:
            raise MTPEngineError("draft-mtp needs a model with an MTP head (nextn_predict_layers >= 1); "
                                 "this model has none", field="spec")
        super().__init__(model, sampler, profiler)
        self.params = params
        self.mtp_cache = model.mtp.make_cache()
        self.h_last: mx.array | None = None  # trunk hidden [1, 1, H] of the position before last_token
        self._owed_tokens: list[int] = []  # catch-up rows the MTP head has not seen yet
        self._owed_hidden: list[mx.array] = []
        self.catch_up_dropped = 0  # owed rows skipped after long plain stretches (see _trim_owed)
        # drafts are sampled on the device; its key derives from the sampler's seeded generator
        self._draft_rng = mx.random.key(int(sampler.rng.integers(0, 2**63)))
        # statistics
        self.rounds = 0
        self.drafted = 0
        self.accepted = 0
        self.per_position_drafted: list[int] = [0] * params.k_max
        self.per_position_accepted: list[int] = [0] * params.k_max
        self.histogram: Counter = Counter()
        self.k_histogram: Counter = Counter()  # auto: the draft length chosen, per completed round
        self.trace: list[dict] | None = None  # per-round record, when a caller sets it to []
        self.calibration_path = ""  # model file whose stored round costs this run's measurements update
        self._pending: _Round | None = None
        self._held_k: int | None = None

    # ---- prompt -------------------------------------------------------------------------------
    def prefill(self, ids: list[int]) -> list[int]:
        """Prefills all but the last prompt token (as llama.cpp's draft-mtp does), so the first
        round drafts from the last prompt token and its verify yields the first new token."""
        self.sampler.begin(ids)
        self._emitted([], 0, 0, None)
        with self.prof.stage("prefill"):
            head = ids[:-1]
            h = self._prefill_trunk(head, prenorm=self.feed == "pre_norm")
            self.last_token = ids[-1]
            self.h_last = h[:, -1:] if head else mx.zeros((1, 1, self.model.cfg.hidden_size))
            # the MTP head sees prompt row t as (token t, hidden t-1), zeros before the first
            h_prev = mx.concatenate([mx.zeros((1, 1, self.model.cfg.hidden_size)), h[:, :-1]], axis=1)
            for s in range(0, len(head), self.prefill_chunk):
                e = slice(s, s + self.prefill_chunk)
                m = self.model.mtp(self.model.embed_tokens(mx.array([head[e]])), h_prev[:, e], self.mtp_cache)
                mx.eval(m, *self.mtp_cache.state())
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

    def _choose_k(self) -> int:
        return self.scheduler.next_k(self.cache.offset) if self.scheduler else int(self.params.n_max)

    def _launch(self, k: int) -> _Round:
        return self._launch_plain(None, k) if k == 0 else self._launch_draft(k)

    def _complete(self, r: _Round) -> list[int]:
        return self._complete_plain(r) if r.plain else self._complete_draft(r)

    def _launch_draft(self, k: int) -> _Round:
        owed = len(self._owed_tokens)
        drafts, q, steps = self.draft(k)
        if 0 < len(drafts) < self.params.n_min:  # too few survived p-min: decode plainly
            drafts, q = [], None
        hidden, logits = self.verify(drafts)
        cfg = self.sampler.cfg
        with self.prof.stage("sample") as out:
            # row i scores the position after drafts 1..i: its penalties count them as generated
            scored = self.sampler.penalize(logits, drafts if len(drafts) else None)
            target = mx.argmax(scored, axis=-1) if cfg.greedy else distribution(scored, cfg)
            finite = mx.all(mx.isfinite(logits))
            out.extend([target, finite])
        if self._pipelined_rounds():
            mx.async_eval(target, finite, *([drafts] if len(drafts) else []))
        capm = kv_capacity(self.mtp_cache)
        shapes = [("mtp", owed + 1, capm), ("trunk", 1 + len(drafts), len(drafts) > 0, kv_capacity(self.cache))]
        if steps > 1:
            shapes.append(("mtp", 1, capm))
        return _Round(k, shapes, logits=logits, finite=finite, drafts=drafts, q=q, steps=steps, hidden=hidden,
                      target=target)

    def _complete_draft(self, r: _Round) -> list[int]:
        n, token, host_drafts = self.accept(r.drafts, r.logits, r.q, r.target, r.finite)
        self._count_experts("verify")
        self.rollback(r.steps, n)
        self.catch_up(host_drafts[:n], r.hidden, n, r.steps)
        self.last_token = token
        return self._finish_round(host_drafts, n, token, r)

    def _pipelined_rounds(self) -> bool:
        # a queued round would be scored against a penalty history that lacks this round's tokens
        return self.pipeline and not self.prof.enabled and not self.sampler.cfg.penalties.active

    def plain_step(self) -> list[int]:
        """A round without drafting: exactly a plain decode step (no capture, no MTP work); the
        MTP head's row for it is owed and caught up when drafting resumes."""
        return self._complete_plain(self._launch_plain(None))

    def _launch_plain(self, prev: _Round | None, k: int = 0) -> _Round:
        """A plain step from the host's last token, or (pipelined) from `prev`'s token on the device."""
        inp = prev.token.reshape(1, 1).astype(mx.int32) if prev is not None else mx.array([[self.last_token]])
        with self.prof.stage("decode") as out:
            post, fed = self.model.forward(inp, self.cache, return_prenorm=True)
            logits = self.model.logits(post[0, -1])
            out.append(logits)
        r = _Round(k, [("trunk", 1, False, kv_capacity(self.cache))], logits=logits, post=post, fed=fed)
        if self._pipelined():
            r.token, r.finite = mx.argmax(logits, axis=-1), mx.all(mx.isfinite(logits))
            mx.async_eval(r.token, r.finite)
        return r

    def _complete_plain(self, r: _Round) -> list[int]:
        with self.prof.stage("sync"):
            token = self._read((r.token, r.finite)) if r.token is not None else self.sampler.sample(r.logits)
        self._count_experts("step")
        self._owed_tokens.append(self.last_token)
        self._owed_hidden.append(self.h_last)
        self._trim_owed()
        self.h_last = r.fed if self.feed == "pre_norm" else r.post
        self.last_token = token
        return self._finish_round([], 0, token, r)

    def _trim_owed(self) -> None:
        """Keeps only the newest `catch_up_window` owed rows. Every plain round owes the head one
        row, and where a product of M rows costs M single rows (MLX's CPU backend) catching up a
        long plain stretch costs c steps per plain token: measured on the 2-core CPU, n-max auto
        fell to 0.86x plain from its probes' catch-ups alone. Older rows are dropped: the head's own
        attention then lacks them (its positions close the gap), which can only lower acceptance of
        the next drafts, never change the output (verify decides)."""
        drop = len(self._owed_tokens) - self.catch_up_window
        if drop <= 0:
            return
        self._owed_tokens = self._owed_tokens[drop:]
        self.catch_up_dropped += drop
        # drop whole entries (no concatenation: a lazy concat per plain round would chain forever)
        while drop:
            rows = int(self._owed_hidden[0].shape[1])
            if rows <= drop:
                self._owed_hidden.pop(0)
                drop -= rows
            else:
                self._owed_hidden[0] = self._owed_hidden[0][:, drop:]
                drop = 0

    def _finish_round(self, drafts: list[int], n: int, token: int, r: _Round) -> list[int]:
        """Statistics, the round's time, the scheduler's observation and the trace; its emitted
        tokens (`r.logits`: the rows that scored them, for logprobs)."""
        emitted = self._emitted(drafts[:n] + [token], n, len(drafts), r.logits)
        seconds, first_use = self.clock.lap(r.k, r.shapes)
        self._record(len(drafts), n)
        self.k_histogram[r.k] += 1
        if self.scheduler:
            self.scheduler.observe(len(drafts), n, seconds, self.cache.offset, first_use)
        if self.trace is not None:
            self.trace.append({"draft": drafts, "n_accepted": n, "emitted": emitted})
        return emitted

    def draft(self, k: int) -> tuple[mx.array | list, mx.array | None, int]:
        """Up to k draft tokens (a device array, so no host sync when p_min = 0), their
        distributions q [k, V] when sampling, and the number of MTP steps run (rows written)."""
        if k == 0:
            return [], None, 0
        mtp, model, cfg = self.model.mtp, self.model, self.sampler.cfg
        if self._owed_tokens and self.prof.mode == "precise":
            # attribute catch-up honestly: run the owed rows as their own forward (same math)
            with self.prof.stage("catch_up") as out:
                out.append(mtp(model.embed_tokens(mx.array([self._owed_tokens])),
                               mx.concatenate(self._owed_hidden, axis=1), self.mtp_cache))
                out.extend(self.mtp_cache.state())
            self._owed_tokens, self._owed_hidden = [], []
        tok = mx.array([self._owed_tokens + [self.last_token]])
        h_prev = mx.concatenate(self._owed_hidden + [self.h_last], axis=1)
        self._owed_tokens, self._owed_hidden = [], []
        drafts: list[mx.array] = []
        qs: list[mx.array] = []
        steps = 0
        for _ in range(k):
            steps += 1
            with self.prof.stage("draft") as out:
                h_mtp = mtp(model.embed_tokens(tok), h_prev, self.mtp_cache)[:, -1:]
                # the drafter sees the penalties its chain would meet (history + earlier drafts)
                logits = self.sampler.penalize(model.logits(h_mtp[0, 0]),
                                               mx.stack(drafts).reshape(-1) if drafts else None, len(drafts))
                if cfg.greedy:
                    d = mx.argmax(logits, axis=-1)
                else:
                    qi = distribution(logits, cfg)
                    self._draft_rng, sub = mx.random.split(self._draft_rng)
                    d = mx.random.categorical(mx.log(qi), key=sub)
                    qs.append(qi)
                out.append(d)
            if self.params.p_min > 0.0:
                with self.prof.stage("sync"):
                    top = mx.topk(logits, min(10, logits.shape[-1]))
                    p_top = mx.max(mx.softmax(top)).item()  # llama.cpp: top-10 softmax at temperature 1
                if p_top < self.params.p_min:
                    if qs:
                        qs.pop()
                    break
            drafts.append(d)
            tok, h_prev = d.reshape(1, 1), h_mtp
        if not drafts:
            return [], None, steps
        return mx.stack(drafts), (mx.stack(qs) if qs else None), steps

    def verify(self, drafts) -> tuple[mx.array, mx.array]:
        """One trunk forward over [last token, d1..dk]; logits for every row."""
        with self.prof.stage("verify") as out:
            last = mx.array([self.last_token], dtype=mx.int32)
            inp = mx.concatenate([last, drafts.astype(mx.int32)]) if len(drafts) else last
            self._verify_len = 1 + len(drafts)
            if self.rollback_mode == "redecode":
                self._snapshot = self.cache.snapshot()
                self._verify_input = inp
            # a round without drafts is a plain step: nothing to roll back, so nothing to capture
            post, hidden = self._trunk(inp[None], capture=self.rollback_mode == "capture" and len(drafts) > 0)
            logits = self.model.logits(post[0])
            out.append(logits)
        return hidden, logits

    def accept(self, drafts, logits: mx.array, q: mx.array | None, target: mx.array | None = None,
               finite: mx.array | None = None) -> tuple[int, int, list[int]]:
        """How many drafts survive, the token after them, and the drafts on the host. Holds the
        round's one host sync. `target`/`finite`: the argmax (or distribution) and finiteness of
        `logits` when already queued."""
        cfg = self.sampler.cfg
        if target is None:
            with self.prof.stage("sample") as out:
                # row i scores the position after drafts 1..i: its penalties count them as generated
                scored = self.sampler.penalize(logits, drafts if len(drafts) else None)
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
            if self.oracle is not None and cfg.greedy:
                n = 0
                while n < len(d) and self.sampler.uniform() < self.oracle:
                    n += 1
                return n, int(host_target[n]), [int(t) for t in host_target[:n]] + d.tolist()[n:]
            if cfg.greedy:
                n, token = accept_greedy(d, host_target)
            elif len(d):
                n, token = accept_sampling(d, host_target, host_q, self.sampler)
            else:
                n, token = 0, self.sampler.categorical(host_target[0])
        return n, token, d.tolist()

    def rollback(self, steps: int, n: int) -> None:
        """Keeps last token + n accepted drafts in the trunk; drops the MTP rows written by draft
        steps 2.. (their inputs were the head's own guesses; step 1's row is exact and stays)."""
        with self.prof.stage("rollback") as out:
            if self.rollback_mode == "capture":
                if self._verify_len > 1:  # captured (a draft-less round is a plain step)
                    self.cache.rollback(n + 1)
            else:
                kept = n + 1
                if kept < self._verify_len:
                    # restore the pre-verify state and decode the accepted tokens again
                    self.cache.restore(self._snapshot)
                    self._trunk(self._verify_input[None, :kept], capture=False)
                    out.extend(self.cache.arrays())
                self._snapshot = None
            if steps > 1:
                self.mtp_cache.truncate(self.mtp_cache.offset - (steps - 1))

    def catch_up(self, accepted: list[int], hidden: mx.array, n: int, steps: int) -> None:
        """The MTP head owes rows for the accepted drafts, (d_i, trunk hidden before d_i), and for
        the last token when no draft step ran; they join the next round's first draft forward."""
        with self.prof.stage("catch_up"):
            if steps == 0:
                self._owed_tokens.append(self.last_token)
                self._owed_hidden.append(self.h_last)
            self._owed_tokens.extend(accepted)
            if n:
                self._owed_hidden.append(hidden[:, :n])
            self.h_last = hidden[:, n:n + 1]

    def _trunk(self, ids: mx.array, capture: bool) -> tuple[mx.array, mx.array]:
        """Trunk forward: (post-norm hidden for the logits, the state the MTP head is fed)."""
        post, pre = self.model.forward(ids, self.cache, capture=capture, return_prenorm=True)
        return post, (pre if self.feed == "pre_norm" else post)

    def finish(self) -> None:
        """The generation is over: a queued round is dropped, and what this run measured of its
        rounds' costs is kept for the next run on this model and device."""
        self._pending = None
        if self.scheduler and self.calibration_path:
            t0 = self.scheduler.step_seconds()
            calibration.save(self.calibration_path, self.model, self.scheduler.measured_round_steps(),
                             t0 * 1e3 if t0 else None)

    # ---- statistics ---------------------------------------------------------------------------
    def _record(self, k: int, n: int) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += n
        for i in range(k):
            self.per_position_drafted[i] += 1
            self.per_position_accepted[i] += int(i < n)
        self.histogram[n] += 1

    def stats(self) -> dict:
        r = max(self.rounds, 1)
        extra: dict = {"compile_seconds": self.clock.compile_seconds()}
        if self.scheduler:
            extra.update({"n_max": "auto", "auto_message": self.scheduler.message(),
                          "draft_length_histogram": {str(k): v for k, v in sorted(self.k_histogram.items())},
                          **self.scheduler.stats()})
        extra.update(self._moe_stats())
        return {**extra,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "mean_accepted_length": self.accepted / r,
            "tokens_per_round": (self.accepted + self.rounds) / r,
            "acceptance_per_position": [a / d if d else None for a, d in
                                        zip(self.per_position_accepted, self.per_position_drafted)],
            "catch_up_rows_dropped": self.catch_up_dropped,
            "accepted_length_histogram": {str(i): self.histogram.get(i, 0) for i in range(self.params.k_max + 1)},
        }
