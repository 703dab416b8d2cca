"""Using a loaded model from any thread.

MLX keeps its streams per thread: an array that is still a lazy graph when another thread first
evaluates it fails with ``RuntimeError: There is no Stream(cpu, 0) in current thread`` (the
joined products of `model.layers.concat_outputs` were such arrays: `generate` in a server worker
failed on a model loaded in the main thread). `evaluate_all` makes everything a model holds
concrete at load, so any thread may use it first.

The interpreter-exit abort after generating in worker threads ("terminate called without an
active exception", exit 134) is MLX's: it reproduces without this engine (`docs/reliability.md` has the reproduction and the
report for upstream). It happens when threads that
ran MLX work have ended before the interpreter exits. The engine's workaround has two parts:
`engine_thread` runs the MLX work of calls made from threads other than the main one on one
long-lived engine thread (so no thread that touched MLX ends before exit), and `release_at_exit`
finishes and drops MLX's pending work and compiled functions while the runtime is intact.
"""
from __future__ import annotations

import atexit
import functools
import queue
import sys
import threading
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Iterator

import mlx.core as mx

from .errors import MTPEngineError

__all__ = ["arrays_of", "evaluate_all", "quiesce_at_exit", "release_at_exit", "engine_thread", "on_engine_thread", "run_on_engine_thread"]


def arrays_of(obj: Any) -> list[mx.array]:
    """Every `mx.array` reachable from `obj` through attributes, dataclass fields, lists,
    tuples and dicts (each object visited once)."""
    out: list[mx.array] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, bool)):
            continue
        seen.add(id(o))
        if isinstance(o, mx.array):
            out.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif is_dataclass(o) and not isinstance(o, type):
            stack.extend(getattr(o, f.name, None) for f in fields(o))
            stack.extend(v for k, v in vars(o).items() if k not in {f.name for f in fields(o)})
        elif hasattr(o, "__dict__") and not isinstance(o, type) and not callable(o):
            stack.extend(vars(o).values())
        elif hasattr(o, "__dict__") and type(o).__module__.startswith("mtp_engine"):
            stack.extend(vars(o).values())  # engine objects that define __call__ (layers)
    return out


def evaluate_all(obj: Any) -> int:
    """Evaluates every array `obj` holds (see `arrays_of`); returns how many there were."""
    arrays = arrays_of(obj)
    if arrays:
        mx.eval(*arrays)
    return len(arrays)


_registered = False
_lock = threading.RLock()


_closing = threading.Event()  # the interpreter is exiting: the engine thread takes no new work
EXIT_WAIT_S = 10.0  # how long exit waits for the engine thread's current step


def _release() -> None:
    # Compiled functions and cached buffers freed by interpreter teardown after worker threads
    # ended is where MLX aborts; finishing the work and dropping them while the runtime is intact
    # avoids it. A generation still running in a daemon thread (the program exits without waiting
    # for it) aborted the same way, mid-step: the engine thread finishes its current step, takes
    # no other, and the callers wait until the interpreter is gone.
    _closing.set()
    for worker in list(_workers):  # their current step finished and drained, then parked
        try:
            worker.quiesce(EXIT_WAIT_S)
        except Exception:  # MLX already shutting down: exit goes on
            pass
    if _engine is not None and _engine.thread.is_alive():
        _engine.idle.wait(EXIT_WAIT_S)
        # the engine thread's own stream: work it queued ahead of its reads (pipelined steps and
        # rounds) was still running at teardown (SIGABRT in ~1 of 10 exits under load); the main
        # thread's synchronize below does not wait for another thread's stream
        _engine.drain(EXIT_WAIT_S)
    try:
        mx.synchronize()
    except Exception:  # nothing to wait for, or MLX already shutting down
        pass
    try:
        mx.clear_cache()
    except Exception:
        pass
    try:
        mx.disable_compile()
    except Exception:
        pass


def release_at_exit() -> None:
    """Registers (once) the exit-time release of MLX state described in the module docstring."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_release)
            _registered = True


_workers: "weakref.WeakSet" = weakref.WeakSet()


def quiesce_at_exit(worker: Any) -> None:
    """Registers a long-lived thread's owner (a batch scheduler) whose `quiesce(timeout)` makes
    that thread finish its current step, wait for its queued device work and park, at exit: the
    same abort as the engine thread's otherwise (module docstring)."""
    _workers.add(worker)
    release_at_exit()


def _drain() -> None:
    mx.synchronize()


