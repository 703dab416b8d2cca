"""Continuous batching: up to `max_batch` sequences decode together, one batched forward a step.

One thread (the scheduler's) does all of the batch's device work, in a loop:
  admit     waiting sequences take the free slots;
  prefill   the joining sequences' prompts, oldest first, one chunk at a time on each one's own
            caches, exactly as the sequence alone prefills (same chunks, same forward: the same
            numbers on any device, a batch of one as quick to its first token), up to a chunk's
            worth of tokens a step: a long prompt delays the running streams by one chunk at a
            time, never by its whole prefill, and short prompts that arrive together are all read
            in one step, queued back to back; fresh prompts of 2 tokens or more whose
            arithmetic alone is the same at a group's length are read in one forward, padded to
            the group's longest, each row computing what it computes alone (`joint_read`);
            after its last chunk a sequence samples its first token and joins the batch
            (`BatchCache.add`: its caches appended as a row);
  decode    one round of every running sequence (`speculative.round`: a plain round here, one
            forward of each row's last token, each row at its own length; an MTP batch's rounds
            draft, `batching.mtp`); each row sampled by its own sampler (temperature, penalties,
            grammar, seed: on the device, `RowSampling`, where no host state is involved). The
            next round is queued from this one's device values before the host reads it, as a
            sequence alone is decoded; a row the host samples (a grammar's) cannot be in it, its
            token not chosen yet: it sits that round out (keeps none of it) and takes the round
            after with its token, so it moves every other round and never holds back the rows
            beside it;
  leave     sequences that are done (max_tokens reached) or cancelled (their reader stopped:
            EOS, a stop string, a closed stream) drop their rows before the next step.
Each sequence's tokens go to its reader through a queue; the reader (`SlotDecoder`, driven by the
ordinary generation loop) cuts them at EOS and stop strings, as for a sequence decoded alone.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
import traceback
from typing import NamedTuple

import mlx.core as mx

from ..errors import MTPEngineError, out_of_memory
from ..generation.sampling import check_finite
from ..model.batch_cache import BatchCache
from ..model.loaded import Model
from ..generation.prompt_read import PromptDrafter, PromptReader
from ..generation.round import Round, plain_round, post_norm
from ..threads import quiesce_at_exit
from .joint_read import read_together
from .sequence import Sequence, logprobs_asked, sampling


# a joining prompt's last chunk of at most this many tokens is queued without a wait (what several
# such chunks hold at once is small beside one full chunk's memory)
QUEUED_TOKENS = 64


class Launched(NamedTuple):
    """A round queued on the device for these rows (read later by `_complete`)."""

    rows: list[Sequence]
    round: Round
    held: list[bool]  # rows that sit it out (their token was still the host's to choose)


class SchedulerStopped(MTPEngineError):
    """The scheduler stopped (the server or the program is ending) before the sequence ended."""


class BatchScheduler:
    """Runs the sequences submitted to it in batches of at most `max_batch` on `model` (see the
    module docstring). With `own_thread` its thread starts with the first sequence and parks when
    stopped (a thread that ran MLX work must outlive the interpreter's exit: `threads`); without,
    the caller runs the loop with `drive` (batch_generate, on the engine thread)."""

    def __init__(self, model: Model, max_batch: int = 8, own_thread: bool = True):
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise MTPEngineError(f"expected an integer >= 1, found {max_batch!r}", field="parallel")
        self.model, self.max_batch, self.own_thread = model, max_batch, own_thread
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._joining: list[Sequence] = []  # prefilling, each on its own caches (`Sequence.reader`)
        self._rows: list[Sequence] = []
        self._batch = BatchCache(model.model, tail=model.model.kv_tail)
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # batched decode steps run
        self._queued: Launched | None = None  # the next round, queued before the host read this one
        self.completed = 0
        self._exiting = False  # the interpreter is exiting: finish the current step and park
        self._parked = threading.Event()

    # ---- any thread --------------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queues a sequence; it joins the batch when a slot is free."""
        with self._cv:
            if self._stopping:
                raise SchedulerStopped("the batch scheduler has stopped", field="model")
            self._waiting.append(seq)
            if self.own_thread and self._thread is None:
                self._thread = threading.Thread(target=self._main, name="mtp-engine-batch", daemon=True)
                self._thread.start()
                quiesce_at_exit(self)
            self._cv.notify()

    def stop(self) -> None:
        """Ends every sequence (SchedulerStopped) and parks the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()

    def quiesce(self, timeout: float) -> None:
        """At interpreter exit (`threads.quiesce_at_exit`): the thread finishes its current step,
        waits for the device work it queued and parks; its readers wait until the process is gone
        (a step cut off by teardown aborted the process: exit 134)."""
        with self._cv:
            self._exiting = True
            self._cv.notify()
        if self._thread is not None and self._thread.is_alive():
            self._parked.wait(timeout)

    def slots(self) -> list[dict]:
        """What each slot is doing (llama-server's /slots): running rows, then the joining one."""
        with self._cv:
            rows = list(self._rows)
            joining = list(self._joining)
        out = [{"id": i, "state": "decoding", "prompt_tokens": len(s.prompt_ids), "generated_tokens": s.produced,
                **({"drafted": s.counts.drafted, "accepted": s.counts.accepted} if s.draft else {})}
               for i, s in enumerate(rows)]
        out += [{"id": len(out) + i, "state": "prefilling", "prompt_tokens": len(s.prompt_ids),
                 "prefilled_tokens": s.reader.done_tokens if s.reader is not None else 0}
                for i, s in enumerate(joining)]
        out += [{"id": i, "state": "idle"} for i in range(len(out), self.max_batch)]
        return out

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._rows) + len(self._joining)

    # ---- the scheduler's thread --------------------------------------------------------------------
    def drive(self, until) -> None:
        """Runs the loop in this thread until `until()` is true (checked between steps)."""
        while not until():
            if not self._work(timeout=0.01):
                continue

    def _main(self) -> None:
        while True:
            self._work(timeout=None)

    def _work(self, timeout: float | None) -> bool:
        """One pass of the loop (leave, admit/prefill a chunk, decode a step); waits up to
        `timeout` (None: for ever) when there is nothing to do. False when it did nothing."""
        with self._cv:
            if not (self._stopping or self._exiting) and not (self._waiting or self._joining or self._rows):
                self._cv.wait(timeout)
            if self._exiting and self.own_thread:
                self._park()
            if self._stopping:
                self._end_all(SchedulerStopped("the batch scheduler stopped before this generation ended",
                                               field="model"))
                if self.own_thread:
                    self._park()
                return False
            if not (self._waiting or self._joining or self._rows):
                return False
        try:
            self._leave()
            self._admit_and_prefill()
            self._leave()  # a sequence done at its prefill (one token asked, or an end token) takes no round
            self._decode()
        except Exception as e:  # a bug must not hang the readers: each gets the error
            traceback.print_exc()
            self._end_all(_engine_error(e))
        return True

    def _park(self) -> None:
        """Waits for the device work this thread queued, then for ever (the class docstring says
        why the thread never ends); called holding `_cv`."""
        mx.synchronize()
        self._parked.set()
        while True:
            self._cv.wait()

    def _end_all(self, error: BaseException) -> None:
        seqs = self._rows + self._joining + list(self._waiting)
        for s in list(self._joining):
            self._leave_prefill(s)
        for s in seqs:
            s.fail(error)
        self._rows, self._joining, self._queued = [], [], None
        self._waiting.clear()
        self._batch = BatchCache(self.model.model, tail=self.model.model.kv_tail)

    def _leave(self) -> None:
        keep = [i for i, s in enumerate(self._rows) if not s.done]
        if len(keep) < len(self._rows):
            for s in self._rows:
                if s.done:
                    s.out.put(None)
                    self.completed += 1
            self._rows = [self._rows[i] for i in keep]
            self._keep_rows(keep)
        with self._cv:  # a waiting sequence whose reader left never takes a slot
            self._waiting = collections.deque(s for s in self._waiting if not s.cancelled.is_set())

    def _keep_rows(self, keep: list[int]) -> None:
        self._batch.keep(keep)

    def _admit_and_prefill(self) -> None:
        with self._cv:
            free = self.max_batch - len(self._rows) - len(self._joining)
            new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        for s in new:
            s.joined = time.perf_counter()
            s.sampler.begin(s.prompt_ids)
            self._start_prefill(s)
            self._joining.append(s)
        for s in [s for s in self._joining if s.cancelled.is_set()]:
            s.out.put(None)
            self._leave_prefill(s)
        chunk = self.model.model.options.prefill_chunk
        joined: list[Sequence] = []
        spent, pending = read_together(self.model.model, self._joining, chunk, joined)
        for s in [s for s in self._joining if s not in joined]:
            try:
                while spent < chunk and not s.reader.done:
                    n, first = self._prefill_chunk(s)
                    spent += n
                    if first is not None:  # read the prompts before's first tokens while this one runs
                        self._first_tokens(pending, joined)
                        pending = [(s, first)]
                if s.reader.done:
                    joined.append(s)
            except Exception as e:  # only this prompt fails: the running rows and the others go on
                self._prefill_failed(s, e)
            if spent >= chunk:
                break
        self._first_tokens(pending, joined)
        if joined:
            self._join(joined)
            self._joining = [s for s in self._joining if s not in joined]

    def _first_tokens(self, pending: list[tuple[Sequence, mx.array]], joined: list[Sequence]) -> None:
        """Samples and delivers joining sequences' first tokens from their logits (queued by
        `_prefill_chunk` or a joint read); one that fails leaves alone."""
        for s, logits in pending:
            try:
                token = s.sampler.sample(logits)
                s.deliver([token], s.sampler.token_logprobs(logits[None], [token]))
            except Exception as e:
                self._prefill_failed(s, e)
                if s in joined:
                    joined.remove(s)
        pending.clear()

    def _prefill_failed(self, s: Sequence, e: Exception) -> None:
        if not isinstance(e, MTPEngineError):
            traceback.print_exc()
        s.fail(_engine_error(e))
        self._leave_prefill(s)

    def _start_prefill(self, s: Sequence, drafter: PromptDrafter | None = None) -> None:
        """`s.reader`: its prompt's reader (`generation.prompt_read`, as the sequence alone reads
        it), on caches of its own; with `drafter`, a drafting sequence's (its last token is read
        by its first round)."""
        end = len(s.prompt_ids) - 1 if drafter is not None else None
        s.reader = PromptReader(self.model.model, s.prompt_ids, end=end, prompt_cache=s.prompt_cache,
                                drafter=drafter, progress=s.progress)
        s.cached = s.reader.cached

    def _prefill_chunk(self, s: Sequence) -> tuple[int, mx.array | None]:
        """The next chunk of `s`'s prompt: the tokens run and, after its last one, the logits its
        first token is sampled from (a drafting sequence's first round reads its last token: None).
        A short chunk is left running (`QUEUED_TOKENS`): the host builds the next joining prompt's
        forward while the device runs this one, and reads this one's first token after that (the
        device is never idle between joiners, and no joiner waits for all of them)."""
        r = s.reader
        n = r.read_chunk(wait=r.remaining > QUEUED_TOKENS)
        if r.done and r.drafter is None:
            logits = self.model.model.logits(r.last[0, 0])
            mx.async_eval(logits)
            return n, logits
        return n, None

    def _leave_prefill(self, s: Sequence) -> None:
        """A joining sequence leaves before its prefill is done (cancelled, or failed)."""
        self._joining.remove(s)
        if s.prompt_cache is not None and s.reader is not None:
            s.prompt_cache.release(s.reader.trunk)
        s.reader = None

    def _join(self, joined: list[Sequence]) -> None:
        """Sequences whose prefill is done join the batch: their caches become its last rows (copied:
        a kept prompt state on them is never written again)."""
        for s in joined:
            self._batch.add(s.reader.trunk)
            s.length = self._batch.host_lengths[-1]
            if s.prompt_cache is not None:
                s.prompt_cache.release(s.reader.trunk)
            s.reader = None
        self._rows += joined

    def _decode(self) -> None:
        """One round read, with the next one queued first (the device runs round r+1 while the host
        delivers round r, as a sequence alone is decoded) unless every row is sampled on the host.
        A queued round outlives rows that leave or join before it is read: it delivers to the rows
        it ran (those still running), and a joined row takes the round after it."""
        rows = list(self._rows)
        if not rows:
            self._queued = None
            return
        cur = self._queued or self._launch(rows)
        self._queued = None
        if cur.rows == rows and any(s.sampler.on_device for s in rows):
            self._queued = self._launch(rows, cur.round)
        self._complete(cur)

    def _launch(self, rows: list[Sequence], prev: Round | None = None) -> Launched:
        """Queues one round over `rows`, from each row's last token: the host's, or `prev`'s still
        on the device; a row the host samples takes the token it chose (`Sequence.chosen`) or, with
        none chosen since its last round, sits this one out."""
        held = [False] * len(rows)
        if prev is None:
            last = mx.array([s.last_token for s in rows], mx.int32)
            for s in rows:
                s.chosen = None
        else:
            last = prev.last
            host = [not s.sampler.on_device for s in rows]
            if any(host):
                held = [h and s.chosen is None for h, s in zip(host, rows)]
                chosen = mx.array([s.chosen or 0 for s in rows], mx.int32)
                last = mx.where(mx.array(host), chosen, last)
                for s in rows:
                    s.chosen = None
        with contextlib.ExitStack() as ahead:
            for b, s in enumerate(rows):  # a row's penalties go on through `prev`'s tokens, unread yet
                if prev is not None and s.sampler.cfg.penalties.active and s.sampler.on_device:
                    ahead.enter_context(s.sampler.reading_ahead(prev.unread(b)))
            r = self._round(rows, last, mx.array(held) if any(held) else None)
        mx.async_eval(*r.read(), *self._batch.arrays(), *self._round_arrays(rows))
        return Launched(rows, r, held)

    def _round(self, rows: list[Sequence], last: mx.array, hold: mx.array | None) -> Round:
        """The round itself: a plain one here (`batching.mtp` drafts); `hold`: rows that sit it out."""
        return plain_round(self.model.model, self._batch, None, last, sampling(rows).pick, post_norm,
                           logprobs=logprobs_asked(rows), hold=hold)

    def _round_arrays(self, rows: list[Sequence]) -> list[mx.array]:
        """What else a queued round leaves on the device (an MTP batch: the head's)."""
        return []

    def _complete(self, cur: Launched) -> None:
        """The host reads a round: each row's accepted drafts and token (a row whose token is not
        drawn on the device is sampled here from the round's logits), delivered to its reader."""
        r, rows = cur.round, cur.rows
        d = r.host()
        emitted, accepted, ok = d.emitted, d.n, d.finite
        self.steps += 1
        for b, s in enumerate(rows):
            if cur.held[b]:
                continue
            n = accepted[b]
            s.length += n + 1
            if s.done:
                continue
            s.batch_sizes.append(len(rows))
            try:
                check_finite(ok[b])
                tokens = emitted[b][:n + 1]
                if s.sampler.on_device:  # its logprobs came with the round
                    logprobs = d.token_logprobs(b, tokens, s.sampler.cfg.logprobs)
                else:
                    tokens = [s.sampler.sample(r.logits[b, 0])]
                    logprobs = s.sampler.token_logprobs(r.logits[b, :1], tokens)
                    s.chosen = tokens[0]
                self._record(s, d.drafted[b], n)
                s.deliver(tokens, logprobs, n, d.drafted[b])
            except Exception as e:  # its sampler or grammar failing ends this sequence only
                if not isinstance(e, MTPEngineError):
                    traceback.print_exc()
                s.fail(_engine_error(e))
        queued = self._queued.round.k + 1 if self._queued is not None else 0
        self._bound([s.length + queued for s in self._rows], [s.length for s in self._rows])

    def _record(self, s: Sequence, drafted: int, n: int) -> None:
        """A row's round statistics: `drafted` drafts counted (p-min, n-min), n accepted (an MTP
        batch counts its drafting rows' rounds)."""

    def _bound(self, bounds: list[int], floors: list[int]) -> None:
        """The host's bounds of the running rows' cache lengths, and the lengths it read (no
        rollback of the round queued since returns below them)."""
        self._batch.bound_lengths(bounds, floors)


def _engine_error(e: Exception) -> MTPEngineError:
    """What a sequence's reader is given for a failure inside the scheduler: the engine's error
    type, whatever raised (MLX raises ValueError and RuntimeError)."""
    if isinstance(e, MTPEngineError):
        return e
    oom = out_of_memory(e, "in a batch's step or prefill")
    if oom is not None:
        return oom
    err = MTPEngineError(f"the batch failed: {type(e).__name__}: {e}", field="model")
    err.__cause__ = e
    return err
