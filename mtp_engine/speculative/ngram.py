"""Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of the
last few tokens are proposed as drafts (Saxena's prompt-lookup decoding, llama.cpp's
`--spec-type ngram`-style drafters). No model, no cache: it only needs the token history, so it
is the smallest drafter the interface admits, and it pays on text that repeats its prompt
(editing code, quoting, extraction).

    from mtp_engine.speculative.ngram import NGramDecoder
    dec = NGramDecoder(model, sampler, DraftParams(4))

Its rounds are the device round (`decoder.SpeculativeDecoder`, `round.draft_round`) with drafts
looked up on the host: a round is launched after the host read the one before it, whose tokens its
lookup needs.
"""
from __future__ import annotations

import mlx.core as mx

from ..errors import MTPEngineError
from ..generation.profiler import Profiler
from ..generation.sampling import Sampler
from ..model.qwen35 import Qwen35Model
from .config import DraftParams
from .decoder import SpeculativeDecoder
from .drafter import DraftContext, Drafter


class NGramDrafter(Drafter):
    """Drafts by matching the last `max_ngram`..`min_ngram` tokens against the history."""

    name = "ngram"

    def __init__(self, ctx: DraftContext, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(ctx)
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise MTPEngineError(f"expected 1 <= min_ngram <= max_ngram, found {min_ngram}, {max_ngram}",
                                 field="ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[int] = []
        # per n: n-gram -> latest start whose next token is known (a round's lookup is then
        # O(max_ngram), not a scan of the whole history: 32k tokens of context would cost ms)
        self._latest: dict[int, dict[tuple, int]] = {}
        self.lookups = 0
        self.hits = 0
        self._next: list[int] = []  # the device round's lookup (`available`), drafted by `draft`

    def start(self, prompt: list[int], start: int, state: object) -> None:
        self.history, self._latest = [], {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        self._extend(prompt)

    def _extend(self, tokens: list[int]) -> None:
        h = self.history
        for t in tokens:
            h.append(t)
            end = len(h) - 1  # the n-gram ending just before the new token now has a follower
            for n, table in self._latest.items():
                if end >= n:
                    table[tuple(h[end - n:end])] = end - n

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix of the history (longest n-gram first)."""
        h = self.history
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            start = self._latest[n].get(tuple(h[-n:]))
            if start is not None:
                return h[start + n:start + n + k]
        return []

    def _proposal(self, k: int) -> list[int]:
        """A round's lookup of up to k tokens, counted in the statistics."""
        self.lookups += 1
        tokens = self.lookup(k)
        self.hits += bool(tokens)
        return tokens

    def _one_hot(self, drafts: mx.array) -> mx.array | None:
        """The drafts' distributions [..., V] when sampling (a deterministic proposal: one-hot rows),
        None when greedy."""
        if self.ctx.sampler.cfg.greedy:
            return None
        return (mx.arange(self.ctx.model.cfg.vocab_size) == drafts[..., None]).astype(mx.float32)

    def stats(self) -> dict:
        return {"ngram_lookups": self.lookups, "ngram_hits": self.hits}

    # ---- the device round's stages (speculative/round.py): drafts from the host's history -----------
    reads_history = True  # a round's lookup needs the tokens of the round before it, read on the host

    def available(self, k: int) -> int:
        """How many of k drafts the next round gets (the round's lookup, kept for `draft`)."""
        self._next = self._proposal(k)
        return len(self._next)

    def draft(self, k: int, p_min: float = 0.0) -> tuple[mx.array, mx.array | None, None]:
        """The k drafts `available(k)` found, as a round's one row [1, k] (their one-hot
        distributions [1, k, V] when sampling); `p_min` does not apply."""
        drafts = mx.array([self._next[:k]], dtype=mx.int32)
        return drafts, self._one_hot(drafts), None

    def round_read(self, tokens: list[int]) -> None:
        self._extend(tokens)

    def commit(self, emitted: mx.array, n: mx.array, hidden: mx.array) -> None:
        """Nothing: the host's read extends the history (`round_read`)."""

    def accept_plain(self, token: mx.array, hidden: mx.array) -> None:
        """Nothing: the host's read extends the history (`round_read`)."""


class NGramDecoder(SpeculativeDecoder):
    """Speculative decoding with prompt-lookup drafts (module docstring); a round drafts what the
    lookup has, at most k (none: a plain round)."""

    def __init__(self, model: Qwen35Model, sampler: Sampler, params: DraftParams,
                 profiler: Profiler | None = None, **options):
        """`options`: `SpeculativeDecoder`'s keywords (scheduler, prompt_cache, calibration_path,
        progress, pipeline, trace)."""
        super().__init__(model, sampler, params, NGramDrafter, profiler, **options)
