"""One request in a batch scheduler: its prompt, sampler and budget, and the queue its tokens
reach its reader through; what a round over sequences asks of their samplers (`sampling`,
`logprobs_asked`)."""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from ..generation.prompt_cache import PromptCache
from ..generation.prompt_read import PromptReader
from ..generation.sampling import Sampler
from ..speculative.row_sampling import RowSampling
from ..speculative.stats import RoundCounts


class Sequence:
    """One request in the scheduler: its prompt, sampler and budget, and the queue its tokens
    reach the reader through (items: (tokens, logprobs), an exception, or None for the end)."""

    def __init__(self, prompt_ids: list[int], sampler: Sampler, max_tokens: int,
                 prompt_cache: PromptCache | None = None, draft: bool = False, n_max: int | None = None,
                 p_min: float = 0.0, n_min: int = 0, progress: Callable[[int, int], None] | None = None):
        """`n_max`, `p_min`, `n_min`: its draft knobs (llama.cpp's: a draft counts while the head's
        top-10 softmax reaches p_min, a round with fewer than n_min counting drafts keeps none).
        `progress(done, total)`: the request's (`GenerationRequest.progress`), told how the
        prompt's reading goes as a sequence alone tells it."""
        self.prompt_ids, self.sampler, self.max_tokens = list(prompt_ids), sampler, max_tokens
        self.progress = progress
        self.prompt_cache = prompt_cache  # reused from and kept in as by a plain decoder alone
        self.cached = 0  # prompt tokens its prompt cache supplied
        self.out: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.produced = 0
        self.last_token: int | None = None
        self.submitted = time.perf_counter()
        self.joined: float | None = None  # when its prefill started
        self.batch_sizes: list[int] = []  # the batch each of its decode steps ran in
        # draft-mtp in an MTP batch: its drafts are verified (rows drawn on the device; a row the
        # host samples, under a grammar, keeps none; n-max 0 drafts none, and so does not fix the
        # batch's draft length at 0 for the rows beside it)
        self.draft = draft and sampler.on_device and n_max != 0
        self.n_max = n_max  # None: the batch's draft length
        self.p_min, self.n_min = p_min, n_min
        self.counts = RoundCounts()  # its rounds' statistics
        self.reader: PromptReader | None = None  # while it prefills: its prompt's reader, on its own caches
        self.length = 0  # tokens in its trunk cache rows, as of the last round the host read
        self.chosen: int | None = None  # a host-sampled row's token no round has taken yet

    def cancel(self) -> None:
        """Its reader is done: the row leaves before the next step."""
        self.cancelled.set()

    @property
    def done(self) -> bool:
        return self.cancelled.is_set() or self.produced >= self.max_tokens

    def deliver(self, tokens: list[int], logprobs: list[dict] | None, n_accepted: int = 0,
                n_drafted: int = 0) -> None:
        self.sampler.accept(tokens)
        self.produced += len(tokens)
        self.last_token = tokens[-1]
        self.out.put((tokens, logprobs, n_accepted, n_drafted))

    def fail(self, error: BaseException) -> None:
        self.cancelled.set()
        self.out.put(error)


def sampling(rows: list[Sequence]) -> RowSampling:
    """The rows' sampling rules for a round on the device (a row sampled on the host: greedy there)."""
    return RowSampling([s.sampler.cfg for s in rows],
                       [s.sampler.draws if s.sampler.on_device and not s.sampler.cfg.greedy else None for s in rows],
                       [s.draft for s in rows],
                       [s.sampler.penalize if s.sampler.cfg.penalties.active and s.sampler.on_device else None
                        for s in rows])


def logprobs_asked(rows: list[Sequence]) -> int | None:
    """The most alternatives a row drawn on the device asks its logprobs for (None: none asks):
    the round computes them for every row."""
    asked = [s.sampler.cfg.logprobs for s in rows if s.sampler.on_device and s.sampler.cfg.logprobs is not None]
    return max(asked) if asked else None
