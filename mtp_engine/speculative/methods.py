"""Speculative methods by name: what `spec=` (API), `--spec-type` (command line) and `spec_type`
(server) reach. Each builds the decoder of one generation from the model, its sampler, the draft
knobs, a profiler and, for n-max auto, a scheduler; plain decoding ("none") is not speculative and
stays with `generation.decode.PlainDecoder`."""
from __future__ import annotations

from typing import Callable

from ..errors import MTPEngineError
from ..generation.decode import Progress
from ..generation.profiler import Profiler
from ..generation.prompt_cache import PromptCache
from ..generation.sampling import Sampler
from ..model.qwen35 import Qwen35Model
from .config import SPEC_METHODS, DraftParams
from .decoder import SpeculativeDecoder
from .draft_mtp import DraftMTPDecoder
from .ngram import NGramDecoder
from .scheduler import DraftLengthScheduler

Build = Callable[..., SpeculativeDecoder]


def _draft_mtp(model, sampler, params, prof, scheduler, **state) -> SpeculativeDecoder:
    return DraftMTPDecoder(model, sampler, params, prof, scheduler=scheduler, **state)


def _ngram(model, sampler, params, prof, scheduler, **state) -> SpeculativeDecoder:
    return NGramDecoder(model, sampler, params, prof, scheduler=scheduler, **state)


DECODERS: dict[str, Build] = {"draft-mtp": _draft_mtp, "ngram": _ngram}
NEEDS_MTP_HEAD = frozenset({"draft-mtp"})
assert set(DECODERS) == set(SPEC_METHODS) - {"none"}


def build_decoder(method: str, model: Qwen35Model, sampler: Sampler, params: DraftParams,
                  profiler: Profiler | None = None,
                  scheduler: DraftLengthScheduler | None = None, *, prompt_cache: PromptCache | None = None,
                  calibration_path: str = "", progress: Progress | None = None) -> SpeculativeDecoder:
    """The speculative decoder of `method` (one of `DECODERS`); `prompt_cache` where it reuses and
    keeps prompt state, `calibration_path` the model file whose stored round costs it updates,
    `progress` what is told of a long prefill."""
    if method not in DECODERS:
        raise MTPEngineError(f"unknown spec type {method!r}: expected one of {list(SPEC_METHODS)}", field="spec")
    if method in NEEDS_MTP_HEAD and model.mtp is None:
        raise MTPEngineError(f"{method} needs a model with an MTP head (nextn_predict_layers >= 1); "
                             "this model has none", field="spec")
    return DECODERS[method](model, sampler, params, profiler, scheduler, prompt_cache=prompt_cache,
                            calibration_path=calibration_path, progress=progress)
