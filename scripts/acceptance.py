"""Greedy draft-mtp acceptance per n-max on the trained model, next to llama.cpp's figures.

Usage: python scripts/acceptance.py [--model FILE] [--prompts FILE] [-n 256] [--n-max 1,2,3,6] [--out FILE.json]
Prompts are the fixture's held-out code prompts (token ids), as in llama.cpp's measurement.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mtp_engine as me

# llama.cpp, same model file (Q4_K_M), 5 prompts x 256 tokens, temperature 0 (fixture README)
LLAMACPP_Q4_K_M = {1: (670, 619), 2: (1010, 788), 3: (1303, 859), 6: (2137, 941)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / "shared/fixtures/trained/prompts.json"))
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--n-max", default="1,2,3,6")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    m = me.load(a.model)
    prompts = [p["token_ids"] for p in json.loads(Path(a.prompts).read_text())["prompts"]]
    rows = []
    base = [me.generate(ids, m, max_tokens=a.n, ignore_eos=True).token_ids for ids in prompts]
    for n_max in [int(x) for x in a.n_max.split(",")]:
        drafted = accepted = same = 0
        t = time.perf_counter()
        for ids, b in zip(prompts, base):
            r = me.generate(ids, m, max_tokens=a.n, spec="draft-mtp", n_max=n_max, ignore_eos=True)
            drafted += r.stats["drafted"]
            accepted += r.stats["accepted"]
            same += r.token_ids == b
        ref = LLAMACPP_Q4_K_M.get(n_max)
        row = {"n_max": n_max, "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted,
               "greedy_equal": f"{same}/{len(prompts)}",
               "llamacpp_drafted": ref[0] if ref else None, "llamacpp_accepted": ref[1] if ref else None,
               "llamacpp_acceptance": ref[1] / ref[0] if ref else None}
        rows.append(row)
        print(json.dumps(row), f"({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    print(f"{'n-max':>5} {'drafted':>8} {'accepted':>8} {'ours':>7} {'llama.cpp':>9}  greedy=plain")
    for r in rows:
        lc = f"{r['llamacpp_acceptance']:.1%}" if r["llamacpp_acceptance"] is not None else "-"
        print(f"{r['n_max']:>5} {r['drafted']:>8} {r['accepted']:>8} {r['acceptance']:>7.1%} {lc:>9}  {r['greedy_equal']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
