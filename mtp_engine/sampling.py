"""Token sampling: greedy, or temperature with top-k / top-p / min-p, as one distribution.

The filters run on the raw logits' softmax and the temperature after them, as in llama.cpp's
default chain (top-k, top-p, min-p, temperature). Speculative sampling builds both the target's
and the draft's distributions with the same `distribution`, which is what makes it lossless.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .errors import MTPEngineError


@dataclass(frozen=True)
class SamplerConfig:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1 and min_p 0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None or -1: a fresh random seed (llama.cpp's -s -1)

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise MTPEngineError(f"expected a finite number >= 0, found {t!r}", field="temperature")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise MTPEngineError(f"expected an integer >= 0 (0 disables), found {self.top_k!r}", field="top_k")
        p = self.top_p
        if not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            raise MTPEngineError(f"expected a number in (0, 1], found {p!r}", field="top_p")
        m = self.min_p
        if not isinstance(m, (int, float)) or not math.isfinite(m) or not 0 <= m < 1:
            raise MTPEngineError(f"expected a number in [0, 1), found {m!r}", field="min_p")
        sd = self.seed
        if sd is not None and (not isinstance(sd, int) or isinstance(sd, bool) or not -1 <= sd < 2**63):
            raise MTPEngineError(f"expected an integer in 0..2^63-1, or -1 / None for a random seed, found {sd!r}",
                                 field="seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def distribution(logits: mx.array, cfg: SamplerConfig) -> mx.array:
    """Sampling probabilities [..., V] for logits [..., V] under `cfg` (temperature > 0)."""
    logits = logits.astype(mx.float32)
    neg = mx.array(-math.inf, mx.float32)
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = mx.sort(logits, axis=-1)[..., -cfg.top_k][..., None]
        logits = mx.where(logits < kth, neg, logits)
    if cfg.top_p < 1.0 or cfg.min_p > 0.0:
        probs = mx.softmax(logits, axis=-1)
        if cfg.top_p < 1.0:
            # keep the smallest prefix of the sorted distribution whose mass reaches top_p
            sorted_p = -mx.sort(-probs, axis=-1)
            before = mx.cumsum(sorted_p, axis=-1) - sorted_p
            keep = before < cfg.top_p
            cutoff = mx.min(mx.where(keep, sorted_p, mx.array(math.inf)), axis=-1, keepdims=True)
            logits = mx.where(probs < cutoff, neg, logits)
        if cfg.min_p > 0.0:
            logits = mx.where(probs < cfg.min_p * probs.max(axis=-1, keepdims=True), neg, logits)
    return mx.softmax(logits / cfg.temperature, axis=-1)


def check_finite(finite: mx.array) -> None:
    """Refuses to go on from NaN/inf logits: finite but huge weights in a corrupt file overflow,
    and an argmax of NaN would silently produce text."""
    if not bool(finite.item()):
        raise MTPEngineError("the model produced non-finite logits (NaN/inf): its weights are corrupt or out of "
                             "range", field="logits")


class Sampler:
    """Draws tokens for one generation; holds its random generator (seeded for reproducibility)."""

    def __init__(self, cfg: SamplerConfig):
        self.cfg = cfg
        self.rng = np.random.default_rng(None if cfg.seed in (None, -1) else cfg.seed)

    @property
    def argmax_on_device(self) -> bool:
        """Whether the next token is just the logits' argmax, with no host-side state (history,
        random draws): then a decode loop may queue the next step from the token still on the
        device before the host reads it. Anything that adds such state must return False here."""
        return self.cfg.greedy

    def sample(self, logits: mx.array) -> int:
        """One token from logits [V]."""
        finite = mx.all(mx.isfinite(logits))
        if self.cfg.greedy:
            tok = mx.argmax(logits, axis=-1)
            mx.eval(tok, finite)
            check_finite(finite)
            return int(tok.item())
        p = distribution(logits, self.cfg)
        mx.eval(p, finite)
        check_finite(finite)
        return self.categorical(np.array(p, dtype=np.float64))

    def categorical(self, p: np.ndarray) -> int:
        p = np.maximum(p, 0.0)
        c = np.cumsum(p)
        u = self.rng.random() * c[-1]
        return int(min(np.searchsorted(c, u, side="right"), len(p) - 1))

    def uniform(self) -> float:
        return float(self.rng.random())