class _EngineThread:
    """One daemon thread that runs submitted calls in order, for the life of the process."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = threading.Event()  # set while it waits for work
        self.thread = threading.Thread(target=self._serve, name="mtp-engine-mlx", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            self.idle.set()
            fn, fut = self._jobs.get()
            self.idle.clear()
            if _closing.is_set() and fn is not _drain:  # queued as the interpreter began to exit: never
                continue  # run (its daemon caller waits until the process is gone)
            if fut is None:  # a stream's step: it hands over its own result and errors
                fn()
            elif fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller's thread, raised there
                    fut.set_exception(e)

    def drain(self, timeout: float) -> None:
        """Waits (up to `timeout`) until the device work this thread queued has finished."""
        fut: Future = Future()
        self._jobs.put((_drain, fut))
        try:
            fut.result(timeout)
        except Exception:  # timed out, or MLX already shutting down: exit goes on
            pass

    def submit(self, fn: Callable[[], None]) -> None:
        """Queues `fn` without waiting for it (a stream's next step)."""
        if not _closing.is_set():
            self._jobs.put((fn, None))

    def call(self, fn: Callable[[], Any]) -> Any:
        if threading.current_thread() is self.thread:
            # from a job already running here (a stream dropped unclosed and collected mid-step
            # closes itself through `call`): queueing it would wait for itself
            return fn()
        if _closing.is_set():  # exiting: this (daemon) caller waits for the end of the process
            threading.Event().wait()
        if sys.is_finalizing() or not self.thread.is_alive():  # at exit the thread may be frozen
            return fn()
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut.result()


_engine: _EngineThread | None = None


def _engine_thread() -> _EngineThread | None:
    """The engine thread, or None when the caller should run MLX work itself (the main thread,
    or the engine thread)."""
    global _engine
    current = threading.current_thread()
    if current is threading.main_thread():
        return None
    with _lock:
        if _engine is None:
            _engine = _EngineThread()
            release_at_exit()
    return None if current is _engine.thread else _engine


def on_engine_thread(fn: Callable[[], Any]) -> Any:
    """Runs `fn()` where this thread's MLX work belongs: right here on the main or the engine
    thread, else on the engine thread (the caller waits; exceptions are raised in the caller).
    A caller that consumes a whole stream (a server's job) runs it this way so that the stream,
    started on the engine thread, is read there too: no hand-over per item."""
    engine = _engine_thread()
    return fn() if engine is None else engine.call(fn)


def run_on_engine_thread(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: a call of `fn` from a thread other than the main one runs on the engine thread
    (the caller waits; exceptions are raised in the caller)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return on_engine_thread(lambda: fn(*args, **kwargs))

    return wrapper


_DONE = object()


def engine_thread(genfunc: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """Decorator for a generator function: iterated from a thread other than the main one, each
    step of the generator runs on the engine thread, up to `RUN_AHEAD` steps ahead of the reader
    (so a reader that stops early has had at most that many more made). Generations of several
    threads interleave there step by step (each keeps its own decoder and cache, as when they ran
    in their threads)."""

    @functools.wraps(genfunc)
    def wrapper(*args: Any, **kwargs: Any) -> Iterator[Any]:
        engine = _engine_thread()
        if engine is None:
            return _pinned(genfunc(*args, **kwargs))
        return _proxy(engine, genfunc, args, kwargs)

    return wrapper


def _pinned(gen: Iterator[Any]) -> Iterator[Any]:
    """A stream run in the thread that iterates it first (the main thread): its MLX arrays live on
    that thread's streams, and a step taken from another thread failed deep inside MLX ("There is
    no Stream(cpu, 0) in current thread"). Said plainly instead."""
    owner = None
    try:
        while True:
            here = threading.get_ident()
            if owner is None:
                owner = here
            elif here != owner:
                raise MTPEngineError("this stream was started in the main thread and must be iterated there; a "
                                     "stream started in any other thread may move between threads", field="stream")
            try:
                item = next(gen)
            except StopIteration:
                return
            yield item
    finally:
        gen.close()


RUN_AHEAD = 4  # steps a proxied stream may take before its caller has read them


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


class _AheadStream:
    """A generator stepped on the engine thread while its caller reads the items already made.

    Waiting for the caller before each step put two thread wake-ups (~100 us each, the engine idle
    meanwhile) into every token: a server's worker decoded at 0.86x of the same stream on the main
    thread (measured on an H100). Each step now queues the next itself, at the back
    of the engine's queue (other threads' streams still take turns), until RUN_AHEAD items wait
    unread; the caller's read then queues it again."""

    def __init__(self, engine: _EngineThread, gen: Iterator[Any], ahead: int):
        self.engine, self.gen, self.ahead = engine, gen, ahead
        self.items: deque = deque()
        self.ready = threading.Condition()
        self.paused = False  # the buffer was full when the last step ended: the next read resumes
        self.closed = False
        engine.submit(self.step)

    def step(self) -> None:
        """On the engine thread."""
        if self.closed:
            return
        try:
            item = next(self.gen, _DONE)
        except BaseException as e:  # raised in the caller's thread
            item = _Raised(e)
        ended = item is _DONE or isinstance(item, _Raised)
        with self.ready:
            self.items.append(item)
            self.ready.notify()
            again = not ended and not self.closed and len(self.items) < self.ahead
            self.paused = not ended and not again
        if again:
            self.engine.submit(self.step)

    def take(self) -> Any:
        """The next item (`_DONE` at the end), in the caller's thread."""
        with self.ready:
            while not self.items:
                self.ready.wait()
            item = self.items.popleft()
            resume, self.paused = self.paused, False
        if resume:
            self.engine.submit(self.step)
        if isinstance(item, _Raised):
            raise item.error
        return item

    def close(self) -> None:
        """Stops stepping and closes the generator on the engine thread (after any step under way)."""
        with self.ready:
            self.closed = True
        self.engine.call(self.gen.close)


def _proxy(engine: _EngineThread, genfunc: Callable[..., Iterator[Any]], args: tuple, kwargs: dict) -> Iterator[Any]:
    stream = _AheadStream(engine, genfunc(*args, **kwargs), RUN_AHEAD)  # the body starts on the engine thread
    try:
        while (item := stream.take()) is not _DONE:
            yield item
    finally:
        stream.close()
