"""Which experts each MoE block chose in its last forward: an observer the blocks report to.

The model holds one `ExpertUse` (built with it, `Qwen35Model.expert_use`; None for a dense model)
and every MoE block holds the same object and its own slot. The block records its routing as a
lazy array (no host sync inside a forward); a compiled step returns the routing as extra graph
outputs and hands them back here (`graph_outputs`). Readers (the profiler's expert counts,
`moe.experts_touched`) evaluate after the forward.
"""
from __future__ import annotations

from typing import Callable, Hashable

import mlx.core as mx
import numpy as np

Slot = Hashable  # ("trunk", layer index) or ("mtp", 0)


class ExpertUse:
    """The experts chosen by each registered MoE block in its last forward."""

    def __init__(self) -> None:
        self._slots: list[Slot] = []
        self._chosen: dict[Slot, mx.array] = {}

    def register(self, slot: Slot) -> Slot:
        """A block that will report under `slot` (registration order is the report order)."""
        if slot not in self._slots:
            self._slots.append(slot)
        return slot

    def slots(self, kind: str) -> list[Slot]:
        """Registered slots of one kind ("trunk" or "mtp"), in order."""
        return [s for s in self._slots if s[0] == kind]

    def record(self, slot: Slot, indices: mx.array) -> None:
        """A block's routing, experts [..., k], from the forward that just ran (kept lazily)."""
        self._chosen[slot] = indices

    def distinct(self, slot: Slot) -> int:
        """How many different experts the block's last forward read: n_used for one token, up to
        n_expert for a batch (each is read once however many rows pick it); 0 before any forward.
        Evaluates the routing, so call it after the forward, not inside a timed stage."""
        chosen = self._chosen.get(slot)
        return 0 if chosen is None else int(np.unique(np.array(chosen)).size)

    def graph_outputs(self, slots: list[Slot]) -> tuple[Callable[[], list] | None, Callable[[list], None] | None]:
        """(side, set_side) for `model.step.run`: inside a trace, the blocks' routing becomes
        extra outputs of the graph; after the run the real arrays are recorded here."""
        if not slots:
            return None, None

        def side() -> list[mx.array]:
            return [self._chosen[s] for s in slots]

        def set_side(values: list[mx.array]) -> None:
            for s, v in zip(slots, values):
                self._chosen[s] = v

        return side, set_side
