"""The drafter interface: what the speculative decoder asks of whatever proposes draft tokens.

In the spirit of llama.cpp's `common_speculative` (begin / draft / accept): the decoder owns the
trunk (verify, acceptance, trunk rollback, scheduling, statistics); a drafter owns only its own
state (an MTP head's KV cache and owed catch-up rows, an n-gram table, ...). One round:

    draft = drafter.draft(k, p_min)        up to k tokens after the last emitted token
    ... the decoder verifies them in one trunk forward and accepts n of them ...
    drafter.rollback(n)                    forget what was derived from drafts n+1..k
    drafter.accept(drafts[:n], token, hidden)   the round emitted drafts[:n] + [token]

A round without drafting (k = 0, a plain step) calls `accept([], token, hidden)` with no `draft`
before it. `hidden` is the trunk's hidden state for the rows the round ran ([1, n+1, H]: row i is
the state after the input before emitted token i), which an MTP head reads and others ignore.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..generation.profiler import Profiler
from ..generation.sampling import Sampler
from ..model.qwen35 import Qwen35Model


@dataclass
class DraftContext:
    """What a drafter may use of the decoder that drives it: the model (its embedding and output
    head), the sampler (configuration, penalties, seeded generator) and the profiler."""

    model: Qwen35Model
    sampler: Sampler
    prof: Profiler


@dataclass
class Draft:
    """A drafter's proposal. `tokens`: a device array [m] (m <= k; a list when empty), so greedy
    drafting needs no host sync; `q`: their distributions [m, V] when sampling (lossless
    speculative sampling needs them; a deterministic drafter gives one-hot rows); `shapes`: the
    forward shapes it ran, for the round clock (a new shape is a compile, not a timed sample)."""

    tokens: mx.array | list = field(default_factory=list)
    q: mx.array | None = None
    shapes: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(ABC):
    """Proposes draft tokens; see the module docstring for the protocol."""

    name = "drafter"

    def __init__(self, ctx: DraftContext):
        """`ctx`: what it may use of the decoder that builds it (`SpeculativeDecoder` calls a
        drafter class, or any `DrafterFactory`, with its own context)."""
        self.ctx = ctx

    @abstractmethod
    def begin(self, prompt: list[int], hidden: mx.array) -> None:
        """The trunk has prefilled `prompt[:-1]` (`hidden`: its hidden states, [1, len-1, H]);
        the first round drafts after `prompt[-1]`."""

    def prefix_state(self) -> object:
        """Right after `begin`: what a later prompt that starts with this one can start from (see
        `begin_from`); its `nbytes()`, if it has one, counts the memory it holds (a prompt cache's
        bound). The default suits a drafter that reads only tokens."""
        return None

    def begin_from(self, prompt: list[int], hidden: mx.array, start: int, state: object) -> None:
        """As `begin`, when the trunk took over the state of `prompt[:start]` from a prompt cache:
        `hidden` holds only rows start..len-2, and `state` is what `prefix_state()` returned after
        the earlier `begin`. The default suits a drafter that reads only tokens."""
        self.begin(prompt, hidden)

    @abstractmethod
    def draft(self, k: int, p_min: float = 0.0) -> Draft:
        """Up to k (>= 1) draft tokens after the last emitted one. A drafter that can score its
        own guesses stops early where the next one's probability falls below `p_min`."""

    def rollback(self, n: int) -> None:
        """Only the first n drafts of the last `draft` were accepted: drop what the others left."""

    @abstractmethod
    def accept(self, accepted: list[int], token: int, hidden: mx.array) -> None:
        """The round emitted `accepted + [token]` (the accepted drafts, then the trunk's token)."""

    def stats(self) -> dict:
        """The drafter's own statistics, merged into the generation's."""
        return {}


# what `SpeculativeDecoder` builds its drafter with: a drafter class, or a function of the context
DrafterFactory = Callable[[DraftContext], Drafter]
