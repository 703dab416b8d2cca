"""What n-max auto costs when it does not draft (issue 23 point 4): plain decoding, draft-mtp n-max 0
and draft-mtp n-max auto through `generate()`, interleaved config by config in every repeat (so a
machine that speeds up or slows down during the run moves all three alike), medians and ratios.

On a device where auto decides drafting cannot pay (this CPU), its rounds are plain steps through
the speculative decoder: the ratio auto / plain is the price of that path and of the scheduler.

    python scripts/auto_idle_cost.py [-m MODEL] [-n 64] [--repeats 8] [--prompts scripts/prompts.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mtp_engine import api  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--prompts", default=str(Path(__file__).with_name("prompts.json")))
    a = ap.parse_args()
    data = json.loads(Path(a.prompts).read_text())
    first = (data["prompts"] if isinstance(data, dict) else data)[0]
    prompt = first if isinstance(first, str) else first["prompt"]
    model = api.load(a.model)
    configs = {"plain": {"spec": None}, "n-max 0": {"spec": "draft-mtp", "n_max": 0},
               "auto": {"spec": "draft-mtp", "n_max": "auto"}}
    for kw in configs.values():  # warm-up
        api.generate(prompt, model, max_tokens=16, ignore_eos=True, **kw)
    tps: dict = {k: [] for k in configs}
    for rep in range(a.repeats):
        for name, kw in configs.items():
            r = api.generate(prompt, model, max_tokens=a.tokens, ignore_eos=True, **kw)
            tps[name].append(r.stats["decode_tokens_per_second"])
        print(json.dumps({"repeat": rep + 1, **{k: round(v[-1], 2) for k, v in tps.items()}}), file=sys.stderr,
              flush=True)
    med = {k: statistics.median(v) for k, v in tps.items()}
    print(json.dumps({"tok_s": {k: round(v, 2) for k, v in med.items()},
                      "over_plain": {k: round(v / med["plain"], 3) for k, v in med.items()},
                      "all": tps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
