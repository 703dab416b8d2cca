"""Time to first token of a multi-turn chat with and without the prompt cache.

A chat of T turns on one model (ChatML when the model has no template): each turn sends the whole
conversation so far plus a new user message and generates N tokens. Run twice per repeat, with a
`PromptCache` and without, alternating which goes first; per turn, the median time to first token
of each and their ratio; the answers must be the same (greedy). A plot of TTFT per turn is written
beside the JSON when matplotlib is there.

    python scripts/bench/bench_prompt_cache.py --turns 6 -n 32 --repeats 3 --out docs/bench/prompt_cache/cpu.json
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
from mtp_engine.chat.template import CHATML

SYSTEM = ("You are a careful senior Python reviewer. Read the code the user sends, explain what it does, "
          "point out bugs and suggest fixes with short code examples. ") * 6
QUESTIONS = ["def parse(argv):\n    args = {}\n    for a in argv:\n        k, v = a.split('=')\n        args[k] = v\n    return args",
             "What happens with an argument without '='?", "Rewrite it with argparse.",
             "Add a --verbose flag.", "Now write a test for it with pytest.", "How would you type-annotate it?",
             "Make it work for repeated keys.", "Summarise the changes."]


def chat(model, turns: int, n: int, cache: me.PromptCache | None, spec: str) -> tuple[list[float], list[str], list[int]]:
    messages = [{"role": "system", "content": SYSTEM}]
    ttft, answers, cached = [], [], []
    for t in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        t0 = time.perf_counter()
        r = me.generate(messages=messages, model=model, max_tokens=n, spec=spec, prompt_cache=cache, ignore_eos=True)
        wall = time.perf_counter() - t0
        ttft.append(r.stats.get("time_to_first_token_seconds", wall))
        cached.append(r.stats["cached_prompt_tokens"])
        answers.append(r.text)
        messages.append({"role": "assistant", "content": r.text})
    return ttft, answers, cached


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the model in models/)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("-n", "--tokens", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spec", default="draft-mtp", choices=["none", "draft-mtp"])
    ap.add_argument("--out", default=None, help="write the results as JSON here (and a .png beside it)")
    args = ap.parse_args()
    model = me.load(args.model)
    if model.tokenizer.chat_template is None:
        model.tokenizer.chat_template = CHATML
    chat(model, 2, 4, me.PromptCache(), args.spec)  # warm-up: compiles, allocator
    runs: dict[str, list[list[float]]] = {"cache": [], "no cache": []}
    cached_tokens, prompt_tokens = None, None
    for rep in range(args.repeats):
        order = ["cache", "no cache"] if rep % 2 == 0 else ["no cache", "cache"]
        answers = {}
        for name in order:
            ttft, answers[name], cached = chat(model, args.turns, args.tokens,
                                               me.PromptCache() if name == "cache" else None, args.spec)
            runs[name].append(ttft)
            if name == "cache":
                cached_tokens = cached
        if answers["cache"] != answers["no cache"]:
            print("the answers differ with and without the cache", file=sys.stderr)
            return 1
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    # each turn's prompt length, for the table
    messages = [{"role": "system", "content": SYSTEM}]
    prompt_tokens = []
    for t in range(args.turns):
        messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        prompt_tokens.append(len(me.generate(messages=messages, model=model, max_tokens=0).prompt_token_ids))
        messages.append({"role": "assistant", "content": answers["cache"][t]})
    rows = []
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'ttft no cache ms':>17} {'ttft cache ms':>14} {'ratio':>6}")
    for t in range(args.turns):
        a = statistics.median(r[t] for r in runs["no cache"]) * 1e3
        b = statistics.median(r[t] for r in runs["cache"]) * 1e3
        rows.append({"turn": t + 1, "prompt_tokens": prompt_tokens[t], "cached_tokens": cached_tokens[t],
                     "ttft_ms_no_cache": a, "ttft_ms_cache": b, "ratio": b / a})
        print(f"{t + 1:>4} {prompt_tokens[t]:>7} {cached_tokens[t]:>7} {a:>17.1f} {b:>14.1f} {b / a:>6.3f}")
    result = {"model": Path(model.path).name, "spec": args.spec, "tokens_per_turn": args.tokens, "repeats": args.repeats,
              "machine": f"{platform.machine()} {platform.system()}", "device": str(mx.default_device()),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "turns": rows}
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return 0
        fig, ax = plt.subplots(figsize=(6, 3.5))
        turns = [r["turn"] for r in rows]
        ax.plot(turns, [r["ttft_ms_no_cache"] for r in rows], "o-", label="no prompt cache")
        ax.plot(turns, [r["ttft_ms_cache"] for r in rows], "o-", label="prompt cache")
        ax.set_xlabel("chat turn")
        ax.set_ylabel("time to first token (ms)")
        ax.set_title(f"{Path(model.path).name}, {args.spec}, {result['device']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
