"""A loaded model as generation uses it: the network, its tokenizer and what the load did."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, TypeVar

from ..options import EngineOptions
from ..tokenizer.tokenizer import Tokenizer
from .loader import LoadInfo
from .qwen35 import Qwen35Model


T = TypeVar("T")


class RankGroup(Protocol):
    """What generation asks of the processes that hold one model's shares (`distributed.Comm`)."""

    mode: str
    rank: int
    size: int

    def broadcast_int(self, value: int, root: int = 0) -> int: ...

    def guard(self, chunks: Iterator[T], what: str = "generation") -> Iterator[T]: ...


class Batcher(Protocol):
    """What requests ask of the batch that runs them (`batching.BatchScheduler`)."""

    def submit(self, seq) -> None: ...

    def stop(self) -> None: ...

    def slots(self) -> list[dict]: ...


@dataclass
class Model:
    """A loaded model: the network, its tokenizer and what the load did."""

    model: Qwen35Model
    tokenizer: Tokenizer
    info: LoadInfo
    path: str
    load_seconds: float = 0.0  # wall time of `load` (reported in every generation's stats)
    comm: RankGroup | None = None  # when this process holds one rank's share
    scheduler: Batcher | None = None  # when requests share batched steps (`load(parallel=N)`)

    @property
    def options(self) -> EngineOptions:
        """The options this model runs under (resolved: no None fields)."""
        return self.model.options
