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
    out: list = [None] * n

    def work(k: int) -> None:
        try:
            out[k] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out[k] = e

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
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


@pytest.mark.parametrize("spec", ["none", "draft-mtp"])
def test_clean_exit_while_a_daemon_thread_still_generates(spec):
    """The program ends while a daemon thread is mid-generation: the interpreter exits with the
    program's status (it aborted with SIGABRT, exit 134, in 10 runs of 10)."""
    code = (f"import sys, threading, time; sys.path.insert(0, {str(ROOT)!r}); import mtp_engine as me\n"
            f"m = me.load({str(need(TINY_Q8))!r})\n"
            "started = threading.Event()\n"
            "def work():\n"
            f"    for i, c in enumerate(me.stream_generate('Hi ' * 8, m, max_tokens=4000, spec={spec!r}, ignore_eos=True)):\n"
            "        started.set()\n"
            "threading.Thread(target=work, daemon=True).start()\n"
            "started.wait(60); time.sleep(0.3)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-500:]


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
