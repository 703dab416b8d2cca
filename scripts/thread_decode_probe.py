"""Does decoding slow down off the main thread? (issue 24: the server's worker decoded at 0.78x of
`stream_generate()` in the bench's own process, measured inside the worker, so the loss is in the
decoding thread, not in HTTP.) The same greedy stream of N tokens, repeats interleaved:
  main    - stream_generate() on the main thread, as bench_server.py's in-process side;
  thread  - the same in a thread, the main thread blocked in join();
  loop    - the same in a thread that hands every chunk to an asyncio loop on the main thread with
            call_soon_threadsafe (the server's hop, minus HTTP), the thread reading the stream;
  engine  - that thread runs the whole read on the engine thread (`threads.on_engine_thread`, as the
            server's lone job does): the chunks go from the decoding thread straight to the loop.
Medians of tokens/s after the first chunk, and each mode's ratio to `main`.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/thread_decode_probe.py [-n 256] [--repeats 7] [--spec none]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtp_engine import load, stream_generate  # noqa: E402
from mtp_engine.threads import on_engine_thread  # noqa: E402

PROMPT = "def parse_args(argv):\n    \"\"\"Parse the command line of the tool.\"\"\"\n"


def decode_rate(model, args, on_chunk=None) -> float:
    first = last = None
    n = 0
    for ch in stream_generate(PROMPT, model, max_tokens=args.tokens, spec=args.spec, n_max=args.n_max,
                              ignore_eos=True):
        if ch.token_ids:
            if first is None:
                first, n = time.perf_counter(), -len(ch.token_ids)
            n += len(ch.token_ids)
            last = time.perf_counter()
        if on_chunk is not None:
            on_chunk(ch)
    return n / (last - first)


def in_thread(fn) -> float:
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def with_loop(model, args, on_engine: bool = False) -> float:
    async def run() -> float:
        loop = asyncio.get_running_loop()
        got = []
        done = loop.create_future()

        def read() -> float:
            return decode_rate(model, args, lambda ch: loop.call_soon_threadsafe(got.append, ch))

        def worker():
            r = on_engine_thread(read) if on_engine else read()
            loop.call_soon_threadsafe(done.set_result, r)

        threading.Thread(target=worker).start()
        return await done

    return asyncio.run(run())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", "--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--spec", default="none")
    ap.add_argument("--n-max", default="auto")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (s)")
    args = ap.parse_args()
    args.n_max = args.n_max if args.n_max == "auto" else int(args.n_max)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    model = load(args.model)
    modes = {"main": lambda: decode_rate(model, args),
             "thread": lambda: in_thread(lambda: decode_rate(model, args)),
             "loop": lambda: with_loop(model, args),
             "engine": lambda: with_loop(model, args, on_engine=True)}
    for f in modes.values():  # warm-up: compile and trace each path once
        f()
    rates: dict[str, list[float]] = {k: [] for k in modes}
    for r in range(args.repeats):
        for k, f in modes.items():
            rates[k].append(f())
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()),
              file=sys.stderr, flush=True)
    base = statistics.median(rates["main"])
    print(f"spec {args.spec}, {args.tokens} tokens, switch interval {sys.getswitchinterval() * 1e3:.1f} ms: "
          + ", ".join(f"{k} {statistics.median(v):.1f} tok/s ({statistics.median(v) / base:.3f}x)"
                      for k, v in rates.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
