"""Kernels launched by one decode step (and one S-token verify) at Qwen3.5-9B shape, and their GPU
time: run under Nsight Compute, which records every kernel between cuProfilerStart/Stop.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        python3 scripts/kernel_census.py --config fused --tokens 1 > census.csv
    python3 scripts/kernel_census.py --summarize census.csv

Configurations are bench_gpu.py's (compiled steps, row padding, custom product kernel, fused GDN).
Without ncu the script still runs the step (a check that it works) and prints nothing else.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import io
import json
import sys
from collections import Counter

import mlx.core as mx

sys.path.insert(0, __file__.rsplit("/", 1)[0])


def summarize(path: str) -> dict:
    text = open(path).read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    ns: dict[int, float] = {}
    names: dict[int, str] = {}
    for r in rows:
        if r.get("Metric Name") == "gpu__time_duration.sum":
            i = int(r["ID"])
            v = float(r["Metric Value"].replace(",", ""))
            ns[i] = v * (1e3 if r.get("Metric Unit") == "usecond" else 1e6 if r.get("Metric Unit") == "msecond" else 1)
            names[i] = r["Kernel Name"].split("(")[0][:60]
    by: Counter = Counter()
    t: Counter = Counter()
    for i, n in names.items():
        by[n] += 1
        t[n] += ns[i]
    top = sorted(t.items(), key=lambda kv: -kv[1])[:15]
    return {"kernels": len(ns), "gpu_ms": sum(ns.values()) / 1e6,
            "top": [{"kernel": k, "count": by[k], "ms": v / 1e6} for k, v in top]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="fused")
    ap.add_argument("--tokens", type=int, default=1, help="rows of the measured forward (1: a decode step)")
    ap.add_argument("--round", type=int, default=None,
                    help="instead: 4 steady device-resident draft-mtp rounds of this k (0: plain), a = 0.8")
    ap.add_argument("--summarize", default=None, help="a CSV written by ncu: print kernel counts and times")
    a = ap.parse_args()
    if a.summarize:
        print(json.dumps(summarize(a.summarize), indent=1))
        return 0
    if a.round is not None:
        return census_rounds(a.config, a.round)
    from bench_9b_oracle import config_9b, random_model
    from bench_gpu import use
    model = random_model(config_9b(False))
    use(model, a.config)
    cache = model.make_cache()
    mx.eval(model.forward(mx.array([list(range(100, 164))]), cache), *cache.arrays())
    ids = mx.array([list(range(7, 7 + a.tokens))])
    for _ in range(3):  # trace, compile and warm the graph outside the profiled range
        snap = cache.snapshot()
        h = model.forward(ids, cache, capture=a.tokens > 1)
        mx.eval(mx.argmax(model.logits(h[0]), axis=-1), *cache.arrays())
        cache.restore(snap)
    cuda = _profiler()
    mx.synchronize()
    if cuda:
        cuda.cuProfilerStart()
    h = model.forward(ids, cache, capture=a.tokens > 1)
    mx.eval(mx.argmax(model.logits(h[0]), axis=-1), *cache.arrays())
    mx.synchronize()
    if cuda:
        cuda.cuProfilerStop()
    return 0


def _profiler():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def census_rounds(config: str, k: int, first: int = 12, count: int = 4) -> int:
    """Profiles rounds first..first+count-1 of a draft-mtp generation: the device is drained before
    the first is queued and after the last, so the range holds exactly their kernels (divide the
    summary by `count`)."""
    from bench_9b_oracle import config_9b, decode_tps, random_model
    from bench_gpu import use
    from mtp_engine.speculative import resident
    model = random_model(config_9b(False))
    use(model, config)
    cuda, seen = _profiler(), [0]
    launch = resident.ResidentRounds._launch_resident

    def counted(self, kk):
        seen[0] += 1
        if seen[0] in (first, first + count):
            mx.synchronize()
            if cuda:
                (cuda.cuProfilerStart if seen[0] == first else cuda.cuProfilerStop)()
        return launch(self, kk)

    prompt = list(range(100, 164))
    decode_tps(model, prompt, 32, "draft-mtp", k, 0.8)  # trace and compile every shape
    resident.ResidentRounds._launch_resident = counted
    decode_tps(model, prompt, 4 * (first + count + 2), "draft-mtp", k, 0.8)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
