"""The drafter interface: what the speculative decoder asks of whatever proposes draft tokens.

In the spirit of llama.cpp's `common_speculative` (begin / draft / accept): the decoder owns the
trunk (verify, acceptance, trunk rollback, scheduling, statistics); a drafter owns only its own
state (an MTP head's KV cache and the rows it is owed, an n-gram table, ...). A round
(`round.draft_round`) is device values end to end, so the drafter's stages are too:

    tokens, q, confident = drafter.draft(k, p_min)   k drafts after the last emitted token
    ... the decoder verifies them in one trunk forward and accepts n of them ...
    drafter.commit(emitted, n, hidden)               the round emitted emitted[:n+1]
    drafter.accept_plain(token, hidden)              a round without drafts emitted `token`

`hidden` is the trunk's hidden state for the rows the round ran, which an MTP head reads and
others ignore. The host reads a round one round late and tells the drafter (`round_read`,
`trunk_committed`); a drafter whose drafts need those tokens (`reads_history`) makes the decoder
launch each round after that read.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
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


class Drafter(ABC):
    """Proposes draft tokens; see the module docstring for the protocol."""

    name = "drafter"

    def __init__(self, ctx: DraftContext):
        """`ctx`: what it may use of the decoder that builds it (`SpeculativeDecoder` calls a
        drafter class, or any `DrafterFactory`, with its own context)."""
        self.ctx = ctx

    # ---- the prompt, read beside the trunk (`generation.prompt_read.PromptDrafter`) ----------------
    @abstractmethod
    def start(self, prompt: list[int], start: int, state: object) -> None:
        """A generation of `prompt` begins; its first `start` tokens come from a prompt cache with
        this drafter's `state` (what `prefix_state()` gave after an earlier prompt; None and 0:
        nothing kept). The trunk then reads `prompt[start:-1]` (`read`); the first round drafts
        after `prompt[-1]`."""

    def read(self, ids: list[int], hidden: mx.array) -> None:
        """The trunk read the prompt's next tokens `ids` (`hidden`: its hidden states [1, len, H]).
        The default suits a drafter that reads only tokens."""

    def prefix_state(self) -> object:
        """After the prompt but its last token: what a later prompt that starts with it can start
        from (`start`); its `nbytes()`, if it has one, counts the memory it holds (a prompt
        cache's bound). The default suits a drafter that reads only tokens."""
        return None

    def prompt_arrays(self) -> list[mx.array]:
        """What reading a chunk of the prompt left for the drafter (evaluated with the chunk)."""
        return []

    reads_history = False  # whether a round's drafts need the round before it read on the host

    def to_device(self) -> None:
        """After the prompt: rounds follow, as device values."""

    def available(self, k: int) -> int:
        """How many of k drafts the next round gets (a drafter that may have fewer: the round is
        shaped by this; 0 makes it a plain round)."""
        return k

    @abstractmethod
    def draft(self, k: int, p_min: float = 0.0) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """k drafts as device values: (tokens [1, k] int32, their distributions [1, k, V] when
        sampling (lossless acceptance needs them; a deterministic drafter gives one-hot rows),
        whether each counts [1, k] (p-min, a grammar's end; None: all))."""

    @abstractmethod
    def commit(self, emitted: mx.array, n: mx.array, hidden: mx.array) -> None:
        """A drafting round emitted `emitted[0, :n+1]` (accepted drafts, then the trunk's token;
        `n` a device count), from the verify's hidden states `hidden`."""

    @abstractmethod
    def accept_plain(self, token: mx.array, hidden: mx.array) -> None:
        """A round without drafts emitted `token` (device [1]) from trunk state `hidden`."""

    def pending_arrays(self) -> list[mx.array]:
        """What a queued round leaves for the drafter that must be evaluated with it."""
        return []

    def round_shapes(self, k: int) -> list:
        """The drafter's forward shapes in a round of k drafts (a first use compiles)."""
        return []

    def round_read(self, tokens: list[int]) -> None:
        """The host read a round that emitted `tokens`."""

    def trunk_committed(self, rows: int) -> None:
        """The trunk holds `rows` committed tokens (the host's count, a round late)."""

    def stats(self) -> dict:
        """The drafter's own statistics, merged into the generation's."""
        return {}


# what `SpeculativeDecoder` builds its drafter with: a drafter class, or a function of the context
DrafterFactory = Callable[[DraftContext], Drafter]
