"""Speculative methods by name: what `spec=` (API), `--spec-type` (command line) and `spec_type`
(server) reach. Each builds the decoder of one generation from the model, its sampler, the draft
knobs, a profiler and, for n-max auto, a scheduler; plain decoding ("none") is not speculative and
stays with `generation.decode.PlainDecoder`."""
from __future__ import annotations

from typing import Callable

from ..errors import MTPEngineError
from ..generation.profiler import Profiler
from ..generation.sampling import Sampler
from ..model.qwen35 import Qwen35Model
from .config import SPEC_METHODS, DraftParams
from .decoder import SpeculativeDecoder
from .draft_mtp import DraftMTPDecoder
from .ngram import NGramDrafter
from .scheduler import DraftLengthScheduler

Build = Callable[[Qwen35Model, Sampler, DraftParams, Profiler, DraftLengthScheduler | None], SpeculativeDecoder]


def _draft_mtp(model, sampler, params, prof, scheduler) -> SpeculativeDecoder:
    return DraftMTPDecoder(model, sampler, params, prof, scheduler=scheduler)


def _ngram(model, sampler, params, prof, scheduler) -> SpeculativeDecoder:
    return SpeculativeDecoder(model, sampler, params, NGramDrafter(), prof, scheduler)


DECODERS: dict[str, Build] = {"draft-mtp": _draft_mtp, "ngram": _ngram}
NEEDS_MTP_HEAD = frozenset({"draft-mtp"})
assert set(DECODERS) == set(SPEC_METHODS) - {"none"}


def build_decoder(method: str, model: Qwen35Model, sampler: Sampler, params: DraftParams,
                  profiler: Profiler | None = None,
                  scheduler: DraftLengthScheduler | None = None) -> SpeculativeDecoder:
    """The speculative decoder of `method` (one of `DECODERS`)."""
    if method not in DECODERS:
        raise MTPEngineError(f"unknown spec type {method!r}: expected one of {list(SPEC_METHODS)}", field="spec")
    if method in NEEDS_MTP_HEAD and model.mtp is None:
        raise MTPEngineError(f"{method} needs a model with an MTP head (nextn_predict_layers >= 1); "
                             "this model has none", field="spec")
    return DECODERS[method](model, sampler, params, profiler, scheduler)
