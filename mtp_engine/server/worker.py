"""The generation worker: one thread owns the model (loads it and runs every generation, since
MLX streams belong to the thread that made them) and takes jobs from a bounded queue, one at a
time, so that no two requests ever share a cache. Each job's events travel back to the event
loop through `loop.call_soon_threadsafe`; a job's cancel flag (set when its client goes away) is
checked between chunks and before the job starts.
"""
from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import queue
import threading
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import mlx.core as mx

from .. import api
from ..constraint import Constraint
from ..errors import MTPEngineError
from ..generation.loop import Chunk
from ..generation.prompt_cache import PromptCache
from ..request.keywords import request_from_keywords
from ..request.prepare import Prepared, chat_template_note, prepare
from ..threads import on_engine_thread

log = logging.getLogger("mtp_engine.server")



@dataclass
class Event:
    """What a job reports: a chunk (with each token's text when traced), the end, or an error."""

    kind: str  # "chunk", "done", "error", "progress"
    chunk: Chunk | None = None
    pieces: list[str] = field(default_factory=list)
    error: BaseException | None = None
    prompt_tokens: int = 0
    progress: dict | None = None  # a "progress" event's prompt_progress (llama-server's fields)


class Job:
    """One request's generation; created on the event loop, run on the worker thread.

    Events cross from the worker to the loop through a deque, with at most one wake-up of the loop
    in flight: a token every ~2 ms on a GPU made one `call_soon_threadsafe` (a self-pipe write and
    a loop turn) and one `asyncio.Queue` get under `wait_for` (a task) per token, ~100-160 us of
    the loop's time per token that the generation thread waited for under the GIL (measured,
    docs/benchmarks.md "Server hand-over"); the handler now takes whatever has arrived at each turn."""

    def __init__(self, prepared: Prepared, trace: bool, loop: asyncio.AbstractEventLoop, progress: bool = False):
        """`progress`: the engine reports the prompt's reading as "progress" events (`prompt_progress`)."""
        if progress:
            prepared = replace(prepared, request=replace(prepared.request, progress=self.prompt_progress))
        self.prepared = prepared  # the request made concrete for the model (request.prepare)
        self.trace = trace
        self.loop = loop
        self._events: deque[Event] = deque()
        self._signalled = False  # a wake-up is on its way to the loop (worker sets, loop clears)
        self._waiter: asyncio.Future | None = None
        self.checked_at: float | None = None  # when its handler last asked whether the client is there
        self.cancelled = threading.Event()
        self.started = threading.Event()
        self._progress_start: float | None = None
        self._progress_cache = 0

    def cancel(self) -> None:
        self.cancelled.set()

    def prompt_progress(self, done: int, total: int) -> None:
        """The engine's `progress(done, total)` (the worker thread's): an event with llama-server's
        `prompt_progress` fields: `total` prompt tokens, `cache` those reused (what the first report
        says was handled before any chunk ran), `processed` those handled so far, cache included
        (processed / total is the share read), `time_ms` since the prompt's reading began."""
        now = time.perf_counter()
        if self._progress_start is None:
            self._progress_start, self._progress_cache = now, int(done)
        self.put(Event("progress", progress={"total": int(total), "cache": self._progress_cache,
                                             "processed": int(done),
                                             "time_ms": round((now - self._progress_start) * 1e3, 1)}))

    def put(self, event: Event) -> None:
        """Queues an event for the handler (any thread)."""
        self._events.append(event)  # before the flag is read: a wake-up in flight then finds it
        if not self._signalled:
            self._signalled = True
            try:
                self.loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop is closed: the server is shutting down
                self.cancel()

    def _wake(self) -> None:
        self._signalled = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def pop(self) -> Event | None:
        """The next queued event, or None (on the loop)."""
        return self._events.popleft() if self._events else None

    async def wait(self, timeout: float) -> bool:
        """Until an event is queued (True) or `timeout` seconds pass (False), on the loop."""
        if self._events:
            return True
        # the waiter itself, resolved by a wake-up or by the timer: `asyncio.wait_for` would add a
        # second future and a loop turn to every token's wake-up
        waiter = self._waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, lambda: waiter.done() or waiter.set_result(None))
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        return bool(self._events)


WARM_UP_PROMPT = "Hello"
WARM_UP_TOKENS = 8


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    """A request ended because the server is stopping."""

    def __str__(self) -> str:
        return "the server is shutting down; retry on another instance or after it restarts"


