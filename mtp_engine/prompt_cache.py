"""Prompt caching: the state after a prompt, kept for the next generation whose prompt starts with it.

A chat's next turn re-sends the whole conversation; without a cache every turn prefills it all
again. Here a generation keeps the trunk's state after its prompt's first n-1 tokens (and the
drafter's, for draft-mtp), and the next generation whose prompt starts with those tokens prefills
only the rest. Why n-1 and not n: the last prompt token is what the first round reads (the
speculative decoder never prefills it; the plain one runs it as its own step when caching), and a
chat template's next render usually agrees with the last one up to that token but not after it
(the generation prompt "<|im_start|>assistant\\n" is followed by the answer's own tokens).

Only an exact token prefix of the kept state can be reused: a gated-delta-net layer's state cannot
be rewound to an earlier position, so a prompt that diverges before the kept length prefills in
full (and becomes the new kept state). Attention caches are kept by reference (their positions up
to the kept length are never written again), recurrent states are MLX values, so keeping a state
costs no copy; it holds the cache's memory until the next generation replaces it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .model.cache import TrunkCache


@dataclass
class _Kept:
    model: Any
    tokens: list[int]
    trunk: TrunkCache
    snapshot: list
    drafter: str | None  # the drafter whose state is kept (None: a plain generation kept it)
    drafter_state: Any


class PromptCache:
    """Give the same `PromptCache` to successive `generate` / `stream_generate` calls on one model
    (one at a time: it is not shared between concurrent generations). Each call reuses the state
    of the previous prompt where the new prompt starts with it, and keeps its own for the next."""

    def __init__(self) -> None:
        self._kept: _Kept | None = None
        self.hits = 0  # generations that reused a kept state
        self.reused_tokens = 0  # prompt tokens they did not prefill

    def match(self, model: Any, prefix: list[int], drafter: str | None) -> int:
        """How many tokens of `prefix` (a prompt without its last token) the kept state covers for
        this model and drafter: its whole length when `prefix` starts with its tokens, else 0."""
        k = self._kept
        if k is None or k.model is not model or (drafter is not None and k.drafter != drafter):
            return 0
        n = len(k.tokens)
        return n if 0 < n <= len(prefix) and prefix[:n] == k.tokens else 0

    def take(self) -> _Kept:
        """The kept state, handed to the generation that reuses it (and no longer kept here)."""
        kept, self._kept = self._kept, None
        self.hits += 1
        self.reused_tokens += len(kept.tokens)
        return kept

    def keep(self, model: Any, tokens: list[int], trunk: TrunkCache, drafter: str | None = None,
             drafter_state: Any = None) -> None:
        """The state after `tokens` (the trunk's cache as it is now; the drafter's, if any)."""
        self._kept = _Kept(model, list(tokens), trunk, trunk.snapshot(), drafter, drafter_state)

    def clear(self) -> None:
        """Drops the kept state (and the memory it holds)."""
        self._kept = None

    @property
    def tokens(self) -> int:
        """Length of the kept state in tokens (0: nothing kept)."""
        return len(self._kept.tokens) if self._kept else 0
