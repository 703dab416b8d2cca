"""Continuous batching (mtp_engine.batching): many sequences in one forward per step, each exactly
as it decodes alone. The references are the same requests run one at a time by `generate`."""
from __future__ import annotations

import random
import threading
import time

import mlx.core as mx
import pytest

from mtp_engine import MTPEngineError, batch_generate, generate, stream_generate
from mtp_engine.model.batch_cache import BatchCache

from .conftest import MOE_Q4, SHIPPED, TINY_Q4, need

# mixed lengths: 1 token, a few, a few dozen (two prefill chunks when the chunk is made small)
PROMPTS = ["x", "def fib(n):", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(",
           "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments and run the tool.\"\"\"\n",
           "for i in range(10):"]


def _alone(model, prompts, **kw):
    return [generate(p, model, **kw) for p in prompts]


@pytest.mark.parametrize("path", [SHIPPED, TINY_Q4, MOE_Q4], ids=["trained", "tiny", "moe"])
def test_batch_greedy_equals_each_alone(models, path):
    """Five prompts of mixed lengths through 2 slots (sequences join and leave as others end):
    every token as when the prompt runs alone."""
    m = models(need(path))
    want = _alone(m, PROMPTS, max_tokens=12, ignore_eos=True)
    got = batch_generate(PROMPTS, m, max_tokens=12, ignore_eos=True, parallel=2)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    assert [g.prompt_token_ids for g in got] == [w.prompt_token_ids for w in want]
    assert max(g.stats["batch_size_max"] for g in got) == 2  # they did share steps


def test_batch_sampling_and_penalties_equal_each_alone(shipped_model):
    """Each sequence keeps its own sampler: seeded draws, top-k/p, penalties as alone."""
    kw = dict(max_tokens=10, ignore_eos=True, temperature=0.9, top_k=20, top_p=0.95, seed=7, repeat_penalty=1.3,
              presence_penalty=0.5)
    want = _alone(shipped_model, PROMPTS[:4], **kw)
    got = batch_generate(PROMPTS[:4], shipped_model, **kw)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_batch_stops_and_logprobs_per_sequence(shipped_model):
    kw = dict(max_tokens=16, stop=["\n\n", "return"], logprobs=2)
    want = _alone(shipped_model, PROMPTS, **kw)
    got = batch_generate(PROMPTS, shipped_model, parallel=3, **kw)
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert [lp["token"] for lp in g.logprobs] == [lp["token"] for lp in w.logprobs]
        for a, b in zip(g.logprobs, w.logprobs):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


def test_long_prompt_prefills_in_chunks_beside_running_streams(shipped_model, monkeypatch):
    from mtp_engine.batching.scheduler import BatchScheduler

    monkeypatch.setattr(BatchScheduler, "prefill_chunk", 4)  # every prompt here takes several chunks
    want = _alone(shipped_model, PROMPTS, max_tokens=6, ignore_eos=True)
    got = batch_generate(PROMPTS, shipped_model, max_tokens=6, ignore_eos=True, parallel=4)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_batch_refusals_name_the_field(shipped_model):
    with pytest.raises(MTPEngineError) as e:
        batch_generate(["a", "b\ud800"], shipped_model, max_tokens=2)
    assert "prompts[1]" in str(e.value) and e.value.field == "prompt"
    with pytest.raises(MTPEngineError) as e:
        batch_generate(["a"], shipped_model, max_tokens=2, spec="draft-mtp")
    assert e.value.field == "spec"
    for bad in ([], "abc", None):
        with pytest.raises(MTPEngineError) as e:
            batch_generate(bad, shipped_model)
        assert e.value.field == "prompts"
    with pytest.raises(MTPEngineError) as e:
        batch_generate(["a"], shipped_model, parallel=0)
    assert e.value.field == "parallel"


# ---- stream_generate from many threads, on a model loaded with parallel= --------------------------

@pytest.fixture(scope="module")
def parallel_model(models):
    return models(SHIPPED, parallel=4)


def test_threads_share_batched_steps_and_overlap(parallel_model, shipped_model):
    """8 threads stream at once: each gets its sequential output, and the streams overlap (every
    first token arrives before the first stream ends), instead of running one after another."""
    prompts = [f"def f{i}(x):\n    return" for i in range(8)]
    want = [r.token_ids for r in _alone(shipped_model, prompts, max_tokens=16, ignore_eos=True)]
    got: dict[int, list[int]] = {}
    first: dict[int, float] = {}
    ended: dict[int, float] = {}
    errors: list[BaseException] = []

    def read(i: int) -> None:
        try:
            toks = []
            for c in stream_generate(prompts[i], parallel_model, max_tokens=16, ignore_eos=True):
                if c.token_ids and i not in first:
                    first[i] = time.perf_counter()
                toks += c.token_ids
            ended[i] = time.perf_counter()
            got[i] = toks
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and [got[i] for i in range(8)] == want
    # 4 slots: the first four streams overlap fully; every stream starts before the last one ends
    assert max(first[i] for i in range(4)) < min(ended.values())
    assert max(first.values()) < max(ended.values())
    s = parallel_model.scheduler
    assert s.running == 0 and s.waiting == 0


def test_random_cancellations_leak_no_slot(parallel_model):
    """200 streams, many closed after a random number of chunks: every slot comes back free."""
    rng = random.Random(3)
    s = parallel_model.scheduler

    def read(i: int) -> None:
        gen = stream_generate(f"x = {i}", parallel_model, max_tokens=8, ignore_eos=True)
        stop_after = rng.randrange(0, 10)
        for n, _ in enumerate(gen):
            if n >= stop_after:
                break
        gen.close()

    for batch in range(10):
        threads = [threading.Thread(target=read, args=(20 * batch + i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    deadline = time.time() + 10
    while (s.running or s.waiting) and time.time() < deadline:
        time.sleep(0.01)
    assert s.running == 0 and s.waiting == 0
    assert len(s._batch) == 0


def test_plain_requests_with_options_the_batch_lacks_run_alone(parallel_model, shipped_model):
    """draft-mtp and profiled requests on a batching model still work (alone, not in the batch)."""
    a = generate("def fib(n):", parallel_model, max_tokens=8, spec="draft-mtp", n_max=2)
    b = generate("def fib(n):", shipped_model, max_tokens=8)
    assert a.token_ids == b.token_ids and "rounds" in a.stats


# ---- the batch caches ---------------------------------------------------------------------------

def test_batch_cache_rows_join_and_leave_without_moving_others(shipped_model):
    m = shipped_model.model
    caches = []
    for ids in ([1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]):
        c = m.make_cache()
        m.forward(mx.array([ids]), c)
        caches.append(c)
    batch = BatchCache(m)
    for c in caches:
        batch.add(c)
    assert batch.host_lengths == [3, 7, 1] and batch.lengths.tolist() == [3, 7, 1]
    kv = next(layer for layer in batch.layers if hasattr(layer, "keys"))
    kv0 = next(layer for layer in caches[1].layers if hasattr(layer, "keys"))
    assert mx.array_equal(kv.keys[1, :, :7], kv0.keys[0, :, :7])
    batch.keep([1, 2])
    assert batch.host_lengths == [7, 1]
    kv = next(layer for layer in batch.layers if hasattr(layer, "keys"))
    assert mx.array_equal(kv.keys[0, :, :7], kv0.keys[0, :, :7])
    batch.keep([])
    assert len(batch) == 0 and batch.layers == []


# ---- serve --parallel -----------------------------------------------------------------------------

def test_serve_parallel_streams_together_and_shows_slots(shipped_model):
    """8 concurrent streamed completions on `serve --parallel 4`: each answer as generate gives it
    alone, the streams overlap, /slots shows the slots at work, and every slot is free after."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from .server_helpers import LiveServer

    prompts = [f"def g{i}(items):\n    " for i in range(8)]
    want = [r.text for r in _alone(shipped_model, prompts, max_tokens=24, ignore_eos=True)]
    server = LiveServer(SHIPPED, "--parallel", "4", "--log-level", "info")
    try:
        assert any("draft-mtp is not batched yet" in line for line in server.stderr)
        seen_slots: list = []
        first: dict[int, float] = {}
        ended: dict[int, float] = {}

        def one(i: int) -> str:
            c, resp = server.open_stream("/v1/completions", {"prompt": prompts[i], "max_tokens": 24,
                                                             "ignore_eos": True})
            text = []
            for raw in resp:  # event by event, as they arrive (sse_events reads them all first)
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                piece = json.loads(line[6:])["choices"][0].get("text") or ""
                if piece and i not in first:
                    first[i] = time.perf_counter()
                text.append(piece)
            ended[i] = time.perf_counter()
            c.close()
            return "".join(text)

        done = threading.Event()

        def watch() -> None:  # what /slots says while the streams run
            while not done.is_set():
                seen_slots.append(server.request("GET", "/slots")[1])
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with ThreadPoolExecutor(8) as ex:
                got = list(ex.map(one, range(8)))
        finally:
            done.set()
            watcher.join()
        assert got == want
        # 4 slots: the first four streams to start all start before any stream ends
        assert sorted(first.values())[3] < min(ended.values()), (first, ended)
        assert all(len(s) == 4 for s in seen_slots)
        assert max(sum(x["state"] != "idle" for x in s) for s in seen_slots) == 4, json.dumps(seen_slots)
        h = server.wait_idle()
        assert h["parallel"] == 4 and h["running"] == 0
        assert all(x["state"] == "idle" for x in server.request("GET", "/slots")[1])
        # a request the batch cannot take yet runs alone, with its MTP figures
        status, body = server.request("POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 8,
                                                                  "spec_type": "draft-mtp", "ignore_eos": True})
        assert status == 200 and want[0].startswith(body["choices"][0]["text"])
    finally:
        server.stop()
