"""Experiment variants of draft-mtp's device round, kept out of the production classes: the
notebooks and the benchmark scripts build them with `ablation_decoder`. (Re-decoding rollback, a
round the host must read before it rolls back, lives with notebook d in scripts/ablation_redecode.py.)

  feed="pre_norm"      feed the MTP head the trunk's pre-norm state: the known bug, kept to measure
                       its cost (notebook c).
  oracle_acceptance=a  each draft counts as right with probability a (greedy only; the drafter
                       still does all its work), so random-weight models can be timed at a chosen
                       acceptance (scripts/bench/harness.py, bench_gpu.py).
"""
from __future__ import annotations

import mlx.core as mx

from ..errors import MTPEngineError
from ..generation.profiler import Profiler
from ..generation.sampling import Sampler
from ..model.qwen35 import Qwen35Model
from .config import DraftParams
from .draft_mtp import DraftMTPDecoder
from .scheduler import DraftLengthScheduler


class PreNormFeed:
    """Mixin: the drafter reads the trunk's pre-norm hidden state (the known-wrong variant)."""

    def _fed(self, post, pre):
        return pre


class OracleAcceptance:
    """Mixin: greedy drafts count as right with probability `oracle` (benchmark-only)."""

    oracle: float = 0.0

    def _accept(self, drafts, scored, q, live):
        if not self.sampler.cfg.greedy:
            return super()._accept(drafts, scored, q, live)
        return accept_oracle_device(drafts, scored, live, self.oracle, self.sampler.draws.next())


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
                     *, feed: str = "post_norm", oracle_acceptance: float | None = None,
                     scheduler: DraftLengthScheduler | None = None) -> DraftMTPDecoder:
    """A draft-mtp decoder with the chosen experiment variants (the defaults are production's)."""
    if feed not in ("post_norm", "pre_norm"):
        raise MTPEngineError(f"expected post_norm or pre_norm, found {feed!r}", field="feed")
    mixins: list[type] = []
    if feed == "pre_norm":
        mixins.append(PreNormFeed)
    if oracle_acceptance is not None:
        mixins.append(OracleAcceptance)
    # the variant is a class of its own: its acceptance rate a class attribute, nothing set on the
    # decoder after it is built
    attrs = {"oracle": float(oracle_acceptance)} if oracle_acceptance is not None else {}
    cls = type("AblationDecoder", (*mixins, DraftMTPDecoder), attrs) if mixins else DraftMTPDecoder
    return cls(model, sampler, params, profiler, scheduler=scheduler)
