"""Reading a prompt into a sequence's caches, the one way every decoding path reads it.

A sequence alone reads its prompt all at once (`decode.PlainDecoder.prefill`); a batch reads a
joining sequence's prompt a chunk at a time between its steps (`batching.scheduler`). Both go
through `PromptReader`, so a prompt gives the same caches and the same first token either way:
  take    a prompt cache's kept state for the prompt but its last token, if one matches;
  chunks  the rest through the trunk in chunks of the model's `prefill_chunk` tokens (fewer deep
          in a long prompt: `model.memory.prefill_chunk_at` bounds a chunk's attention scores),
          each told to a drafter that reads the trunk's states (an MTP head), `progress` after each;
  keep    with a prompt cache, the state before the prompt's last token is kept for the next
          prompt that starts with it (the last token is then a chunk of its own).
A drafting run leaves the last token to its first round (`end`).
"""
from __future__ import annotations

from typing import Callable, Protocol

import mlx.core as mx

from ..model.cache import TrunkCache
from ..model.memory import prefill_chunk_at
from ..model.qwen35 import Qwen35Model
from ..model.step import Pass
from .prompt_cache import PromptCache

Progress = Callable[[int, int], None]  # (prompt tokens read, of total)


class PromptDrafter(Protocol):
    """What a prompt's reader asks of a drafter that reads the prompt beside the trunk (the methods
    of `speculative.drafter.Drafter` of these names: an MTP head reads the trunk's states)."""

    name: str

    def start(self, prompt: list[int], start: int, state: object) -> None: ...

    def read(self, ids: list[int], hidden: mx.array) -> None: ...

    def prefix_state(self) -> object: ...

    def prompt_arrays(self) -> list[mx.array]: ...


def post_only(post: mx.array, pre: mx.array) -> mx.array:
    """The trunk state a drafter reads: the post-norm hidden state (an ablation feeds another)."""
    return post


class PromptReader:
    """One prompt read into a sequence's trunk cache (`trunk`) and its drafter's, a chunk at a time
    (module docstring). `last` is the last row read's post-norm hidden state [1, 1, H]."""

    def __init__(self, model: Qwen35Model, ids: list[int], *, end: int | None = None,
                 prompt_cache: PromptCache | None = None, drafter: PromptDrafter | None = None,
                 fed: Callable[[mx.array, mx.array], mx.array] = post_only, progress: Progress | None = None,
                 chunk: int | None = None):
        """`end`: the tokens to read (None: all; a drafting run's, all but the last); `fed(post,
        pre)`: what of the trunk's states `drafter` reads; `chunk`: tokens per forward (None: the
        model's options')."""
        self.model, self.ids, self.drafter, self.fed, self.progress = model, list(ids), drafter, fed, progress
        self.end = len(self.ids) if end is None else end
        self.chunk = chunk or model.options.prefill_chunk
        self.prompt_cache = prompt_cache
        name = drafter.name if drafter is not None else None
        kept = prompt_cache.take(model, self.ids[:-1], name) if prompt_cache is not None else None
        self.trunk = model.make_cache() if kept is None else kept.trunk
        if kept is not None:
            self.trunk.restore(kept.snapshot)
        self.cached = self.done_tokens = len(kept.tokens) if kept is not None else 0
        if drafter is not None:
            drafter.start(self.ids, self.cached, kept.drafter_state if kept is not None else None)
        self.last: mx.array | None = None
        self._keep_at = len(self.ids) - 1 if prompt_cache is not None and self.ids else None
        self.report()

    @property
    def done(self) -> bool:
        """Whether every token to read is read (and a prompt cache's state kept)."""
        return self.done_tokens >= self.end and self._keep_at is None

    def report(self, whole: bool = False) -> None:
        """Tells `progress` the prompt tokens read so far (all of them once `whole`)."""
        if self.progress is not None:
            n = len(self.ids)
            self.progress(n if whole else min(self.done_tokens, n), n)

    @property
    def remaining(self) -> int:
        """Tokens still to read."""
        return max(0, self.end - self.done_tokens)

    def next_ids(self) -> list[int]:
        """The tokens the next `read_chunk` reads (up to a prompt cache's keep point; none once done)."""
        stop = self.end if self._keep_at is None else min(self.end, self._keep_at)
        return self.ids[self.done_tokens:min(self.done_tokens + prefill_chunk_at(self.chunk, self.done_tokens), stop)]

    def read_chunk(self, wait: bool = True) -> int:
        """Reads the next chunk (keeping a prompt cache's state where it is due); returns its tokens.
        `wait=False` leaves the chunk running on the device (its arrays queued, not read): a batch
        queues the short last chunks of several joining prompts back to back, each one's first
        token read once the next one's forward is queued."""
        ids = self.next_ids()
        if ids:
            post, pre = self.model.forward_states(mx.array([ids]), self.trunk, Pass.PREFILL)
            self.last = post[:, -1:]
            out = [self.last]
            if self.drafter is not None:
                self.drafter.read(ids, self.fed(post, pre))
                out += self.drafter.prompt_arrays()
            (mx.eval if wait else mx.async_eval)(*out, *self.trunk.arrays())
        self._read(len(ids))
        return len(ids)

    def took(self, trunk: TrunkCache, last: mx.array) -> None:
        """`next_ids()` were read elsewhere, in one forward beside other prompts (a batch's joint
        read; no drafter), into `trunk`, this prompt's caches from now on; `last` [1, 1, H] the
        last one's post-norm state."""
        self.trunk, self.last = trunk, last
        self._read(len(self.next_ids()))

    def _read(self, n: int) -> None:
        """n more tokens are read: progress, and a prompt cache's state kept where it is due."""
        self.done_tokens += n
        if n:
            self.report()
        if self.done_tokens == self._keep_at:
            state = self.drafter.prefix_state() if self.drafter is not None else None
            self.prompt_cache.keep(self.model, self.ids[:-1], self.trunk, self.drafter.name if self.drafter else None,
                                   state)
            self._keep_at = None

    def read_all(self) -> "PromptReader":
        """Reads the whole prompt (a sequence alone)."""
        while not self.done:
            self.read_chunk()
        return self
