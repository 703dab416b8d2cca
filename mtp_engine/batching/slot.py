"""The decoder a batched sequence's generation loop drives: `prefill` and `step` hand the
sequence to the scheduler and return the tokens its thread produced for it, so the generation
loop (EOS, stop strings, max_tokens, detokenizing, statistics) is the one every sequence has."""
from __future__ import annotations

from ..generation.profiler import Profiler
from ..model.qwen35 import Qwen35Model
from .scheduler import BatchScheduler
from .sequence import Sequence


class SlotDecoder:
    """The generation loop's `Decoder` over a `Sequence` in a `BatchScheduler`."""

    prompt_cache = None  # the sequence's own prefill reuses and keeps prompt state (scheduler)
    cache = None
    cached_tokens = 0

    def __init__(self, scheduler: BatchScheduler, seq: Sequence, model: Qwen35Model, profiler: Profiler):
        self.scheduler, self.seq, self.model, self.prof = scheduler, seq, model, profiler
        self.round_drafted: list[bool] = []
        self.round_logprobs: list[dict] | None = None
        self.round_n_drafted = 0

    def prefill(self, ids: list[int], budget: int | None = None) -> list[int]:
        """Hands the sequence to the scheduler (its own max_tokens is its budget: its thread runs
        ahead of this reader by itself); returns its first tokens."""
        self.scheduler.submit(self.seq)
        first = self._next()
        self.cached_tokens = self.seq.cached
        return first

    def step(self) -> list[int]:
        return self._next()

    def _next(self) -> list[int]:
        item = self.seq.out.get()
        if isinstance(item, BaseException):
            raise item
        if item is None:  # the scheduler ended it (cannot happen before max_tokens: the loop stops first)
            raise RuntimeError("the batch scheduler ended a sequence its reader still reads")
        tokens, logprobs, n_accepted, n_drafted = item
        self.round_drafted = [True] * n_accepted + [False] * (len(tokens) - n_accepted)
        self.round_logprobs = logprobs
        self.round_n_drafted = n_drafted
        return tokens

    def finish(self) -> None:
        self.seq.cancel()

    def stats(self) -> dict:
        s = self.seq
        sizes = s.batch_sizes
        out = {"compile_seconds": 0.0,
               "batch_queue_seconds": (s.joined - s.submitted) if s.joined is not None else 0.0,
               "batch_size_mean": sum(sizes) / len(sizes) if sizes else 1.0,
               "batch_size_max": max(sizes) if sizes else 1}
        if s.counts.rounds:  # a draft-mtp sequence in an MTP batch: a speculative decoder's statistics
            out.update(s.counts.stats())
        return out
