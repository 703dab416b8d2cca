"""Plain autoregressive decoding: chunked prefill, then one trunk step per token.

A decoder turns a prompt into a stream of token lists (one list per round: a plain step emits one
token, a speculative round one or more); the generation loop above handles stopping and text.

Pipelining (`pipeline = True`, set by the generation loop): greedy plain steps queue the next step
on the device (`mx.async_eval`) before the host reads the current token, as mlx-lm's
`generate_step` does, so the device never waits for the host's detokenization and stop checks.
Sampling at temperature > 0 draws on the host and is not pipelined.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx

from ..model.qwen35 import Qwen35Model
from .profiler import Profiler
from .prompt_cache import PromptCache
from .prompt_read import Progress, PromptReader
from .round import Round, plain_round, token_round
from .sampling import Sampler, check_finite



class RoundClock:
    """Wall time between consecutive rounds' host reads (what a round costs the caller, host work
    included), and whether a round first used a shape: a forward of a new row count or cache
    capacity is traced (`mx.compile`) and its kernels JIT-compiled on a GPU, so its time is not a
    sample of the round's cost. The shapes seen are kept on the model, for the whole process."""

    def __init__(self, model: Qwen35Model):
        self.seen: set = model.graphs.seen
        # the MLX CPU backend compiles nothing unless steps are compiled: no first use to exclude
        self.costly = bool(getattr(model, "compile_steps", False)) or mx.default_device() == mx.gpu
        self._t: float | None = None
        self.rounds: list[tuple[int, float, bool]] = []  # (k, seconds, first use)

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, k: int, shapes: list, shift: float = 0.0) -> tuple[float, bool]:
        """This round's seconds since the last lap (plus `shift`, a pipelined round's correction
        for work of another round inside its interval) and whether it first used a shape."""
        now = time.perf_counter()
        seconds = max(now - (self._t if self._t is not None else now) + shift, 0.0)
        self._t = now
        first = self.costly and any(s not in self.seen for s in shapes)
        self.seen.update(shapes)
        self.rounds.append((k, seconds, first))
        return seconds, first

    def compile_seconds(self) -> float:
        """First-use rounds' time beyond the median of the warm rounds of the same k (or of all)."""
        warm: dict[int, list[float]] = {}
        for k, s, first in self.rounds:
            if not first:
                warm.setdefault(k, []).append(s)
        every = [s for v in warm.values() for s in v]
        total = 0.0
        for k, s, first in self.rounds:
            if first:
                ref = warm.get(k) or every
                total += max(s - statistics.median(ref), 0.0) if ref else 0.0
        return total


def kv_capacity(cache) -> int:
    """Capacity of a cache's first attention buffer (compiled graphs are specialised to it)."""
    for c in getattr(cache, "layers", [cache]):
        cap = getattr(c, "capacity", None)
        if cap is not None:
            return int(cap)
    return 0


@dataclass
class Queued:
    """A round queued on the device (`round.Round`), read by the host later."""

    round: Round
    rows: int  # trunk rows it runs (its bound on the KV offsets' growth; 0: a prefill's first token)
    shapes: list = field(default_factory=list)  # forward shapes it runs (first use = a compile)
    launch_s: float = 0.0  # host seconds it took to queue, when queued ahead of another round's read
    shift: float = 0.0  # correction to its timed interval (`step`)
    steady: bool = True  # queued between rounds of its own k: its time is a sample of t(k)

    @property
    def k(self) -> int:
        return self.round.k

    def read(self) -> list[mx.array]:
        return self.round.read()


