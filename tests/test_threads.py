"""A loaded model works from any thread, first use included, and the interpreter exits cleanly
after generations in worker threads."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from tests.conftest import ROOT, TINY_Q8, need
from mtp_engine import api

PROMPT = "Once upon a time"


def _in_threads(fn, n: int) -> list:
    return _each([fn] * n)


def _each(fns: list, timeout: float | None = None) -> list:
    """Each function in a thread of its own, all started, then joined: their results (or errors)."""
    out: list = [None] * len(fns)

    def work(k: int) -> None:
        try:
            out[k] = fns[k]()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out[k] = e

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


@pytest.mark.parametrize("spec", [None, "draft-mtp"])
def test_first_use_in_another_thread(spec):
    m = api.load(need(TINY_Q8))  # loaded here, first used in a worker: used to fail on lazy arrays
    kw = dict(max_tokens=6, spec=spec, ignore_eos=True)
    (first,) = _in_threads(lambda: api.generate(PROMPT, m, **kw).token_ids, 1)
    assert not isinstance(first, BaseException), repr(first)
    assert first == api.generate(PROMPT, m, **kw).token_ids
    # several threads at once, streaming included, on the same model
    results = _in_threads(lambda: [t for c in api.stream_generate(PROMPT, m, **kw) for t in c.token_ids], 3)
    assert results == [first] * 3


def test_load_in_a_worker_thread():
    path = need(TINY_Q8)  # here: a skip raised in the worker thread would not reach pytest
    (m,) = _in_threads(lambda: api.load(path), 1)
    assert isinstance(m, api.Model)
    assert len(api.generate(PROMPT, m, max_tokens=3, ignore_eos=True).token_ids) == 3


def test_errors_reach_the_calling_thread():
    m = api.load(need(TINY_Q8))
    (err,) = _in_threads(lambda: api.generate("", m, max_tokens=1), 1)
    assert isinstance(err, api.MTPEngineError) and err.field == "prompt"


def test_clean_exit_after_threaded_generation():
    code = (f"import sys, threading; sys.path.insert(0, {str(ROOT)!r}); import mtp_engine as me\n"
            f"m = me.load({str(need(TINY_Q8))!r})\n"
            "out = []\n"
            "work = lambda: out.append(me.generate('Hi', m, max_tokens=4, spec='draft-mtp', n_max=2, ignore_eos=True))\n"
            "ts = [threading.Thread(target=work) for _ in range(3)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "assert len(out) == 3 and all(len(r.token_ids) == 4 for r in out), out\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-500:]


@pytest.mark.parametrize("spec, parallel", [("none", None), ("draft-mtp", None), ("none", 4), ("draft-mtp", 4)])
def test_clean_exit_while_a_daemon_thread_still_generates(spec, parallel):
    """The program ends while daemon threads are mid-generation (alone, or batched on a
    `load(parallel=4)` model whose scheduler thread runs the steps): the interpreter exits with the
    program's status and says nothing (it aborted with SIGABRT, exit 134, in 10 runs of 10 alone and
    4 of 4 batched)."""
    code = (f"import sys, threading, time; sys.path.insert(0, {str(ROOT)!r}); import mtp_engine as me\n"
            f"m = me.load({str(need(TINY_Q8))!r}, parallel={parallel!r})\n"
            "started = threading.Event()\n"
            "def work():\n"
            f"    for i, c in enumerate(me.stream_generate('Hi ' * 8, m, max_tokens=4000, spec={spec!r}, ignore_eos=True)):\n"
            "        started.set()\n"
            "for _ in range(2): threading.Thread(target=work, daemon=True).start()\n"
            "started.wait(60); time.sleep(0.3)\n"
            "sys.exit(3)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 3 and "terminate" not in p.stderr, p.stderr[-500:]


def test_a_main_thread_stream_continued_elsewhere_says_so():
    """A stream started in the main thread and iterated on in another: one clear error (MLX failed
    with "There is no Stream(cpu, 0) in current thread"); a stream started in a worker thread may
    move between threads and finishes with the same tokens as in one thread."""
    m = api.load(need(TINY_Q8))
    ref = api.generate(PROMPT, m, max_tokens=12, spec="draft-mtp", ignore_eos=True).token_ids
    s = api.stream_generate(PROMPT, m, max_tokens=12, spec="draft-mtp", ignore_eos=True)
    first = next(s).token_ids
    out = _in_threads(lambda: [c.token_ids for c in s], 1)[0]
    assert isinstance(out, api.MTPEngineError) and "main thread" in str(out), out
    box = {}
    _in_threads(lambda: box.setdefault("s", api.stream_generate(PROMPT, m, max_tokens=12, spec="draft-mtp",
                                                                 ignore_eos=True)), 1)
    head = _in_threads(lambda: next(box["s"]).token_ids, 1)[0]
    tail = _in_threads(lambda: [t for c in box["s"] for t in c.token_ids], 1)[0]
    assert head + tail == ref and first == ref[:len(first)]


# ---- the engine thread's streams, with plain generators (no model) ------------------------------
from mtp_engine import threads  # noqa: E402


def _made_on() -> tuple:
    """A stream recording, for each item it makes, the thread it ran on and how many it had made."""
    log: list[tuple[str, int]] = []
    stopped: list[str] = []

    @threads.engine_thread
    def count(n: int, fail_at: int | None = None):
        try:
            for i in range(n):
                if i == fail_at:
                    raise ValueError(f"bad item {i}")
                log.append((threading.current_thread().name, i))
                yield i
        finally:
            stopped.append(threading.current_thread().name)

    return count, log, stopped


def test_a_thread_reads_a_stream_made_on_the_engine_thread_in_order():
    count, log, stopped = _made_on()
    (got,) = _in_threads(lambda: list(count(50)), 1)
    assert got == list(range(50))
    assert {name for name, _ in log} == {"mtp-engine-mlx"} and stopped == ["mtp-engine-mlx"]


def test_a_stream_runs_at_most_run_ahead_steps_past_its_reader():
    count, log, stopped = _made_on()
    seen: list[int] = []
    made_when_read: list[int] = []

    def read() -> None:
        gen = count(100)
        for i in gen:
            seen.append(i)
            threading.Event().wait(0.002)  # a slow reader: the engine thread waits, not runs on
            made_when_read.append(len(log))
            if i == 9:
                break
        gen.close()

    _in_threads(read, 1)
    assert seen == list(range(10))
    assert max(m - (k + 1) for k, m in enumerate(made_when_read)) <= threads.RUN_AHEAD
    assert len(log) <= 10 + threads.RUN_AHEAD  # closing early stopped it
    assert stopped == ["mtp-engine-mlx"]  # its finally ran on the engine thread, at close


def test_a_stream_error_is_raised_in_the_reader_after_the_items_before_it():
    count, _, _ = _made_on()

    def read():
        got = []
        try:
            for i in count(10, fail_at=6):
                got.append(i)
        except ValueError as e:
            return got, str(e)
        return got, None

    ((got, err),) = _in_threads(read, 1)
    assert got == list(range(6)) and err == "bad item 6"


def test_a_reader_that_stops_reading_does_not_hold_up_other_threads_streams():
    count, log, _ = _made_on()
    b_done = threading.Event()

    def a():
        gen = count(100)
        first = next(gen)
        ok = b_done.wait(30)  # A reads nothing more until B has read its whole stream
        rest = list(gen)
        return first, ok, rest

    def b():
        try:
            return list(count(40))
        finally:
            b_done.set()

    (first, ok, rest), got_b = _each([a, b], timeout=60)
    assert ok, "B's stream waited for A's reader"
    assert got_b == list(range(40)) and [first] + rest == list(range(100))


def test_a_stream_dropped_without_closing_it_is_closed_even_when_collected_on_the_engine_thread():
    import gc
    count, log, stopped = _made_on()
    dropped: list = []

    def read_two_and_drop():
        gen = count(100)
        next(gen), next(gen)
        dropped.append(gen)  # neither closed nor exhausted: its last reference goes on the engine thread

    _in_threads(read_two_and_drop, 1)
    engine = threads._engine

    def collect_there():
        dropped.clear()
        gc.collect()

    done = threading.Event()
    t = threading.Thread(target=lambda: (engine.call(collect_there), done.set()))
    t.start()
    assert done.wait(20), "closing a stream from the engine thread waited for itself"
    assert stopped == ["mtp-engine-mlx"]
