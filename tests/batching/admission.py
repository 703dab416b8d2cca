"""A test's control over when a batch admits its waiting sequences: readers submit from threads,
in any order and at any time, so a test that counts on one pass seeing several prompts (a joint
read, the order of reads) holds the scheduler until they all wait."""
from __future__ import annotations

from typing import Callable

from mtp_engine.batching.scheduler import BatchScheduler


def admit_together(monkeypatch, n: int, order: Callable | None = None) -> None:
    """The scheduler admits no one until `n` sequences wait; then it admits as usual (a model cached
    with fewer slots than n leaves some waiting after the first pass). `order(sequence)`: a sort key
    for the first pass's waiting sequences (None: their arrival order)."""
    admit = BatchScheduler._admit_and_prefill
    opened = []

    def gated(self):
        if opened or len(self._waiting) >= n:
            if not opened and order is not None:
                with self._cv:
                    self._waiting = type(self._waiting)(sorted(self._waiting, key=order))
            opened.append(True)
            admit(self)

    monkeypatch.setattr(BatchScheduler, "_admit_and_prefill", gated)
