"""Plain decoding vs draft-mtp at several n-max on the trained model: tok/s (median of repeats,
measured side by side in one process), acceptance, greedy parity.

Usage: python scripts/bench_quick.py [--model FILE] [-n 256] [--n-max 1,2,3,6] [--repeats 3] [--prompts FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import mlx.core as mx

import mtp_engine as me


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--n-max", default="1,2,3,6")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    pfile = Path(a.prompts) if a.prompts else next(p for p in [here / "scripts" / "prompts.json",
                                                              here.parent / "shared/fixtures/trained/prompts.json"]
                                                   if p.exists())
    prompts = [p["token_ids"] for p in json.loads(pfile.read_text())["prompts"]]
    m = me.load(a.model)
    print(f"device: {mx.default_device()}", file=sys.stderr)
    me.generate(prompts[0], m, max_tokens=16, ignore_eos=True)  # warm-up
    me.generate(prompts[0], m, max_tokens=16, ignore_eos=True, spec="draft-mtp")
    configs = [("none", 0)] + [("draft-mtp", int(k)) for k in a.n_max.split(",")]
    rows = []
    base_tokens = {}
    for spec, k in configs:
        speeds, drafted, accepted, same = [], 0, 0, 0
        for rep in range(a.repeats):
            tok, sec = 0, 0.0
            for i, ids in enumerate(prompts):
                r = me.generate(ids, m, max_tokens=a.n, ignore_eos=True, spec=spec, n_max=k)
                s = r.stats
                tok += s["generated_tokens"] - (0 if spec == "draft-mtp" else 1)
                sec += s["decode_seconds"]
                if rep == 0:
                    if spec == "none":
                        base_tokens[i] = r.token_ids
                    else:
                        drafted += s["drafted"]
                        accepted += s["accepted"]
                        same += r.token_ids == base_tokens[i]
            speeds.append(tok / sec)
        row = {"spec": spec, "n_max": k, "tok_s": statistics.median(speeds),
               "acceptance": accepted / drafted if drafted else None, "drafted": drafted, "accepted": accepted,
               "greedy_equal": f"{same}/{len(prompts)}" if spec != "none" else "-"}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    base = rows[0]["tok_s"]
    print("| config | decode tok/s | vs plain | acceptance | greedy = plain |")
    print("|---|---|---|---|---|")
    for r in rows:
        name = "plain" if r["spec"] == "none" else f"draft-mtp n-max {r['n_max']}"
        acc = f"{r['acceptance']:.1%}" if r["acceptance"] is not None else "-"
        print(f"| {name} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | {acc} | {r['greedy_equal']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
