"""Benchmark variants of batched draft-mtp, kept out of the production scheduler (as
`speculative.ablations` is for a sequence alone).

`OracleBatchScheduler`: each draft counts as right with probability `oracle`, whatever the head
proposed (random weights make every draft wrong, so the cost of batched MTP rounds at a chosen
acceptance is measured this way: `scripts/bench/bench_batch.py --oracle A`). The rounds run as usual:
accepted drafts are kept, rolled back past, caught up by the head; only the decision is drawn.
Output is then not the model's: benchmark-only.
"""
from __future__ import annotations

import mlx.core as mx

from ..errors import MTPEngineError
from ..model.loaded import Model
from ..speculative.ablations import accept_oracle_device
from .mtp import MTPBatchScheduler


class OracleBatchScheduler(MTPBatchScheduler):
    """`MTPBatchScheduler` whose drafts are accepted with probability `oracle` each."""

    def __init__(self, model: Model, max_batch: int = 8, oracle: float = 0.8, seed: int = 0,
                 own_thread: bool = True, profile: str = "off"):
        if not 0.0 <= oracle <= 1.0:
            raise MTPEngineError(f"expected an acceptance in [0, 1], found {oracle}", field="oracle")
        super().__init__(model, max_batch, own_thread, profile=profile)
        self.oracle = oracle
        self._key = mx.random.key(seed)

    def _accept(self, rule, drafts, scored, q, live):
        # every row, sampling ones too (their distributions are still computed: the round's cost)
        self._key, sub = mx.random.split(self._key)
        return accept_oracle_device(drafts, scored, live, self.oracle, sub)
