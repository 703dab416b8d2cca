"""Where n-max auto loses to the best fixed draft length: every round of an auto run, beside the
rounds of fixed n-max runs, at the 9B shape (random 4-bit g32 weights, oracle acceptance a).

For each a: plain, n-max 1..4 and auto decode the same prompt (after a warm-up that used every
shape), and the script prints per run its tok/s and, per k, the median of the rounds' wall times
(the interval between host reads) in ms; for auto also its rounds in order (k, accepted, ms, and
which the scheduler timed as steady) and what it believed at the end (acceptance per position,
t(k)/t(0) per k). The difference between auto's rounds and the fixed runs' is its learning cost.

Usage (GPU): python3 scripts/auto_trace.py [--accs 0.5,0.9] [--tokens 128] [--costs FILE] [--small]
`--costs FILE`: a stored costs.json entry's round_steps ({k: plain steps}) seeds auto, as a second
run on a device would; without it auto starts from the GPU prior, as a first run does.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_9b_oracle import config_9b, decode_tps, random_model  # noqa: E402
from mtp_engine.speculative.scheduler import DraftLengthScheduler  # noqa: E402


class TracedScheduler(DraftLengthScheduler):
    """The production scheduler, recording what each observation told it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: list[tuple] = []

    def observe(self, drafted, n, seconds, context=0, first_use=False, steady=True):
        self.log.append((drafted, n, round(seconds * 1e3, 2), first_use, steady))
        super().observe(drafted, n, seconds, context, first_use, steady)


EARLY: dict = {}  # run name -> its first rounds' ms (is a run's start slow whatever the policy?)


def decode(model, prompt, tokens, k=None, a=None, costs=None, name=None):
    """(tok/s, {k: median ms of its warm rounds}, the scheduler or None) of one run."""
    decs: list = []
    tps, _ = decode_tps(model, prompt, tokens, None if k is None else "draft-mtp", k, a, costs, TracedScheduler, decs)
    laps: dict = {}
    rounds = decs[0].clock.rounds if hasattr(decs[0], "clock") else []
    for kk, s, first in rounds:
        if not first:
            laps.setdefault(kk, []).append(s * 1e3)
    if name:
        EARLY[name] = [round(s * 1e3, 1) for _, s, _ in rounds[:24]]
    return tps, {kk: round(statistics.median(v), 2) for kk, v in sorted(laps.items())}, getattr(decs[0], "scheduler", None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--accs", default="0.5,0.9")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--costs", default="", help="JSON {k: plain steps} seeding auto")
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    costs = {int(k): float(v) for k, v in json.loads(Path(a.costs).read_text()).items()} if a.costs else None
    model = random_model(config_9b(a.small))
    prompt = list(range(100, 164))
    accs = [float(x) for x in a.accs.split(",")]
    t = time.perf_counter()
    decode(model, prompt, 16)
    for k in (1, 2, 3, 4, "auto"):
        decode(model, prompt, 24, k, 0.8, costs)
    for acc in accs:  # auto's fallback to plain steps and back: head block widths fixed runs never use
        decode(model, prompt, a.tokens, "auto", acc, costs)
    print(f"warm-up {time.perf_counter() - t:.1f} s", flush=True)
    for acc in accs:
        plain, laps, _ = decode(model, prompt, a.tokens, name="plain")
        print(f"a={acc} plain {plain:.1f} tok/s laps {laps}", flush=True)
        for k in (1, 2, 3, 4):
            tps, laps, _ = decode(model, prompt, a.tokens, k, acc, name=f"n-max {k}")
            print(f"a={acc} n-max {k}: {tps / plain:.2f}x laps {laps}", flush=True)
        tps, laps, sched = decode(model, prompt, a.tokens, "auto", acc, costs, name="auto")
        print(f"a={acc} auto: {tps / plain:.2f}x laps {laps}", flush=True)
        print("  first rounds' ms per run:", "; ".join(f"{n}: {' '.join(map(str, v))}" for n, v in EARLY.items()),
              flush=True)
        print("  rounds (k, n, ms, first, steady):", " ".join(
            f"{d}/{n}/{ms}{'F' if f else ''}{'' if s else 'u'}" for d, n, ms, f, s in sched.log), flush=True)
        print(f"  alphas {[round(x, 2) for x in sched.alphas()]} round_steps "
              f"{ {k: round(sched.round_steps(k), 2) for k in range(1, sched.k_max + 1)} } "
              f"t0 {sched.step_seconds() and round(sched.step_seconds() * 1e3, 2)} ms seed {sched.seed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
