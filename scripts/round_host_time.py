"""Host time to queue one device-resident round vs the round's wall time (is the host the limit?).

Usage: python3 scripts/round_host_time.py [--layers 32] [--small] [--k 3] [--a 0.8] [--tokens 128]
(GPU: the 9B shape with random 4-bit weights; CPU: pass --small for an 8-layer model.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_9b_oracle import config_9b, decode_tps, random_model, _Tok  # noqa: E402
from mtp_engine.generation.loop import run  # noqa: E402
from mtp_engine.generation.sampling import Sampler, SamplerConfig  # noqa: E402
from mtp_engine.speculative.ablations import ablation_decoder  # noqa: E402
from mtp_engine.speculative.config import DraftParams  # noqa: E402
from mtp_engine.speculative import resident  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--ks", default="1,3")
    ap.add_argument("--a", type=float, default=0.8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    model = random_model(config_9b(a.small))
    # host time per part of a round: building its graph (launch, incl. async_eval), the async_eval
    # call alone, and the read of a finished round (mostly waiting for the device)
    parts: dict[str, list[float]] = {"launch": [], "async_eval": [], "read": []}

    def timed(name, orig):
        def wrapper(self, *args):
            t = time.perf_counter()
            r = orig(self, *args)
            parts[name].append(time.perf_counter() - t)
            return r
        return wrapper

    R = resident.ResidentRounds
    R._launch_resident = timed("launch", R._launch_resident)
    R._queue = timed("async_eval", R._queue)
    R._complete_resident = timed("read", R._complete_resident)
    prompt = list(range(100, 164))
    ks = [int(x) for x in a.ks.split(",")]
    for k in ks:  # warm-up: every shape traced once
        decode_tps(model, prompt, 24, "draft-mtp", k, a.a)
    decode_tps(model, prompt, 24)
    for rep in range(3):
        row = {"rep": rep, "plain_ms": 1e3 / decode_tps(model, prompt, a.tokens)[0]}
        for k in ks:
            for v in parts.values():
                v.clear()
            dec = ablation_decoder(model, Sampler(SamplerConfig(seed=0)), DraftParams(k), oracle_acceptance=a.a)
            last = None
            for last in run(dec, _Tok(), prompt, a.tokens, ignore_eos=True):
                pass
            rounds = [s for _, s, first in dec.clock.rounds if not first]
            row[f"k{k}"] = {**{f"{n}_ms": round(statistics.median(v) * 1e3, 3) for n, v in parts.items() if v},
                            "round_ms": round(statistics.median(rounds) * 1e3, 3),
                            "tok_s": round(last.stats["decode_tokens_per_second"], 1),
                            "speedup": round(last.stats["decode_tokens_per_second"] * row["plain_ms"] / 1e3, 3),
                            "acceptance": round(last.stats["acceptance_rate"], 3)}
        print(json.dumps(row), flush=True)
    if a.profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        decode_tps(model, prompt, a.tokens, "draft-mtp", ks[-1], a.a)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