class GenerationWorker:
    """Loads the model in its own thread, then runs queued jobs one by one."""

    def __init__(self, model_path: str | None, queue_size: int, exact: bool = False,
                 max_context: int | None = None, warm_up: dict | None = None, idle_release_s: float = 0.0,
                 load_progress=None, cache_slots: int = 4, cache_bytes: int | None = None,
                 chat_template: str | None = None, parallel: int = 1):
        """`warm_up`: `generate` keyword arguments (the server's default settings) for one short
        generation before the worker says it is ready, so the first request does not pay for
        tracing and compiling the steps (seconds each on a GPU). `cache_slots`, `cache_bytes`: the
        prompt cache's (`PromptCache`). `chat_template`: replaces the model's (serve
        --chat-template). `idle_release_s` > 0: hand MLX's cached buffers back once no request has come for that
        long. Off by default: MLX keeps freed buffers for reuse, as generate() in a loop does, and
        clearing them makes the next request pay fresh allocations (page faults on the CPU, device
        allocations on a GPU).

        `parallel` N > 1 (serve --parallel): up to N jobs run at once, their plain decoding in one
        batched forward per step (`batching.BatchScheduler`); each job's reading and streaming runs
        in a thread of its own; draft-mtp ones draft and verify together. Requests the batch cannot
        take (ngram, profiled) run alone."""
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self.parallel = parallel
        self._free = threading.Semaphore(parallel)  # slots: a job is taken off the queue only into one
        self.queue_size = queue_size
        self._path, self._exact, self._max_context, self._warm_up = model_path, exact, max_context, warm_up
        self._idle_release = idle_release_s if idle_release_s and idle_release_s > 0 else None
        self._load_progress = load_progress  # progress(done, total) while the model loads
        self._chat_template = chat_template
        self.model: api.Model | None = None
        self.load_error: BaseException | None = None
        self.warm_seconds: float | None = None
        # the last prompt's state: the next request that starts with it (a chat's next turn)
        # prefills only the rest; one generation at a time uses it (this thread's)
        self.prompt_cache = PromptCache(cache_slots, cache_bytes)
        self.ready = threading.Event()
        self.running = 0  # jobs generating now (at most `parallel`)
        self.completed = 0
        self._stopping = False
        self._count = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="mtp-engine-generation", daemon=True)
        self._runner_jobs: queue.Queue | None = None  # jobs for the runner threads (parallel > 1)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queues a job, or raises QueueFull when `queue_size` jobs are already waiting
        (ShuttingDown once the server is stopping)."""
        if self._stopping:
            raise ShuttingDown
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def shutdown(self) -> None:
        """The server is stopping (safe from a signal handler: it does not wait): the running
        generation ends at its next chunk and every request, running or waiting, gets a
        "shutting down" error event, so open streams end properly before the server closes them."""
        self._stopping = True
        if self.model is not None and self.model.scheduler is not None:
            self.model.scheduler.stop()  # running batched generations end with an error event
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.put(Event("error", error=ShuttingDown()))
                job.cancel()

    def stop(self, timeout: float = 10.0) -> None:
        """:meth:`shutdown`, then joins the thread (a thread left inside MLX while the interpreter
        exits aborts the process)."""
        self.shutdown()
        self.jobs.put_nowait(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def waiting(self) -> int:
        return self.jobs.qsize()

    # ---- the worker thread ----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.model = api.load(self._path, exact=self._exact, max_context=self._max_context,
                                  progress=self._load_progress, parallel=self.parallel)
            if self._chat_template is not None:
                self.model.tokenizer.chat_template = self._chat_template
            note = chat_template_note(self.model)
            if note:
                log.warning("%s", note)
            if self._warm_up is not None:
                self._warm(dict(self._warm_up))
        except BaseException as e:  # reported by the main thread, which exits cleanly
            self.load_error = e
            self.ready.set()
            return
        self.ready.set()
        dirty = False
        while True:
            self._free.acquire()  # a waiting job stays in the bounded queue until a slot is free
            try:
                job = self.jobs.get(timeout=self._idle_release)
            except queue.Empty:
                self._free.release()
                if dirty and self.running == 0:  # idle for a while: hand the caches' memory back
                    mx.clear_cache()
                    _trim_heap()
                    dirty = False
                continue
            if job is None:
                return
            if self._stopping or job.cancelled.is_set():  # a client that left while it waited frees its place
                if self._stopping:
                    job.put(Event("error", error=ShuttingDown()))
                self._free.release()
                continue
            dirty = True
            with self._count:
                self.running += 1
            if self.parallel == 1:
                self._run_in_slot(job)
            else:  # the job reads its tokens in a runner thread; this one takes the next job
                self._runners().put(job)

    def _runners(self) -> queue.Queue:
        """The hand-off to `parallel` long-lived runner threads, started on first use. Not a thread
        per request: each new thread gets its own C heap arena and stack, and 10k requests left
        ~7 MiB of such pages resident after they ended. The slots' semaphore keeps at most
        `parallel` jobs running, so a runner is always free when a job arrives."""
        if self._runner_jobs is None:
            self._runner_jobs = queue.Queue()
            for i in range(self.parallel):
                threading.Thread(target=self._runner, name=f"mtp-engine-request-{i}", daemon=True).start()
        return self._runner_jobs

    def _runner(self) -> None:
        while (job := self._runner_jobs.get()) is not None:
            self._run_in_slot(job)

    @property
    def busy(self) -> bool:
        return self.running > 0

    def _run_in_slot(self, job: Job) -> None:
        try:
            if self.parallel == 1:
                # the whole job on the engine thread, where its stream runs: read from this thread,
                # every token crossed threads before reaching the loop (server decode 0.84x of
                # generate() on an H100 with the shipped model)
                on_engine_thread(lambda: self._run(job))
            else:  # batched: the scheduler's thread makes the tokens, this one streams them
                self._run(job)
        finally:
            with self._count:
                self.running -= 1
                self.completed += 1
            self._free.release()

    def slots(self) -> list[dict]:
        """What each slot is doing (llama-server's /slots)."""
        if self.model is not None and self.model.scheduler is not None:
            return self.model.scheduler.slots()
        return [{"id": 0, "state": "generating" if self.running else "idle"}]


    def _warm(self, kw: dict) -> None:
        kw.pop("cache_prompt", None)  # the warm-up's prompt is no one's
        if kw.get("spec") == "draft-mtp" and self.model.model.mtp is None:
            kw["spec"] = "none"  # served plainly (run_serve says so)
        log.info("warming up: %d tokens in %d slot(s) with the default settings", WARM_UP_TOKENS, self.parallel)
        t0 = time.monotonic()
        # EOS ignored so a model that would stop at once still runs the plain and the first drafting
        # rounds' shapes. One sequence per slot, each ending a step after the last, so every batch
        # width the slots can reach (parallel down to 1) is traced before the first request (vLLM
        # captures its graphs per batch size at start-up); the first is a chat message, so the
        # chat template is compiled too. What a request would build on first use is built here,
        # where the server's starting memory includes it.
        first = [{"messages": [{"role": "user", "content": WARM_UP_PROMPT}]}]
        runs = [{**r, "max_tokens": WARM_UP_TOKENS + i, "ignore_eos": True}
                for i, r in enumerate(first + [{"prompt": WARM_UP_PROMPT}] * (self.parallel - 1))]

        def one(run: dict) -> None:  # a request's own path: typed request, preparation, stream
            for _ in api.stream_request(prepare(self.model, request_from_keywords(**{**kw, **run})), self.model):
                pass

        if self.parallel == 1:
            one(runs[0])
        else:
            with ThreadPoolExecutor(self.parallel, thread_name_prefix="mtp-engine-warm-up") as pool:
                for f in [pool.submit(one, r) for r in runs]:
                    f.result()
        try:  # JSON mode (response_format): llguidance's start-up and the vocabulary's trie, ~6 MiB
            json_mode = Constraint.json()
        except MTPEngineError:
            json_mode = None  # llguidance absent: requests with a grammar are refused anyway
        if json_mode is not None:
            one({"prompt": WARM_UP_PROMPT, "max_tokens": 2, "constraint": json_mode})
        self.warm_seconds = time.monotonic() - t0

    def _run(self, job: Job) -> None:
        job.started.set()
        gen = None
        try:
            n_prompt = len(job.prepared.prompt_ids)
            gen = api.stream_request(job.prepared, self.model)
            for chunk in gen:
                if self._stopping:
                    job.put(Event("error", error=ShuttingDown()))
                    return
                if job.cancelled.is_set():
                    log.info("client gone: generation stopped")
                    return
                # each token's text comes from the stream's own detokenizer (one per request)
                job.put(Event("chunk", chunk, chunk.pieces if job.trace else [], prompt_tokens=n_prompt))
            job.put(Event("done", prompt_tokens=n_prompt))
        except MTPEngineError as e:
            job.put(Event("error", error=e))
        except Exception as e:  # a bug must not kill the worker: answer 500 and go on
            log.error("generation failed:\n%s", traceback.format_exc())
            job.put(Event("error", error=e))
        finally:
            if gen is not None:
                gen.close()  # a generation left early frees its caches here


def wait_ready(worker: GenerationWorker, timeout: float | None = None) -> api.Model:
    """Blocks until the worker has loaded the model; re-raises a load error."""
    t0 = time.monotonic()
    while not worker.ready.wait(0.2):
        if timeout is not None and time.monotonic() - t0 > timeout:
            raise TimeoutError("the model did not load in time")
    if worker.load_error is not None:
        raise worker.load_error
    return worker.model


def _trim_heap() -> None:
    """Returns the C heap's free pages to the system (glibc's `malloc_trim`): requests come and go
    on threads of their own, whose malloc arenas keep freed memory mapped (RSS grew ~1.2 KiB per
    request over 10k requests with no Python object left behind, tracemalloc showed). A no-op where
    the C library has no such call."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
