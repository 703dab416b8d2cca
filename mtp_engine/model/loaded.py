"""A loaded model as generation uses it: the network, its tokenizer and what the load did."""
from __future__ import annotations

from dataclasses import dataclass

from ..options import EngineOptions
from ..tokenizer.tokenizer import Tokenizer
from .loader import LoadInfo
from .qwen35 import Qwen35Model


@dataclass
class Model:
    """A loaded model: the network, its tokenizer and what the load did."""

    model: Qwen35Model
    tokenizer: Tokenizer
    info: LoadInfo
    path: str
    load_seconds: float = 0.0  # wall time of `load` (reported in every generation's stats)
    comm: object = None  # a `distributed.Comm` when this process holds one rank's share
    scheduler: object = None  # a `batching.BatchScheduler` when plain requests share batched steps

    @property
    def options(self) -> EngineOptions:
        """The options this model runs under (resolved: no None fields)."""
        return self.model.options
