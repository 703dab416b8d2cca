"""What a grammar costs: decode tokens/s of JSON-schema-constrained generation against the same
generation unconstrained, plain and draft-mtp, repeats interleaved in one process (medians).

The constrained and unconstrained texts differ (the grammar changes what is generated), so each
rate is over its own tokens; the constrained draft-mtp text must equal plain constrained decoding's
(the script fails otherwise).

    python scripts/bench/bench_constraint.py --repeats 5 --out docs/bench/constraint/cpu.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path


import mlx.core as mx

import mtp_engine as me

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "version": {"type": "string", "maxLength": 12},
    "dependencies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 4, "maxItems": 8},
    "scripts": {"type": "object", "properties": {"test": {"type": "string", "maxLength": 40},
                                                 "build": {"type": "string", "maxLength": 40}},
                "required": ["test", "build"], "additionalProperties": False}},
    "required": ["name", "version", "dependencies", "scripts"], "additionalProperties": False}
PROMPT = "import json\n\nPACKAGE = json.loads('''"
CONFIGS = [("plain", dict(spec="none")), ("draft-mtp n-max 3", dict(spec="draft-mtp", n_max=3)),
           ("draft-mtp auto", dict(spec="draft-mtp"))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the model in models/)")
    ap.add_argument("-n", "--tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    model = me.load(args.model)
    constraint = me.Constraint.json(SCHEMA)
    runs: dict[tuple[str, bool], list[float]] = {}
    texts: dict[tuple[str, bool], str] = {}
    for rep in range(args.repeats + 1):  # the first round warms up
        for name, kw in (CONFIGS if rep % 2 else CONFIGS[::-1]):
            for constrained in ((False, True) if rep % 2 else (True, False)):
                r = me.generate(PROMPT, model=model, max_tokens=args.tokens, constraint=constraint if constrained else None,
                                **kw)
                if rep:
                    runs.setdefault((name, constrained), []).append(r.stats["decode_tokens_per_second"])
                texts[(name, constrained)] = r.text
        print(f"repeat {rep}/{args.repeats}", file=sys.stderr)
    ref = texts[("plain", True)]
    json.loads(ref)
    if any(texts[(n, True)] != ref for n, _ in CONFIGS):
        print("constrained draft-mtp differs from plain constrained decoding", file=sys.stderr)
        return 1
    rows = []
    print(f"{'config':<20} {'free tok/s':>10} {'JSON tok/s':>10} {'ratio':>6}")
    for name, _ in CONFIGS:
        a, b = statistics.median(runs[(name, False)]), statistics.median(runs[(name, True)])
        rows.append({"config": name, "free_tok_s": a, "json_tok_s": b, "ratio": b / a})
        print(f"{name:<20} {a:>10.1f} {b:>10.1f} {b / a:>6.3f}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"model": Path(model.path).name, "device": str(mx.default_device()),
                                   "machine": platform.machine(), "tokens": args.tokens, "repeats": args.repeats,
                                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                   "json_text": ref, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
