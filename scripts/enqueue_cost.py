"""Host cost of queuing each part of a round (mx.async_eval returns once the work is encoded)
against its device time, 9B shape with random 4-bit weights: is a round host-bound?

Usage (GPU): python3 scripts/enqueue_cost.py [--small]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_9b_oracle import config_9b, random_model  # noqa: E402


def timed(fn, reps=20) -> dict:
    enq, tot = [], []
    for i in range(reps + 3):
        t = time.perf_counter()
        outs = fn()
        mx.async_eval(*outs)
        t1 = time.perf_counter()
        mx.eval(*outs)
        t2 = time.perf_counter()
        if i >= 3:
            enq.append(t1 - t)
            tot.append(t2 - t)
    return {"enqueue_ms": round(statistics.median(enq) * 1e3, 3), "total_ms": round(statistics.median(tot) * 1e3, 3)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    model = random_model(config_9b(a.small))
    cache = model.make_cache()
    model.forward(mx.array([list(range(100, 164))]), cache)
    mx.eval(cache.arrays())
    out = {}

    def plain():
        h = model.forward(mx.array([[5]]), cache)
        cache.rollback  # noqa: B018
        for c in cache.layers:
            if hasattr(c, "truncate"):
                c.truncate(c.offset - 1)
        cache.offset -= 1
        return [mx.argmax(model.logits(h[0, -1]))] + cache.arrays()

    out["plain_step"] = timed(plain)
    for s in (2, 4, 8):
        def verify(s=s):
            h = model.forward(mx.array([list(range(5, 5 + s))]), cache, capture=True)
            cache.rollback(s)  # keep all: nothing rebuilt
            for c in cache.layers:
                if hasattr(c, "truncate"):
                    c.truncate(c.offset - s)
            cache.offset -= s
            return [mx.argmax(model.logits(h[0]), axis=-1)] + cache.arrays()
        out[f"verify_{s}"] = timed(verify)

        def verify_rollback(s=s):
            h = model.forward(mx.array([list(range(5, 5 + s))]), cache, capture=True, resident=True)
            cache.rollback_lazy(mx.array(1, dtype=mx.int32))
            for c in cache.layers:
                if hasattr(c, "truncate"):
                    c.truncate(c.bound - s)
            return [mx.argmax(model.logits(h[0]), axis=-1)] + cache.arrays()
        cache.kv_to_device()
        out[f"verify_{s}+rollback"] = timed(verify_rollback)
        cache.to_host()
    head = model.mtp.make_cache()
    hid = mx.zeros((1, 1, model.cfg.hidden_size))
    model.mtp(model.embed_tokens(mx.array([list(range(64))])), mx.zeros((1, 64, model.cfg.hidden_size)), head)

    def head_step():
        h = model.mtp(model.embed_tokens(mx.array([[7]])), hid, head)
        head.truncate(head.offset - 1)
        return [mx.argmax(model.logits(h[0, 0]))]
    out["head_step"] = timed(head_step)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
