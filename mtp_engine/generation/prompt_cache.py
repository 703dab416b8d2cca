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

import threading
from dataclasses import dataclass
from typing import Any

from ..errors import MTPEngineError
from ..model.cache import TrunkCache


@dataclass
class _Kept:
    model: Any
    tokens: list[int]
    trunk: TrunkCache
    snapshot: list
    drafter: str | None  # the drafter whose state is kept (None: a plain generation kept it)
    drafter_state: Any
    live: bool = True  # the generation that kept it still writes into its caches

    def fork(self) -> "_Kept | None":
        """This state on caches of its own (sharing buffers until either is written), for another
        generation while the one that kept it goes on; None if it cannot be had now."""
        trunk = self.trunk.fork(self.snapshot)
        if trunk is None:
            return None
        fork_state = getattr(self.drafter_state, "fork", None)  # None: an immutable state
        state = fork_state() if callable(fork_state) else self.drafter_state
        return _Kept(self.model, self.tokens, trunk, trunk.snapshot(), self.drafter, state, live=False)


class PromptCache:
    """Give the same `PromptCache` to successive `generate` / `stream_generate` calls on one model.
    Each call reuses the kept state that its prompt starts with (the longest, if several) and
    keeps its own. Generations in several threads may share one: a state whose generation has
    ended is handed over (and no longer kept here); one whose generation is still running is
    shared copy-on-write (its caches' buffers are copied by the first write of either).

    `slots`: how many prompts' states are kept (several conversations interleaved each find
    theirs); the least recently used goes first, and also while they hold more than `max_bytes`
    (the state just kept is never dropped for it)."""

    def __init__(self, slots: int = 1, max_bytes: int | None = None) -> None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise MTPEngineError(f"expected an integer >= 1, found {slots!r}", field="slots")
        self.slots, self.max_bytes = slots, max_bytes
        self._kept: list[_Kept] = []  # least recently used first
        self._lock = threading.Lock()
        self.hits = 0  # generations that reused a kept state
        self.reused_tokens = 0  # prompt tokens they did not prefill

    def _best(self, model: Any, prefix: list[int], drafter: str | None) -> int | None:
        best, best_len = None, 0
        for i, k in enumerate(self._kept):
            n = len(k.tokens)
            if (k.model is model and (drafter is None or k.drafter == drafter) and best_len < n <= len(prefix)
                    and prefix[:n] == k.tokens):
                best, best_len = i, n
        return best

    def take(self, model: Any, prefix: list[int], drafter: str | None) -> _Kept | None:
        """The longest kept state for this model that `prefix` (a prompt without its last token)
        starts with, and that holds `drafter`'s state when one is named; handed to the generation
        that reuses it (and no longer kept here: that generation changes it), or None."""
        with self._lock:
            i = self._best(model, prefix, drafter)
            if i is None:
                return None
            if self._kept[i].live:  # the generation that kept it still writes into these caches
                kept = self._kept[i].fork()
                if kept is None:
                    return None
            else:
                kept = self._kept.pop(i)
            self.hits += 1
            self.reused_tokens += len(kept.tokens)
            return kept

    def keep(self, model: Any, tokens: list[int], trunk: TrunkCache, drafter: str | None = None,
             drafter_state: Any = None) -> None:
        """The state after `tokens` (the trunk's cache as it is now; the drafter's, if any)."""
        if not tokens:
            return
        with self._lock:
            self._kept.append(_Kept(model, list(tokens), trunk, trunk.snapshot(), drafter, drafter_state))
            while len(self._kept) > self.slots or (self.max_bytes is not None and len(self._kept) > 1
                                                   and self.nbytes() > self.max_bytes):
                self._kept.pop(0)

    def release(self, trunk: TrunkCache) -> None:
        """The generation whose caches are `trunk` has ended: its kept state can be handed over."""
        with self._lock:
            for k in self._kept:
                if k.trunk is trunk:
                    k.live = False

    def clear(self) -> None:
        """Drops the kept states (and the memory they hold)."""
        with self._lock:
            self._kept = []

    def nbytes(self) -> int:
        """Memory the kept states hold (their caches' buffers)."""
        total = 0
        for k in self._kept:
            total += k.trunk.nbytes()
            drafter_bytes = getattr(k.drafter_state, "nbytes", None)  # see Drafter.prefix_state
            total += drafter_bytes() if callable(drafter_bytes) else 0
        return total

    @property
    def tokens(self) -> int:
        """Length of the most recently kept state in tokens (0: nothing kept)."""
        return len(self._kept[-1].tokens) if self._kept else 0