class PlainDecoder:
    """Decodes one token per trunk forward: `round.plain_round` over the sequence's one row, in
    rounds the host reads one round late. The prompt's last row gives the first token
    (`round.token_round`); where the caller wants more tokens than a round gives (`prefill`'s
    budget) and nothing needs the host in between (a grammar's masks, precise profiling), round
    r+1 is queued from round r's device values before the host reads r (KV offsets stay device
    values: the host counts a round's tokens when it reads it), as mlx-lm's `generate_step` does,
    so the device never waits for the host's detokenization and stop checks. A speculative
    decoder is this loop with drafting rounds (`speculative.decoder`). The generation loop drives
    it (`loop.Decoder`): `prefill`, then `step` per round, then `finish`; `stats` at the end (the
    round clock's compile time and, MoE models when profiling, expert counts)."""

    drafting = False  # whether rounds may draft (a speculative decoder's run that drafts)
    drafter = None  # a speculative decoder's drafter

    def __init__(self, model: Qwen35Model, sampler: Sampler, profiler: Profiler | None = None, *,
                 prompt_cache: PromptCache | None = None, progress: Progress | None = None,
                 pipeline: bool = True):
        """`pipeline`: queue the next round before the host reads the current one, where the
        caller wants more tokens than a round gives (`prefill`'s budget) and nothing needs the
        host in between (sampling on the host, precise profiling)."""
        self.model = model
        self.pipeline = pipeline
        self.budget: int | None = None  # tokens the caller still wants (`prefill`): none queued past them
        self.progress = progress  # told (tokens done, total) after each prefill chunk
        self.sampler = sampler
        self.prof = profiler or Profiler("off")
        self.cache = model.make_cache()
        self.last_token: int | None = None
        self.moe_experts: dict[str, tuple[int, float]] = {}  # kind -> (forwards, sum of per-layer means)
        self.clock = RoundClock(model)
        # what the last prefill/step emitted, for the generation loop: per token whether it was an
        # accepted draft, its logprobs (when asked for), and how many drafts the round proposed
        self.round_drafted: list[bool] = []
        self.round_logprobs: list[dict] | None = None
        self.round_n_drafted = 0
        self.prompt_cache = prompt_cache  # where prompt state is reused from and kept
        self.cached_tokens = 0  # prompt tokens the last prefill took from the prompt cache (`_reader`)
        self._queued: list[Queued] = []  # rounds queued ahead of the host's read
        self._prev_k = -1
        self._last_dev: mx.array | None = None  # the next round's first input, on the device
        self._in_flight: Round | None = None  # the round queued last, until the host reads it

    def _fed(self, post: mx.array, pre: mx.array) -> mx.array:
        """The trunk state a drafter reads: the post-norm hidden state (what the output head reads;
        an ablation feeds another)."""
        return post

    # ---- prompt -------------------------------------------------------------------------------
    def prefill(self, ids: list[int], budget: int | None = None) -> list[int]:
        """Processes the prompt; returns the tokens it already produces (here the first one).
        `budget`: the most tokens the caller will take (the generation loop's max_tokens; None: it
        reads one round at a time, so no round is queued ahead)."""
        self.budget = budget
        self.sampler.begin(ids)
        with self.prof.stage("prefill"):
            h = self._reader(ids).read_all().last
            self._start_rounds()
            first = self._queue(Queued(token_round(self.model.logits(h[:, -1:]), self._pick,
                                                   self._round_logprobs()), 0))
            if self._ahead() and self._wanted() > 1:
                self._queued.append(self._launch(self._choose_k()))
            tokens, _, _, logprobs = self._read(first)
            emitted = self._emitted(tokens, 0, 0, logprobs)
        self.clock.start()
        return emitted

    def _start_rounds(self) -> None:
        """After a prefill: no round queued; the KV offsets go to the device (rounds move them)."""
        self._queued, self._prev_k, self._in_flight = [], -1, None
        self.cache.kv_to_device()

    def _wanted(self) -> int:
        return self.budget if self.budget is not None else 1

    def _emitted(self, tokens: list[int], n_accepted: int, n_drafted: int,
                 logprobs: list[dict] | None) -> list[int]:
        """Records a round's provenance and `logprobs` (one per token, or None) and adds the tokens
        to the sampler's penalty history."""
        self.round_drafted = [True] * n_accepted + [False] * (len(tokens) - n_accepted)
        self.round_n_drafted = n_drafted
        self.round_logprobs = logprobs
        self.sampler.accept(tokens)
        if self.budget is not None:
            self.budget -= len(tokens)
        return tokens

    def _reader(self, ids: list[int], **kw) -> PromptReader:
        """A reader of the prompt `ids` into this decoder's cache (`prompt_read`; `kw`: its
        drafter, its end), with this decoder's prompt cache and progress."""
        reader = PromptReader(self.model, ids, prompt_cache=self.prompt_cache, progress=self.progress, **kw)
        self.cache, self.cached_tokens = reader.trunk, reader.cached
        return reader

    def _count_experts(self, kind: str) -> None:
        """MoE models, when profiling: distinct experts each layer read in the last forward
        (verify batches read up to (k+1) x top-k experts, a single step top-k)."""
        use = self.model.expert_use
        if not self.prof.enabled or use is None:
            return
        counts = [use.distinct(s) for s in use.slots("trunk")]
        if counts:
            n, total = self.moe_experts.get(kind, (0, 0.0))
            self.moe_experts[kind] = (n + 1, total + sum(counts) / len(counts))

    # ---- one round ----------------------------------------------------------------------------
    def step(self) -> list[int]:
        """One round; returns the tokens it emits (at least one)."""
        cur = self._queued.pop(0) if self._queued else self._launch(self._choose_k())
        if self._ahead() and self._wanted() > 1:
            # queued before the host reads `cur`: it starts from cur's device values
            t = time.perf_counter()
            nxt = self._launch(self._choose_k())
            nxt.launch_s = time.perf_counter() - t
            self._queued.append(nxt)
            # cur's timed interval (host read to host read) holds nxt's queuing, not its own: swap
            # them, or a plain round before a drafting one times like a drafting round and auto
            # sees drafting as free (it kept drafting at acceptance 0.5 and lost 40%)
            cur.shift = cur.launch_s - nxt.launch_s
            cur.steady = self._prev_k == cur.k == nxt.k
        elif self._ahead():
            cur.steady = False  # the last round: nothing queued behind it
        self._prev_k = cur.k
        return self._complete(cur)

    def _choose_k(self) -> int:
        """The next round's draft length (0: a plain round)."""
        return 0

    def _ahead(self) -> bool:
        """Whether the next round is queued before the host reads this one (class docstring): precise
        profiling must see each stage's own work, a grammar's masks need the host's tokens
        (`Sampler.on_device`)."""
        return bool(self.pipeline) and self.sampler.on_device and not self.prof.enabled

    def _launch(self, k: int) -> Queued:
        """Queues a round of k drafts (here always a plain one)."""
        with self.sampler.reading_ahead(self._unread()):
            r = plain_round(self.model, self.cache, self.drafter if self.drafting else None, self._last_dev,
                            self._pick, self._fed, self.prof.stage, self._round_logprobs())
        return self._queue(Queued(r, 1, [("trunk", 1, False, kv_capacity(self.cache))]))

    def _unread(self) -> tuple[mx.array, mx.array] | None:
        """The tokens of the round queued last that the host has not read (the penalties' history
        of the round queued now goes on through them), or None (none, or no penalties to read them)."""
        r = self._in_flight
        if r is None or not self.sampler.cfg.penalties.active:
            return None
        return r.unread(0)

    def _queue(self, r: Queued) -> Queued:
        self._last_dev, self._in_flight = r.round.last, r.round
        if self._ahead():
            mx.async_eval(*r.read(), *self._pending())
        return r

    def _pending(self) -> list[mx.array]:
        """What else a queued round leaves on the device (a drafter's block)."""
        return []

    def _pick(self, logits: mx.array) -> mx.array:
        """A round's token [1] from its logits [1, V] (one row), on the device; a token the host
        draws (a grammar's, sampled) is drawn at the read (`_read`), this one a placeholder."""
        if self._host_draws():
            return mx.zeros((1,), mx.int32)
        return self.sampler.draw(self.sampler.constrain(self.sampler.penalize(logits)))

    def _host_draws(self) -> bool:
        """Whether a plain round's token is drawn on the host: sampled under a grammar (its masks
        follow the tokens the host read; the draw is the host's, as a batch's grammar row's), in
        a run that does not draft (a drafting run's drafter reads the round's token on the device:
        there it is drawn on the device, under the grammar's mask, as its drafting rounds' are)."""
        return not (self.sampler.cfg.greedy or self.sampler.on_device or self.drafting)

    def _round_logprobs(self) -> int | None:
        """The logprobs a plain round computes with its token (None where the host draws it: they
        come with the host's draw, `_read`)."""
        return None if self._host_draws() else self.sampler.cfg.logprobs

    # ---- the host's read, one round late -------------------------------------------------------
    def _read(self, r: Queued) -> tuple[list[int], int, list[int], list[dict] | None]:
        """The host reads a round: (its tokens, accepted drafts n, the drafts that counted, the
        tokens' logprobs); its tokens are committed (KV offsets, the drafter) and the last one is
        the next round's input."""
        with self.prof.stage("sync"):
            # this round's block is evaluated with it; once a later round is queued the block is
            # that round's (its `_queue` evaluates it): waiting for it here would serialise them
            mx.eval(*r.read(), *([] if self._queued else self._pending()))
            d = r.round.host()
            if self._in_flight is r.round:
                self._in_flight = None
            check_finite(d.finite[0])
            n, emitted = d.n[0], d.emitted[0]
            drafts = d.drafts[0][:d.drafted[0]] if d.drafts is not None else []
            if r.k == 0 and self._host_draws():  # drawn here from the round's logits, as a batch's host rows are
                emitted = [self.sampler.sample(r.round.logits[0, 0])]
                logprobs = self.sampler.token_logprobs(r.round.logits[0, :1], emitted)
                self._last_dev = mx.array(emitted, mx.int32)
            else:
                logprobs = d.token_logprobs(0, emitted[:n + 1], self.sampler.cfg.logprobs)
        self._committed(emitted[:n + 1], min(n + 1, r.rows))
        self.last_token = emitted[n]
        if r.rows:  # (a prefill's first token ran no forward of its own)
            self._count_experts("verify" if r.k else "step")
        return emitted[:n + 1], n, drafts, logprobs

    def _committed(self, emitted: list[int], kept: int) -> None:
        """A read round's `emitted` tokens: the trunk keeps `kept` rows (the host's count of the KV
        offsets moves on; each round queued behind it may add its rows)."""
        self.cache.offset += kept
        self.cache.set_bound(self.cache.offset + sum(q.rows for q in self._queued))

    def _complete(self, r: Queued) -> list[int]:
        """The host reads round `r`: its tokens, with its time and statistics."""
        tokens, n, drafts, logprobs = self._read(r)
        emitted = self._emitted(tokens, n, len(drafts), logprobs)
        seconds, first_use = self.clock.lap(r.k, r.shapes, r.shift)
        self._record_round(r.k, drafts, n, emitted, seconds, first_use, r.steady)
        return emitted

    def _record_round(self, k: int, drafts: list[int], n: int, emitted: list[int], seconds: float,
                      first_use: bool, steady: bool) -> None:
        """A completed round's statistics (a speculative decoder's)."""

    def finish(self) -> None:
        """The generation is over (a queued round, if any, is dropped)."""
        self._queued = []

    def stats(self) -> dict:
        """The run's statistics beyond the loop's."""
        return {"compile_seconds": self.clock.compile_seconds(), **self._moe_stats()}

    def _moe_stats(self) -> dict:
        if not self.moe_experts:
            return {}
        return {"moe_distinct_experts_per_layer": {k: t / n for k, (n, t) in self.moe_experts.items()}}
