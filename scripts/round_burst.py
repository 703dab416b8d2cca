"""A round's pace with the host out of the way: rounds (and each part of one) queued back to back
with no host read between them, against the same rounds run by the decode loop.

For each k: `loop` = the loop's median round (host reads round r while r+1 runs); `burst` = R rounds
queued by `_launch_resident` alone, then one evaluation (per round: max(host encode, device time),
as far as MLX's queue of 10 in-flight graphs lets the host run ahead); `host` = the host's share of
that burst (building and queuing, including any wait in `mx.async_eval`). Parts, each queued R times
alone: the drafts (`draft_resident(k)`: the head's block and k steps with their output heads), the
verify (k+1 trunk rows, logits, argmax, rollback), and a plain step.

Usage (GPU): python3 scripts/round_burst.py [--ks 0,1,3,4] [--a 0.8] [--bursts 16] [--small]
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
from bench_9b_oracle import _Tok, config_9b, random_model  # noqa: E402
from mtp_engine.generation.loop import run  # noqa: E402
from mtp_engine.generation.sampling import Sampler, SamplerConfig  # noqa: E402
from mtp_engine.speculative.ablations import ablation_decoder  # noqa: E402
from mtp_engine.speculative.config import DraftParams  # noqa: E402


def _decoder(model, k: int, a: float, prompt: list[int], room: int):
    dec = ablation_decoder(model, Sampler(SamplerConfig(seed=0)), DraftParams(max(k, 1)), oracle_acceptance=a)
    dec.pipeline, dec.budget = True, 1 << 20
    dec.prefill(prompt)
    for c in dec.cache.layers:  # capacity for every burst now: a growth inside one is a retrace
        if hasattr(c, "reserve"):
            c.reserve(c.limit + room)
    dec.drafter.cache.reserve(dec.drafter.cache.limit + room)
    return dec


def _timed(launch, R: int) -> tuple[float, float]:
    """(host ms, wall ms) per launch for R launches queued back to back, then one evaluation."""
    t0 = time.perf_counter()
    outs = None
    for _ in range(R):
        outs = launch()
    t1 = time.perf_counter()
    mx.eval(outs)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3 / R, (t2 - t0) * 1e3 / R


def parts(model, k: int, a: float, prompt: list[int], R: int, reps: int) -> dict:
    dec = _decoder(model, k, a, prompt, room=(3 * reps + 3) * R * (k + 2) + 64)

    def round_():
        r = dec._launch_resident(k) if k else dec._launch_resident_plain()
        return [r.round.emitted]

    def draft():
        tokens, _, _ = dec.drafter.draft_resident(k)
        mx.async_eval(tokens)
        return [tokens]

    ids = mx.zeros((1, k + 1), dtype=mx.int32)

    def verify():
        post, _ = model.forward(ids, dec.cache, capture=True, return_prenorm=True, resident=True)
        t = mx.argmax(model.logits(post[0]), axis=-1)
        dec.cache.rollback_lazy(mx.array(k + 1))
        mx.async_eval(t)
        return [t]

    launches = {"burst": round_} | ({"draft": draft, "verify": verify} if k else {})
    for f in launches.values():  # warm-up: every graph traced at the capacity the bursts use
        _timed(f, 3)
    res: dict[str, list] = {}
    for _ in range(reps):  # interleaved
        for name, f in launches.items():
            res.setdefault(name, []).append(_timed(f, R))
    out = {}
    for name, v in res.items():
        out[f"{name}_ms"] = round(statistics.median(w for _, w in v), 3)
        out[f"{name}_host_ms"] = round(statistics.median(h for h, _ in v), 3)
    return out


def loop_round(model, k: int, a: float, prompt: list[int], tokens: int) -> float:
    dec = ablation_decoder(model, Sampler(SamplerConfig(seed=0)), DraftParams(k), oracle_acceptance=a)
    for _ in run(dec, _Tok(), prompt, tokens, ignore_eos=True):
        pass
    rounds = [s for _, s, first in dec.clock.rounds if not first]
    return statistics.median(rounds) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="8 layers (a check that it runs)")
    ap.add_argument("--ks", default="0,1,3,4")
    ap.add_argument("--a", type=float, default=0.8)
    ap.add_argument("--bursts", type=int, default=16, help="rounds per burst")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96, help="tokens of the loop runs")
    a = ap.parse_args()
    t = time.perf_counter()
    model = random_model(config_9b(a.small))
    print(f"model built in {time.perf_counter() - t:.0f}s on {mx.default_device()}", file=sys.stderr, flush=True)
    prompt = list(range(100, 164))
    for k in [int(x) for x in a.ks.split(",")]:
        loop_round(model, k, a.a, prompt, 24)  # warm-up
        row = {"k": k, "loop_ms": round(statistics.median(loop_round(model, k, a.a, prompt, a.tokens)
                                                          for _ in range(a.repeats)), 3)}
        row |= parts(model, k, a.a, prompt, a.bursts, a.repeats)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
