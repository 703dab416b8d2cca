"""Experiment variants of draft-mtp, kept out of the production classes: the notebooks and the
benchmark scripts build them with `ablation_decoder`.

  rollback="redecode"  restore the pre-verify trunk state and run the trunk again over the accepted
                       tokens (what llama.cpp's server does when it cannot snapshot), instead of
                       picking the state captured in verify (notebook d).
  feed="pre_norm"      feed the MTP head the trunk's pre-norm state: the known bug, kept to measure
                       its cost (notebook c).
  oracle_acceptance=a  each draft counts as right with probability a (greedy only; the drafter
                       still does all its work), so random-weight models can be timed at a chosen
                       acceptance (scripts/bench/harness.py, bench_gpu.py).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import MTPEngineError
from ..generation.profiler import Profiler
from ..generation.sampling import Sampler
from ..model.qwen35 import Qwen35Model
from .config import DraftParams
from .draft_mtp import DraftMTPDecoder
from .scheduler import DraftLengthScheduler


class RedecodeRollback:
    """Mixin: rollback by snapshot + re-decoding the accepted tokens."""

    _snapshot: list | None = None
    _redecode_input: mx.array | None = None
    resident_rounds = False  # a snapshot per round is host state

    def verify(self, drafts):
        self._snapshot = self.cache.snapshot()
        self._redecode_input = self._verify_input(drafts)
        return super().verify(drafts)

    def _trunk(self, ids, capture):
        return super()._trunk(ids, capture=False)  # nothing to capture: the snapshot is the rollback

    def rollback(self, n: int) -> None:
        with self.prof.stage("rollback") as out:
            kept = n + 1
            if kept < self._verify_rows:
                self.cache.restore(self._snapshot)
                super()._trunk(self._redecode_input[None, :kept], capture=False)
                out.extend(self.cache.arrays())
            self._snapshot = None
            self.drafter.rollback(n)


class PreNormFeed:
    """Mixin: the drafter reads the trunk's pre-norm hidden state (the known-wrong variant)."""

    def _fed(self, post, pre):
        return pre


class OracleAcceptance:
    """Mixin: greedy drafts count as right with probability `oracle` (benchmark-only)."""

    oracle: float = 0.0

    def _decide(self, d: np.ndarray, target: np.ndarray, q):
        if not self.sampler.cfg.greedy:
            return super()._decide(d, target, q)
        n = 0
        while n < len(d) and self.sampler.uniform() < self.oracle:
            n += 1
        return n, int(target[n]), [int(t) for t in target[:n]] + d.tolist()[n:]

    def _accept_device(self, drafts, scored, q, live):
        if not self.sampler.cfg.greedy:
            return super()._accept_device(drafts, scored, q, live)
        self._key, sub = mx.random.split(self._key)
        return accept_oracle_device(drafts, scored, live, self.oracle, sub)


def accept_oracle_device(drafts: mx.array, scored: mx.array, live: mx.array, oracle: float,
                         key: mx.array) -> tuple[mx.array, mx.array]:
    """The oracle's acceptance over rows (drafts [B, k], scored [B, k+1, V], live [B, k]): row b
    keeps its first n_b live drafts, each right with probability `oracle`, and emits the target's
    tokens up to row n_b (what the trunk scored there): (n [B], emitted [B, k+1])."""
    target = mx.argmax(scored, axis=-1).astype(mx.int32)
    right = (mx.random.uniform(shape=drafts.shape, key=key) < oracle) & live
    n = mx.sum(mx.cumprod(right.astype(mx.int32), axis=1), axis=1)
    return n, mx.where(mx.arange(target.shape[1])[None, :] <= n[:, None], target, 0)


def ablation_decoder(model: Qwen35Model, sampler: Sampler, params: DraftParams, profiler: Profiler | None = None,
                     *, rollback: str = "capture", feed: str = "post_norm", oracle_acceptance: float | None = None,
                     scheduler: DraftLengthScheduler | None = None) -> DraftMTPDecoder:
    """A draft-mtp decoder with the chosen experiment variants (the defaults are production's)."""
    if rollback not in ("capture", "redecode"):
        raise MTPEngineError(f"expected capture or redecode, found {rollback!r}", field="rollback")
    if feed not in ("post_norm", "pre_norm"):
        raise MTPEngineError(f"expected post_norm or pre_norm, found {feed!r}", field="feed")
    mixins: list[type] = []
    if rollback == "redecode":
        mixins.append(RedecodeRollback)
    if feed == "pre_norm":
        mixins.append(PreNormFeed)
    if oracle_acceptance is not None:
        mixins.append(OracleAcceptance)
    # the variant is a class of its own: its acceptance rate a class attribute, nothing set on the
    # decoder after it is built
    attrs = {"oracle": float(oracle_acceptance)} if oracle_acceptance is not None else {}
    cls = type("AblationDecoder", (*mixins, DraftMTPDecoder), attrs) if mixins else DraftMTPDecoder
    return cls(model, sampler, params, profiler, scheduler=scheduler)
