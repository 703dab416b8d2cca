"""Continuous batching: many sequences in one forward per step (`scheduler`), each read through
the ordinary generation loop (`slot`). `stream_batched` runs one prepared request in a scheduler."""
from __future__ import annotations

from typing import Iterator

from ..errors import MTPEngineError
from ..generation.loop import Chunk, run
from ..generation.profiler import Profiler
from ..model.loaded import Model
from ..request.prepare import Prepared, make_sampler
from .scheduler import BatchScheduler, SchedulerStopped, Sequence
from .slot import SlotDecoder

__all__ = ["BatchScheduler", "SchedulerStopped", "Sequence", "SlotDecoder", "batchable", "stream_batched"]


def batchable(request) -> bool:
    """Whether a request can decode in a batch today: plain decoding, no prompt cache, no profile
    (others run alone)."""
    return request.spec.method == "none" and request.prompt_cache is None and request.profile in (None, "off")


def stream_batched(scheduler: BatchScheduler, prepared: Prepared, model: Model) -> Iterator[Chunk]:
    """The chunks of one prepared request decoded in `scheduler`'s batches; closing the stream
    early frees its slot at the scheduler's next step."""
    req = prepared.request
    if req.spec.method != "none":
        raise MTPEngineError(f"{req.spec.method} is not available in a batch yet: batched sequences decode "
                             "plainly (spec 'none')", field="spec")
    if req.prompt_cache is not None:
        raise MTPEngineError("a batched sequence keeps no prompt cache yet", field="prompt_cache")
    if model.comm is not None:
        raise MTPEngineError("not supported with a distributed model", field="parallel")
    prof = Profiler(req.profile or "off")
    if prof.enabled:
        raise MTPEngineError("profiling needs the sequence alone (a batch's steps are shared)", field="profile")
    seq = Sequence(prepared.prompt_ids, make_sampler(model, prepared), prepared.max_tokens)
    decoder = SlotDecoder(scheduler, seq, model.model, prof)
    try:
        for chunk in run(decoder, model.tokenizer, prepared.prompt_ids, prepared.max_tokens, stop=req.stop,
                         ignore_eos=req.ignore_eos, profiler=prof):
            if chunk.finish_reason is not None:
                chunk.stats["load_seconds"] = model.load_seconds
            yield chunk
    finally:
        seq.cancel()
