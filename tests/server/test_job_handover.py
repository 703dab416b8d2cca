"""The hand-over of a job's events from the generation thread to the event loop (server/worker.Job):
one wake-up in flight at a time, the handler taking what has arrived. Nothing may be lost,
reordered or left waiting, whatever the interleaving of the two threads."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from types import SimpleNamespace

from mtp_engine.generation.loop import Chunk
from mtp_engine.server.answer import Generation, next_event
from mtp_engine.server.worker import Event, Job


class _Request:
    async def is_disconnected(self) -> bool:
        return False


def test_every_event_arrives_once_in_order_under_any_interleaving():
    async def run(seed: int) -> list[int]:
        loop = asyncio.get_running_loop()
        job = Job(SimpleNamespace(tool_format=None, prompt_ids=[1]), False, loop)
        rng = random.Random(seed)
        pauses = [rng.choice([0.0, 0.0, 0.0, 1e-5, 2e-4]) for _ in range(3000)]

        def produce() -> None:
            for i, p in enumerate(pauses):
                job.put(Event("chunk", Chunk(str(i), [i])))
                if p:
                    time.sleep(p)
            job.put(Event("done"))

        threading.Thread(target=produce).start()
        got = []
        while True:
            ev = await next_event(job, _Request())
            if ev.kind == "done":
                return got
            got.append(ev.chunk.token_ids[0])
            if rng.random() < 0.01:
                await asyncio.sleep(1e-3)  # a busy handler: events pile up meanwhile

    for seed in range(3):
        assert asyncio.run(run(seed)) == list(range(3000))


def test_a_stream_writes_what_has_arrived_together_and_every_event_once():
    async def run() -> str:
        loop = asyncio.get_running_loop()
        job = Job(SimpleNamespace(tool_format=None, prompt_ids=[1]), True, loop)
        for i in range(50):  # all arrived before the handler runs: one write
            job.put(Event("chunk", Chunk(f"t{i} ", [i], drafted=[False], pieces=[f"t{i} "]), [f"t{i} "]))
        job.put(Event("chunk", Chunk("", [], "length", {"decode_seconds": 1.0})))
        job.put(Event("done", prompt_tokens=1))
        state = SimpleNamespace(worker=SimpleNamespace(model=SimpleNamespace(tokenizer=None)), model_name="m", metrics=None)
        req = SimpleNamespace(kind="completion", tools=None, logprobs=None, mtp_trace=True, include_usage=False)
        gen = Generation(state, req, job)
        first = await next_event(job, _Request())
        writes = [s async for s in gen.stream(first, _Request())]
        assert len(writes) <= 3, len(writes)  # the tokens, the end, [DONE]
        return "".join(writes)

    import json
    text = asyncio.run(run())
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e and e != "data: [DONE]"]
    tokens = [t["id"] for e in events for t in e.get("mtp", {}).get("tokens", []) if "usage" not in e["mtp"]]
    assert "".join(e["choices"][0]["text"] for e in events) == "".join(f"t{i} " for i in range(50))
    assert tokens == list(range(50))


def test_a_lone_job_makes_and_hands_over_its_tokens_on_the_engine_thread(monkeypatch):
    # with one slot the job runs where its stream runs (threads.on_engine_thread): read from the
    # worker thread instead, each token crossed a thread before its hand-over to the loop
    from tests.conftest import TINY_Q4, need
    from mtp_engine.request import prepare, request_from_keywords
    from mtp_engine.server import worker as W

    put_on: list[str] = []
    real_put = Job.put

    def put(self, event):
        put_on.append(threading.current_thread().name)
        real_put(self, event)

    monkeypatch.setattr(Job, "put", put)
    w = W.GenerationWorker(str(need(TINY_Q4)), queue_size=2)
    w.start()
    loop = asyncio.new_event_loop()
    try:
        model = W.wait_ready(w, timeout=60)
        job = Job(prepare(model, request_from_keywords("x", max_tokens=5, ignore_eos=True)), False, loop)
        w.submit(job)
        deadline = time.monotonic() + 60
        while w.completed < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        kinds = [e.kind for e in job._events]
        assert kinds[-1] == "done" and kinds.count("chunk") >= 1, kinds
        assert set(put_on) == {"mtp-engine-mlx"}, put_on
    finally:
        w.stop()
        loop.close()
