"""The server's own cost per streamed chunk, without a model: a thread puts N chunk events on a job
the way the generation worker does (`Job.put`), while the event loop turns them into SSE text with
the real `Generation.stream`; reports microseconds of the loop's work and of the hand-over per
chunk. On a GPU each plain token is one chunk of ~2 ms (the shipped model), so tens of
microseconds here are percents of `bench_server.py`'s ratio; this runs anywhere.

    python scripts/server_hops.py [-n 20000] [--trace]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtp_engine.generation.loop import Chunk  # noqa: E402
from mtp_engine.server.app import Generation, _next_event  # noqa: E402
from mtp_engine.server.worker import Event, Job  # noqa: E402


class _Request:
    async def is_disconnected(self) -> bool:
        return False


async def one_run(n: int, trace: bool, paced: bool) -> tuple[float, float, float]:
    """(loop CPU seconds, wall seconds, writes) per chunk for n chunks."""
    loop = asyncio.get_running_loop()
    prepared = SimpleNamespace(tool_format=None, prompt_ids=[1, 2, 3])
    job = Job(prepared, trace, loop)
    state = SimpleNamespace(worker=SimpleNamespace(model=SimpleNamespace(tokenizer=None)), model_name="m")
    req = SimpleNamespace(kind="completion", tools=None, logprobs=None, mtp_trace=trace, include_usage=False)
    chunks = [Chunk(text=" tok", token_ids=[100 + i % 50], drafted=[False]) for i in range(n)]
    last = Chunk(text="", token_ids=[], finish_reason="length", stats={"decode_seconds": 1.0})

    def produce() -> None:  # the worker's side: one put per chunk, paced like a fast GPU
        for c in chunks:
            job.put(Event("chunk", c, [c.text] if trace else [], prompt_tokens=3))
            if paced:
                time.sleep(0.0005)
        job.put(Event("chunk", last, [""] if trace else [], prompt_tokens=3))
        job.put(Event("done", prompt_tokens=3))

    gen = Generation(state, req, job)
    t = threading.Thread(target=produce)
    t.start()
    first = await _next_event(job, _Request())
    w0, c0 = time.perf_counter(), time.thread_time()
    writes = 0
    async for _ in gen.stream(first, _Request()):
        writes += 1
    cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
    t.join()
    return cpu / n, wall / n, writes / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--trace", action="store_true", help="with the mtp trace per chunk (bench_server.py asks for it)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    for paced in (False, True):
        runs = [asyncio.run(one_run(a.n if not paced else a.n // 10, a.trace, paced)) for _ in range(a.repeats)]
        cpu = statistics.median(r[0] for r in runs) * 1e6
        wall = statistics.median(r[1] for r in runs) * 1e6
        writes = statistics.median(r[2] for r in runs)
        print(f"{'paced 0.5 ms' if paced else 'back to back'}: loop CPU {cpu:.1f} us/chunk, wall {wall:.1f} us/chunk, "
              f"{writes:.2f} writes/chunk"
              f"{' (mtp trace)' if a.trace else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
