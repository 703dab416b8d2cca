"""draft-mtp: the speculative decoder with the model's own MTP head as its drafter.

The round (draft → verify → accept → commit) is `SpeculativeDecoder`'s (speculative/decoder.py,
speculative/round.py); the drafting, the head's cache and the rows it is owed are `MTPDrafter`'s
(speculative/mtp_drafter.py). Experiment variants (re-decode rollback, pre-norm
feed, oracle acceptance) are in speculative/ablations.py.
"""
from __future__ import annotations

from ..generation.decode import Progress
from ..generation.profiler import Profiler
from ..generation.prompt_cache import PromptCache
from ..generation.sampling import Sampler
from ..model.qwen35 import Qwen35Model
from .config import DraftParams
from .decoder import SpeculativeDecoder
from .mtp_drafter import MTPDrafter
from .scheduler import DraftLengthScheduler

__all__ = ["DraftMTPDecoder", "DraftParams"]


class DraftMTPDecoder(SpeculativeDecoder):
    """Speculative decoding with the model's MTP head as the drafter."""

    def __init__(self, model: Qwen35Model, sampler: Sampler, params: DraftParams,
                 profiler: Profiler | None = None, *, scheduler: DraftLengthScheduler | None = None,
                 prompt_cache: PromptCache | None = None, calibration_path: str = "",
                 progress: Progress | None = None, pipeline: bool = True, trace: list[dict] | None = None):
        super().__init__(model, sampler, params, MTPDrafter, profiler, scheduler, prompt_cache=prompt_cache,
                         calibration_path=calibration_path, progress=progress, pipeline=pipeline, trace=trace)

    # the head's state, where tests and notebooks look for it
    @property
    def mtp_cache(self):
        return self.drafter.cache

    @property
    def catch_up_window(self) -> int:
        return self.drafter.catch_up_window

    @property
    def catch_up_dropped(self) -> int:
        return self.drafter.catch_up_dropped
