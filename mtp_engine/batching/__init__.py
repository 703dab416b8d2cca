"""Continuous batching: many sequences in one forward per step (`scheduler`), each read through
the ordinary generation loop (`slot`). `stream_batched` runs one prepared request in a scheduler."""
from __future__ import annotations

from typing import Iterator

from ..errors import MTPEngineError
from ..generation.loop import Chunk, run
from ..generation.profiler import Profiler
from ..model.loaded import Model
from ..request.prepare import Prepared, make_sampler
from .mtp import MTPBatchScheduler
from .scheduler import BatchScheduler, SchedulerStopped
from .sequence import Sequence
from .slot import SlotDecoder

__all__ = ["BatchScheduler", "MTPBatchScheduler", "SchedulerStopped", "Sequence", "SlotDecoder", "batch_scheduler",
           "batchable", "stream_batched"]


def batch_scheduler(model: Model, max_batch: int, draft_mtp: bool = True,
                    own_thread: bool = True) -> BatchScheduler:
    """The scheduler for `model`: MTP batches (draft-mtp sequences draft) when the model has an MTP
    head and `draft_mtp`, else plain ones."""
    if draft_mtp and model.model.mtp is not None:
        return MTPBatchScheduler(model, max_batch, own_thread)
    return BatchScheduler(model, max_batch, own_thread)


def _refusal(request, scheduler: BatchScheduler) -> MTPEngineError | None:
    """Why `request` cannot decode in `scheduler`'s batches (None: it can): plain decoding batches
    anywhere, draft-mtp in an MTP batch, nothing profiled."""
    if request.profile not in (None, "off"):
        return MTPEngineError("profiling needs the sequence alone (a batch's steps are shared)", field="profile")
    spec = request.spec.method
    if spec == "none" or spec == "draft-mtp" and isinstance(scheduler, MTPBatchScheduler):
        return None
    return MTPEngineError(f"{spec} does not batch here: a model with an MTP head batches draft-mtp; ngram runs "
                          "alone", field="spec")


def batchable(request, scheduler: BatchScheduler) -> bool:
    """Whether a request decodes in `scheduler`'s batches (others run alone)."""
    return _refusal(request, scheduler) is None


def stream_batched(scheduler: BatchScheduler, prepared: Prepared, model: Model) -> Iterator[Chunk]:
    """The chunks of one prepared request decoded in `scheduler`'s batches; closing the stream
    early frees its slot at the scheduler's next step."""
    req = prepared.request
    refusal = _refusal(req, scheduler)
    if refusal is not None:
        raise refusal
    if model.comm is not None:
        raise MTPEngineError("not supported with a distributed model", field="parallel")
    prof = Profiler("off")
    seq = Sequence(prepared.prompt_ids, make_sampler(model, prepared), prepared.max_tokens, req.prompt_cache,
                   draft=req.spec.method == "draft-mtp", n_max=req.spec.n_max, p_min=req.spec.p_min,
                   n_min=req.spec.n_min, progress=req.progress)
    decoder = SlotDecoder(scheduler, seq, model.model, prof)
    try:
        yield from run(decoder, model.tokenizer, prepared.prompt_ids, prepared.max_tokens, stop=req.stop,
                       ignore_eos=req.ignore_eos, profiler=prof)
    finally:
        seq.cancel()
